//! Weights on the device.
//!
//! A [`DeviceMatrix`] is a `lily_model::weights::Matrix` (`count` × `[rows, cols]`, `y = x Wᵀ`) in
//! device memory: affine packed words exactly as stored (`[count, rows, cols*bits/32]` u32, LSB first),
//! scales and biases as bf16 (`[count, rows, cols/group]`, followed by [`SCALE_PAD`] zeros), dense
//! matrices as bf16 (`[count, rows, cols]`).
//! f16 and f32 sources are rounded to bf16 on the host (round to nearest even; MLX checkpoints already
//! store bf16, so nothing changes for them).
//!
//! [`Uploader`] stages through two pinned (page-locked) host buffers of `chunk_bytes`
//! each: while the DMA engine copies one, the host fills (or converts into) the other. Pinned memory
//! is what lets `cuMemcpyHtoDAsync` run at PCIe speed without a hidden bounce copy. Reuse one uploader
//! for a whole model: pinning 2 × 64 MiB costs milliseconds.

use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaEvent, CudaSlice, DeviceRepr, PinnedHostSlice};
use half::bf16;
use lily_model::affine::AffineParams;
use lily_model::buf::FloatBuf;
use lily_model::weights::{Matrix, Storage};

use crate::{CudaError, Device, Result};

/// How a [`DeviceMatrix`] is stored.
#[derive(Debug)]
pub enum DeviceStorage {
    Affine { params: AffineParams, packed: CudaSlice<u32>, scales: CudaSlice<bf16>, biases: CudaSlice<bf16> },
    Dense { data: CudaSlice<bf16> },
}

/// `count` matrices of `[rows, cols]` on the device.
#[derive(Debug)]
pub struct DeviceMatrix {
    pub count: usize,
    pub rows: usize,
    pub cols: usize,
    pub storage: DeviceStorage,
}

impl DeviceMatrix {
    /// Bits per weight code: 4 or 8 for affine, 16 for dense bf16.
    pub fn bits(&self) -> u32 {
        match &self.storage {
            DeviceStorage::Affine { params, .. } => params.bits,
            DeviceStorage::Dense { .. } => 16,
        }
    }
    /// Elements per scale/bias group (None for dense).
    pub fn group_size(&self) -> Option<usize> {
        match &self.storage {
            DeviceStorage::Affine { params, .. } => Some(params.group_size),
            DeviceStorage::Dense { .. } => None,
        }
    }
    /// Bytes one matrix of the stack occupies (what a GEMV over it must read).
    pub fn bytes_per_matrix(&self) -> usize {
        let n = self.rows * self.cols;
        match &self.storage {
            DeviceStorage::Affine { params, .. } => n * params.bits as usize / 8 + 2 * 2 * n / params.group_size,
            DeviceStorage::Dense { .. } => 2 * n,
        }
    }
}

/// Copies host data to the device through two pinned staging buffers.
pub struct Uploader<'d> {
    dev: &'d Device,
    bufs: [PinnedHostSlice<u8>; 2],
    /// Recorded after the copy out of the matching buffer; waited on before refilling it.
    done: [CudaEvent; 2],
    next: usize,
}

/// Extra zero elements after scales and biases on the device (so a 4-byte read of the last bf16's
/// aligned word stays inside the allocation).
pub const SCALE_PAD: usize = 8;

/// Default staging chunk: 64 MiB (two of them are pinned).
pub const DEFAULT_CHUNK_BYTES: usize = 64 << 20;

impl<'d> Uploader<'d> {
    pub fn new(dev: &'d Device) -> Result<Self> {
        Self::with_chunk_bytes(dev, DEFAULT_CHUNK_BYTES)
    }

    /// `chunk_bytes` (rounded up to 16) per staging buffer; tests use small chunks to cross boundaries.
    pub fn with_chunk_bytes(dev: &'d Device, chunk_bytes: usize) -> Result<Self> {
        let chunk = chunk_bytes.max(16).div_ceil(16) * 16;
        let ctx = dev.context();
        // SAFETY: the buffers are only written before being read, by `stage`. Plain (not write-combined)
        // pinned memory: the host copy into it measured 6.0 vs 4.8 GB/s on the H200 machine, DMA the same.
        let bufs = unsafe { [ctx.alloc_pinned_with_flags::<u8>(chunk, 0)?, ctx.alloc_pinned_with_flags::<u8>(chunk, 0)?] };
        let done = [ctx.new_event(Some(CUevent_flags::CU_EVENT_DISABLE_TIMING))?, ctx.new_event(Some(CUevent_flags::CU_EVENT_DISABLE_TIMING))?];
        // Record both once so the first wait on each returns at once.
        for e in &done {
            e.record(dev.stream())?;
        }
        Ok(Uploader { dev, bufs, done, next: 0 })
    }

    fn chunk_bytes(&self) -> usize {
        self.bufs[0].len()
    }

    /// Uploads `n` elements of `T`, produced chunk by chunk by `fill(start, dst)`, which writes
    /// `dst.len()` elements starting at element `start`.
    fn stage<T: DeviceRepr + bytemuck::Pod>(&mut self, n: usize, mut fill: impl FnMut(usize, &mut [T])) -> Result<CudaSlice<T>> {
        let stream = self.dev.stream().clone();
        // SAFETY: every element is written by the copies below before anyone reads it.
        let mut dst = unsafe { stream.alloc::<T>(n.max(1))? };
        let per_chunk = self.chunk_bytes() / std::mem::size_of::<T>();
        let mut start = 0;
        while start < n {
            let len = per_chunk.min(n - start);
            let i = self.next;
            self.next ^= 1;
            // Wait until the previous copy out of this buffer has finished, then refill it.
            self.done[i].synchronize()?;
            let bytes = self.bufs[i].as_mut_slice()?;
            let staged: &mut [T] = bytemuck::cast_slice_mut(&mut bytes[..len * std::mem::size_of::<T>()]);
            fill(start, staged);
            let mut view = dst.slice_mut(start..start + len);
            // A plain slice of pinned memory: the driver sees page-locked memory and copies asynchronously;
            // `done[i]` keeps us from overwriting it too early.
            stream.memcpy_htod(&*staged, &mut view)?;
            self.done[i].record(&stream)?;
            start += len;
        }
        Ok(dst)
    }

    /// Uploads plain values (packed words, indices, f32 vectors).
    pub fn upload<T: DeviceRepr + bytemuck::Pod>(&mut self, src: &[T]) -> Result<CudaSlice<T>> {
        self.stage(src.len(), |start, dst| dst.copy_from_slice(&src[start..start + dst.len()]))
    }

    /// Uploads floats as bf16 (bf16 sources are copied, f16/f32 rounded to nearest even).
    pub fn upload_bf16(&mut self, src: &FloatBuf) -> Result<CudaSlice<bf16>> {
        self.upload_bf16_padded(src, 0)
    }

    /// [`Self::upload_bf16`] into a buffer `pad` elements longer (the extra elements are zero).
    fn upload_bf16_padded(&mut self, src: &FloatBuf, pad: usize) -> Result<CudaSlice<bf16>> {
        let n = src.len();
        self.stage(n + pad, |start, dst| {
            let end = (start + dst.len()).min(n);
            let (real, extra) = dst.split_at_mut(end.saturating_sub(start));
            if !real.is_empty() {
                match src {
                    FloatBuf::Bf16(b) => real.copy_from_slice(&b[start..end]),
                    FloatBuf::F16(b) => real.iter_mut().zip(&b[start..end]).for_each(|(d, s)| *d = bf16::from_f32(s.to_f32())),
                    FloatBuf::F32(b) => real.iter_mut().zip(&b[start..end]).for_each(|(d, s)| *d = bf16::from_f32(*s)),
                }
            }
            extra.fill(bf16::ZERO);
        })
    }

    /// Uploads a matrix (or stack) of the model.
    pub fn upload_matrix(&mut self, m: &Matrix) -> Result<DeviceMatrix> {
        let n = m.count * m.rows * m.cols;
        let storage = match &m.storage {
            Storage::Affine { params, packed, scales, biases } => {
                if !params.is_supported() || !m.cols.is_multiple_of(params.group_size) {
                    return Err(CudaError::Shape(format!(
                        "affine matrix [{}, {}, {}] with {params:?} is not supported (bits 4/8, group 32/64/128 dividing cols)",
                        m.count, m.rows, m.cols
                    )));
                }
                let words = n * params.bits as usize / 32;
                let groups = n / params.group_size;
                if packed.len() != words || scales.len() != groups || biases.len() != groups {
                    return Err(CudaError::Shape(format!(
                        "affine matrix [{}, {}, {}] {params:?}: {} words, {} scales, {} biases (expected {words}, {groups}, {groups})",
                        m.count,
                        m.rows,
                        m.cols,
                        packed.len(),
                        scales.len(),
                        biases.len()
                    )));
                }
                DeviceStorage::Affine {
                    params: *params,
                    packed: self.upload::<u32>(packed)?,
                    // Padded: the pipelined GEMV copies the aligned 4-byte word holding each bf16.
                    scales: self.upload_bf16_padded(scales, SCALE_PAD)?,
                    biases: self.upload_bf16_padded(biases, SCALE_PAD)?,
                }
            }
            Storage::Dense(data) => {
                if data.len() != n {
                    return Err(CudaError::Shape(format!(
                        "dense matrix [{}, {}, {}] holds {} values",
                        m.count,
                        m.rows,
                        m.cols,
                        data.len()
                    )));
                }
                DeviceStorage::Dense { data: self.upload_bf16(data)? }
            }
        };
        Ok(DeviceMatrix { count: m.count, rows: m.rows, cols: m.cols, storage })
    }

    /// Whether [`Uploader::upload_concat`] takes these parts.
    pub fn can_concat(parts: &[&Matrix], rows_concat: bool) -> bool {
        let Some(first) = parts.first() else { return false };
        parts.iter().all(|m| {
            let fmt = match (&m.storage, &first.storage) {
                (Storage::Affine { params: a, .. }, Storage::Affine { params: b, .. }) => a == b,
                (Storage::Dense(_), Storage::Dense(_)) => true,
                _ => false,
            };
            fmt && m.cols == first.cols && if rows_concat { m.count == 1 } else { m.rows == first.rows }
        })
    }

    /// Uploads several matrices as one. Stacked (`rows_concat = false`): the parts' stacks one after
    /// the other (every part has the same rows; counts add up). `rows_concat = true`: one matrix whose
    /// rows are the parts' rows in order (every part a single matrix). Both are a plain concatenation of
    /// the stored data. Every part must have the same cols and the same storage format.
    pub fn upload_concat(&mut self, parts: &[&Matrix], rows_concat: bool) -> Result<DeviceMatrix> {
        let first = parts.first().ok_or_else(|| CudaError::Shape("upload_concat of no matrices".into()))?;
        let same_format = |m: &Matrix| match (&m.storage, &first.storage) {
            (Storage::Affine { params: a, .. }, Storage::Affine { params: b, .. }) => a == b,
            (Storage::Dense(_), Storage::Dense(_)) => true,
            _ => false,
        };
        for m in parts {
            let shape_ok = m.cols == first.cols && if rows_concat { m.count == 1 } else { m.rows == first.rows };
            if !shape_ok || !same_format(m) {
                return Err(CudaError::Shape(format!(
                    "upload_concat: [{}, {}, {}] does not go with [{}, {}, {}] (same cols, format and {})",
                    m.count,
                    m.rows,
                    m.cols,
                    first.count,
                    first.rows,
                    first.cols,
                    if rows_concat { "single matrices" } else { "rows" }
                )));
            }
        }
        let (count, rows) = if rows_concat {
            (1, parts.iter().map(|m| m.rows).sum())
        } else {
            (parts.iter().map(|m| m.count).sum(), first.rows)
        };
        let storage = match &first.storage {
            Storage::Affine { params, .. } => {
                let pick = |m: &Matrix| match &m.storage {
                    Storage::Affine { packed, scales, biases, .. } => (packed.clone(), scales.clone(), biases.clone()),
                    Storage::Dense(_) => unreachable!("formats checked above"),
                };
                let all: Vec<_> = parts.iter().map(|m| pick(m)).collect();
                let packed: Vec<&[u32]> = all.iter().map(|p| &p.0[..]).collect();
                let scales: Vec<&FloatBuf> = all.iter().map(|p| &p.1).collect();
                let biases: Vec<&FloatBuf> = all.iter().map(|p| &p.2).collect();
                let n_words: usize = packed.iter().map(|p| p.len()).sum();
                DeviceStorage::Affine {
                    params: *params,
                    packed: self.stage(n_words, |start, dst| concat_fill(&packed, start, dst))?,
                    scales: self.upload_bf16_concat(&scales, SCALE_PAD)?,
                    biases: self.upload_bf16_concat(&biases, SCALE_PAD)?,
                }
            }
            Storage::Dense(_) => {
                let data: Vec<&FloatBuf> = parts
                    .iter()
                    .map(|m| match &m.storage {
                        Storage::Dense(d) => d,
                        Storage::Affine { .. } => unreachable!("formats checked above"),
                    })
                    .collect();
                DeviceStorage::Dense { data: self.upload_bf16_concat(&data, 0)? }
            }
        };
        Ok(DeviceMatrix { count, rows, cols: first.cols, storage })
    }

    /// The concatenation of `srcs` as bf16, `pad` zeros after.
    fn upload_bf16_concat(&mut self, srcs: &[&FloatBuf], pad: usize) -> Result<CudaSlice<bf16>> {
        let n: usize = srcs.iter().map(|b| b.len()).sum();
        self.stage(n + pad, |start, dst| {
            let (mut off, mut w) = (0usize, 0usize);
            for src in srcs {
                let len = src.len();
                let at = start + w;
                if w < dst.len() && at < off + len {
                    let s = at - off;
                    let k = (len - s).min(dst.len() - w);
                    let out = &mut dst[w..w + k];
                    match src {
                        FloatBuf::Bf16(b) => out.copy_from_slice(&b[s..s + k]),
                        FloatBuf::F16(b) => out.iter_mut().zip(&b[s..s + k]).for_each(|(d, x)| *d = bf16::from_f32(x.to_f32())),
                        FloatBuf::F32(b) => out.iter_mut().zip(&b[s..s + k]).for_each(|(d, x)| *d = bf16::from_f32(*x)),
                    }
                    w += k;
                }
                off += len;
            }
            dst[w..].fill(bf16::ZERO);
        })
    }

    /// Waits for every copy issued so far.
    pub fn finish(self) -> Result<()> {
        for e in &self.done {
            e.synchronize()?;
        }
        Ok(())
    }
}

impl Drop for Uploader<'_> {
    fn drop(&mut self) {
        // The pinned buffers must outlive the copies out of them.
        for e in &self.done {
            let _ = e.synchronize();
        }
    }
}

/// Copies elements `start..start + dst.len()` of the concatenation of `parts` into `dst`.
fn concat_fill<T: Copy>(parts: &[&[T]], start: usize, dst: &mut [T]) {
    let (mut off, mut w) = (0usize, 0usize);
    for p in parts {
        let at = start + w;
        if w < dst.len() && at < off + p.len() {
            let s = at - off;
            let k = (p.len() - s).min(dst.len() - w);
            dst[w..w + k].copy_from_slice(&p[s..s + k]);
            w += k;
        }
        off += p.len();
    }
}

/// Uploads one matrix with a fresh uploader (convenience; loading a model should reuse one `Uploader`).
pub fn upload_matrix(dev: &Device, m: &Matrix) -> Result<DeviceMatrix> {
    let chunk = (m.count * m.rows * m.cols).clamp(1 << 16, DEFAULT_CHUNK_BYTES);
    let mut up = Uploader::with_chunk_bytes(dev, chunk)?;
    let d = up.upload_matrix(m)?;
    up.finish()?;
    Ok(d)
}
