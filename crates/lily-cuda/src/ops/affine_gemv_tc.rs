//! The tensor-core decode GEMV (`kernels/affine_gemv_tc.cu`): the 4-bit, group-64 case of
//! [`super::affine_gemv`] (the checkpoints' format), chosen there when the shape allows it. This
//! module knows the kernels' names, their shared memory and how the work is split; the parameters,
//! the checks and the launch are `affine_gemv::run`'s.

use std::sync::OnceLock;

use crate::{CudaError, Device, Result};

/// By K split 1, 2, 4, 8.
const GEMV: [&str; 4] = ["affine_gemv_tc_q4_k1", "affine_gemv_tc_q4_k2", "affine_gemv_tc_q4_k4", "affine_gemv_tc_q4_k8"];
const SWIGLU: [&str; 4] = ["affine_swiglu_tc_q4_k1", "affine_swiglu_tc_q4_k2", "affine_swiglu_tc_q4_k4", "affine_swiglu_tc_q4_k8"];
/// The integer form (x as three byte planes, int8 mmas; `gemv_tc.cuh`), by K split.
const GEMV_I8: [&str; 4] = ["affine_gemv_i8_q4_k1", "affine_gemv_i8_q4_k2", "affine_gemv_i8_q4_k4", "affine_gemv_i8_q4_k8"];
const SWIGLU_I8: [&str; 4] = ["affine_swiglu_i8_q4_k1", "affine_swiglu_i8_q4_k2", "affine_swiglu_i8_q4_k4", "affine_swiglu_i8_q4_k8"];
/// The integer SwiGLU with the MoE router's selection in each block (`SEL` in the .cu), by K split.
const SWIGLU_I8_SEL: [&str; 4] = ["affine_swiglu_i8_q4_k1_sel", "affine_swiglu_i8_q4_k2_sel", "affine_swiglu_i8_q4_k4_sel", "affine_swiglu_i8_q4_k8_sel"];
/// The bf16 form of one matrix with two rounds in flight a warp (`LILY_GEMV_DEPTH=2`), by K split.
const GEMV_D2: [&str; 4] = ["affine_gemv_tc_q4_k1_d2", "affine_gemv_tc_q4_k2_d2", "affine_gemv_tc_q4_k4_d2", "affine_gemv_tc_q4_k8_d2"];
/// The down projection with the combine, by most (slot, round) units a warp loads at once.
const MIX: [(&str, usize); 3] = [("affine_mix_tc_q4_u2", 2), ("affine_mix_tc_q4_u5", 5), ("affine_mix_tc_q4_u8", 8)];
pub(crate) const KERNELS: &[&str] = &[
    GEMV[0], GEMV[1], GEMV[2], GEMV[3], SWIGLU[0], SWIGLU[1], SWIGLU[2], SWIGLU[3], MIX[0].0, MIX[1].0, MIX[2].0, GEMV_I8[0], GEMV_I8[1],
    GEMV_I8[2], GEMV_I8[3], SWIGLU_I8[0], SWIGLU_I8[1], SWIGLU_I8[2], SWIGLU_I8[3], GEMV_D2[0], GEMV_D2[1], GEMV_D2[2], GEMV_D2[3],
    SWIGLU_I8_SEL[0], SWIGLU_I8_SEL[1], SWIGLU_I8_SEL[2], SWIGLU_I8_SEL[3],
];

/// Which tensor-core GEMV kernel: the K split (0: chosen by [`plan`]), the integer form, two
/// rounds of weights in flight a warp instead of one (the bf16 form of one matrix only), and the
/// MoE router's selection inside each block (the integer SwiGLU only; `affine_gemv::swiglu_select`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Form {
    pub ks: usize,
    pub int8: bool,
    pub deep: bool,
    pub select: bool,
}

impl Form {
    /// The form a forced GEMV variant names (`affine_gemv::gemv_tuned`): 9..=12 the bf16 form, 13..=16
    /// the integer form, 17..=20 the bf16 form with two rounds in flight, each at a K split of 1, 2, 4, 8.
    pub(crate) fn forced(variant: u32) -> Option<Form> {
        let v = variant.checked_sub(9).filter(|v| *v < 12)?;
        Some(Form { ks: 1 << (v % 4), int8: v / 4 == 1, deep: v / 4 == 2, select: false })
    }
}

/// Threads per block (8 warps), as `TC_WARPS` in the .cu.
pub(crate) const THREADS: u32 = 256;
/// Columns per round (4 lanes × 32 codes) and staged bytes per round (`TC_ROUND`).
const ROUND_COLS: usize = 128;
pub(crate) const ROUND_BYTES: usize = 960;
/// Staged bytes per round of the integer form (`I8_ROUND`).
const ROUND_BYTES_I8: usize = 576;
/// Warp tasks (16-row tiles × K slices) per SM wanted before the K split stops growing.
const WANT_TASKS_PER_SM: usize = 16;

/// Lets the kernels use the device's opt-in shared memory (x is staged there: 7.5 bytes per column).
pub(crate) fn configure(dev: &Device) -> Result<()> {
    super::allow_optin_smem(dev, KERNELS)
}

/// Whether the automatic choice may take these kernels: `LILY_GEMV=ffma` keeps the FFMA kernels
/// (read once; for A/B benchmarks).
pub(crate) fn enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var("LILY_GEMV").map(|v| v != "ffma").unwrap_or(true))
}

/// Whether the automatic choice takes the integer form (the default since the twelfth session's
/// measurement, docs/PERF.md; `LILY_GEMV=bf16` keeps the bf16 form, read once).
pub(crate) fn int8_auto() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var("LILY_GEMV").map(|v| v != "bf16").unwrap_or(true))
}

/// Whether the automatic choice keeps two rounds in flight a warp where it can (the bf16 form of one
/// matrix, so with `LILY_GEMV=bf16`; `LILY_GEMV_DEPTH=2`, read once; opt-in: even on an H100, where
/// lm_head already reaches 89% of the copy bandwidth, and not yet measured on an H200).
pub(crate) fn depth2_auto() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var("LILY_GEMV_DEPTH").is_ok_and(|v| v == "2"))
}

/// Whether a shape fits the kernels: 4-bit, group 64, whole rounds of 128 columns.
pub(crate) fn fits(bits: u32, group: usize, cols: usize) -> bool {
    bits == 4 && group == 64 && cols > 0 && cols.is_multiple_of(ROUND_COLS)
}

/// Whether the automatic choice takes them for a shape that fits: rows of up to 2048 columns, or
/// many rows. Measured in the 4K decode graph (docs/PERF.md, 2026-12-02): faster on every projection
/// of 2048 columns, on the down projections of 512 and on lm_head, slower on the [2048 x 4096]
/// output projections (the K split's reduction across 8 warps of 4 rounds each).
pub(crate) fn preferred(rows: usize, cols: usize, slots: usize) -> bool {
    cols <= 2048 || rows * slots >= 16384
}

/// The launch of the down projection with the combine over `ns` slots of `rows × cols` (a shape that
/// [`fits`]): (kernel, grid x, dynamic shared memory bytes), or None when a warp would hold more than
/// 8 (slot, round) units (many slots of long rows: the FFMA mix kernel takes those).
pub(crate) fn plan_mix(dev: &Device, rows: usize, cols: usize, ns: usize) -> Result<Option<(&'static str, u32, u32)>> {
    let units = ns * (cols / ROUND_COLS);
    let per_warp = units.div_ceil(THREADS as usize / 32);
    let Some(&(name, _)) = MIX.iter().find(|&&(_, u)| u >= per_warp) else { return Ok(None) };
    let smem = units * ROUND_BYTES + 4 * ns * (cols / 64);
    if smem > dev.max_smem_optin() as usize - 1024 {
        return Ok(None);
    }
    let cap = dev.resident_blocks(name, THREADS, smem as u32)? as usize;
    Ok(Some((name, rows.div_ceil(16).min(cap.max(1)) as u32, smem as u32)))
}

/// The launch for `rows × cols` over `slots`: (kernel, grid x, dynamic shared memory bytes) of the
/// kernel `form` names. Its K split `ks` (1, 2, 4, 8), or 0 to choose it: the smallest that gives every
/// SM 16 warp tasks, among those leaving each warp at least two rounds.
pub(crate) fn plan(dev: &Device, rows: usize, cols: usize, slots: usize, swiglu: bool, form: Form) -> Result<(&'static str, u32, u32)> {
    let Form { ks, int8, deep, select } = form;
    if deep && (swiglu || int8) {
        return Err(CudaError::Shape("gemv (tensor cores): two rounds in flight only in the bf16 form of one matrix".into()));
    }
    if select && !(swiglu && int8 && !deep) {
        return Err(CudaError::Shape("gemv (tensor cores): the selection only in the integer SwiGLU".into()));
    }
    let rounds = cols / ROUND_COLS;
    let tiles = rows.div_ceil(16);
    let auto = ks == 0;
    let ks = if auto {
        let mut pick = 1;
        for k in [1usize, 2, 4, 8] {
            if !rounds.is_multiple_of(k) || (k > 1 && rounds / k < 2) {
                break;
            }
            pick = k;
            if tiles * slots * k >= WANT_TASKS_PER_SM * dev.sm_count() as usize {
                break;
            }
        }
        pick
    } else {
        if ![1, 2, 4, 8].contains(&ks) || !rounds.is_multiple_of(ks) {
            return Err(CudaError::Shape(format!("gemv (tensor cores): a K split of {ks} for {rounds} rounds of 128 columns")));
        }
        ks
    };
    let nw = if swiglu { 2 } else { 1 };
    // x's staging, the group sums (and the integer form's group scales), the split-K partials.
    let smem = if int8 { rounds * ROUND_BYTES_I8 + 8 * (cols / 64) } else { rounds * ROUND_BYTES + 4 * (cols / 64) } + 4 * 8 * nw * 16;
    if smem > dev.max_smem_optin() as usize - 1024 {
        return Err(CudaError::Shape(format!("gemv (tensor cores): cols {cols} needs {smem} bytes of shared memory")));
    }
    let launch = |ks: usize| -> Result<(&'static str, usize, usize)> {
        let i = ks.trailing_zeros() as usize;
        let name = match (swiglu, int8, deep) {
            (true, true, _) if select => SWIGLU_I8_SEL[i],
            (false, false, true) => GEMV_D2[i],
            (false, false, _) => GEMV[i],
            (true, false, _) => SWIGLU[i],
            (false, true, _) => GEMV_I8[i],
            (true, true, _) => SWIGLU_I8[i],
        };
        let want = rows.div_ceil(16 * (8 / ks));
        let cap = (dev.resident_blocks(name, THREADS, smem as u32)? as usize / slots).max(1);
        Ok((name, want, cap))
    };
    let (mut name, mut want, mut cap) = launch(ks)?;
    // A chosen split whose blocks do not all fit at once leaves some blocks two tiles in series: half
    // the split (each block then takes twice the tiles, every warp twice the rounds, in one pass) while
    // that fits better. The MoE gate/up (9 slots of 32 tiles, 127 registers a thread: 29 blocks a slot
    // fit) goes from 8 to 4: +1–2% decode tok/s at 4K–128K (docs/PERF.md, 2026-12-05 tenth session).
    let mut k = ks;
    while want > cap && auto && k > 1 {
        k /= 2;
        (name, want, cap) = launch(k)?;
    }
    Ok((name, want.min(cap) as u32, smem as u32))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn forced_variants_name_each_form_and_split() {
        assert_eq!(Form::forced(9), Some(Form { ks: 1, int8: false, deep: false, select: false }));
        assert_eq!(Form::forced(12), Some(Form { ks: 8, int8: false, deep: false, select: false }));
        assert_eq!(Form::forced(14), Some(Form { ks: 2, int8: true, deep: false, select: false }));
        assert_eq!(Form::forced(19), Some(Form { ks: 4, int8: false, deep: true, select: false }));
        for v in [0, 8, 21, 100] {
            assert_eq!(Form::forced(v), None, "variant {v}");
        }
    }
}
