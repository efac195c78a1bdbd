//! CPU-vs-GPU tests of the MoE dispatch plan and combine (`kernels/moe_dispatch.cu`,
//! `ops::moe_dispatch`), plus a timing (`bench_moe_dispatch`, ignored by default).
//!
//! Each test skips (prints "no GPU, skipped") when `probe(0)` fails. Router choices are fresh
//! pseudo-random rows of k distinct experts in random order, in four styles: uniform, skewed (70% from a
//! small hot set), few experts in use (k + 2 of E: most experts empty), and every token choosing the
//! same experts. T = 1, 5, 513, 4096; E = 8, 256; k = 1, 2, 8.
//! - plan: outputs and scratch poisoned with 0xFFFFFFFF; offsets must equal the counts' exclusive
//!   prefix sums exactly, every (t, j) must own exactly one slot inside its expert's range with
//!   rows[slot] == t, and the layout must be the documented stable one (slots ascending in (t, j)
//!   within an expert) and the same on a second run over the dirty scratch.
//! - combine: outputs poisoned with NaN; compared bit for bit (no tolerance) with a CPU loop that
//!   accumulates as `lily_cpu::moe::forward` does (experts ascending, `out += w · y` in f32, then
//!   `+= sigmoid(gate) · shared` with `lily_cpu::norm::sigmoid`), with and without `slot_of`, with and
//!   without the shared expert, at H = 2048 (the model's), odd H (scalar kernel) and a misaligned view.
//!   The sigmoid alone is also compared bit for bit with `lily_cpu::norm::sigmoid` on 2^22 logits.
#![cfg(feature = "cuda")]

mod common;

use common::{device, Rng, time_op};
use cudarc::driver::CudaSlice;
use lily_cuda::ops::gemm_wgmma::{stage_half, HalfStage, Stager};
use lily_cuda::ops::{moe_dispatch, rmsnorm, util};
use lily_cuda::ops::moe_dispatch::NormOut;
use lily_cuda::Device;

// ---------------------------------------------------------------------------------------------------
// Helpers

/// t router rows of k distinct experts < e, in random order (the router's is best first, not by id).
fn gen_idx(rng: &mut Rng, t: usize, e: usize, k: usize, style: usize) -> Vec<u32> {
    let mut perm: Vec<usize> = (0..e).collect();
    for i in (1..e).rev() {
        perm.swap(i, rng.below(i + 1));
    }
    let hot = (e / 16).max(k);
    let few = (k + 2).min(e);
    let fixed: Vec<usize> = perm[..k].to_vec();
    let mut out = Vec::with_capacity(t * k);
    for _ in 0..t {
        let mut row: Vec<usize> = Vec::with_capacity(k);
        while row.len() < k {
            let x = match style % 4 {
                0 => rng.below(e),
                1 => {
                    if rng.uniform() < 0.7 {
                        perm[rng.below(hot)]
                    } else {
                        rng.below(e)
                    }
                }
                2 => perm[rng.below(few)],
                _ => fixed[row.len()],
            };
            if !row.contains(&x) {
                row.push(x);
            }
        }
        if style % 4 == 3 && k > 1 {
            let a = rng.below(k);
            row.swap(0, a);
        }
        out.extend(row.iter().map(|&x| x as u32));
    }
    out
}

/// The documented plan: (offsets, rows, slot_of), slots of an expert ascending in flat index t·k + j.
fn cpu_plan(idx: &[u32], k: usize, e: usize) -> (Vec<u32>, Vec<u32>, Vec<u32>) {
    let n = idx.len();
    let mut counts = vec![0u32; e];
    for &x in idx {
        counts[x as usize] += 1;
    }
    let mut offsets = vec![0u32; e + 1];
    for x in 0..e {
        offsets[x + 1] = offsets[x] + counts[x];
    }
    let mut cursor = offsets[..e].to_vec();
    let (mut rows, mut slot_of) = (vec![0u32; n], vec![0u32; n]);
    for (i, &x) in idx.iter().enumerate() {
        let s = cursor[x as usize] as usize;
        cursor[x as usize] += 1;
        rows[s] = (i / k) as u32;
        slot_of[i] = s as u32;
    }
    (offsets, rows, slot_of)
}

/// `lily_cpu::moe::forward`'s accumulation given the expert outputs y (sorted-slot order, or
/// identity order when `slot_of` is None): for experts ascending, each of its tokens in order gets
/// `out += wgt · v`; then `out += sigmoid(gate) · shared`.
#[allow(clippy::too_many_arguments)]
fn cpu_combine(
    y: &[f32],
    idx: &[u32],
    slot_of: Option<&[u32]>,
    w: &[f32],
    shared: Option<(&[f32], &[f32])>,
    t: usize,
    k: usize,
    h: usize,
    e: usize,
) -> Vec<f32> {
    let mut by_expert: Vec<Vec<(usize, usize)>> = vec![Vec::new(); e];
    for ti in 0..t {
        for j in 0..k {
            by_expert[idx[ti * k + j] as usize].push((ti, j));
        }
    }
    let mut out = vec![0.0f32; t * h];
    for rows in &by_expert {
        for &(ti, j) in rows {
            let i = ti * k + j;
            let s = slot_of.map_or(i, |so| so[i] as usize);
            let wgt = w[i];
            for (o, v) in out[ti * h..(ti + 1) * h].iter_mut().zip(&y[s * h..(s + 1) * h]) {
                *o += wgt * v;
            }
        }
    }
    if let Some((sh, g)) = shared {
        for ti in 0..t {
            let gate = lily_cpu::norm::sigmoid(g[ti]);
            for (o, v) in out[ti * h..(ti + 1) * h].iter_mut().zip(&sh[ti * h..(ti + 1) * h]) {
                *o += gate * v;
            }
        }
    }
    out
}

fn upload_u32(dev: &Device, v: &[u32]) -> CudaSlice<u32> {
    dev.upload(v).unwrap()
}

fn poisoned_u32(dev: &Device, n: usize) -> CudaSlice<u32> {
    dev.upload(&vec![u32::MAX; n.max(1)]).unwrap()
}

fn poisoned_f32(dev: &Device, n: usize) -> CudaSlice<f32> {
    let mut b = dev.zeros::<f32>(n.max(1)).unwrap();
    util::fill(dev, &mut b, f32::NAN).unwrap();
    b
}

/// Asserts `got` equals `want` bit for bit; prints the largest absolute difference otherwise.
fn assert_bits(got: &[f32], want: &[f32], h: usize, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let bad: Vec<usize> = (0..want.len()).filter(|&i| got[i].to_bits() != want[i].to_bits()).collect();
    if let Some(&i) = bad.first() {
        let worst =
            bad.iter()
                .map(|&i| (got[i] as f64 - want[i] as f64).abs())
                .fold(0.0f64, |a, b| if b.is_nan() { f64::INFINITY } else { a.max(b) });
        panic!(
            "{what}: {} of {} values differ; first at token {} column {}: got {:e}, want {:e}; largest |diff| {worst:e}",
            bad.len(),
            want.len(),
            i / h,
            i % h,
            got[i],
            want[i]
        );
    }
}

/// Runs the GPU plan for `idx` and checks it; returns the device idx and slot_of, and the host slot_of.
fn check_plan(dev: &Device, idx: &[u32], t: usize, k: usize, e: usize, what: &str) -> (CudaSlice<u32>, CudaSlice<u32>, Vec<u32>) {
    let n = t * k;
    let d_idx = upload_u32(dev, idx);
    let mut scratch = poisoned_u32(dev, moe_dispatch::plan_scratch_len(t, k, e));
    let mut d_off = poisoned_u32(dev, e + 1);
    let mut d_rows = poisoned_u32(dev, n);
    let mut d_slot = poisoned_u32(dev, n);
    moe_dispatch::plan(dev, &d_idx, t, k, e, &mut scratch, &mut d_off, &mut d_rows, &mut d_slot).unwrap();
    let offsets = dev.download(&d_off).unwrap()[..e + 1].to_vec();
    let rows = dev.download(&d_rows).unwrap()[..n].to_vec();
    let slot_of = dev.download(&d_slot).unwrap()[..n].to_vec();

    // The contract.
    let (want_off, want_rows, want_slot) = cpu_plan(idx, k, e);
    assert_eq!(offsets, want_off, "{what}: offsets are not the counts' prefix sums");
    assert_eq!((offsets[0], offsets[e]), (0, n as u32), "{what}: offsets ends");
    let mut seen = vec![false; n];
    for (i, &s) in slot_of.iter().enumerate() {
        let s = s as usize;
        assert!(s < n, "{what}: slot_of[{i}] = {s} out of range (n = {n})");
        assert!(!seen[s], "{what}: slot {s} given twice");
        seen[s] = true;
        assert_eq!(rows[s] as usize, i / k, "{what}: rows[slot_of[{i}]]");
        let x = idx[i] as usize;
        assert!(
            (offsets[x] as usize..offsets[x + 1] as usize).contains(&s),
            "{what}: slot {s} of ({}, {}) outside expert {x}'s range",
            i / k,
            i % k
        );
    }
    // The documented stable order, and determinism over dirty scratch.
    assert_eq!(rows, want_rows, "{what}: rows not in the stable order");
    assert_eq!(slot_of, want_slot, "{what}: slot_of not in the stable order");
    moe_dispatch::plan(dev, &d_idx, t, k, e, &mut scratch, &mut d_off, &mut d_rows, &mut d_slot).unwrap();
    assert_eq!(dev.download(&d_off).unwrap()[..e + 1], offsets[..], "{what}: second run offsets");
    assert_eq!(dev.download(&d_rows).unwrap()[..n], rows[..], "{what}: second run rows");
    assert_eq!(dev.download(&d_slot).unwrap()[..n], slot_of[..], "{what}: second run slot_of");
    (d_idx, d_slot, slot_of)
}

/// Combine with fresh random y, w, shared, gate at width h, every (slot_of, shared) variant, checked
/// bit for bit against `cpu_combine`.
#[allow(clippy::too_many_arguments)]
fn check_combine(
    dev: &Device,
    rng: &mut Rng,
    idx: &[u32],
    d_idx: &CudaSlice<u32>,
    slot_of: &[u32],
    d_slot: &CudaSlice<u32>,
    t: usize,
    k: usize,
    h: usize,
    e: usize,
    what: &str,
) {
    let n = t * k;
    let y: Vec<f32> = (0..n * h).map(|_| rng.range(-2.0, 2.0)).collect();
    let w: Vec<f32> = (0..n).map(|_| rng.range(0.01, 1.0)).collect();
    let sh: Vec<f32> = (0..t * h).map(|_| rng.range(-2.0, 2.0)).collect();
    let mut g: Vec<f32> = (0..t).map(|_| rng.normal(3.0)).collect();
    if t >= 8 {
        // The exp's special ranges: overflow, underflow, the |x| >= 88 branch.
        for v in [-120.0, -103.5, -88.5, 88.5, 95.0, 120.0] {
            let i = rng.below(t);
            g[i] = v;
        }
    }
    let (d_y, d_w, d_sh, d_g) = (dev.upload(&y).unwrap(), dev.upload(&w).unwrap(), dev.upload(&sh).unwrap(), dev.upload(&g).unwrap());
    for with_slot in [true, false] {
        for with_shared in [true, false] {
            let mut d_out = poisoned_f32(dev, t * h);
            moe_dispatch::combine(
                dev,
                &d_y,
                d_idx,
                with_slot.then_some(d_slot),
                &d_w,
                with_shared.then_some((&d_sh, &d_g)),
                t,
                k,
                h,
                &mut d_out,
            )
            .unwrap();
            let got = dev.download(&d_out).unwrap()[..t * h].to_vec();
            let want = cpu_combine(&y, idx, with_slot.then_some(slot_of), &w, with_shared.then_some((&sh[..], &g[..])), t, k, h, e);
            assert_bits(&got, &want, h, &format!("{what} H={h} slot_of={with_slot} shared={with_shared}"));
        }
    }
    // The gate logits as the last column of rows of E + 1 (the router fused with the shared gate);
    // the other columns hold logits that would change every output if read instead.
    let stride = e + 1;
    let mut rows: Vec<f32> = (0..t * stride).map(|_| rng.normal(3.0)).collect();
    for (i, gv) in g.iter().enumerate() {
        rows[i * stride + e] = *gv;
    }
    let d_rows = dev.upload(&rows).unwrap();
    let gate = d_rows.slice(e..);
    let mut d_out = poisoned_f32(dev, t * h);
    moe_dispatch::combine_with(dev, &d_y, d_idx, Some(d_slot), &d_w, Some((&d_sh, &gate)), stride, t, k, h, &mut d_out, false).unwrap();
    let got = dev.download(&d_out).unwrap()[..t * h].to_vec();
    let want = cpu_combine(&y, idx, Some(slot_of), &w, Some((&sh[..], &g[..])), t, k, h, e);
    assert_bits(&got, &want, h, &format!("{what} H={h} gate logits {stride} apart"));
    // y in bf16 (the prefill's down projection writes it so): each value widened exactly, then the
    // same sums; the vector form (H % 4 == 0) reads 8-byte groups.
    let y16: Vec<u16> = y.iter().map(|&v| half::bf16::from_f32(v).to_bits()).collect();
    let y16_wide: Vec<f32> = y16.iter().map(|&b| half::bf16::from_bits(b).to_f32()).collect();
    let d_y16 = dev.upload(&y16).unwrap();
    for with_shared in [true, false] {
        let mut d_out = poisoned_f32(dev, t * h);
        let sh_terms = with_shared.then_some((&d_sh, &gate));
        moe_dispatch::combine_with(dev, &d_y16, d_idx, Some(d_slot), &d_w, sh_terms, stride, t, k, h, &mut d_out, false).unwrap();
        let got = dev.download(&d_out).unwrap()[..t * h].to_vec();
        let want = cpu_combine(&y16_wide, idx, Some(slot_of), &w, with_shared.then_some((&sh[..], &g[..])), t, k, h, e);
        assert_bits(&got, &want, h, &format!("{what} H={h} y in bf16, shared={with_shared}"));
    }
}

// ---------------------------------------------------------------------------------------------------
// Tests

#[test]
fn moe_plan_and_combine_match_cpu() {
    let Some(dev) = device() else { return };
    let mut seed = 1u64;
    for t in [1usize, 5, 513, 4096] {
        for e in [8usize, 256] {
            for k in [1usize, 2, 8] {
                // Every style at the real shape, one (cycling) elsewhere.
                let styles: Vec<usize> = if t == 4096 && e == 256 && k == 8 { (0..4).collect() } else { vec![seed as usize % 4] };
                for style in styles {
                    let mut rng = Rng::new(seed);
                    seed += 1;
                    let idx = gen_idx(&mut rng, t, e, k, style);
                    let what = format!("T={t} E={e} k={k} style={style}");
                    let (d_idx, d_slot, slot_of) = check_plan(&dev, &idx, t, k, e, &what);
                    let h = if t * k <= 8192 || (e == 256 && k == 8 && style == 0) { 2048 } else { 36 };
                    check_combine(&dev, &mut rng, &idx, &d_idx, &slot_of, &d_slot, t, k, h, e, &what);
                    if t <= 513 {
                        check_combine(&dev, &mut rng, &idx, &d_idx, &slot_of, &d_slot, t, k, 7, e, &what);
                    }
                    println!("{what}: plan exact (stable order), combine bit-identical");
                }
            }
        }
    }
}

/// The combine fused with the residual add and the next RMSNorm (`combine_norm`, a prompt chunk's MoE
/// block) against the combine into a buffer followed by `rmsnorm::add_rms_norm`: x and the normed rows
/// bit for bit, with y in f32 and in bf16, with and without the shared expert, at widths that take the
/// vector kernel (one and two vectors a thread) and the scalar one; x also bit for bit the CPU's
/// x + `cpu_combine`, and the normed rows within 2e-5 of `lily_cpu::norm::rms_norm` on it (its sequential f32 sum of
/// squares is the larger error; a wrong weight, row or eps is > 1e-3). Where the rows are a multiple of
/// 64 wide, the form writing them only as the next GEMM's staged x (`NormOut::Staged`): x the same
/// bits, the plane and scales the stager's on the normed rows.
#[test]
fn combine_norm_matches_combine_then_norm() {
    let Some(dev) = device() else { return };
    let eps = 1e-6f32;
    for (c, &(t, e, k, h)) in [(513usize, 256usize, 8usize, 2048usize), (37, 64, 8, 64), (5, 8, 2, 7), (1, 8, 1, 36), (20, 64, 8, 5000)].iter().enumerate() {
        let mut rng = Rng::new(900 + c as u64);
        let idx = gen_idx(&mut rng, t, e, k, c % 4);
        let what = format!("T={t} E={e} k={k} H={h}");
        let (d_idx, d_slot, slot_of) = check_plan(&dev, &idx, t, k, e, &what);
        let n = t * k;
        let y: Vec<f32> = (0..n * h).map(|_| rng.range(-2.0, 2.0)).collect();
        let y16: Vec<u16> = y.iter().map(|&v| half::bf16::from_f32(v).to_bits()).collect();
        let y16_wide: Vec<f32> = y16.iter().map(|&b| half::bf16::from_bits(b).to_f32()).collect();
        let w: Vec<f32> = (0..n).map(|_| rng.range(0.01, 1.0)).collect();
        let sh: Vec<f32> = (0..t * h).map(|_| rng.range(-2.0, 2.0)).collect();
        let g: Vec<f32> = (0..t).map(|_| rng.normal(3.0)).collect();
        let x0: Vec<f32> = (0..t * h).map(|_| rng.range(-4.0, 4.0)).collect();
        let nw: Vec<f32> = (0..h).map(|_| rng.range(0.5, 1.5)).collect();
        let (d_y, d_y16, d_w, d_sh, d_g, d_nw) =
            (dev.upload(&y).unwrap(), dev.upload(&y16).unwrap(), dev.upload(&w).unwrap(), dev.upload(&sh).unwrap(), dev.upload(&g).unwrap(), dev.upload(&nw).unwrap());
        for bf16_y in [false, true] {
            for with_shared in [true, false] {
                let sht = with_shared.then_some((&d_sh, &d_g));
                let case = format!("{what} y in {} shared={with_shared}", if bf16_y { "bf16" } else { "f32" });
                // The two kernels.
                let mut mlp = poisoned_f32(&dev, t * h);
                let (mut x_ref, mut nr_ref) = (dev.upload(&x0).unwrap(), poisoned_f32(&dev, t * h));
                let (mut x_got, mut nr_got) = (dev.upload(&x0).unwrap(), poisoned_f32(&dev, t * h));
                if bf16_y {
                    moe_dispatch::combine_with(&dev, &d_y16, &d_idx, Some(&d_slot), &d_w, sht, 1, t, k, h, &mut mlp, false).unwrap();
                    moe_dispatch::combine_norm(&dev, &d_y16, &d_idx, Some(&d_slot), &d_w, sht, 1, t, k, h, &mut x_got, &d_nw, eps, NormOut::Rows(&mut nr_got)).unwrap();
                } else {
                    moe_dispatch::combine_with(&dev, &d_y, &d_idx, Some(&d_slot), &d_w, sht, 1, t, k, h, &mut mlp, false).unwrap();
                    moe_dispatch::combine_norm(&dev, &d_y, &d_idx, Some(&d_slot), &d_w, sht, 1, t, k, h, &mut x_got, &d_nw, eps, NormOut::Rows(&mut nr_got)).unwrap();
                }
                rmsnorm::add_rms_norm(&dev, &mlp, &mut x_ref, &d_nw, eps, t, &mut nr_ref, None).unwrap();
                // The normed rows written only as the next GEMM's staged x: x the same bits, the plane
                // and scales those of the stager on the normed rows.
                if moe_dispatch::combine_stage_fits(h) {
                    let mut x_st = dev.upload(&x0).unwrap();
                    let (mut plane, mut scales) = (dev.zeros::<u16>(t * h).unwrap(), dev.zeros::<f32>(t).unwrap());
                    let st = HalfStage::into_buffers(&dev, &mut plane, &mut scales, t, h).unwrap();
                    if bf16_y {
                        moe_dispatch::combine_norm(&dev, &d_y16, &d_idx, Some(&d_slot), &d_w, sht, 1, t, k, h, &mut x_st, &d_nw, eps, NormOut::Staged(&st)).unwrap();
                    } else {
                        moe_dispatch::combine_norm(&dev, &d_y, &d_idx, Some(&d_slot), &d_w, sht, 1, t, k, h, &mut x_st, &d_nw, eps, NormOut::Staged(&st)).unwrap();
                    }
                    let (want_p, want_s) = stage_half(&dev, &nr_got, t, h, Stager::Rows).unwrap();
                    assert_bits(&dev.download(&x_st).unwrap(), &dev.download(&x_got).unwrap(), h, &format!("{case}: staged form's x"));
                    assert_eq!(dev.download(&plane).unwrap(), dev.download(&want_p).unwrap(), "{case}: staged plane vs the stager on the normed rows");
                    let bits = |v: Vec<f32>| v.into_iter().map(f32::to_bits).collect::<Vec<_>>();
                    assert_eq!(bits(dev.download(&scales).unwrap()), bits(dev.download(&want_s).unwrap()), "{case}: staged scales");
                }
                let (x_got, nr_got) = (dev.download(&x_got).unwrap()[..t * h].to_vec(), dev.download(&nr_got).unwrap()[..t * h].to_vec());
                assert_bits(&x_got, &dev.download(&x_ref).unwrap()[..t * h], h, &format!("{case}: x vs combine + add_rms_norm"));
                assert_bits(&nr_got, &dev.download(&nr_ref).unwrap()[..t * h], h, &format!("{case}: normed vs combine + add_rms_norm"));
                // The CPU.
                let yy = if bf16_y { &y16_wide } else { &y };
                let sum = cpu_combine(yy, &idx, Some(&slot_of), &w, with_shared.then_some((&sh[..], &g[..])), t, k, h, e);
                let x_cpu: Vec<f32> = x0.iter().zip(&sum).map(|(a, b)| a + b).collect();
                assert_bits(&x_got, &x_cpu, h, &format!("{case}: x vs the CPU"));
                let mut worst = 0.0f64;
                for r in 0..t {
                    let mut want = vec![0.0f32; h];
                    lily_cpu::norm::rms_norm(&x_cpu[r * h..(r + 1) * h], &nw, eps, &mut want);
                    let scale = want.iter().fold(0.0f64, |m, v| m.max(v.abs() as f64));
                    for (a, b) in nr_got[r * h..(r + 1) * h].iter().zip(&want) {
                        worst = worst.max((*a as f64 - *b as f64).abs() / scale);
                    }
                }
                assert!(worst <= 2e-5, "{case}: normed vs the CPU's rms_norm: {worst:e}");
                println!("{case}: x and normed bit for bit combine + add_rms_norm; normed within {worst:.1e} of the CPU");
            }
        }
    }
}

#[test]
fn moe_plan_other_sizes() {
    // E not a multiple of 32, E = 512 (the largest), k = E, k = 32 (the largest), chunk boundaries.
    let Some(dev) = device() else { return };
    let cases = [(1023, 3, 1), (1024, 5, 5), (1025, 33, 4), (300, 512, 32), (2048, 512, 16), (100, 1, 1), (3000, 100, 7)];
    for (c, &(t, e, k)) in cases.iter().enumerate() {
        for style in 0..4 {
            let mut rng = Rng::new(500 + 4 * c as u64 + style as u64);
            let idx = gen_idx(&mut rng, t, e, k, style);
            let what = format!("T={t} E={e} k={k} style={style}");
            let (d_idx, d_slot, slot_of) = check_plan(&dev, &idx, t, k, e, &what);
            if style == 0 {
                check_combine(&dev, &mut rng, &idx, &d_idx, &slot_of, &d_slot, t, k, 20, e, &what);
            }
            println!("{what}: plan exact");
        }
    }
}

#[test]
fn moe_plan_empty_and_invalid_ids() {
    let Some(dev) = device() else { return };
    // t = 0: offsets all zero.
    let d_idx = upload_u32(&dev, &[0]);
    let mut scratch = poisoned_u32(&dev, moe_dispatch::plan_scratch_len(0, 8, 16));
    let mut off = poisoned_u32(&dev, 17);
    let (mut rows, mut slot) = (poisoned_u32(&dev, 1), poisoned_u32(&dev, 1));
    moe_dispatch::plan(&dev, &d_idx, 0, 8, 16, &mut scratch, &mut off, &mut rows, &mut slot).unwrap();
    assert_eq!(dev.download(&off).unwrap(), vec![0u32; 17]);

    // Ids >= E take no slot: slot_of = u32::MAX, the rest still a valid plan.
    let (t, e, k) = (700, 16, 2);
    let mut rng = Rng::new(99);
    let mut idx = gen_idx(&mut rng, t, e, k, 0);
    let bad: Vec<usize> = (0..10).map(|_| rng.below(t * k)).collect();
    for &i in &bad {
        idx[i] = (e + rng.below(1000)) as u32;
    }
    let d_idx = upload_u32(&dev, &idx);
    let mut scratch = poisoned_u32(&dev, moe_dispatch::plan_scratch_len(t, k, e));
    let mut off = poisoned_u32(&dev, e + 1);
    let (mut rows, mut slot) = (poisoned_u32(&dev, t * k), poisoned_u32(&dev, t * k));
    moe_dispatch::plan(&dev, &d_idx, t, k, e, &mut scratch, &mut off, &mut rows, &mut slot).unwrap();
    let (off, rows, slot) = (dev.download(&off).unwrap(), dev.download(&rows).unwrap(), dev.download(&slot).unwrap());
    let valid = idx.iter().filter(|&&x| (x as usize) < e).count();
    assert_eq!(off[e] as usize, valid);
    for (i, &x) in idx.iter().enumerate() {
        if (x as usize) < e {
            let s = slot[i] as usize;
            assert!((off[x as usize] as usize..off[x as usize + 1] as usize).contains(&s));
            assert_eq!(rows[s] as usize, i / k);
        } else {
            assert_eq!(slot[i], u32::MAX, "invalid id at {i} got a slot");
        }
    }
}

#[test]
fn moe_combine_misaligned_view() {
    // y and out as views one element in: the scalar kernel at h % 4 == 0.
    let Some(dev) = device() else { return };
    let (t, e, k, h) = (37, 64, 8, 64);
    let mut rng = Rng::new(7);
    let idx = gen_idx(&mut rng, t, e, k, 1);
    let (d_idx, d_slot, slot_of) = check_plan(&dev, &idx, t, k, e, "misaligned");
    let n = t * k;
    let y: Vec<f32> = (0..n * h + 1).map(|_| rng.range(-2.0, 2.0)).collect();
    let w: Vec<f32> = (0..n).map(|_| rng.range(0.01, 1.0)).collect();
    let sh: Vec<f32> = (0..t * h).map(|_| rng.range(-2.0, 2.0)).collect();
    let g: Vec<f32> = (0..t).map(|_| rng.normal(3.0)).collect();
    let (d_y, d_w, d_sh, d_g) = (dev.upload(&y).unwrap(), dev.upload(&w).unwrap(), dev.upload(&sh).unwrap(), dev.upload(&g).unwrap());
    let mut d_out = poisoned_f32(&dev, t * h + 1);
    let yv = d_y.slice(1..);
    let mut ov = d_out.slice_mut(1..);
    moe_dispatch::combine(&dev, &yv, &d_idx, Some(&d_slot), &d_w, Some((&d_sh, &d_g)), t, k, h, &mut ov).unwrap();
    let got = dev.download(&d_out).unwrap();
    assert!(got[0].is_nan(), "wrote before the view");
    let want = cpu_combine(&y[1..], &idx, Some(&slot_of), &w, Some((&sh, &g)), t, k, h, e);
    assert_bits(&got[1..], &want, h, "misaligned view");
    // bf16 y two elements in (4-byte, not 8-byte, aligned): the scalar bf16 kernel, output aligned.
    let y16: Vec<u16> = y.iter().chain([0.5f32].iter()).map(|&v| half::bf16::from_f32(v).to_bits()).collect(); // n·h + 2
    let d_y16 = dev.upload(&y16).unwrap();
    let y16v = d_y16.slice(2..);
    let mut d_out = poisoned_f32(&dev, t * h);
    moe_dispatch::combine_with(&dev, &y16v, &d_idx, Some(&d_slot), &d_w, Some((&d_sh, &d_g)), 1, t, k, h, &mut d_out, false).unwrap();
    let wide: Vec<f32> = y16[2..].iter().map(|&b| half::bf16::from_bits(b).to_f32()).collect();
    let want = cpu_combine(&wide, &idx, Some(&slot_of), &w, Some((&sh, &g)), t, k, h, e);
    assert_bits(&dev.download(&d_out).unwrap(), &want, h, "bf16 y misaligned view");
}

#[test]
fn moe_combine_gate_matches_cpu_sigmoid() {
    // The sigmoid alone (k = 1, h = 1, w = 0, shared = 1: out = 0 + 0·y + sigmoid(g)·1), bit for bit
    // against lily_cpu::norm::sigmoid (Rust's f32::exp, i.e. the host's expf) on 2^22 logits: a dense
    // sweep of [-110, 110] plus random bit patterns (including NaN and infinities).
    let Some(dev) = device() else { return };
    let t = 1usize << 22;
    let mut rng = Rng::new(2024);
    let g: Vec<f32> =
        (0..t).map(|i| if i % 2 == 0 { -110.0 + 220.0 * (i as f32 / t as f32) } else { f32::from_bits(rng.next_u64() as u32) }).collect();
    let y: Vec<f32> = (0..t).map(|_| rng.range(-2.0, 2.0)).collect();
    let idx = vec![3u32; t];
    let (d_g, d_y, d_idx) = (dev.upload(&g).unwrap(), dev.upload(&y).unwrap(), dev.upload(&idx).unwrap());
    let d_w = dev.upload(&vec![0.0f32; t]).unwrap();
    let d_sh = dev.upload(&vec![1.0f32; t]).unwrap();
    let mut d_out = poisoned_f32(&dev, t);
    moe_dispatch::combine(&dev, &d_y, &d_idx, None::<&CudaSlice<u32>>, &d_w, Some((&d_sh, &d_g)), t, 1, 1, &mut d_out).unwrap();
    let got = dev.download(&d_out).unwrap();
    let mut bad = 0usize;
    for i in 0..t {
        let want = 0.0f32 + lily_cpu::norm::sigmoid(g[i]);
        let same = got[i].to_bits() == want.to_bits() || (got[i].is_nan() && want.is_nan());
        if !same {
            if bad < 5 {
                println!("g = {:e} ({:#010x}): got {:e}, want {:e}", g[i], g[i].to_bits(), got[i], want);
            }
            bad += 1;
        }
    }
    assert_eq!(bad, 0, "{bad} of {t} sigmoids differ from the host's (is the host's expf glibc's FMA build?)");
}

#[test]
fn moe_dispatch_rejects_bad_shapes() {
    let Some(dev) = device() else { return };
    let idx = dev.zeros::<u32>(64).unwrap();
    let mut scratch = dev.zeros::<u32>(512).unwrap();
    let mut off = dev.zeros::<u32>(513).unwrap();
    let mut rows = dev.zeros::<u32>(64).unwrap();
    let mut slot = dev.zeros::<u32>(64).unwrap();
    let mut small = dev.zeros::<u32>(4).unwrap();
    let plan = moe_dispatch::plan::<_, _, _, _, _>;
    assert!(plan(&dev, &idx, 8, 8, 513, &mut scratch, &mut off, &mut rows, &mut slot).is_err()); // E > 512
    assert!(plan(&dev, &idx, 8, 0, 16, &mut scratch, &mut off, &mut rows, &mut slot).is_err()); // k = 0
    assert!(plan(&dev, &idx, 1, 33, 64, &mut scratch, &mut off, &mut rows, &mut slot).is_err()); // k > 32
    assert!(plan(&dev, &idx, 8, 5, 4, &mut scratch, &mut off, &mut rows, &mut slot).is_err()); // k > E
    assert!(plan(&dev, &idx, 9, 8, 16, &mut scratch, &mut off, &mut rows, &mut slot).is_err()); // short idx
    assert!(plan(&dev, &idx, 8, 8, 16, &mut small, &mut off, &mut rows, &mut slot).is_err()); // short scratch
    assert!(plan(&dev, &idx, 8, 8, 16, &mut scratch, &mut small, &mut rows, &mut slot).is_err()); // short offsets
    assert!(plan(&dev, &idx, 8, 8, 16, &mut scratch, &mut off, &mut small, &mut slot).is_err()); // short rows
    assert!(plan(&dev, &idx, 8, 8, 16, &mut scratch, &mut off, &mut rows, &mut small).is_err()); // short slot_of
    assert!(plan(&dev, &idx, 8, 8, 16, &mut scratch, &mut off, &mut rows, &mut slot).is_ok());

    let y = dev.zeros::<f32>(64 * 16).unwrap();
    let w = dev.zeros::<f32>(64).unwrap();
    let sh = dev.zeros::<f32>(8 * 16).unwrap();
    let g = dev.zeros::<f32>(8).unwrap();
    let mut out = dev.zeros::<f32>(8 * 16).unwrap();
    let none = None::<&CudaSlice<u32>>;
    let nosh = None::<(&CudaSlice<f32>, &CudaSlice<f32>)>;
    assert!(moe_dispatch::combine(&dev, &y, &idx, none, &w, nosh, 8, 8, 17, &mut out).is_err()); // short y
    assert!(moe_dispatch::combine(&dev, &y, &idx, Some(&small), &w, nosh, 8, 8, 16, &mut out).is_err()); // short slot_of
    assert!(moe_dispatch::combine(&dev, &y, &idx, none, &w, Some((&sh, &small_f32(&dev))), 8, 8, 16, &mut out).is_err()); // short gate
    assert!(moe_dispatch::combine(&dev, &y, &idx, none, &w, nosh, 1, 33, 16, &mut out).is_err()); // k > 32
    assert!(moe_dispatch::combine(&dev, &y, &idx, none, &w, nosh, 8, 0, 16, &mut out).is_err()); // k = 0
    assert!(moe_dispatch::combine(&dev, &y, &idx, Some(&slot), &w, Some((&sh, &g)), 8, 8, 16, &mut out).is_ok());
    assert!(moe_dispatch::combine(&dev, &y, &idx, none, &w, nosh, 0, 8, 16, &mut out).is_ok());
    // gate logits strided past the end of their buffer, or a zero stride
    assert!(moe_dispatch::combine_with(&dev, &y, &idx, none, &w, Some((&sh, &g)), 2, 8, 8, 16, &mut out, false).is_err());
    assert!(moe_dispatch::combine_with(&dev, &y, &idx, none, &w, Some((&sh, &g)), 0, 8, 8, 16, &mut out, false).is_err());
    // nothing to do
}

fn small_f32(dev: &Device) -> CudaSlice<f32> {
    dev.zeros::<f32>(4).unwrap()
}

// ---------------------------------------------------------------------------------------------------
// Timing (run with `--ignored bench_moe_dispatch`)

#[test]
#[ignore = "timing; run on the GPU machine"]
fn bench_moe_dispatch() {
    let Some(dev) = device() else { return };
    let (e, k, h) = (256, 8, 2048);
    println!("MoE dispatch, E {e}, k {k}, H {h}");
    for t in [1usize, 512, 4096, 8192] {
        let mut rng = Rng::new(31 + t as u64);
        let idx = gen_idx(&mut rng, t, e, k, 1);
        let n = t * k;
        let d_idx = upload_u32(&dev, &idx);
        let mut scratch = dev.zeros::<u32>(moe_dispatch::plan_scratch_len(t, k, e)).unwrap();
        let mut off = dev.zeros::<u32>(e + 1).unwrap();
        let mut rows = dev.zeros::<u32>(n).unwrap();
        let mut slot = dev.zeros::<u32>(n).unwrap();
        let (plan_t, plan_s) = time_op(&dev, 15, 50, |_| {
            moe_dispatch::plan(&dev, &d_idx, t, k, e, &mut scratch, &mut off, &mut rows, &mut slot).unwrap();
        });
        let y = dev.upload(&(0..n * h).map(|_| rng.range(-1.0, 1.0)).collect::<Vec<f32>>()).unwrap();
        let w = dev.upload(&(0..n).map(|_| rng.range(0.0, 1.0)).collect::<Vec<f32>>()).unwrap();
        let sh = dev.upload(&(0..t * h).map(|_| rng.range(-1.0, 1.0)).collect::<Vec<f32>>()).unwrap();
        let g = dev.upload(&(0..t).map(|_| rng.normal(1.0)).collect::<Vec<f32>>()).unwrap();
        let mut out = dev.zeros::<f32>(t * h).unwrap();
        let slot_arg = if t == 1 { None } else { Some(&slot) };
        let (comb_t, comb_s) = time_op(&dev, 15, 50, |_| {
            moe_dispatch::combine(&dev, &y, &d_idx, slot_arg, &w, Some((&sh, &g)), t, k, h, &mut out).unwrap();
        });
        let gbs = ((n + 2 * t) * h * 4) as f64 / comb_t / 1e9;
        println!(
            "  T={t:5}: plan {:8.2} µs (spread {plan_s:.2}), combine {:8.2} µs ({gbs:.0} GB/s, spread {comb_s:.2})",
            plan_t * 1e6,
            comb_t * 1e6
        );
    }
}
