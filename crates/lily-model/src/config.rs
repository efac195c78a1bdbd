//! The model's configuration, read from a checkpoint directory's `config.json` (and
//! `generation_config.json`), in either of its published forms: the multimodal wrapper with a
//! `text_config` block (Hugging Face and MLX conversions of Qwen3.5/3.6) or a plain text config.
//! The MLX `quantization` block sits at the top level, with per-module overrides as sibling keys.
//! A missing or wrong value is an error that names the file and the key.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde_json::{Map, Value};

use crate::error::{Error, Result};

/// What a decoder layer mixes tokens with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LayerKind {
    /// Gated DeltaNet: causal conv + delta-rule recurrence with a fixed-size state.
    LinearAttention,
    /// Gated softmax attention over a KV cache (GQA, partial RoPE, sigmoid output gate).
    FullAttention,
}

/// The text model's hyper-parameters (`text_config`), validated.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    pub model_type: String,
    pub hidden_size: usize,
    pub num_hidden_layers: usize,
    pub vocab_size: usize,
    pub rms_norm_eps: f32,
    pub tie_word_embeddings: bool,
    pub max_position_embeddings: usize,
    pub layer_types: Vec<LayerKind>,
    // Full attention.
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub attn_output_gate: bool,
    pub rope_theta: f64,
    /// Rotated dims per head: `head_dim * partial_rotary_factor` (64 of 256 for Qwen3.6).
    pub rotary_dim: usize,
    // Gated DeltaNet.
    pub linear_num_key_heads: usize,
    pub linear_num_value_heads: usize,
    pub linear_key_head_dim: usize,
    pub linear_value_head_dim: usize,
    pub linear_conv_kernel_dim: usize,
    // Mixture of experts (num_experts == 0: a dense SwiGLU MLP of `intermediate_size`).
    pub num_experts: usize,
    pub num_experts_per_tok: usize,
    pub moe_intermediate_size: usize,
    pub shared_expert_intermediate_size: usize,
    pub norm_topk_prob: bool,
    pub intermediate_size: usize,
    // Special tokens named by config.json.
    pub eos_token_ids: Vec<u32>,
    pub bos_token_id: Option<u32>,
    /// The MLX quantisation block, when the checkpoint is quantised.
    pub quantization: Option<QuantizationConfig>,
}

/// MLX's top-level `quantization` block: a default and per-module overrides.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct QuantizationConfig {
    pub group_size: usize,
    pub bits: u32,
    pub mode: String,
    /// Module path (as MLX names it, e.g. `language_model.model.layers.0.mlp.gate`) → its
    /// `(group_size, bits)`, or `None` where the module is left unquantised (`false`).
    pub overrides: BTreeMap<String, Option<(usize, u32)>>,
}

impl QuantizationConfig {
    /// The (group_size, bits) for one module path, or None if it is not quantised.
    pub fn for_module(&self, path: &str) -> Option<(usize, u32)> {
        match self.overrides.get(path) {
            Some(o) => *o,
            None => Some((self.group_size, self.bits)),
        }
    }
}

/// `generation_config.json`: the defaults a request falls back to.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct GenerationConfig {
    pub eos_token_ids: Vec<u32>,
    pub bos_token_id: Option<u32>,
    pub pad_token_id: Option<u32>,
    pub do_sample: Option<bool>,
    pub temperature: Option<f32>,
    pub top_k: Option<u32>,
    pub top_p: Option<f32>,
    pub min_p: Option<f32>,
    pub repetition_penalty: Option<f32>,
    pub presence_penalty: Option<f32>,
}

impl ModelConfig {
    pub fn num_full_attention_layers(&self) -> usize {
        self.layer_types.iter().filter(|k| **k == LayerKind::FullAttention).count()
    }
    /// Channels of the GDN causal conv: q | k | v.
    pub fn linear_conv_dim(&self) -> usize {
        2 * self.linear_key_dim() + self.linear_value_dim()
    }
    pub fn linear_key_dim(&self) -> usize {
        self.linear_num_key_heads * self.linear_key_head_dim
    }
    pub fn linear_value_dim(&self) -> usize {
        self.linear_num_value_heads * self.linear_value_head_dim
    }

    /// Reads `dir/config.json`.
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path).map_err(|e| Error::io(&path, e))?;
        Self::from_json_str(&text, &path)
    }

    /// Parses a config.json text; `path` is only used in error messages.
    pub fn from_json_str(text: &str, path: &Path) -> Result<Self> {
        let root: Value = serde_json::from_str(text).map_err(|source| Error::Json { path: path.into(), source })?;
        let Value::Object(root) = root else {
            return Err(Error::key(path, "(root)", "expected a JSON object"));
        };
        let top = Keys { path, prefix: String::new(), map: &root };
        let text = match root.get("text_config") {
            Some(Value::Object(m)) => Keys { path, prefix: "text_config.".into(), map: m },
            Some(_) => return Err(Error::key(path, "text_config", "expected an object")),
            None => Keys { path, prefix: String::new(), map: &root },
        };
        let top_type = top.opt_str("model_type")?;
        let model_type = text.opt_str("model_type")?.or(top_type.clone()).unwrap_or_default();
        let family_ok = |t: &str| t.starts_with("qwen3_5");
        if !family_ok(&model_type) && !top_type.as_deref().is_some_and(family_ok) {
            let key = if model_type.is_empty() { "model_type".to_string() } else { format!("{}model_type", text.prefix) };
            return Err(Error::key(
                path,
                key,
                format!("`{model_type}` is not a Qwen3.5/3.6 (`qwen3_5_moe`) model; lily runs only that family"),
            ));
        }

        let hidden_size = text.usize("hidden_size")?;
        let num_hidden_layers = text.usize("num_hidden_layers")?;
        let num_attention_heads = text.usize("num_attention_heads")?;
        let num_key_value_heads = text.usize("num_key_value_heads")?;
        let head_dim = match text.opt_usize("head_dim")? {
            Some(d) => d,
            None => hidden_size / num_attention_heads.max(1),
        };

        let layer_types = match text.map.get("layer_types") {
            Some(Value::Array(items)) => {
                let key = text.name("layer_types");
                if items.len() != num_hidden_layers {
                    return Err(Error::key(
                        path,
                        key,
                        format!("has {} entries but num_hidden_layers is {num_hidden_layers}", items.len()),
                    ));
                }
                items
                    .iter()
                    .enumerate()
                    .map(|(i, v)| match v.as_str() {
                        Some("linear_attention") => Ok(LayerKind::LinearAttention),
                        Some("full_attention") => Ok(LayerKind::FullAttention),
                        _ => Err(Error::key(
                            path,
                            format!("{key}[{i}]"),
                            format!("{v} is neither \"linear_attention\" nor \"full_attention\""),
                        )),
                    })
                    .collect::<Result<Vec<_>>>()?
            }
            Some(Value::Null) | None => {
                let interval = text.opt_usize("full_attention_interval")?.unwrap_or(4);
                if interval == 0 {
                    return Err(Error::key(path, text.name("full_attention_interval"), "must be at least 1"));
                }
                (0..num_hidden_layers)
                    .map(|i| if (i + 1) % interval == 0 { LayerKind::FullAttention } else { LayerKind::LinearAttention })
                    .collect()
            }
            Some(_) => return Err(Error::key(path, text.name("layer_types"), "expected an array of strings")),
        };

        // RoPE: `rope_parameters` (transformers 5), else the legacy flat keys.
        let (rope_theta, partial) = match text.map.get("rope_parameters").or_else(|| text.map.get("rope_scaling")) {
            Some(Value::Object(m)) => {
                let which = if text.map.contains_key("rope_parameters") { "rope_parameters." } else { "rope_scaling." };
                let rp = Keys { path, prefix: format!("{}{which}", text.prefix), map: m };
                let kind = rp.opt_str("rope_type")?.or(rp.opt_str("type")?).unwrap_or_else(|| "default".into());
                if kind != "default" && kind != "mrope" {
                    return Err(Error::key(
                        path,
                        rp.name("rope_type"),
                        format!("rope type `{kind}` is not supported (only the default RoPE)"),
                    ));
                }
                let theta = match rp.opt_f64("rope_theta")? {
                    Some(t) => t,
                    None => text.f64("rope_theta")?,
                };
                let partial = match rp.opt_f64("partial_rotary_factor")? {
                    Some(p) => p,
                    None => text.opt_f64("partial_rotary_factor")?.unwrap_or(0.25),
                };
                (theta, partial)
            }
            _ => (text.f64("rope_theta")?, text.opt_f64("partial_rotary_factor")?.unwrap_or(0.25)),
        };
        if !(partial > 0.0 && partial <= 1.0) {
            return Err(Error::key(path, text.name("partial_rotary_factor"), format!("{partial} is not in (0, 1]")));
        }
        let rotary_dim = (head_dim as f64 * partial) as usize;
        if !rotary_dim.is_multiple_of(2) || rotary_dim == 0 {
            return Err(Error::key(
                path,
                text.name("partial_rotary_factor"),
                format!("gives an odd or empty rotary dimension {rotary_dim} for head_dim {head_dim}"),
            ));
        }

        let num_experts = text.opt_usize("num_experts")?.unwrap_or(0);
        let (num_experts_per_tok, moe_intermediate_size, shared_expert_intermediate_size, intermediate_size);
        if num_experts > 0 {
            num_experts_per_tok = text.usize("num_experts_per_tok")?;
            moe_intermediate_size = text.usize("moe_intermediate_size")?;
            shared_expert_intermediate_size = text.opt_usize("shared_expert_intermediate_size")?.unwrap_or(0);
            intermediate_size = 0;
            if num_experts_per_tok == 0 || num_experts_per_tok > num_experts {
                return Err(Error::key(
                    path,
                    text.name("num_experts_per_tok"),
                    format!("{num_experts_per_tok} must be between 1 and num_experts ({num_experts})"),
                ));
            }
            if let Some(step) = text.opt_usize("decoder_sparse_step")? {
                if step != 1 {
                    return Err(Error::key(path, text.name("decoder_sparse_step"), "only 1 (every layer MoE) is supported"));
                }
            }
            if let Some(Value::Array(a)) = text.map.get("mlp_only_layers") {
                if !a.is_empty() {
                    return Err(Error::key(path, text.name("mlp_only_layers"), "dense-MLP layers in a MoE model are not supported"));
                }
            }
        } else {
            num_experts_per_tok = 0;
            moe_intermediate_size = 0;
            shared_expert_intermediate_size = 0;
            intermediate_size = text.usize("intermediate_size")?;
        }

        let eos_token_ids = token_list(&text, "eos_token_id")?
            .or(token_list(&top, "eos_token_id")?)
            .unwrap_or_default();
        let bos_token_id = match text.opt_usize("bos_token_id")? {
            Some(b) => Some(b as u32),
            None => top.opt_usize("bos_token_id")?.map(|b| b as u32),
        };

        let quantization = match root.get("quantization").or_else(|| root.get("quantization_config")) {
            Some(Value::Object(m)) => {
                let key = if root.contains_key("quantization") { "quantization." } else { "quantization_config." };
                Some(QuantizationConfig::parse(&Keys { path, prefix: key.into(), map: m })?)
            }
            Some(Value::Null) | None => None,
            Some(_) => return Err(Error::key(path, "quantization", "expected an object")),
        };

        let cfg = ModelConfig {
            model_type,
            hidden_size,
            num_hidden_layers,
            vocab_size: text.usize("vocab_size")?,
            rms_norm_eps: text.opt_f64("rms_norm_eps")?.unwrap_or(1e-6) as f32,
            tie_word_embeddings: text.opt_bool("tie_word_embeddings")?.or(top.opt_bool("tie_word_embeddings")?).unwrap_or(false),
            max_position_embeddings: text.opt_usize("max_position_embeddings")?.unwrap_or(262_144),
            layer_types,
            num_attention_heads,
            num_key_value_heads,
            head_dim,
            attn_output_gate: text.opt_bool("attn_output_gate")?.unwrap_or(true),
            rope_theta,
            rotary_dim,
            linear_num_key_heads: text.usize("linear_num_key_heads")?,
            linear_num_value_heads: text.usize("linear_num_value_heads")?,
            linear_key_head_dim: text.usize("linear_key_head_dim")?,
            linear_value_head_dim: text.usize("linear_value_head_dim")?,
            linear_conv_kernel_dim: text.opt_usize("linear_conv_kernel_dim")?.unwrap_or(4),
            num_experts,
            num_experts_per_tok,
            moe_intermediate_size,
            shared_expert_intermediate_size,
            norm_topk_prob: text.opt_bool("norm_topk_prob")?.unwrap_or(true),
            intermediate_size,
            eos_token_ids,
            bos_token_id,
            quantization,
        };
        cfg.validate(&text)?;
        Ok(cfg)
    }

    fn validate(&self, text: &Keys) -> Result<()> {
        let p = text.path;
        let positive = [
            ("hidden_size", self.hidden_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.num_key_value_heads),
            ("head_dim", self.head_dim),
            ("vocab_size", self.vocab_size),
            ("linear_num_key_heads", self.linear_num_key_heads),
            ("linear_num_value_heads", self.linear_num_value_heads),
            ("linear_key_head_dim", self.linear_key_head_dim),
            ("linear_value_head_dim", self.linear_value_head_dim),
            ("linear_conv_kernel_dim", self.linear_conv_kernel_dim),
        ];
        for (k, v) in positive {
            if v == 0 {
                return Err(Error::key(p, text.name(k), "must be positive"));
            }
        }
        if !self.num_attention_heads.is_multiple_of(self.num_key_value_heads) {
            return Err(Error::key(
                p,
                text.name("num_key_value_heads"),
                format!("{} does not divide num_attention_heads ({})", self.num_key_value_heads, self.num_attention_heads),
            ));
        }
        if !self.linear_num_value_heads.is_multiple_of(self.linear_num_key_heads) {
            return Err(Error::key(
                p,
                text.name("linear_num_key_heads"),
                format!(
                    "{} does not divide linear_num_value_heads ({})",
                    self.linear_num_key_heads, self.linear_num_value_heads
                ),
            ));
        }
        if self.rotary_dim > self.head_dim {
            return Err(Error::key(p, text.name("partial_rotary_factor"), "rotary dimension exceeds head_dim"));
        }
        Ok(())
    }
}

impl QuantizationConfig {
    fn parse(q: &Keys) -> Result<Self> {
        let group_size = q.usize("group_size")?;
        let bits = q.usize("bits")? as u32;
        let mode = q.opt_str("mode")?.unwrap_or_else(|| "affine".into());
        if mode != "affine" {
            return Err(Error::key(q.path, q.name("mode"), format!("`{mode}` quantisation is not supported (only affine)")));
        }
        check_quant(q, "", group_size, bits)?;
        let mut overrides = BTreeMap::new();
        for (k, v) in q.map {
            match v {
                Value::Object(m) => {
                    let o = Keys { path: q.path, prefix: format!("{}{k}.", q.prefix), map: m };
                    let g = o.usize("group_size")?;
                    let b = o.usize("bits")? as u32;
                    check_quant(&o, k, g, b)?;
                    overrides.insert(k.clone(), Some((g, b)));
                }
                Value::Bool(false) => {
                    overrides.insert(k.clone(), None);
                }
                _ => {}
            }
        }
        Ok(QuantizationConfig { group_size, bits, mode, overrides })
    }
}

fn check_quant(q: &Keys, _module: &str, group_size: usize, bits: u32) -> Result<()> {
    if ![32, 64, 128].contains(&group_size) {
        return Err(Error::key(q.path, q.name("group_size"), format!("{group_size} is not supported (32, 64 or 128)")));
    }
    if ![4, 8].contains(&bits) {
        return Err(Error::key(q.path, q.name("bits"), format!("{bits} is not supported (4 or 8)")));
    }
    Ok(())
}

impl GenerationConfig {
    /// Reads `dir/generation_config.json`; a checkpoint without one gets the defaults.
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let path = dir.join("generation_config.json");
        if !path.exists() {
            return Ok(Self::default());
        }
        let text = std::fs::read_to_string(&path).map_err(|e| Error::io(&path, e))?;
        let root: Value = serde_json::from_str(&text).map_err(|source| Error::Json { path: path.clone(), source })?;
        let Value::Object(m) = root else {
            return Err(Error::key(&path, "(root)", "expected a JSON object"));
        };
        let k = Keys { path: &path, prefix: String::new(), map: &m };
        Ok(GenerationConfig {
            eos_token_ids: token_list(&k, "eos_token_id")?.unwrap_or_default(),
            bos_token_id: k.opt_usize("bos_token_id")?.map(|v| v as u32),
            pad_token_id: k.opt_usize("pad_token_id")?.map(|v| v as u32),
            do_sample: k.opt_bool("do_sample")?,
            temperature: k.opt_f64("temperature")?.map(|v| v as f32),
            top_k: k.opt_usize("top_k")?.map(|v| v as u32),
            top_p: k.opt_f64("top_p")?.map(|v| v as f32),
            min_p: k.opt_f64("min_p")?.map(|v| v as f32),
            repetition_penalty: k.opt_f64("repetition_penalty")?.map(|v| v as f32),
            presence_penalty: k.opt_f64("presence_penalty")?.map(|v| v as f32),
        })
    }
}

fn token_list(k: &Keys, key: &str) -> Result<Option<Vec<u32>>> {
    match k.map.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Number(_)) => Ok(Some(vec![k.usize(key)? as u32])),
        Some(Value::Array(a)) => a
            .iter()
            .map(|v| v.as_u64().map(|x| x as u32).ok_or_else(|| Error::key(k.path, k.name(key), "expected token ids")))
            .collect::<Result<Vec<_>>>()
            .map(Some),
        Some(_) => Err(Error::key(k.path, k.name(key), "expected a token id or a list of them")),
    }
}

/// A JSON object with the file and key prefix it came from, for errors that name the key.
struct Keys<'a> {
    path: &'a Path,
    prefix: String,
    map: &'a Map<String, Value>,
}

impl Keys<'_> {
    fn name(&self, key: &str) -> String {
        format!("{}{key}", self.prefix)
    }
    fn err(&self, key: &str, msg: &str) -> Error {
        Error::key(PathBuf::from(self.path), self.name(key), msg)
    }
    fn opt_usize(&self, key: &str) -> Result<Option<usize>> {
        match self.map.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => v.as_u64().map(|x| Some(x as usize)).ok_or_else(|| self.err(key, &format!("{v} is not a non-negative integer"))),
        }
    }
    fn usize(&self, key: &str) -> Result<usize> {
        self.opt_usize(key)?.ok_or_else(|| self.err(key, "missing"))
    }
    fn opt_f64(&self, key: &str) -> Result<Option<f64>> {
        match self.map.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => v.as_f64().map(Some).ok_or_else(|| self.err(key, &format!("{v} is not a number"))),
        }
    }
    fn f64(&self, key: &str) -> Result<f64> {
        self.opt_f64(key)?.ok_or_else(|| self.err(key, "missing"))
    }
    fn opt_bool(&self, key: &str) -> Result<Option<bool>> {
        match self.map.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => v.as_bool().map(Some).ok_or_else(|| self.err(key, &format!("{v} is not true or false"))),
        }
    }
    fn opt_str(&self, key: &str) -> Result<Option<String>> {
        match self.map.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.clone())),
            Some(v) => Err(self.err(key, &format!("{v} is not a string"))),
        }
    }
}
