//! The model's weights, typed by the architecture and independent of the checkpoint format.
//!
//! Two checkpoint layouts load into the same [`ModelWeights`]:
//! - MLX affine-quantised (`language_model.model.*`, `switch_mlp.{gate,up,down}_proj` stacked
//!   experts, conv1d `[C,K,1]`, norms already folded to `1+w`);
//! - Hugging Face bf16 (`model.language_model.*` or `model.*`, fused `experts.gate_up_proj`,
//!   conv1d `[C,1,K]`, zero-centred norms that get `+1` here, except `linear_attn.norm`), quantised
//!   at load with MLX's own algorithm (so the bytes equal `mlx_lm.convert`'s) or kept in bf16.
//!
//! The reliable signal for "norms still zero-centred" is the conv1d layout (`qwen36-architecture.md`
//! §3.2, the double-shift pitfall), not the key names.

use std::path::Path;

use half::bf16;

use crate::affine::{quantize_bf16, AffineParams};
use crate::buf::{Buf, FloatBuf};
use crate::checkpoint::{Checkpoint, TensorRef};
use crate::config::{LayerKind, ModelConfig};
use crate::error::{Error, Result};

/// How a matrix is stored: affine-quantised, or dense floats.
#[derive(Clone, Debug)]
pub enum Storage {
    /// `packed`: `[count, rows, cols*bits/32]` u32 (LSB first); `scales`, `biases`: `[count, rows, cols/group]`.
    Affine { params: AffineParams, packed: Buf<u32>, scales: FloatBuf, biases: FloatBuf },
    /// `[count, rows, cols]`.
    Dense(FloatBuf),
}

/// A weight matrix `[rows(out), cols(in)]` (`y = x Wᵀ`), or a stack of `count` of them (experts).
#[derive(Clone, Debug)]
pub struct Matrix {
    pub count: usize,
    pub rows: usize,
    pub cols: usize,
    pub storage: Storage,
}

impl Matrix {
    pub fn affine_params(&self) -> Option<AffineParams> {
        match &self.storage {
            Storage::Affine { params, .. } => Some(*params),
            Storage::Dense(_) => None,
        }
    }
}

/// Gated DeltaNet mixer of one layer (`linear_attn.*`).
#[derive(Clone, Debug)]
pub struct GdnWeights {
    pub in_proj_qkv: Matrix, // [2·Hk·Dk + Hv·Dv, H]
    pub in_proj_z: Matrix,   // [Hv·Dv, H]
    pub in_proj_b: Matrix,   // [Hv, H]
    pub in_proj_a: Matrix,   // [Hv, H]
    pub conv1d: Vec<f32>,    // [C, K]; tap K-1 multiplies the current token
    pub dt_bias: Vec<f32>,   // [Hv]
    pub a_log: Vec<f32>,     // [Hv]
    pub norm: Vec<f32>,      // [Dv], a plain weight (never 1+w)
    pub out_proj: Matrix,    // [H, Hv·Dv]
}

/// Gated full attention of one layer (`self_attn.*`).
#[derive(Clone, Debug)]
pub struct AttnWeights {
    pub q_proj: Matrix,   // [heads·head_dim·(1+gate), H], per head [query | gate]
    pub k_proj: Matrix,   // [kv_heads·head_dim, H]
    pub v_proj: Matrix,   // [kv_heads·head_dim, H]
    pub o_proj: Matrix,   // [H, heads·head_dim]
    pub q_norm: Vec<f32>, // [head_dim], folded (1+w)
    pub k_norm: Vec<f32>, // [head_dim], folded (1+w)
}

#[derive(Clone, Debug)]
pub enum Mixer {
    Linear(GdnWeights),
    Full(AttnWeights),
}

/// Sparse MoE block (`mlp.*`).
#[derive(Clone, Debug)]
pub struct MoeWeights {
    pub router: Matrix,       // [E, H]
    pub gate_proj: Matrix,    // E × [I, H]
    pub up_proj: Matrix,      // E × [I, H]
    pub down_proj: Matrix,    // E × [H, I]
    pub shared: Option<DenseMlpWeights>,
    pub shared_gate: Option<Matrix>, // [1, H]
}

/// SwiGLU MLP: the shared expert, or the MLP of a dense model.
#[derive(Clone, Debug)]
pub struct DenseMlpWeights {
    pub gate_proj: Matrix, // [I, H]
    pub up_proj: Matrix,   // [I, H]
    pub down_proj: Matrix, // [H, I]
}

#[allow(clippy::large_enum_variant)] // one a layer, built once at load: the size difference costs nothing
#[derive(Clone, Debug)]
pub enum Mlp {
    Moe(MoeWeights),
    Dense(DenseMlpWeights),
}

#[derive(Clone, Debug)]
pub struct LayerWeights {
    pub input_norm: Vec<f32>, // [H], folded (1+w)
    pub post_norm: Vec<f32>,  // [H], folded (1+w)
    pub mixer: Mixer,
    pub mlp: Mlp,
}

/// Where the weights came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SourceFormat {
    MlxAffine,
    HfQuantizedAtLoad,
    HfDense,
}

#[derive(Clone, Debug)]
pub struct ModelWeights {
    pub config: ModelConfig,
    pub source: SourceFormat,
    pub embed: Matrix,          // [V, H]
    pub layers: Vec<LayerWeights>,
    pub final_norm: Vec<f32>,   // [H], folded (1+w)
    lm_head: Option<Matrix>,    // [V, H]; None when tied to the embedding
}

/// What to do with a Hugging Face bf16 checkpoint.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HfWeights {
    /// Quantise at load exactly as `mlx_lm.convert` does: these defaults, and 8-bit group-64 router
    /// gates; a matrix whose input dim is not a multiple of the group size stays dense.
    Quantize(AffineParams),
    /// Keep every matrix in bf16.
    KeepBf16,
}

#[derive(Clone, Copy, Debug)]
pub struct LoadOptions {
    pub hf: HfWeights,
}

impl Default for LoadOptions {
    fn default() -> Self {
        LoadOptions { hf: HfWeights::Quantize(AffineParams { bits: 4, group_size: 64 }) }
    }
}

impl ModelWeights {
    pub fn lm_head(&self) -> &Matrix {
        self.lm_head.as_ref().unwrap_or(&self.embed)
    }

    /// Loads `dir` (config.json + safetensors).
    pub fn load(dir: &Path, opts: &LoadOptions) -> Result<Self> {
        let config = ModelConfig::from_dir(dir)?;
        let ckpt = Checkpoint::open(dir)?;
        Self::from_checkpoint(config, &ckpt, opts)
    }

    pub fn from_checkpoint(config: ModelConfig, ckpt: &Checkpoint, opts: &LoadOptions) -> Result<Self> {
        let layout = Layout::detect(ckpt)?;
        let loader = Loader { cfg: &config, ckpt, layout, opts: *opts };
        let h = config.hidden_size;
        let raw_norms = loader.norms_are_zero_centred()?;

        let embed = loader.matrix("embed_tokens", &format!("{}embed_tokens", layout.text), 1, config.vocab_size, h)?;
        let lm_head = if config.tie_word_embeddings {
            None
        } else {
            Some(loader.matrix("lm_head", layout.head, 1, config.vocab_size, h)?)
        };
        let final_norm = loader.norm(&format!("{}norm.weight", layout.text), h, raw_norms)?;

        let mut layers = Vec::with_capacity(config.num_hidden_layers);
        for (l, kind) in config.layer_types.iter().enumerate() {
            let p = format!("{}layers.{l}.", layout.text);
            let mixer = match kind {
                LayerKind::LinearAttention => Mixer::Linear(loader.gdn(&p, l)?),
                LayerKind::FullAttention => Mixer::Full(loader.attention(&p, l, raw_norms)?),
            };
            let mlp = if config.num_experts > 0 {
                Mlp::Moe(loader.moe(&p, l)?)
            } else {
                Mlp::Dense(loader.dense_mlp(&format!("{p}mlp."), l, "mlp", config.intermediate_size)?)
            };
            layers.push(LayerWeights {
                input_norm: loader.norm(&format!("{p}input_layernorm.weight"), h, raw_norms)?,
                post_norm: loader.norm(&format!("{p}post_attention_layernorm.weight"), h, raw_norms)?,
                mixer,
                mlp,
            });
        }
        let source = match (layout.kind, opts.hf) {
            (LayoutKind::Mlx, _) => SourceFormat::MlxAffine,
            (LayoutKind::Hf, HfWeights::Quantize(_)) => SourceFormat::HfQuantizedAtLoad,
            (LayoutKind::Hf, HfWeights::KeepBf16) => SourceFormat::HfDense,
        };
        Ok(ModelWeights { config, source, embed, layers, final_norm, lm_head })
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum LayoutKind {
    Mlx,
    Hf,
}

/// Key prefixes of one checkpoint layout.
#[derive(Clone, Copy, Debug)]
struct Layout {
    kind: LayoutKind,
    /// Prefix of the text model's tensors, up to `embed_tokens` / `layers.N.` / `norm`.
    text: &'static str,
    head: &'static str,
}

impl Layout {
    fn detect(ckpt: &Checkpoint) -> Result<Self> {
        const CANDIDATES: [Layout; 4] = [
            Layout { kind: LayoutKind::Mlx, text: "language_model.model.", head: "language_model.lm_head" },
            Layout { kind: LayoutKind::Hf, text: "model.language_model.", head: "lm_head" },
            Layout { kind: LayoutKind::Hf, text: "model.", head: "lm_head" },
            Layout { kind: LayoutKind::Mlx, text: "model.", head: "lm_head" },
        ];
        for c in CANDIDATES {
            let embed = format!("{}embed_tokens", c.text);
            let quantized = ckpt.contains(&format!("{embed}.scales"));
            if ckpt.contains(&format!("{embed}.weight")) {
                // A plain `model.` prefix is MLX when its embedding is quantised or its experts are `switch_mlp`.
                if c.text == "model." {
                    let mlx = quantized || ckpt.names().any(|n| n.contains(".switch_mlp."));
                    if mlx != (c.kind == LayoutKind::Mlx) {
                        continue;
                    }
                }
                return Ok(c);
            }
        }
        Err(Error::MissingTensor {
            dir: ckpt.dir().to_path_buf(),
            name: "language_model.model.embed_tokens.weight (MLX) or model.language_model.embed_tokens.weight (Hugging Face)".into(),
        })
    }
}

struct Loader<'a> {
    cfg: &'a ModelConfig,
    ckpt: &'a Checkpoint,
    layout: Layout,
    opts: LoadOptions,
}

impl Loader<'_> {
    /// HF checkpoints store `w` for `(1+w)` norms; MLX conversions store `1+w`. The conv1d layout tells
    /// them apart: `[C,1,K]` is raw Hugging Face, `[C,K,1]` converted.
    fn norms_are_zero_centred(&self) -> Result<bool> {
        if let Some(l) = self.cfg.layer_types.iter().position(|k| *k == LayerKind::LinearAttention) {
            let name = format!("{}layers.{l}.linear_attn.conv1d.weight", self.layout.text);
            let t = self.ckpt.tensor(&name)?;
            let k = self.cfg.linear_conv_kernel_dim;
            let s = t.shape();
            if s.len() == 3 && s[1] == 1 && s[2] == k && k != 1 {
                return Ok(true);
            }
            if s.len() == 3 && s[1] == k && s[2] == 1 {
                return Ok(false);
            }
            return Err(shape_err(&t, &format!("[{}, 1, {k}] or [{}, {k}, 1]", self.cfg.linear_conv_dim(), self.cfg.linear_conv_dim())));
        }
        Ok(self.layout.kind == LayoutKind::Hf)
    }

    /// The path MLX gives a module in its quantisation overrides (`language_model.model.layers.0.mlp.gate`).
    fn mlx_path(&self, name: &str) -> String {
        let rest = name.strip_prefix(self.layout.text).map(|r| format!("language_model.model.{r}"));
        rest.unwrap_or_else(|| if name == self.layout.head { "language_model.lm_head".into() } else { name.to_string() })
    }

    /// `(group, bits)` for quantising a dense module at load, mirroring `mlx_lm` (`quantize_model` +
    /// qwen3_5's `quant_predicate`); None when it stays dense.
    fn at_load_params(&self, short: &str, cols: usize) -> Option<AffineParams> {
        let HfWeights::Quantize(p) = self.opts.hf else { return None };
        if self.layout.kind != LayoutKind::Hf || !cols.is_multiple_of(p.group_size) {
            return None;
        }
        if self.cfg.num_experts > 0 && (short == "mlp.gate" || short == "shared_expert_gate") {
            return Some(AffineParams { bits: 8, group_size: 64 });
        }
        Some(p)
    }

    fn vector(&self, name: &str, len: usize) -> Result<Vec<f32>> {
        let t = self.ckpt.tensor(name)?;
        if t.numel() != len || t.shape().len() != 1 {
            return Err(shape_err(&t, &format!("[{len}]")));
        }
        t.to_f32()
    }

    /// A `(1+w)` RMSNorm weight, folded.
    fn norm(&self, name: &str, len: usize, zero_centred: bool) -> Result<Vec<f32>> {
        let mut w = self.vector(name, len)?;
        if zero_centred {
            // Hugging Face computes (1 + w) in f32 from the stored weight: the same as adding 1 here.
            w.iter_mut().for_each(|x| *x += 1.0);
        }
        Ok(w)
    }

    /// A linear module `base` (`base.weight` [+ `.scales`, `.biases`]) of `count` × `[rows, cols]`.
    /// `short` names the module kind for the at-load quantisation rule.
    fn matrix(&self, short: &str, base: &str, count: usize, rows: usize, cols: usize) -> Result<Matrix> {
        let weight = self.ckpt.tensor(&format!("{base}.weight"))?;
        let lead: Vec<usize> = if count == 1 { vec![] } else { vec![count] };
        let scales_name = format!("{base}.scales");
        if self.ckpt.contains(&scales_name) {
            let scales = self.ckpt.tensor(&scales_name)?;
            let biases = self.ckpt.tensor(&format!("{base}.biases"))?;
            return self.affine(&weight, &scales, &biases, &lead, rows, cols, &self.mlx_path(base));
        }
        let want: Vec<usize> = lead.iter().copied().chain([rows, cols]).collect();
        weight.expect_shape(&want)?;
        if !weight.dtype().is_float() {
            return Err(weight.dtype_error("BF16, F16 or F32 (or U32 with .scales and .biases)"));
        }
        match self.at_load_params(short, cols) {
            Some(p) => Ok(quantized_matrix(&weight.to_bf16()?, count, rows, cols, p)),
            None => Ok(Matrix { count, rows, cols, storage: Storage::Dense(weight.float_buf()?) }),
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn affine(
        &self,
        weight: &TensorRef,
        scales: &TensorRef,
        biases: &TensorRef,
        lead: &[usize],
        rows: usize,
        cols: usize,
        mlx_path: &str,
    ) -> Result<Matrix> {
        let count = lead.first().copied().unwrap_or(1);
        let ws = weight.shape();
        let ss = scales.shape();
        let nd = lead.len() + 2;
        let words = *ws.last().unwrap_or(&0);
        let groups = *ss.last().unwrap_or(&0);
        let bits = if cols > 0 && (words * 32).is_multiple_of(cols) { (words * 32 / cols) as u32 } else { 0 };
        let group_size = if groups > 0 && cols.is_multiple_of(groups) { cols / groups } else { 0 };
        let prefix_ok = |s: &[usize]| s.len() == nd && s[..nd - 1] == lead.iter().copied().chain([rows]).collect::<Vec<_>>()[..];
        if !prefix_ok(ws) || ![4, 8].contains(&bits) {
            return Err(shape_err(weight, &format!("{:?} + [{rows}, {cols}·bits/32] with 4 or 8 bits", lead)));
        }
        if !prefix_ok(ss) || ![32, 64, 128].contains(&group_size) {
            return Err(shape_err(scales, &format!("{:?} + [{rows}, {cols}/group_size] with group size 32, 64 or 128", lead)));
        }
        if biases.shape() != ss {
            return Err(shape_err(biases, &format!("{ss:?} (the shape of its scales)")));
        }
        if let Some(q) = &self.cfg.quantization {
            if let Some((g, b)) = q.for_module(mlx_path) {
                if (g, b) != (group_size, bits) {
                    return Err(Error::Tensor {
                        path: weight.path().to_path_buf(),
                        name: weight.name().to_string(),
                        msg: format!(
                            "is quantised with {bits} bits, group size {group_size}, but config.json's quantization says {b} bits, group size {g}"
                        ),
                    });
                }
            }
        }
        Ok(Matrix {
            count,
            rows,
            cols,
            storage: Storage::Affine {
                params: AffineParams { bits, group_size },
                packed: weight.u32_buf()?,
                scales: scales.float_buf()?,
                biases: biases.float_buf()?,
            },
        })
    }

    fn gdn(&self, p: &str, _l: usize) -> Result<GdnWeights> {
        let c = self.cfg;
        let (h, hv, dv) = (c.hidden_size, c.linear_num_value_heads, c.linear_value_head_dim);
        let conv_dim = c.linear_conv_dim();
        let a = format!("{p}linear_attn.");
        if self.ckpt.contains(&format!("{a}in_proj_qkvz.weight")) {
            return Err(Error::Invalid(format!(
                "{}: `{a}in_proj_qkvz` is the Qwen3-Next fused layout; lily runs Qwen3.5/3.6 (separate in_proj_qkv/z/a/b)",
                self.ckpt.dir().display()
            )));
        }
        let conv = self.ckpt.tensor(&format!("{a}conv1d.weight"))?;
        if conv.numel() != conv_dim * c.linear_conv_kernel_dim {
            return Err(shape_err(&conv, &format!("[{conv_dim}, {k}, 1] or [{conv_dim}, 1, {k}]", k = c.linear_conv_kernel_dim)));
        }
        Ok(GdnWeights {
            in_proj_qkv: self.matrix("in_proj_qkv", &format!("{a}in_proj_qkv"), 1, conv_dim, h)?,
            in_proj_z: self.matrix("in_proj_z", &format!("{a}in_proj_z"), 1, c.linear_value_dim(), h)?,
            in_proj_b: self.matrix("in_proj_b", &format!("{a}in_proj_b"), 1, hv, h)?,
            in_proj_a: self.matrix("in_proj_a", &format!("{a}in_proj_a"), 1, hv, h)?,
            // [C,1,K] and [C,K,1] hold the taps in the same memory order: c·K + k.
            conv1d: conv.to_f32()?,
            dt_bias: self.vector(&format!("{a}dt_bias"), hv)?,
            a_log: self.vector(&format!("{a}A_log"), hv)?,
            norm: self.vector(&format!("{a}norm.weight"), dv)?,
            out_proj: self.matrix("out_proj", &format!("{a}out_proj"), 1, h, c.linear_value_dim())?,
        })
    }

    fn attention(&self, p: &str, _l: usize, raw_norms: bool) -> Result<AttnWeights> {
        let c = self.cfg;
        let (h, nh, kvh, hd) = (c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim);
        let a = format!("{p}self_attn.");
        let q_rows = nh * hd * if c.attn_output_gate { 2 } else { 1 };
        Ok(AttnWeights {
            q_proj: self.matrix("q_proj", &format!("{a}q_proj"), 1, q_rows, h)?,
            k_proj: self.matrix("k_proj", &format!("{a}k_proj"), 1, kvh * hd, h)?,
            v_proj: self.matrix("v_proj", &format!("{a}v_proj"), 1, kvh * hd, h)?,
            o_proj: self.matrix("o_proj", &format!("{a}o_proj"), 1, h, nh * hd)?,
            q_norm: self.norm(&format!("{a}q_norm.weight"), hd, raw_norms)?,
            k_norm: self.norm(&format!("{a}k_norm.weight"), hd, raw_norms)?,
        })
    }

    fn dense_mlp(&self, m: &str, _l: usize, short: &str, inter: usize) -> Result<DenseMlpWeights> {
        let h = self.cfg.hidden_size;
        Ok(DenseMlpWeights {
            gate_proj: self.matrix(short, &format!("{m}gate_proj"), 1, inter, h)?,
            up_proj: self.matrix(short, &format!("{m}up_proj"), 1, inter, h)?,
            down_proj: self.matrix(short, &format!("{m}down_proj"), 1, h, inter)?,
        })
    }

    fn moe(&self, p: &str, l: usize) -> Result<MoeWeights> {
        let c = self.cfg;
        let (h, e, i) = (c.hidden_size, c.num_experts, c.moe_intermediate_size);
        let m = format!("{p}mlp.");
        let router = self.matrix("mlp.gate", &format!("{m}gate"), 1, e, h)?;
        let (gate_proj, up_proj, down_proj) = if self.ckpt.contains(&format!("{m}experts.gate_up_proj")) {
            self.hf_experts(&m)?
        } else {
            (
                self.matrix("switch_mlp", &format!("{m}switch_mlp.gate_proj"), e, i, h)?,
                self.matrix("switch_mlp", &format!("{m}switch_mlp.up_proj"), e, i, h)?,
                self.matrix("switch_mlp", &format!("{m}switch_mlp.down_proj"), e, h, i)?,
            )
        };
        let (shared, shared_gate) = if c.shared_expert_intermediate_size > 0 {
            (
                Some(self.dense_mlp(&format!("{m}shared_expert."), l, "shared_expert", c.shared_expert_intermediate_size)?),
                Some(self.matrix("shared_expert_gate", &format!("{m}shared_expert_gate"), 1, 1, h)?),
            )
        } else {
            (None, None)
        };
        Ok(MoeWeights { router, gate_proj, up_proj, down_proj, shared, shared_gate })
    }

    /// Hugging Face's fused experts: `gate_up_proj` [E, 2I, H] (rows 0..I gate, I..2I up) and
    /// `down_proj` [E, H, I], no `.weight` suffix.
    fn hf_experts(&self, m: &str) -> Result<(Matrix, Matrix, Matrix)> {
        let c = self.cfg;
        let (h, e, i) = (c.hidden_size, c.num_experts, c.moe_intermediate_size);
        let gu = self.ckpt.tensor(&format!("{m}experts.gate_up_proj"))?;
        gu.expect_shape(&[e, 2 * i, h])?;
        let down = self.ckpt.tensor(&format!("{m}experts.down_proj"))?;
        down.expect_shape(&[e, h, i])?;
        let gu = gu.to_bf16()?;
        let (mut gate, mut up) = (Vec::with_capacity(e * i * h), Vec::with_capacity(e * i * h));
        for x in 0..e {
            let base = x * 2 * i * h;
            gate.extend_from_slice(&gu[base..base + i * h]);
            up.extend_from_slice(&gu[base + i * h..base + 2 * i * h]);
        }
        let make = |w: Vec<bf16>, rows: usize, cols: usize| match self.at_load_params("switch_mlp", cols) {
            Some(p) => quantized_matrix(&w, e, rows, cols, p),
            None => Matrix { count: e, rows, cols, storage: Storage::Dense(FloatBuf::Bf16(Buf::owned(w))) },
        };
        Ok((make(gate, i, h), make(up, i, h), make(down.to_bf16()?, h, i)))
    }
}

fn quantized_matrix(w: &[bf16], count: usize, rows: usize, cols: usize, p: AffineParams) -> Matrix {
    let q = quantize_bf16(w, cols, p);
    Matrix {
        count,
        rows,
        cols,
        storage: Storage::Affine {
            params: p,
            packed: Buf::owned(q.packed),
            scales: FloatBuf::Bf16(Buf::owned(q.scales)),
            biases: FloatBuf::Bf16(Buf::owned(q.biases)),
        },
    }
}

fn shape_err(t: &TensorRef, expected: &str) -> Error {
    Error::TensorShape {
        path: t.path().to_path_buf(),
        name: t.name().to_string(),
        expected: expected.to_string(),
        found: t.shape().to_vec(),
    }
}
