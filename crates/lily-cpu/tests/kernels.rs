//! Tests of the matrix-product kernels (`lily_cpu::kernels`, through `lily_cpu::linear`): every
//! compilation this CPU runs (AVX2 and portable) against a plain scalar loop of the definition (the
//! dequantisation `s·q + b`, then the eight-lane dot product in its fixed order), on fresh random
//! codes, scales, biases and activations (never zeros), for 4- and 8-bit codes, every group size,
//! bf16/f16/f32 scales, dense bf16/f32 rows (odd widths too), stacks, and token counts that take
//! each path (one token, serial tiles, the split by rows, the split by tokens). The kernels promise
//! the same bits as the definition, so the comparison is exact: a lane summed out of order, a
//! dropped tail row or token, or a wrong code would show.

use half::{bf16, f16};
use lily_cpu::kernels::Isa;
use lily_cpu::linear::{dequantize_row, embed_row, matmul_with};
use lily_model::affine::AffineParams;
use lily_model::buf::{Buf, FloatBuf};
use lily_model::weights::{Matrix, Storage};

mod common;

use common::Rng;

#[derive(Clone, Copy, Debug)]
enum Dtype {
    Bf16,
    F16,
    F32,
}

fn float_buf(v: &[f32], dt: Dtype) -> FloatBuf {
    match dt {
        Dtype::Bf16 => FloatBuf::Bf16(Buf::owned(v.iter().map(|&x| bf16::from_f32(x)).collect())),
        Dtype::F16 => FloatBuf::F16(Buf::owned(v.iter().map(|&x| f16::from_f32(x)).collect())),
        Dtype::F32 => FloatBuf::F32(Buf::owned(v.to_vec())),
    }
}

/// A random affine stack: every code drawn uniformly (all bit patterns occur), scales and biases
/// normal and never zero.
fn affine(rng: &mut Rng, count: usize, rows: usize, cols: usize, bits: u32, group: usize, dt: Dtype) -> Matrix {
    let words = count * rows * cols * bits as usize / 32;
    let packed: Vec<u32> = (0..words).map(|_| rng.next_u64() as u32).collect();
    let groups = count * rows * cols / group;
    let nonzero = |v: f32| if v.abs() < 1e-3 { 1e-3 } else { v };
    let scales: Vec<f32> = rng.normals(groups, 0.02).into_iter().map(nonzero).collect();
    let biases: Vec<f32> = rng.normals(groups, 0.1).into_iter().map(nonzero).collect();
    Matrix {
        count,
        rows,
        cols,
        storage: Storage::Affine {
            params: AffineParams::new(bits, group),
            packed: Buf::owned(packed),
            scales: float_buf(&scales, dt),
            biases: float_buf(&biases, dt),
        },
    }
}

fn dense(rng: &mut Rng, count: usize, rows: usize, cols: usize, dt: Dtype) -> Matrix {
    let v = rng.normals(count * rows * cols, 0.1);
    Matrix { count, rows, cols, storage: Storage::Dense(float_buf(&v, dt)) }
}

/// The definition, one element at a time: row `m · rows + r` as f32.
fn reference_row(w: &Matrix, m: usize, r: usize) -> Vec<f32> {
    let row = m * w.rows + r;
    let cols = w.cols;
    match &w.storage {
        Storage::Dense(d) => (0..cols).map(|c| d.get(row * cols + c)).collect(),
        Storage::Affine { params, packed, scales, biases } => {
            let groups = cols / params.group_size;
            (0..cols)
                .map(|c| {
                    let q = lily_model::affine::code(&packed[row * cols * params.bits as usize / 32..], c, params.bits);
                    let g = row * groups + c / params.group_size;
                    scales.get(g) * q as f32 + biases.get(g)
                })
                .collect()
        }
    }
}

/// The definition of the dot product: eight lane sums in column order, combined, then the tail.
fn reference_dot(w: &[f32], x: &[f32]) -> f32 {
    let c8 = w.len() / 8 * 8;
    let mut acc = [0f32; 8];
    for c in 0..c8 {
        acc[c % 8] += w[c] * x[c];
    }
    let mut s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for c in c8..w.len() {
        s += w[c] * x[c];
    }
    s
}

fn reference_matmul(w: &Matrix, m: usize, x: &[f32]) -> Vec<f32> {
    let t = x.len() / w.cols;
    let rows: Vec<Vec<f32>> = (0..w.rows).map(|r| reference_row(w, m, r)).collect();
    let mut y = vec![0f32; t * w.rows];
    for ti in 0..t {
        for (r, row) in rows.iter().enumerate() {
            y[ti * w.rows + r] = reference_dot(row, &x[ti * w.cols..(ti + 1) * w.cols]);
        }
    }
    y
}

/// Bit-for-bit equality, with the first difference named.
fn assert_same_bits(what: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    if let Some(i) = (0..got.len()).find(|&i| got[i].to_bits() != want[i].to_bits()) {
        panic!("{what}: element {i} of {} is {:e}, the definition gives {:e}", got.len(), got[i], want[i]);
    }
    assert!(want.iter().any(|v| *v != 0.0), "{what}: an all-zero reference proves nothing");
}

fn check_products(what: &str, w: &Matrix, rng: &mut Rng, tokens: &[usize]) {
    for m in [0, w.count - 1] {
        for &t in tokens {
            let x = rng.normals(t * w.cols, 1.0);
            let want = reference_matmul(w, m, &x);
            for isa in Isa::available() {
                let mut y = vec![f32::NAN; t * w.rows];
                matmul_with(isa, w, m, &x, &mut y);
                assert_same_bits(&format!("{what}, matrix {m}, T={t}, {isa:?}"), &y, &want);
            }
        }
    }
}

#[test]
fn the_simd_paths_are_tested_where_the_cpu_has_them() {
    let isas = Isa::available();
    assert_eq!(isas[0], Isa::Portable);
    #[cfg(target_arch = "x86_64")]
    {
        let avx2 = std::arch::is_x86_feature_detected!("avx2");
        let avx512 = avx2 && std::arch::is_x86_feature_detected!("avx512f");
        assert_eq!(isas.contains(&Isa::Avx2), avx2);
        assert_eq!(isas.contains(&Isa::Avx512), avx512);
        assert_eq!(Isa::best(), *isas.last().unwrap());
    }
}

#[test]
fn affine_rows_expand_as_the_definition() {
    let mut rng = Rng::new(1);
    for bits in [4, 8] {
        for group in [32, 64, 128] {
            for dt in [Dtype::Bf16, Dtype::F16, Dtype::F32] {
                let w = affine(&mut rng, 2, 5, 256, bits, group, dt);
                for (m, r) in [(0, 0), (0, 4), (1, 2)] {
                    let want = reference_row(&w, m, r);
                    let mut got = vec![f32::NAN; w.cols];
                    dequantize_row(&w, m, r, &mut got);
                    assert_same_bits(&format!("{bits}-bit g{group} {dt:?} row {m}/{r}"), &got, &want);
                    for isa in Isa::available() {
                        got.fill(f32::NAN);
                        lily_cpu::kernels::expand_row(isa, &w, m, r, &mut got);
                        assert_same_bits(&format!("{bits}-bit g{group} {dt:?} row {m}/{r} {isa:?}"), &got, &want);
                    }
                }
                let mut e = vec![f32::NAN; w.cols];
                embed_row(&w, 3, &mut e);
                assert_same_bits("embedding row", &e, &reference_row(&w, 0, 3));
            }
        }
    }
}

#[test]
fn one_token_products_match_the_definition() {
    let mut rng = Rng::new(2);
    for bits in [4, 8] {
        for group in [32, 64, 128] {
            // 13 rows: three groups of four and a tail row; 2048 rows: split over the threads.
            for rows in [1, 13, 2048] {
                let w = affine(&mut rng, 2, rows, 256, bits, group, Dtype::Bf16);
                check_products(&format!("{bits}-bit g{group}, {rows} rows"), &w, &mut rng, &[1]);
            }
        }
    }
}

#[test]
fn many_token_products_match_the_definition() {
    let mut rng = Rng::new(3);
    for bits in [4, 8] {
        // T = 2..7 cover every tile remainder; 40 tokens of 1024 rows split by rows, 300 tokens of
        // 64 rows split by tokens; 17 rows leave a tail after the tiles and the row blocks.
        let w = affine(&mut rng, 3, 17, 128, bits, 64, Dtype::Bf16);
        check_products(&format!("{bits}-bit, 17 rows"), &w, &mut rng, &[2, 3, 4, 5, 6, 7, 40]);
        let w = affine(&mut rng, 1, 1024, 256, bits, 64, Dtype::F32);
        check_products(&format!("{bits}-bit, 1024 rows"), &w, &mut rng, &[5, 40]);
        let w = affine(&mut rng, 1, 64, 512, bits, 128, Dtype::Bf16);
        check_products(&format!("{bits}-bit, 64 rows"), &w, &mut rng, &[300]);
    }
}

#[test]
fn dense_products_match_the_definition() {
    let mut rng = Rng::new(4);
    for dt in [Dtype::Bf16, Dtype::F16, Dtype::F32] {
        // 13 columns: one lane block and a tail of five products added one by one.
        for (rows, cols) in [(9, 13), (6, 256), (1024, 256)] {
            let w = dense(&mut rng, 2, rows, cols, dt);
            check_products(&format!("dense {dt:?} {rows}x{cols}"), &w, &mut rng, &[1, 2, 7, 40]);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Timing at the demo model's shapes (run explicitly, in release).

/// `reps` calls of `f`: the fastest call's wall time, and the least process CPU time of a call
/// (the machine may be shared; with one thread the CPU time is the work's).
fn time(reps: usize, mut f: impl FnMut()) -> (f64, f64) {
    f();
    let (mut wall, mut cpu) = (f64::INFINITY, f64::INFINITY);
    for _ in 0..reps {
        let (w0, c0) = (std::time::Instant::now(), common::cpu_seconds());
        f();
        cpu = cpu.min(common::cpu_seconds() - c0);
        wall = wall.min(w0.elapsed().as_secs_f64());
    }
    (wall, cpu)
}

#[test]
#[ignore = "timing; run with --release --ignored --nocapture"]
fn timing_demo_shapes() {
    let mut rng = Rng::new(10);
    // (what, rows, cols, tokens): the lm_head and a GDN projection at decode, prefill chunks.
    let cases = [
        ("lm_head, decode", 248_320, 256, 1),
        ("in_proj_qkv, decode", 2048, 256, 1),
        ("expert gate, decode", 128, 256, 1),
        ("in_proj_qkv, prefill 512", 2048, 256, 512),
        ("in_proj_qkv, 128 tokens", 2048, 256, 128),
        ("out_proj, prefill 512", 256, 1024, 512),
        ("out_proj, 128 tokens", 256, 1024, 128),
        ("expert down, 128 tokens", 256, 128, 128),
        ("in_proj_a, prefill 512", 8, 256, 512),
    ];
    for (what, rows, cols, t) in cases {
        let w = affine(&mut rng, 1, rows, cols, 4, 64, Dtype::Bf16);
        let x = rng.normals(t * cols, 1.0);
        let mut y = vec![0f32; t * rows];
        for isa in Isa::available() {
            // The fastest of many calls: the machine is shared, and a slow call says little.
            let reps = (4e8 / (rows * cols * t) as f64).clamp(5.0, 2000.0) as usize;
            let (best, cpu) = time(reps, || matmul_with(isa, &w, 0, &x, &mut y));
            println!(
                "{what:>26} {rows}x{cols} T={t} {isa:?} on {} threads: {:.1} us ({:.1} us CPU), {:.2} G multiply-adds per CPU-second",
                rayon::current_num_threads(),
                best * 1e6,
                cpu * 1e6,
                (rows * cols * t) as f64 / cpu / 1e9
            );
        }
    }
    // Attention of the demo's shape (8 query heads over 2 KV heads of 256): a 512-token chunk after
    // 512 tokens, and one decode step after 1024.
    for (pos0, t) in [(512, 512), (1024, 1)] {
        let (nh, kvh, hd) = (8, 2, 256);
        let q = rng.normals(t * nh * hd, 1.0);
        let kc = rng.normals((pos0 + t) * kvh * hd, 0.3);
        let vc = rng.normals((pos0 + t) * kvh * hd, 1.0);
        let mut o = vec![0f32; q.len()];
        for isa in Isa::available() {
            let reps = if t == 1 { 200 } else { 5 };
            let (best, cpu) = time(reps, || lily_cpu::attention::attend(isa, &q, &kc, &vc, pos0, nh, kvh, hd, &mut o));
            let macs = 2 * t * nh * hd * (pos0 + t.div_ceil(2));
            println!(
                "{:>26} pos0={pos0} T={t} {isa:?} on {} threads: {:.1} us ({:.1} us CPU), {:.2} G multiply-adds per CPU-second",
                "attention",
                rayon::current_num_threads(),
                best * 1e6,
                cpu * 1e6,
                macs as f64 / cpu / 1e9
            );
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The attention kernels: strided dot products (scores) and weighted sums of rows (values).

#[test]
fn strided_dots_match_the_definition() {
    let mut rng = Rng::new(5);
    // d = 256 (whole tiles), 13 (a tail of five products); 7 × 5 rows leave tile remainders.
    for (na, nb, d) in [(7, 5, 256), (37, 64, 256), (9, 3, 13), (1, 1, 8)] {
        let (sa, sb, os) = (d + 3, 2 * d, na + 2);
        let a = rng.normals(na * sa, 1.0);
        let b = rng.normals(nb * sb, 1.0);
        let mut want = vec![f32::NAN; nb * os];
        for u in 0..nb {
            for i in 0..na {
                want[u * os + i] = reference_dot(&a[i * sa..i * sa + d], &b[u * sb..u * sb + d]);
            }
        }
        for isa in Isa::available() {
            let mut out = vec![f32::NAN; nb * os];
            lily_cpu::kernels::dots(isa, &a, sa, na, &b, sb, nb, d, &mut out, os);
            for u in 0..nb {
                assert_same_bits(&format!("dots {na}x{nb}x{d} {isa:?}, row {u}"), &out[u * os..u * os + na], &want[u * os..u * os + na]);
                assert!(out[u * os + na..(u + 1) * os].iter().all(|v| v.is_nan()), "dots wrote past its rows");
            }
        }
    }
}

#[test]
fn weighted_sums_match_the_definition() {
    let mut rng = Rng::new(6);
    // 256 columns (whole register blocks), 100 (blocks and a tail), 5 (tail only); 1, 3, 4, 9 rows
    // (groups of the builds' row counts and single rows left over).
    for (rows, n, d) in [(4, 1, 256), (4, 130, 256), (9, 17, 100), (3, 9, 5), (1, 40, 256)] {
        let (sv, sw) = (d + 11, n + 3);
        let w = rng.normals(rows * sw, 1.0);
        let v = rng.normals(n * sv, 1.0);
        let start = rng.normals(rows * d, 1.0);
        let mut want = start.clone();
        for r in 0..rows {
            for j in 0..d {
                for p in 0..n {
                    want[r * d + j] += w[r * sw + p] * v[p * sv + j];
                }
            }
        }
        for isa in Isa::available() {
            let mut out = start.clone();
            lily_cpu::kernels::weighted_sum(isa, &w, sw, n, &v, sv, &mut out, rows);
            assert_same_bits(&format!("weighted sum rows={rows} n={n} d={d} {isa:?}"), &out, &want);
        }
    }
}

/// Causal GQA softmax attention in f64, the plain loop.
#[allow(clippy::too_many_arguments)]
fn reference_attend(q: &[f32], kc: &[f32], vc: &[f32], pos0: usize, nh: usize, kvh: usize, hd: usize) -> Vec<f64> {
    let t = q.len() / (nh * hd);
    let mut o = vec![0f64; q.len()];
    for ti in 0..t {
        for h in 0..nh {
            let kv = h / (nh / kvh);
            let qv = &q[(ti * nh + h) * hd..(ti * nh + h + 1) * hd];
            let n = pos0 + ti + 1;
            let s: Vec<f64> = (0..n)
                .map(|p| {
                    let k = &kc[(p * kvh + kv) * hd..(p * kvh + kv + 1) * hd];
                    qv.iter().zip(k).map(|(&a, &b)| a as f64 * b as f64).sum::<f64>() / (hd as f64).sqrt()
                })
                .collect();
            let m = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let e: Vec<f64> = s.iter().map(|v| (v - m).exp()).collect();
            let sum: f64 = e.iter().sum();
            for (p, ep) in e.iter().enumerate() {
                let v = &vc[(p * kvh + kv) * hd..(p * kvh + kv + 1) * hd];
                for (o, &vv) in o[(ti * nh + h) * hd..(ti * nh + h + 1) * hd].iter_mut().zip(v) {
                    *o += ep / sum * vv as f64;
                }
            }
        }
    }
    o
}

#[test]
fn attention_matches_an_f64_loop_and_every_build_agrees() {
    let mut rng = Rng::new(7);
    // (pos0, T): decode steps after short and long histories; prefills longer than a block of
    // query tokens, from empty and after a history; 8 query heads over 2 KV heads (the demo), and
    // 4 over 4.
    for (nh, kvh, hd) in [(8, 2, 256), (4, 4, 64)] {
        for (pos0, t) in [(0, 1), (5, 1), (300, 1), (0, 37), (20, 40)] {
            let n = pos0 + t;
            // Keys scaled up so that the softmax is peaked: a wrong position or head shows.
            let q = rng.normals(t * nh * hd, 1.0);
            let kc = rng.normals(n * kvh * hd, 0.3);
            let vc = rng.normals(n * kvh * hd, 1.0);
            let want = reference_attend(&q, &kc, &vc, pos0, nh, kvh, hd);
            let scale = want.iter().fold(0f64, |m, v| m.max(v.abs()));
            let mut first: Option<Vec<f32>> = None;
            for isa in Isa::available() {
                let mut o = vec![f32::NAN; q.len()];
                lily_cpu::attention::attend(isa, &q, &kc, &vc, pos0, nh, kvh, hd, &mut o);
                let err = o.iter().zip(&want).fold(0f64, |m, (&a, &b)| m.max((a as f64 - b).abs())) / scale;
                assert!(err < 1e-5, "attention nh={nh} kvh={kvh} pos0={pos0} T={t} {isa:?}: relative error {err:.2e}");
                match &first {
                    None => first = Some(o),
                    Some(f) => assert_same_bits(&format!("attention pos0={pos0} T={t} {isa:?} vs portable"), &o, f),
                }
            }
        }
    }
}

#[test]
fn exp_is_within_two_ulp_keeps_nan_and_flushes_below_minus_87() {
    use lily_cpu::kernels::exp_neg;
    let mut worst = 0f64;
    for i in 0..=2_000_000u32 {
        let x = -87.0 * i as f32 / 2_000_000.0;
        let (got, want) = (exp_neg(x) as f64, (x as f64).exp());
        worst = worst.max(((got - want) / want).abs());
    }
    // 2 ulp of f32 is 2.4e-7 relative.
    assert!(worst < 2.4e-7, "exp_neg relative error {worst:.3e}");
    assert_eq!(exp_neg(0.0), 1.0);
    assert_eq!(exp_neg(-88.0), 0.0);
    assert_eq!(exp_neg(f32::NEG_INFINITY), 0.0);
    assert!(exp_neg(f32::NAN).is_nan());
}

#[test]
fn softmax_matches_f64_and_every_build_agrees() {
    let mut rng = Rng::new(8);
    for n in [1, 7, 8, 37, 1000] {
        let scores = rng.normals(n, 3.0);
        let scale = 0.0625f32;
        let m = scores.iter().map(|&v| (v * scale) as f64).fold(f64::NEG_INFINITY, f64::max);
        let e: Vec<f64> = scores.iter().map(|&v| ((v * scale) as f64 - m).exp()).collect();
        let total: f64 = e.iter().sum();
        let mut first: Option<Vec<f32>> = None;
        for isa in Isa::available() {
            let mut s = scores.clone();
            lily_cpu::kernels::softmax(isa, &mut s, scale);
            for (p, (&got, &want)) in s.iter().zip(&e).enumerate() {
                let want = want / total;
                assert!((got as f64 - want).abs() <= 1e-6 * want + 1e-30, "softmax n={n} {isa:?} p={p}: {got} vs {want}");
            }
            match &first {
                None => first = Some(s),
                Some(f) => assert_same_bits(&format!("softmax n={n} {isa:?} vs portable"), &s, f),
            }
        }
    }
    // A NaN score makes the row NaN (never hidden).
    let mut s = vec![1.0, f32::NAN, 2.0];
    lily_cpu::kernels::softmax(Isa::best(), &mut s, 1.0);
    assert!(s.iter().any(|v| v.is_nan()));
}
