//! A model ready for conversations: the backend, the tokenizer, the chat template, the
//! generation defaults and stop ids of one checkpoint directory; and the built-in demo model that
//! is used when no checkpoint is given.

use std::path::{Path, PathBuf};

use lily_sampler::Defaults;
use lily_template::ChatTemplate;
use lily_tokenizer::Tokenizer;

use crate::open::{open, BackendKind, EngineError, LoadedModel, OpenOptions};
use lily_model::Backend;

pub struct ChatModel {
    pub dir: PathBuf,
    pub model: LoadedModel,
    pub tokenizer: Tokenizer,
    pub template: ChatTemplate,
    pub defaults: Defaults,
    /// EOS ids of config.json, generation_config.json and the tokenizer, merged.
    pub stop_ids: Vec<u32>,
    /// True for the built-in demo model (random weights).
    pub demo: bool,
}

#[derive(Debug, thiserror::Error)]
pub enum ChatModelError {
    #[error(transparent)]
    Engine(#[from] EngineError),
    #[error(transparent)]
    Tokenizer(#[from] lily_tokenizer::TokenizerError),
    #[error(transparent)]
    Template(#[from] lily_template::TemplateError),
    #[error("{path}: {msg}")]
    File { path: PathBuf, msg: String },
}

impl ChatModel {
    pub fn open(dir: &Path, kind: BackendKind, opts: &OpenOptions) -> Result<Self, ChatModelError> {
        let model = open(dir, kind, opts)?;
        let tokenizer = Tokenizer::from_dir(dir)?;
        let template = ChatTemplate::from_dir(dir)?;
        let gen_path = dir.join("generation_config.json");
        let defaults: Defaults = if gen_path.exists() {
            let text = std::fs::read_to_string(&gen_path).map_err(|e| ChatModelError::File { path: gen_path.clone(), msg: e.to_string() })?;
            serde_json::from_str(&text).map_err(|e| ChatModelError::File { path: gen_path.clone(), msg: e.to_string() })?
        } else {
            Defaults::default()
        };
        let gen = lily_model::GenerationConfig::from_dir(dir).map_err(EngineError::from)?;
        let mut stop_ids: Vec<u32> = model.config().eos_token_ids.clone();
        stop_ids.extend(gen.eos_token_ids);
        stop_ids.extend(tokenizer.eos_ids());
        stop_ids.sort_unstable();
        stop_ids.dedup();
        Ok(ChatModel { dir: dir.to_path_buf(), model, tokenizer, template, defaults, stop_ids, demo: false })
    }

    /// The built-in demo model: a small random model of the real architecture with the real
    /// tokenizer (`lily synth --config qwen3.6-tiny`), written once into the cache directory.
    pub fn open_demo(kind: BackendKind, opts: &OpenOptions) -> Result<Self, ChatModelError> {
        let dir = demo_dir();
        if !dir.join("config.json").exists() {
            let tmp = dir.with_extension("partial");
            let _ = std::fs::remove_dir_all(&tmp);
            let config = lily_model::synth::builtin_config(DEMO_CONFIG).expect("the demo config is built in");
            let opts = lily_model::synth::SynthOptions::new(config, tmp.clone());
            lily_model::synth::synthesize(&opts, &indicatif::ProgressBar::hidden()).map_err(EngineError::from)?;
            std::fs::rename(&tmp, &dir).map_err(|e| ChatModelError::File { path: dir.clone(), msg: e.to_string() })?;
        }
        let mut m = Self::open(&dir, kind, opts)?;
        m.demo = true;
        Ok(m)
    }
}

/// The built-in config the demo model is made from.
pub const DEMO_CONFIG: &str = "qwen3.6-tiny";

/// `$LILY_CACHE`, else `$XDG_CACHE_HOME/lily`, else `~/.cache/lily`, then `demo-qwen3.6-tiny`.
pub fn demo_dir() -> PathBuf {
    let base = std::env::var_os("LILY_CACHE")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("XDG_CACHE_HOME").map(|p| PathBuf::from(p).join("lily")))
        .or_else(|| std::env::var_os("HOME").map(|p| PathBuf::from(p).join(".cache/lily")))
        .unwrap_or_else(|| std::env::temp_dir().join("lily"));
    base.join(format!("demo-{DEMO_CONFIG}-v1"))
}
