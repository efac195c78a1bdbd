//! The Gated DeltaNet maths of the linear-attention layers (Qwen3.5/3.6 `linear_attn`), in f32, as
//! plain functions on row-major slices. The layer (projections aside) runs, per call on T tokens:
//!
//! 1. [`causal_conv1d_silu`]: depthwise causal conv over time on the q|k|v projections, then SiLU;
//! 2. [`gates`]: beta = sigmoid(b), log-decay g = -exp(A_log) * softplus(a + dt_bias);
//! 3. [`normalize_qk`]: q ← l2norm(q)/√Dk, k ← l2norm(k);
//! 4. the gated delta rule, [`delta_rule_recurrent`] (the definition; decode) or
//!    [`delta_rule_chunked`] (the same numbers in chunks of 64 tokens; prefill);
//! 5. [`gated_rmsnorm`]: RMSNorm with a plain weight, times silu(z).
//!
//! Spec: `docs/qwen36-architecture.md` §2.2 (#2, #3), §2.4 and §5.3. The reference code is HF
//! `torch_recurrent_gated_delta_rule` / `torch_chunk_gated_delta_rule` (qwen3_5_moe) and the MLX
//! kernel in `mlx_lm/models/gated_delta.py`.
//!
//! Layouts: T tokens, Hk key heads, Hv value heads (a multiple of Hk), Dk/Dv head dims.
//! The conv channels are C = 2·Hk·Dk + Hv·Dv, ordered q | k | v, each head-major. Value head j reads
//! key head j / (Hv/Hk) (`repeat_interleave`, not the tiled j % Hk of GGUF). The recurrent state is
//! [Hv, Dk, Dv] in HF order: S[h][i_k][j_v] (MLX and FLA store the transpose).

use rayon::prelude::*;

use crate::kernels::Isa;

/// Tokens per chunk of [`delta_rule_chunked`] (as HF and FLA); also the token block that both rule
/// functions hand to the value-head-parallel workers at a time.
pub const CHUNK: usize = 64;

/// The eps that `l2norm` adds to the sum of squares (FLA / HF convention).
const L2NORM_EPS: f32 = 1e-6;

pub use lily_model::GdnDims;

fn check(dims: &GdnDims) {
    assert!(dims.is_valid(), "GDN: invalid dims {dims:?} (empty, or Hv not a multiple of Hk)");
}

// ---------------------------------------------------------------------------------------------
// Scalar and vector helpers.

#[inline]
fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

#[inline]
fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// torch's softplus (beta 1, threshold 20).
#[inline]
fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}

/// Σ a·b with 8 independent accumulators, so that it vectorises. a, b: [n].
#[inline]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    let mut acc = [0f32; 8];
    for (x, y) in ca.zip(cb) {
        for l in 0..8 {
            acc[l] += x[l] * y[l];
        }
    }
    let mut s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for (x, y) in ra.iter().zip(rb) {
        s += x * y;
    }
    s
}

// ---------------------------------------------------------------------------------------------
// Conv, gates, q/k normalisation, gated norm.

/// Causal depthwise conv over time + SiLU. x: [T, C] pre-conv projections; weight: [C, K] (tap K-1
/// multiplies the current token); conv_state: [K-1, C] the previous K-1 raw input rows (zeros for a
/// fresh sequence), updated in place to the last K-1 rows of concat(conv_state, x); out: [T, C].
///
/// With xin = concat(conv_state, x) ([K-1+T, C]): out[t, ch] = silu(Σ_j weight[ch, j]·xin[t+j, ch]).
pub fn causal_conv1d_silu(
    x: &[f32],
    weight: &[f32],
    conv_state: &mut [f32],
    dims: &GdnDims,
    out: &mut [f32],
) {
    check(dims);
    let c = dims.conv_dim();
    let k = dims.conv_kernel;
    let hist = k - 1;
    assert_eq!(x.len() % c, 0, "conv: x is not [T, {c}]");
    let t_len = x.len() / c;
    assert_eq!(weight.len(), c * k, "conv: weight is not [{c}, {k}]");
    assert_eq!(
        conv_state.len(),
        hist * c,
        "conv: conv_state is not [{hist}, {c}]"
    );
    assert_eq!(out.len(), x.len(), "conv: out is not [T, {c}]");

    // wt: [K, C], the weight transposed so that the channel loop is contiguous.
    let mut wt = vec![0f32; k * c];
    for ch in 0..c {
        for j in 0..k {
            wt[j * c + ch] = weight[ch * k + j];
        }
    }

    // Over tokens t (parallel), taps j, channels ch: out[t, ch] = silu(Σ_j wt[j, ch]·xin[t+j, ch]).
    let state: &[f32] = conv_state;
    out.par_chunks_mut(c).enumerate().for_each(|(t, o)| {
        o.fill(0.0);
        for j in 0..k {
            let r = t + j; // row of xin
            let row = if r < hist {
                &state[r * c..(r + 1) * c]
            } else {
                &x[(r - hist) * c..(r - hist + 1) * c]
            };
            for ((o, w), v) in o.iter_mut().zip(&wt[j * c..(j + 1) * c]).zip(row) {
                *o += w * v;
            }
        }
        for o in o.iter_mut() {
            *o = silu(*o);
        }
    });

    // New state row r = xin[T + r], r in 0..K-1. When T < K-1 some rows come from the old state
    // (row T + r > r), so the forward in-place copy reads each old row before it is overwritten.
    for r in 0..hist {
        let src = t_len + r;
        if src < hist {
            conv_state.copy_within(src * c..(src + 1) * c, r * c);
        } else {
            conv_state[r * c..(r + 1) * c]
                .copy_from_slice(&x[(src - hist) * c..(src - hist + 1) * c]);
        }
    }
}

/// Per token and value head: beta = sigmoid(b); log-decay g = -exp(a_log)·softplus(a + dt_bias)
/// (softplus(x) = x > 20 ? x : ln(1+eˣ)). a, b: [T, Hv]; a_log, dt_bias: [Hv]. Writes g [T, Hv]
/// (≤ 0) and beta [T, Hv].
pub fn gates(
    a: &[f32],
    b: &[f32],
    a_log: &[f32],
    dt_bias: &[f32],
    g: &mut [f32],
    beta: &mut [f32],
) {
    let hv = a_log.len();
    assert!(hv > 0, "gates: empty a_log");
    assert_eq!(dt_bias.len(), hv, "gates: dt_bias is not [{hv}]");
    assert_eq!(a.len() % hv, 0, "gates: a is not [T, {hv}]");
    for (name, len) in [("b", b.len()), ("g", g.len()), ("beta", beta.len())] {
        assert_eq!(len, a.len(), "gates: {name} is not [T, {hv}] like a");
    }
    // neg_a: [Hv], -exp(A_log).
    let neg_a: Vec<f32> = a_log.iter().map(|&x| -x.exp()).collect();
    // Over tokens (parallel), heads h.
    g.par_chunks_mut(hv)
        .zip(beta.par_chunks_mut(hv))
        .zip(a.par_chunks(hv).zip(b.par_chunks(hv)))
        .with_min_len(64)
        .for_each(|((g, beta), (a, b))| {
            for h in 0..hv {
                g[h] = neg_a[h] * softplus(a[h] + dt_bias[h]);
                beta[h] = sigmoid(b[h]);
            }
        });
}

/// In place on the conv output [T, C]: q ← l2norm(q)/√Dk, k ← l2norm(k), with
/// l2norm(x) = x / √(Σx² + 1e-6) per head. The v part is left alone.
pub fn normalize_qk(qkv: &mut [f32], dims: &GdnDims) {
    check(dims);
    let c = dims.conv_dim();
    let dk = dims.head_k_dim;
    let kd = dims.key_dim();
    assert_eq!(qkv.len() % c, 0, "normalize_qk: qkv is not [T, {c}]");
    let q_scale = 1.0 / (dk as f32).sqrt();
    // Over tokens (parallel), then the 2·Hk heads of q | k, each [Dk].
    qkv.par_chunks_mut(c).for_each(|row| {
        for (i, head) in row[..2 * kd].chunks_exact_mut(dk).enumerate() {
            let inv = 1.0 / (dot(head, head) + L2NORM_EPS).sqrt();
            let s = if i < dims.num_k_heads {
                inv * q_scale
            } else {
                inv
            };
            head.iter_mut().for_each(|x| *x *= s);
        }
    });
}

/// Gated RMSNorm per (token, value head) over Dv: y = (w ⊙ x·rsqrt(mean(x²) + eps))·silu(z).
/// x = the rule's output [T, Hv, Dv], z [T, Hv·Dv], weight [Dv] (a plain weight, NOT 1+w), y [T, Hv·Dv].
pub fn gated_rmsnorm(
    x: &[f32],
    z: &[f32],
    weight: &[f32],
    eps: f32,
    dims: &GdnDims,
    y: &mut [f32],
) {
    let dv = dims.head_v_dim;
    assert_eq!(weight.len(), dv, "gated_rmsnorm: weight is not [{dv}]");
    assert_eq!(
        x.len() % dims.value_dim(),
        0,
        "gated_rmsnorm: x is not [T, Hv, Dv]"
    );
    assert_eq!(
        z.len(),
        x.len(),
        "gated_rmsnorm: z is not [T, Hv·Dv] like x"
    );
    assert_eq!(
        y.len(),
        x.len(),
        "gated_rmsnorm: y is not [T, Hv·Dv] like x"
    );
    // Over (token, head) rows of [Dv] (parallel).
    y.par_chunks_mut(dv)
        .zip(x.par_chunks(dv).zip(z.par_chunks(dv)))
        .with_min_len(16)
        .for_each(|(y, (x, z))| {
            let r = 1.0 / (dot(x, x) / dv as f32 + eps).sqrt();
            for i in 0..dv {
                y[i] = weight[i] * (x[i] * r) * silu(z[i]);
            }
        });
}

// ---------------------------------------------------------------------------------------------
// The gated delta rule.
//
// Both forms work per value head on column tiles of W value dims: the columns of S (and of v, o,
// δ) never mix, so each tile's sums stay in registers while the loops run over Dk or over the
// chunk's tokens, and the width changes nothing in any column's arithmetic. A tail of Dv % W
// columns runs the same kernels with width 1. The width is a parameter of the per-head loops: 16
// for the portable build (SSE2 has 16 registers of 4 lanes), wider for AVX2 and AVX-512 (more
// independent sums in flight, each chain's add latency hidden).

/// Column tile widths of the portable build.
const TILE: usize = 16;
/// Column tile widths of the AVX2 build: the rule kernels, and the state update of the chunked form
/// (one sum per column: 8 registers).
#[cfg(target_arch = "x86_64")]
const TILE_AVX2: usize = 32;
#[cfg(target_arch = "x86_64")]
const TILE_AVX2_STATE: usize = 64;
/// The same for the AVX-512 build (16-lane registers, 32 of them).
#[cfg(target_arch = "x86_64")]
const TILE_AVX512: usize = 64;
#[cfg(target_arch = "x86_64")]
const TILE_AVX512_STATE: usize = 128;

/// Calls `$kernel::<W>(v0, args…)` on column tiles v0..v0+W covering 0..dv, then width 1 on the
/// tail.
macro_rules! over_column_tiles {
    ($w:ident, $dv:expr, $kernel:ident($($arg:expr),* $(,)?)) => {{
        let dv: usize = $dv;
        let full = dv / $w * $w;
        for v0 in (0..full).step_by($w) {
            $kernel::<$w>(v0, $($arg),*);
        }
        for v0 in full..dv {
            $kernel::<1>(v0, $($arg),*);
        }
    }};
}

/// Columns v0..v0+W of a row, as an array reference.
#[inline(always)]
fn cols<const W: usize>(row: &[f32], v0: usize) -> &[f32; W] {
    row[v0..v0 + W].try_into().unwrap()
}

#[inline(always)]
fn cols_mut<const W: usize>(row: &mut [f32], v0: usize) -> &mut [f32; W] {
    (&mut row[v0..v0 + W]).try_into().unwrap()
}

/// Shapes and checks shared by the two rule functions; returns T.
fn check_rule(
    qkv: &[f32],
    g: &[f32],
    beta: &[f32],
    state: &[f32],
    dims: &GdnDims,
    out: &[f32],
) -> usize {
    check(dims);
    let c = dims.conv_dim();
    assert_eq!(qkv.len() % c, 0, "delta rule: qkv is not [T, {c}]");
    let t_len = qkv.len() / c;
    let hv = dims.num_v_heads;
    assert_eq!(g.len(), t_len * hv, "delta rule: g is not [{t_len}, {hv}]");
    assert_eq!(
        beta.len(),
        t_len * hv,
        "delta rule: beta is not [{t_len}, {hv}]"
    );
    assert_eq!(
        state.len(),
        dims.state_len(),
        "delta rule: state is not [Hv, Dk, Dv]"
    );
    assert_eq!(
        out.len(),
        t_len * dims.value_dim(),
        "delta rule: out is not [{t_len}, Hv, Dv]"
    );
    t_len
}

/// Runs `head` on every value head in parallel, one block of ≤ CHUNK tokens at a time, and
/// scatters the per-head outputs into out [T, Hv, Dv].
/// head(j, t0, n, state_j [Dk, Dv], out_j [n, Dv], scratch_j) handles tokens t0..t0+n of head j.
fn for_each_head_block<S: Send>(
    t_len: usize,
    state: &mut [f32],
    dims: &GdnDims,
    out: &mut [f32],
    make_scratch: impl Fn() -> S,
    head: impl Fn(usize, usize, usize, &mut [f32], &mut [f32], &mut S) + Sync,
) {
    if t_len == 0 {
        return;
    }
    let (hv, dv) = (dims.num_v_heads, dims.head_v_dim);
    let blk_len = CHUNK.min(t_len) * dv;
    // blk: [Hv, ≤CHUNK, Dv], the current block's output per head; scratch: one per head.
    let mut blk = crate::workspace::Buf::for_output(hv * blk_len); // written before it is read
    let mut scratch: Vec<S> = (0..hv).map(|_| make_scratch()).collect();
    for t0 in (0..t_len).step_by(CHUNK) {
        let n = CHUNK.min(t_len - t0);
        // Over value heads j (parallel): state_j [Dk, Dv], blk_j [n, Dv].
        state
            .par_chunks_mut(dims.head_k_dim * dv)
            .zip(blk.par_chunks_mut(blk_len))
            .zip(scratch.par_iter_mut())
            .enumerate()
            .for_each(|(j, ((s, o), sc))| head(j, t0, n, s, &mut o[..n * dv], sc));
        // Over tokens i of the block (parallel), heads j: out[t0+i, j, :] = blk[j, i, :].
        out[t0 * hv * dv..(t0 + n) * hv * dv]
            .par_chunks_mut(hv * dv)
            .enumerate()
            .for_each(|(i, row)| {
                for (j, dst) in row.chunks_exact_mut(dv).enumerate() {
                    dst.copy_from_slice(&blk[j * blk_len + i * dv..j * blk_len + (i + 1) * dv]);
                }
            });
    }
}

/// The gated delta rule, token by token (the definition). q, k are read from qkv [T, C] (after
/// normalize_qk), v from its v part; g, beta [T, Hv]; state [Hv, Dk, Dv] fp32 (HF layout
/// S[h][i_k][j_v]) updated in place; out [T, Hv, Dv].
///
/// Per token and value head: S ← exp(g)·S; kv = Sᵀk; δ = beta·(v − kv); S ← S + k ⊗ δ;
/// o = Sᵀq (read after the update).
pub fn delta_rule_recurrent(
    qkv: &[f32],
    g: &[f32],
    beta: &[f32],
    state: &mut [f32],
    dims: &GdnDims,
    out: &mut [f32],
) {
    delta_rule_recurrent_with(Isa::best(), qkv, g, beta, state, dims, out)
}

/// [`delta_rule_recurrent`] with a chosen compilation of the per-head loops (the tests compare them).
pub fn delta_rule_recurrent_with(
    isa: Isa,
    qkv: &[f32],
    g: &[f32],
    beta: &[f32],
    state: &mut [f32],
    dims: &GdnDims,
    out: &mut [f32],
) {
    let t_len = check_rule(qkv, g, beta, state, dims, out);
    let rule = Rule { qkv, g, beta, dims };
    for_each_head_block(t_len, state, dims, out, || (), |j, t0, n, s, o, _| match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: Isa::Avx2 (Avx512) is only produced where the CPU has AVX2 (AVX-512F).
        Isa::Avx2 => unsafe { recurrent_head_avx2(&rule, j, t0, n, s, o) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        Isa::Avx512 => unsafe { recurrent_head_avx512(&rule, j, t0, n, s, o) },
        _ => recurrent_head::<TILE>(&rule, j, t0, n, s, o),
    });
}

/// The inputs of a rule call, shared by its per-head loops.
struct Rule<'a> {
    qkv: &'a [f32],
    g: &'a [f32],
    beta: &'a [f32],
    dims: &'a GdnDims,
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn recurrent_head_avx2(rule: &Rule, j: usize, t0: usize, n: usize, s: &mut [f32], o: &mut [f32]) {
    recurrent_head::<TILE_AVX2>(rule, j, t0, n, s, o)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn recurrent_head_avx512(rule: &Rule, j: usize, t0: usize, n: usize, s: &mut [f32], o: &mut [f32]) {
    recurrent_head::<TILE_AVX512>(rule, j, t0, n, s, o)
}

/// Tokens t0..t0+n of value head j, one by one, on column tiles of W; s: [Dk, Dv], o: [n, Dv].
#[inline(always)]
fn recurrent_head<const W: usize>(rule: &Rule, j: usize, t0: usize, n: usize, s: &mut [f32], o: &mut [f32]) {
    let Rule { qkv, g, beta, dims } = *rule;
    let (hv, dk, dv, c) = (dims.num_v_heads, dims.head_k_dim, dims.head_v_dim, dims.conv_dim());
    let kd = dims.key_dim();
    let kh = dims.key_head_of(j);
    for i in 0..n {
        let t = t0 + i;
        let row = &qkv[t * c..(t + 1) * c];
        let q = &row[kh * dk..(kh + 1) * dk];
        let k = &row[kd + kh * dk..kd + (kh + 1) * dk];
        let v = &row[2 * kd + j * dv..2 * kd + (j + 1) * dv];
        let (decay, b) = (g[t * hv + j].exp(), beta[t * hv + j]);
        over_column_tiles!(W, dv, recurrent_step(s, q, k, v, decay, b, &mut o[i * dv..(i + 1) * dv]));
    }
}

/// One token of the recurrence on columns v0..v0+W of one head: s [Dk, Dv]; q, k [Dk]; v, o [Dv].
/// kv = Sᵀk is taken on the old S and then scaled by the decay (the same as decaying S first, without
/// a pass that stores S); the second pass writes S = decay·S + k ⊗ δ and reads o from it.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn recurrent_step<const W: usize>(
    v0: usize,
    s: &mut [f32],
    q: &[f32],
    k: &[f32],
    v: &[f32],
    decay: f32,
    b: f32,
    o: &mut [f32],
) {
    let dv = s.len() / k.len();
    // Pass 1 over rows d: kv = decay · Σ_d k[d]·S[d, tile].
    let mut kv = [0f32; W];
    for (d, srow) in s.chunks_exact(dv).enumerate() {
        let st = cols::<W>(srow, v0);
        for l in 0..W {
            kv[l] += k[d] * st[l];
        }
    }
    // δ = β (v − kv).
    let vt = cols::<W>(v, v0);
    let mut delta = [0f32; W];
    for l in 0..W {
        delta[l] = b * (vt[l] - decay * kv[l]);
    }
    // Pass 2 over rows d: S[d, tile] = decay·S[d, tile] + k[d]·δ; o = Σ_d q[d]·S[d, tile].
    let mut ot = [0f32; W];
    for (d, srow) in s.chunks_exact_mut(dv).enumerate() {
        let st = cols_mut::<W>(srow, v0);
        for l in 0..W {
            st[l] = decay * st[l] + k[d] * delta[l];
            ot[l] += q[d] * st[l];
        }
    }
    *cols_mut::<W>(o, v0) = ot;
}

/// Per-head scratch of [`delta_rule_chunked`], sized for a full chunk.
struct ChunkScratch {
    /// q and k of the chunk, [CHUNK, Dk], gathered from qkv.
    q: Vec<f32>,
    k: Vec<f32>,
    /// kt: [Dk, CHUNK], k transposed; later scaled in place to kt[d, j] = k_j[d]·exp(Γ_last − Γ_j).
    kt: Vec<f32>,
    /// decay[i] = exp(g_i), cum[i] = exp(Γ_i) = Π_{s≤i} decay[s], to_end[j] = exp(Γ_last − Γ_j)
    /// = Π_{s>j} decay[s]: [CHUNK] each.
    decay: Vec<f32>,
    cum: Vec<f32>,
    to_end: Vec<f32>,
    /// a[i, j] = β_i (k_i·k_j) exp(Γ_i − Γ_j) for j < i: [CHUNK, CHUNK], the strict lower part of the UT system.
    a: Vec<f32>,
    /// p[i, j] = (q_i·k_j) exp(Γ_i − Γ_j) for j ≤ i: [CHUNK, CHUNK], the intra-chunk attention.
    p: Vec<f32>,
    /// r: [CHUNK, Dv], the corrected values Vn (HF `v_new`).
    r: Vec<f32>,
}

/// The same result as [`delta_rule_recurrent`] computed in chunks of 64 tokens, for prefill: HF
/// `torch_chunk_gated_delta_rule` maths (WY / UT-transform form with forward substitution,
/// within-chunk cumulative log-decay, sequential over chunks). Any T, from any state; same
/// arguments and shapes as the recurrent form, and the same numbers to fp32 rounding.
///
/// Per value head and chunk of n ≤ 64 tokens, local indices i, j, with Γ_i = Σ_{s≤i} g_s,
/// D_ij = exp(Γ_i − Γ_j) (j ≤ i), A = strictly_lower((diag(β) K Kᵀ) ⊙ D), L = I + A:
/// ```text
/// Vn = L⁻¹ (diag(β) V − diag(β·exp(Γ)) K S)         (= HF's U − W S, one forward substitution)
/// O  = diag(exp(Γ)) Q S + ((Q Kᵀ) ⊙ D) Vn           (D including the diagonal)
/// S ← exp(Γ_last) S + (diag(exp(Γ_last − Γ)) K)ᵀ Vn
/// ```
/// A short last chunk is handled as its n tokens: HF's zero padding (g = 0, β = 0, k = 0) adds
/// nothing to the real rows nor to the state. The decays exp(Γ_i − Γ_j) are formed as products of
/// the per-token exp(g) rather than from differences of the cumulative sums, which lose digits once
/// Γ is large; every factor is ≤ 1, so nothing overflows, and strong decays only underflow terms
/// that are negligible anyway.
pub fn delta_rule_chunked(
    qkv: &[f32],
    g: &[f32],
    beta: &[f32],
    state: &mut [f32],
    dims: &GdnDims,
    out: &mut [f32],
) {
    delta_rule_chunked_with(Isa::best(), qkv, g, beta, state, dims, out)
}

/// [`delta_rule_chunked`] with a chosen compilation of the per-head loops (the tests compare them).
pub fn delta_rule_chunked_with(
    isa: Isa,
    qkv: &[f32],
    g: &[f32],
    beta: &[f32],
    state: &mut [f32],
    dims: &GdnDims,
    out: &mut [f32],
) {
    let t_len = check_rule(qkv, g, beta, state, dims, out);
    let (dk, dv) = (dims.head_k_dim, dims.head_v_dim);
    let make = || ChunkScratch {
        q: vec![0f32; CHUNK * dk],
        k: vec![0f32; CHUNK * dk],
        kt: vec![0f32; dk * CHUNK],
        decay: vec![0f32; CHUNK],
        cum: vec![0f32; CHUNK],
        to_end: vec![0f32; CHUNK],
        a: vec![0f32; CHUNK * CHUNK],
        p: vec![0f32; CHUNK * CHUNK],
        r: vec![0f32; CHUNK * dv],
    };
    let rule = Rule { qkv, g, beta, dims };
    for_each_head_block(t_len, state, dims, out, make, |j, t0, n, s, o, sc| match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: Isa::Avx2 (Avx512) is only produced where the CPU has AVX2 (AVX-512F).
        Isa::Avx2 => unsafe { chunked_head_avx2(&rule, j, t0, n, s, o, sc) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        Isa::Avx512 => unsafe { chunked_head_avx512(&rule, j, t0, n, s, o, sc) },
        _ => chunked_head::<TILE, TILE>(&rule, j, t0, n, s, o, sc),
    });
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn chunked_head_avx2(rule: &Rule, j: usize, t0: usize, n: usize, s: &mut [f32], o: &mut [f32], sc: &mut ChunkScratch) {
    chunked_head::<TILE_AVX2, TILE_AVX2_STATE>(rule, j, t0, n, s, o, sc)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn chunked_head_avx512(rule: &Rule, j: usize, t0: usize, n: usize, s: &mut [f32], o: &mut [f32], sc: &mut ChunkScratch) {
    chunked_head::<TILE_AVX512, TILE_AVX512_STATE>(rule, j, t0, n, s, o, sc)
}

/// One chunk (tokens t0..t0+n, n ≤ CHUNK) of value head j on column tiles of W (WS for the state
/// update); s: [Dk, Dv], o: [n, Dv].
#[inline(always)]
fn chunked_head<const W: usize, const WS: usize>(rule: &Rule, j: usize, t0: usize, n: usize, s: &mut [f32], o: &mut [f32], sc: &mut ChunkScratch) {
    let Rule { qkv, g, beta, dims } = *rule;
    let (hv, dk, dv, c) = (dims.num_v_heads, dims.head_k_dim, dims.head_v_dim, dims.conv_dim());
    let kd = dims.key_dim();
    let kh = dims.key_head_of(j);
    let ChunkScratch {
        q,
        k,
        kt,
        decay,
        cum,
        to_end,
        a,
        p,
        r,
    } = sc;
    let (q, k, r) = (&mut q[..n * dk], &mut k[..n * dk], &mut r[..n * dv]);

    // Gather the chunk, over tokens i: q, k [n, Dk]; kt [Dk, n]; decay, cum [n].
    let mut acc = 1f32;
    for i in 0..n {
        let row = &qkv[(t0 + i) * c..(t0 + i + 1) * c];
        q[i * dk..(i + 1) * dk].copy_from_slice(&row[kh * dk..(kh + 1) * dk]);
        k[i * dk..(i + 1) * dk].copy_from_slice(&row[kd + kh * dk..kd + (kh + 1) * dk]);
        for d in 0..dk {
            kt[d * CHUNK + i] = k[i * dk + d];
        }
        decay[i] = g[(t0 + i) * hv + j].exp();
        acc *= decay[i];
        cum[i] = acc;
    }
    // to_end [n], backwards over tokens.
    to_end[n - 1] = 1.0;
    for i in (0..n - 1).rev() {
        to_end[i] = to_end[i + 1] * decay[i + 1];
    }

    // a, p [n, n]: over tokens i, row i of K Kᵀ and Q Kᵀ on the columns jj < m (the lower
    // triangle, rounded up to whole tiles), then decay and β on jj ≤ i.
    for i in 0..n {
        let m = ((i + 1).div_ceil(W) * W).min(n);
        let (ki, qi) = (&k[i * dk..(i + 1) * dk], &q[i * dk..(i + 1) * dk]);
        let (ai, pi) = (
            &mut a[i * CHUNK..i * CHUNK + m],
            &mut p[i * CHUNK..i * CHUNK + m],
        );
        over_column_tiles!(W, m, project_cols(kt, CHUNK, ki, qi, ai, pi));
        // Over jj = i down to 0: dec = exp(Γ_i − Γ_jj) = Π_{jj<s≤i} decay[s].
        let bi = beta[(t0 + i) * hv + j];
        let mut dec = 1f32;
        for jj in (0..=i).rev() {
            ai[jj] *= bi * dec;
            pi[jj] *= dec;
            dec *= decay[jj];
        }
    }

    // Inter-chunk terms, over tokens i: r_i = β_i (v_i − exp(Γ_i) Sᵀk_i), o_i = exp(Γ_i) Sᵀq_i.
    // r, o: [n, Dv]; S: [Dk, Dv].
    for i in 0..n {
        let (ki, qi) = (&k[i * dk..(i + 1) * dk], &q[i * dk..(i + 1) * dk]);
        let (ri, oi) = (&mut r[i * dv..(i + 1) * dv], &mut o[i * dv..(i + 1) * dv]);
        over_column_tiles!(W, dv, project_cols(s, dv, ki, qi, ri, oi));
        let t = t0 + i;
        let v = &qkv[t * c + 2 * kd + j * dv..t * c + 2 * kd + (j + 1) * dv];
        let (bi, ei) = (beta[t * hv + j], cum[i]);
        for (rv, &vv) in ri.iter_mut().zip(v) {
            *rv = bi * (vv - ei * *rv);
        }
        oi.iter_mut().for_each(|x| *x *= ei);
    }

    // Forward substitution r ← L⁻¹ r fused with the intra-chunk read-out o_i += Σ_{jj≤i} p_ij r_jj,
    // over tokens i (sequential; the rows jj < i are final by then). r, o: [n, Dv].
    for i in 0..n {
        let (done, rest) = r.split_at_mut(i * dv);
        let (ai, pi) = (
            &a[i * CHUNK..i * CHUNK + i],
            &p[i * CHUNK..i * CHUNK + i + 1],
        );
        over_column_tiles!(
            W,
            dv,
            substitute_row(done, ai, pi, &mut rest[..dv], &mut o[i * dv..(i + 1) * dv])
        );
    }

    // State: kt[d, jj] ← k_jj[d]·exp(Γ_last − Γ_jj); then S ← exp(Γ_last) S + Σ_jj kt[:, jj] ⊗ r_jj,
    // over rows d of S [Dk, Dv].
    for jj in 0..n {
        for d in 0..dk {
            kt[d * CHUNK + jj] *= to_end[jj];
        }
    }
    let last = cum[n - 1];
    for (d, srow) in s.chunks_exact_mut(dv).enumerate() {
        over_column_tiles!(
            WS,
            dv,
            update_state_row(srow, last, &kt[d * CHUNK..d * CHUNK + n], r)
        );
    }
}

/// Columns v0..v0+W of xk = Xᵀk and xq = Xᵀq: x [Dk, ≥ v0+W] with rows `stride` apart (the state
/// S [Dk, Dv], or the transposed keys kt [Dk, CHUNK]); k, q [Dk]; xk, xq [≥ v0+W].
#[inline(always)]
fn project_cols<const W: usize>(
    v0: usize,
    x: &[f32],
    stride: usize,
    k: &[f32],
    q: &[f32],
    xk: &mut [f32],
    xq: &mut [f32],
) {
    let (mut kt, mut qt) = ([0f32; W], [0f32; W]);
    for d in 0..k.len() {
        let xt = cols::<W>(&x[d * stride..], v0);
        for l in 0..W {
            kt[l] += k[d] * xt[l];
            qt[l] += q[d] * xt[l];
        }
    }
    *cols_mut::<W>(xk, v0) = kt;
    *cols_mut::<W>(xq, v0) = qt;
}

/// Row i of the forward substitution, columns v0..v0+W: done = r rows 0..i [i, Dv] (final);
/// ai = a[i, 0..i]; pi = p[i, 0..=i]; ri, oi [Dv]. ri ← ri − Σ_jj ai[jj]·r_jj; oi += Σ_jj pi[jj]·r_jj
/// + pi[i]·ri (with the new ri).
#[inline(always)]
fn substitute_row<const W: usize>(
    v0: usize,
    done: &[f32],
    ai: &[f32],
    pi: &[f32],
    ri: &mut [f32],
    oi: &mut [f32],
) {
    let dv = ri.len();
    let (mut rt, mut ot) = (*cols::<W>(ri, v0), *cols::<W>(oi, v0));
    for (jj, rj) in done.chunks_exact(dv).enumerate() {
        let rjt = cols::<W>(rj, v0);
        for l in 0..W {
            rt[l] -= ai[jj] * rjt[l];
            ot[l] += pi[jj] * rjt[l];
        }
    }
    let i = ai.len();
    for l in 0..W {
        ot[l] += pi[i] * rt[l];
    }
    *cols_mut::<W>(ri, v0) = rt;
    *cols_mut::<W>(oi, v0) = ot;
}

/// One row d of the state update, columns v0..v0+W: srow [Dv] ← last·srow + Σ_jj ktd[jj]·r_jj;
/// ktd = kt[d, 0..n]; r [n, Dv].
#[inline(always)]
fn update_state_row<const W: usize>(
    v0: usize,
    srow: &mut [f32],
    last: f32,
    ktd: &[f32],
    r: &[f32],
) {
    let dv = srow.len();
    let st = cols_mut::<W>(srow, v0);
    let mut acc = [0f32; W];
    for l in 0..W {
        acc[l] = last * st[l];
    }
    for (jj, rj) in r.chunks_exact(dv).enumerate() {
        let rjt = cols::<W>(rj, v0);
        for l in 0..W {
            acc[l] += ktd[jj] * rjt[l];
        }
    }
    *st = acc;
}
