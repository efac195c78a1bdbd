//! Gated full attention (the 1-in-4 layers): q/k/v projections, per-head (1+w) RMSNorm of q and k,
//! partial NeoX RoPE on the first `rotary_dim` dims, GQA softmax attention over the KV cache
//! (causal within the new tokens), a sigmoid output gate, and the output projection.
//!
//! The softmax part runs per KV head on blocks of query rows (a block of new tokens times the query
//! heads that read that KV head), so each key and value row is read once per block, not once per
//! query: scores are the shared dot kernels of `kernels` (eight-lane sums in a fixed order), then a
//! two-pass softmax per row (vectorised, its own `exp`), then the value rows summed in position
//! order.

use lily_model::weights::AttnWeights;
use lily_model::ModelConfig;
use rayon::prelude::*;

use crate::kernels::{self, Isa};
use crate::linear::matmul_buf;
use crate::norm::{rms_norm_inplace, sigmoid};
use crate::workspace::Buf;

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
pub fn forward(w: &AttnWeights, cfg: &ModelConfig, x: &[f32], cache: &mut KvCache, kv_bf16: bool) -> Buf {
    let (nh, kvh, hd) = (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim);
    let t = x.len() / cfg.hidden_size;
    let pos0 = cache.len(cfg);

    // Projections. q_proj rows are per head [query(hd) | gate(hd)] when the output gate is on.
    let qg = matmul_buf(&w.q_proj, 0, x); // [T, nh·hd·(1+gate)]
    let per_head = if cfg.attn_output_gate { 2 * hd } else { hd };
    let mut q = Buf::for_output(t * nh * hd); // [T, nh, hd], written whole below
    let mut gate = Buf::zeros(t * nh * hd); // [T, nh·hd]
    for ti in 0..t {
        for h in 0..nh {
            let src = &qg[(ti * nh + h) * per_head..(ti * nh + h + 1) * per_head];
            q[(ti * nh + h) * hd..(ti * nh + h + 1) * hd].copy_from_slice(&src[..hd]);
            if cfg.attn_output_gate {
                gate[(ti * nh + h) * hd..(ti * nh + h + 1) * hd].copy_from_slice(&src[hd..]);
            }
        }
    }
    let mut k = matmul_buf(&w.k_proj, 0, x); // [T, kvh, hd]
    let v = matmul_buf(&w.v_proj, 0, x); // [T, kvh, hd]

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

    let mut o = Buf::for_output(t * nh * hd); // [T, nh, hd], written whole by attend
    attend(Isa::best(), &q, &cache.k, &cache.v, pos0, nh, kvh, hd, &mut o);
    if cfg.attn_output_gate {
        for (a, g) in o.iter_mut().zip(gate.iter()) {
            *a *= sigmoid(*g);
        }
    }
    matmul_buf(&w.o_proj, 0, &o)
}

/// Scores of one block of query rows are kept whole (the softmax takes two passes): at most this
/// many f32 per block, which bounds the tokens per block at long contexts.
const SCORES_BUDGET: usize = 1 << 20;
/// Most new tokens per block (their query rows share each key and value row read).
const MAX_BLOCK_TOKENS: usize = 16;
/// Value rows summed per pass over a block's query rows (kept in cache while they are reused).
const VALUE_BLOCK: usize = 128;
/// Multiply-adds below which the blocks run on the calling thread.
const PAR_MIN_WORK: usize = 1 << 18;

/// Causal GQA softmax attention of the T new tokens at positions pos0.. (their K/V rows already in
/// the cache): q [T, nh, hd] (after norm and RoPE), kc/vc [pos0+T, kvh, hd], o [T, nh, hd].
/// Query head h reads KV head h / (nh/kvh); token i sees positions 0..=pos0+i. Per query row:
/// s_p = (q·k_p)·(1/√hd) (the dot in the kernels' fixed order), w_p = exp(s_p − max s) / Σ exp(s −
/// max s) ([`kernels::softmax`]), o = Σ_p w_p·v_p in position order.
#[allow(clippy::too_many_arguments)]
pub fn attend(isa: Isa, q: &[f32], kc: &[f32], vc: &[f32], pos0: usize, nh: usize, kvh: usize, hd: usize, o: &mut [f32]) {
    let t = q.len() / (nh * hd);
    assert_eq!(q.len(), t * nh * hd, "attend: q is not [T, {nh}, {hd}]");
    assert_eq!(o.len(), q.len(), "attend: o is not like q");
    assert!(kc.len() >= (pos0 + t) * kvh * hd && vc.len() == kc.len(), "attend: the cache lacks the new rows");
    assert!(kvh > 0 && nh.is_multiple_of(kvh), "attend: {nh} query heads over {kvh} KV heads");
    if t == 0 {
        return;
    }
    let group = nh / kvh;
    let n_all = pos0 + t;
    let tb = (SCORES_BUDGET / (group * n_all)).clamp(1, MAX_BLOCK_TOKENS);
    // Tasks: (KV head, block of new tokens).
    let blocks = t.div_ceil(tb);
    let tasks: Vec<(usize, usize)> = (0..kvh).flat_map(|kv| (0..blocks).map(move |b| (kv, b * tb))).collect();
    let run = |&(kv, t0): &(usize, usize)| -> Buf {
        let nt = tb.min(t - t0);
        attend_block(isa, q, kc, vc, pos0, nh, kvh, hd, kv, t0, nt)
    };
    let put = |o: &mut [f32], (kv, t0): (usize, usize), out: &[f32]| {
        // out: [nt, group, hd] → o[t0 + i, kv·group.., :].
        for (i, rows) in out.chunks_exact(group * hd).enumerate() {
            let at = ((t0 + i) * nh + kv * group) * hd;
            o[at..at + group * hd].copy_from_slice(rows);
        }
    };
    let work = 2 * t * nh * hd * (pos0 + t.div_ceil(2));
    if work < PAR_MIN_WORK || rayon::current_num_threads() == 1 {
        for task in &tasks {
            let out = run(task);
            put(o, *task, &out);
        }
    } else {
        let outs: Vec<Buf> = tasks.par_iter().map(run).collect();
        for (task, out) in tasks.iter().zip(&outs) {
            put(o, *task, out);
        }
    }
}

/// Tokens t0..t0+nt with the query heads of KV head kv: returns their outputs [nt, group, hd].
#[allow(clippy::too_many_arguments)]
fn attend_block(
    isa: Isa,
    q: &[f32],
    kc: &[f32],
    vc: &[f32],
    pos0: usize,
    nh: usize,
    kvh: usize,
    hd: usize,
    kv: usize,
    t0: usize,
    nt: usize,
) -> Buf {
    let group = nh / kvh;
    let rows = nt * group;
    let n_max = pos0 + t0 + nt; // the last token's positions; earlier rows use a prefix
    let stride = kvh * hd; // between positions of one KV head in the cache
    let scale = 1.0 / (hd as f32).sqrt();
    // Query rows (token i, head kv·group + g) → row i·group + g: contiguous per token.
    let mut qs = Buf::for_output(rows * hd);
    for (i, dst) in qs.chunks_exact_mut(group * hd).enumerate() {
        let at = ((t0 + i) * nh + kv * group) * hd;
        dst.copy_from_slice(&q[at..at + group * hd]);
    }
    // Scores [rows, n_max] (written whole): every key of the block's widest prefix against every
    // query row, a cache-sized block of keys at a time.
    let mut s = Buf::for_output(rows * n_max);
    let keys = (kernels::BLOCK_BYTES / (4 * hd)).max(4);
    for p0 in (0..n_max).step_by(keys) {
        let np = keys.min(n_max - p0);
        kernels::dots(isa, &kc[p0 * stride + kv * hd..], stride, np, &qs, hd, rows, hd, &mut s[p0..], n_max);
    }
    // Per row: its causal prefix, scaled, then the softmax.
    for r in 0..rows {
        let n = pos0 + t0 + r / group + 1;
        kernels::softmax(isa, &mut s[r * n_max..r * n_max + n], scale);
    }
    // Σ_p w_p·v_p per row, over blocks of value rows (each block reused by every row).
    let mut out = Buf::zeros(rows * hd);
    // A token's `group` rows (one per query head of this KV head) see the same positions and are
    // summed together, sharing each value row read.
    let vk = &vc[kv * hd..];
    for p0 in (0..n_max).step_by(VALUE_BLOCK) {
        for (i, orows) in out.chunks_exact_mut(group * hd).enumerate() {
            let n = pos0 + t0 + i + 1;
            if p0 < n {
                let p1 = (p0 + VALUE_BLOCK).min(n);
                kernels::weighted_sum(isa, &s[i * group * n_max + p0..], n_max, p1 - p0, &vk[p0 * stride..], stride, orows, group);
            }
        }
    }
    out
}
