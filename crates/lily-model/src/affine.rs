//! MLX's affine quantisation format, and a quantiser that is bit-exact with `mx.quantize` on the CPU.
//!
//! Layout (one row of `cols` elements, `cols % group_size == 0`):
//! - `packed`: `cols * bits / 32` u32 words; element `j` sits in word `j * bits / 32` at bits
//!   `[(j % per_word) * bits, … + bits)` (LSB first).
//! - `scales`, `biases`: one per group of `group_size` contiguous elements; `w ≈ scale * q + bias`.
//!
//! The quantiser follows MLX's CPU kernel (`mlx/backend/cpu/quantized.cpp`, `quantize<T, U>`, mlx 0.32),
//! which is what `mlx_lm.convert` runs. Every intermediate is f32, and the order of operations matters:
//! ```text
//! max, min  = over the group, in f32 (bf16 inputs widen exactly)
//! scale     = max((max - min) / n_bins, 1e-7)        n_bins = 2^bits - 1
//! mask      = |min| > |max|
//! scale     = mask ? scale : -scale                  (the larger-magnitude edge gets code 0)
//! edge      = mask ? min : max
//! q0        = rint(edge / scale)                     (round half to even)
//! if q0 != 0 { scale = edge / q0; bias = edge } else { bias = 0 }
//! q         = clamp(rint((w - bias) / scale), 0, n_bins)     with the f32 scale, not the bf16 one
//! stored    = bf16(scale), bf16(bias)                (round to nearest even)
//! ```
//! Note the codes are computed with the f32 `scale`/`bias`, so dequantising with the stored bf16
//! values is not exactly what the quantiser "intended"; being bit-exact means reproducing that.

use half::bf16;
use rayon::prelude::*;

/// Bits per code and elements per group.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AffineParams {
    pub bits: u32,
    pub group_size: usize,
}

impl AffineParams {
    pub const fn new(bits: u32, group_size: usize) -> Self {
        AffineParams { bits, group_size }
    }
    /// Codes per u32 word.
    pub const fn per_word(&self) -> usize {
        32 / self.bits as usize
    }
    /// u32 words holding one row of `cols` elements.
    pub const fn words_per_row(&self, cols: usize) -> usize {
        cols * self.bits as usize / 32
    }
    /// Groups (scales, biases) in one row of `cols` elements.
    pub const fn groups_per_row(&self, cols: usize) -> usize {
        cols / self.group_size
    }
    /// Largest code, `2^bits - 1`.
    pub const fn max_code(&self) -> u32 {
        (1u32 << self.bits) - 1
    }
    /// Whether MLX supports these parameters (bits 4 or 8 here; group 32, 64 or 128).
    pub fn is_supported(&self) -> bool {
        matches!(self.bits, 4 | 8) && matches!(self.group_size, 32 | 64 | 128)
    }
    /// Whether a row of `cols` elements can be quantised (MLX leaves such modules in bf16 otherwise).
    pub fn fits(&self, cols: usize) -> bool {
        cols > 0 && cols.is_multiple_of(self.group_size)
    }
}

/// An affine-quantised matrix: `rows` rows of `words_per_row` words and `groups_per_row` scales/biases.
#[derive(Clone, Debug, PartialEq)]
pub struct Quantized {
    pub packed: Vec<u32>,
    pub scales: Vec<bf16>,
    pub biases: Vec<bf16>,
}

/// Quantises row-major bf16 rows of length `cols` exactly as `mx.quantize(w_bf16, group_size, bits)`
/// does on the CPU (mlx 0.32.4): same u32 words, same bf16 scales and biases, bit for bit.
/// Parallel over rows.
///
/// Panics if `cols` is not a positive multiple of `group_size`, `w.len()` is not a multiple of
/// `cols`, or the parameters are not supported.
pub fn quantize_bf16(w: &[bf16], cols: usize, p: AffineParams) -> Quantized {
    assert!(p.is_supported(), "unsupported affine parameters {p:?}");
    assert!(p.fits(cols), "row length {cols} is not a multiple of group size {}", p.group_size);
    assert_eq!(w.len() % cols, 0, "{} elements do not form rows of {cols}", w.len());
    let rows = w.len() / cols;
    let wpr = p.words_per_row(cols);
    let gpr = p.groups_per_row(cols);
    let mut packed = vec![0u32; rows * wpr];
    let mut scales = vec![bf16::ZERO; rows * gpr];
    let mut biases = vec![bf16::ZERO; rows * gpr];
    // Rows are independent; batch a few per task so small rows do not drown in scheduling.
    let rows_per_task = (16384 / cols).max(1);
    packed
        .par_chunks_mut(wpr * rows_per_task)
        .zip(scales.par_chunks_mut(gpr * rows_per_task))
        .zip(biases.par_chunks_mut(gpr * rows_per_task))
        .zip(w.par_chunks(cols * rows_per_task))
        .for_each(|(((pk, sc), bi), wr)| {
            let n = wr.len() / cols;
            for r in 0..n {
                quantize_row(
                    &wr[r * cols..(r + 1) * cols],
                    p,
                    &mut pk[r * wpr..(r + 1) * wpr],
                    &mut sc[r * gpr..(r + 1) * gpr],
                    &mut bi[r * gpr..(r + 1) * gpr],
                );
            }
        });
    Quantized { packed, scales, biases }
}

/// Quantises one row (`w.len()` a multiple of the group size) into its words, scales and biases.
pub fn quantize_row(w: &[bf16], p: AffineParams, packed: &mut [u32], scales: &mut [bf16], biases: &mut [bf16]) {
    let gs = p.group_size;
    let per_word = p.per_word();
    let bits = p.bits;
    let n_bins = p.max_code() as f32;
    let eps = 1e-7f32;
    let mut wf = [0f32; 128];
    for (g, group) in w.chunks_exact(gs).enumerate() {
        let wf = &mut wf[..gs];
        for (d, s) in wf.iter_mut().zip(group) {
            *d = s.to_f32();
        }
        let mut w_max = f32::NEG_INFINITY;
        let mut w_min = f32::INFINITY;
        for &x in wf.iter() {
            // std::max/std::min semantics: NaN inputs are ignored only when they come second.
            w_max = if w_max < x { x } else { w_max };
            w_min = if x < w_min { x } else { w_min };
        }
        let mask = w_min.abs() > w_max.abs();
        let mut scale = {
            let s = (w_max - w_min) / n_bins;
            if s < eps {
                eps
            } else {
                s
            }
        };
        if !mask {
            scale = -scale;
        }
        let edge = if mask { w_min } else { w_max };
        let q0 = (edge / scale).round_ties_even();
        let mut bias = 0f32;
        if q0 != 0.0 {
            scale = edge / q0;
            bias = edge;
        }
        // Codes: rint((w - bias) / scale) clamped to [0, n_bins]. Clamping to [-1, n_bins + 1] first
        // does not change the result and lets rint be the exact "add and subtract 1.5·2^23"
        // (round half to even in the default rounding mode), so the loop vectorises; NaN → 0 as
        // MLX's cast does on x86.
        let mut q = [0u32; 128];
        for (d, &x) in q[..gs].iter_mut().zip(wf.iter()) {
            let v = (x - bias) / scale;
            let v = if v >= -1.0 { v } else { -1.0 }; // also NaN → -1 → code 0
            let v = if v <= n_bins + 1.0 { v } else { n_bins + 1.0 };
            let r = (v + 12_582_912.0) - 12_582_912.0;
            let r = if r < 0.0 { 0.0 } else { r };
            let r = if r > n_bins { n_bins } else { r };
            *d = r as u32;
        }
        let words = &mut packed[g * gs / per_word..(g + 1) * gs / per_word];
        for (word, els) in words.iter_mut().zip(q[..gs].chunks_exact(per_word)) {
            let mut out = 0u32;
            for (k, &c) in els.iter().enumerate() {
                out |= c << (k as u32 * bits);
            }
            *word = out;
        }
        scales[g] = bf16::from_f32(scale);
        biases[g] = bf16::from_f32(bias);
    }
}

/// Dequantises one row (its packed words, f32 scales and biases) into `out` (`out.len()` = cols):
/// `out[j] = scales[j / group_size] * q[j] + biases[j / group_size]` in f32.
pub fn dequantize_row(packed: &[u32], scales: &[f32], biases: &[f32], p: AffineParams, out: &mut [f32]) {
    let gs = p.group_size;
    let per_word = p.per_word();
    let mask = p.max_code();
    debug_assert!(packed.len() * per_word >= out.len());
    debug_assert!(scales.len() * gs >= out.len() && biases.len() * gs >= out.len());
    for (g, o) in out.chunks_mut(gs).enumerate() {
        let (s, b) = (scales[g], biases[g]);
        let words = &packed[g * gs / per_word..];
        for (wi, oc) in o.chunks_mut(per_word).enumerate() {
            let mut word = words[wi];
            for v in oc.iter_mut() {
                *v = s * (word & mask) as f32 + b;
                word >>= p.bits;
            }
        }
    }
}

/// Dequantises one row with bf16 scales and biases (as stored in a checkpoint).
pub fn dequantize_row_bf16(packed: &[u32], scales: &[bf16], biases: &[bf16], p: AffineParams, out: &mut [f32]) {
    let gs = p.group_size;
    let per_word = p.per_word();
    let mask = p.max_code();
    for (g, o) in out.chunks_mut(gs).enumerate() {
        let (s, b) = (scales[g].to_f32(), biases[g].to_f32());
        let words = &packed[g * gs / per_word..];
        for (wi, oc) in o.chunks_mut(per_word).enumerate() {
            let mut word = words[wi];
            for v in oc.iter_mut() {
                *v = s * (word & mask) as f32 + b;
                word >>= p.bits;
            }
        }
    }
}

/// Code `j` of a packed row.
#[inline]
pub fn code(packed: &[u32], j: usize, bits: u32) -> u32 {
    let per_word = 32 / bits as usize;
    (packed[j / per_word] >> ((j % per_word) as u32 * bits)) & ((1u32 << bits) - 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pack_order_is_lsb_first() {
        let p = AffineParams::new(4, 32);
        // A group 0..15 twice: min 0 → with |min| !> |max|, scale is negative and code 0 = max.
        let w: Vec<bf16> = (0..32).map(|i| bf16::from_f32((i % 16) as f32)).collect();
        let q = quantize_bf16(&w, 32, p);
        assert_eq!(q.scales[0].to_f32(), -1.0);
        assert_eq!(q.biases[0].to_f32(), 15.0);
        for j in 0..32 {
            assert_eq!(code(&q.packed, j, 4), 15 - (j as u32 % 16));
        }
        assert_eq!(q.packed[0], 0x89ab_cdef);
        let mut out = vec![0.0; 32];
        dequantize_row_bf16(&q.packed, &q.scales, &q.biases, p, &mut out);
        for (j, &x) in out.iter().enumerate() {
            assert_eq!(x, (j % 16) as f32);
        }
    }

    #[test]
    fn zero_row() {
        let p = AffineParams::new(8, 64);
        let q = quantize_bf16(&vec![bf16::ZERO; 128], 128, p);
        assert!(q.packed.iter().all(|&w| w == 0));
        assert!(q.biases.iter().all(|b| b.to_f32() == 0.0));
        assert!(q.scales.iter().all(|s| s.to_f32() == bf16::from_f32(-1e-7).to_f32()));
    }
}
