//! `lily bench`: prefill and decode throughput over a sweep of lengths, on any backend.
//!
//! For each length L: size a fresh session for L + decode_tokens + 1 positions (`Backend::reserve`,
//! inside the timed prefill, as a request does), prefill it with L random token ids, chunked as serving chunks
//! (`Backend::prefill_chunk`; the last chunk gives the next token as serving does: the engine's own
//! `prefill_and_next`), `repeats` times; then, from a copy of that state, decode `decode_tokens`
//! tokens greedily through the engine's `next_token` (chosen on the device when the backend picks
//! there), `repeats` times. Each figure is the median of its repeats. One short
//! warm-up run comes first (kernel loading, allocator warm-up). Random ids make the routing of a
//! trained model's experts more even than real text would; say so beside the figures.

use std::time::Instant;

use lily_model::Backend;
use lily_sampler::rng::Rng;
use lily_sampler::{Defaults, Sampler, SamplingParams};
use serde::Serialize;

use crate::generate::{next_token, prefill_and_next, GenError};

/// The default sweep: 256 to 128K tokens.
pub const DEFAULT_LENGTHS: [usize; 10] = [256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072];

#[derive(Clone, Debug)]
pub struct BenchSpec {
    pub lengths: Vec<usize>,
    pub decode_tokens: usize,
    pub repeats: usize,
    pub seed: u64,
}

impl Default for BenchSpec {
    fn default() -> Self {
        BenchSpec { lengths: DEFAULT_LENGTHS.to_vec(), decode_tokens: 64, repeats: 3, seed: 0 }
    }
}

/// One length's figures (medians over the repeats; the raw seconds are kept too).
#[derive(Clone, Debug, Serialize)]
pub struct BenchRow {
    pub length: usize,
    pub prefill_tok_s: f64,
    pub decode_tok_s: f64,
    pub prefill_seconds: Vec<f64>,
    pub decode_seconds: Vec<f64>,
    pub decode_tokens: usize,
}

fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(|a, b| a.total_cmp(b));
    if s.is_empty() {
        return f64::NAN;
    }
    let n = s.len();
    if n % 2 == 1 {
        s[n / 2]
    } else {
        0.5 * (s[n / 2 - 1] + s[n / 2])
    }
}

/// Seeded random ids below `vocab`.
fn random_ids(n: usize, vocab: usize, seed: u64) -> Vec<u32> {
    let mut rng = Rng::from_seed(seed);
    (0..n).map(|_| (rng.next_u64() % vocab as u64) as u32).collect()
}

/// Measures every length of `spec`; `on_row` sees each row as it is measured.
pub fn bench<B: Backend>(b: &mut B, spec: &BenchSpec, mut on_row: impl FnMut(&BenchRow)) -> Result<Vec<BenchRow>, GenError> {
    let vocab = b.config().vocab_size;
    let greedy = SamplingParams { temperature: Some(0.0), ..Default::default() };
    let mut sampler = Sampler::new(&greedy, &Defaults::default(), vocab)?;
    let repeats = spec.repeats.max(1);
    // Warm-up.
    {
        let mut s = b.new_state();
        let ids = random_ids(64.min(spec.lengths.iter().copied().min().unwrap_or(64)).max(1), vocab, spec.seed ^ 0xABCD);
        let mut t = prefill_and_next(b, &mut s, &mut sampler, &ids)?.token;
        for _ in 0..4 {
            t = next_token(b, &mut s, &mut sampler, &[t])?.token;
        }
    }
    let mut rows = Vec::new();
    for (li, &len) in spec.lengths.iter().enumerate() {
        let ids = random_ids(len, vocab, spec.seed.wrapping_add(li as u64));
        let mut prefill_seconds = Vec::new();
        let mut kept = None;
        for _ in 0..repeats {
            // As serving does: the session sized for the prompt and its decode, then the prefill.
            let mut s = b.new_state();
            let t0 = Instant::now();
            b.reserve(&mut s, len + spec.decode_tokens + 1)?;
            let next = prefill_and_next(b, &mut s, &mut sampler, &ids)?.token;
            prefill_seconds.push(t0.elapsed().as_secs_f64());
            kept = Some((s, next));
        }
        let (after, first) = kept.expect("at least one repeat");
        let mut decode_seconds = Vec::new();
        for _ in 0..repeats {
            let mut s = after.clone(); // a clone keeps only the positions held: size it again
            b.reserve(&mut s, len + spec.decode_tokens + 1)?;
            let mut t = first;
            let t0 = Instant::now();
            for _ in 0..spec.decode_tokens {
                t = next_token(b, &mut s, &mut sampler, &[t])?.token;
            }
            decode_seconds.push(t0.elapsed().as_secs_f64());
        }
        let row = BenchRow {
            length: len,
            prefill_tok_s: len as f64 / median(&prefill_seconds),
            decode_tok_s: spec.decode_tokens as f64 / median(&decode_seconds),
            prefill_seconds,
            decode_seconds,
            decode_tokens: spec.decode_tokens,
        };
        on_row(&row);
        rows.push(row);
    }
    Ok(rows)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_of_odd_and_even() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), 2.5);
    }

    #[test]
    fn random_ids_stay_in_the_vocabulary_and_vary() {
        let ids = random_ids(1000, 37, 5);
        assert!(ids.iter().all(|&i| i < 37));
        assert!(ids.iter().collect::<std::collections::HashSet<_>>().len() > 30);
        assert_eq!(ids, random_ids(1000, 37, 5));
    }
}
