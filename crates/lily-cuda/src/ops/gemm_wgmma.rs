//! The Hopper (wgmma) prefill GEMM (`kernels/gemm_wgmma.cu`) for 4-bit group-64 weights: the kernels
//! behind [`super::gemm`]'s `Tile::Wg*` tiles (what `Tile::Auto` picks for that format: in `Exact` and
//! `Bf16x` with the same numerics as gemm.cu's kernels, and in `Half`); and for 8-bit group-64 weights
//! (the MoE router) in `Half`, the plain form with 128 weight rows a block. This module launches them: one
//! pass stages x (16-bit planes in the kernel's column order, and the f32 sums per group or the
//! per-row scales) into a buffer the [`Device`] keeps for the numerics (one for the half numerics, one
//! for the folded ones; see `Stage`), then the GEMM runs on it. Shapes and
//! pointers are checked by `gemm::run` before it comes here.

use cudarc::driver::sys::CUfunction_attribute;
use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut, DeviceRepr, LaunchConfig};

use super::{addr, launch, launch_cluster};
use crate::{CudaError, Device, Result};

/// Must match `struct WgStageParams` in `kernels/gemm_wgmma.cu`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct StageParams {
    x: u64,
    hi: u64,
    lo: u64,
    sums: u64,
    rows: i64,
    cols: i32,
}
// SAFETY: plain old data with the kernel's layout.
unsafe impl DeviceRepr for StageParams {}

/// Must match `struct WgParams` in `kernels/gemm_wgmma.cu`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct WgParams {
    w: u64,
    scales: u64,
    biases: u64,
    w2: u64,
    scales2: u64,
    biases2: u64,
    xh: u64,
    xl: u64,
    xsum: u64,
    y: u64,
    offsets: u64,
    gather: u64,
    x_rows: i64,
    t: i32,
    rows: i32,
    cols: i32,
    count: i32,
    matrix: i32,
    splits: i32,
    part: u64,
    tile_count: u64,
}
// SAFETY: plain old data with the kernel's layout.
unsafe impl DeviceRepr for WgParams {}

/// Must match `struct WgTmaParams` in `kernels/gemm_wgmma.cu`: the staged plane's TMA descriptor
/// (CUtensorMap: 128 bytes, 64-byte aligned), then the parameters.
#[repr(C, align(64))]
#[derive(Clone, Copy, Debug)]
struct WgTmaParams {
    xmap: [u64; 16],
    p: WgParams,
}
// SAFETY: plain old data with the kernel's layout.
unsafe impl DeviceRepr for WgTmaParams {}

/// The TMA descriptor of a staged x plane (f16 [x_rows, cols] at device address `plane`): boxes of 64
/// columns (one group, 128 bytes) × 128 rows with the 128-byte swizzle, the layout the cp.async copies
/// write; rows past x_rows read as zeros.
fn x_map(plane: u64, x_rows: usize, cols: usize) -> Result<[u64; 16]> {
    use cudarc::driver::sys;
    let dims = [cols as u64, x_rows as u64];
    let strides = [(cols * 2) as u64];
    let boxes = [GROUP as u32, 128];
    let steps = [1u32, 1];
    let mut map = std::mem::MaybeUninit::<sys::CUtensorMap>::uninit();
    // SAFETY: every pointer is to a live array of the rank the call names (2; strides rank − 1); the
    // plane is a device allocation of x_rows × cols f16 that outlives the launch using the descriptor.
    unsafe {
        sys::cuTensorMapEncodeTiled(
            map.as_mut_ptr(),
            sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
            2,
            plane as *mut std::ffi::c_void,
            dims.as_ptr(),
            strides.as_ptr(),
            boxes.as_ptr(),
            steps.as_ptr(),
            sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
            sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
            sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
    }
    .result()?;
    // SAFETY: initialised by the successful call above.
    Ok(unsafe { map.assume_init() }.opaque)
}

const THREADS: usize = 256;
/// Weight rows a block (SwiGLU: 64 outputs of gate and up).
pub(crate) const BW: usize = 128;
const STAGES: usize = 4;
/// K a step: the group size this kernel takes.
pub(crate) const GROUP: usize = 64;

/// The numerics of a wgmma GEMM: x as one bf16 plane (the per-group fold), two (hi + lo, the fold), or
/// one f16 plane scaled per row with the weights dequantised to f16 (no fold).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Num {
    Bf16x,
    Exact,
    Half,
}

impl Num {
    /// The 16-bit planes of staged x.
    const fn planes(self) -> usize {
        if matches!(self, Num::Exact) { 2 } else { 1 }
    }
}

// Index = form (plain, swiglu, grouped, grouped swiglu) * 8 + variant (see `variant`).
const VARIANTS: usize = 8;
macro_rules! forms {
    ($($f:literal),*) => {
        [$(
            concat!("gemm_wgmma_", $f, "_n128_p1"),
            concat!("gemm_wgmma_", $f, "_n128_p2"),
            concat!("gemm_wgmma_", $f, "_n64_p1"),
            concat!("gemm_wgmma_", $f, "_n64_p2"),
            concat!("gemm_wgmma_", $f, "_n128_h128"),
            concat!("gemm_wgmma_", $f, "_n64_h128"),
            concat!("gemm_wgmma_", $f, "_n128_h256"),
            concat!("gemm_wgmma_", $f, "_n64_h256"),
        )*]
    };
}
const NAMES: [&str; 4 * VARIANTS] = forms!("plain", "swiglu", "grouped", "grouped_swiglu");
/// The 8-bit plain kernels: half at 128 tokens, then 64 (variants 4 and 5 of the 4-bit forms, one ring
/// stage shallower); then folded (variants 0–3 of the 4-bit forms: bf16x and exact at 128, then 64).
const NAMES_Q8: [&str; 6] = [
    "gemm_wgmma_plain_n128_h128_q8",
    "gemm_wgmma_plain_n64_h128_q8",
    "gemm_wgmma_plain_n128_p1_q8",
    "gemm_wgmma_plain_n128_p2_q8",
    "gemm_wgmma_plain_n64_p1_q8",
    "gemm_wgmma_plain_n64_p2_q8",
];
/// The grouped half kernels writing bf16 outputs: variants 4 (128 tokens) and 5 (64) of the grouped form,
/// storing 16-byte rows through shared memory; then the same storing one output at a time
/// (`LILY_STORE16=scalar`, see [`rows16`]).
const NAMES_O16: [&str; 4] =
    ["gemm_wgmma_grouped_n128_h128_o16", "gemm_wgmma_grouped_n64_h128_o16", "gemm_wgmma_grouped_n128_h128_o16s", "gemm_wgmma_grouped_n64_h128_o16s"];
/// The 32-token grouped half tiles (`Tile::Wg32`): the grouped and grouped SwiGLU forms, then the
/// grouped form's bf16 outputs as 16-byte rows and one output a store ([`rows16`]); [`VARIANT_N32`].
const NAMES_N32: [&str; 4] =
    ["gemm_wgmma_grouped_n32_h128", "gemm_wgmma_grouped_swiglu_n32_h128", "gemm_wgmma_grouped_n32_h128_o16", "gemm_wgmma_grouped_n32_h128_o16s"];
/// [`NAMES_N32`]'s variant: 32 tokens, half numerics, a ring of 8 stages of 8 KB (three blocks an SM).
const VARIANT_N32: Variant = Variant { bt: 32, num: Num::Half, stages: 8, wgs: 2, bits: 4 };
/// The warp-specialised persistent tiles (half numerics, 4-bit): per form (plain, swiglu, grouped,
/// grouped swiglu) [`Ws::R128`], [`Ws::R256`], [`Ws::Four`], [`Ws::Ss256`], [`Ws::T256`], [`Ws::T160`].
const NAMES_WS: [&str; 24] = [
    "gemm_wgmma_plain_ws128",
    "gemm_wgmma_plain_ws256",
    "gemm_wgmma_plain_ws4",
    "gemm_wgmma_plain_ss256",
    "gemm_wgmma_plain_ws128t256",
    "gemm_wgmma_plain_ws128t160",
    "gemm_wgmma_swiglu_ws128",
    "gemm_wgmma_swiglu_ws256",
    "gemm_wgmma_swiglu_ws4",
    "gemm_wgmma_swiglu_ss256",
    "gemm_wgmma_swiglu_ws128t256",
    "gemm_wgmma_swiglu_ws128t160",
    "gemm_wgmma_grouped_ws128",
    "gemm_wgmma_grouped_ws256",
    "gemm_wgmma_grouped_ws4",
    "gemm_wgmma_grouped_ss256",
    "gemm_wgmma_grouped_ws128t256",
    "gemm_wgmma_grouped_ws128t160",
    "gemm_wgmma_grouped_swiglu_ws128",
    "gemm_wgmma_grouped_swiglu_ws256",
    "gemm_wgmma_grouped_swiglu_ws4",
    "gemm_wgmma_grouped_swiglu_ss256",
    "gemm_wgmma_grouped_swiglu_ws128t256",
    "gemm_wgmma_grouped_swiglu_ws128t160",
];
/// [`Ws::T256`]'s and [`Ws::T160`]'s grouped forms writing bf16 outputs (the MoE down projection's slots),
/// as 16-byte rows; then one output at a time (`LILY_STORE16=scalar`).
const NAMES_WS_O16: [&str; 4] =
    ["gemm_wgmma_grouped_ws128t256_o16", "gemm_wgmma_grouped_ws128t160_o16", "gemm_wgmma_grouped_ws128t256_o16s", "gemm_wgmma_grouped_ws128t160_o16s"];
/// [`NAMES_WS_O16`]'s tiles.
const WS_O16_KINDS: [Ws; 4] = [Ws::T256, Ws::T160, Ws::T256, Ws::T160];

/// Whether the bf16-output kernels write a tile's outputs as 16-byte rows of 8 consecutive outputs of a
/// slot, staged through shared memory by a transposing `stmatrix` (the default), or one output a store
/// (`LILY_STORE16=scalar`, the first form, for A/B runs): the same values either way. Read once.
fn rows16() -> bool {
    static ROWS16: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ROWS16.get_or_init(|| std::env::var("LILY_STORE16").as_deref() != Ok("scalar"))
}
/// The split-K forms of the plain 64-token tiles (`Call::split_k`): half 4-bit (variant 5's ring, two
/// blocks an SM), folded exact 4-bit (variant 3), folded exact 8-bit (`variant_q8(5)`).
const NAMES_SK: [&str; 3] = ["gemm_wgmma_plain_n64_h128_sk", "gemm_wgmma_plain_n64_p2_sk", "gemm_wgmma_plain_n64_p2_q8_sk"];
const fn variant_sk(i: usize) -> Variant {
    match i {
        0 => variant(5),
        1 => variant(3),
        _ => variant_q8(5),
    }
}
/// Most blocks a split-K tile is split into, and the fewest of K's groups each takes.
const SPLIT_MAX: usize = 8;
const SPLIT_MIN_GROUPS: usize = 4;
/// Blocks (an SM) a split-K grid may reach: the split doubles while the grid stays within this.
const SPLIT_BLOCKS_PER_SM: usize = 2;

/// The splits of K for a plain GEMM of `tiles` 64-token tiles over `groups` groups of K on `sm` SMs:
/// doubled from 1 while the grid stays within `SPLIT_BLOCKS_PER_SM` blocks an SM and each split keeps
/// at least `SPLIT_MIN_GROUPS` groups, at most `SPLIT_MAX` (1: the grid fills the GPU already). The
/// router at 256 tokens (12 tiles, 32 groups) takes 8; a 2048 × 4096 projection at 256 tokens (64 tiles)
/// 4; at 1K tokens neither splits.
pub(crate) fn split_count(tiles: usize, groups: usize, sm: usize) -> usize {
    let mut s = 1;
    while s < SPLIT_MAX && tiles * 2 * s <= SPLIT_BLOCKS_PER_SM * sm && groups / (2 * s) >= SPLIT_MIN_GROUPS {
        s *= 2;
    }
    s
}

/// f32 values of the split-K partial tiles the largest split grid holds: splits × tiles ≤ the grid's
/// bound, each tile 64 tokens × 128 rows.
fn split_part_floats(sm: usize) -> usize {
    SPLIT_BLOCKS_PER_SM * sm * 64 * 128
}

/// The router's folded 64-token tile (`NAMES_Q8[5]`) with each group's scales and biases loaded in its
/// own step, the form before the twenty-seventh session; `NAMES_Q8[5]` fetches them a group ahead (the
/// same values). The router takes this one unless `LILY_ROUTER_FOLD=ahead` (opt-in: built in the
/// twenty-seventh session, not yet run on a GPU; read once, see [`late_scales`]).
const NAME_Q8_LATE: &str = "gemm_wgmma_plain_n64_p2_q8_late";
fn late_scales() -> bool {
    static LATE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *LATE.get_or_init(|| std::env::var("LILY_ROUTER_FOLD").as_deref() != Ok("ahead"))
}
/// The grouped SwiGLU (the MoE gate/up) on [`Ws::T256`] and [`Ws::T160`] with the fast SiLU epilogue
/// (`store_tile`'s FAST_SILU: `__expf` and `__fdividef` for the IEEE forms, a few ulp of the output).
const NAMES_WS_FS: [&str; 2] = ["gemm_wgmma_grouped_swiglu_ws128t256_fs", "gemm_wgmma_grouped_swiglu_ws128t160_fs"];

/// Whether the grouped SwiGLU's two-part tiles take [`NAMES_WS_FS`] (the default) or the IEEE
/// exponential and division (`LILY_SILU=precise`, the first form, for A/B runs). Read once.
fn fast_silu() -> bool {
    static FAST: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *FAST.get_or_init(|| std::env::var("LILY_SILU").as_deref() != Ok("precise"))
}

/// [`Ws::Mc256`]'s plain and SwiGLU forms (cluster pairs sharing each X tile by TMA multicast).
const NAMES_MC: [&str; 2] = ["gemm_wgmma_plain_mc256", "gemm_wgmma_swiglu_mc256"];

/// A warp-specialised tile: a producer warpgroup and consumer warpgroups of 64 weight rows a m64 tile.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Ws {
    /// 128 weight rows: two consumer warpgroups of one m64 tile.
    R128,
    /// 256 weight rows: two consumer warpgroups of two m64 tiles.
    R256,
    /// 256 weight rows: four consumer warpgroups of one m64 tile (one register set of weights each).
    Four,
    /// 256 weight rows with the weights dequantised once into shared memory by the loading warpgroup
    /// and both MMA operands from shared memory: two consumer warpgroups of two m64 tiles (`wg_tile_ss`).
    Ss256,
    /// 128 weight rows × 256 tokens: two consumer warpgroups of one m64 tile, each weight they
    /// dequantise feeding the MMAs of both 128-token halves (the second only where the tile has more
    /// than 128 slots).
    T256,
    /// 128 weight rows × 160 tokens: `T256` with a second part of 32 tokens (an expert of up to 160
    /// slots one tile; stages of 24 KB, so the ring holds 9 groups).
    T160,
    /// `T256` in cluster pairs (the plain and SwiGLU forms, an even count of row tiles): the two blocks
    /// of a pair take adjacent row tiles of one token tile, and each X tile is copied once for both by
    /// TMA multicast (half the L2 traffic a FLOP).
    Mc256,
}

impl Ws {
    /// Its place in `WS_KINDS`.
    const fn index(self) -> usize {
        match self {
            Ws::R128 => 0,
            Ws::R256 => 1,
            Ws::Four => 2,
            Ws::Ss256 => 3,
            Ws::T256 | Ws::Mc256 => 4,
            Ws::T160 => 5,
        }
    }

    /// Weight rows a tile.
    pub(crate) const fn rows(self) -> usize {
        if matches!(self, Ws::R128 | Ws::T256 | Ws::T160 | Ws::Mc256) { 128 } else { 256 }
    }

    /// Tokens (slots) a tile.
    pub(crate) const fn tokens(self) -> usize {
        match self {
            Ws::T256 | Ws::Mc256 => 256,
            Ws::T160 => 160,
            _ => 128,
        }
    }

    /// Stages of its ring (NS of `WS_ENTRY` in the `.cu`; `Ss256`: the X and code stages, NX of
    /// `SS_ENTRY`).
    const fn stages(self) -> usize {
        match self {
            Ws::R128 => 10,
            Ws::Ss256 => 5,
            Ws::T256 | Ws::Mc256 => 6,
            Ws::T160 => 9,
            _ => 8,
        }
    }

    /// Threads a block: the producer warpgroup and the consumers.
    const fn threads(self) -> u32 {
        if matches!(self, Ws::Four) { 640 } else { 384 }
    }
}

/// Experts a grouped call of the warp-specialised tiles may route over (`group_tile_prefix` covers two
/// experts a thread: 768 at 384 threads, more at 640).
pub(crate) const WS_MAX_EXPERTS: usize = 768;
const STAGE_KERNEL: &str = "gemm_wgmma_stage";
const STAGE_HALF_KERNEL: &str = "gemm_wgmma_stage_half";
const STAGE_HALF_ROWS_KERNEL: &str = "gemm_wgmma_stage_half_rows";
const STAGE_HALF_WROWS_KERNEL: &str = "gemm_wgmma_stage_half_wrows";

/// Every kernel's name, in the order of these lists.
const NAME_LISTS: [&[&str]; 11] = [
    &NAMES,
    &[STAGE_KERNEL, STAGE_HALF_KERNEL, STAGE_HALF_ROWS_KERNEL, STAGE_HALF_WROWS_KERNEL],
    &NAMES_Q8,
    &NAMES_WS,
    &NAMES_O16,
    &NAMES_WS_O16,
    &NAMES_WS_FS,
    &NAMES_N32,
    &NAMES_MC,
    &[NAME_Q8_LATE],
    &NAMES_SK,
];
const N_ALL: usize = {
    let (mut n, mut l) = (0, 0);
    while l < NAME_LISTS.len() {
        n += NAME_LISTS[l].len();
        l += 1;
    }
    n
};
const fn all_kernels() -> [&'static str; N_ALL] {
    let mut out = [""; N_ALL];
    let (mut n, mut l) = (0, 0);
    while l < NAME_LISTS.len() {
        let mut i = 0;
        while i < NAME_LISTS[l].len() {
            out[n] = NAME_LISTS[l][i];
            (i, n) = (i + 1, n + 1);
        }
        l += 1;
    }
    out
}
const ALL: [&str; N_ALL] = all_kernels();
pub(crate) const KERNELS: &[&str] = &ALL;

/// A kernel variant: tokens a block, numerics, ring stages, warpgroups (of 64 weight rows each), bits
/// of a code.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Variant {
    bt: usize,
    num: Num,
    stages: usize,
    wgs: usize,
    bits: usize,
}

impl Variant {
    /// Weight rows a block.
    const fn rows(self) -> usize {
        64 * self.wgs
    }
}

/// Variant `i` of a form. The half kernels of 128 weight rows run 2 (128 tokens) or 3 (64 tokens) blocks
/// an SM on shallower rings; those of 256 rows, four warpgroups of one m64 tile each (measured in
/// PERF.md, 2026-12-03 fourth session: two warpgroups of two tiles ran slower, at the register limit).
const fn variant(i: usize) -> Variant {
    let (bt, num, stages, wgs) = match i % VARIANTS {
        0 => (128, Num::Bf16x, STAGES, 2),
        1 => (128, Num::Exact, STAGES, 2),
        2 => (64, Num::Bf16x, STAGES, 2),
        3 => (64, Num::Exact, STAGES, 2),
        4 => (128, Num::Half, 5, 2),
        5 => (64, Num::Half, 4, 2),
        6 => (128, Num::Half, 6, 4),
        _ => (64, Num::Half, 6, 4),
    };
    Variant { bt, num, stages, wgs, bits: 4 }
}

/// The 8-bit variant `i`, named `NAMES_Q8[i]`: 0, 1 half (128, 64 tokens; 4 stages); 2–5 the 4-bit
/// variants 0–3 (folded) with 8-bit codes.
const fn variant_q8(i: usize) -> Variant {
    match i {
        0 | 1 => Variant { bt: if i == 0 { 128 } else { 64 }, num: Num::Half, stages: 4, wgs: 2, bits: 8 },
        _ => {
            let v = variant(i - 2);
            Variant { bits: 8, ..v }
        }
    }
}

/// The index in `NAMES_Q8` of the 8-bit variant of `bt` tokens in `num`.
const fn variant_q8_index(bt: usize, num: Num) -> usize {
    match num {
        Num::Half => {
            if bt == 128 {
                0
            } else {
                1
            }
        }
        Num::Bf16x => {
            if bt == 128 {
                2
            } else {
                4
            }
        }
        Num::Exact => {
            if bt == 128 {
                3
            } else {
                5
            }
        }
    }
}

/// The variant index for `bt` tokens and `rows` weight rows a block (128, or 256 in `Num::Half`).
fn variant_index(bt: usize, num: Num, rows: usize) -> usize {
    match (num, bt, rows) {
        (Num::Bf16x, 128, _) => 0,
        (Num::Exact, 128, _) => 1,
        (Num::Bf16x, _, _) => 2,
        (Num::Exact, _, _) => 3,
        (Num::Half, 128, 128) => 4,
        (Num::Half, _, 128) => 5,
        (Num::Half, 128, _) => 6,
        (Num::Half, _, _) => 7,
    }
}

/// Dynamic shared memory of a variant: its ring's stages, each rounded to 1024 bytes (planes × bt rows
/// of 128 bytes, the codes of its weight rows × 8·bits bytes, and in the folded numerics bt X sums),
/// plus 1024 for aligning the ring.
const fn smem_bytes(v: Variant) -> usize {
    let sums = if matches!(v.num, Num::Half) { 0 } else { v.bt * 4 };
    let stage = (v.num.planes() * v.bt * 128 + v.rows() * 8 * v.bits + sums).div_ceil(1024) * 1024;
    v.stages * stage + 1024
}

/// The warp-specialised tiles in the order of `NAMES_WS` within a form.
const WS_KINDS: [Ws; 6] = [Ws::R128, Ws::R256, Ws::Four, Ws::Ss256, Ws::T256, Ws::T160];
/// `Ss256`'s slots of dequantised weights (NA of `SS_ENTRY`), 256 rows of 128 bytes each.
const SS_SLOTS: usize = 2;

/// Dynamic shared memory of a warp-specialised tile: its ring (stages of the tile's X rows of 128
/// bytes and its code rows of 32 bytes, each rounded to 1024 bytes) plus 1024 for aligning it. The
/// kernel's static shared memory (barriers, the expert prefix, the slots' scales, and in the bf16-output
/// forms 4 KB of output rows) comes on top: 6.4 KB at most (the four-consumer tile's expert prefix), 9.2
/// KB in the bf16-output forms of [`Ws::T256`] and [`Ws::T160`] (0.9 KB short of the SM's 227 KB).
const fn ws_smem_bytes(kind: Ws) -> usize {
    let weights = if matches!(kind, Ws::Ss256) { SS_SLOTS * 256 * 128 } else { 0 };
    kind.stages() * (kind.tokens() * 128 + kind.rows() * 32).div_ceil(1024) * 1024 + weights + 1024
}

pub(crate) fn configure(dev: &Device) -> Result<()> {
    for (i, name) in NAMES_WS.iter().enumerate() {
        let kind = WS_KINDS[i % WS_KINDS.len()];
        dev.function(name)?.set_attribute(CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, ws_smem_bytes(kind) as i32)?;
    }
    let fs = [(&NAMES_WS_FS[0], Ws::T256), (&NAMES_WS_FS[1], Ws::T160)];
    for (name, kind) in NAMES_WS_O16.iter().zip(WS_O16_KINDS).chain([(&NAMES_MC[0], Ws::Mc256), (&NAMES_MC[1], Ws::Mc256)]).chain(fs) {
        dev.function(name)?.set_attribute(CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, ws_smem_bytes(kind) as i32)?;
    }
    for (i, name) in NAMES.iter().enumerate() {
        dev.function(name)?
            .set_attribute(CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem_bytes(variant(i)) as i32)?;
    }
    for name in NAMES_N32 {
        dev.function(name)?.set_attribute(CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem_bytes(VARIANT_N32) as i32)?;
    }
    for (i, name) in NAMES_O16.iter().enumerate() {
        dev.function(name)?
            .set_attribute(CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem_bytes(variant(4 + i % 2)) as i32)?;
    }
    for (i, name) in NAMES_Q8.iter().enumerate() {
        dev.function(name)?
            .set_attribute(CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem_bytes(variant_q8(i)) as i32)?;
    }
    dev.function(NAME_Q8_LATE)?
        .set_attribute(CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem_bytes(variant_q8(5)) as i32)?;
    for (i, name) in NAMES_SK.iter().enumerate() {
        dev.function(name)?.set_attribute(CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem_bytes(variant_sk(i)) as i32)?;
    }
    Ok(())
}

/// One GEMM call, as `gemm::run` has checked it (addresses of live buffers of the sizes named).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Call {
    /// (packed codes, scales, biases) of the gate (or only) matrix stack and of the up stack (or zeros).
    pub w: (u64, u64, u64),
    pub w2: (u64, u64, u64),
    /// f32 `[x_rows, cols]`.
    pub x: u64,
    pub x_rows: usize,
    /// `[t, rows]`: f32, or bf16 with `out16`.
    pub y: u64,
    pub t: usize,
    pub rows: usize,
    pub cols: usize,
    /// Plain forms: the matrix of the stack.
    pub matrix: usize,
    /// Bits of a code: 4, or 8 (the plain form with 128 weight rows only).
    pub bits: u32,
    /// Grouped forms: (offsets address, gather address or 0, experts).
    pub grouped: Option<(u64, u64, usize)>,
    /// y in bf16: the grouped form without SwiGLU, 4-bit, `Num::Half`, 128 weight rows, not `ws`.
    pub out16: bool,
    /// K may be split over several blocks a tile ([`split_count`]): the plain form (no SwiGLU), 64
    /// tokens, 128 weight rows, `Num::Half` (4-bit) or `Num::Exact` (4- or 8-bit), not `ws`.
    pub split_k: bool,
}

/// Bytes of staged x for `x_rows` rows of `cols` (a multiple of 64) in `planes` planes: the planes
/// (each rounded to 256 bytes) and the f32 sums per group (the half numerics' per-row scales fit in
/// the one-plane size).
pub(crate) fn stage_bytes(x_rows: usize, cols: usize, planes: usize) -> usize {
    planes * (x_rows * cols * 2).next_multiple_of(256) + x_rows * (cols / GROUP) * 4
}

/// Where a staging of `x_rows` rows of `cols` in `planes` planes lies in the buffer at `base`: the hi
/// plane, the lo plane (0 with one plane) and the sums or scales after the planes (stage_bytes's layout).
fn stage_addrs(base: u64, x_rows: usize, cols: usize, planes: usize) -> (u64, u64, u64) {
    let plane_bytes = (x_rows * cols * 2).next_multiple_of(256) as u64;
    (base, if planes == 2 { base + plane_bytes } else { 0 }, base + planes as u64 * plane_bytes)
}

/// What a staging is of: (x address, rows, columns, numerics).
type StageKey = (u64, usize, usize, Num);

/// The device's staging buffers, one for the half numerics and one for the folded ones, and the x each
/// holds (`None` when new or forgotten). Two, so that a GEMM in the folded numerics (the MoE router)
/// between two half-numerics GEMMs on the same x (the shared expert and the routed experts' gate/up,
/// on x staged by the norm that wrote it) leaves the half staging in place.
#[derive(Default)]
pub(crate) struct Stage {
    bufs: [Option<cudarc::driver::CudaSlice<u8>>; 2],
    holds: [Option<StageKey>; 2],
    /// The split-K tiles' partial tiles (f32, [`split_part_floats`]) and their tiles' counters (zero
    /// between calls: each call's last block of a tile resets its own).
    split: Option<(cudarc::driver::CudaSlice<f32>, cudarc::driver::CudaSlice<u32>)>,
}

/// The device's staging buffers, locked.
fn lock_stage(dev: &Device) -> Result<std::sync::MutexGuard<'_, Stage>> {
    dev.gemm_stage.lock().map_err(|_| CudaError::Driver("gemm stage buffer lock poisoned".into()))
}

/// The buffer of `Stage` a numerics stages into.
const fn slot(num: Num) -> usize {
    if matches!(num, Num::Half) { 0 } else { 1 }
}

/// Makes the device's staging buffers at least `half` bytes (the half numerics) and `folded` bytes (grown
/// in 16 MiB steps; an old one is freed in stream order), and the split-K buffers where `Tile::Auto` may
/// split K (`LILY_SPLITK=1`, [`super::gemm::split_k_on`]). The model reserves its largest needs at load,
/// so that the memory it reports includes them and a prefill allocates nothing. Returns the bytes the
/// staging and split-K buffers hold.
pub(crate) fn reserve(dev: &Device, half: usize, folded: usize) -> Result<usize> {
    let mut stage = lock_stage(dev)?;
    reserve_in(dev, &mut stage, 0, half)?;
    reserve_in(dev, &mut stage, 1, folded)?;
    if super::gemm::split_k_on() {
        split_buffers(dev, &mut stage)?;
    }
    let bufs: usize = stage.bufs.iter().flatten().map(|b| b.len()).sum();
    Ok(bufs + stage.split.as_ref().map_or(0, |(p, c)| 4 * (p.len() + c.len())))
}

/// The split-K buffers' addresses (partial tiles, counters), made on first use.
fn split_buffers(dev: &Device, stage: &mut Stage) -> Result<(u64, u64)> {
    if stage.split.is_none() {
        let sm = dev.sm_count() as usize;
        stage.split = Some((dev.zeros::<f32>(split_part_floats(sm))?, dev.zeros::<u32>(SPLIT_BLOCKS_PER_SM * sm)?));
    }
    let (part, count) = stage.split.as_ref().map(|(p, c)| (p.device_ptr(dev.stream()).0, c.device_ptr(dev.stream()).0)).unwrap_or((0, 0));
    Ok((part, count))
}

/// Makes buffer `slot` at least `bytes` and returns its address.
fn reserve_in(dev: &Device, stage: &mut Stage, slot: usize, bytes: usize) -> Result<u64> {
    if stage.bufs[slot].as_ref().is_none_or(|b| b.len() < bytes) {
        stage.bufs[slot] = Some(dev.zeros::<u8>(bytes.max(1).next_multiple_of(16 << 20))?);
        stage.holds[slot] = None;
    }
    Ok(stage.bufs[slot].as_ref().map(|b| b.device_ptr(dev.stream()).0).unwrap_or(0))
}

/// The kernels that stage x for the half numerics (kernels/gemm_wgmma.cu; the same bits).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stager {
    /// One warp a row, 2-byte stores at the permuted columns (the first form; `LILY_STAGE=warp`).
    Warp,
    /// Each row held in shared memory — one warp a row up to `STAGE_WARP_ROW_COLS` columns, else one
    /// block a row (64–256 threads) — x read once, 16-byte stores (the default; rows of more than
    /// `STAGE_ROWS_MAX_COLS` columns take `Warp`).
    Rows,
}

/// Columns the one-block-a-row stager holds in shared memory (48 KiB of f32).
const STAGE_ROWS_MAX_COLS: usize = 12 * 1024;
/// Rows of up to this many columns are held one a warp, 8 a block (32 KiB): a block a row of 512
/// columns measured slower than the first form (41.8 against 36.7 µs on [32768 × 512], H100 ncu).
const STAGE_WARP_ROW_COLS: usize = 1024;

/// The stager `run` uses: `LILY_STAGE=warp` the first form (A/B runs; read once), else `Rows`.
fn stager() -> Stager {
    static S: std::sync::OnceLock<Stager> = std::sync::OnceLock::new();
    *S.get_or_init(|| if std::env::var("LILY_STAGE").is_ok_and(|v| v == "warp") { Stager::Warp } else { Stager::Rows })
}

/// Launches the half numerics' staging of `sp.rows` rows of `sp.cols` (a multiple of 64) columns: the
/// f16 plane at `sp.hi`, the rows' scales 2^e at `sp.sums`.
fn launch_stage_half(dev: &Device, sp: &StageParams, kind: Stager) -> Result<()> {
    let cols = sp.cols as usize;
    if kind == Stager::Rows && cols <= STAGE_WARP_ROW_COLS {
        let cfg = LaunchConfig {
            grid_dim: ((sp.rows as usize).div_ceil(THREADS / 32) as u32, 1, 1),
            block_dim: (THREADS as u32, 1, 1),
            shared_mem_bytes: (4 * cols * THREADS / 32) as u32,
        };
        return launch(dev, STAGE_HALF_WROWS_KERNEL, cfg, sp);
    }
    if kind == Stager::Rows && cols <= STAGE_ROWS_MAX_COLS {
        // A thread per 16-byte chunk of the staged row where there are 64–256 of them.
        let threads = match cols / 8 {
            c if c >= 256 => 256,
            c if c >= 128 => 128,
            _ => 64,
        };
        let cfg = LaunchConfig { grid_dim: (sp.rows as u32, 1, 1), block_dim: (threads, 1, 1), shared_mem_bytes: 4 * cols as u32 };
        return launch(dev, STAGE_HALF_ROWS_KERNEL, cfg, sp);
    }
    let cfg = LaunchConfig { grid_dim: ((sp.rows as usize).div_ceil(THREADS / 32) as u32, 1, 1), block_dim: (THREADS as u32, 1, 1), shared_mem_bytes: 0 };
    launch(dev, STAGE_HALF_KERNEL, cfg, sp)
}

/// Stages `rows` rows of `cols` columns (a multiple of 64) of x for the half numerics with `kind`, into
/// fresh buffers: the f16 plane's bits [rows, cols] (permuted within each group of 64) and the rows'
/// scales 2^e [rows]. For tests of the stagers; the GEMMs stage into the device's buffer.
pub fn stage_half<X: DevicePtr<f32>>(dev: &Device, x: &X, rows: usize, cols: usize, kind: Stager) -> Result<(CudaSlice<u16>, CudaSlice<f32>)> {
    if rows == 0 || cols == 0 || !cols.is_multiple_of(GROUP) || rows > u32::MAX as usize / 2 || rows * cols > i32::MAX as usize {
        return Err(CudaError::Shape(format!("stage_half: {rows} rows of {cols} columns (a positive multiple of 64)")));
    }
    let xp = addr(dev, x, rows * cols, "stage_half x")?;
    if xp % 16 != 0 {
        return Err(CudaError::Shape("stage_half: x must be 16-byte aligned".into()));
    }
    let plane = dev.zeros::<u16>(rows * cols)?;
    let scales = dev.zeros::<f32>(rows)?;
    let (hi, sums) = (plane.device_ptr(dev.stream()).0, scales.device_ptr(dev.stream()).0);
    launch_stage_half(dev, &StageParams { x: xp, hi, lo: 0, sums, rows: rows as i64, cols: cols as i32 }, kind)?;
    Ok((plane, scales))
}

/// Where a producer kernel writes x's half-numerics staging itself ([`prestage_half`]): the f16 plane
/// [rows, cols] (columns permuted within each group of 64, kernels/stage_half.cuh) and the rows' scales
/// 2^e [rows]. Made only by [`prestage_half`] or [`HalfStage::into_buffers`], so its addresses are
/// checked ones.
#[derive(Clone, Copy, Debug)]
pub struct HalfStage {
    pub(crate) plane: u64,
    pub(crate) scales: u64,
    pub(crate) rows: usize,
    pub(crate) cols: usize,
}

impl HalfStage {
    /// Into caller-owned buffers (tests): `plane` [rows·cols], `scales` [rows], which must outlive
    /// every launch that writes through it.
    pub fn into_buffers<P: DevicePtrMut<u16>, S: DevicePtrMut<f32>>(dev: &Device, plane: &mut P, scales: &mut S, rows: usize, cols: usize) -> Result<HalfStage> {
        if rows == 0 || !cols.is_multiple_of(GROUP) || cols == 0 || plane.len() < rows * cols || scales.len() < rows {
            return Err(CudaError::Shape(format!("half stage: {rows} rows of {cols} into a plane of {} and {} scales", plane.len(), scales.len())));
        }
        let (pp, sp) = (plane.device_ptr_mut(dev.stream()).0, scales.device_ptr_mut(dev.stream()).0);
        if pp % 16 != 0 {
            return Err(CudaError::Shape("half stage: the plane must be 16-byte aligned".into()));
        }
        Ok(HalfStage { plane: pp, scales: sp, rows, cols })
    }
}

/// x's address for a prestage call `what`, after its shape's check: `rows` > 0 rows of `cols` columns, a
/// positive multiple of 64, with fewer than 2^32 − 2 elements (the stagers' indices).
fn prestaged_x<X: DevicePtr<f32>>(dev: &Device, x: &X, rows: usize, cols: usize, what: &str) -> Result<u64> {
    if rows == 0 || cols == 0 || !cols.is_multiple_of(GROUP) || rows as u128 * cols as u128 > u32::MAX as u128 - 2 {
        return Err(CudaError::Shape(format!("{what}: {rows} rows of {cols} columns (a positive multiple of 64)")));
    }
    addr(dev, x, rows * cols, &format!("{what} x"))
}

/// Makes the device's staging buffer hold x (`rows` × `cols`, a multiple of 64) in the half numerics
/// and returns where its plane and scales go, for a kernel that produces x to write them instead of
/// x's f32 values; the next GEMM on x must then run with `x_staged_only` (and
/// [`super::gemm::takes_prestaged_half`]). Whatever the buffer held before is forgotten.
pub fn prestage_half<X: DevicePtr<f32>>(dev: &Device, x: &X, rows: usize, cols: usize) -> Result<HalfStage> {
    let xp = prestaged_x(dev, x, rows, cols, "prestage_half")?;
    let mut stage = lock_stage(dev)?;
    let base = reserve_in(dev, &mut stage, slot(Num::Half), stage_bytes(rows, cols, 1))?;
    stage.holds = [None, None];
    stage.holds[slot(Num::Half)] = Some((xp, rows, cols, Num::Half));
    let (plane, _, scales) = stage_addrs(base, rows, cols, 1);
    Ok(HalfStage { plane, scales, rows, cols })
}

/// Where a producer kernel writes x's folded (exact) numerics' staging itself, beside its half one
/// ([`prestage_half_exact`]): the hi and lo bf16 planes [rows, cols] (columns permuted within each group
/// of 64 as the half plane's) and x's f32 sums per group [rows, cols / 64], as `gemm_wgmma_stage` writes
/// them. Made only by [`prestage_half_exact`] or [`ExactStage::into_buffers`], so its addresses are
/// checked ones.
#[derive(Clone, Copy, Debug)]
pub struct ExactStage {
    pub(crate) hi: u64,
    pub(crate) lo: u64,
    pub(crate) sums: u64,
    pub(crate) rows: usize,
    pub(crate) cols: usize,
}

impl ExactStage {
    /// Into caller-owned buffers (tests): `hi`, `lo` [rows·cols], `sums` [rows·cols/64], which must
    /// outlive every launch that writes through it.
    pub fn into_buffers<H: DevicePtrMut<u16>, L: DevicePtrMut<u16>, S: DevicePtrMut<f32>>(
        dev: &Device,
        hi: &mut H,
        lo: &mut L,
        sums: &mut S,
        rows: usize,
        cols: usize,
    ) -> Result<ExactStage> {
        if rows == 0 || cols == 0 || !cols.is_multiple_of(GROUP) || hi.len() < rows * cols || lo.len() < rows * cols || sums.len() < rows * (cols / GROUP) {
            return Err(CudaError::Shape(format!(
                "exact stage: {rows} rows of {cols} into planes of {} and {} and {} sums",
                hi.len(),
                lo.len(),
                sums.len()
            )));
        }
        let (h, l, s) = (hi.device_ptr_mut(dev.stream()).0, lo.device_ptr_mut(dev.stream()).0, sums.device_ptr_mut(dev.stream()).0);
        if h % 16 != 0 || l % 16 != 0 {
            return Err(CudaError::Shape("exact stage: the planes must be 16-byte aligned".into()));
        }
        Ok(ExactStage { hi: h, lo: l, sums: s, rows, cols })
    }
}

/// [`prestage_half`] and the folded exact numerics' staging of the same x, each in its own buffer, for
/// a kernel that produces x to write both: the next GEMMs on x in either numerics (the MoE router in
/// the folded numerics, the experts in the half ones) reuse them (`Opts::reuse_x`), x's f32 values
/// still written. Whatever the buffers held before is forgotten.
pub fn prestage_half_exact<X: DevicePtr<f32>>(dev: &Device, x: &X, rows: usize, cols: usize) -> Result<(HalfStage, ExactStage)> {
    let xp = prestaged_x(dev, x, rows, cols, "prestage_half_exact")?;
    let mut stage = lock_stage(dev)?;
    let hb = reserve_in(dev, &mut stage, slot(Num::Half), stage_bytes(rows, cols, 1))?;
    let eb = reserve_in(dev, &mut stage, slot(Num::Exact), stage_bytes(rows, cols, 2))?;
    stage.holds = [Some((xp, rows, cols, Num::Half)), Some((xp, rows, cols, Num::Exact))];
    let (plane, _, scales) = stage_addrs(hb, rows, cols, 1);
    let (hi, lo, sums) = stage_addrs(eb, rows, cols, 2);
    Ok((HalfStage { plane, scales, rows, cols }, ExactStage { hi, lo, sums, rows, cols }))
}

/// Stages `rows` rows of `cols` columns (a multiple of 64) of x for the folded exact numerics into fresh
/// buffers, as a GEMM in those numerics does (`gemm_wgmma_stage`): the hi and lo bf16 planes [rows,
/// cols] and the group sums [rows, cols / 64]. For tests of the producers that write it.
#[allow(clippy::type_complexity)]
pub fn stage_exact<X: DevicePtr<f32>>(dev: &Device, x: &X, rows: usize, cols: usize) -> Result<(CudaSlice<u16>, CudaSlice<u16>, CudaSlice<f32>)> {
    if rows == 0 || cols == 0 || !cols.is_multiple_of(GROUP) || rows * cols > i32::MAX as usize {
        return Err(CudaError::Shape(format!("stage_exact: {rows} rows of {cols} columns (a positive multiple of 64)")));
    }
    let xp = addr(dev, x, rows * cols, "stage_exact x")?;
    let (hi, lo, sums) = (dev.zeros::<u16>(rows * cols)?, dev.zeros::<u16>(rows * cols)?, dev.zeros::<f32>(rows * (cols / GROUP))?);
    let sp = StageParams {
        x: xp,
        hi: hi.device_ptr(dev.stream()).0,
        lo: lo.device_ptr(dev.stream()).0,
        sums: sums.device_ptr(dev.stream()).0,
        rows: rows as i64,
        cols: cols as i32,
    };
    launch_stage_exact(dev, &sp)?;
    Ok((hi, lo, sums))
}

/// Launches the folded numerics' staging (one warp per (row, group)).
fn launch_stage_exact(dev: &Device, sp: &StageParams) -> Result<()> {
    let warps = sp.rows as usize * (sp.cols as usize / GROUP);
    let cfg = LaunchConfig { grid_dim: (warps.div_ceil(THREADS / 32) as u32, 1, 1), block_dim: (THREADS as u32, 1, 1), shared_mem_bytes: 0 };
    launch(dev, STAGE_KERNEL, cfg, sp)
}

/// Marks the staging buffers as holding no x (a GEMM call that stages nothing ran since).
pub(crate) fn forget_staged(dev: &Device) -> Result<()> {
    let mut stage = lock_stage(dev)?;
    stage.holds = [None, None];
    Ok(())
}

/// Runs `c` with `bt` (64 or 128) tokens and `wrows` (128, or 256 in `Num::Half` only) weight rows a
/// block in numerics `num`; `ws`: on the warp-specialised persistent tiles (4-bit, `Num::Half`, 128
/// tokens, at most `WS_MAX_EXPERTS` experts). `xs`: `Reuse` — the caller promises x has not been written
/// since the previous call that staged it; when the numerics' buffer still holds that staging (same x,
/// shape and numerics), it is not staged again, and a staging into it leaves the other buffer's
/// staging of the same x in place; `Only` — the buffer must hold it (x's f32 values were never written,
/// [`prestage_half`]); `Fresh` leaves only its own staging.
pub(crate) fn run(dev: &Device, c: &Call, bt: usize, num: Num, wrows: usize, ws: Option<Ws>, xs: super::gemm::XStage) -> Result<()> {
    debug_assert!(c.cols.is_multiple_of(GROUP) && c.t > 0 && matches!(bt, 32 | 64 | 128 | 160 | 256) && (wrows == 128 || (wrows == 256 && num == Num::Half)));
    debug_assert!(bt != 32 || (c.grouped.is_some() && num == Num::Half && c.bits == 4 && wrows == 128 && ws.is_none()));
    debug_assert!(ws.is_none_or(|k| c.bits == 4 && num == Num::Half && bt == k.tokens() && k.rows() == wrows));
    let q8 = c.bits == 8;
    debug_assert!(c.bits == 4 || (q8 && c.w2.0 == 0 && c.grouped.is_none() && wrows == 128 && ws.is_none()));
    debug_assert!(!c.out16 || (c.bits == 4 && c.w2.0 == 0 && c.grouped.is_some() && num == Num::Half && wrows == 128 && ws.is_none_or(|k| matches!(k, Ws::T256 | Ws::T160))));
    debug_assert!(!c.split_k || (c.w2.0 == 0 && c.grouped.is_none() && !c.out16 && bt == 64 && wrows == 128 && ws.is_none() && (num == Num::Exact || (num == Num::Half && c.bits == 4))));
    // The grid (checked before anything is launched): token tiles × weight-row tiles, or the other way
    // round for grouped calls, whose blocks of one token tile run consecutively (`tile_slots` in the
    // kernel: measured +3% on the 4K prefill, the down projection 16.2 → 12.9 ms, PERF.md).
    let swiglu = c.w2.0 != 0;
    let (offsets, gather, experts) = c.grouped.unwrap_or((0, 0, 0));
    let m_tiles = c.t.div_ceil(bt) + experts;
    let row_tiles = c.rows.div_ceil(if swiglu { wrows / 2 } else { wrows });
    let grid = if c.grouped.is_some() { (row_tiles, m_tiles) } else { (m_tiles, row_tiles) };
    if grid.1 > 65535 {
        return Err(CudaError::Shape(format!("wgmma gemm: {} tiles along the grid's y", grid.1)));
    }
    if ws == Some(Ws::Mc256) && (c.grouped.is_some() || c.out16 || !row_tiles.is_multiple_of(2)) {
        return Err(CudaError::Shape(format!(
            "wgmma gemm: the cluster-pair tiles take the plain and SwiGLU forms with an even count of row tiles, not {row_tiles} (grouped: {})",
            c.grouped.is_some()
        )));
    }
    debug_assert!(ws.is_none() || experts <= WS_MAX_EXPERTS, "gemm::run refuses the warp-specialised tiles past WS_MAX_EXPERTS");
    let planes = num.planes();
    let key = (c.x, c.x_rows, c.cols, num);
    let sl = slot(num);
    // Split K where the tiles are too few for the GPU (the wrapper asked for it: `split_k`).
    let splits = if c.split_k { split_count(m_tiles * row_tiles, c.cols / GROUP, dev.sm_count() as usize) } else { 1 };
    debug_assert!(splits == 1 || (splits * c.t * c.rows <= split_part_floats(dev.sm_count() as usize) && m_tiles * row_tiles <= SPLIT_BLOCKS_PER_SM * dev.sm_count() as usize));
    let (base, staged, (part, tile_count)) = {
        let mut stage = lock_stage(dev)?;
        let split = if splits > 1 { split_buffers(dev, &mut stage)? } else { (0, 0) };
        let base = reserve_in(dev, &mut stage, sl, stage_bytes(c.x_rows, c.cols, planes))?;
        let staged = xs != super::gemm::XStage::Fresh && stage.holds[sl] == Some(key);
        if xs == super::gemm::XStage::Only && !staged {
            return Err(CudaError::Shape(format!(
                "wgmma gemm: x is only in its staged copy, but the staging buffer holds {:?}, not {key:?}",
                stage.holds[sl]
            )));
        }
        if !staged {
            stage.holds[sl] = None; // until the staging below has been launched
            // The other buffer keeps a staging only of this same x, unwritten since (a Reuse promise).
            let same_x = |k: &StageKey| xs != super::gemm::XStage::Fresh && (k.0, k.1, k.2) == (c.x, c.x_rows, c.cols);
            if !stage.holds[1 - sl].as_ref().is_some_and(same_x) {
                stage.holds[1 - sl] = None;
            }
        }
        (base, staged, split)
    };
    let (hi, lo, sums) = stage_addrs(base, c.x_rows, c.cols, planes);

    if !staged {
        let sp = StageParams { x: c.x, hi, lo, sums, rows: c.x_rows as i64, cols: c.cols as i32 };
        if num == Num::Half {
            launch_stage_half(dev, &sp, stager())?;
        } else {
            launch_stage_exact(dev, &sp)?;
        }
        lock_stage(dev)?.holds[sl] = Some(key);
    }

    let form = match (swiglu, c.grouped.is_some()) {
        (false, false) => 0,
        (true, false) => 1,
        (false, true) => 2,
        (true, true) => 3,
    };
    let p = WgParams {
        w: c.w.0,
        scales: c.w.1,
        biases: c.w.2,
        w2: c.w2.0,
        scales2: c.w2.1,
        biases2: c.w2.2,
        xh: hi,
        xl: lo,
        xsum: sums,
        y: c.y,
        offsets,
        gather,
        x_rows: c.x_rows as i64,
        t: c.t as i32,
        rows: c.rows as i32,
        cols: c.cols as i32,
        count: experts as i32,
        matrix: c.matrix as i32,
        splits: splits as i32,
        part,
        tile_count,
    };
    if ws == Some(Ws::Mc256) {
        // Cluster pairs: pairs of adjacent row tiles of a token tile, one pair a cluster of two SMs.
        let pairs = m_tiles * row_tiles / 2;
        let clusters = pairs.min(dev.sm_count() as usize / 2).max(1);
        let cfg = LaunchConfig {
            grid_dim: (2 * clusters as u32, 1, 1),
            block_dim: (Ws::Mc256.threads(), 1, 1),
            shared_mem_bytes: ws_smem_bytes(Ws::Mc256) as u32,
        };
        let q = WgTmaParams { xmap: x_map(hi, c.x_rows, c.cols)?, p };
        return launch_cluster(dev, NAMES_MC[form], cfg, 2, &q);
    }
    if let Some(kind) = ws {
        // Persistent: one block an SM (at most one a tile), each walking the tiles.
        let tiles = m_tiles * row_tiles;
        let blocks = tiles.min(dev.sm_count() as usize).max(1);
        let cfg = LaunchConfig { grid_dim: (blocks as u32, 1, 1), block_dim: (kind.threads(), 1, 1), shared_mem_bytes: ws_smem_bytes(kind) as u32 };
        let name = match (c.out16, kind) {
            (false, Ws::T256) if form == 3 && fast_silu() => NAMES_WS_FS[0],
            (false, Ws::T160) if form == 3 && fast_silu() => NAMES_WS_FS[1],
            (false, _) => NAMES_WS[WS_KINDS.len() * form + kind.index()],
            (true, Ws::T160) => NAMES_WS_O16[if rows16() { 1 } else { 3 }],
            (true, _) => NAMES_WS_O16[if rows16() { 0 } else { 2 }],
        };
        return launch(dev, name, cfg, &p);
    }
    let (name, v) = if splits > 1 {
        let i = match (num, q8) {
            (Num::Half, _) => 0,
            (_, false) => 1,
            (_, true) => 2,
        };
        (NAMES_SK[i], variant_sk(i))
    } else if bt == 32 {
        let i = match (c.out16, swiglu) {
            (false, false) => 0,
            (false, true) => 1,
            (true, _) => if rows16() { 2 } else { 3 },
        };
        (NAMES_N32[i], VARIANT_N32)
    } else if q8 {
        let i = variant_q8_index(bt, num);
        (if i == 5 && late_scales() { NAME_Q8_LATE } else { NAMES_Q8[i] }, variant_q8(i))
    } else if c.out16 {
        let vi = variant_index(bt, num, wrows);
        (NAMES_O16[vi - 4 + if rows16() { 0 } else { 2 }], variant(vi))
    } else {
        let vi = variant_index(bt, num, wrows);
        (NAMES[form * VARIANTS + vi], variant(vi))
    };
    debug_assert_eq!((v.bt, v.num, v.rows()), (bt, num, wrows));
    let cfg = LaunchConfig {
        grid_dim: (grid.0 as u32, grid.1 as u32, splits as u32),
        block_dim: (128 * v.wgs as u32, 1, 1),
        shared_mem_bytes: smem_bytes(v) as u32,
    };
    launch(dev, name, cfg, &p)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The split-K counts on a 132-SM GPU for the model's short-prompt GEMMs and the gpu_gemm cases,
    /// and the partial-tile buffer's bound holding every split grid's partials.
    #[test]
    fn split_count_fills_the_gpu_and_keeps_each_split_four_groups() {
        let sm = 132;
        // The router (257 rows: 3 row tiles; K = 2048: 32 groups) at 256, 512, 1K, 2K and 4K tokens.
        assert_eq!([4, 8, 16, 32, 64].map(|tt| split_count(tt * 3, 32, sm)), [8, 8, 4, 2, 1]);
        // A [2048 × 4096] output projection (16 row tiles, 64 groups) at 256, 512 and 1K tokens.
        assert_eq!([4, 8, 16].map(|tt| split_count(tt * 16, 64, sm)), [4, 2, 1]);
        // K = 512 (8 groups): two splits at most; K = 128: none.
        assert_eq!((split_count(1, 8, sm), split_count(1, 2, sm)), (2, 1));
        for tiles in 1..=2 * sm {
            for groups in [2, 8, 32, 64, 192] {
                let s = split_count(tiles, groups, sm);
                assert!(s.is_power_of_two() && s <= SPLIT_MAX);
                if s > 1 {
                    assert!(groups / s >= SPLIT_MIN_GROUPS && tiles * s <= SPLIT_BLOCKS_PER_SM * sm);
                    assert!(tiles * s * 64 * 128 <= split_part_floats(sm), "{tiles} tiles × {s}");
                }
            }
        }
    }

    /// Each variant's ring as laid out in the `.cu` (stages of X planes, codes and X sums, each rounded
    /// to 1024 bytes, plus 1024 for alignment), and the blocks an SM its launch bounds ask for fit in
    /// the 227 KiB an SM offers (n128_p*: 1, n64_p*: 2, n128_h128: 2, n64_h128: 3, *_h256: 1).
    #[test]
    fn variants_shared_memory_matches_the_kernels_and_fits() {
        let want = [87_040, 152_576, 54_272, 87_040, 103_424, 50_176, 148_480, 99_328];
        let blocks = [1, 1, 2, 2, 2, 3, 1, 1];
        for i in 0..VARIANTS {
            let v = variant(i);
            assert_eq!(smem_bytes(v), want[i], "variant {i} ({})", NAMES[i]);
            assert!(blocks[i] * smem_bytes(v) <= 227 * 1024, "variant {i}: {} blocks do not fit", blocks[i]);
            assert_eq!(variant_index(v.bt, v.num, v.rows()), i, "variant {i} is not the one its shape selects");
        }
        // The warp-specialised tiles: one block an SM, with their static shared memory (6.4 KB at most;
        // the bf16-output forms of the two-part tiles 9.2 KB, ptxas: 4 KB of them their warps' output rows).
        for (kind, want) in [(Ws::R128, 205_824), (Ws::R256, 197_632), (Ws::Four, 197_632), (Ws::Ss256, 189_440), (Ws::T256, 222_208), (Ws::T160, 222_208)] {
            assert_eq!(ws_smem_bytes(kind), want, "{kind:?}");
            let fixed = if WS_O16_KINDS.contains(&kind) { 9400 } else { 6400 };
            assert!(ws_smem_bytes(kind) + fixed <= 227 * 1024, "{kind:?} does not fit");
            assert_eq!(WS_KINDS[kind.index()], kind);
        }
        // The 32-token grouped tiles: three blocks an SM (their launch bound), 8 stages of 8 KB.
        assert_eq!(smem_bytes(VARIANT_N32), 66_560);
        assert!(3 * (smem_bytes(VARIANT_N32) + 1024) <= 227 * 1024);
        // The 8-bit kernels: the half ones two blocks an SM; the folded ones as their 4-bit variants.
        for (i, want) in [99_328, 66_560, 103_424, 168_960, 70_656, 103_424].into_iter().enumerate() {
            let blocks = if i < 2 { 2 } else { [1, 1, 2, 2][i - 2] };
            let v = variant_q8(i);
            assert_eq!(variant_q8_index(v.bt, v.num), i, "{}", NAMES_Q8[i]);
            assert_eq!(smem_bytes(v), want, "{}", NAMES_Q8[i]);
            assert!(blocks * smem_bytes(v) <= 227 * 1024, "{}: {blocks} blocks do not fit", NAMES_Q8[i]);
        }
    }
}
