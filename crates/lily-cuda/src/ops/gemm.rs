//! Prefill GEMM (`kernels/gemm.cu`): `Y[t, rows] = X[t, cols] · W[m]ᵀ` for many tokens at once, on
//! 4/8-bit affine or dense bf16 weights, with the tensor cores; f32 activations in and out, row-major.
//! Also the fused SwiGLU first half of the MLP, and the grouped (MoE prefill) forms where sorted slots
//! belong to experts through a device array of offsets (no host round trip).
//!
//! Two kernel families: `kernels/gemm.cu` (`mma.sync`, every format) and, for 4-bit group-64 weights
//! in `Exact`, `Bf16x` and `Half` (the model's format), and for 8-bit group-64 weights (the router) in
//! the plain form in the same three, the Hopper wgmma kernels of [`super::gemm_wgmma`] (`Tile::Wg*` and
//! the warp-specialised `Tile::Ws*`, chosen by `Tile::Auto`; 8-bit weights asked for in `Half` run
//! `Exact` there unless `LILY_ROUTER_WGMMA=1`, see `router_path`; `LILY_GEMM=mma` keeps gemm.cu's for
//! A/B runs, `LILY_GEMM=wg` the two-warpgroup wgmma tiles).
//!
//! Numerics ([`Precision`], all four forms; products are exact and accumulated in f32 by
//! `mma.sync m16n8k16 .bf16 -> .f32` or `wgmma m64nNk16 .bf16 -> .f32`):
//! - [`Precision::Exact`] (the default of every function without a `precision` argument, what the
//!   model runs): nearly f32, see below.
//! - [`Precision::Bf16x`]: X rounded to bf16 (nearest even) once, the weights exact as in `Exact`
//!   (integer codes, the affine map per group in f32, the X sums of the unrounded x); one MMA per
//!   k-step. Against an f64 product expect a relative difference of order 1e-3 of the largest output
//!   (the rounding of x, 2^-9 relative per element, averaged over the row).
//! - [`Precision::Half`] (4-bit group-64 weights on the wgmma kernels, and 8-bit group-64 ones in the
//!   plain form on them; any other format, form or tile runs `Exact`): each X row is scaled by a power of two 2^-e (its largest |x| to [2^14, 2^15)) and
//!   rounded to f16, each weight formed in f16 as `f16(s)·q + f16(b)` by one fused multiply-add (one
//!   rounding), and the products are summed in f32 across all of K by the MMA, then times 2^e: no
//!   per-group fold, so the MMAs of successive groups overlap. Against an f64 product expect ~2e-4 of
//!   the largest output (f16's 11-bit significand on both operands), 5–8× closer than `Bf16x`.
//! - [`Precision::Exact`]:
//!   Each X element is split into two bf16, `hi = bf16(x)` and `lo = bf16(x - hi)`, and both are
//!   multiplied (two MMAs per k-step), so what is lost of x is below 2^-16 |x| (~2^-18 typically).
//!   Affine weights are not rounded at all: the tensor cores multiply the integer codes, centred
//!   (`c = q - 2^(bits-1)`, exact in bf16), and the affine map is applied per group in f32,
//!   `y = Σ_g ( s[g] · Σ_{i∈g} c[i]·x[i] + (b[g] + 2^(bits-1)·s[g]) · Σ_{i∈g} x[i] )`, with the X sums
//!   taken in f32 from the unrounded x. Dense bf16 weights are exact already. Against an f64 product of
//!   the f32 x and `lily-cpu`'s dequantised weights (`scale * q + bias` in f32) expect a few 1e-6 of the
//!   largest output (the part of x the split loses).
//! - [`Precision::Fast`]: each X element is rounded to bf16 (nearest even) when staged; each weight is
//!   dequantised in f32 as `scale * q + bias` (one rounding, the value `lily-cpu` computes) and rounded
//!   to bf16 (nearest even); one MMA per k-step. Against `lily_cpu::linear::matmul` expect a relative
//!   difference of order 1e-3 (bf16 has an 8-bit significand).
//!
//! Shapes: `cols` a positive multiple of 32 and of the group size; any `rows >= 1`; any `t` (or `n`)
//! `>= 0` (0 does nothing); tails are masked, nothing outside `Y[..t, ..rows]` is written. The kernels
//! index x, the packed weights and the scales with 32 bits: x up to 2^32 - 2 floats, a weight stack up to
//! 2^32 - 1 16-byte chunks (64 GiB) and 2^32 - 1 groups.

use cudarc::driver::sys::CUfunction_attribute;
use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut, DeviceRepr, LaunchConfig};

use super::{addr, addr_mut, launch};
use crate::weights::{DeviceMatrix, DeviceStorage};
use crate::{CudaError, Device, Result};

/// Must match `struct GemmParams` in `kernels/gemm.cu`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct GemmParams {
    w: u64,
    scales: u64,
    biases: u64,
    w2: u64,
    scales2: u64,
    biases2: u64,
    x: u64,
    y: u64,
    offsets: u64,
    gather: u64,
    x_rows: i64,
    t: i32,
    rows: i32,
    cols: i32,
    count: i32,
    matrix: i32,
    group_shift: i32,
}
// SAFETY: plain old data with the kernel's layout.
unsafe impl DeviceRepr for GemmParams {}

/// Tokens (M) per block of a kernel variant. `Auto` lets the wrapper choose.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Tile {
    /// 4-bit group-64 weights in `Exact` or `Bf16x`: the wgmma kernels, 64 tokens a block, or 128 in
    /// `Bf16x` when that still gives a block per SM (grouped: when experts average 256 slots); in `Half`
    /// 128 tokens when that gives a block per SM, else 64 (grouped: 128 from 96 slots an expert on
    /// average, else 64). Otherwise
    /// 64 tokens per block when there are enough blocks to fill the GPU, else 32 (grouped: 32 when
    /// experts average fewer than 48 slots).
    #[default]
    Auto,
    /// 64 tokens × 128 weight rows per block (2 × 4 warps of 32 × 32).
    M64,
    /// 32 tokens × 128 weight rows per block (1 × 8 warps of 32 × 16).
    M32,
    /// Hopper wgmma (`gemm_wgmma`): 64 tokens × 128 weight rows per block, two warpgroups. 4-bit
    /// group-64 weights in the `Exact`, `Bf16x` and `Half` precisions, and 8-bit group-64 weights in
    /// those in the plain form (not SwiGLU, not grouped), only.
    Wg64,
    /// Hopper wgmma: 128 tokens × 128 weight rows per block (the formats of `Wg64`).
    Wg128,
    /// Hopper wgmma, the grouped forms (and their bf16 outputs) of 4-bit weights in `Half` only: 32
    /// tokens × 128 weight rows per block, a deeper ring (for experts of a few slots each: short
    /// prompts). `Tile::Auto` takes it under 32 slots an expert with `LILY_GEMM=n32` (opt-in: built in
    /// the twenty-sixth session after its last GPU call, not yet measured).
    Wg32,
    /// `Wg64` with K split over up to 8 blocks a tile where its tiles are too few to fill the GPU (each
    /// block sums a range of K's groups; the last of a tile's blocks to finish sums their partial tiles in
    /// split order): the plain form only (not SwiGLU, not grouped), 4-bit weights in `Half` or `Exact`,
    /// 8-bit ones in `Exact`. `Tile::Auto` takes it for the plain GEMMs it would run on `Wg64` (short
    /// prompts: the router, the output projections) with `LILY_SPLITK=1` (opt-in, not yet run on a GPU).
    Wg64K,
    /// Hopper wgmma, 4-bit in `Half` only: 64 tokens × 256 weight rows per block (four warpgroups).
    Wg64x256,
    /// Hopper wgmma, 4-bit in `Half` only: 128 tokens × 256 weight rows per block (four warpgroups).
    Wg128x256,
    /// Hopper wgmma, 4-bit in `Half` only, warp-specialised and persistent: a producer warpgroup fills
    /// the ring, two consumer warpgroups compute 128 tokens × 128 weight rows a tile, one block an SM
    /// walking the tiles (grouped: at most 768 experts).
    Ws128,
    /// As `Ws128` with 128 tokens × 256 weight rows a tile (two m64 tiles a consumer warpgroup).
    Ws256,
    /// 128 tokens × 256 weight rows a tile as four consumer warpgroups of 64 rows (half the re-reads
    /// of each X tile a FLOP of `Ws128`).
    Ws4,
    /// 128 tokens × 256 weight rows a tile, the weights dequantised once into shared memory by the
    /// loading warpgroup and both MMA operands read from there by two consumer warpgroups of 128 rows
    /// (no weights in their registers); persistent as `Ws128`.
    Ss256,
    /// As `Ws128` with 256 tokens × 128 weight rows a tile: each weight a consumer dequantises feeds
    /// the MMAs of two 128-token halves (the second only where the tile holds more than 128 slots, so
    /// a grouped expert of up to 256 slots is one tile). Also takes the grouped bf16 outputs.
    Ws128T256,
    /// As `Ws128T256` with a second part of 32 tokens: 160 tokens × 128 weight rows a tile (a grouped
    /// expert of up to 160 slots one tile; a ring of 9 groups). Also takes the grouped bf16 outputs.
    Ws128T160,
    /// `Ws128T256` in cluster pairs, the plain and SwiGLU forms only (not grouped), with an even count of
    /// 128-row tiles (SwiGLU: of 64 outputs): the two blocks of a pair take adjacent row tiles of one
    /// token tile and copy each X tile once for both (TMA multicast).
    Mc256,
}

impl Tile {
    fn is_wgmma(self) -> bool {
        matches!(
            self,
            Tile::Wg64
                | Tile::Wg128
                | Tile::Wg32
                | Tile::Wg64K
                | Tile::Wg64x256
                | Tile::Wg128x256
                | Tile::Ws128
                | Tile::Ws256
                | Tile::Ws4
                | Tile::Ss256
                | Tile::Ws128T256
                | Tile::Ws128T160
                | Tile::Mc256
        )
    }

    /// The warp-specialised tile of this one, if it is one.
    fn ws(self) -> Option<super::gemm_wgmma::Ws> {
        match self {
            Tile::Ws128 => Some(super::gemm_wgmma::Ws::R128),
            Tile::Ws256 => Some(super::gemm_wgmma::Ws::R256),
            Tile::Ws4 => Some(super::gemm_wgmma::Ws::Four),
            Tile::Ss256 => Some(super::gemm_wgmma::Ws::Ss256),
            Tile::Ws128T256 => Some(super::gemm_wgmma::Ws::T256),
            Tile::Mc256 => Some(super::gemm_wgmma::Ws::Mc256),
            Tile::Ws128T160 => Some(super::gemm_wgmma::Ws::T160),
            _ => None,
        }
    }

    /// (tokens, weight rows) a block of a wgmma tile.
    fn wgmma_shape(self) -> (usize, usize) {
        match self {
            Tile::Wg64 | Tile::Wg64K => (64, 128),
            Tile::Wg32 => (32, 128),
            Tile::Wg64x256 => (64, 256),
            Tile::Wg128x256 | Tile::Ws256 | Tile::Ws4 | Tile::Ss256 => (128, 256),
            Tile::Ws128T256 | Tile::Mc256 => (256, 128),
            Tile::Ws128T160 => (160, 128),
            _ => (128, 128),
        }
    }
}

/// `LILY_GEMM`, read once (A/B runs): `mma` keeps gemm.cu's kernels where `Tile::Auto` would take the
/// wgmma ones; `wg`, `ws128`, `ws256`, `ws4`, `ss256`, `t256` put that wgmma tile wherever `Tile::Auto`
/// would take the 128 × 128 half tile; `t128` the choice before the two-part tiles, `mc256` the
/// defaults with the cluster pairs, `no160` without the 160-token tiles, `down128` the defaults with
/// the MoE down projection on `Wg128` (its tile before the twenty-fifth session; see `wide_half_tile`);
/// `n32` the defaults with the grouped half GEMMs on `Wg32` under 32 slots an expert (`half_tile`);
/// anything else, the defaults.
#[derive(Clone, Copy, PartialEq, Eq)]
enum GemmSwitch {
    Default,
    Mma,
    Wide(Tile),
    Tokens128,
    Pairs,
    No160,
    /// The defaults with the MoE down projection (grouped, no SwiGLU) on `Wg128`.
    Down128,
    /// The defaults with the grouped half GEMMs on `Wg32` under 32 slots an expert.
    N32,
}

fn gemm_switch() -> GemmSwitch {
    static SWITCH: std::sync::OnceLock<GemmSwitch> = std::sync::OnceLock::new();
    *SWITCH.get_or_init(|| match std::env::var("LILY_GEMM").as_deref() {
        Ok("mma") => GemmSwitch::Mma,
        Ok("wg") => GemmSwitch::Wide(Tile::Wg128),
        Ok("ws128") => GemmSwitch::Wide(Tile::Ws128),
        Ok("ws256") => GemmSwitch::Wide(Tile::Ws256),
        Ok("ws4") => GemmSwitch::Wide(Tile::Ws4),
        Ok("ss256") => GemmSwitch::Wide(Tile::Ss256),
        Ok("t256") => GemmSwitch::Wide(Tile::Ws128T256),
        Ok("t160") => GemmSwitch::Wide(Tile::Ws128T160),
        Ok("no160") => GemmSwitch::No160,
        Ok("t128") => GemmSwitch::Tokens128,
        Ok("mc256") => GemmSwitch::Pairs,
        Ok("down128") => GemmSwitch::Down128,
        Ok("n32") => GemmSwitch::N32,
        _ => GemmSwitch::Default,
    })
}

/// Whether `Tile::Auto` takes `Tile::Wg64K` for the plain GEMMs it would run on `Tile::Wg64`: with
/// `LILY_SPLITK=1` (opt-in: built in the twenty-seventh session, not yet run on a GPU); else `Wg64`.
/// Read once.
pub(crate) fn split_k_on() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("LILY_SPLITK").as_deref() == Ok("1"))
}

/// The calls `Tile::Wg64K` takes: the plain form (not grouped, not SwiGLU), 4-bit weights in Half or
/// Exact, 8-bit ones in Exact (the kernels `gemm_wgmma::run` has for it).
fn split_k_takes(grouped: bool, swiglu: bool, precision: Precision, bits: u32) -> bool {
    !grouped && !swiglu && matches!((precision, bits), (Precision::Half, 4) | (Precision::Exact, _))
}

/// Where `Tile::Auto` runs 8-bit group-64 weights in the plain form (the MoE router), read once from
/// `LILY_ROUTER_WGMMA`: by default on the wgmma tiles in the folded numerics, a call in `Half` taking
/// `Exact` there (the codes exact, x as two bf16: the numerics of gemm.cu's kernels, which ran it before;
/// `Half` moved near-tied experts' picks in the fixtures, PERF.md 2026-12-05); `1` in `Half` on the
/// wgmma tiles (opt-in); `mma` on gemm.cu's kernels (A/B runs). The explicit `Tile::Wg64` / `Tile::Wg128`
/// take the wgmma kernels in any numerics but Fast regardless (the tests do).
#[derive(Clone, Copy, PartialEq, Eq)]
enum RouterPath {
    Folded,
    Half,
    Mma,
}

fn router_path() -> RouterPath {
    static PATH: std::sync::OnceLock<RouterPath> = std::sync::OnceLock::new();
    *PATH.get_or_init(|| match std::env::var("LILY_ROUTER_WGMMA").as_deref() {
        Ok("1") => RouterPath::Half,
        Ok("mma") => RouterPath::Mma,
        _ => RouterPath::Folded,
    })
}

/// The numerics a call runs in, from those it asks: the 8-bit router (`q8_plain`: 8-bit group-64 codes
/// in a plain GEMM) asked in `Half` on `Tile::Auto` runs `Exact` unless `LILY_ROUTER_WGMMA=1`
/// ([`router_path`]); every other call runs what it asks.
fn run_precision(q8_plain: bool, tile: Tile, asked: Precision) -> Precision {
    if q8_plain && tile == Tile::Auto && asked == Precision::Half && router_path() != RouterPath::Half {
        Precision::Exact
    } else {
        asked
    }
}

/// Whether the switches leave `Tile::Auto` the wgmma kernels for weights of `bits`: not with
/// `LILY_GEMM=mma`, nor for 8-bit codes with `LILY_ROUTER_WGMMA=mma`.
fn auto_wgmma_allowed(bits: u32) -> bool {
    gemm_switch() != GemmSwitch::Mma && (bits == 4 || router_path() != RouterPath::Mma)
}

/// The tile `Tile::Auto` takes where `half_tile` picks `Tile::Wg128` (4-bit weights, at most
/// `WS_MAX_EXPERTS` experts), measured (H100, PERF.md 2026-12-06 twentieth, nineteenth and fifteenth
/// sessions):
/// - the plain GEMMs: `Ws128T256` where its tiles still give every SM one (the GDN input projection
///   at 4K: 264.5 µs since its MMAs are no longer serialised, `Ws128` 305), else `Ws128` (the cluster pairs,
///   `Mc256`, 3–4% faster again in isolation but +0.3% in the model, inside the runs' spread: opt-in);
/// - the grouped SwiGLU (the MoE gate/up): `Ws128T256` where experts average 192 slots or more (an
///   8K chunk: one tile an expert instead of two or three; the 32K prefill +3%), else `Ws128T160` (at
///   ~128 slots an expert `Ws128T256` is 6% slower than `Ws128`: its ring holds 6 groups where
///   `Ws128`'s holds 10; the 160-token tile holds 9 and takes an expert's tail past 128 slots, which
///   otherwise costs a tile of its own);
/// - the grouped GEMMs without SwiGLU (the MoE down projection, K = 512): `Ws128T160` since its
///   bf16 outputs leave as 16-byte rows (twenty-fifth session: 4K prefill +2.7%, 32K +1.0% against
///   `Wg128`, whose second block an SM had hidden the one-output-a-store epilogue: `Ws128T160` was 4.5%
///   faster in isolation and even in the model before, twentieth; `Ws128` 3.5% slower than `Wg128`,
///   fifteenth; `Ws128T256` slower at a 4K chunk).
///
/// `LILY_GEMM=t128` takes `Ws128` where this takes a two-part tile (the down projection `Wg128`, as
/// then); `mc256` `Mc256` where this takes `Ws128T256` and the row tiles pair up; `no160` `Ws128` where
/// this takes `Ws128T160`; `down128` puts the down projection on `Wg128`; `wg` keeps
/// `Wg128` everywhere, `ws128` / `ws256` / `ws4` / `ss256` / `t256` / `t160` take that tile everywhere
/// (A/B runs).
fn wide_half_tile(dev: &Device, grouped: bool, swiglu: bool, t: usize, experts: usize, wg_tiles: usize) -> Tile {
    let t256 = if grouped { swiglu && t / experts.max(1) >= 192 } else { t.div_ceil(256) * wg_tiles >= dev.sm_count() as usize };
    let pairs = !grouped && wg_tiles.is_multiple_of(2);
    match gemm_switch() {
        GemmSwitch::Wide(tile) => tile,
        GemmSwitch::Down128 | GemmSwitch::Tokens128 if grouped && !swiglu => Tile::Wg128,
        GemmSwitch::Tokens128 => Tile::Ws128,
        GemmSwitch::Pairs if t256 && pairs => Tile::Mc256,
        _ if t256 => Tile::Ws128T256,
        GemmSwitch::No160 => Tile::Ws128,
        _ if grouped => Tile::Ws128T160,
        _ => Tile::Ws128,
    }
}

/// The numerics of a GEMM call (see the module doc).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Precision {
    /// Nearly f32: x as a sum of two bf16 (two MMAs per k-step), affine weights as exact integer codes
    /// with the per-group scale and bias applied in f32. The default.
    #[default]
    Exact,
    /// x rounded to bf16, the weights as in `Exact` (one MMA per k-step).
    Bf16x,
    /// x and each dequantised weight rounded to bf16 (one MMA per k-step): ~1e-3 relative error.
    Fast,
    /// 4-bit group-64 weights on the wgmma kernels (and 8-bit group-64 ones in the plain form): each
    /// row of x scaled by a power of two into f16's range and rounded to f16, each weight dequantised
    /// to f16 (`s·q + b`, one rounding), products accumulated in f32 across all of K (one MMA per
    /// k-step, no per-group fold). Other formats and forms, and the mma.sync tiles, run `Exact`
    /// (closer; there is no half kernel for them).
    Half,
}

const THREADS: usize = 256;
/// W tile rows per block (the SwiGLU forms use 64 output rows of gate and 64 of up).
const BN: usize = 128;
/// K per step.
const BK: usize = 64;
/// Shared-memory row pitch in bf16 elements, as in the `.cu` (64 + 8 padding).
const LDS: usize = 72;

/// Dynamic shared memory of a variant with `bm` tokens per block, as laid out in the `.cu`. Fast: two
/// buffers of X and W tiles. Exact: two buffers of X (hi and lo planes) and W tiles, of (scale, bias)
/// per W tile row and 32-column half (f32 pairs) and of X row sums per half; one raw W staging area
/// (two 16-byte chunks per thread) and one raw f32 X tile.
const fn smem_bytes(bm: usize, precision: Precision) -> usize {
    let staging = 2 * BN * 2 * 8 + 2 * bm * 8 + 2 * THREADS * 16 + bm * BK * 4;
    match precision {
        Precision::Fast => 2 * (bm + BN) * LDS * 2,
        Precision::Bf16x => 2 * (bm + BN) * LDS * 2 + staging,
        Precision::Exact | Precision::Half => 2 * (2 * bm + BN) * LDS * 2 + staging,
    }
}

// Kernel names by form; index = precision (exact, bf16x, fast) * 6 + format (q4, q8, bf16) * 2 + tile (m64, m32).
macro_rules! family {
    ($p:literal) => {
        [
            concat!($p, "_q4_m64_exact"),
            concat!($p, "_q4_m32_exact"),
            concat!($p, "_q8_m64_exact"),
            concat!($p, "_q8_m32_exact"),
            concat!($p, "_bf16_m64_exact"),
            concat!($p, "_bf16_m32_exact"),
            concat!($p, "_q4_m64_bf16x"),
            concat!($p, "_q4_m32_bf16x"),
            concat!($p, "_q8_m64_bf16x"),
            concat!($p, "_q8_m32_bf16x"),
            concat!($p, "_bf16_m64_bf16x"),
            concat!($p, "_bf16_m32_bf16x"),
            concat!($p, "_q4_m64_fast"),
            concat!($p, "_q4_m32_fast"),
            concat!($p, "_q8_m64_fast"),
            concat!($p, "_q8_m32_fast"),
            concat!($p, "_bf16_m64_fast"),
            concat!($p, "_bf16_m32_fast"),
        ]
    };
}
const VARIANTS: usize = 18;
const GEMM: [&str; VARIANTS] = family!("gemm");
const SWIGLU: [&str; VARIANTS] = family!("swiglu_gemm");
const GROUPED: [&str; VARIANTS] = family!("grouped_gemm");
const GROUPED_SWIGLU: [&str; VARIANTS] = family!("grouped_swiglu_gemm");
const FAMILIES: [&[&str; VARIANTS]; 4] = [&GEMM, &SWIGLU, &GROUPED, &GROUPED_SWIGLU];

/// Precision, and tokens per block, of variant `i` of a family.
const fn variant(i: usize) -> (Precision, usize) {
    (
        match i / 6 {
            0 => Precision::Exact,
            1 => Precision::Bf16x,
            _ => Precision::Fast,
        },
        if i.is_multiple_of(2) { 64 } else { 32 },
    )
}

/// Every name of the four families.
const fn all_kernels() -> [&'static str; 4 * VARIANTS] {
    let mut out = [""; 4 * VARIANTS];
    let mut f = 0;
    while f < 4 {
        let mut i = 0;
        while i < VARIANTS {
            out[f * VARIANTS + i] = FAMILIES[f][i];
            i += 1;
        }
        f += 1;
    }
    out
}
const ALL_KERNELS: [&str; 4 * VARIANTS] = all_kernels();

pub(crate) const KERNELS: &[&str] = &ALL_KERNELS;

/// Most experts the grouped forms take (each block scans the offsets with 256 threads × 2).
pub const MAX_EXPERTS: usize = 512;

/// One-time function attributes (called by `Device::open`): every variant but the fast m32 ones uses
/// more than the 48 KB default of dynamic shared memory (up to 103 424 bytes, exact m64).
pub(crate) fn configure(dev: &Device) -> Result<()> {
    for fam in FAMILIES {
        for (i, name) in fam.iter().enumerate() {
            let (precision, bm) = variant(i);
            dev.function(name)?
                .set_attribute(CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem_bytes(bm, precision) as i32)?;
        }
    }
    Ok(())
}

/// How a GEMM call runs (see the module doc); `Default` is what the model uses.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Opts {
    pub tile: Tile,
    pub precision: Precision,
    /// Grouped forms: the experts `offsets` covers (`offsets` has `experts + 1` entries), the first
    /// matrices of the stack; `None`: all of them. A stack can carry more matrices after the routed
    /// experts (the shared expert).
    pub experts: Option<usize>,
    /// x is the previous GEMM call's x (on this device), unwritten since (the caller's promise): a
    /// wgmma GEMM then reuses that call's staged copy of x instead of staging it again, when the
    /// staging buffer still holds it (same x, rows, columns and precision). Every call without the
    /// promise leaves the buffer holding its own x, or nothing when it did not stage (the mma.sync
    /// kernels), so a promise after such a call stages afresh.
    pub reuse_x: bool,
    /// x's f32 values were never written: only its staged copy holds them, written by the caller
    /// through [`super::gemm_wgmma::prestage_half`] (a producer kernel that stages its own output, for
    /// a call [`takes_prestaged_half`] says yes to). The call fails rather than read x itself.
    pub x_staged_only: bool,
}

impl Opts {
    fn x_stage(&self) -> XStage {
        if self.x_staged_only {
            XStage::Only
        } else if self.reuse_x {
            XStage::Reuse
        } else {
            XStage::Fresh
        }
    }
}

/// Whether [`gemm_with`] of matrix `w` with `o` runs on the wgmma tiles in the half numerics, so that
/// it takes x staged by its producer ([`super::gemm_wgmma::prestage_half`], then `x_staged_only`): 4-bit
/// group-64 weights (a plain GEMM), [`Precision::Half`], the automatic tile, the wgmma kernels not
/// switched off. `run` chooses those tiles by the same function ([`half_on_wgmma`]).
pub fn takes_prestaged_half(w: &DeviceMatrix, o: Opts) -> bool {
    o.tile == Tile::Auto && o.experts.is_none() && half_on_wgmma(w, o.precision, false)
}

/// Whether [`gemm_with`] of matrix `w` with `o` runs on the wgmma tiles in the folded exact numerics, so
/// that x's producer may write that staging beside the half one
/// ([`super::gemm_wgmma::prestage_half_exact`], then `reuse_x`): the 8-bit router asked in Half (which
/// runs Exact on the folded path, the default) or a group-64 matrix asked in Exact, a plain GEMM on the
/// automatic tile, the wgmma kernels not switched off. `gemm_with` chooses by the same conditions.
pub fn takes_prestaged_exact(w: &DeviceMatrix, o: Opts) -> bool {
    let g64 = w.group_size() == Some(super::gemm_wgmma::GROUP);
    let q8_plain = w.bits() == 8 && g64;
    let exact = run_precision(q8_plain, o.tile, o.precision) == Precision::Exact;
    o.tile == Tile::Auto && o.experts.is_none() && g64 && exact && (w.bits() == 4 || q8_plain) && auto_wgmma_allowed(w.bits())
}

/// Whether `Tile::Auto` takes the wgmma kernels in the half numerics for `w` asked in `precision`
/// (`q8_plain`: 8-bit codes in a plain GEMM, the router, which takes them only with
/// `LILY_ROUTER_WGMMA=1`); not with `LILY_GEMM=mma`.
fn half_on_wgmma(w: &DeviceMatrix, precision: Precision, q8_plain: bool) -> bool {
    let g64 = w.group_size() == Some(super::gemm_wgmma::GROUP);
    let half = precision == Precision::Half && !(q8_plain && router_path() != RouterPath::Half);
    g64 && half && (w.bits() == 4 || q8_plain) && auto_wgmma_allowed(w.bits())
}

/// How a call gets x's staged copy on the wgmma tiles.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum XStage {
    /// Stage x afresh.
    Fresh,
    /// Reuse the buffer's staging when it holds this x ([`Opts::reuse_x`]).
    Reuse,
    /// The buffer must hold this x's staging ([`Opts::x_staged_only`]); the call fails otherwise.
    Only,
}

/// `Y[t, rows] = X[t, cols] · W[m]ᵀ` (matrix `m` of the stack; like `lily_cpu::linear::matmul(w, m, ..)`).
/// x: `[t, cols]` f32 (16-byte aligned), y: `[t, rows]` f32. [`Precision::Exact`]; see the module doc.
pub fn gemm<X: DevicePtr<f32>, Y: DevicePtrMut<f32>>(dev: &Device, w: &DeviceMatrix, m: usize, x: &X, t: usize, y: &mut Y) -> Result<()> {
    gemm_with(dev, w, m, x, t, y, Opts::default())
}

/// [`gemm`] with chosen [`Opts`].
pub fn gemm_with<X: DevicePtr<f32>, Y: DevicePtrMut<f32>>(dev: &Device, w: &DeviceMatrix, m: usize, x: &X, t: usize, y: &mut Y, o: Opts) -> Result<()> {
    run(dev, w, None, Group::Plain(m), x, t, y, o.tile, o.precision, o.x_stage())
}

/// `Y[t, rows] = silu(X · G[m]ᵀ) ⊙ (X · U[m]ᵀ)`: the first half of the SwiGLU MLP, `gate` and `up` of one
/// shape and format. x: `[t, cols]`, y: `[t, rows]`. [`Precision::Exact`].
pub fn swiglu_gemm<X: DevicePtr<f32>, Y: DevicePtrMut<f32>>(
    dev: &Device,
    gate: &DeviceMatrix,
    up: &DeviceMatrix,
    m: usize,
    x: &X,
    t: usize,
    y: &mut Y,
) -> Result<()> {
    swiglu_gemm_with(dev, gate, up, m, x, t, y, Opts::default())
}

/// [`swiglu_gemm`] with chosen [`Opts`].
#[allow(clippy::too_many_arguments)]
pub fn swiglu_gemm_with<X: DevicePtr<f32>, Y: DevicePtrMut<f32>>(
    dev: &Device,
    gate: &DeviceMatrix,
    up: &DeviceMatrix,
    m: usize,
    x: &X,
    t: usize,
    y: &mut Y,
    o: Opts,
) -> Result<()> {
    run(dev, gate, Some(up), Group::Plain(m), x, t, y, o.tile, o.precision, o.x_stage())
}

/// Grouped GEMM (MoE prefill). `n` sorted slots; `offsets` is a device array of `E + 1` u32
/// (`E = w.count <= 512`, or [`Opts::experts`]), non-decreasing, `offsets[0] = 0`, `offsets[E] = n`:
/// slots `offsets[e] .. offsets[e+1]` belong to expert `e`. For every slot `i`:
/// `Y[i, :] = W[e(i)] · X[r(i), :]`, where `r(i) = rows[i]` (a device array of `n` source-row indices
/// into x) when `rows` is given, else `i`. y: `[n, w.rows]`; x: `[≥ max r + 1, cols]` (without `rows`,
/// `[n, cols]`). [`Precision::Exact`].
///
/// The per-expert counts stay on the device: the grid covers the worst case and each block finds its
/// expert from `offsets`. Offsets are clamped to `n`; a slot no expert covers is not written; a source
/// row past the end of x gives a NaN output row.
///
/// [`grouped_gemm_with`] also writes y in bf16 (a `u16` buffer of the bits; each f32 result rounded
/// once to nearest even) on the wgmma tiles of 128 weight rows in [`Precision::Half`] with 4-bit
/// group-64 weights (see [`bf16_out_ok`]); other calls are refused.
pub fn grouped_gemm<O: DevicePtr<u32>, X: DevicePtr<f32>, Y: DevicePtrMut<f32>>(
    dev: &Device,
    w: &DeviceMatrix,
    offsets: &O,
    rows: Option<&CudaSlice<u32>>,
    x: &X,
    n: usize,
    y: &mut Y,
) -> Result<()> {
    grouped_gemm_with(dev, w, offsets, rows, x, n, y, Opts::default())
}

/// [`grouped_gemm`] with chosen [`Opts`].
#[allow(clippy::too_many_arguments)]
pub fn grouped_gemm_with<O: DevicePtr<u32>, X: DevicePtr<f32>, E: super::Act, Y: DevicePtrMut<E>>(
    dev: &Device,
    w: &DeviceMatrix,
    offsets: &O,
    rows: Option<&CudaSlice<u32>>,
    x: &X,
    n: usize,
    y: &mut Y,
    o: Opts,
) -> Result<()> {
    let g = group(dev, w, o.experts.unwrap_or(w.count), offsets, rows, n)?;
    run(dev, w, None, g, x, n, y, o.tile, o.precision, o.x_stage())
}

/// [`grouped_gemm`] with the fused SwiGLU of [`swiglu_gemm`]:
/// `Y[i, :] = silu(G[e(i)] · X[r(i), :]) ⊙ (U[e(i)] · X[r(i), :])`. [`Precision::Exact`].
#[allow(clippy::too_many_arguments)]
pub fn grouped_swiglu_gemm<O: DevicePtr<u32>, X: DevicePtr<f32>, Y: DevicePtrMut<f32>>(
    dev: &Device,
    gate: &DeviceMatrix,
    up: &DeviceMatrix,
    offsets: &O,
    rows: Option<&CudaSlice<u32>>,
    x: &X,
    n: usize,
    y: &mut Y,
) -> Result<()> {
    grouped_swiglu_gemm_with(dev, gate, up, offsets, rows, x, n, y, Opts::default())
}

/// [`grouped_swiglu_gemm`] with chosen [`Opts`].
#[allow(clippy::too_many_arguments)]
pub fn grouped_swiglu_gemm_with<O: DevicePtr<u32>, X: DevicePtr<f32>, Y: DevicePtrMut<f32>>(
    dev: &Device,
    gate: &DeviceMatrix,
    up: &DeviceMatrix,
    offsets: &O,
    rows: Option<&CudaSlice<u32>>,
    x: &X,
    n: usize,
    y: &mut Y,
    o: Opts,
) -> Result<()> {
    let g = group(dev, gate, o.experts.unwrap_or(gate.count), offsets, rows, n)?;
    run(dev, gate, Some(up), g, x, n, y, o.tile, o.precision, o.x_stage())
}

/// Whether [`grouped_gemm_with`] can write bf16 outputs for `w` under `o`: 4-bit group-64 weights in
/// [`Precision::Half`], on the wgmma tiles (`Tile::Auto` takes them unless `LILY_GEMM=mma`).
pub fn bf16_out_ok(w: &DeviceMatrix, o: Opts) -> bool {
    let wgmma_tile = match o.tile {
        Tile::Auto => gemm_switch() != GemmSwitch::Mma,
        t => t.is_wgmma(),
    };
    bf16_out_takes(w, o.precision, wgmma_tile)
}

/// The bf16 outputs' rule, for [`bf16_out_ok`] and `run` alike: 4-bit group-64 weights in `Half` on a
/// wgmma tile (of a grouped call without SwiGLU, which only `grouped_gemm_with` makes).
fn bf16_out_takes(w: &DeviceMatrix, precision: Precision, wgmma_tile: bool) -> bool {
    precision == Precision::Half && w.bits() == 4 && w.group_size() == Some(super::gemm_wgmma::GROUP) && wgmma_tile
}

/// Which rows of X and which matrix each output row uses.
#[derive(Clone, Copy, Debug)]
enum Group {
    /// Matrix `m` for every token; token `i` reads X row `i`.
    Plain(usize),
    /// Experts by device offsets (address), with an optional device gather array (address or 0).
    Grouped { offsets: u64, gather: u64, e: usize },
}

fn group<O: DevicePtr<u32>>(
    dev: &Device,
    w: &DeviceMatrix,
    e: usize,
    offsets: &O,
    rows: Option<&CudaSlice<u32>>,
    n: usize,
) -> Result<Group> {
    if e == 0 || e > MAX_EXPERTS || e > w.count {
        return Err(CudaError::Shape(format!("grouped gemm: {e} experts (1..={MAX_EXPERTS})")));
    }
    let offsets = addr(dev, offsets, e + 1, "grouped gemm offsets")?;
    let gather = match rows {
        Some(r) => addr(dev, r, n, "grouped gemm rows")?,
        None => 0,
    };
    Ok(Group::Grouped { offsets, gather, e })
}

/// (packed or dense data, scales, biases, log2 group) addresses.
fn parts(dev: &Device, w: &DeviceMatrix) -> (u64, u64, u64, i32) {
    let s = dev.stream();
    match &w.storage {
        DeviceStorage::Affine { params, packed, scales, biases } => {
            (packed.device_ptr(s).0, scales.device_ptr(s).0, biases.device_ptr(s).0, params.group_size.trailing_zeros() as i32)
        }
        DeviceStorage::Dense { data } => (data.device_ptr(s).0, 0, 0, 0),
    }
}

fn describe(w: &DeviceMatrix) -> String {
    format!("[{}, {}, {}] {}-bit/{:?}", w.count, w.rows, w.cols, w.bits(), w.group_size())
}

/// The wgmma tile `Tile::Auto` takes in `Half` (`wg_tiles`: the call's 128-row tiles). Measured
/// (PERF.md, 2026-12-03 fourth session): 128 tokens × 128 rows at two blocks an SM is the fastest on
/// every large shape, the 256-row tiles slower; 64 tokens where 128 would not give each SM a block;
/// grouped, 128 tokens from 96 slots an expert on average, else 64 (a mixed split, 128-token tiles
/// with each expert's tail in 64-token ones, measured no faster: a tile costs its expert's weight
/// reads whatever it holds).
/// The grouped ones on 256 weight rows a block (half the L2 re-reads of each expert tile's x) measured
/// slower (PERF.md, 2026-12-05 twelfth session: gate/up +8%, down +9% at a 4K chunk).
fn half_tile(dev: &Device, grouped: bool, t: usize, experts: usize, wg_tiles: usize) -> Tile {
    if grouped {
        return if t / experts >= 96 {
            Tile::Wg128
        } else if gemm_switch() == GemmSwitch::N32 && t / experts < 32 {
            Tile::Wg32
        } else {
            Tile::Wg64
        };
    }
    if t.div_ceil(128) * wg_tiles >= dev.sm_count() as usize {
        Tile::Wg128
    } else {
        Tile::Wg64
    }
}

#[allow(clippy::too_many_arguments)]
fn run<X: DevicePtr<f32>, E: super::Act, Y: DevicePtrMut<E>>(
    dev: &Device,
    w: &DeviceMatrix,
    w2: Option<&DeviceMatrix>,
    grp: Group,
    x: &X,
    t: usize,
    y: &mut Y,
    tile: Tile,
    precision: Precision,
    xs: XStage,
) -> Result<()> {
    let (rows, cols) = (w.rows, w.cols);
    let what = if w2.is_some() { "swiglu gemm" } else { "gemm" };
    if let Some(u) = w2 {
        let same = u.count == w.count && u.rows == rows && u.cols == cols && u.bits() == w.bits() && u.group_size() == w.group_size();
        if !same {
            return Err(CudaError::Shape(format!("{what}: gate {} and up {} differ", describe(w), describe(u))));
        }
    }
    let fmt = match w.bits() {
        4 => 0,
        8 => 1,
        16 => 2,
        b => return Err(CudaError::Shape(format!("{what}: no kernel for {b}-bit weights"))),
    };
    if cols == 0 || cols % 32 != 0 || cols > i32::MAX as usize {
        return Err(CudaError::Shape(format!("{what}: cols {cols} is not a positive multiple of 32")));
    }
    if let Some(gs) = w.group_size() {
        if !matches!(gs, 32 | 64 | 128) || cols % gs != 0 {
            return Err(CudaError::Shape(format!("{what}: group size {gs} does not divide cols {cols} (32/64/128)")));
        }
    }
    if rows == 0 || rows > i32::MAX as usize || w.count == 0 || t > i32::MAX as usize {
        return Err(CudaError::Shape(format!("{what}: {} with {t} tokens", describe(w))));
    }
    // The kernels' 32-bit indices: 16-byte chunks and groups of the whole stack.
    let chunks = w.count as u128 * rows as u128 * cols as u128 * w.bits() as u128 / 128;
    let groups = w.group_size().map_or(0, |gs| w.count as u128 * rows as u128 * (cols / gs) as u128);
    if chunks > u32::MAX as u128 || groups > u32::MAX as u128 {
        return Err(CudaError::Shape(format!("{what}: {} is too large for 32-bit indices", describe(w))));
    }
    let out_rows_per_block = if w2.is_some() { BN / 2 } else { BN };
    let n_tiles = rows.div_ceil(out_rows_per_block);
    if n_tiles > 65535 {
        return Err(CudaError::Shape(format!("{what}: {rows} rows need {n_tiles} > 65535 row tiles")));
    }
    // x rows: t (plain, or grouped without gather), else whatever x holds (bounds of the gather).
    let (matrix, offsets, gather) = match grp {
        Group::Plain(m) => {
            if m >= w.count {
                return Err(CudaError::Shape(format!("{what}: matrix {m} of a stack of {}", w.count)));
            }
            (m, 0, 0)
        }
        Group::Grouped { offsets, gather, .. } => (0, offsets, gather),
    };
    let x_rows = if gather != 0 { x.len() / cols } else { t };
    if gather != 0 && t > 0 && x_rows == 0 {
        return Err(CudaError::Shape(format!("grouped {what}: x holds {} floats, less than one row of {cols}", x.len())));
    }
    if x_rows as u128 * cols as u128 > u32::MAX as u128 - 2 {
        return Err(CudaError::Shape(format!("{what}: x of {x_rows} rows of {cols} is too large for 32-bit indices")));
    }
    let x_p = addr(dev, x, x_rows * cols, &format!("{what} x"))?;
    if x_p % 16 != 0 {
        return Err(CudaError::Shape(format!("{what}: x must be 16-byte aligned")));
    }
    let y_p = addr_mut(dev, y, t * rows, &format!("{what} y"))?;
    if t == 0 {
        return Ok(());
    }

    let grouped = matches!(grp, Group::Grouped { .. });
    // Matrices the kernel routes over: the experts of a grouped call, else the whole stack.
    let experts = match grp {
        Group::Grouped { e, .. } => e,
        Group::Plain(_) => w.count,
    };
    let g64 = w.group_size() == Some(super::gemm_wgmma::GROUP);
    // 8-bit codes on Tile::Auto in Half: the folded numerics unless `LILY_ROUTER_WGMMA=1` (router_path).
    let q8_plain = w.bits() == 8 && g64 && w2.is_none() && !grouped;
    let asked = precision;
    let precision = run_precision(q8_plain, tile, precision);
    let wg_ok = g64
        && match w.bits() {
            4 => precision != Precision::Fast,
            8 => q8_plain && precision != Precision::Fast,
            _ => false,
        };
    if tile.is_wgmma() && !wg_ok {
        return Err(CudaError::Shape(format!(
            "{what}: the wgmma tiles take 4-bit group-64 weights in Exact, Bf16x or Half, or 8-bit group-64 ones in a plain gemm in those, not {} in {precision:?}",
            describe(w)
        )));
    }
    if tile == Tile::Wg32 && (!grouped || precision != Precision::Half || w.bits() != 4) {
        return Err(CudaError::Shape(format!(
            "{what}: the 32-token wgmma tiles take the grouped forms of 4-bit weights in Half, not {} in {precision:?} (grouped: {grouped})",
            describe(w)
        )));
    }
    if tile == Tile::Wg64K && !split_k_takes(grouped, w2.is_some(), precision, w.bits()) {
        return Err(CudaError::Shape(format!(
            "{what}: the split-K tiles take the plain form of 4-bit weights in Half or Exact, or 8-bit ones in Exact, not {} in {precision:?} (grouped: {grouped})",
            describe(w)
        )));
    }
    if matches!(tile, Tile::Wg64x256 | Tile::Wg128x256) && (precision != Precision::Half || w.bits() != 4) {
        return Err(CudaError::Shape(format!("{what}: the 256-row wgmma tiles take 4-bit weights in Half, not {} in {precision:?}", describe(w))));
    }
    if tile.ws().is_some() && (precision != Precision::Half || w.bits() != 4 || matches!(grp, Group::Grouped { e, .. } if e > super::gemm_wgmma::WS_MAX_EXPERTS)) {
        return Err(CudaError::Shape(format!(
            "{what}: the warp-specialised tiles take 4-bit weights in Half and at most {} experts, not {} in {precision:?}",
            super::gemm_wgmma::WS_MAX_EXPERTS,
            describe(w)
        )));
    }
    let wg_tiles = rows.div_ceil(if w2.is_some() { super::gemm_wgmma::BW / 2 } else { super::gemm_wgmma::BW });
    let wg_auto = wg_ok && auto_wgmma_allowed(w.bits());
    let auto = tile == Tile::Auto;
    let tile = match tile {
        // The test `takes_prestaged_half` makes (on the precision asked: the router's Half is Exact here).
        Tile::Auto if half_on_wgmma(w, asked, q8_plain) => match half_tile(dev, grouped, t, experts, wg_tiles) {
            Tile::Wg128 if w.bits() == 4 && (!grouped || experts <= super::gemm_wgmma::WS_MAX_EXPERTS) => {
                wide_half_tile(dev, grouped, w2.is_some(), t, experts, wg_tiles)
            }
            other => other,
        },
        Tile::Auto if wg_auto => {
            // Measured (PERF.md, 2026-12-02 third session): the two X planes of Exact fit 128-token tiles
            // one block an SM, where 64-token tiles run two and win by 0-10%; Bf16x gains 128 tokens'
            // reuse when the grid still fills the GPU. Grouped tiles end at each expert's last slot, so at
            // 128 slots an expert (a 4K chunk) 64 wins by 17%.
            let big = if grouped {
                t / experts >= 256
            } else {
                precision == Precision::Bf16x && t.div_ceil(128) * wg_tiles >= dev.sm_count() as usize
            };
            if big {
                Tile::Wg128
            } else {
                Tile::Wg64
            }
        }
        Tile::Auto if grouped => {
            if t / experts >= 48 {
                Tile::M64
            } else {
                Tile::M32
            }
        }
        Tile::Auto => {
            if t.div_ceil(64) * n_tiles >= 2 * dev.sm_count() as usize {
                Tile::M64
            } else {
                Tile::M32
            }
        }
        other => other,
    };
    // The plain GEMMs `Tile::Auto` put on 64-token tiles split K where those are too few (`Tile::Wg64K`).
    let tile = if auto && tile == Tile::Wg64 && split_k_on() && split_k_takes(grouped, w2.is_some(), precision, w.bits()) { Tile::Wg64K } else { tile };
    // bf16 outputs: the grouped 4-bit Half wgmma form without SwiGLU, on its tiles of 128 weight rows
    // and `Ws128T256` (another forced 256-row or warp-specialised tile gives way to the 128-row one of
    // its token width).
    let tile = if E::BF16 {
        if !(grouped && w2.is_none() && bf16_out_takes(w, precision, tile.is_wgmma())) {
            return Err(CudaError::Shape(format!(
                "{what}: bf16 outputs take the grouped form on the wgmma tiles in Half with 4-bit group-64 weights, not {} in {precision:?} on {tile:?}",
                describe(w)
            )));
        }
        match tile {
            Tile::Ws128T256 | Tile::Ws128T160 | Tile::Wg32 => tile,
            _ if tile.wgmma_shape().0 == 64 => Tile::Wg64,
            _ => Tile::Wg128,
        }
    } else {
        tile
    };
    let (w_p, s_p, b_p, group_shift) = parts(dev, w);
    let (w2_p, s2_p, b2_p) = match w2 {
        Some(u) => {
            let (a, b, c, _) = parts(dev, u);
            (a, b, c)
        }
        None => (0, 0, 0),
    };
    if tile.is_wgmma() {
        let call = super::gemm_wgmma::Call {
            w: (w_p, s_p, b_p),
            w2: (w2_p, s2_p, b2_p),
            x: x_p,
            x_rows,
            y: y_p,
            t,
            rows,
            cols,
            matrix,
            bits: w.bits(),
            grouped: if grouped { Some((offsets, gather, experts)) } else { None },
            out16: E::BF16,
            split_k: tile == Tile::Wg64K,
        };
        let (bt, wrows) = tile.wgmma_shape();
        let num = match precision {
            Precision::Exact => super::gemm_wgmma::Num::Exact,
            Precision::Bf16x => super::gemm_wgmma::Num::Bf16x,
            _ => super::gemm_wgmma::Num::Half,
        };
        return super::gemm_wgmma::run(dev, &call, bt, num, wrows, tile.ws(), xs);
    }
    if xs == XStage::Only {
        return Err(CudaError::Shape(format!("{what}: x is only in its staged copy, but {} in {precision:?} on {tile:?} reads x itself", describe(w))));
    }
    // This call stages nothing: a later `reuse_x` call must not take an older staging for its x.
    if xs == XStage::Fresh {
        super::gemm_wgmma::forget_staged(dev)?;
    }
    let bm = if tile == Tile::M64 { 64 } else { 32 };
    let fam = match (w2.is_some(), grouped) {
        (false, false) => &GEMM,
        (true, false) => &SWIGLU,
        (false, true) => &GROUPED,
        (true, true) => &GROUPED_SWIGLU,
    };
    // No half kernel off the wgmma path: Half runs Exact (closer).
    let (precision, prec) = match precision {
        Precision::Exact | Precision::Half => (Precision::Exact, 0),
        Precision::Bf16x => (Precision::Bf16x, 1),
        Precision::Fast => (Precision::Fast, 2),
    };
    let name = fam[prec * 6 + fmt * 2 + if bm == 64 { 0 } else { 1 }];
    // Worst case of the grouped forms: sum over experts of ceil(count_e / bm) <= ceil(n / bm) + E.
    let m_tiles = t.div_ceil(bm) + if grouped { experts } else { 0 };
    if m_tiles > i32::MAX as usize {
        return Err(CudaError::Shape(format!("{what}: {t} tokens")));
    }

    let params = GemmParams {
        w: w_p,
        scales: s_p,
        biases: b_p,
        w2: w2_p,
        scales2: s2_p,
        biases2: b2_p,
        x: x_p,
        y: y_p,
        offsets,
        gather,
        x_rows: x_rows as i64,
        t: t as i32,
        rows: rows as i32,
        cols: cols as i32,
        count: experts as i32,
        matrix: matrix as i32,
        group_shift,
    };
    let cfg = LaunchConfig {
        grid_dim: (m_tiles as u32, n_tiles as u32, 1),
        block_dim: (THREADS as u32, 1, 1),
        shared_mem_bytes: smem_bytes(bm, precision) as u32,
    };
    debug_assert_eq!(variant(prec * 6 + fmt * 2 + if bm == 64 { 0 } else { 1 }), (precision, bm));
    launch(dev, name, cfg, &params)
}
