//! The tokenizer `lily synth` writes beside a random checkpoint: the real Qwen3.5/3.6 tokenizer when
//! the vocabulary holds it, else that tokenizer cut down to the vocabulary, so that every id it
//! makes is a row of the embedding and `lily run`, `chat` and `serve` work on any config. The cut
//! keeps the first BPE entries (the 256 byte tokens come first, so any text still encodes), the
//! merges among them, and the control tokens after them (all 33 when there is room, else the 9 the
//! chat template and the output parser use), renumbered to follow the BPE entries.

use serde_json::{Map, Value};

use crate::error::{Error, Result};

static TOKENIZER_GZ: &[u8] = include_bytes!("../../../assets/qwen3.6-tokenizer.json.gz");

/// Entries of the real tokenizer: 248,044 BPE tokens and 33 added ones.
pub const REAL_ENTRIES: usize = 248_077;

/// The added tokens a conversation needs, when there is no room for all of them.
const ESSENTIAL: [&str; 9] =
    ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"];

/// The smallest vocabulary a tokenizer can be cut to: the byte tokens and the essential controls.
pub const MIN_VOCAB: usize = 256 + ESSENTIAL.len();

/// Which tokenizer was written.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SynthTokenizer {
    /// The real Qwen3.5/3.6 tokenizer.
    Real,
    /// The real one cut down: its first `bpe` BPE entries and `special` added tokens.
    CutDown { bpe: usize, special: usize },
}

impl std::fmt::Display for SynthTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SynthTokenizer::Real => write!(f, "the real Qwen3.5/3.6 tokenizer"),
            SynthTokenizer::CutDown { bpe, special } => {
                write!(f, "the Qwen3.5/3.6 tokenizer cut down to the vocabulary ({bpe} BPE entries and {special} control tokens)")
            }
        }
    }
}

/// A tokenizer.json for `vocab` embedding rows, what it is, and the ids of `<|im_end|>` and
/// `<|endoftext|>` in it.
pub(crate) struct Written {
    pub json: Vec<u8>,
    pub kind: SynthTokenizer,
    pub im_end: u32,
    pub endoftext: u32,
}

fn real() -> Result<Vec<u8>> {
    let mut out = Vec::new();
    std::io::Read::read_to_end(&mut flate2::read::GzDecoder::new(TOKENIZER_GZ), &mut out)
        .map_err(|e| Error::Invalid(format!("the built-in tokenizer: {e}")))?;
    Ok(out)
}

pub(crate) fn for_vocab(vocab: usize) -> Result<Written> {
    let json = real()?;
    if vocab >= REAL_ENTRIES {
        return Ok(Written { json, kind: SynthTokenizer::Real, im_end: 248_046, endoftext: 248_044 });
    }
    if vocab < MIN_VOCAB {
        return Err(Error::Invalid(format!(
            "synth: vocab_size {vocab} is too small for a tokenizer: a byte-level BPE needs its 256 byte tokens and the {} control tokens a conversation uses (at least {MIN_VOCAB})",
            ESSENTIAL.len()
        )));
    }
    let bad = |what: &str| Error::Invalid(format!("the built-in tokenizer: {what}"));
    let mut t: Value = serde_json::from_slice(&json).map_err(|e| bad(&e.to_string()))?;
    let added: Vec<Value> = t["added_tokens"].as_array().ok_or_else(|| bad("no added_tokens"))?.clone();
    let kept: Vec<Value> = if vocab >= 256 + added.len() {
        added
    } else {
        added.into_iter().filter(|a| a["content"].as_str().is_some_and(|c| ESSENTIAL.contains(&c))).collect()
    };
    let bpe = vocab - kept.len();
    let model = t["model"].as_object_mut().ok_or_else(|| bad("no model"))?;
    let old = model.get("vocab").and_then(Value::as_object).ok_or_else(|| bad("no model.vocab"))?;
    let id_of = |tok: &str| old.get(tok).and_then(Value::as_u64).map(|i| i as usize);
    let new_vocab: Map<String, Value> = old.iter().filter(|(_, id)| id.as_u64().is_some_and(|i| (i as usize) < bpe)).map(|(k, v)| (k.clone(), v.clone())).collect();
    let merges: Vec<Value> = model
        .get("merges")
        .and_then(Value::as_array)
        .ok_or_else(|| bad("no model.merges"))?
        .iter()
        .filter(|m| {
            let (a, b) = match m {
                Value::Array(p) if p.len() == 2 => (p[0].as_str().unwrap_or(""), p[1].as_str().unwrap_or("")),
                Value::String(s) => s.split_once(' ').unwrap_or(("", "")),
                _ => return false,
            };
            [id_of(a), id_of(b), id_of(&format!("{a}{b}"))].iter().all(|i| i.is_some_and(|i| i < bpe))
        })
        .cloned()
        .collect();
    model.insert("vocab".into(), Value::Object(new_vocab));
    model.insert("merges".into(), Value::Array(merges));
    let (mut im_end, mut endoftext) = (None, None);
    let renumbered: Vec<Value> = kept
        .into_iter()
        .enumerate()
        .map(|(i, mut a)| {
            let id = (bpe + i) as u32;
            match a["content"].as_str() {
                Some("<|im_end|>") => im_end = Some(id),
                Some("<|endoftext|>") => endoftext = Some(id),
                _ => {}
            }
            a["id"] = Value::from(id);
            a
        })
        .collect();
    let special = renumbered.len();
    t["added_tokens"] = Value::Array(renumbered);
    let json = serde_json::to_vec(&t).map_err(|e| bad(&e.to_string()))?;
    Ok(Written {
        json,
        kind: SynthTokenizer::CutDown { bpe, special },
        im_end: im_end.ok_or_else(|| bad("no <|im_end|>"))?,
        endoftext: endoftext.ok_or_else(|| bad("no <|endoftext|>"))?,
    })
}
