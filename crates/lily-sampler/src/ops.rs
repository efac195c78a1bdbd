//! The sampling math as pure functions over a logits slice and the plain [`Resolved`] parameters:
//! what a GPU kernel would mirror one-to-one (see the crate header for the plan).
//!
//! Conventions shared by every function here:
//! - the slice is the valid vocabulary only (padding rows already cut off by the caller);
//! - ordering of tokens is "logit descending, then id ascending" (ties go to the lower id);
//! - NaN logits are never chosen unless nothing else is (then token 0); `-inf` has probability 0;
//! - weights are `exp((l - m) / T)` in f32 ([`exp_f32`]) with `m` the largest logit, summed in
//!   f64.
//!
//! `crates/lily-cuda/kernels/sample.cu` reproduces [`choose`] and [`argmax`] bit for bit, including
//! the order of every f64 sum (`sum_f64`'s eight lanes, `draw_weights`' 1024-token blocks,
//! `nucleus_mask`'s buckets and walks, the top-k path's rank and id orders): change one, change both.

use crate::params::Resolved;
use std::cmp::Ordering;

/// Repetition penalty (transformers/vLLM): for each distinct token in `seen` (prompt + generated),
/// a positive logit is divided by `penalty` and a negative one multiplied by it. Each id must
/// appear once in `seen`; ids outside the slice are ignored.
pub fn apply_repetition_penalty(logits: &mut [f32], penalty: f32, seen: impl IntoIterator<Item = u32>) {
    if penalty == 1.0 {
        return;
    }
    for id in seen {
        if let Some(l) = logits.get_mut(id as usize) {
            *l = if *l > 0.0 { *l / penalty } else { *l * penalty };
        }
    }
}

/// Presence and frequency penalties (OpenAI/vLLM): for each generated token with count `c > 0`,
/// `logit -= presence + frequency * c`. Each id must appear once in `counts`.
pub fn apply_presence_frequency(
    logits: &mut [f32],
    presence: f32,
    frequency: f32,
    counts: impl IntoIterator<Item = (u32, u32)>,
) {
    if presence == 0.0 && frequency == 0.0 {
        return;
    }
    for (id, c) in counts {
        if c == 0 {
            continue;
        }
        if let Some(l) = logits.get_mut(id as usize) {
            *l -= presence + frequency * c as f32;
        }
    }
}

/// Adds each bias to its token's logit (OpenAI `logit_bias`; -100 bans in practice, +100 forces).
pub fn apply_logit_bias(logits: &mut [f32], bias: &[(u32, f32)]) {
    for &(id, b) in bias {
        if let Some(l) = logits.get_mut(id as usize) {
            *l += b;
        }
    }
}

/// Constrained decoding: `mask` has bit `id % 32` of word `id / 32` set when token `id` may come
/// next; every other logit becomes `-inf` (ids past the mask's words too). Applied after the
/// penalties and the bias, just before the choice; `-inf` is absorbing under all three, so the order
/// would not change the result anyway.
pub fn apply_token_mask(logits: &mut [f32], mask: &[u32]) {
    for (w, chunk) in logits.chunks_mut(32).enumerate() {
        let bits = mask.get(w).copied().unwrap_or(0);
        if bits == u32::MAX {
            continue;
        }
        if bits == 0 {
            chunk.fill(f32::NEG_INFINITY);
            continue;
        }
        for (b, l) in chunk.iter_mut().enumerate() {
            if bits >> b & 1 == 0 {
                *l = f32::NEG_INFINITY;
            }
        }
    }
}

/// The choice under a mask when [`choose`] picked a token the mask does not allow, which happens
/// only when every allowed logit is `-inf` or NaN (nothing to draw from): the lowest allowed id
/// below `vocab` (the grammar's word is final). `token` itself otherwise.
pub fn masked_choice(token: u32, mask: &[u32], vocab: usize) -> u32 {
    if mask_allows(mask, token) {
        return token;
    }
    mask.iter()
        .enumerate()
        .find(|(_, &w)| w != 0)
        .map(|(i, &w)| i as u32 * 32 + w.trailing_zeros())
        .filter(|&id| (id as usize) < vocab)
        .unwrap_or(token)
}

/// Whether `mask` allows `id`.
pub fn mask_allows(mask: &[u32], id: u32) -> bool {
    mask.get(id as usize / 32).is_some_and(|w| w >> (id % 32) & 1 == 1)
}

/// The largest logit's id, ties to the lowest id; 0 when every logit is `-inf` or NaN.
pub fn argmax(logits: &[f32]) -> u32 {
    let m = max_logit(logits);
    logits.iter().position(|&l| l == m).unwrap_or(0) as u32
}

/// The largest logit (NaN ignored), with eight lanes so it vectorises.
fn max_logit(logits: &[f32]) -> f32 {
    let mut acc = [f32::NEG_INFINITY; 8];
    let chunks = logits.chunks_exact(8);
    let rest = chunks.remainder();
    for c in chunks {
        for j in 0..8 {
            acc[j] = if c[j] > acc[j] { c[j] } else { acc[j] };
        }
    }
    acc.iter().chain(rest).copied().fold(f32::NEG_INFINITY, |m, l| if l > m { l } else { m })
}

/// `log Σ exp(l)` over the slice (f64 accumulation): the normaliser of the log-softmax.
pub fn log_sum_exp(logits: &[f32]) -> f64 {
    let m = max_logit(logits);
    if !m.is_finite() {
        return m as f64;
    }
    // In blocks, so the weights vectorise without a buffer.
    let mut buf = [0.0f32; 256];
    let mut s = 0.0f64;
    for c in logits.chunks(256) {
        for (b, &l) in buf.iter_mut().zip(c) {
            *b = exp_f32(l - m);
        }
        s += sum_f64(&buf[..c.len()]);
    }
    m as f64 + s.ln()
}

fn by_rank(a: &(f32, u32), b: &(f32, u32)) -> Ordering {
    b.0.partial_cmp(&a.0).unwrap_or(Ordering::Equal).then(a.1.cmp(&b.1))
}

/// The `n` best tokens as `(logit, id)`, sorted best first (logit descending, id ascending). Only
/// logits above `-inf` qualify (NaN never), so fewer than `n` may come back. One pass with a
/// rising threshold and occasional partial selection: no full sort of the vocabulary.
pub fn top_n(logits: &[f32], n: usize, out: &mut Vec<(f32, u32)>) {
    out.clear();
    if n == 0 {
        return;
    }
    let cap = (2 * n).max(64);
    let mut thresh = f32::NEG_INFINITY;
    for (i, &l) in logits.iter().enumerate() {
        // Later ids lose ties, so an entry equal to the current n-th best can be skipped.
        if l > thresh {
            out.push((l, i as u32));
            if out.len() >= cap {
                out.select_nth_unstable_by(n - 1, by_rank);
                out.truncate(n);
                thresh = out[n - 1].0;
            }
        }
    }
    out.sort_unstable_by(by_rank);
    out.truncate(n);
}

/// `e^x` in f32, written out (Cephes' `expf` polynomial, about 1 ulp) so that it vectorises and
/// gives the same bits on every platform; `0` below `-87` (weights under 1.6e-38 of the top
/// token's) and for NaN.
#[inline(always)]
pub fn exp_f32(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    const ROUND: f32 = 12_582_912.0; // 1.5 * 2^23: adding it rounds to an integer (ties to even)
    let xc = x.clamp(-87.0, 88.0);
    let t = xc * LOG2E + ROUND;
    let n = t - ROUND;
    let ni = (t.to_bits() as i32).wrapping_sub(ROUND.to_bits() as i32);
    let r = xc - n * LN2_HI - n * LN2_LO;
    let mut p = 1.987_569_1e-4f32;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 1.666_666_5e-1;
    p = p * r + 0.5;
    let y = p * r * r + r + 1.0;
    let scale = f32::from_bits(((ni + 127) as u32) << 23);
    if x >= -87.0 {
        y * scale
    } else {
        0.0
    }
}

/// A token's unnormalised probability after temperature: `exp((l - m) / t)`, `m` the top logit.
#[inline(always)]
pub fn weight(l: f32, m: f32, t: f32) -> f32 {
    exp_f32((l - m) / t)
}

/// Sum in f64 with eight independent lanes (vectorises).
fn sum_f64(xs: &[f32]) -> f64 {
    let mut acc = [0.0f64; 8];
    let chunks = xs.chunks_exact(8);
    let rest = chunks.remainder();
    for c in chunks {
        for j in 0..8 {
            acc[j] += c[j] as f64;
        }
    }
    acc.iter().sum::<f64>() + rest.iter().map(|&x| x as f64).sum::<f64>()
}

/// Reusable buffers for [`choose`] (a `Sampler` keeps one; nothing in them carries over).
#[derive(Clone, Debug, Default)]
pub struct Scratch {
    cand: Vec<(f32, u32)>,
    w: Vec<f32>,
    blocks: Vec<f64>,
    hist: Vec<f64>,
}

/// Weight buckets for the nucleus: the f32 bits' exponent and top 4 mantissa bits (monotone in
/// the weight, about 4% wide). Weights are in (0, 1], so the index is at most 0x7F0.
const BUCKET_SHIFT: u32 = 19;
const BUCKETS: usize = (0x3F80_0000u32 >> BUCKET_SHIFT) as usize + 1;

#[inline(always)]
fn bucket(w: f32) -> usize {
    (w.to_bits() >> BUCKET_SHIFT) as usize
}

#[inline(always)]
fn ranks_before_or_at(l: f32, id: u32, cut: (f32, u32)) -> bool {
    l > cut.0 || (l == cut.0 && id <= cut.1)
}

/// Top-p over the whole vocabulary without sorting it: histogram the weights into buckets, find
/// the bucket where the mass ranked above first reaches `top_p` of the total, and sort only that
/// bucket's tokens to find the last one kept. Zeroes the weights of the tokens cut.
fn nucleus_mask(logits: &[f32], top_p: f32, s: &mut Scratch) {
    const LANES: usize = 4; // independent histograms, so repeated buckets do not serialise
    s.hist.clear();
    s.hist.resize(LANES * BUCKETS, 0.0);
    let chunks = s.w.chunks_exact(LANES);
    let rest = chunks.remainder();
    for c in chunks {
        for (j, &x) in c.iter().enumerate() {
            s.hist[j * BUCKETS + bucket(x)] += x as f64;
        }
    }
    for &x in rest {
        s.hist[bucket(x)] += x as f64;
    }
    let mass = |b: usize| (0..LANES).map(|j| s.hist[j * BUCKETS + b]).sum::<f64>();
    // Bucket 0 holds zero (and subnormal) weights only: never kept.
    let total: f64 = (1..BUCKETS).rev().map(mass).sum();
    let target = top_p as f64 * total;
    let mut above = 0.0f64;
    let mut edge = 1;
    for b in (1..BUCKETS).rev() {
        let m = mass(b);
        if above + m >= target {
            edge = b;
            break;
        }
        above += m;
    }
    // Sort the edge bucket by rank; keep while the mass ranked above is below the target.
    s.cand.clear();
    for (i, (&x, &l)) in s.w.iter().zip(logits).enumerate() {
        if bucket(x) == edge {
            s.cand.push((l, i as u32));
        }
    }
    s.cand.sort_unstable_by(by_rank);
    let Some(&first) = s.cand.first() else { return };
    let mut cut = first;
    for &(l, id) in &s.cand {
        if above >= target {
            break;
        }
        above += s.w[id as usize] as f64;
        cut = (l, id);
    }
    for (i, (x, &l)) in s.w.iter_mut().zip(logits).enumerate() {
        let b = bucket(*x);
        if b < edge || (b == edge && !ranks_before_or_at(l, i as u32, cut)) {
            *x = 0.0;
        }
    }
}

/// Chooses the next token from processed logits (penalties and bias already applied).
///
/// Greedy (temperature < 1e-5): [`argmax`]. Otherwise, as transformers: weights
/// `exp((l - max) / T)`, then top-k, then top-p on the renormalised top-k survivors (a token is
/// kept while the mass ranked above it is below `top_p` of theirs; the top token always stays),
/// then min-p (keep weights >= `min_p`, the top one's being 1). Each of these keeps a prefix of
/// the rank order (logit descending, then id ascending). Then one inverse-CDF draw: the first kept
/// token, in ascending id order, whose cumulative weight exceeds `u` times the kept mass.
pub fn choose(logits: &[f32], p: &Resolved, u: f64, s: &mut Scratch) -> u32 {
    if p.is_greedy() || logits.is_empty() {
        return argmax(logits);
    }
    let t = p.temperature;
    let n = logits.len();
    let k = p.top_k as usize;
    let m = max_logit(logits);
    if !m.is_finite() {
        // All -inf/NaN, or a +inf logit: no distribution to draw from.
        return argmax(logits);
    }
    if k > 0 && k < n {
        // Top-k: a small sorted candidate list; top-p and min-p cut it further.
        top_n(logits, k, &mut s.cand);
        let mut keep = s.cand.len();
        if p.top_p < 1.0 {
            let total: f64 = s.cand.iter().map(|&(l, _)| weight(l, m, t) as f64).sum();
            let target = p.top_p as f64 * total;
            let mut above = 0.0f64;
            for (j, &(l, _)) in s.cand.iter().enumerate() {
                if above >= target {
                    keep = j;
                    break;
                }
                above += weight(l, m, t) as f64;
            }
        }
        if p.min_p > 0.0 {
            let j = s.cand[..keep].iter().position(|&(l, _)| weight(l, m, t) < p.min_p).unwrap_or(keep);
            keep = keep.min(j.max(1));
        }
        s.cand.truncate(keep);
        s.cand.sort_unstable_by_key(|c| c.1);
        let total: f64 = s.cand.iter().map(|&(l, _)| weight(l, m, t) as f64).sum();
        let target = u * total;
        let mut cum = 0.0f64;
        for &(l, id) in &s.cand {
            cum += weight(l, m, t) as f64;
            if target < cum {
                return id;
            }
        }
        return s.cand.last().map(|c| c.1).unwrap_or(0);
    }
    // The whole vocabulary: weights, the nucleus cut, the min-p cut, the draw.
    s.w.clear();
    s.w.resize(n, 0.0);
    for (x, &l) in s.w.iter_mut().zip(logits) {
        *x = weight(l, m, t);
    }
    if p.top_p < 1.0 {
        nucleus_mask(logits, p.top_p, s);
    }
    if p.min_p > 0.0 {
        let min_p = p.min_p;
        for x in s.w.iter_mut() {
            if *x < min_p {
                *x = 0.0;
            }
        }
    }
    draw_weights(&s.w, u, &mut s.blocks) as u32
}

/// Inverse-CDF draw in id order over non-negative weights: block sums first (the total is their
/// sum in order), then a walk inside the chosen block. Returns the first index whose cumulative
/// weight exceeds `u * total` (rounding fallback: the block's last non-zero weight).
fn draw_weights(w: &[f32], u: f64, blocks: &mut Vec<f64>) -> usize {
    const B: usize = 1024;
    blocks.clear();
    blocks.extend(w.chunks(B).map(sum_f64));
    let total: f64 = blocks.iter().sum();
    let target = u * total;
    let mut cum = 0.0f64;
    let mut chosen = blocks.len() - 1;
    for (b, &bs) in blocks.iter().enumerate() {
        if target < cum + bs {
            chosen = b;
            break;
        }
        cum += bs;
    }
    // The block with the last positive mass, if rounding ran past every block.
    while chosen > 0 && blocks[chosen] <= 0.0 {
        chosen -= 1;
    }
    let start = chosen * B;
    let block = &w[start..(start + B).min(w.len())];
    let rest = target - cum;
    let mut c = 0.0f64;
    let mut last = None;
    for (j, &x) in block.iter().enumerate() {
        if x > 0.0 {
            c += x as f64;
            last = Some(j);
            if rest < c {
                return start + j;
            }
        }
    }
    start + last.unwrap_or(0)
}
