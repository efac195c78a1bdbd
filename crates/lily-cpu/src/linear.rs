//! Matrix products on stored weights, `y = x Wᵀ`, for any [`Matrix`] storage, split over the cores
//! when the work pays for it. One token (decode) runs the fused kernel that expands each weight in
//! registers and never stores a row; several tokens expand a block of rows at a time and run a
//! register tile of rows × tokens over it, so a row's weights are expanded once per call (per
//! token block) however many tokens there are. The kernels, and the fixed order in which every
//! output element is summed (the same on every path, so results do not depend on T or on the
//! split), are in [`crate::kernels`].

use lily_model::weights::Matrix;
use rayon::prelude::*;

use crate::kernels::{self, Isa};
use crate::workspace::Buf;

/// Multiply-adds below which a product runs on the calling thread (a split costs more than it
/// saves below this).
const PAR_MIN_WORK: usize = 1 << 18;
/// Tasks per thread when a product is split (slack for a core taken by another process).
const TASKS_PER_THREAD: usize = 4;
/// Tokens per task below which a many-token product is split by rows rather than by tokens.
const MIN_TOKENS_PER_TASK: usize = 32;

/// Expands row `r` of matrix `m` of the stack into `out` (len = cols).
pub fn dequantize_row(w: &Matrix, m: usize, r: usize, out: &mut [f32]) {
    kernels::expand_row(Isa::best(), w, m, r, out);
}

/// `y[t, r] = Σ_c x[t, c] · W_m[r, c]`. x: [T, cols], y: [T, rows].
pub fn matmul(w: &Matrix, m: usize, x: &[f32], y: &mut [f32]) {
    matmul_with(Isa::best(), w, m, x, y)
}

/// [`matmul`] with a chosen compilation of the kernels (the tests compare them).
pub fn matmul_with(isa: Isa, w: &Matrix, m: usize, x: &[f32], y: &mut [f32]) {
    let (rows, cols) = (w.rows, w.cols);
    let t = x.len() / cols;
    assert_eq!(x.len(), t * cols, "matmul: x is not [T, {cols}]");
    assert_eq!(y.len(), t * rows, "matmul: y is not [{t}, {rows}]");
    assert!(m < w.count, "matmul: matrix {m} of a stack of {}", w.count);
    if t == 0 {
        return;
    }
    let threads = rayon::current_num_threads();
    let tasks = threads * TASKS_PER_THREAD;
    if threads == 1 || rows * cols * t < PAR_MIN_WORK {
        let mut scratch = Vec::new();
        if t == 1 {
            kernels::gemv_rows(isa, w, m, 0, x, y, &mut scratch);
        } else {
            kernels::gemm_rows(isa, w, m, 0, rows, x, y, &mut scratch);
        }
    } else if t == 1 {
        // Over blocks of output rows (a multiple of 8, the kernels' row groups).
        let chunk = rows.div_ceil(tasks).next_multiple_of(8);
        y.par_chunks_mut(chunk)
            .enumerate()
            .for_each_init(Vec::new, |s, (i, out)| kernels::gemv_rows(isa, w, m, i * chunk, x, out, s));
    } else if t >= tasks * MIN_TOKENS_PER_TASK {
        // Over blocks of tokens: each task expands every row once for its tokens, so fewer, larger
        // blocks (two per thread) than for the splits by rows.
        let tb = t.div_ceil(2 * threads);
        y.par_chunks_mut(tb * rows)
            .zip(x.par_chunks(tb * cols))
            .for_each_init(Vec::new, |s, (out, xb)| kernels::gemm_rows(isa, w, m, 0, rows, xb, out, s));
    } else {
        // Over blocks of rows: each task computes [T, its rows], then they are put in place.
        let chunk = rows.div_ceil(tasks).max(1);
        let parts: Vec<(usize, Vec<f32>)> = (0..rows.div_ceil(chunk))
            .into_par_iter()
            .map_init(Vec::new, |s, i| {
                let (r0, nr) = (i * chunk, chunk.min(rows - i * chunk));
                let mut out = vec![0.0f32; t * nr];
                kernels::gemm_rows(isa, w, m, r0, nr, x, &mut out, s);
                (r0, out)
            })
            .collect();
        for (r0, part) in parts {
            let nr = part.len() / t;
            for (yt, pt) in y.chunks_exact_mut(rows).zip(part.chunks_exact(nr)) {
                yt[r0..r0 + nr].copy_from_slice(pt);
            }
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

/// A `[T, rows]` result in a reused buffer (see [`crate::workspace`]).
pub fn matmul_buf(w: &Matrix, m: usize, x: &[f32]) -> Buf {
    let t = x.len() / w.cols;
    // Every element is written by the product.
    let mut y = Buf::for_output(t * w.rows);
    matmul(w, m, x, &mut y);
    y
}

/// Embedding lookup: row `id` of the (possibly quantised) table.
pub fn embed_row(w: &Matrix, id: usize, out: &mut [f32]) {
    dequantize_row(w, 0, id, out);
}
