//! Token choice on the device (`kernels/sample.cu`): the same token as
//! [`lily_sampler::pick_on_cpu`] for the same logits and [`DevicePick`], with only the id written (to
//! a 1-element device buffer the caller downloads when it needs it; nothing here synchronises).
//!
//! The penalties and bias are applied to a copy of the logits in the scratch (never to `logits`).
//! Greedy is the argmax (one kernel); top-k a three-pass radix select of the k best, then one block
//! sorts them and walks them; everything else the CPU's bucket histogram for top-p (integer masses,
//! the f64 chain over them, the edge bucket's cut by a weighted radix select) and its blocked
//! inverse-CDF draw. Kernels per call: greedy 1, temperature / min-p 2, top-p 4, top-k 4.
//!
//! Where could the GPU and the CPU differ? Every f64 sum that decides the token is the CPU's sum: the
//! same operands, added in the same order, each add rounded to nearest (`__dadd_rn`, no fused
//! multiply-add, no flush to zero on either side). The orders the GPU does change are provably
//! order-free: a bucket's mass (its weights share one exponent, so every partial sum is exact), the
//! walk inside the edge bucket when it is exact in integers (checked per call; otherwise the CPU's
//! sequential walk runs), and the top-k set (a selection, not a sum). So a `u` at an exact CDF
//! boundary gives the same token on both (`tests/gpu_sample.rs` tests exactly that); a difference
//! would be a bug. The coupling is to `lily_sampler::ops` as written: its lane count in `sum_f64`,
//! its draw block of 1024, its bucket scheme and its walk orders are mirrored here, and a change there
//! needs the same change in the kernel.
//!
//! Edits go up through a small ring of pinned staging buffers; the host waits only when more than
//! eight picks with edits are queued without a token being downloaded in between.

use cudarc::driver::{CudaEvent, CudaSlice, DevicePtr, DevicePtrMut, DeviceRepr, LaunchConfig, PinnedHostSlice};
use lily_sampler::DevicePick;

use super::{addr, addr_mut, launch};
use crate::{CudaError, Device, Result};

/// The largest vocabulary [`pick`] handles.
pub const MAX_VOCAB: usize = 1 << 19;

/// Tokens per block of most kernels; must match `PREP_TILE` in the kernel.
const PREP_TILE: usize = 2048;
/// Tokens per block of the draw (`ops::draw_weights`' block); must match `DRAW_BLOCK`.
const DRAW_BLOCK: usize = 1024;
/// Threads per block; must match `NT`.
const NT: u32 = 1024;
/// Words (u32) at the start of the scratch that must be zero between calls: the state (ticket, list
/// counter) and the histogram.
const CTRL_WORDS: usize = 64 + 2 * 2048;

const MODE_GREEDY: i32 = 0;
const MODE_FULL: i32 = 1;
const MODE_TOPK: i32 = 2;

/// Must match `struct SampleParams` in `kernels/sample.cu`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct SampleParams {
    logits: u64,
    edits: u64,
    out: u64,
    x: u64,
    st: u64,
    hist: u64,
    bmax: u64,
    bidx: u64,
    bsum: u64,
    list: u64,
    wts: u64,
    sortbuf: u64,
    aux: u64,
    u: f64,
    vocab: i32,
    nb_prep: i32,
    nb_draw: i32,
    n_edits: i32,
    mode: i32,
    pass: i32,
    top_k: u32,
    temperature: f32,
    top_p: f32,
    min_p: f32,
    mask: u64,
}
// SAFETY: plain old data with the kernel's layout.
unsafe impl DeviceRepr for SampleParams {}

pub(crate) const KERNELS: &[&str] = &[
    "sample_prep",
    "sample_topk_pass",
    "sample_topk_gather",
    "sample_nucleus_hist",
    "sample_nucleus_cut",
    "sample_draw",
    "sample_mask_fix",
];

/// Where each part of the scratch lives, in 4-byte words from its start.
struct Layout {
    st: usize,
    hist: usize,
    bmax: usize,
    bidx: usize,
    bsum: usize,
    x: usize,
    list: usize,
    wts: usize,
    sortbuf: usize,
    aux: usize,
    total: usize,
}

fn layout(vocab: usize) -> Layout {
    let nbp = vocab.div_ceil(PREP_TILE);
    let nbd = vocab.div_ceil(DRAW_BLOCK);
    let mut at = 0usize;
    let mut take = |words: usize| {
        let here = at;
        at = (at + words).next_multiple_of(64); // 256-byte aligned regions
        here
    };
    let st = take(64);
    let hist = take(2 * 2048);
    debug_assert_eq!(hist + 2 * 2048, CTRL_WORDS);
    Layout {
        st,
        hist,
        bmax: take(nbp),
        bidx: take(nbp),
        bsum: take(2 * nbd),
        x: take(vocab),
        list: take(2 * vocab),
        wts: take(vocab),
        sortbuf: take(2 * vocab.next_power_of_two()),
        aux: take(2 * vocab),
        total: at,
    }
}

/// f32 elements of scratch that [`pick`] needs for a vocabulary of `vocab` (about 32 bytes per
/// token: 8 MB at 248,320). Allocate it zeroed ([`Device::zeros`]), once, and pass it to every call
/// for that vocabulary or a smaller one.
pub fn scratch_len(vocab: usize) -> usize {
    layout(vocab.max(1)).total
}

/// Pinned staging buffers in the ring (picks that may be queued without the host waiting).
const RING: usize = 8;

/// The edits' way to the device: a ring of pinned host staging buffers and one device buffer, grown
/// as needed (one per caller; reused across calls). Also remembers whether a call failed half-way,
/// so that the next call resets the scratch's counters first.
pub struct EditBuffer {
    /// Each with the event recorded after the last copy out of it (waited on before it is rewritten:
    /// only when more than `RING` picks with edits are queued without the host downloading a token).
    staging: Vec<(PinnedHostSlice<u32>, CudaEvent)>,
    next: usize,
    /// Read by the kernels in stream order, after the copy that precedes them.
    device: CudaSlice<u32>,
    cap: usize,
    reset_pending: bool,
}

impl EditBuffer {
    /// Room for about a thousand edits; grows when a pick has more.
    pub fn new(dev: &Device) -> Result<Self> {
        Self::with_capacity(dev, 4096)
    }

    fn with_capacity(dev: &Device, words: usize) -> Result<Self> {
        let mut staging = Vec::with_capacity(RING);
        for _ in 0..RING {
            // SAFETY: a staging buffer is written before any copy reads it.
            let host = unsafe { dev.context().alloc_pinned::<u32>(words) }?;
            staging.push((host, dev.context().new_event(None)?));
        }
        let device = dev.zeros::<u32>(words)?;
        Ok(EditBuffer { staging, next: 0, device, cap: words, reset_pending: false })
    }

    fn wait_all(&self) -> Result<()> {
        for (_, ev) in &self.staging {
            ev.synchronize()?;
        }
        Ok(())
    }

    /// Copies the per-block offsets and the edits to the device; returns the device address.
    fn upload(&mut self, dev: &Device, pick: &DevicePick, nb_prep: usize) -> Result<u64> {
        let words = nb_prep + 1 + 4 * pick.edits.len();
        if words > self.cap {
            self.wait_all()?;
            let reset_pending = self.reset_pending;
            *self = Self::with_capacity(dev, words.next_power_of_two())?;
            self.reset_pending = reset_pending;
        }
        let (host, copied) = &mut self.staging[self.next];
        self.next = (self.next + 1) % RING;
        copied.synchronize()?;
        let host = host.as_mut_slice()?;
        let (offsets, body) = host[..words].split_at_mut(nb_prep + 1);
        let mut k = 0usize;
        for (b, o) in offsets.iter_mut().enumerate() {
            let start = b * PREP_TILE;
            while k < pick.edits.len() && (pick.edits[k].id as usize) < start {
                k += 1;
            }
            *o = k as u32;
        }
        for (w, e) in body.chunks_exact_mut(4).zip(&pick.edits) {
            w.copy_from_slice(&[e.id, e.rep.to_bits(), e.sub.to_bits(), e.bias.to_bits()]);
        }
        let stream = dev.stream();
        let (dst, _g) = self.device.device_ptr_mut(stream);
        dev.context().bind_to_thread()?;
        // SAFETY: `dst` holds at least `words` u32; the pinned source stays untouched until `copied`
        // (recorded right after) has passed.
        unsafe { cudarc::driver::result::memcpy_htod_async(dst, &host[..words], stream.cu_stream()) }?;
        copied.record(stream)?;
        Ok(dst)
    }
}

impl Drop for EditBuffer {
    fn drop(&mut self) {
        // The pinned memory must outlive the copies out of it.
        let _ = self.wait_all();
    }
}

/// Chooses the next token from `logits` [≥ `pick.vocab`] f32 as `pick` says (the same token as
/// [`lily_sampler::pick_on_cpu`]), writing its id to `out[0]`. The edits are applied to a copy in
/// `scratch` (never to `logits`); `scratch` holds at least [`scratch_len`]`(pick.vocab)` f32 and was
/// allocated zeroed (the calls keep their counters zero between calls). Needs 1 ≤ vocab ≤
/// [`MAX_VOCAB`], edits sorted by id with ids below vocab, and valid parameters (temperature finite
/// and ≥ 0, top_p in (0, 1], min_p in [0, 1], u in [0, 1)). No host synchronisation: the caller
/// downloads `out` when it needs the id.
///
/// Kernels: greedy 1; temperature / min-p 2; top-p 4; top-k 4 (see `kernels/sample.cu`).
pub fn pick<L: DevicePtr<f32>, S: DevicePtrMut<f32>, O: DevicePtrMut<u32>>(
    dev: &Device,
    logits: &L,
    pick: &DevicePick,
    edits: &mut EditBuffer,
    scratch: &mut S,
    out: &mut O,
) -> Result<()> {
    pick_masked(dev, logits, pick, None::<&CudaSlice<u32>>, edits, scratch, out)
}

/// [`pick`] under a token mask (constrained decoding): `mask` holds `pick.vocab.div_ceil(32)` words,
/// bit `id % 32` of word `id / 32` set when token `id` is allowed. After the edits every disallowed
/// logit is `-inf`; the choice is then `lily_sampler::pick_on_cpu_masked`'s (the lowest allowed id
/// when the chain's choice is not allowed, as when every allowed logit is `-inf`).
pub fn pick_masked<L: DevicePtr<f32>, M: DevicePtr<u32>, S: DevicePtrMut<f32>, O: DevicePtrMut<u32>>(
    dev: &Device,
    logits: &L,
    pick: &DevicePick,
    mask: Option<&M>,
    edits: &mut EditBuffer,
    scratch: &mut S,
    out: &mut O,
) -> Result<()> {
    let n = pick.vocab;
    let p = &pick.params;
    if n == 0 || n > MAX_VOCAB {
        return Err(CudaError::Shape(format!("pick: vocabulary of {n} (1 to {MAX_VOCAB})")));
    }
    let in_range = p.temperature.is_finite()
        && p.temperature >= 0.0
        && p.top_p > 0.0
        && p.top_p <= 1.0
        && (0.0..=1.0).contains(&p.min_p)
        && (0.0..1.0).contains(&pick.u);
    if !in_range {
        return Err(CudaError::Shape(format!(
            "pick: temperature {} top_p {} min_p {} u {} out of range",
            p.temperature, p.top_p, p.min_p, pick.u
        )));
    }
    if let Some(w) = pick.edits.windows(2).find(|w| w[0].id >= w[1].id) {
        return Err(CudaError::Shape(format!("pick: edits not sorted by id ({} then {})", w[0].id, w[1].id)));
    }
    if let Some(e) = pick.edits.last().filter(|e| e.id as usize >= n) {
        return Err(CudaError::Shape(format!("pick: edit of token {} in a vocabulary of {n}", e.id)));
    }
    let mask = match mask {
        Some(m) => addr(dev, m, n.div_ceil(32), "pick mask")?,
        None => 0,
    };
    let lay = layout(n);
    let base = addr_mut(dev, scratch, lay.total, "pick scratch")?;
    let logits = addr(dev, logits, n, "pick logits")?;
    let out = addr_mut(dev, out, 1, "pick out")?;
    let nb_prep = n.div_ceil(PREP_TILE);
    let nb_draw = n.div_ceil(DRAW_BLOCK);

    if edits.reset_pending {
        dev.context().bind_to_thread()?;
        // SAFETY: the scratch holds at least CTRL_WORDS words (lay.total is larger).
        unsafe { cudarc::driver::result::memset_d8_async(base, 0, 4 * CTRL_WORDS, dev.stream().cu_stream()) }?;
    }
    edits.reset_pending = true; // until every launch below has gone
    let edits_addr = if pick.edits.is_empty() { 0 } else { edits.upload(dev, pick, nb_prep)? };

    let mode = if p.is_greedy() {
        MODE_GREEDY
    } else if p.top_k > 0 && (p.top_k as usize) < n {
        MODE_TOPK
    } else {
        MODE_FULL
    };
    let w = |off: usize| base + 4 * off as u64;
    let mut prm = SampleParams {
        logits,
        edits: edits_addr,
        out,
        x: w(lay.x),
        st: w(lay.st),
        hist: w(lay.hist),
        bmax: w(lay.bmax),
        bidx: w(lay.bidx),
        bsum: w(lay.bsum),
        list: w(lay.list),
        wts: w(lay.wts),
        sortbuf: w(lay.sortbuf),
        aux: w(lay.aux),
        u: pick.u,
        vocab: n as i32,
        nb_prep: nb_prep as i32,
        nb_draw: nb_draw as i32,
        n_edits: pick.edits.len() as i32,
        mode,
        pass: 0,
        top_k: p.top_k,
        temperature: p.temperature,
        top_p: p.top_p,
        min_p: p.min_p,
        mask,
    };
    let grid =
        |blocks: usize| LaunchConfig { grid_dim: (blocks as u32, 1, 1), block_dim: (NT, 1, 1), shared_mem_bytes: 0 };
    launch(dev, "sample_prep", grid(nb_prep), &prm)?;
    match mode {
        MODE_GREEDY => {}
        MODE_TOPK => {
            for pass in [1, 2] {
                prm.pass = pass;
                launch(dev, "sample_topk_pass", grid(nb_prep), &prm)?;
            }
            launch(dev, "sample_topk_gather", grid(nb_prep), &prm)?;
        }
        _ => {
            if p.top_p < 1.0 {
                launch(dev, "sample_nucleus_hist", grid(nb_prep), &prm)?;
                launch(dev, "sample_nucleus_cut", grid(nb_prep), &prm)?;
            }
            launch(dev, "sample_draw", grid(nb_draw), &prm)?;
        }
    }
    if mask != 0 {
        launch(dev, "sample_mask_fix", grid(1), &prm)?;
    }
    edits.reset_pending = false;
    Ok(())
}
