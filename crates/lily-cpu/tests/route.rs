//! Tests of the MoE router's selection (`lily_cpu::moe::route`) against its definition in f64: the
//! softmax over all experts, the k largest probabilities (ties to the lower index), and with
//! renormalisation each chosen probability over the chosen ones' sum. The renormalised form computes
//! only the chosen exponentials and picks by logit, so these tests are what hold it to the softmax
//! form it replaces: the picks must be the same experts in the same order, and each weight within
//! 1e-6 relative (the f32 roundings of the two forms differ by a few ulp; a wrong pick, a weight
//! not renormalised or renormalised over the wrong set is off by far more). Logits are fresh random
//! normals (never zeros) with exact ties planted, large magnitudes (probabilities underflow), and
//! all-equal rows.

use lily_cpu::moe::route;

mod common;

use common::Rng;

/// A normal draw, never zero (the row styles need no exact zeros).
fn nonzero_normal(rng: &mut Rng, std: f64) -> f32 {
    let v = rng.normal(std);
    if v == 0.0 { 0.375 } else { v }
}

/// The definition in f64: (expert, weight) of the k largest softmax probabilities, best first, ties
/// to the lower index; renormalised over the chosen ones when asked.
fn definition(row: &[f32], k: usize, renormalise: bool) -> Vec<(usize, f64)> {
    let m = row.iter().fold(f64::NEG_INFINITY, |a, &b| a.max(b as f64));
    let ex: Vec<f64> = row.iter().map(|&v| (v as f64 - m).exp()).collect();
    let sum: f64 = ex.iter().sum();
    let mut idx: Vec<usize> = (0..row.len()).collect();
    idx.sort_by(|&a, &b| ex[b].total_cmp(&ex[a]).then(a.cmp(&b)));
    idx.truncate(k);
    let total: f64 = idx.iter().map(|&i| ex[i]).sum();
    idx.into_iter().map(|i| (i, if renormalise { ex[i] / total } else { ex[i] / sum })).collect()
}

fn check(row: &[f32], k: usize, renormalise: bool, what: &str) {
    let got = &route(row, row.len(), k, renormalise)[0];
    let want = definition(row, k, renormalise);
    let got_idx: Vec<usize> = got.iter().map(|p| p.0).collect();
    let want_idx: Vec<usize> = want.iter().map(|p| p.0).collect();
    assert_eq!(got_idx, want_idx, "{what}: picks");
    for (&(i, g), &(_, w)) in got.iter().zip(&want) {
        let err = (g as f64 - w).abs();
        assert!(err <= 1e-6 * w.abs() + f32::MIN_POSITIVE as f64, "{what}: expert {i} weight {g} vs {w}");
    }
}

#[test]
fn route_matches_the_softmax_definition() {
    let mut rng = Rng::new(11);
    for (e, k) in [(256usize, 8usize), (64, 4), (8, 2), (8, 8), (1, 1)] {
        for case in 0..40 {
            let std = [1.0, 3.0, 0.1][case % 3];
            let mut row: Vec<f32> = (0..e).map(|_| nonzero_normal(&mut rng, std)).collect();
            if case % 2 == 1 && e > 1 {
                // Exact ties: the largest at a lower and a higher index, and copies elsewhere.
                let am = (0..e).fold(0, |b, i| if row[i] > row[b] { i } else { b });
                let (lo, hi) = (rng.below(e), rng.below(e));
                row[lo] = row[am];
                row[hi] = row[am];
                for _ in 0..e / 4 + 1 {
                    let (a, b) = (rng.below(e), rng.below(e));
                    row[b] = row[a];
                }
            }
            for renorm in [true, false] {
                check(&row, k, renorm, &format!("e {e} k {k} case {case} renorm {renorm}"));
            }
        }
    }
}

#[test]
fn renormalised_route_picks_by_logit_where_probabilities_underflow() {
    // std 1000: all but the largest few probabilities underflow to 0 in f32 (and tie there); the
    // renormalised form still picks the k largest logits, best first, and weighs the underflowed ones 0.
    let mut rng = Rng::new(5);
    for _ in 0..20 {
        let row: Vec<f32> = (0..256).map(|_| nonzero_normal(&mut rng, 1000.0)).collect();
        let got = &route(&row, 256, 8, true)[0];
        let mut by_logit: Vec<usize> = (0..256).collect();
        by_logit.sort_by(|&a, &b| row[b].total_cmp(&row[a]).then(a.cmp(&b)));
        assert_eq!(got.iter().map(|p| p.0).collect::<Vec<_>>(), by_logit[..8].to_vec());
        let want = definition(&row, 8, true);
        for (&(_, g), &(_, w)) in got.iter().zip(&want) {
            assert!((g as f64 - w).abs() <= 1e-6 * w + f32::MIN_POSITIVE as f64, "weight {g} vs {w}");
        }
        let underflowed = got.iter().filter(|p| p.1 == 0.0).count();
        assert!(underflowed > 0, "std 1000 should underflow some chosen weights: {got:?}");
    }
}

#[test]
fn all_equal_logits_pick_the_first_k_equally() {
    for renorm in [true, false] {
        let got = &route(&[0.75f32; 16], 16, 4, renorm)[0];
        assert_eq!(got.iter().map(|p| p.0).collect::<Vec<_>>(), vec![0, 1, 2, 3]);
        let w = if renorm { 0.25 } else { 1.0 / 16.0 };
        assert!(got.iter().all(|p| p.1 == w), "renorm {renorm}: {got:?}");
    }
}
