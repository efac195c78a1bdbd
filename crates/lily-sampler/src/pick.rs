//! Device picks: everything [`Sampler::sample`](crate::Sampler::sample) does to one row of logits,
//! as plain data that a GPU kernel can apply ([`DevicePick`], made by
//! [`Sampler::device_pick`](crate::Sampler::device_pick)), and its CPU reference [`pick_on_cpu`].
//!
//! The penalties and the bias become one [`LogitEdit`] per affected token, holding the exact f32
//! operands the CPU path uses, so that a device applying `rep`, then `sub`, then `bias` produces the
//! same bits as [`ops::apply_repetition_penalty`], [`ops::apply_presence_frequency`] and
//! [`ops::apply_logit_bias`] in turn. An operation that does not apply to a token gets an operand
//! that is an exact identity for every f32, -0.0 and NaN included: `rep = 1` (skipped), `sub = +0.0`
//! (`l - (+0) = l` always) and `bias = -0.0` (`l + (-0) = l` always; `l + (+0)` would turn -0.0 into
//! +0.0, which the CPU does only when a request's bias really is +0.0). The random number is drawn on
//! the host as `sample` draws it; the device returns only the chosen id, which the caller then
//! passes to [`Sampler::record`](crate::Sampler::record).

use crate::ops;
use crate::params::Resolved;
use crate::sampler::Sampler;

/// Everything `Sampler::sample` does to one row of logits, as plain data a device can apply.
#[derive(Clone, Debug, PartialEq)]
pub struct DevicePick {
    /// The valid vocabulary: logits at or past it are ignored (never chosen).
    pub vocab: usize,
    /// Temperature, top_k, top_p and min_p as [`ops::choose`] takes them; the penalty fields are
    /// off (folded into `edits`).
    pub params: Resolved,
    /// The draw in [0, 1) (0 when greedy, where none is drawn).
    pub u: f64,
    /// Sorted by id, one per id, every id below `vocab`.
    pub edits: Vec<LogitEdit>,
}

/// What the penalties and the bias do to one token's logit:
/// `if rep != 1 { l = if l > 0 { l / rep } else { l * rep } }; l -= sub; l += bias`, each step one
/// f32 operation rounded to nearest (no fused multiply-add).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LogitEdit {
    pub id: u32,
    /// Repetition penalty (1: none).
    pub rep: f32,
    /// `presence + frequency * count` computed in f32 as [`ops::apply_presence_frequency`] does
    /// (+0.0: none).
    pub sub: f32,
    /// Logit bias (-0.0: none).
    pub bias: f32,
}

impl LogitEdit {
    /// An edit that changes nothing (for any f32, -0.0 and NaN included).
    pub const NONE: LogitEdit = LogitEdit { id: 0, rep: 1.0, sub: 0.0, bias: -0.0 };

    /// The edited logit.
    #[inline]
    pub fn apply(&self, l: f32) -> f32 {
        let mut l = l;
        if self.rep != 1.0 {
            l = if l > 0.0 { l / self.rep } else { l * self.rep };
        }
        l -= self.sub;
        l + self.bias
    }
}

impl Sampler {
    /// The pick for the next step, consuming the random number [`Sampler::sample`] would (none when
    /// greedy). `None` when the request wants logprobs (the host needs the logits then), or when its
    /// `logit_bias` names a token twice (the CPU adds both biases in turn, which one edit cannot
    /// express); nothing is consumed then. The caller must then [`Sampler::record`] the token the
    /// device chose, as `sample` records its own.
    pub fn device_pick(&mut self) -> Option<DevicePick> {
        if self.wants_logprobs() {
            return None;
        }
        let vocab = self.vocab();
        let p = *self.params();
        let mut bias_ids: Vec<u32> = self.bias().iter().map(|&(id, _)| id).collect();
        bias_ids.sort_unstable();
        if bias_ids.windows(2).any(|w| w[0] == w[1]) {
            return None;
        }
        let mut edits: Vec<LogitEdit> = Vec::new();
        let valid = |id: u32| (id as usize) < vocab;
        // Same conditions as ops::apply_repetition_penalty / apply_presence_frequency.
        if p.repetition_penalty != 1.0 {
            edits.extend(self.seen_ids().copied().filter(|&id| valid(id)).map(|id| LogitEdit {
                id,
                rep: p.repetition_penalty,
                ..LogitEdit::NONE
            }));
        }
        if p.presence_penalty != 0.0 || p.frequency_penalty != 0.0 {
            edits.extend(self.counts_map().iter().filter(|&(&id, &c)| c > 0 && valid(id)).map(|(&id, &c)| LogitEdit {
                id,
                sub: p.presence_penalty + p.frequency_penalty * c as f32,
                ..LogitEdit::NONE
            }));
        }
        edits.extend(self.bias().iter().filter(|&&(id, _)| valid(id)).map(|&(id, bias)| LogitEdit {
            id,
            bias,
            ..LogitEdit::NONE
        }));
        // One edit per id: each id appears at most once per kind, so merging takes each kind's
        // operand from the edit that has it.
        edits.sort_unstable_by_key(|e| e.id);
        let mut merged: Vec<LogitEdit> = Vec::with_capacity(edits.len());
        for e in edits {
            match merged.last_mut() {
                Some(m) if m.id == e.id => {
                    if e.rep != 1.0 {
                        m.rep = e.rep;
                    }
                    if e.sub.to_bits() != 0 {
                        m.sub = e.sub;
                    }
                    if e.bias.to_bits() != LogitEdit::NONE.bias.to_bits() {
                        m.bias = e.bias;
                    }
                }
                _ => merged.push(e),
            }
        }
        let u = if p.is_greedy() { 0.0 } else { self.next_u() };
        let params = Resolved { presence_penalty: 0.0, frequency_penalty: 0.0, repetition_penalty: 1.0, ..p };
        Some(DevicePick { vocab, params, u, edits: merged })
    }
}

/// The CPU reference of a device pick: applies the edits to `logits[..pick.vocab]` (in place; ids
/// at or past `vocab` are ignored) and [`ops::choose`]s with `pick.u` (greedy: the argmax).
pub fn pick_on_cpu(logits: &mut [f32], pick: &DevicePick) -> u32 {
    pick_on_cpu_masked(logits, pick, None)
}

/// [`pick_on_cpu`] under a token mask (constrained decoding): the edits, then every token the mask
/// does not allow set to `-inf` ([`ops::apply_token_mask`]; `mask` has `pick.vocab.div_ceil(32)`
/// words), then [`ops::choose`] ([`ops::masked_choice`]: the lowest allowed id when every allowed
/// logit is `-inf` or NaN). The reference a device applying a mask must match: the same token
/// as [`Sampler::sample_masked`](crate::Sampler::sample_masked) on the same logits and mask.
pub fn pick_on_cpu_masked(logits: &mut [f32], pick: &DevicePick, mask: Option<&[u32]>) -> u32 {
    assert!(
        logits.len() >= pick.vocab,
        "logits have {} entries, fewer than the vocabulary's {}",
        logits.len(),
        pick.vocab
    );
    let logits = &mut logits[..pick.vocab];
    for e in &pick.edits {
        if let Some(l) = logits.get_mut(e.id as usize) {
            *l = e.apply(*l);
        }
    }
    match mask {
        None => ops::choose(logits, &pick.params, pick.u, &mut ops::Scratch::default()),
        Some(mask) => {
            ops::apply_token_mask(logits, mask);
            let token = ops::choose(logits, &pick.params, pick.u, &mut ops::Scratch::default());
            ops::masked_choice(token, mask, pick.vocab)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Defaults, SamplingParams};

    /// xorshift64* with Box–Muller normals: test inputs only.
    struct Gen(u64);
    impl Gen {
        fn u64(&mut self) -> u64 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
        }
        fn uniform(&mut self) -> f64 {
            ((self.u64() >> 11) as f64 + 0.5) / (1u64 << 53) as f64
        }
        fn below(&mut self, n: usize) -> usize {
            (self.u64() % n as u64) as usize
        }
        fn normal(&mut self) -> f64 {
            let (a, b) = (self.uniform(), self.uniform());
            (-2.0 * a.ln()).sqrt() * (2.0 * std::f64::consts::PI * b).cos()
        }
    }

    /// A logits row of `n` (plus `pad` padding entries) in one of several styles: normals of
    /// different scales, quantised values (ties), a few -inf and NaN, zeros of both signs.
    fn row(g: &mut Gen, n: usize, pad: usize, style: usize) -> Vec<f32> {
        let mut r: Vec<f32> = (0..n)
            .map(|_| match style % 5 {
                0 => g.normal() as f32,
                1 => (g.normal() * 4.0) as f32,
                2 => ((g.normal() * 8.0).round() / 4.0) as f32,
                3 => (g.normal() * 0.05) as f32,
                _ => {
                    let x = g.uniform();
                    (x * x * x * 25.0 - 5.0) as f32
                }
            })
            .collect();
        if style % 3 == 1 {
            for _ in 0..3 {
                let i = g.below(n);
                r[i] = f32::NEG_INFINITY;
            }
            let i = g.below(n);
            r[i] = f32::NAN;
        }
        if style % 4 == 2 {
            let (a, b) = (g.below(n), g.below(n));
            r[a] = 0.0;
            r[b] = -0.0;
        }
        r.extend((0..pad).map(|_| 1e6f32)); // padding: huge, never chosen
        r
    }

    fn params_sets() -> Vec<SamplingParams> {
        let d = SamplingParams::default;
        let bias = vec![(3, 2.5), (7, -100.0), (11, 0.0), (12, -0.0), (40, 100.0)];
        vec![
            SamplingParams { temperature: Some(0.0), ..d() },
            SamplingParams {
                temperature: Some(0.0),
                repetition_penalty: Some(1.3),
                presence_penalty: Some(0.5),
                ..d()
            },
            d(),
            SamplingParams { temperature: Some(0.3), ..d() },
            SamplingParams { temperature: Some(2.0), ..d() },
            SamplingParams { top_k: Some(1), ..d() },
            SamplingParams { top_k: Some(5), ..d() },
            SamplingParams { top_k: Some(40), temperature: Some(0.7), ..d() },
            SamplingParams { top_p: Some(0.1), ..d() },
            SamplingParams { top_p: Some(0.9), ..d() },
            SamplingParams { top_p: Some(0.999), temperature: Some(1.5), ..d() },
            SamplingParams { min_p: Some(0.05), ..d() },
            SamplingParams { top_k: Some(40), top_p: Some(0.9), min_p: Some(0.05), ..d() },
            SamplingParams { top_p: Some(0.8), min_p: Some(0.1), ..d() },
            SamplingParams { repetition_penalty: Some(1.5), ..d() },
            SamplingParams { repetition_penalty: Some(0.7), top_p: Some(0.95), ..d() },
            SamplingParams { presence_penalty: Some(1.0), frequency_penalty: Some(0.5), ..d() },
            SamplingParams { presence_penalty: Some(-2.0), frequency_penalty: Some(-0.3), top_k: Some(20), ..d() },
            SamplingParams { logit_bias: bias.clone(), ..d() },
            SamplingParams {
                logit_bias: bias,
                repetition_penalty: Some(1.2),
                frequency_penalty: Some(0.4),
                top_p: Some(0.95),
                top_k: Some(50),
                temperature: Some(0.8),
                ..d()
            },
        ]
    }

    /// A sampler driven through `device_pick` + `pick_on_cpu` + `record` chooses the same tokens as a
    /// clone driven through `sample`, for many rows, parameter sets, seeds and vocabularies.
    #[test]
    fn device_pick_replays_sample() {
        let mut g = Gen(0x1234_5678_9ABC_DEF1);
        let mut cases = 0;
        for (pi, p) in params_sets().into_iter().enumerate() {
            for &(vocab, pad) in &[(50usize, 0usize), (300, 13), (1000, 24)] {
                for seed in 0..3u64 {
                    let p = SamplingParams { seed: Some(seed * 7919 + pi as u64), ..p.clone() };
                    let mut a = Sampler::new(&p, &Defaults::default(), vocab).unwrap();
                    let prompt: Vec<u32> = (0..20).map(|_| g.below(vocab + 5) as u32).collect();
                    a.observe_prompt(&prompt);
                    let mut b = a.clone();
                    for step in 0..25 {
                        let logits = row(&mut g, vocab, pad, step + seed as usize + pi);
                        let want = a.sample(&mut logits.clone()).token;
                        let pick = b.device_pick().expect("no logprobs: a device pick");
                        assert_eq!(pick.vocab, vocab);
                        assert!(pick.edits.windows(2).all(|w| w[0].id < w[1].id));
                        assert!(pick.edits.iter().all(|e| (e.id as usize) < vocab));
                        if pick.params.is_greedy() {
                            assert_eq!(pick.u, 0.0);
                        }
                        let got = pick_on_cpu(&mut logits.clone(), &pick);
                        b.record(got);
                        assert_eq!(got, want, "params {pi} vocab {vocab} seed {seed} step {step}: {pick:?}");
                        cases += 1;
                    }
                }
            }
        }
        assert!(cases > 4000);
    }

    /// The edits hold the CPU's exact operands: applying them equals the three `ops::apply_*` calls
    /// bit for bit, on values that include ±0, ±inf, NaN and subnormals.
    #[test]
    fn edits_equal_the_cpu_operations_bit_for_bit() {
        let specials = [
            0.0f32,
            -0.0,
            1.0,
            -1.0,
            3.5,
            -7.25,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            1e-40,
            -1e-40,
            1e30,
            -1e30,
        ];
        let d = SamplingParams::default;
        for p in [
            SamplingParams {
                repetition_penalty: Some(1.3),
                presence_penalty: Some(0.5),
                frequency_penalty: Some(0.25),
                ..d()
            },
            SamplingParams { repetition_penalty: Some(0.5), ..d() },
            SamplingParams { presence_penalty: Some(-0.0), frequency_penalty: Some(0.7), ..d() },
            SamplingParams { logit_bias: vec![(0, 0.0), (1, -0.0), (2, 5.0)], ..d() },
            d(),
        ] {
            let n = specials.len();
            let mut s =
                Sampler::new(&SamplingParams { temperature: Some(0.0), ..p.clone() }, &Defaults::default(), n).unwrap();
            s.observe_prompt(&[0, 2, 4, 6, 8, 10, 12]);
            for t in [1u32, 1, 3, 5, 1, 7, 9, 11, 0] {
                s.record(t);
            }
            let pick = s.device_pick().unwrap();
            // Every row rotation, so each special value meets each kind of edit.
            for rot in 0..n {
                let raw: Vec<f32> = (0..n).map(|i| specials[(i + rot) % n]).collect();
                let mut want = raw.clone();
                let mut c = s.clone();
                // The CPU path: `sample` on a clone applies the penalties and bias in place.
                c.sample(&mut want);
                let mut got = raw.clone();
                for e in &pick.edits {
                    got[e.id as usize] = e.apply(got[e.id as usize]);
                }
                let bits =
                    |v: &[f32]| v.iter().map(|x| if x.is_nan() { u32::MAX } else { x.to_bits() }).collect::<Vec<_>>();
                assert_eq!(bits(&got), bits(&want), "{p:?} rotation {rot}");
            }
        }
        // The identity edit is exact on every special value.
        for x in specials {
            let y = LogitEdit::NONE.apply(x);
            assert!(y.to_bits() == x.to_bits() || (x.is_nan() && y.is_nan()), "{x} -> {y}");
        }
    }

    /// A random mask over `vocab` tokens in one of several shapes: one token, a handful, about
    /// half, all but one, all; never empty.
    fn mask(g: &mut Gen, vocab: usize, shape: usize) -> Vec<u32> {
        let ids: Vec<usize> = match shape % 5 {
            0 => vec![g.below(vocab)],
            1 => (0..5).map(|_| g.below(vocab)).collect(),
            2 => {
                let extra = g.below(vocab);
                let mut v: Vec<usize> = (0..vocab).filter(|_| g.below(2) == 0).collect();
                v.push(extra);
                v
            }
            3 => {
                let skip = g.below(vocab);
                (0..vocab).filter(|&i| i != skip || vocab == 1).collect()
            }
            _ => (0..vocab).collect(),
        };
        let mut m = vec![0u32; vocab.div_ceil(32)];
        for id in ids {
            m[id / 32] |= 1 << (id % 32);
        }
        m
    }

    /// Under a mask, the device pick's CPU reference chooses what `sample_masked` chooses, and the
    /// token is always one the mask allows.
    #[test]
    fn masked_device_pick_replays_masked_sample_and_obeys_the_mask() {
        let mut g = Gen(0x0BAD_CAFE_1234_5678);
        let mut cases = 0;
        for (pi, p) in params_sets().into_iter().enumerate() {
            for &(vocab, pad) in &[(50usize, 0usize), (300, 13), (1000, 24)] {
                let p = SamplingParams { seed: Some(31 * pi as u64 + vocab as u64), ..p.clone() };
                let mut a = Sampler::new(&p, &Defaults::default(), vocab).unwrap();
                a.observe_prompt(&[1, 2, 3, 5, 8, 13]);
                let mut b = a.clone();
                for step in 0..20 {
                    let logits = row(&mut g, vocab, pad, step + pi);
                    let m = mask(&mut g, vocab, step);
                    let want = a.sample_masked(&mut logits.clone(), Some(&m)).token;
                    assert!(ops::mask_allows(&m, want), "params {pi} vocab {vocab} step {step}: {want} is masked out");
                    let pick = b.device_pick().unwrap();
                    let got = pick_on_cpu_masked(&mut logits.clone(), &pick, Some(&m));
                    b.record(got);
                    assert_eq!(got, want, "params {pi} vocab {vocab} step {step}");
                    cases += 1;
                }
            }
        }
        assert!(cases > 1000);
    }

    /// The mask sets exactly the disallowed logits to -inf, padding included, and an all-ones mask
    /// changes nothing.
    #[test]
    fn apply_token_mask_is_exact() {
        let mut g = Gen(77);
        for vocab in [1usize, 31, 32, 33, 100, 1000] {
            let raw = row(&mut g, vocab, 0, 0);
            let m = mask(&mut g, vocab, 2);
            let mut got = raw.clone();
            ops::apply_token_mask(&mut got, &m);
            for (i, (&x, &y)) in raw.iter().zip(&got).enumerate() {
                if ops::mask_allows(&m, i as u32) {
                    assert_eq!(x.to_bits(), y.to_bits());
                } else {
                    assert_eq!(y, f32::NEG_INFINITY);
                }
            }
            // Logits past the mask's words are disallowed.
            let mut long = raw.clone();
            long.extend([5.0f32; 40]);
            ops::apply_token_mask(&mut long, &m);
            assert!(long[vocab.div_ceil(32) * 32..].iter().all(|&l| l == f32::NEG_INFINITY));
            let ones = vec![u32::MAX; vocab.div_ceil(32)];
            let mut same = raw.clone();
            ops::apply_token_mask(&mut same, &ones);
            assert!(same.iter().zip(&raw).all(|(a, b)| a.to_bits() == b.to_bits()));
        }
    }

    #[test]
    fn logprobs_and_duplicate_biases_stay_on_the_host() {
        let d = SamplingParams::default;
        let mut s = Sampler::new(&SamplingParams { logprobs: true, ..d() }, &Defaults::default(), 10).unwrap();
        assert!(s.device_pick().is_none());
        let p = SamplingParams { logit_bias: vec![(3, 1.0), (3, 2.0)], seed: Some(5), ..d() };
        let mut s = Sampler::new(&p, &Defaults::default(), 10).unwrap();
        let mut c = s.clone();
        assert!(s.device_pick().is_none());
        // Nothing was consumed: the random stream is where it was.
        let row = [0.5f32; 10];
        assert_eq!(s.sample(&mut row.clone()), c.sample(&mut row.clone()));
    }
}
