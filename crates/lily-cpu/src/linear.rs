//! Matrix products on stored weights, `y = x Wᵀ`, for any [`Matrix`] storage. Quantised rows are
//! expanded one at a time into a per-thread scratch row (never the whole matrix), then dotted with
//! every activation row, so a row's weights are read once per call however many tokens there are.
//! Work is split over output rows with rayon.

use lily_model::affine::AffineParams;
use lily_model::weights::{Matrix, Storage};
use rayon::prelude::*;

/// Rows of W handled by one rayon task.
const ROWS_PER_TASK: usize = 16;

/// Expands row `r` of matrix `m` of the stack into `out` (len = cols).
pub fn dequantize_row(w: &Matrix, m: usize, r: usize, out: &mut [f32]) {
    let cols = w.cols;
    let row = m * w.rows + r;
    match &w.storage {
        Storage::Dense(data) => data.read_into(row * cols, out),
        Storage::Affine { params, packed, scales, biases } => {
            let AffineParams { bits, group_size } = *params;
            let words = cols * bits as usize / 32;
            let groups = cols / group_size;
            let packed = &packed[row * words..(row + 1) * words];
            let per_word = (32 / bits) as usize;
            let mask = (1u32 << bits) - 1;
            for g in 0..groups {
                let s = scales.get(row * groups + g);
                let b = biases.get(row * groups + g);
                let wstart = g * group_size / per_word;
                let dst = &mut out[g * group_size..(g + 1) * group_size];
                for (wi, chunk) in dst.chunks_exact_mut(per_word).enumerate() {
                    let mut word = packed[wstart + wi];
                    for o in chunk {
                        *o = s * (word & mask) as f32 + b;
                        word >>= bits;
                    }
                }
            }
        }
    }
}

#[inline]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    // Eight independent accumulators: vectorisable, and a fixed summation order.
    let mut acc = [0.0f32; 8];
    let (ac, ar) = a.split_at(a.len() / 8 * 8);
    let (bc, br) = b.split_at(ac.len());
    for (x, y) in ac.chunks_exact(8).zip(bc.chunks_exact(8)) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    let mut s = (acc[0] + acc[4]) + (acc[1] + acc[5]) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for (x, y) in ar.iter().zip(br) {
        s += x * y;
    }
    s
}

/// `y[t, r] = Σ_c x[t, c] · W_m[r, c]`. x: [T, cols], y: [T, rows].
pub fn matmul(w: &Matrix, m: usize, x: &[f32], y: &mut [f32]) {
    let (rows, cols) = (w.rows, w.cols);
    let t = x.len() / cols;
    debug_assert_eq!(x.len(), t * cols);
    debug_assert_eq!(y.len(), t * rows);
    if t == 0 {
        return;
    }
    // Computed transposed ([rows, T]) so that each task owns a contiguous block of the output.
    let mut yt = vec![0.0f32; rows * t];
    yt.par_chunks_mut(ROWS_PER_TASK * t).enumerate().for_each_init(
        || vec![0.0f32; cols],
        |scratch, (task, out)| {
            for (i, out_row) in out.chunks_exact_mut(t).enumerate() {
                let r = task * ROWS_PER_TASK + i;
                dequantize_row(w, m, r, scratch);
                for (ti, o) in out_row.iter_mut().enumerate() {
                    *o = dot(scratch, &x[ti * cols..(ti + 1) * cols]);
                }
            }
        },
    );
    for ti in 0..t {
        for r in 0..rows {
            y[ti * rows + r] = yt[r * t + ti];
        }
    }
}

/// Convenience: a fresh `[T, rows]` result.
pub fn matmul_new(w: &Matrix, m: usize, x: &[f32]) -> Vec<f32> {
    let t = x.len() / w.cols;
    let mut y = vec![0.0; t * w.rows];
    matmul(w, m, x, &mut y);
    y
}

/// Embedding lookup: row `id` of the (possibly quantised) table.
pub fn embed_row(w: &Matrix, id: usize, out: &mut [f32]) {
    dequantize_row(w, 0, id, out);
}
