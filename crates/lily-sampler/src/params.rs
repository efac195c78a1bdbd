//! Request parameters, model defaults (`generation_config.json`), their resolution and validation.

use serde::{Deserialize, Deserializer};

/// What a request asks for. Every field may be absent (`None`/empty): it then falls back to the
/// model's [`Defaults`] and then to OpenAI's defaults (see [`Resolved::resolve`]).
///
/// Deserialises from the OpenAI request fields of the same names, so a server request struct can
/// `#[serde(flatten)]` it. `null` is accepted everywhere and means "unset"; `logit_bias` is OpenAI's
/// map from token id (a string) to bias; `top_k` takes vLLM's `-1`/`0` for "off"; `seed` takes any
/// 64-bit integer, negative ones reinterpreted as `u64`.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(default)]
pub struct SamplingParams {
    pub temperature: Option<f32>,
    /// `0` or `-1`: no top-k (vLLM's convention); otherwise at least 1.
    pub top_k: Option<i32>,
    pub top_p: Option<f32>,
    pub min_p: Option<f32>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    pub repetition_penalty: Option<f32>,
    /// `(token id, bias)`, added to the logit. Bias in [-100, 100].
    #[serde(deserialize_with = "de_logit_bias")]
    pub logit_bias: Vec<(u32, f32)>,
    #[serde(deserialize_with = "de_seed")]
    pub seed: Option<u64>,
    /// Report the chosen token's log-probability.
    #[serde(deserialize_with = "de_null_default")]
    pub logprobs: bool,
    /// Also report this many most likely tokens (0..=20); needs `logprobs`.
    #[serde(deserialize_with = "de_null_default")]
    pub top_logprobs: u32,
}

/// The model's defaults, from `generation_config.json` (deserialises from that file directly;
/// unknown keys are ignored).
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(default)]
pub struct Defaults {
    /// `false` makes greedy the default when a request sets no temperature (transformers' meaning).
    pub do_sample: Option<bool>,
    pub temperature: Option<f32>,
    /// `0` means no top-k, as in transformers.
    pub top_k: Option<i32>,
    pub top_p: Option<f32>,
    pub min_p: Option<f32>,
    pub repetition_penalty: Option<f32>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
}

/// The resolved numeric parameters: a plain `Copy` struct, the argument a GPU kernel would take.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Resolved {
    /// `0` (anything below [`GREEDY_EPS`]) is greedy.
    pub temperature: f32,
    /// `0`: off.
    pub top_k: u32,
    /// `1`: off.
    pub top_p: f32,
    /// `0`: off.
    pub min_p: f32,
    /// `0`: off.
    pub presence_penalty: f32,
    /// `0`: off.
    pub frequency_penalty: f32,
    /// `1`: off.
    pub repetition_penalty: f32,
}

/// Temperatures below this are greedy (vLLM's `_SAMPLING_EPS`).
pub const GREEDY_EPS: f32 = 1e-5;
/// The most `top_logprobs` a request may ask for (OpenAI's limit).
pub const MAX_TOP_LOGPROBS: u32 = 20;

impl Default for Resolved {
    /// OpenAI's defaults: temperature 1, everything else off.
    fn default() -> Self {
        Resolved {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            repetition_penalty: 1.0,
        }
    }
}

/// A parameter out of range. [`SamplerError::param`] names the request field (OpenAI's `param`),
/// and the message is fit for a 400 response.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SamplerError {
    #[error("`{param}` must be {expected}, got {value}")]
    OutOfRange { param: &'static str, expected: &'static str, value: String },
    #[error("`logit_bias` names token {id}, but the vocabulary has {vocab} tokens")]
    LogitBiasToken { id: u32, vocab: usize },
    #[error("`top_logprobs` needs `logprobs` to be true")]
    TopLogprobsWithoutLogprobs,
    #[error("the vocabulary is empty")]
    EmptyVocab,
}

impl SamplerError {
    /// The request field at fault (`None` for errors that are not the request's).
    pub fn param(&self) -> Option<&'static str> {
        match self {
            SamplerError::OutOfRange { param, .. } => Some(param),
            SamplerError::LogitBiasToken { .. } => Some("logit_bias"),
            SamplerError::TopLogprobsWithoutLogprobs => Some("top_logprobs"),
            SamplerError::EmptyVocab => None,
        }
    }
}

fn check(ok: bool, param: &'static str, expected: &'static str, value: impl ToString) -> Result<(), SamplerError> {
    if ok {
        Ok(())
    } else {
        Err(SamplerError::OutOfRange { param, expected, value: value.to_string() })
    }
}

fn top_k_of(param: &'static str, k: i32) -> Result<u32, SamplerError> {
    check(k >= -1, param, "-1 or 0 (off) or at least 1", k)?;
    Ok(k.max(0) as u32)
}

impl Resolved {
    /// Each field: the request's value, else `generation_config.json`'s, else OpenAI's default
    /// (temperature 1, top_p 1, no top-k, min_p 0, no penalties). A `do_sample: false` in the
    /// defaults makes the fallback temperature 0 (greedy). Then every value is range-checked:
    /// temperature finite and >= 0; top_k -1, 0 or >= 1; top_p in (0, 1]; min_p in [0, 1];
    /// presence and frequency penalties in [-2, 2]; repetition penalty in (0, 2].
    pub fn resolve(p: &SamplingParams, d: &Defaults) -> Result<Resolved, SamplerError> {
        let o = Resolved::default();
        let default_temperature = match (d.temperature, d.do_sample) {
            (_, Some(false)) => 0.0,
            (Some(t), _) => t,
            (None, _) => o.temperature,
        };
        let temperature = p.temperature.unwrap_or(default_temperature);
        check(temperature.is_finite() && temperature >= 0.0, "temperature", "a number >= 0", temperature)?;
        let top_k = match (p.top_k, d.top_k) {
            (Some(k), _) => top_k_of("top_k", k)?,
            (None, Some(k)) => top_k_of("top_k", k)?,
            (None, None) => o.top_k,
        };
        let top_p = p.top_p.or(d.top_p).unwrap_or(o.top_p);
        check(top_p > 0.0 && top_p <= 1.0, "top_p", "in (0, 1]", top_p)?;
        let min_p = p.min_p.or(d.min_p).unwrap_or(o.min_p);
        check((0.0..=1.0).contains(&min_p), "min_p", "in [0, 1]", min_p)?;
        let presence_penalty = p.presence_penalty.or(d.presence_penalty).unwrap_or(o.presence_penalty);
        check((-2.0..=2.0).contains(&presence_penalty), "presence_penalty", "in [-2, 2]", presence_penalty)?;
        let frequency_penalty = p.frequency_penalty.or(d.frequency_penalty).unwrap_or(o.frequency_penalty);
        check((-2.0..=2.0).contains(&frequency_penalty), "frequency_penalty", "in [-2, 2]", frequency_penalty)?;
        let repetition_penalty = p.repetition_penalty.or(d.repetition_penalty).unwrap_or(o.repetition_penalty);
        check(
            repetition_penalty > 0.0 && repetition_penalty <= 2.0,
            "repetition_penalty",
            "in (0, 2]",
            repetition_penalty,
        )?;
        Ok(Resolved { temperature, top_k, top_p, min_p, presence_penalty, frequency_penalty, repetition_penalty })
    }

    pub fn is_greedy(&self) -> bool {
        self.temperature < GREEDY_EPS
    }
}

/// Checks the request-only fields: `logit_bias` ids below `vocab` and biases in [-100, 100],
/// `top_logprobs` in 0..=20 and only with `logprobs`.
pub(crate) fn validate_request(p: &SamplingParams, vocab: usize) -> Result<(), SamplerError> {
    for &(id, bias) in &p.logit_bias {
        if id as usize >= vocab {
            return Err(SamplerError::LogitBiasToken { id, vocab });
        }
        check((-100.0..=100.0).contains(&bias), "logit_bias", "a bias in [-100, 100]", bias)?;
    }
    check(p.top_logprobs <= MAX_TOP_LOGPROBS, "top_logprobs", "in [0, 20]", p.top_logprobs)?;
    if p.top_logprobs > 0 && !p.logprobs {
        return Err(SamplerError::TopLogprobsWithoutLogprobs);
    }
    Ok(())
}

fn de_null_default<'de, D: Deserializer<'de>, T: Deserialize<'de> + Default>(d: D) -> Result<T, D::Error> {
    Ok(Option::<T>::deserialize(d)?.unwrap_or_default())
}

fn de_seed<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Seed {
        U(u64),
        I(i64),
    }
    Ok(Option::<Seed>::deserialize(d)?.map(|s| match s {
        Seed::U(u) => u,
        Seed::I(i) => i as u64,
    }))
}

fn de_logit_bias<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<(u32, f32)>, D::Error> {
    use serde::de::Error;
    let map: Option<std::collections::BTreeMap<String, f32>> = Option::deserialize(d)?;
    let mut out = Vec::new();
    for (k, v) in map.unwrap_or_default() {
        let id =
            k.trim().parse::<u32>().map_err(|_| D::Error::custom(format!("logit_bias: `{k}` is not a token id")))?;
        out.push((id, v));
    }
    out.sort_by_key(|&(id, _)| id);
    Ok(out)
}
