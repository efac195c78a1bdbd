//! `affine::quantize_bf16` against `mx.quantize` (mlx 0.32.4, CPU): bit-for-bit on an adversarial
//! matrix (`tests/data/affine_ref.safetensors`, made by `tools/affine_reference.py`), and a round trip
//! on fresh random data.

use half::bf16;
use lily_model::affine::{code, dequantize_row, dequantize_row_bf16, quantize_bf16, AffineParams};
use safetensors::{Dtype, SafeTensors};

const REF: &[u8] = include_bytes!("data/affine_ref.safetensors");

fn u16s(b: &[u8]) -> Vec<u16> {
    b.chunks_exact(2).map(|c| u16::from_le_bytes([c[0], c[1]])).collect()
}
fn u32s(b: &[u8]) -> Vec<u32> {
    b.chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
}

#[test]
fn bit_exact_with_mlx() {
    let st = SafeTensors::deserialize(REF).unwrap();
    let w = st.tensor("w").unwrap();
    assert_eq!(w.dtype(), Dtype::BF16);
    let (rows, cols) = (w.shape()[0], w.shape()[1]);
    let wv: Vec<bf16> = u16s(w.data()).into_iter().map(bf16::from_bits).collect();
    let mut cases = 0;
    for bits in [4u32, 8] {
        for gs in [32usize, 64, 128] {
            let p = AffineParams { bits, group_size: gs };
            let name = format!("b{bits}_g{gs}");
            let rq = st.tensor(&format!("{name}.weight")).unwrap();
            let rs = st.tensor(&format!("{name}.scales")).unwrap();
            let rb = st.tensor(&format!("{name}.biases")).unwrap();
            assert_eq!(rq.dtype(), Dtype::U32);
            assert_eq!(rq.shape(), &[rows, p.words_per_row(cols)]);
            assert_eq!(rs.shape(), &[rows, p.groups_per_row(cols)]);
            let (rq, rs, rb) = (u32s(rq.data()), u16s(rs.data()), u16s(rb.data()));

            let q = quantize_bf16(&wv, cols, p);
            let wpr = p.words_per_row(cols);
            let gpr = p.groups_per_row(cols);
            let mut bad = Vec::new();
            for r in 0..rows {
                let words_ok = q.packed[r * wpr..(r + 1) * wpr] == rq[r * wpr..(r + 1) * wpr];
                let sc: Vec<u16> = q.scales[r * gpr..(r + 1) * gpr].iter().map(|x| x.to_bits()).collect();
                let bi: Vec<u16> = q.biases[r * gpr..(r + 1) * gpr].iter().map(|x| x.to_bits()).collect();
                let scales_ok = sc == rs[r * gpr..(r + 1) * gpr];
                let biases_ok = bi == rb[r * gpr..(r + 1) * gpr];
                if !(words_ok && scales_ok && biases_ok) {
                    bad.push(format!("row {r}: words {words_ok} scales {scales_ok} biases {biases_ok}"));
                }
            }
            assert!(bad.is_empty(), "{name}: {} rows differ from mx.quantize:\n{}", bad.len(), bad.join("\n"));
            cases += 1;
        }
    }
    assert_eq!(cases, 6);
}

/// splitmix64, for test data.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn uniform(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
    fn normal(&mut self) -> f64 {
        let (u1, u2) = (self.uniform().max(1e-300), self.uniform());
        (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
    }
}

#[test]
fn round_trip_within_half_a_step() {
    let mut rng = Rng(7);
    let (rows, cols) = (96, 512);
    for bits in [4u32, 8] {
        for gs in [32usize, 64, 128] {
            let p = AffineParams { bits, group_size: gs };
            let w: Vec<bf16> = (0..rows * cols)
                .map(|i| {
                    let row_scale = 10f64.powi((i / cols) as i32 % 7 - 4);
                    bf16::from_f64(rng.normal() * row_scale + if (i / cols) % 5 == 0 { row_scale } else { 0.0 })
                })
                .collect();
            let q = quantize_bf16(&w, cols, p);
            let (wpr, gpr) = (p.words_per_row(cols), p.groups_per_row(cols));
            let n_bins = p.max_code() as f32;
            let mut out = vec![0f32; cols];
            let mut out2 = vec![0f32; cols];
            let mut clipped = 0usize;
            for r in 0..rows {
                let sc: Vec<f32> = q.scales[r * gpr..(r + 1) * gpr].iter().map(|x| x.to_f32()).collect();
                let bi: Vec<f32> = q.biases[r * gpr..(r + 1) * gpr].iter().map(|x| x.to_f32()).collect();
                let packed = &q.packed[r * wpr..(r + 1) * wpr];
                dequantize_row(packed, &sc, &bi, p, &mut out);
                dequantize_row_bf16(
                    packed,
                    &q.scales[r * gpr..(r + 1) * gpr],
                    &q.biases[r * gpr..(r + 1) * gpr],
                    p,
                    &mut out2,
                );
                assert_eq!(out, out2);
                for j in 0..cols {
                    let (s, b) = (sc[j / gs], bi[j / gs]);
                    let x = w[r * cols + j].to_f32();
                    let c = code(packed, j, bits) as f32;
                    assert_eq!(out[j], s * c + b);
                    let err = (out[j] - x).abs();
                    // bf16 rounding of the stored scale and bias: at most 2^-9 relative each.
                    let slop = (s.abs() * c + b.abs()) * 2f32.powi(-8);
                    let unclipped = (x - b) / s;
                    if unclipped <= n_bins + 0.5 {
                        assert!(
                            err <= 0.5 * s.abs() + slop,
                            "bits {bits} gs {gs} row {r} col {j}: {x} -> {} (scale {s}, bias {b})",
                            out[j]
                        );
                    } else {
                        // The far edge can clip after the q0 adjustment of the scale (zero is kept
                        // exact instead); that costs at most n_bins/15 steps.
                        clipped += 1;
                        let extra = (unclipped - n_bins) * s.abs();
                        assert!(extra <= s.abs() * n_bins / 15.0 + slop);
                        assert!(err <= 0.5 * s.abs() + extra + slop);
                    }
                }
            }
            assert!(clipped * 50 < rows * cols, "{clipped} clipped");
        }
    }
}

#[test]
fn codes_and_helpers() {
    let p = AffineParams { bits: 8, group_size: 32 };
    assert_eq!(p.words_per_row(256), 64);
    assert_eq!(p.groups_per_row(256), 8);
    let w: Vec<bf16> = (0..64).map(|i| bf16::from_f32(i as f32 - 32.0)).collect();
    let q = quantize_bf16(&w, 64, p);
    for j in 0..64 {
        let c = code(&q.packed, j, 8);
        assert_eq!(c, (q.packed[j / 4] >> (8 * (j % 4))) & 0xff);
    }
}
