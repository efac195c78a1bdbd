//! Random checkpoints in the MLX affine layout (`lily synth`): the files `mlx_lm.convert -q` writes for a
//! Qwen3.5/3.6 MoE model, with random weights, generated and written tensor by tensor (bounded memory:
//! two 8 MiB buffers; the next chunk is generated while the current one is written).
//!
//! Output directory:
//! - `config.json`: the given config as `mlx_lm.convert` saves it: `vision_config` dropped, the
//!   generation config's `eos_token_id` copied to the top level, `quantization` and an identical
//!   `quantization_config` added (per-layer 8-bit overrides for the routers), top-level keys sorted,
//!   4-space indent, Python float spelling, and mlx-lm's in-place rename of
//!   `rope_parameters.rope_type` to `type`. For the same input config this is byte-identical to
//!   what mlx-lm 0.32 writes (checked against a converted tiny Hugging Face model);
//! - `generation_config.json` (Qwen3.6's), `tokenizer.json` (the real Qwen3.5/3.6 tokenizer, or,
//!   for a smaller vocabulary, that tokenizer cut down to it: see `synth_tokenizer`; the eos, bos
//!   and pad ids of both configs then name its control tokens), `tokenizer_config.json` (no BOS,
//!   eos `<|im_end|>`, pad `<|endoftext|>`, `Qwen2Tokenizer`);
//! - `model.safetensors` or `model-0000i-of-0000n.safetensors` (5 digits, as mlx-lm), each header
//!   sorted by name with `{"format": "mlx"}` metadata, and `model.safetensors.index.json` (always
//!   written, like mlx-lm; its `total_size` and `total_parameters` count as mlx-lm does).
//!
//! Tensor names, shapes and dtypes are those of mlx-lm's `qwen3_5_moe` model after quantisation with its
//! `quant_predicate` (router `mlp.gate` and `mlp.shared_expert_gate` at 8 bits, group 64; modules whose
//! input dim is not a multiple of the group size stay bf16; conv1d `[C, K, 1]`; `A_log` f32; norms
//! bf16, already in the `1 + w` form), checked by `tools/check_synth_mlx.py`.
//!
//! Values: every quantised matrix gets uniform random codes, per-group bf16 scales spread over half an
//! octave either side of `std / sqrt((4^bits - 1) / 12)` and biases `≈ -scale · (2^bits - 1) / 2` plus a
//! small random per-group offset, so each matrix has mean ≈ 0 and std ≈ its target (1/√fan_in mostly),
//! and per-group scale/bias indexing matters. See [`Law`] for the tuning (residual branches scaled by
//! 1/√layers, decisive routers, an lm_head partly tied to the embedding so each position has a clear
//! top token). Randomness is counter-based (splitmix64 of a per-tensor key and the element index), so
//! output is a pure function of (config, seed, bits, group size), whatever the thread count or sharding.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

use half::bf16;
use rayon::prelude::*;
use serde_json::{json, Map, Value};

use crate::config::{LayerKind, ModelConfig};
use crate::error::{Error, Result};
pub use crate::synth_tokenizer::SynthTokenizer;

/// What to synthesise, and where.
#[derive(Clone, Debug)]
pub struct SynthOptions {
    /// A Hugging Face form `config.json`: the multimodal wrapper with `text_config`, or a plain text config.
    pub config: Value,
    pub out: PathBuf,
    pub seed: u64,
    /// Default bits and group size (4, 64); the routers always get 8 bits, group 64 (as mlx-lm does).
    pub bits: u32,
    pub group_size: usize,
    /// Largest shard (mlx-lm: 5 GiB); one tensor larger than this gets a shard of its own.
    pub max_shard_bytes: u64,
    /// How unevenly the routers favour their experts, as trained routers do (0: evenly). Expert e's
    /// router row is scaled by `(1 + router_skew)^(1 - rank(e)/E)`, ranks a seeded permutation per
    /// layer: its logits spread wider, so it lands in the top k more often (see [`router_gain`]).
    pub router_skew: f32,
}

impl SynthOptions {
    /// 4-bit, group 64, seed 0, 5 GiB shards, even routing.
    pub fn new(config: Value, out: impl Into<PathBuf>) -> Self {
        SynthOptions { config, out: out.into(), seed: 0, bits: 4, group_size: 64, max_shard_bytes: 5 << 30, router_skew: 0.0 }
    }
}

/// The gain [`SynthOptions::router_skew`] gives the router row of expert `e` of `experts` in the layer
/// whose router is keyed `key` (a bijection of ranks: one expert has the full `1 + skew`, the others
/// spread geometrically down to 1).
pub fn router_gain(key: u64, e: u64, experts: u64, skew: f32) -> f32 {
    if skew <= 0.0 || experts == 0 {
        return 1.0;
    }
    let mut a = (rand(key, u64::MAX - 2) % experts).max(1) | 1;
    while gcd(a, experts) != 1 {
        a += 2;
    }
    let rank = RowPerm { rows: experts, a, b: rand(key, u64::MAX - 3) % experts }.apply(e);
    (1.0 + skew).powf(1.0 - rank as f32 / experts as f32)
}

/// What was written.
#[derive(Clone, Debug)]
pub struct SynthReport {
    /// Bytes of all files written (weights, configs, tokenizer).
    pub bytes: u64,
    /// Bytes of tensor data (the index's `total_size`).
    pub tensor_bytes: u64,
    pub tensors: usize,
    /// Parameters as mlx-lm counts them (a quantised matrix counts its unpacked elements).
    pub parameters: u64,
    /// File names in `out`.
    pub files: Vec<String>,
    pub tokenizer: SynthTokenizer,
}

const BUILTINS: &[&str] = &["qwen3.6-35b-a3b", "qwen3.6-tiny"];

/// Names accepted by [`builtin_config`].
pub fn builtin_names() -> &'static [&'static str] {
    BUILTINS
}

/// A built-in Hugging Face `config.json`:
/// - `qwen3.6-35b-a3b`: Qwen/Qwen3.6-35B-A3B (`qwen36-architecture.md` §1.1);
/// - `qwen3.6-tiny`: a small demo model with the real vocabulary (so the real tokenizer works) and the
///   real per-head shapes (head_dim 256, GDN heads 128 wide, 64 rotary dims), hidden 256, 8 layers
///   (3 GDN : 1 full), 16 experts top-4, expert width 128, shared expert 192 (all dims distinct, so a
///   transposed or swapped matrix cannot go unnoticed).
pub fn builtin_config(name: &str) -> Option<Value> {
    match name {
        "qwen3.6-35b-a3b" => Some(qwen36_35b_a3b()),
        "qwen3.6-tiny" => Some(qwen36_tiny()),
        _ => None,
    }
}

fn layer_types(n: usize, interval: usize) -> Value {
    Value::Array(
        (0..n)
            .map(|i| Value::from(if (i + 1) % interval == 0 { "full_attention" } else { "linear_attention" }))
            .collect(),
    )
}

fn qwen36_35b_a3b() -> Value {
    // Built in pieces: one json! this size exceeds the default macro recursion limit.
    let mut text = json!({
        "attention_bias": false,
        "attention_dropout": 0.0,
        "attn_output_gate": true,
        "bos_token_id": 248044,
        "dtype": "bfloat16",
        "eos_token_id": 248044,
        "full_attention_interval": 4,
        "head_dim": 256,
        "hidden_act": "silu",
        "hidden_size": 2048,
        "initializer_range": 0.02,
        "layer_types": layer_types(40, 4),
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        "linear_value_head_dim": 128,
        "max_position_embeddings": 262144,
        "model_type": "qwen3_5_moe_text",
        "moe_intermediate_size": 512,
        "mtp_num_hidden_layers": 1,
        "mtp_use_dedicated_embeddings": false
    });
    let rest = json!({
        "num_attention_heads": 16,
        "num_experts": 256,
        "num_experts_per_tok": 8,
        "num_hidden_layers": 40,
        "num_key_value_heads": 2,
        "output_router_logits": false,
        "pad_token_id": null,
        "rms_norm_eps": 1e-6,
        "router_aux_loss_coef": 0.001,
        "shared_expert_intermediate_size": 512,
        "tie_word_embeddings": false,
        "use_cache": true,
        "vocab_size": 248320,
        "mamba_ssm_dtype": "float32",
        "rope_parameters": {
            "mrope_interleaved": true,
            "mrope_section": [11, 11, 10],
            "rope_type": "default",
            "rope_theta": 10000000,
            "partial_rotary_factor": 0.25
        }
    });
    let t = text.as_object_mut().unwrap();
    for (k, v) in rest.as_object().unwrap() {
        t.insert(k.clone(), v.clone());
    }
    let vision = json!({
        "deepstack_visual_indexes": [],
        "depth": 27,
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_size": 1152,
        "in_channels": 3,
        "initializer_range": 0.02,
        "intermediate_size": 4304,
        "model_type": "qwen3_5_moe",
        "num_heads": 16,
        "num_position_embeddings": 2304,
        "out_hidden_size": 2048,
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2
    });
    json!({
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "image_token_id": 248056,
        "model_type": "qwen3_5_moe",
        "text_config": text,
        "tie_word_embeddings": false,
        "transformers_version": "4.57.1",
        "video_token_id": 248057,
        "vision_config": vision,
        "vision_end_token_id": 248054,
        "vision_start_token_id": 248053
    })
}

fn qwen36_tiny() -> Value {
    let mut c = qwen36_35b_a3b();
    let t = c["text_config"].as_object_mut().unwrap();
    for (k, v) in [
        ("hidden_size", json!(256)),
        ("num_hidden_layers", json!(8)),
        ("layer_types", layer_types(8, 4)),
        ("num_attention_heads", json!(8)),
        ("num_key_value_heads", json!(2)),
        ("linear_num_key_heads", json!(4)),
        ("linear_num_value_heads", json!(8)),
        ("num_experts", json!(16)),
        ("num_experts_per_tok", json!(4)),
        ("moe_intermediate_size", json!(128)),
        ("shared_expert_intermediate_size", json!(192)),
    ] {
        t.insert(k.into(), v);
    }
    c.as_object_mut().unwrap().remove("vision_config");
    c
}

/// Qwen3.6's `generation_config.json`, with the ids of `<|im_end|>` and `<|endoftext|>` given
/// (248046 and 248044 in the real tokenizer).
fn generation_config(im_end: u32, endoftext: u32) -> Value {
    json!({
        "bos_token_id": endoftext,
        "do_sample": true,
        "eos_token_id": [im_end, endoftext],
        "pad_token_id": endoftext,
        "temperature": 1.0,
        "top_k": 20,
        "top_p": 0.95
    })
}

fn tokenizer_config() -> Value {
    json!({
        "add_bos_token": false,
        "add_prefix_space": false,
        "bos_token": null,
        "clean_up_tokenization_spaces": false,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 262144,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": false,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": null
    })
}


// ---------------------------------------------------------------------------------------------
// Counter-based randomness.

const GAMMA: u64 = 0x9e37_79b9_7f4a_7c15;

#[inline]
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The `i`-th output of the splitmix64 stream keyed by `key`.
#[inline]
fn rand(key: u64, i: u64) -> u64 {
    mix(key.wrapping_add(i.wrapping_add(1).wrapping_mul(GAMMA)))
}

/// Uniform in [0, 1) from 24 bits.
#[inline]
fn unit24(x: u32) -> f32 {
    (x >> 8) as f32 * (1.0 / 16_777_216.0)
}

/// A standard normal from one 64-bit draw (Box–Muller on its two halves).
#[inline]
fn normal(x: u64) -> f32 {
    let u1 = ((x >> 40) as f32 + 0.5) * (1.0 / 16_777_216.0); // (0, 1)
    let u2 = unit24(x as u32);
    (-2.0 * u1.ln()).sqrt() * (std::f32::consts::TAU * u2).cos()
}

fn tensor_key(seed: u64, name: &str) -> u64 {
    // FNV-1a of the name, mixed with the seed.
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in name.bytes() {
        h = (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3);
    }
    mix(mix(seed ^ 0x5eed_5eed_5eed_5eed).wrapping_add(h))
}

// ---------------------------------------------------------------------------------------------
// The plan: every tensor, its dtype and shape, and how its values are drawn.

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum DType {
    U32,
    BF16,
    F32,
}

impl DType {
    fn size(self) -> usize {
        match self {
            DType::U32 | DType::F32 => 4,
            DType::BF16 => 2,
        }
    }
    fn name(self) -> &'static str {
        match self {
            DType::U32 => "U32",
            DType::BF16 => "BF16",
            DType::F32 => "F32",
        }
    }
}

/// Per-group scale/bias of a quantised module (shared by its `.scales` and `.biases`).
#[derive(Clone, Copy, Debug)]
struct GroupLaw {
    key: u64,
    /// Scale giving the target std before the per-group spread: `std / code_std`.
    scale0: f32,
    /// Middle code, `(2^bits - 1) / 2`.
    mid: f32,
    /// Largest per-group mean offset, in units of the scale: 0.2 std.
    offset: f32,
    /// A skewed router: (groups per row, rows, skew); row r's scales times [`router_gain`].
    skew: Option<(u64, u64, f32)>,
}

/// `2^((i + 0.5) / 256 - 0.5)`, i < 256: per-group scale multipliers spread over ±half an octave.
fn spread_table() -> &'static [f32; 256] {
    static T: std::sync::OnceLock<[f32; 256]> = std::sync::OnceLock::new();
    T.get_or_init(|| std::array::from_fn(|i| ((i as f64 + 0.5) / 256.0 - 0.5).exp2() as f32))
}

impl GroupLaw {
    /// Dequantised weights with mean ≈ 0 and std ≈ `std` (uniform codes, scales spread ±½ octave).
    fn new(key: u64, bits: u32, std: f32) -> Self {
        let levels = (1u64 << bits) as f32;
        let code_std = ((levels * levels - 1.0) / 12.0).sqrt();
        GroupLaw { key, scale0: std / code_std, mid: (levels - 1.0) * 0.5, offset: 0.2 * code_std, skew: None }
    }

    /// The (bf16) scale and bias of flat group `g`; `spread` is [`spread_table`].
    #[inline]
    fn group(&self, g: u64, spread: &[f32; 256]) -> (bf16, bf16) {
        let r = rand(self.key, g);
        let gain = match self.skew {
            Some((per_row, rows, skew)) => router_gain(self.key, (g / per_row) % rows, rows, skew),
            None => 1.0,
        };
        let scale = bf16::from_f32(self.scale0 * gain * spread[(r & 0xff) as usize]);
        let s = scale.to_f32();
        // Zero mean on average; a per-group offset of up to ±0.2 std keeps biases honest.
        let u = unit24((r >> 32) as u32) * 2.0 - 1.0;
        let bias = bf16::from_f32(s * (u * self.offset - self.mid));
        (scale, bias)
    }
}

/// Codes of row `j` that copy, element by element with probability `p`, the codes of row `π(j)` of
/// another matrix of the same shape (`π(j) = (a·j + b) mod rows`, a bijection): the two matrices'
/// rows are then correlated with coefficient ≈ `p`. lm_head copies the embedding this way, which
/// gives the random model a "bigram" preference (the token after `t` tends to be `π⁻¹(t)`) with a
/// clear margin, robust to rounding noise.
#[derive(Clone, Copy, Debug)]
struct CodeCopy {
    src_key: u64,
    words_per_row: u64,
    perm: RowPerm,
    /// Per-code copy threshold out of 256.
    threshold: u32,
    bits: u32,
    mix_key: u64,
}

impl CodeCopy {
    #[inline]
    fn word(&self, w: u64, own: u32) -> u32 {
        let (row, col) = (w / self.words_per_row, w % self.words_per_row);
        let sw = self.perm.apply(row) * self.words_per_row + col;
        let src = (rand(self.src_key, sw >> 1) >> ((sw & 1) * 32)) as u32;
        let pick = rand(self.mix_key, w);
        let per_word = 32 / self.bits;
        let mut mask = 0u32;
        for k in 0..per_word {
            if ((pick >> (8 * k)) & 0xff) < self.threshold as u64 {
                mask |= ((1u32 << self.bits) - 1) << (k * self.bits);
            }
        }
        (src & mask) | (own & !mask)
    }
}

/// A row bijection `j → (a·j + b) mod rows` (`a` coprime with `rows`).
#[derive(Clone, Copy, Debug)]
struct RowPerm {
    rows: u64,
    a: u64,
    b: u64,
}

impl RowPerm {
    #[inline]
    fn apply(&self, j: u64) -> u64 {
        ((self.a as u128 * j as u128 + self.b as u128) % self.rows as u128) as u64
    }
}

/// The bf16 counterpart of [`CodeCopy`]: element `(j, i)` is `c·z(π(j), i) + √(1-c²)·z'(j, i)`
/// (standard normals of the source's and its own stream), times the std, plus the mean.
#[derive(Clone, Copy, Debug)]
struct NormalTie {
    src_key: u64,
    cols: u64,
    perm: RowPerm,
    c: f32,
}

#[derive(Clone, Copy, Debug)]
enum Fill {
    /// Uniform random u32 words (codes), optionally partly copied from another matrix.
    Codes {
        key: u64,
        copy: Option<CodeCopy>,
    },
    Scales(GroupLaw),
    Biases(GroupLaw),
    /// bf16 N(mean, std), optionally correlated row by row with another matrix.
    Normal {
        key: u64,
        mean: f32,
        std: f32,
        tie: Option<NormalTie>,
    },
    /// f32 ln(U(lo, hi)).
    LogUniform {
        key: u64,
        lo: f32,
        hi: f32,
    },
}

#[derive(Clone, Debug)]
struct TensorPlan {
    name: String,
    dtype: DType,
    shape: Vec<usize>,
    fill: Fill,
}

impl TensorPlan {
    fn numel(&self) -> usize {
        self.shape.iter().product()
    }
    fn nbytes(&self) -> u64 {
        (self.numel() * self.dtype.size()) as u64
    }
}

struct Planner {
    seed: u64,
    bits: u32,
    group_size: usize,
    tensors: Vec<TensorPlan>,
    /// `quantization` overrides (module path → {group_size, bits}), in module order.
    overrides: Vec<(String, u32, usize)>,
    parameters: u64,
}

impl Planner {
    fn normal(&mut self, name: String, shape: Vec<usize>, mean: f32, std: f32) {
        let key = tensor_key(self.seed, &name);
        self.parameters += shape.iter().product::<usize>() as u64;
        self.tensors.push(TensorPlan {
            name,
            dtype: DType::BF16,
            shape,
            fill: Fill::Normal { key, mean, std, tie: None },
        });
    }

    /// `A_log` (f32). Like `dt_bias`, a direct parameter of the GDN module, which mlx-lm's
    /// `get_total_parameters` (leaf modules only) does not count.
    fn a_log(&mut self, name: String, n: usize) {
        let key = tensor_key(self.seed, &name);
        self.tensors.push(TensorPlan {
            name,
            dtype: DType::F32,
            shape: vec![n],
            fill: Fill::LogUniform { key, lo: 1.0, hi: 16.0 },
        });
    }

    /// Correlates each row `j` of `dst` with row `π(j)` of `src` (same shape, a seeded bijection `π`)
    /// with coefficient ≈ `p`: quantised, by copying a fraction `p` of the codes; in bf16, by mixing
    /// the standard normals. No-op when they are stored differently.
    fn tie_rows(&mut self, src: &str, dst: &str, p: f32) {
        let find = |name: &str| self.tensors.iter().position(|t| t.name == name);
        let (Some(si), Some(di)) = (find(&format!("{src}.weight")), find(&format!("{dst}.weight"))) else { return };
        let (s, d) = (&self.tensors[si], &self.tensors[di]);
        if s.shape != d.shape || s.dtype != d.dtype || p <= 0.0 {
            return;
        }
        let rows = d.shape[0] as u64;
        let cols = d.shape[1] as u64;
        let perm_key = match d.fill {
            Fill::Codes { key, .. } | Fill::Normal { key, .. } => key,
            _ => return,
        };
        let mut a = (rand(perm_key, u64::MAX) % rows).max(1) | 1;
        while gcd(a, rows) != 1 {
            a += 2;
        }
        let perm = RowPerm { rows, a, b: rand(perm_key, u64::MAX - 1) % rows };
        self.tensors[di].fill = match (s.fill, d.fill) {
            (Fill::Codes { key: src_key, .. }, Fill::Codes { key, .. }) => Fill::Codes {
                key,
                copy: Some(CodeCopy {
                    src_key,
                    words_per_row: cols,
                    perm,
                    threshold: (p.clamp(0.0, 1.0) * 256.0).round() as u32,
                    // Both use the default parameters (neither is a router).
                    bits: self.bits,
                    mix_key: mix(key ^ 0xc0de_c0de_c0de_c0de),
                }),
            },
            (Fill::Normal { key: src_key, .. }, Fill::Normal { key, mean, std, .. }) => {
                Fill::Normal { key, mean, std, tie: Some(NormalTie { src_key, cols, perm, c: p.clamp(0.0, 1.0) }) }
            }
            (_, f) => f,
        };
    }

    /// Scales row r of the quantised module `path` ([rows, inp], no stack) by [`router_gain`] (its
    /// scales and biases together, so each row keeps its shape and its std grows by the gain).
    fn skew_rows(&mut self, path: &str, skew: f32) {
        for t in self.tensors.iter_mut().filter(|t| t.name == format!("{path}.scales") || t.name == format!("{path}.biases")) {
            if let (Fill::Scales(law) | Fill::Biases(law), [rows, groups]) = (&mut t.fill, t.shape.as_slice()) {
                law.skew = Some((*groups as u64, *rows as u64, skew));
            }
        }
    }

    /// A linear (or embedding) module `path` with weight `[lead.., out, inp]`, quantised as mlx-lm does:
    /// unquantised if `inp` is not a multiple of the default group size, else at `special`
    /// (recorded as an override) or the default.
    fn module(
        &mut self,
        path: &str,
        lead: &[usize],
        out: usize,
        inp: usize,
        std: f32,
        special: Option<(u32, usize)>,
    ) -> Result<()> {
        let mut shape: Vec<usize> = lead.to_vec();
        shape.push(out);
        if !inp.is_multiple_of(self.group_size) {
            shape.push(inp);
            self.normal(format!("{path}.weight"), shape, 0.0, std);
            return Ok(());
        }
        let (bits, gs) = special.unwrap_or((self.bits, self.group_size));
        if !inp.is_multiple_of(gs) {
            return Err(Error::Invalid(format!(
                "{path}: input dim {inp} is a multiple of the group size {} but not of {gs}, which mlx-lm uses for this module",
                self.group_size
            )));
        }
        if special.is_some() {
            self.overrides.push((path.to_string(), bits, gs));
        }
        self.parameters += (shape.iter().product::<usize>() * inp) as u64;
        let key = tensor_key(self.seed, path);
        let law = GroupLaw::new(key, bits, std);
        let mut wshape = shape.clone();
        wshape.push(inp * bits as usize / 32);
        let mut sshape = shape;
        sshape.push(inp / gs);
        let wkey = tensor_key(self.seed, &format!("{path}.weight"));
        self.tensors.push(TensorPlan {
            name: format!("{path}.weight"),
            dtype: DType::U32,
            shape: wshape,
            fill: Fill::Codes { key: wkey, copy: None },
        });
        self.tensors.push(TensorPlan {
            name: format!("{path}.scales"),
            dtype: DType::BF16,
            shape: sshape.clone(),
            fill: Fill::Scales(law),
        });
        self.tensors.push(TensorPlan {
            name: format!("{path}.biases"),
            dtype: DType::BF16,
            shape: sshape,
            fill: Fill::Biases(law),
        });
        Ok(())
    }
}

/// The random model's value laws. Tuned with `tools/check_synth_mlx.py` on `qwen3.6-tiny` and on a
/// 40-layer variant of it, comparing mlx-lm in f32 against the same forward pass with the residual
/// stream and every branch output rounded to bf16 (what a bf16 engine does):
/// - residual branches scaled by `out_c / √layers`, so the layers together add about 40% to the
///   embedding's energy whatever the depth, and perturbations are not amplified much (relative
///   error ≈ 2% after 40 bf16-rounded layers, ≈ 0.9% after 8: essentially the rounding itself);
/// - routers at logit std 4, so the renormalised weight of the k-th expert is small and a near-tie
///   in routing moves the output little;
/// - lm_head at logit std 3, with 8/√hidden of its codes (half, at hidden 256) copied from the
///   embedding row of a "bigram" partner token: the top token has a clear margin (median top-1
///   probability ≈ 0.85, top-1/top-2 gap ≈ 4 logits) and bf16-rounded vs f32 agree on ≥ 99% of
///   top-1 tokens at 40 layers. Without the copy (purely random features) agreement drops to
///   ≈ 97.5%: the top-1 margin of random logits over 248k tokens is thin. The partner wins at
///   ≈ 90% of positions; elsewhere the layers decide.
/// - Tied embeddings: the embedding doubles as lm_head, so it gets lm_head's std (and the residual
///   branches shrink with it); the current token then tends to win (a tied random model copies).
#[derive(Clone, Copy, Debug)]
struct Law {
    /// Embedding rows (the residual stream starts at unit RMS).
    embed_std: f32,
    /// lm_head std × √hidden: the logit std for a unit-RMS final hidden state.
    lm_head_gain: f32,
    /// Fraction of lm_head codes copied from the embedding row of the bigram partner, × √hidden
    /// (the partner's logit margin grows as copy·√hidden; this keeps it at ≈ 20 logits).
    lm_head_copy_c: f32,
    /// Router std × √hidden: router logit std.
    router_gain: f32,
    /// Residual-branch output projections (out_proj, o_proj, down_proj): std × √fan_in × √layers.
    out_c: f32,
    /// Norm weights: N(1, norm_std).
    norm_std: f32,
    /// conv1d taps: N(0, conv_std).
    conv_std: f32,
    /// dt_bias: N(1, dt_bias_std).
    dt_bias_std: f32,
}

const LAW: Law = Law {
    embed_std: 1.0,
    lm_head_gain: 3.0,
    lm_head_copy_c: 8.0,
    router_gain: 4.0,
    out_c: 0.8,
    norm_std: 0.05,
    conv_std: 0.5,
    dt_bias_std: 0.1,
};

fn plan(cfg: &ModelConfig, seed: u64, bits: u32, group_size: usize, router_skew: f32) -> Result<Planner> {
    let mut p = Planner { seed, bits, group_size, tensors: Vec::new(), overrides: Vec::new(), parameters: 0 };
    let h = cfg.hidden_size;
    let inv = |n: usize| 1.0 / (n as f32).sqrt();
    let m = "language_model.model";
    let law = LAW;
    let embed_std = if cfg.tie_word_embeddings { law.lm_head_gain * inv(h) } else { law.embed_std };
    let out_gain = embed_std * law.out_c / (cfg.num_hidden_layers as f32).sqrt();
    p.module(&format!("{m}.embed_tokens"), &[], cfg.vocab_size, h, embed_std, None)?;
    let moe_special = Some((8u32, 64usize));
    for l in 0..cfg.num_hidden_layers {
        let lp = format!("{m}.layers.{l}");
        p.normal(format!("{lp}.input_layernorm.weight"), vec![h], 1.0, law.norm_std);
        match cfg.layer_types[l] {
            LayerKind::LinearAttention => {
                let a = format!("{lp}.linear_attn");
                let (hv, dv) = (cfg.linear_num_value_heads, cfg.linear_value_head_dim);
                let conv = cfg.linear_conv_dim();
                p.a_log(format!("{a}.A_log"), hv);
                p.normal(format!("{a}.conv1d.weight"), vec![conv, cfg.linear_conv_kernel_dim, 1], 0.0, law.conv_std);
                p.normal(format!("{a}.dt_bias"), vec![hv], 1.0, law.dt_bias_std);
                p.parameters -= hv as u64; // not in a leaf module: mlx-lm does not count it
                p.module(&format!("{a}.in_proj_a"), &[], hv, h, inv(h), None)?;
                p.module(&format!("{a}.in_proj_b"), &[], hv, h, inv(h), None)?;
                p.module(&format!("{a}.in_proj_qkv"), &[], conv, h, inv(h), None)?;
                p.module(&format!("{a}.in_proj_z"), &[], hv * dv, h, inv(h), None)?;
                p.normal(format!("{a}.norm.weight"), vec![dv], 1.0, law.norm_std);
                p.module(&format!("{a}.out_proj"), &[], h, hv * dv, out_gain * inv(hv * dv), None)?;
            }
            LayerKind::FullAttention => {
                let a = format!("{lp}.self_attn");
                let (nh, nkv, hd) = (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim);
                p.module(&format!("{a}.k_proj"), &[], nkv * hd, h, inv(h), None)?;
                p.normal(format!("{a}.k_norm.weight"), vec![hd], 1.0, law.norm_std);
                p.module(&format!("{a}.o_proj"), &[], h, nh * hd, out_gain * inv(nh * hd), None)?;
                p.module(&format!("{a}.q_proj"), &[], nh * hd * 2, h, inv(h), None)?;
                p.normal(format!("{a}.q_norm.weight"), vec![hd], 1.0, law.norm_std);
                p.module(&format!("{a}.v_proj"), &[], nkv * hd, h, inv(h), None)?;
            }
        }
        let mp = format!("{lp}.mlp");
        if cfg.num_experts > 0 {
            let (e, i, s) = (cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size);
            p.module(&format!("{mp}.gate"), &[], e, h, law.router_gain * inv(h), moe_special)?;
            if router_skew > 0.0 {
                p.skew_rows(&format!("{mp}.gate"), router_skew);
            }
            p.module(&format!("{mp}.shared_expert.down_proj"), &[], h, s, out_gain * inv(s), None)?;
            p.module(&format!("{mp}.shared_expert.gate_proj"), &[], s, h, inv(h), None)?;
            p.module(&format!("{mp}.shared_expert.up_proj"), &[], s, h, inv(h), None)?;
            p.module(&format!("{mp}.shared_expert_gate"), &[], 1, h, inv(h), moe_special)?;
            p.module(&format!("{mp}.switch_mlp.down_proj"), &[e], h, i, out_gain * inv(i), None)?;
            p.module(&format!("{mp}.switch_mlp.gate_proj"), &[e], i, h, inv(h), None)?;
            p.module(&format!("{mp}.switch_mlp.up_proj"), &[e], i, h, inv(h), None)?;
        } else {
            let i = cfg.intermediate_size;
            p.module(&format!("{mp}.down_proj"), &[], h, i, out_gain * inv(i), None)?;
            p.module(&format!("{mp}.gate_proj"), &[], i, h, inv(h), None)?;
            p.module(&format!("{mp}.up_proj"), &[], i, h, inv(h), None)?;
        }
        p.normal(format!("{lp}.post_attention_layernorm.weight"), vec![h], 1.0, law.norm_std);
    }
    p.normal(format!("{m}.norm.weight"), vec![h], 1.0, law.norm_std);
    if !cfg.tie_word_embeddings {
        p.module("language_model.lm_head", &[], cfg.vocab_size, h, law.lm_head_gain * inv(h), None)?;
        let copy = (law.lm_head_copy_c * inv(h)).min(0.9);
        p.tie_rows("language_model.model.embed_tokens", "language_model.lm_head", copy);
    }
    Ok(p)
}

fn gcd(mut a: u64, mut b: u64) -> u64 {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

// ---------------------------------------------------------------------------------------------
// Generating bytes.

/// Writes the bytes `[byte0, byte0 + out.len())` of a tensor (`byte0` element-aligned).
fn fill_bytes(t: &TensorPlan, byte0: usize, out: &mut [u8]) {
    let es = t.dtype.size();
    debug_assert_eq!(byte0 % es, 0);
    debug_assert_eq!(out.len() % es, 0);
    let e0 = (byte0 / es) as u64;
    match t.fill {
        Fill::Codes { key, copy } => {
            // Word pairs share one 64-bit draw: word w is half (w & 1) of draw w / 2.
            let word = |w: u64| (rand(key, w >> 1) >> ((w & 1) * 32)) as u32;
            match &copy {
                Some(cp) => {
                    for (k, c) in out.chunks_exact_mut(4).enumerate() {
                        let w = e0 + k as u64;
                        c.copy_from_slice(&cp.word(w, word(w)).to_le_bytes());
                    }
                }
                None if e0.is_multiple_of(2) => {
                    let n_pairs = out.len() / 8;
                    let mut pairs = out.chunks_exact_mut(8);
                    for (k, c) in (&mut pairs).enumerate() {
                        c.copy_from_slice(&rand(key, (e0 >> 1) + k as u64).to_le_bytes());
                    }
                    let rest = pairs.into_remainder();
                    if !rest.is_empty() {
                        let w = e0 + (n_pairs * 2) as u64;
                        rest.copy_from_slice(&word(w).to_le_bytes());
                    }
                }
                None => {
                    for (k, c) in out.chunks_exact_mut(4).enumerate() {
                        c.copy_from_slice(&word(e0 + k as u64).to_le_bytes());
                    }
                }
            }
        }
        Fill::Scales(law) => {
            let t = spread_table();
            for (k, c) in out.chunks_exact_mut(2).enumerate() {
                c.copy_from_slice(&law.group(e0 + k as u64, t).0.to_bits().to_le_bytes());
            }
        }
        Fill::Biases(law) => {
            let t = spread_table();
            for (k, c) in out.chunks_exact_mut(2).enumerate() {
                c.copy_from_slice(&law.group(e0 + k as u64, t).1.to_bits().to_le_bytes());
            }
        }
        Fill::Normal { key, mean, std, tie } => {
            for (k, c) in out.chunks_exact_mut(2).enumerate() {
                let e = e0 + k as u64;
                let mut z = normal(rand(key, e));
                if let Some(t) = &tie {
                    let src = t.perm.apply(e / t.cols) * t.cols + e % t.cols;
                    z = t.c * normal(rand(t.src_key, src)) + (1.0 - t.c * t.c).sqrt() * z;
                }
                c.copy_from_slice(&bf16::from_f32(mean + std * z).to_bits().to_le_bytes());
            }
        }
        Fill::LogUniform { key, lo, hi } => {
            for (k, c) in out.chunks_exact_mut(4).enumerate() {
                let u = unit24(rand(key, e0 + k as u64) as u32);
                c.copy_from_slice(&(lo + (hi - lo) * u).ln().to_le_bytes());
            }
        }
    }
}

/// Bytes generated per step (written while the next step is generated).
const CHUNK: usize = 8 << 20;
/// Bytes per parallel task.
const TASK: usize = 256 << 10;

fn fill_chunk(t: &TensorPlan, byte0: usize, out: &mut [u8]) {
    out.par_chunks_mut(TASK).enumerate().for_each(|(k, blk)| fill_bytes(t, byte0 + k * TASK, blk));
}

/// One safetensors file: its tensors (sorted by name, data in that order).
struct Shard {
    file: String,
    tensors: Vec<usize>,
}

fn safetensors_header(plan: &[TensorPlan], idx: &[usize]) -> Vec<u8> {
    // {"__metadata__":{"format":"mlx"},"name":{"dtype":..,"shape":[..],"data_offsets":[a,b]},...}
    let mut s = String::from("{\"__metadata__\":{\"format\":\"mlx\"}");
    let mut off = 0u64;
    for &i in idx {
        let t = &plan[i];
        let shape: Vec<String> = t.shape.iter().map(|d| d.to_string()).collect();
        let end = off + t.nbytes();
        s.push_str(&format!(
            ",{}:{{\"dtype\":\"{}\",\"shape\":[{}],\"data_offsets\":[{off},{end}]}}",
            Value::from(t.name.as_str()),
            t.dtype.name(),
            shape.join(",")
        ));
        off = end;
    }
    s.push('}');
    while s.len() % 8 != 0 {
        s.push(' ');
    }
    let mut out = (s.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(s.as_bytes());
    out
}

fn write_shard(dir: &Path, plan: &[TensorPlan], shard: &Shard, progress: &indicatif::ProgressBar) -> Result<u64> {
    let path = dir.join(&shard.file);
    let io = |e| Error::io(&path, e);
    let mut f = File::create(&path).map_err(io)?;
    let header = safetensors_header(plan, &shard.tensors);
    f.write_all(&header).map_err(io)?;
    let mut written = header.len() as u64;

    // Steps: (tensor, byte offset, length), CHUNK bytes at most.
    let mut steps = Vec::new();
    for &i in &shard.tensors {
        let n = plan[i].nbytes() as usize;
        let mut b = 0;
        while b < n {
            let len = CHUNK.min(n - b);
            steps.push((i, b, len));
            b += len;
        }
    }
    let mut cur = vec![0u8; CHUNK];
    let mut next = vec![0u8; CHUNK];
    if let Some(&(i, b, len)) = steps.first() {
        fill_chunk(&plan[i], b, &mut cur[..len]);
    }
    for k in 0..steps.len() {
        let len = steps[k].2;
        let following = steps.get(k + 1).copied();
        let (res, ()) = rayon::join(
            || f.write_all(&cur[..len]),
            || {
                if let Some((i, b, l)) = following {
                    fill_chunk(&plan[i], b, &mut next[..l]);
                }
            },
        );
        res.map_err(io)?;
        written += len as u64;
        progress.inc(len as u64);
        std::mem::swap(&mut cur, &mut next);
    }
    f.flush().map_err(io)?;
    Ok(written)
}

/// Python's `json.dump(v, f, indent=4)` layout (mlx-lm's files end without a newline; transformers'
/// with one).
fn write_json(path: &Path, v: &Value, newline: bool) -> Result<u64> {
    let mut buf = Vec::new();
    let fmt = PyFormatter(serde_json::ser::PrettyFormatter::with_indent(b"    "));
    let mut ser = serde_json::Serializer::with_formatter(&mut buf, fmt);
    serde::Serialize::serialize(v, &mut ser).map_err(|e| Error::Invalid(format!("{}: {e}", path.display())))?;
    if newline {
        buf.push(b'\n');
    }
    std::fs::write(path, &buf).map_err(|e| Error::io(path, e))?;
    Ok(buf.len() as u64)
}

/// serde_json's pretty printer with floats written as Python's `repr` does (`1e-06`, not `1e-6`).
struct PyFormatter<'a>(serde_json::ser::PrettyFormatter<'a>);

impl serde_json::ser::Formatter for PyFormatter<'_> {
    fn write_f64<W: ?Sized + Write>(&mut self, w: &mut W, x: f64) -> std::io::Result<()> {
        w.write_all(py_float(x).as_bytes())
    }
    fn begin_array<W: ?Sized + Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        self.0.begin_array(w)
    }
    fn end_array<W: ?Sized + Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        self.0.end_array(w)
    }
    fn begin_array_value<W: ?Sized + Write>(&mut self, w: &mut W, first: bool) -> std::io::Result<()> {
        self.0.begin_array_value(w, first)
    }
    fn end_array_value<W: ?Sized + Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        self.0.end_array_value(w)
    }
    fn begin_object<W: ?Sized + Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        self.0.begin_object(w)
    }
    fn end_object<W: ?Sized + Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        self.0.end_object(w)
    }
    fn begin_object_key<W: ?Sized + Write>(&mut self, w: &mut W, first: bool) -> std::io::Result<()> {
        self.0.begin_object_key(w, first)
    }
    fn begin_object_value<W: ?Sized + Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        self.0.begin_object_value(w)
    }
    fn end_object_value<W: ?Sized + Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        self.0.end_object_value(w)
    }
}

/// Python's `repr(float)`: shortest round-trip digits, positional for 1e-4 <= |x| < 1e16, else
/// `d.ddde±XX`.
fn py_float(x: f64) -> String {
    if !x.is_finite() {
        return if x.is_nan() {
            "NaN".into()
        } else if x > 0.0 {
            "Infinity".into()
        } else {
            "-Infinity".into()
        };
    }
    if x == 0.0 {
        return if x.is_sign_negative() { "-0.0".into() } else { "0.0".into() };
    }
    let sci = format!("{x:e}"); // e.g. "1.5e-6"
    let (mant, exp) = sci.split_once('e').unwrap();
    let exp: i32 = exp.parse().unwrap();
    if (-4..16).contains(&exp) {
        let s = format!("{x}");
        if s.contains('.') {
            s
        } else {
            format!("{s}.0")
        }
    } else {
        format!("{mant}e{}{:02}", if exp < 0 { '-' } else { '+' }, exp.abs())
    }
}

fn sorted(m: Map<String, Value>) -> Map<String, Value> {
    let b: BTreeMap<String, Value> = m.into_iter().collect();
    b.into_iter().collect()
}

/// Checks that mlx-lm would build the same model from this config as lily does.
fn check_mlx_compatible(cfg: &ModelConfig, root: &Map<String, Value>, path: &Path) -> Result<()> {
    let (text, prefix) = match root.get("text_config") {
        Some(Value::Object(t)) => (t, "text_config."),
        _ => (root, ""),
    };
    let interval = text.get("full_attention_interval").and_then(Value::as_u64).unwrap_or(4) as usize;
    if interval == 0 {
        return Err(Error::ConfigKey {
            path: path.into(),
            key: format!("{prefix}full_attention_interval"),
            msg: "must be at least 1".into(),
        });
    }
    for (l, kind) in cfg.layer_types.iter().enumerate() {
        let mlx_full = (l + 1) % interval == 0;
        if mlx_full != (*kind == LayerKind::FullAttention) {
            return Err(Error::ConfigKey {
                path: path.into(),
                key: format!("{prefix}layer_types[{l}]"),
                msg: format!(
                    "disagrees with full_attention_interval = {interval} (mlx-lm builds layer kinds from the interval, so the MLX layout cannot express this)"
                ),
            });
        }
    }
    if !cfg.attn_output_gate {
        return Err(Error::ConfigKey {
            path: path.into(),
            key: format!("{prefix}attn_output_gate"),
            msg: "false is not expressible in the MLX layout (mlx-lm's q_proj always carries the output gate)".into(),
        });
    }
    if cfg.num_experts > 0 && cfg.shared_expert_intermediate_size == 0 {
        return Err(Error::ConfigKey {
            path: path.into(),
            key: format!("{prefix}shared_expert_intermediate_size"),
            msg: "must be positive (the MoE block always has a shared expert)".into(),
        });
    }
    Ok(())
}

/// Writes a random checkpoint in the MLX affine layout into `opts.out` (created if missing; existing
/// files of the same names are overwritten). Progress is reported in bytes on `progress`.
pub fn synthesize(opts: &SynthOptions, progress: &indicatif::ProgressBar) -> Result<SynthReport> {
    let cfg_path = PathBuf::from("<synth config>");
    let Value::Object(root) = &opts.config else {
        return Err(Error::ConfigKey { path: cfg_path, key: "(root)".into(), msg: "expected a JSON object".into() });
    };
    let mut root = root.clone();
    root.remove("quantization");
    root.remove("quantization_config");
    let text = serde_json::to_string(&root).map_err(|e| Error::Invalid(format!("config: {e}")))?;
    let cfg = ModelConfig::from_json_str(&text, &cfg_path)?;
    check_mlx_compatible(&cfg, &root, &cfg_path)?;
    if !matches!(opts.bits, 4 | 8) {
        return Err(Error::Invalid(format!("synth: {} bits is not supported (4 or 8)", opts.bits)));
    }
    if !matches!(opts.group_size, 32 | 64 | 128) {
        return Err(Error::Invalid(format!("synth: group size {} is not supported (32, 64 or 128)", opts.group_size)));
    }

    if !(opts.router_skew >= 0.0 && opts.router_skew.is_finite()) {
        return Err(Error::Invalid(format!("router skew {}: must be a finite number ≥ 0", opts.router_skew)));
    }
    let planner = plan(&cfg, opts.seed, opts.bits, opts.group_size, opts.router_skew)?;
    let tensors = &planner.tensors;

    // Shards as mlx-lm makes them (in module order, a new one when the next tensor would overflow),
    // each sorted by name.
    let mut groups: Vec<Vec<usize>> = Vec::new();
    let mut size = 0u64;
    for (i, t) in tensors.iter().enumerate() {
        if groups.is_empty() || (size + t.nbytes() > opts.max_shard_bytes && size > 0) {
            groups.push(Vec::new());
            size = 0;
        }
        groups.last_mut().unwrap().push(i);
        size += t.nbytes();
    }
    let n = groups.len();
    let shards: Vec<Shard> = groups
        .into_iter()
        .enumerate()
        .map(|(k, mut idx)| {
            idx.sort_by(|&a, &b| tensors[a].name.cmp(&tensors[b].name));
            let file = if n == 1 {
                "model.safetensors".to_string()
            } else {
                format!("model-{:05}-of-{:05}.safetensors", k + 1, n)
            };
            Shard { file, tensors: idx }
        })
        .collect();

    let out = &opts.out;
    std::fs::create_dir_all(out).map_err(|e| Error::io(out, e))?;
    let tensor_bytes: u64 = tensors.iter().map(TensorPlan::nbytes).sum();
    progress.set_length(tensor_bytes);
    progress.set_position(0);

    let mut bytes = 0u64;
    let mut files = Vec::new();

    let tok = crate::synth_tokenizer::for_vocab(cfg.vocab_size)?;
    // config.json, as mlx_lm.convert + save_config write it.
    let gen = generation_config(tok.im_end, tok.endoftext);
    let mut q = Map::new();
    q.insert("group_size".into(), json!(opts.group_size));
    q.insert("bits".into(), json!(opts.bits));
    q.insert("mode".into(), json!("affine"));
    for (path, bits, gs) in &planner.overrides {
        q.insert(path.clone(), json!({"group_size": gs, "bits": bits}));
    }
    let mut config = root;
    config.remove("_name_or_path");
    config.remove("vision_config");
    // mlx-lm's TextModelArgs renames rope_parameters.rope_type to `type` in place, in the very dict
    // that convert saves, so converted configs carry `"type"` (moved to the end of the object).
    let rope = match config.get_mut("text_config") {
        Some(Value::Object(t)) => t.get_mut("rope_parameters"),
        _ => config.get_mut("rope_parameters"),
    };
    if let Some(Value::Object(rp)) = rope {
        if !rp.contains_key("type") {
            if let Some(v) = rp.shift_remove("rope_type") {
                rp.insert("type".into(), v);
            }
        }
    }
    if tok.kind != SynthTokenizer::Real {
        // The config's own special ids must name the cut-down tokenizer's control tokens.
        let text = match config.get_mut("text_config") {
            Some(Value::Object(t)) => t,
            _ => &mut config,
        };
        for key in ["eos_token_id", "bos_token_id", "pad_token_id"] {
            if text.get(key).is_some_and(|v| !v.is_null()) {
                text.insert(key.into(), json!(tok.endoftext));
            }
        }
    }
    config.insert("eos_token_id".into(), gen["eos_token_id"].clone());
    config.insert("quantization".into(), Value::Object(q.clone()));
    config.insert("quantization_config".into(), Value::Object(q));
    for (name, v, newline) in [
        ("config.json", Value::Object(sorted(config)), false),
        ("generation_config.json", gen, true),
        ("tokenizer_config.json", tokenizer_config(), true),
    ] {
        bytes += write_json(&out.join(name), &v, newline)?;
        files.push(name.to_string());
    }

    // tokenizer.json
    {
        let path = out.join("tokenizer.json");
        std::fs::write(&path, &tok.json).map_err(|e| Error::io(&path, e))?;
        bytes += tok.json.len() as u64;
        files.push("tokenizer.json".into());
    }

    // Weights.
    for shard in &shards {
        bytes += write_shard(out, tensors, shard, progress)?;
        files.push(shard.file.clone());
    }

    // model.safetensors.index.json
    let mut weight_map = BTreeMap::new();
    for shard in &shards {
        for &i in &shard.tensors {
            weight_map.insert(tensors[i].name.clone(), Value::from(shard.file.as_str()));
        }
    }
    let index = json!({
        "metadata": {"total_size": tensor_bytes, "total_parameters": planner.parameters},
        "weight_map": Value::Object(weight_map.into_iter().collect()),
    });
    bytes += write_json(&out.join("model.safetensors.index.json"), &index, false)?;
    files.push("model.safetensors.index.json".into());

    Ok(SynthReport { bytes, tensor_bytes, tensors: tensors.len(), parameters: planner.parameters, files, tokenizer: tok.kind })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn group_law_hits_its_std() {
        for bits in [4u32, 8] {
            let law = GroupLaw::new(7, bits, 0.01);
            let n_bins = ((1u32 << bits) - 1) as f64;
            let (mut s1, mut s2, mut n) = (0f64, 0f64, 0f64);
            for g in 0..4096u64 {
                let (s, b) = law.group(g, spread_table());
                let (s, b) = (s.to_f32() as f64, b.to_f32() as f64);
                for q in 0..=(n_bins as u32) {
                    let w = s * q as f64 + b;
                    s1 += w;
                    s2 += w * w;
                    n += 1.0;
                }
            }
            let mean = s1 / n;
            let std = (s2 / n - mean * mean).sqrt();
            assert!(mean.abs() < 0.0005, "bits {bits}: mean {mean}");
            assert!((std / 0.01 - 1.0).abs() < 0.1, "bits {bits}: std {std}");
        }
    }

    #[test]
    fn fills_are_position_independent() {
        let law = GroupLaw::new(3, 4, 0.1);
        let fills = [
            (DType::U32, Fill::Codes { key: 9, copy: None }),
            (DType::BF16, Fill::Scales(law)),
            (DType::BF16, Fill::Biases(law)),
            (DType::BF16, Fill::Normal { key: 5, mean: 1.0, std: 0.5, tie: None }),
            (
                DType::BF16,
                Fill::Normal {
                    key: 5,
                    mean: 0.0,
                    std: 0.5,
                    tie: Some(NormalTie { src_key: 8, cols: 10, perm: RowPerm { rows: 100, a: 7, b: 3 }, c: 0.5 }),
                },
            ),
            (DType::F32, Fill::LogUniform { key: 5, lo: 1.0, hi: 16.0 }),
        ];
        for (dtype, fill) in fills {
            let t = TensorPlan { name: "t".into(), dtype, shape: vec![1000], fill };
            let mut whole = vec![0u8; 1000 * dtype.size()];
            fill_bytes(&t, 0, &mut whole);
            // Any element-aligned split gives the same bytes (odd word offsets included).
            for cut in [1usize, 3, 8, 333] {
                let b = cut * dtype.size();
                let mut a = vec![0u8; b];
                let mut c = vec![0u8; whole.len() - b];
                fill_bytes(&t, 0, &mut a);
                fill_bytes(&t, b, &mut c);
                assert_eq!([a, c].concat(), whole, "{fill:?} cut {cut}");
            }
        }
    }

    #[test]
    fn python_float_repr() {
        for (x, s) in [
            (1e-6, "1e-06"),
            (0.001, "0.001"),
            (1.0, "1.0"),
            (0.95, "0.95"),
            (1e-4, "0.0001"),
            (1e16, "1e+16"),
            (1.5e-7, "1.5e-07"),
            (10000000.0, "10000000.0"),
            (0.0, "0.0"),
        ] {
            assert_eq!(py_float(x), s);
        }
    }

    #[test]
    fn builtins_parse() {
        for name in builtin_names() {
            let c = builtin_config(name).unwrap();
            let cfg = ModelConfig::from_json_str(&c.to_string(), Path::new(name)).unwrap();
            check_mlx_compatible(&cfg, c.as_object().unwrap(), Path::new(name)).unwrap();
        }
    }
}
