//! The inner loops of the matrix products in `linear`: expanding a stored row (affine-quantised or
//! dense) to f32, the one-token product (the expansion fused with the dot, several rows at a time,
//! nothing stored) and the many-token tile (rows × tokens dot products on expanded rows).
//!
//! Every output element is computed in one fixed order, whatever the path, the tile or the thread
//! split, so a result never depends on how many tokens a call has, nor on the machine:
//! - a quantised weight is `s·q + b` in f32 (the product rounded, then the sum; no fused
//!   multiply-add), MLX's affine dequantisation; a dense weight is its stored value as f32;
//! - a dot product over `cols` keeps eight lane sums, lane `l` adding `w[c]·x[c]` (rounded, then
//!   added) over the columns `c ≡ l (mod 8)` in increasing order, combines them as
//!   `((l0+l4)+(l1+l5))+((l2+l6)+(l3+l7))`, then adds the `cols % 8` last products one by one.
//!
//! There are two implementations of the three kernels ([`Kernels`]): plain Rust over `[f32; 8]`
//! lanes (the portable path, for any CPU) and AVX2 intrinsics (x86-64, chosen at run time when the
//! CPU has AVX2), the same IEEE operations in the same order, so the same bits. The loops around
//! them (row blocks, tiles, tails) are shared, and compiled once per implementation with its target
//! features. `tests/kernels.rs` holds both paths to each other and to a plain scalar loop.

use std::sync::OnceLock;

use half::{bf16, f16};
use lily_model::buf::FloatBuf;
use lily_model::weights::{Matrix, Storage};

/// Which implementation of the kernels runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Isa {
    /// Plain Rust, baseline target features (any CPU).
    Portable,
    /// x86-64 AVX2 intrinsics (8-lane f32 vectors, variable shifts to unpack 4-bit codes).
    Avx2,
    /// x86-64 AVX-512F: the one-token product holds two rows per 16-lane register (lanes 0–7 one
    /// row's eight sums, 8–15 the next row's), so the eight-lane order is kept; the rest as AVX2,
    /// compiled with AVX-512 enabled.
    Avx512,
}

impl Isa {
    /// The best implementation this CPU can run (detected once).
    pub fn best() -> Isa {
        static BEST: OnceLock<Isa> = OnceLock::new();
        *BEST.get_or_init(|| Isa::available().last().copied().unwrap_or(Isa::Portable))
    }

    /// Every implementation this CPU can run, portable first.
    pub fn available() -> Vec<Isa> {
        let mut v = vec![Isa::Portable];
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx2") {
            v.push(Isa::Avx2);
            if std::arch::is_x86_feature_detected!("avx512f") {
                v.push(Isa::Avx512);
            }
        }
        v
    }
}

/// Bytes of expanded rows [`gemm_rows`] works on at a time (kept in the L1 cache while every token
/// passes over them).
pub const BLOCK_BYTES: usize = 32 << 10;
/// Dense rows expanded at a time by the one-token product.
const GEMV_R: usize = 4;

// ---------------------------------------------------------------------------------------------
// The entry points: one match on the implementation, then the loops compiled with its features.

/// `out[i] = W_m[r0 + i] · x` for `i < out.len()`: the one-token product (x: [cols]).
/// `scratch` is reused between calls (dense rows are expanded into it).
pub fn gemv_rows(isa: Isa, w: &Matrix, m: usize, r0: usize, x: &[f32], out: &mut [f32], scratch: &mut Vec<f32>) {
    assert_eq!(x.len(), w.cols, "gemv: x is not [cols]");
    assert!(m < w.count && r0 + out.len() <= w.rows, "gemv: rows out of range");
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: Isa::Avx2 is only produced where the CPU has AVX2 (`Isa::available`).
        Isa::Avx2 => unsafe { avx2::gemv_rows(w, m, r0, x, out, scratch) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: Isa::Avx512 is only produced where the CPU has AVX-512F.
        Isa::Avx512 => unsafe { avx512::gemv_rows(w, m, r0, x, out, scratch) },
        _ => gemv_rows_impl::<Portable>(w, m, r0, x, out, scratch),
    }
}

/// The many-token product on rows `r0..r0 + nr` and the tokens of `x` ([nt, cols]):
/// `out[t * nr + i] = W_m[r0 + i] · x[t]`. `scratch` is reused between calls.
#[allow(clippy::too_many_arguments)]
pub fn gemm_rows(isa: Isa, w: &Matrix, m: usize, r0: usize, nr: usize, x: &[f32], out: &mut [f32], scratch: &mut Vec<f32>) {
    assert_eq!(x.len() % w.cols, 0, "gemm: x is not [T, cols]");
    assert!(m < w.count && r0 + nr <= w.rows, "gemm: rows out of range");
    assert_eq!(out.len(), x.len() / w.cols * nr, "gemm: out is not [T, nr]");
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as in gemv_rows.
        Isa::Avx2 => unsafe { avx2::gemm_rows(w, m, r0, nr, x, out, scratch) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        Isa::Avx512 => unsafe { avx512::gemm_rows(w, m, r0, nr, x, out, scratch) },
        _ => gemm_rows_impl::<Portable>(w, m, r0, nr, x, out, scratch),
    }
}

/// Expands row `r` of matrix `m` of the stack into `out` (len = cols).
pub fn expand_row(isa: Isa, w: &Matrix, m: usize, r: usize, out: &mut [f32]) {
    assert_eq!(out.len(), w.cols, "expand: out is not [cols]");
    assert!(r < w.rows && m < w.count, "expand: row out of range");
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as in gemv_rows.
        Isa::Avx2 => unsafe { avx2::expand_row(w, m * w.rows + r, out) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        Isa::Avx512 => unsafe { avx512::expand_row(w, m * w.rows + r, out) },
        _ => expand_row_impl::<Portable>(w, m * w.rows + r, out),
    }
}

/// Every product of rows `a_i` (i < na, `a[i·sa..][..d]`) with rows `b_u` (u < nb, `b[u·sb..][..d]`)
/// into `out[u·os + i]`, each summed in the fixed order (attention scores: keys × queries).
#[allow(clippy::too_many_arguments)]
pub fn dots(isa: Isa, a: &[f32], sa: usize, na: usize, b: &[f32], sb: usize, nb: usize, d: usize, out: &mut [f32], os: usize) {
    assert!(na == 0 || (na - 1) * sa + d <= a.len(), "dots: a too short");
    assert!(nb == 0 || (nb - 1) * sb + d <= b.len(), "dots: b too short");
    assert!(nb == 0 || na == 0 || (nb - 1) * os + na <= out.len(), "dots: out too short");
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as in gemv_rows.
        Isa::Avx2 => unsafe { avx2::dots(a, sa, na, b, sb, nb, d, out, os) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        Isa::Avx512 => unsafe { avx512::dots(a, sa, na, b, sb, nb, d, out, os) },
        _ => Portable::dots(a, sa, na, b, sb, nb, d, out, os),
    }
}

/// For each of the `rows` rows r of `out` ([rows, d]): `out[r·d + j] += Σ_{p < n} w[r·sw + p] ·
/// v[p·sv + j]`, in increasing p for every element (attention's weighted sums of value rows; the
/// rows share each value row read).
#[allow(clippy::too_many_arguments)]
pub fn weighted_sum(isa: Isa, w: &[f32], sw: usize, n: usize, v: &[f32], sv: usize, out: &mut [f32], rows: usize) {
    assert!(rows > 0 && out.len().is_multiple_of(rows), "weighted_sum: out is not [rows, d]");
    let d = out.len() / rows;
    assert!(n == 0 || ((rows - 1) * sw + n <= w.len() && (n - 1) * sv + d <= v.len()), "weighted_sum: w or v too short");
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as in gemv_rows.
        Isa::Avx2 => unsafe { avx2::weighted_sum(w, sw, n, v, sv, out, rows) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        Isa::Avx512 => unsafe { avx512::weighted_sum(w, sw, n, v, sv, out, rows) },
        _ => Portable::weighted_sum(w, sw, n, v, sv, out, rows),
    }
}

/// In place on a row of attention scores: `s ← s·scale`, then the softmax
/// `exp(s − max s) / Σ exp(s − max s)`, with [`exp_neg`] and the sum in the fixed eight-lane order.
pub fn softmax(isa: Isa, s: &mut [f32], scale: f32) {
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as in gemv_rows.
        Isa::Avx2 => unsafe { avx2::softmax(s, scale) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        Isa::Avx512 => unsafe { avx512::softmax(s, scale) },
        _ => softmax_impl(s, scale),
    }
}

/// `e^x` for x ≤ 0 in f32, by Cephes' `expf` polynomial (about 1 ulp; the same algorithm as
/// `lily_sampler::ops::exp_f32`), written out so that it vectorises and gives the same bits on
/// every machine: 0 below −87 (weights under 1.6e-38 of the largest), NaN for NaN.
#[inline(always)]
pub fn exp_neg(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    const ROUND: f32 = 12_582_912.0; // 1.5 · 2^23: adding it rounds to an integer (ties to even)
    let xc = x.clamp(-87.0, 0.0);
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
    } else if x.is_nan() {
        x
    } else {
        0.0
    }
}

#[inline(always)]
fn softmax_impl(s: &mut [f32], scale: f32) {
    for v in s.iter_mut() {
        *v *= scale;
    }
    // The largest score (NaN ignored, as f32::max does; exact in any order).
    let mut mx = [f32::NEG_INFINITY; 8];
    let mut chunks = s.chunks_exact(8);
    for c in &mut chunks {
        for l in 0..8 {
            mx[l] = if c[l] > mx[l] { c[l] } else { mx[l] };
        }
    }
    let m = mx.iter().chain(chunks.remainder()).fold(f32::NEG_INFINITY, |m, &v| if v > m { v } else { m });
    let mut acc = [0f32; 8];
    let mut chunks = s.chunks_exact_mut(8);
    for c in &mut chunks {
        for l in 0..8 {
            c[l] = exp_neg(c[l] - m);
            acc[l] += c[l];
        }
    }
    let mut sum = combine(&acc);
    for v in chunks.into_remainder() {
        *v = exp_neg(*v - m);
        sum += *v;
    }
    for v in s.iter_mut() {
        *v /= sum;
    }
}

// ---------------------------------------------------------------------------------------------
// Stored values and the affine view.

/// A stored scalar type of scales, biases or dense weights.
pub(crate) trait Stored: Copy {
    fn f32(self) -> f32;
}
impl Stored for bf16 {
    /// The widening without `half`'s branch that sets the quiet bit of a NaN (a NaN scale gives
    /// NaN weights either way).
    #[inline(always)]
    fn f32(self) -> f32 {
        f32::from_bits((self.to_bits() as u32) << 16)
    }
}
impl Stored for f16 {
    #[inline(always)]
    fn f32(self) -> f32 {
        self.to_f32()
    }
}
impl Stored for f32 {
    #[inline(always)]
    fn f32(self) -> f32 {
        self
    }
}

/// An affine-quantised stack seen as rows (`row` counts over the whole stack: m · rows + r), with
/// codes the fast kernels unpack: 4 or 8 bits, groups of a multiple of 8 columns.
pub(crate) struct Affine<'a, S> {
    group: usize,
    groups: usize,
    words: usize,
    packed: &'a [u32],
    scales: &'a [S],
    biases: &'a [S],
}

impl<S: Stored> Affine<'_, S> {
    #[inline(always)]
    fn words_of(&self, row: usize) -> &[u32] {
        &self.packed[row * self.words..(row + 1) * self.words]
    }
    #[inline(always)]
    fn scale_bias(&self, row: usize, g: usize) -> (f32, f32) {
        let i = row * self.groups + g;
        (self.scales[i].f32(), self.biases[i].f32())
    }
}

/// Runs `$body` with `$a` an [`Affine`] view of `$w` and `$bits` its code width as a const, when the
/// fast kernels handle its layout; `$other` otherwise.
macro_rules! with_affine {
    ($w:expr, |$a:ident, $bits:ident| $body:expr, else $other:expr) => {{
        let w: &Matrix = $w;
        match &w.storage {
            Storage::Affine { params, packed, scales, biases }
                if matches!(params.bits, 4 | 8) && params.group_size % 8 == 0 && w.cols % params.group_size == 0 =>
            {
                let (group, bits) = (params.group_size, params.bits);
                let (groups, words) = (w.cols / group, w.cols * bits as usize / 32);
                macro_rules! view {
                    ($s:expr, $b:expr) => {
                        Affine { group, groups, words, packed: &packed[..], scales: &$s[..], biases: &$b[..] }
                    };
                }
                match (bits, scales, biases) {
                    (4, FloatBuf::Bf16(s), FloatBuf::Bf16(b)) => {
                        const $bits: u32 = 4;
                        let $a = view!(s, b);
                        $body
                    }
                    (8, FloatBuf::Bf16(s), FloatBuf::Bf16(b)) => {
                        const $bits: u32 = 8;
                        let $a = view!(s, b);
                        $body
                    }
                    (4, FloatBuf::F16(s), FloatBuf::F16(b)) => {
                        const $bits: u32 = 4;
                        let $a = view!(s, b);
                        $body
                    }
                    (8, FloatBuf::F16(s), FloatBuf::F16(b)) => {
                        const $bits: u32 = 8;
                        let $a = view!(s, b);
                        $body
                    }
                    (4, FloatBuf::F32(s), FloatBuf::F32(b)) => {
                        const $bits: u32 = 4;
                        let $a = view!(s, b);
                        $body
                    }
                    (8, FloatBuf::F32(s), FloatBuf::F32(b)) => {
                        const $bits: u32 = 8;
                        let $a = view!(s, b);
                        $body
                    }
                    _ => $other,
                }
            }
            _ => $other,
        }
    }};
}

// ---------------------------------------------------------------------------------------------
// The kernels, and the loops around them (shared by both implementations).

/// One implementation of the three kernels. Every method is `#[inline(always)]`, so each lands in
/// the loops compiled for its implementation.
pub(crate) trait Kernels {
    /// Row `row` of the stack as f32: `out[c] = s·q[c] + b`.
    fn expand_affine<const BITS: u32, S: Stored>(a: &Affine<S>, row: usize, out: &mut [f32]);
    /// Rows row0..row0+R dotted with x ([cols]), each weight expanded in registers.
    fn gemv_affine<const BITS: u32, const R: usize, S: Stored>(a: &Affine<S>, row0: usize, x: &[f32]) -> [f32; R];
    /// `out[i]` = row `base + i` · x: [`Kernels::gemv_affine`] on groups of this implementation's size.
    fn gemv_affine_rows<const BITS: u32, S: Stored>(a: &Affine<S>, base: usize, x: &[f32], out: &mut [f32]);
    /// The products of R expanded rows with U token rows (all `x[0].len()` long; rows may be longer).
    fn dot_tile<const R: usize, const U: usize>(w: [&[f32]; R], x: [&[f32]; U]) -> [[f32; U]; R];
    /// Every product of rows `a_i` (i < na, `a[i·sa..][..d]`) with rows `b_u` (u < nb,
    /// `b[u·sb..][..d]`) into `out[u·os + i]`: tiles of this implementation's shape.
    #[allow(clippy::too_many_arguments)]
    fn dots(a: &[f32], sa: usize, na: usize, b: &[f32], sb: usize, nb: usize, d: usize, out: &mut [f32], os: usize);
    /// [`weighted_sum`]'s contract (arguments checked by it).
    #[allow(clippy::too_many_arguments)]
    fn weighted_sum(w: &[f32], sw: usize, n: usize, v: &[f32], sv: usize, out: &mut [f32], rows: usize);
    /// The many-token product of a block of `nb` expanded rows (`cols` apart in `rows`) with every
    /// token of `x`, into `out[t·os + i]`; `pack` is room for a copy of the block in whatever
    /// layout the implementation prefers.
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    fn gemm_block(rows: &[f32], nb: usize, x: &[f32], cols: usize, out: &mut [f32], os: usize, pack: &mut [f32]) {
        let _ = pack;
        Self::dots(rows, cols, nb, x, cols, x.len() / cols, cols, out, os)
    }
}

/// The fixed combination of the eight lane sums.
#[inline(always)]
fn combine(a: &[f32; 8]) -> f32 {
    ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7]))
}

/// [`Kernels::dots`] with R × U register tiles, and R × 1, 1 × U, 1 × 1 ones for the tails.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn dots_tiled<K: Kernels, const R: usize, const U: usize>(
    a: &[f32],
    sa: usize,
    na: usize,
    b: &[f32],
    sb: usize,
    nb: usize,
    d: usize,
    out: &mut [f32],
    os: usize,
) {
    let row = |i: usize| &a[i * sa..i * sa + d];
    let tok = |u: usize| &b[u * sb..u * sb + d];
    let (full_r, full_u) = (na / R * R, nb / U * U);
    // U rows of b at a time (they stay in registers' reach), sweeping every row of a (kept in L1 by
    // the callers: a block of expanded weights, or of keys), then the single rows of b.
    for u in (0..full_u).step_by(U) {
        let mut br: [&[f32]; U] = [&[]; U];
        for (j, br) in br.iter_mut().enumerate() {
            *br = tok(u + j);
        }
        for i in (0..full_r).step_by(R) {
            let mut ar: [&[f32]; R] = [&[]; R];
            for (k, ar) in ar.iter_mut().enumerate() {
                *ar = row(i + k);
            }
            let v = K::dot_tile::<R, U>(ar, br);
            for j in 0..U {
                for (k, vr) in v.iter().enumerate() {
                    out[(u + j) * os + i + k] = vr[j];
                }
            }
        }
        for i in full_r..na {
            let v = K::dot_tile::<1, U>([row(i)], br);
            for (j, val) in v[0].iter().enumerate() {
                out[(u + j) * os + i] = *val;
            }
        }
    }
    for u in full_u..nb {
        let br = [tok(u)];
        for i in (0..full_r).step_by(R) {
            let mut ar: [&[f32]; R] = [&[]; R];
            for (k, ar) in ar.iter_mut().enumerate() {
                *ar = row(i + k);
            }
            let v = K::dot_tile::<R, 1>(ar, br);
            for (k, vr) in v.iter().enumerate() {
                out[u * os + i + k] = vr[0];
            }
        }
        for i in full_r..na {
            out[u * os + i] = K::dot_tile::<1, 1>([row(i)], br)[0][0];
        }
    }
}

/// [`Kernels::weighted_sum`] in plain Rust: R rows and C columns at a time, so the R·C sums stay in
/// registers over all the positions and each value row read serves R rows (each element's order
/// over p is unchanged). The builds choose R and C for their registers.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn weighted_sum_blocked<const R: usize, const C: usize>(w: &[f32], sw: usize, n: usize, v: &[f32], sv: usize, out: &mut [f32], rows: usize) {
    let d = out.len() / rows;
    let full_r = rows / R * R;
    for r0 in (0..full_r).step_by(R) {
        weighted_sum_rows::<R, C>(&w[r0 * sw..], sw, n, v, sv, &mut out[r0 * d..(r0 + R) * d]);
    }
    for r in full_r..rows {
        weighted_sum_rows::<1, C>(&w[r * sw..], sw, n, v, sv, &mut out[r * d..(r + 1) * d]);
    }
}

/// R rows of [`weighted_sum_blocked`]: out [R, d].
#[inline(always)]
fn weighted_sum_rows<const R: usize, const C: usize>(w: &[f32], sw: usize, n: usize, v: &[f32], sv: usize, out: &mut [f32]) {
    let d = out.len() / R;
    let full = d / C * C;
    for j0 in (0..full).step_by(C) {
        let mut acc = [[0f32; C]; R];
        for (r, acc) in acc.iter_mut().enumerate() {
            acc.copy_from_slice(&out[r * d + j0..r * d + j0 + C]);
        }
        for p in 0..n {
            let vr: &[f32; C] = v[p * sv + j0..p * sv + j0 + C].try_into().unwrap();
            for (r, acc) in acc.iter_mut().enumerate() {
                let wp = w[r * sw + p];
                for l in 0..C {
                    acc[l] += wp * vr[l];
                }
            }
        }
        for (r, acc) in acc.iter().enumerate() {
            out[r * d + j0..r * d + j0 + C].copy_from_slice(acc);
        }
    }
    for r in 0..R {
        for j in full..d {
            let mut acc = out[r * d + j];
            for p in 0..n {
                acc += w[r * sw + p] * v[p * sv + j];
            }
            out[r * d + j] = acc;
        }
    }
}

/// [`Kernels::gemv_affine_rows`] with groups of R rows, then single rows.
#[inline(always)]
fn gemv_affine_rows_grouped<K: Kernels, const BITS: u32, const R: usize, S: Stored>(a: &Affine<S>, base: usize, x: &[f32], out: &mut [f32]) {
    let full = out.len() / R * R;
    let (head, tail) = out.split_at_mut(full);
    for (i, o) in head.chunks_exact_mut(R).enumerate() {
        o.copy_from_slice(&K::gemv_affine::<BITS, R, S>(a, base + i * R, x));
    }
    for (i, o) in tail.iter_mut().enumerate() {
        *o = K::gemv_affine::<BITS, 1, S>(a, base + full + i, x)[0];
    }
}

/// Expands one row of the stack (row = m · rows + r).
#[inline(always)]
fn expand_row_impl<K: Kernels>(w: &Matrix, row: usize, out: &mut [f32]) {
    with_affine!(w, |a, BITS| K::expand_affine::<BITS, _>(&a, row, out), else expand_generic(w, row, out))
}

/// Any storage, one element at a time (dense rows, and codes of other widths or groupings).
fn expand_generic(w: &Matrix, row: usize, out: &mut [f32]) {
    let cols = w.cols;
    match &w.storage {
        Storage::Dense(data) => data.read_into(row * cols, out),
        Storage::Affine { params, packed, scales, biases } => {
            let (bits, group) = (params.bits, params.group_size);
            let words = cols * bits as usize / 32;
            let groups = cols / group;
            let packed = &packed[row * words..(row + 1) * words];
            let per_word = (32 / bits) as usize;
            let mask = (1u32 << bits) - 1;
            for g in 0..groups {
                let s = scales.get(row * groups + g);
                let b = biases.get(row * groups + g);
                let wstart = g * group / per_word;
                let dst = &mut out[g * group..(g + 1) * group];
                for (wi, chunk) in dst.chunks_exact_mut(per_word).enumerate() {
                    let mut word = packed[wstart + wi];
                    for o in chunk {
                        *o = s * (word & mask) as f32 + b;
                        word >>= bits;
                    }
                }
            }
        }
    }
}

#[inline(always)]
fn gemv_rows_impl<K: Kernels>(w: &Matrix, m: usize, r0: usize, x: &[f32], out: &mut [f32], scratch: &mut Vec<f32>) {
    let base = m * w.rows + r0;
    with_affine!(
        w,
        |a, BITS| K::gemv_affine_rows::<BITS, _>(&a, base, x, out),
        else {
            // Dense rows (or unusual codes): expand a few rows, then the tile kernel on one token.
            let cols = w.cols;
            scratch.resize(GEMV_R * cols, 0.0);
            for (i0, o) in (0..out.len()).step_by(GEMV_R).zip(out.chunks_mut(GEMV_R)) {
                for (i, dst) in scratch.chunks_exact_mut(cols).take(o.len()).enumerate() {
                    expand_row_impl::<K>(w, base + i0 + i, dst);
                }
                for (i, v) in o.iter_mut().enumerate() {
                    *v = K::dot_tile::<1, 1>([&scratch[i * cols..(i + 1) * cols]], [x])[0][0];
                }
            }
        }
    )
}

#[inline(always)]
fn gemm_rows_impl<K: Kernels>(w: &Matrix, m: usize, r0: usize, nr: usize, x: &[f32], out: &mut [f32], scratch: &mut Vec<f32>) {
    let cols = w.cols;
    let block = (BLOCK_BYTES / (4 * cols)).clamp(8, 64) / 8 * 8;
    scratch.resize(2 * block * cols, 0.0);
    let (rows, pack) = scratch.split_at_mut(block * cols);
    for b0 in (0..nr).step_by(block) {
        let nb = block.min(nr - b0);
        for (i, dst) in rows.chunks_exact_mut(cols).take(nb).enumerate() {
            expand_row_impl::<K>(w, m * w.rows + r0 + b0 + i, dst);
        }
        K::gemm_block(rows, nb, x, cols, &mut out[b0..], nr, pack);
    }
}

// ---------------------------------------------------------------------------------------------
// The portable implementation: plain Rust over [f32; 8] lanes.

pub(crate) struct Portable;

#[inline(always)]
fn lanes(s: &[f32], c: usize) -> [f32; 8] {
    s[c..c + 8].try_into().unwrap()
}

/// The codes of columns c..c+8 (c a multiple of 8) of a row's packed words, as f32.
#[inline(always)]
fn codes<const BITS: u32>(words: &[u32], c: usize) -> [f32; 8] {
    let mut q = [0f32; 8];
    if BITS == 4 {
        let w = words[c / 8];
        for (l, q) in q.iter_mut().enumerate() {
            *q = ((w >> (4 * l as u32)) & 0xF) as i32 as f32;
        }
    } else {
        let (w0, w1) = (words[c / 4], words[c / 4 + 1]);
        for l in 0..4 {
            q[l] = ((w0 >> (8 * l as u32)) & 0xFF) as i32 as f32;
            q[l + 4] = ((w1 >> (8 * l as u32)) & 0xFF) as i32 as f32;
        }
    }
    q
}

impl Kernels for Portable {
    #[inline(always)]
    fn expand_affine<const BITS: u32, S: Stored>(a: &Affine<S>, row: usize, out: &mut [f32]) {
        let words = a.words_of(row);
        for (g, dst) in out.chunks_exact_mut(a.group).enumerate() {
            let (s, b) = a.scale_bias(row, g);
            for (i, o8) in dst.chunks_exact_mut(8).enumerate() {
                let q = codes::<BITS>(words, g * a.group + i * 8);
                for l in 0..8 {
                    o8[l] = s * q[l] + b;
                }
            }
        }
    }

    #[inline(always)]
    fn gemv_affine<const BITS: u32, const R: usize, S: Stored>(a: &Affine<S>, row0: usize, x: &[f32]) -> [f32; R] {
        let mut words: [&[u32]; R] = [&[]; R];
        for (r, w) in words.iter_mut().enumerate() {
            *w = a.words_of(row0 + r);
        }
        let mut acc = [[0f32; 8]; R];
        for g in 0..a.groups {
            let mut sb = [(0f32, 0f32); R];
            for (r, sb) in sb.iter_mut().enumerate() {
                *sb = a.scale_bias(row0 + r, g);
            }
            for c in (g * a.group..(g + 1) * a.group).step_by(8) {
                let xv = lanes(x, c);
                for r in 0..R {
                    let q = codes::<BITS>(words[r], c);
                    for l in 0..8 {
                        acc[r][l] += (sb[r].0 * q[l] + sb[r].1) * xv[l];
                    }
                }
            }
        }
        let mut out = [0f32; R];
        for (o, acc) in out.iter_mut().zip(&acc) {
            *o = combine(acc);
        }
        out
    }

    #[inline(always)]
    fn gemv_affine_rows<const BITS: u32, S: Stored>(a: &Affine<S>, base: usize, x: &[f32], out: &mut [f32]) {
        gemv_affine_rows_grouped::<Self, BITS, 4, S>(a, base, x, out)
    }

    #[inline(always)]
    fn dot_tile<const R: usize, const U: usize>(w: [&[f32]; R], x: [&[f32]; U]) -> [[f32; U]; R] {
        let cols = x[0].len();
        let c8 = cols / 8 * 8;
        let mut acc = [[[0f32; 8]; U]; R];
        for c in (0..c8).step_by(8) {
            let mut wv = [[0f32; 8]; R];
            for (wv, w) in wv.iter_mut().zip(&w) {
                *wv = lanes(w, c);
            }
            for u in 0..U {
                let xv = lanes(x[u], c);
                for r in 0..R {
                    for l in 0..8 {
                        acc[r][u][l] += wv[r][l] * xv[l];
                    }
                }
            }
        }
        let mut out = [[0f32; U]; R];
        for r in 0..R {
            for u in 0..U {
                let mut s = combine(&acc[r][u]);
                for c in c8..cols {
                    s += w[r][c] * x[u][c];
                }
                out[r][u] = s;
            }
        }
        out
    }

    #[inline(always)]
    fn dots(a: &[f32], sa: usize, na: usize, b: &[f32], sb: usize, nb: usize, d: usize, out: &mut [f32], os: usize) {
        dots_tiled::<Self, 4, 3>(a, sa, na, b, sb, nb, d, out, os)
    }

    #[inline(always)]
    fn weighted_sum(w: &[f32], sw: usize, n: usize, v: &[f32], sv: usize, out: &mut [f32], rows: usize) {
        weighted_sum_blocked::<2, 16>(w, sw, n, v, sv, out, rows)
    }
}

// ---------------------------------------------------------------------------------------------
// The AVX2 implementation.

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::{
        combine, dots_tiled, expand_row_impl, gemm_rows_impl, gemv_affine_rows_grouped, gemv_rows_impl, weighted_sum_blocked, Affine, Kernels, Stored,
    };
    use lily_model::weights::Matrix;

    pub(crate) struct Avx2;

    #[target_feature(enable = "avx2")]
    pub(super) fn gemv_rows(w: &Matrix, m: usize, r0: usize, x: &[f32], out: &mut [f32], scratch: &mut Vec<f32>) {
        gemv_rows_impl::<Avx2>(w, m, r0, x, out, scratch)
    }

    #[target_feature(enable = "avx2")]
    pub(super) fn gemm_rows(w: &Matrix, m: usize, r0: usize, nr: usize, x: &[f32], out: &mut [f32], scratch: &mut Vec<f32>) {
        gemm_rows_impl::<Avx2>(w, m, r0, nr, x, out, scratch)
    }

    #[target_feature(enable = "avx2")]
    pub(super) fn expand_row(w: &Matrix, row: usize, out: &mut [f32]) {
        expand_row_impl::<Avx2>(w, row, out)
    }

    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx2")]
    pub(super) fn dots(a: &[f32], sa: usize, na: usize, b: &[f32], sb: usize, nb: usize, d: usize, out: &mut [f32], os: usize) {
        <Avx2 as Kernels>::dots(a, sa, na, b, sb, nb, d, out, os)
    }

    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx2")]
    pub(super) fn weighted_sum(w: &[f32], sw: usize, n: usize, v: &[f32], sv: usize, out: &mut [f32], rows: usize) {
        <Avx2 as Kernels>::weighted_sum(w, sw, n, v, sv, out, rows)
    }

    #[target_feature(enable = "avx2")]
    pub(super) fn softmax(s: &mut [f32], scale: f32) {
        super::softmax_impl(s, scale)
    }

    /// The codes of columns c..c+8 (c a multiple of 8) of a row's words, as f32 lanes. 4 bits: the
    /// word of the eight codes in every lane, shifted right by 0, 4, …, 28 and masked; 8 bits: the
    /// eight bytes of two words, widened (x86 is little-endian: byte j of the row is code j).
    ///
    /// SAFETY: the caller checks that `words` holds the codes of columns c..c+8, and runs with AVX2.
    #[inline(always)]
    pub(super) unsafe fn codes<const BITS: u32>(words: &[u32], c: usize) -> __m256 {
        unsafe {
            if BITS == 4 {
                let v = _mm256_set1_epi32(*words.get_unchecked(c / 8) as i32);
                let q = _mm256_srlv_epi32(v, _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28));
                _mm256_cvtepi32_ps(_mm256_and_si256(q, _mm256_set1_epi32(0xF)))
            } else {
                let b = _mm_loadl_epi64(words.as_ptr().add(c / 4) as *const __m128i);
                _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b))
            }
        }
    }

    /// How far ahead the one-token product prefetches a matrix's rows.
    const PREFETCH_ROWS: usize = 32;

    /// Prefetches the rows PREFETCH_ROWS after row0..row0+n (codes, scales, biases): a matrix larger
    /// than the caches (the lm_head) streams from memory, and the hardware prefetcher alone leaves
    /// the core waiting. The addresses may run past the matrix: a prefetch never faults, and the
    /// pointers are formed with wrapping arithmetic and never read.
    #[inline(always)]
    pub(super) fn prefetch_rows<S: Stored>(a: &Affine<S>, row0: usize, n: usize) {
        let ahead = a.packed.as_ptr().wrapping_add((row0 + PREFETCH_ROWS) * a.words) as *const i8;
        let g = (row0 + PREFETCH_ROWS) * a.groups;
        // SAFETY: prefetches only (SSE, part of x86-64).
        unsafe {
            for line in (0..n * a.words * 4).step_by(64) {
                _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(line));
            }
            _mm_prefetch::<_MM_HINT_T0>(a.scales.as_ptr().wrapping_add(g) as *const i8);
            _mm_prefetch::<_MM_HINT_T0>(a.biases.as_ptr().wrapping_add(g) as *const i8);
        }
    }

    /// The eight lanes of `v`, combined in the fixed order.
    #[inline(always)]
    pub(super) unsafe fn reduce(v: __m256) -> f32 {
        let mut a = [0f32; 8];
        unsafe { _mm256_storeu_ps(a.as_mut_ptr(), v) };
        combine(&a)
    }

    /// Eight sums at once: lane j of the result is `v[j]`'s eight lanes combined in the fixed order,
    /// `((a0+a4)+(a1+a5))+((a2+a6)+(a3+a7))`, by the same additions done across registers.
    #[inline(always)]
    pub(super) unsafe fn reduce8(v: &[__m256; 8]) -> __m256 {
        unsafe {
            // [x_k + x_{k+4} (k < 4) | y_k + y_{k+4}]: the first level for two vectors.
            let half = |x: __m256, y: __m256| {
                _mm256_add_ps(_mm256_permute2f128_ps::<0x20>(x, y), _mm256_permute2f128_ps::<0x31>(x, y))
            };
            // hadd pairs neighbours within each 128-bit half: [x01, x23, y01, y23 | …].
            let p04 = half(v[0], v[4]);
            let p15 = half(v[1], v[5]);
            let p26 = half(v[2], v[6]);
            let p37 = half(v[3], v[7]);
            let q0 = _mm256_hadd_ps(p04, p15); // [v0:01, v0:23, v1:01, v1:23 | v4…, v5…]
            let q1 = _mm256_hadd_ps(p26, p37); // [v2…, v3… | v6…, v7…]
            _mm256_hadd_ps(q0, q1) // [v0, v1, v2, v3 | v4, v5, v6, v7]
        }
    }

    impl Kernels for Avx2 {
        #[inline(always)]
        fn expand_affine<const BITS: u32, S: Stored>(a: &Affine<S>, row: usize, out: &mut [f32]) {
            let words = a.words_of(row);
            let cols = a.groups * a.group;
            assert!(out.len() >= cols && words.len() * 32 >= cols * BITS as usize);
            for g in 0..a.groups {
                let (s, b) = a.scale_bias(row, g);
                // SAFETY: columns below cols, checked above; AVX2 by the entry point.
                unsafe {
                    let (s, b) = (_mm256_set1_ps(s), _mm256_set1_ps(b));
                    for c in (g * a.group..(g + 1) * a.group).step_by(8) {
                        let w = _mm256_add_ps(_mm256_mul_ps(s, codes::<BITS>(words, c)), b);
                        _mm256_storeu_ps(out.as_mut_ptr().add(c), w);
                    }
                }
            }
        }

        #[inline(always)]
        fn gemv_affine<const BITS: u32, const R: usize, S: Stored>(a: &Affine<S>, row0: usize, x: &[f32]) -> [f32; R] {
            let mut words: [&[u32]; R] = [&[]; R];
            for (r, w) in words.iter_mut().enumerate() {
                *w = a.words_of(row0 + r);
            }
            let cols = a.groups * a.group;
            assert!(x.len() >= cols && words.iter().all(|w| w.len() * 32 >= cols * BITS as usize));
            prefetch_rows(a, row0, R);
            // SAFETY: columns below cols, checked above; AVX2 by the entry point.
            unsafe {
                let mut acc = [_mm256_setzero_ps(); R];
                for g in 0..a.groups {
                    let mut sb = [(_mm256_setzero_ps(), _mm256_setzero_ps()); R];
                    for (r, sb) in sb.iter_mut().enumerate() {
                        let (s, b) = a.scale_bias(row0 + r, g);
                        *sb = (_mm256_set1_ps(s), _mm256_set1_ps(b));
                    }
                    for c in (g * a.group..(g + 1) * a.group).step_by(8) {
                        let xv = _mm256_loadu_ps(x.as_ptr().add(c));
                        for r in 0..R {
                            let w = _mm256_add_ps(_mm256_mul_ps(sb[r].0, codes::<BITS>(words[r], c)), sb[r].1);
                            acc[r] = _mm256_add_ps(acc[r], _mm256_mul_ps(w, xv));
                        }
                    }
                }
                let mut out = [0f32; R];
                for (o, &acc) in out.iter_mut().zip(&acc) {
                    *o = reduce(acc);
                }
                out
            }
        }

        #[inline(always)]
        fn gemv_affine_rows<const BITS: u32, S: Stored>(a: &Affine<S>, base: usize, x: &[f32], out: &mut [f32]) {
            // Two rows: two independent sums hide the add latency, and the scales, biases, sums,
            // codes and x fit in the 16 vector registers.
            gemv_affine_rows_grouped::<Self, BITS, 2, S>(a, base, x, out)
        }

        #[inline(always)]
        fn dot_tile<const R: usize, const U: usize>(w: [&[f32]; R], x: [&[f32]; U]) -> [[f32; U]; R] {
            let cols = x[0].len();
            let c8 = cols / 8 * 8;
            assert!(w.iter().all(|r| r.len() >= cols) && x.iter().all(|u| u.len() == cols));
            // SAFETY: columns below cols, checked above; AVX2 by the entry point.
            unsafe {
                let mut acc = [[_mm256_setzero_ps(); U]; R];
                for c in (0..c8).step_by(8) {
                    let mut wv = [_mm256_setzero_ps(); R];
                    for (wv, w) in wv.iter_mut().zip(&w) {
                        *wv = _mm256_loadu_ps(w.as_ptr().add(c));
                    }
                    for u in 0..U {
                        let xv = _mm256_loadu_ps(x[u].as_ptr().add(c));
                        for r in 0..R {
                            acc[r][u] = _mm256_add_ps(acc[r][u], _mm256_mul_ps(wv[r], xv));
                        }
                    }
                }
                let mut out = [[0f32; U]; R];
                if R * U == 8 && c8 == cols {
                    // The whole tile's sums at once (no tail products to add).
                    let mut v = [_mm256_setzero_ps(); 8];
                    for (j, v) in v.iter_mut().enumerate() {
                        *v = acc[j / U][j % U];
                    }
                    let mut sums = [0f32; 8];
                    _mm256_storeu_ps(sums.as_mut_ptr(), reduce8(&v));
                    for (j, &s) in sums.iter().enumerate() {
                        out[j / U][j % U] = s;
                    }
                    return out;
                }
                for r in 0..R {
                    for u in 0..U {
                        let mut s = reduce(acc[r][u]);
                        for c in c8..cols {
                            s += w[r][c] * x[u][c];
                        }
                        out[r][u] = s;
                    }
                }
                out
            }
        }

        #[inline(always)]
        fn dots(a: &[f32], sa: usize, na: usize, b: &[f32], sb: usize, nb: usize, d: usize, out: &mut [f32], os: usize) {
            // 4 × 2 tiles: 8 sums, 4 rows and a token in 14 of the 16 vector registers.
            dots_tiled::<Self, 4, 2>(a, sa, na, b, sb, nb, d, out, os)
        }

        #[inline(always)]
        fn weighted_sum(w: &[f32], sw: usize, n: usize, v: &[f32], sv: usize, out: &mut [f32], rows: usize) {
            // Plain Rust: with AVX2 enabled, 4 rows × 16 columns are 8 registers of sums.
            weighted_sum_blocked::<4, 16>(w, sw, n, v, sv, out, rows)
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The AVX-512 implementation.

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    use super::avx2::{self, Avx2};
    use super::{dots_tiled, expand_row_impl, gemm_rows_impl, gemv_affine_rows_grouped, gemv_rows_impl, weighted_sum_blocked, Affine, Kernels, Stored};
    use lily_model::weights::Matrix;

    pub(super) struct Avx512;

    #[target_feature(enable = "avx512f")]
    pub(super) fn gemv_rows(w: &Matrix, m: usize, r0: usize, x: &[f32], out: &mut [f32], scratch: &mut Vec<f32>) {
        gemv_rows_impl::<Avx512>(w, m, r0, x, out, scratch)
    }

    #[target_feature(enable = "avx512f")]
    pub(super) fn gemm_rows(w: &Matrix, m: usize, r0: usize, nr: usize, x: &[f32], out: &mut [f32], scratch: &mut Vec<f32>) {
        gemm_rows_impl::<Avx512>(w, m, r0, nr, x, out, scratch)
    }

    #[target_feature(enable = "avx512f")]
    pub(super) fn expand_row(w: &Matrix, row: usize, out: &mut [f32]) {
        expand_row_impl::<Avx512>(w, row, out)
    }

    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx512f")]
    pub(super) fn dots(a: &[f32], sa: usize, na: usize, b: &[f32], sb: usize, nb: usize, d: usize, out: &mut [f32], os: usize) {
        <Avx512 as Kernels>::dots(a, sa, na, b, sb, nb, d, out, os)
    }

    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx512f")]
    pub(super) fn weighted_sum(w: &[f32], sw: usize, n: usize, v: &[f32], sv: usize, out: &mut [f32], rows: usize) {
        <Avx512 as Kernels>::weighted_sum(w, sw, n, v, sv, out, rows)
    }

    #[target_feature(enable = "avx512f")]
    pub(super) fn softmax(s: &mut [f32], scale: f32) {
        super::softmax_impl(s, scale)
    }

    /// The codes of columns c..c+8 of two rows, as f32: lanes 0–7 row `a`'s, 8–15 row `b`'s.
    ///
    /// SAFETY: the caller checks that both rows hold the codes of columns c..c+8, and runs with
    /// AVX-512F.
    #[inline(always)]
    unsafe fn codes2<const BITS: u32>(a: &[u32], b: &[u32], c: usize) -> __m512 {
        unsafe {
            if BITS == 4 {
                let v = _mm512_mask_set1_epi32(_mm512_set1_epi32(*a.get_unchecked(c / 8) as i32), 0xFF00, *b.get_unchecked(c / 8) as i32);
                let sh = _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 0, 4, 8, 12, 16, 20, 24, 28);
                _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srlv_epi32(v, sh), _mm512_set1_epi32(0xF)))
            } else {
                let lo = (a.as_ptr().add(c / 4) as *const i64).read_unaligned();
                let hi = (b.as_ptr().add(c / 4) as *const i64).read_unaligned();
                _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_set_epi64x(hi, lo)))
            }
        }
    }

    /// `[x | y]`: one 8-lane value in each half.
    #[inline(always)]
    unsafe fn halves(x: f32, y: f32) -> __m512 {
        _mm512_mask_mov_ps(_mm512_set1_ps(x), 0xFF00, _mm512_set1_ps(y))
    }

    impl Kernels for Avx512 {
        #[inline(always)]
        fn expand_affine<const BITS: u32, S: Stored>(a: &Affine<S>, row: usize, out: &mut [f32]) {
            Avx2::expand_affine::<BITS, S>(a, row, out)
        }

        #[inline(always)]
        fn gemv_affine<const BITS: u32, const R: usize, S: Stored>(a: &Affine<S>, row0: usize, x: &[f32]) -> [f32; R] {
            if R % 2 == 1 {
                return Avx2::gemv_affine::<BITS, R, S>(a, row0, x);
            }
            let mut words: [&[u32]; R] = [&[]; R];
            for (r, w) in words.iter_mut().enumerate() {
                *w = a.words_of(row0 + r);
            }
            let cols = a.groups * a.group;
            assert!(x.len() >= cols && words.iter().all(|w| w.len() * 32 >= cols * BITS as usize));
            // SAFETY: columns below cols, checked above; AVX-512F by the entry point.
            unsafe {
                avx2::prefetch_rows(a, row0, R);
                // Pair p = rows 2p (lanes 0–7) and 2p+1 (lanes 8–15); only the first R/2 are used.
                let mut acc = [_mm512_setzero_ps(); R];
                for g in 0..a.groups {
                    let mut sb = [(_mm512_setzero_ps(), _mm512_setzero_ps()); R];
                    for (p, sb) in sb.iter_mut().take(R / 2).enumerate() {
                        let ((s0, b0), (s1, b1)) = (a.scale_bias(row0 + 2 * p, g), a.scale_bias(row0 + 2 * p + 1, g));
                        *sb = (halves(s0, s1), halves(b0, b1));
                    }
                    for c in (g * a.group..(g + 1) * a.group).step_by(8) {
                        let x8 = _mm256_loadu_pd(x.as_ptr().add(c) as *const f64);
                        let xv = _mm512_castpd_ps(_mm512_broadcast_f64x4(x8));
                        for p in 0..R / 2 {
                            let q = codes2::<BITS>(words[2 * p], words[2 * p + 1], c);
                            let w = _mm512_add_ps(_mm512_mul_ps(sb[p].0, q), sb[p].1);
                            acc[p] = _mm512_add_ps(acc[p], _mm512_mul_ps(w, xv));
                        }
                    }
                }
                let half = |r: usize| {
                    let v = acc[r / 2];
                    if r.is_multiple_of(2) {
                        _mm512_castps512_ps256(v)
                    } else {
                        _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v)))
                    }
                };
                let mut out = [0f32; R];
                if R == 8 {
                    let mut v = [_mm256_setzero_ps(); 8];
                    for (r, v) in v.iter_mut().enumerate() {
                        *v = half(r);
                    }
                    _mm256_storeu_ps(out.as_mut_ptr(), avx2::reduce8(&v));
                } else {
                    for (r, o) in out.iter_mut().enumerate() {
                        *o = avx2::reduce(half(r));
                    }
                }
                out
            }
        }

        #[inline(always)]
        fn gemv_affine_rows<const BITS: u32, S: Stored>(a: &Affine<S>, base: usize, x: &[f32], out: &mut [f32]) {
            // Eight rows: four registers of sums, reduced together.
            gemv_affine_rows_grouped::<Self, BITS, 8, S>(a, base, x, out)
        }

        #[inline(always)]
        fn dot_tile<const R: usize, const U: usize>(w: [&[f32]; R], x: [&[f32]; U]) -> [[f32; U]; R] {
            Avx2::dot_tile::<R, U>(w, x)
        }

        #[inline(always)]
        fn dots(a: &[f32], sa: usize, na: usize, b: &[f32], sb: usize, nb: usize, d: usize, out: &mut [f32], os: usize) {
            // The buffer is taken out and put back: code inside the closure of `with` would not
            // be compiled with this function's target features.
            let mut pack = PACK.with(|p| p.take());
            pack.resize(na / 8 * 8 * d, 0.0);
            packed_dots(a, sa, na, b, sb, nb, d, out, os, &mut pack);
            PACK.with(|p| p.replace(pack));
        }

        #[inline(always)]
        fn weighted_sum(w: &[f32], sw: usize, n: usize, v: &[f32], sv: usize, out: &mut [f32], rows: usize) {
            // 4 rows × 64 columns: 16 registers of sums, 4 value loads per position for 4 rows.
            weighted_sum_blocked::<4, 64>(w, sw, n, v, sv, out, rows)
        }

        #[inline(always)]
        fn gemm_block(rows: &[f32], nb: usize, x: &[f32], cols: usize, out: &mut [f32], os: usize, pack: &mut [f32]) {
            packed_dots(rows, cols, nb, x, cols, x.len() / cols, cols, out, os, pack)
        }
    }

    thread_local! {
        /// Room for the packed rows of `dots` (attention's key blocks).
        static PACK: std::cell::Cell<Vec<f32>> = const { std::cell::Cell::new(Vec::new()) };
    }

    /// [`Kernels::dots`] through 8 × 4 register tiles: rows of `a` in groups of eight are packed
    /// in pairs (`pack[p·2·d + 2c + h·8 + l]` = row 2p+h, column c+l), each 8-column slice of a row
    /// of `b` is broadcast to both halves; the remainders go through the AVX2 tiles.
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    fn packed_dots(a: &[f32], sa: usize, na: usize, b: &[f32], sb: usize, nb: usize, d: usize, out: &mut [f32], os: usize, pack: &mut [f32]) {
        let full_r = na / 8 * 8;
        if !d.is_multiple_of(8) || full_r == 0 || nb == 0 {
            return dots_tiled::<Avx2, 4, 2>(a, sa, na, b, sb, nb, d, out, os);
        }
        assert!(pack.len() >= full_r * d && (na - 1) * sa + d <= a.len() && (nb - 1) * sb + d <= b.len());
        assert!((nb - 1) * os + na <= out.len());
        for p in 0..full_r / 2 {
            let dst = &mut pack[p * 2 * d..(p + 1) * 2 * d];
            let (r0, r1) = (&a[2 * p * sa..2 * p * sa + d], &a[(2 * p + 1) * sa..(2 * p + 1) * sa + d]);
            for (c, d16) in (0..d).step_by(8).zip(dst.chunks_exact_mut(16)) {
                d16[..8].copy_from_slice(&r0[c..c + 8]);
                d16[8..].copy_from_slice(&r1[c..c + 8]);
            }
        }
        let full_u = nb / 4 * 4;
        for u in (0..full_u).step_by(4) {
            for i in (0..full_r).step_by(8) {
                // SAFETY: bounds checked above; AVX-512F by the entry point.
                unsafe { tile8::<4>(&pack[i * d..(i + 8) * d], b, sb, u, d, &mut out[u * os + i..], os) };
            }
        }
        for u in full_u..nb {
            for i in (0..full_r).step_by(8) {
                // SAFETY: as above.
                unsafe { tile8::<1>(&pack[i * d..(i + 8) * d], b, sb, u, d, &mut out[u * os + i..], os) };
            }
        }
        if full_r < na {
            dots_tiled::<Avx2, 4, 2>(&a[full_r * sa..], sa, na - full_r, b, sb, nb, d, &mut out[full_r..], os);
        }
    }

    /// Eight packed rows (four pairs, see `packed_dots`) times rows u0..u0+U of x (`sx` apart), into
    /// `out[j·os + 0..8]` for row u0+j: 4·U registers of sums, two rows each.
    ///
    /// SAFETY: `pk` holds 8·cols floats, x rows u0..u0+U, out U-1 strides and 8; AVX-512F.
    #[inline(always)]
    #[allow(clippy::needless_range_loop)] // acc is read as acc[p][j] across p for each j
    unsafe fn tile8<const U: usize>(pk: &[f32], x: &[f32], sx: usize, u0: usize, cols: usize, out: &mut [f32], os: usize) {
        unsafe {
            let mut acc = [[_mm512_setzero_ps(); U]; 4];
            let xp = x.as_ptr().add(u0 * sx);
            let wp = pk.as_ptr();
            for c in (0..cols).step_by(8) {
                let mut xb = [_mm512_setzero_ps(); U];
                for (j, xb) in xb.iter_mut().enumerate() {
                    *xb = _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_loadu_pd(xp.add(j * sx + c) as *const f64)));
                }
                for (p, acc) in acc.iter_mut().enumerate() {
                    let w = _mm512_loadu_ps(wp.add(p * 2 * cols + 2 * c));
                    for j in 0..U {
                        acc[j] = _mm512_add_ps(acc[j], _mm512_mul_ps(w, xb[j]));
                    }
                }
            }
            for j in 0..U {
                let mut v = [_mm256_setzero_ps(); 8];
                for p in 0..4 {
                    v[2 * p] = _mm512_castps512_ps256(acc[p][j]);
                    v[2 * p + 1] = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(acc[p][j])));
                }
                _mm256_storeu_ps(out.as_mut_ptr().add(j * os), avx2::reduce8(&v));
            }
        }
    }
}
