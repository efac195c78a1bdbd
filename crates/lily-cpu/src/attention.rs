//! Gated full attention (the 1-in-4 layers): q/k/v projections, per-head (1+w) RMSNorm of q and k,
//! partial NeoX RoPE on the first `rotary_dim` dims, GQA softmax attention over the KV cache
//! (causal within the new tokens), a sigmoid output gate, and the output projection.

use lily_model::weights::AttnWeights;
use lily_model::ModelConfig;
use rayon::prelude::*;

use crate::linear::{matmul, matmul_new};
use crate::norm::{rms_norm_inplace, sigmoid};

/// The KV cache of one attention layer: post-RoPE keys and values, `[pos, kv_heads, head_dim]`.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct KvCache {
    pub k: Vec<f32>,
    pub v: Vec<f32>,
}

impl KvCache {
    /// Positions held.
    pub fn len(&self, cfg: &ModelConfig) -> usize {
        self.k.len() / (cfg.num_key_value_heads * cfg.head_dim)
    }
    pub fn is_empty(&self) -> bool {
        self.k.is_empty()
    }
    /// Keeps only the first `n` positions.
    pub fn truncate(&mut self, n: usize, cfg: &ModelConfig) {
        let w = cfg.num_key_value_heads * cfg.head_dim;
        self.k.truncate(n * w);
        self.v.truncate(n * w);
    }
}

/// Rotates the first `rot` dims of each `head_dim`-vector of `x` ([T, heads, head_dim]) by the
/// angles of positions `pos0..pos0+T`: NeoX half-split pairs (i, i + rot/2).
pub fn rope(x: &mut [f32], heads: usize, head_dim: usize, rot: usize, theta: f64, pos0: usize) {
    let half = rot / 2;
    let inv_freq: Vec<f64> = (0..half).map(|i| theta.powf(-((2 * i) as f64) / rot as f64)).collect();
    for (t, row) in x.chunks_exact_mut(heads * head_dim).enumerate() {
        let p = (pos0 + t) as f64;
        let (cos, sin): (Vec<f32>, Vec<f32>) = inv_freq.iter().map(|f| ((p * f).cos() as f32, (p * f).sin() as f32)).unzip();
        for h in row.chunks_exact_mut(head_dim) {
            for i in 0..half {
                let (a, b) = (h[i], h[i + half]);
                h[i] = a * cos[i] - b * sin[i];
                h[i + half] = b * cos[i] + a * sin[i];
            }
        }
    }
}

/// One attention layer on normed input x [T, H] at positions `cache.len()..`; appends to the cache.
/// Returns [T, H]. With `kv_bf16` the appended keys and values are rounded to bf16 first (to nearest
/// even), as the CUDA backend stores its cache: the reference its GPU tests compare against.
pub fn forward(w: &AttnWeights, cfg: &ModelConfig, x: &[f32], cache: &mut KvCache, kv_bf16: bool) -> Vec<f32> {
    let (nh, kvh, hd) = (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim);
    let t = x.len() / cfg.hidden_size;
    let pos0 = cache.len(cfg);

    // Projections. q_proj rows are per head [query(hd) | gate(hd)] when the output gate is on.
    let qg = matmul_new(&w.q_proj, 0, x); // [T, nh·hd·(1+gate)]
    let per_head = if cfg.attn_output_gate { 2 * hd } else { hd };
    let mut q = vec![0.0f32; t * nh * hd]; // [T, nh, hd]
    let mut gate = vec![0.0f32; t * nh * hd]; // [T, nh·hd]
    for ti in 0..t {
        for h in 0..nh {
            let src = &qg[(ti * nh + h) * per_head..(ti * nh + h + 1) * per_head];
            q[(ti * nh + h) * hd..(ti * nh + h + 1) * hd].copy_from_slice(&src[..hd]);
            if cfg.attn_output_gate {
                gate[(ti * nh + h) * hd..(ti * nh + h + 1) * hd].copy_from_slice(&src[hd..]);
            }
        }
    }
    let mut k = matmul_new(&w.k_proj, 0, x); // [T, kvh, hd]
    let v = matmul_new(&w.v_proj, 0, x); // [T, kvh, hd]

    rms_norm_inplace(&mut q, &w.q_norm, cfg.rms_norm_eps);
    rms_norm_inplace(&mut k, &w.k_norm, cfg.rms_norm_eps);
    rope(&mut q, nh, hd, cfg.rotary_dim, cfg.rope_theta, pos0);
    rope(&mut k, kvh, hd, cfg.rotary_dim, cfg.rope_theta, pos0);
    if kv_bf16 {
        let round = |x: f32| half::bf16::from_f32(x).to_f32();
        cache.k.extend(k.iter().map(|&x| round(x)));
        cache.v.extend(v.iter().map(|&x| round(x)));
    } else {
        cache.k.extend_from_slice(&k);
        cache.v.extend_from_slice(&v);
    }

    // Softmax attention per (token, query head); query head h reads KV head h / (nh/kvh).
    let group = nh / kvh;
    let scale = 1.0 / (hd as f32).sqrt();
    let (kc, vc) = (&cache.k, &cache.v);
    let mut o = vec![0.0f32; t * nh * hd]; // [T, nh, hd]
    o.par_chunks_mut(hd).enumerate().for_each_init(Vec::new, |scores: &mut Vec<f32>, (i, out)| {
        let (ti, h) = (i / nh, i % nh);
        let kv = h / group;
        let n = pos0 + ti + 1; // causal: positions 0..=pos0+ti
        let qv = &q[i * hd..(i + 1) * hd];
        scores.clear();
        scores.extend((0..n).map(|p| {
            let kr = &kc[(p * kvh + kv) * hd..(p * kvh + kv + 1) * hd];
            qv.iter().zip(kr).map(|(a, b)| a * b).sum::<f32>() * scale
        }));
        let m = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut sum = 0.0f32;
        for s in scores.iter_mut() {
            *s = (*s - m).exp();
            sum += *s;
        }
        out.fill(0.0);
        for (p, s) in scores.iter().enumerate() {
            let vr = &vc[(p * kvh + kv) * hd..(p * kvh + kv + 1) * hd];
            let wgt = s / sum;
            for (a, b) in out.iter_mut().zip(vr) {
                *a += wgt * b;
            }
        }
    });
    if cfg.attn_output_gate {
        for (a, g) in o.iter_mut().zip(&gate) {
            *a *= sigmoid(*g);
        }
    }
    let mut y = vec![0.0f32; t * cfg.hidden_size];
    matmul(&w.o_proj, 0, &o, &mut y);
    y
}
