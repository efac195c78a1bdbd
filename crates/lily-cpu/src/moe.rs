//! The sparse MoE block: router softmax over all experts (f32), top-k, renormalise; SwiGLU experts
//! run on the tokens routed to them; plus the sigmoid-gated shared expert. Also the dense SwiGLU
//! MLP (the shared expert, or the MLP of a dense model of the family).

use lily_model::weights::{DenseMlpWeights, MoeWeights};
use lily_model::ModelConfig;

use crate::linear::{matmul, matmul_buf};
use crate::workspace::Buf;
use crate::norm::{sigmoid, silu};

/// `down(silu(gate(x)) · up(x))` for matrix `m` of the stacks. x: [T, H] → [T, H].
fn swiglu(gate: &lily_model::weights::Matrix, up: &lily_model::weights::Matrix, down: &lily_model::weights::Matrix, m: usize, x: &[f32]) -> Buf {
    let mut g = matmul_buf(gate, m, x); // [T, I]
    let u = matmul_buf(up, m, x); // [T, I]
    for (a, b) in g.iter_mut().zip(u.iter()) {
        *a = silu(*a) * b;
    }
    matmul_buf(down, m, &g) // [T, H]
}

pub fn dense_mlp(w: &DenseMlpWeights, x: &[f32]) -> Buf {
    swiglu(&w.gate_proj, &w.up_proj, &w.down_proj, 0, x)
}

/// Per token: the chosen experts and their weights. logits: [T, E].
///
/// The weights are the softmax over all E experts of the chosen ones, p_i = e^(l_i − m) / Σ_j
/// e^(l_j − m) (m the largest logit), and the k chosen are the k largest p, ties to the lower index.
/// With `renormalise` (the model's `norm_topk_prob`) each is divided by the chosen ones' sum, where
/// the softmax's denominator cancels: w_i = e^(l_i − m) / Σ_{chosen j} e^(l_j − m), and the k
/// largest p are the k largest logits. So that form computes k exponentials, not E, and picks by
/// logit (f32 total order, ties to the lower index; the same picks as by p except where distinct
/// logits round to equal probabilities, e.g. both underflowing to 0, where the larger logit wins);
/// the chosen exponentials are summed in pick order. The CUDA kernels (`route.cuh`) follow both
/// forms bit for bit.
pub fn route(logits: &[f32], e: usize, k: usize, renormalise: bool) -> Vec<Vec<(usize, f32)>> {
    logits
        .chunks_exact(e)
        .map(|row| {
            let mut idx: Vec<usize> = (0..e).collect();
            if renormalise {
                // Largest logit first; ties to the lower index.
                idx.sort_by(|&a, &b| row[b].total_cmp(&row[a]).then(a.cmp(&b)));
                idx.truncate(k);
                let m = row[idx[0]];
                let ex: Vec<f32> = idx.iter().map(|&i| (row[i] - m).exp()).collect();
                let total: f32 = ex.iter().sum();
                return idx.into_iter().zip(ex).map(|(i, x)| (i, x / total)).collect();
            }
            let m = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let ex: Vec<f32> = row.iter().map(|v| (v - m).exp()).collect();
            let sum: f32 = ex.iter().sum();
            let p: Vec<f32> = ex.iter().map(|v| v / sum).collect();
            // Largest first; ties to the lower index.
            idx.sort_by(|&a, &b| p[b].total_cmp(&p[a]).then(a.cmp(&b)));
            idx.truncate(k);
            idx.into_iter().map(|i| (i, p[i])).collect()
        })
        .collect()
}

/// x: [T, H] (post-attention-normed) → [T, H].
pub fn forward(w: &MoeWeights, cfg: &ModelConfig, x: &[f32]) -> Buf {
    let h = cfg.hidden_size;
    let t = x.len() / h;
    let logits = matmul_buf(&w.router, 0, x); // [T, E]
    let routes = route(&logits, cfg.num_experts, cfg.num_experts_per_tok, cfg.norm_topk_prob);

    // Group token rows by expert, run each expert once on its rows.
    let mut by_expert: Vec<Vec<(usize, f32)>> = vec![Vec::new(); cfg.num_experts];
    for (ti, r) in routes.iter().enumerate() {
        for &(e, wgt) in r {
            by_expert[e].push((ti, wgt));
        }
    }
    let mut out = Buf::zeros(t * h);
    for (e, rows) in by_expert.iter().enumerate() {
        if rows.is_empty() {
            continue;
        }
        let mut xe = Buf::for_output(rows.len() * h);
        for (dst, &(ti, _)) in xe.chunks_exact_mut(h).zip(rows) {
            dst.copy_from_slice(&x[ti * h..(ti + 1) * h]);
        }
        let ye = swiglu(&w.gate_proj, &w.up_proj, &w.down_proj, e, &xe); // [n, H]
        for (j, &(ti, wgt)) in rows.iter().enumerate() {
            for (o, v) in out[ti * h..(ti + 1) * h].iter_mut().zip(&ye[j * h..(j + 1) * h]) {
                *o += wgt * v;
            }
        }
    }
    if let (Some(shared), Some(sg)) = (&w.shared, &w.shared_gate) {
        let s = dense_mlp(shared, x); // [T, H]
        let mut g = vec![0.0f32; t];
        matmul(sg, 0, x, &mut g); // [T, 1]
        for ti in 0..t {
            let gate = sigmoid(g[ti]);
            for (o, v) in out[ti * h..(ti + 1) * h].iter_mut().zip(&s[ti * h..(ti + 1) * h]) {
                *o += gate * v;
            }
        }
    }
    out
}
