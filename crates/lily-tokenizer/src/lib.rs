//! Text to token ids and back for Qwen3.5/3.6 checkpoints.
//!
//! [`Tokenizer`] wraps the checkpoint's own `tokenizer.json` through the pure-Rust `tokenizers`
//! crate (NFC normaliser, the Qwen3.5 split regex, byte-level BPE), plus the special-token table
//! from `tokenizer_config.json`. Added tokens written in the text (`<|im_start|>`, `<think>`, ...)
//! encode to single ids, exactly as Hugging Face does with `add_special_tokens=False`; no BOS is
//! added.
//!
//! [`StreamDecoder`] turns ids into text one id at a time for streaming: it never emits part of a
//! UTF-8 character (byte-level BPE splits multi-byte characters across tokens), never repeats
//! text, and the concatenation of everything it returns plus [`StreamDecoder::flush`] equals
//! [`Tokenizer::decode`] of all the ids, byte for byte.
//!
//! ```no_run
//! # fn main() -> Result<(), lily_tokenizer::TokenizerError> {
//! use lily_tokenizer::{StreamDecoder, Tokenizer};
//! let tok = Tokenizer::from_dir(std::path::Path::new("/models/qwen3.6"))?;
//! let ids = tok.encode("<|im_start|>user\nhi<|im_end|>\n")?;
//! let mut stream = StreamDecoder::new(&tok, true);
//! let mut text = String::new();
//! for &id in &ids {
//!     text.push_str(&stream.push(id)?);
//! }
//! text.push_str(&stream.flush());
//! assert_eq!(text, tok.decode(&ids, true)?);
//! # Ok(()) }
//! ```

use std::collections::HashSet;
use std::fmt;
use std::path::{Path, PathBuf};

use tokenizers::{DecoderWrapper, Model};

/// Boxed error from the `tokenizers` crate or from serde.
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Everything that can go wrong in this crate.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    /// A file could not be read (a missing `tokenizer.json` names its path here).
    #[error("cannot read {}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// `tokenizer.json` is not a valid Hugging Face tokenizer file.
    #[error("invalid tokenizer {origin}: {source}")]
    InvalidTokenizer {
        /// The file's path, or `tokenizer.json (bytes)`.
        origin: String,
        #[source]
        source: BoxError,
    },
    /// `tokenizer_config.json` is not valid JSON, or disagrees with `tokenizer.json`.
    #[error("invalid {origin}: {message}")]
    InvalidConfig { origin: String, message: String },
    /// An id the tokenizer does not know (ids >= `vocab_size()`, e.g. the model's padding rows).
    #[error("token id {id} is out of range: the tokenizer knows ids 0..{vocab_size}")]
    UnknownId { id: u32, vocab_size: usize },
    /// The `tokenizers` crate failed to encode.
    #[error("encoding failed: {0}")]
    Encode(#[source] BoxError),
    /// The `tokenizers` crate failed to decode.
    #[error("decoding failed: {0}")]
    Decode(#[source] BoxError),
}

/// Stop tokens assumed when no `tokenizer_config.json` is given (ChatML end of turn, end of text).
const DEFAULT_EOS: [&str; 2] = ["<|im_end|>", "<|endoftext|>"];

/// The generic stream decoder holds back at most this many ids undecided.
const MAX_UNDECIDED: usize = 16;

/// A checkpoint's tokenizer: `tokenizer.json` + the special-token table.
#[derive(Clone)]
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    vocab_size: usize,
    /// Added tokens with `special: true` (skipped by `skip_special`); `<think>`, `<tool_call>`
    /// etc. are added tokens but not special in Qwen3.5/3.6.
    special: HashSet<u32>,
    eos: Vec<u32>,
    bos: Option<u32>,
    pad: Option<u32>,
    /// The decoder is plain byte-level: the streaming decoder can work on bytes exactly.
    byte_level: bool,
}

impl fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut special: Vec<_> = self.special.iter().copied().collect();
        special.sort_unstable();
        f.debug_struct("Tokenizer")
            .field("vocab_size", &self.vocab_size)
            .field("special", &special)
            .field("eos", &self.eos)
            .field("bos", &self.bos)
            .field("pad", &self.pad)
            .field("byte_level", &self.byte_level)
            .finish_non_exhaustive()
    }
}

impl Tokenizer {
    /// Loads `dir/tokenizer.json`, and `dir/tokenizer_config.json` when it exists (eos / bos /
    /// pad tokens, `added_tokens_decoder` special flags, `split_special_tokens`).
    pub fn from_dir(dir: &Path) -> Result<Self, TokenizerError> {
        let path = dir.join("tokenizer.json");
        let bytes = std::fs::read(&path).map_err(|source| TokenizerError::Io { path: path.clone(), source })?;
        let cfg_path = dir.join("tokenizer_config.json");
        let cfg = match std::fs::read(&cfg_path) {
            Ok(b) => Some(b),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
            Err(source) => return Err(TokenizerError::Io { path: cfg_path, source }),
        };
        Self::build(
            &bytes,
            &path.display().to_string(),
            cfg.as_deref().map(|b| (b, cfg_path.display().to_string())),
        )
    }

    /// Loads a `tokenizer.json` held in memory, without a `tokenizer_config.json`: the eos ids are
    /// then the ChatML stop tokens `<|im_end|>` and `<|endoftext|>` (those the vocabulary has).
    pub fn from_json_bytes(bytes: &[u8]) -> Result<Self, TokenizerError> {
        Self::build(bytes, "tokenizer.json (bytes)", None)
    }

    /// Like [`Tokenizer::from_dir`], from memory: `tokenizer.json` and optionally
    /// `tokenizer_config.json`.
    pub fn from_json_bytes_with_config(tokenizer_json: &[u8], tokenizer_config_json: Option<&[u8]>) -> Result<Self, TokenizerError> {
        Self::build(
            tokenizer_json,
            "tokenizer.json (bytes)",
            tokenizer_config_json.map(|b| (b, "tokenizer_config.json (bytes)".to_string())),
        )
    }

    fn build(bytes: &[u8], origin: &str, config: Option<(&[u8], String)>) -> Result<Self, TokenizerError> {
        let mut inner = tokenizers::Tokenizer::from_bytes(bytes)
            .map_err(|source| TokenizerError::InvalidTokenizer { origin: origin.to_string(), source })?;
        let added = inner.get_added_tokens_decoder();
        let max_added = added.keys().map(|&id| id as usize + 1).max().unwrap_or(0);
        let vocab_size = inner.get_model().get_vocab_size().max(max_added);
        let mut special: HashSet<u32> = added.iter().filter(|(_, t)| t.special).map(|(&id, _)| id).collect();
        let byte_level = matches!(inner.get_decoder(), Some(DecoderWrapper::ByteLevel(_)));

        let (eos, bos, pad) = match config {
            None => (
                DEFAULT_EOS.iter().filter_map(|t| inner.token_to_id(t)).collect(),
                None,
                inner.token_to_id("<|endoftext|>"),
            ),
            Some((cfg_bytes, cfg_origin)) => {
                let bad = |message: String| TokenizerError::InvalidConfig { origin: cfg_origin.clone(), message };
                let cfg: serde_json::Value = serde_json::from_slice(cfg_bytes).map_err(|e| bad(e.to_string()))?;
                let obj = cfg.as_object().ok_or_else(|| bad("not a JSON object".into()))?;
                // added_tokens_decoder: {"248044": {"content": ..., "special": bool, ...}, ...}
                if let Some(map) = obj.get("added_tokens_decoder") {
                    let map = map.as_object().ok_or_else(|| bad("added_tokens_decoder is not an object".into()))?;
                    for (key, entry) in map {
                        let id: u32 = key.parse().map_err(|_| bad(format!("added_tokens_decoder key {key:?} is not an id")))?;
                        let content = entry.get("content").and_then(|c| c.as_str());
                        let Some(known) = inner.id_to_token(id) else {
                            continue; // an id tokenizer.json does not have: nothing to override
                        };
                        if let Some(content) = content {
                            if content != known {
                                return Err(bad(format!(
                                    "added_tokens_decoder says id {id} is {content:?}, tokenizer.json says {known:?}"
                                )));
                            }
                        }
                        match entry.get("special").and_then(|s| s.as_bool()) {
                            Some(true) => {
                                special.insert(id);
                            }
                            Some(false) => {
                                special.remove(&id);
                            }
                            None => {}
                        }
                    }
                }
                let lookup = |key: &str| -> Result<Option<u32>, TokenizerError> {
                    let name = match obj.get(key) {
                        None | Some(serde_json::Value::Null) => return Ok(None),
                        Some(serde_json::Value::String(s)) => s.as_str(),
                        Some(v) => v
                            .get("content")
                            .and_then(|c| c.as_str())
                            .ok_or_else(|| bad(format!("{key} is neither a string nor {{\"content\": ...}}")))?,
                    };
                    inner
                        .token_to_id(name)
                        .map(Some)
                        .ok_or_else(|| bad(format!("{key} {name:?} is not in the vocabulary")))
                };
                let eos: Vec<u32> = lookup("eos_token")?.into_iter().collect();
                let bos = lookup("bos_token")?;
                let pad = lookup("pad_token")?;
                if let Some(split) = obj.get("split_special_tokens").and_then(|v| v.as_bool()) {
                    // true: special tokens written in the text are encoded as plain text.
                    inner.set_encode_special_tokens(split);
                }
                (eos, bos, pad)
            }
        };
        Ok(Self { inner, vocab_size, special, eos, bos, pad, byte_level })
    }

    /// Encodes text to ids. Added and special tokens written in the text (a rendered chat prompt
    /// contains `<|im_start|>` etc.) become single ids; the text is NFC-normalised first (the
    /// `tokenizer.json` normaliser); no BOS is added.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, TokenizerError> {
        let enc = self.inner.encode_fast(text, false).map_err(TokenizerError::Encode)?;
        Ok(enc.get_ids().to_vec())
    }

    /// The ids of `prefix + rest`, given `prefix`'s ids, without encoding the prefix again when
    /// `rest` begins with an added token (`<|im_start|>`, ...): the tokenizer splits the text at added
    /// tokens before anything else, so the ids then simply concatenate. Otherwise the whole text is
    /// encoded. (A chat prompt is its history followed by `<|im_start|>assistant…`.)
    pub fn encode_after(&self, prefix: &str, prefix_ids: &[u32], rest: &str) -> Result<Vec<u32>, TokenizerError> {
        let rest_ids = self.encode(rest)?;
        let starts_at_added = rest_ids.first().and_then(|id| self.inner.get_added_tokens_decoder().get(id).map(|t| rest.starts_with(&t.content)));
        if starts_at_added == Some(true) {
            let mut ids = prefix_ids.to_vec();
            ids.extend_from_slice(&rest_ids);
            return Ok(ids);
        }
        self.encode(&format!("{prefix}{rest}"))
    }

    /// Decodes ids to text (invalid UTF-8 becomes U+FFFD, as in Hugging Face). With
    /// `skip_special`, special tokens (`is_special`) are dropped; `<think>`, `<tool_call>` etc.
    /// stay. An id the tokenizer does not know is an error.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String, TokenizerError> {
        for &id in ids {
            self.check_id(id)?;
        }
        if skip_special && ids.iter().any(|id| self.special.contains(id)) {
            let kept: Vec<u32> = ids.iter().copied().filter(|id| !self.special.contains(id)).collect();
            self.decode_unchecked(&kept)
        } else {
            self.decode_unchecked(ids)
        }
    }

    fn decode_unchecked(&self, ids: &[u32]) -> Result<String, TokenizerError> {
        self.inner.decode(ids, false).map_err(TokenizerError::Decode)
    }

    fn check_id(&self, id: u32) -> Result<(), TokenizerError> {
        if (id as usize) < self.vocab_size && self.inner.id_to_token(id).is_some() {
            Ok(())
        } else {
            Err(TokenizerError::UnknownId { id, vocab_size: self.vocab_size })
        }
    }

    /// Number of ids the tokenizer knows (248077 for Qwen3.5/3.6: 248044 BPE tokens + 33 added
    /// tokens). The model's embedding may have more rows (padding), which decode rejects.
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// The id of a token, as written in the vocabulary: added tokens as-is (`<|im_end|>`), BPE
    /// tokens in byte-level form (`"Ġthe"` for `" the"`).
    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The vocabulary entry of an id (see [`Tokenizer::token_id`] for its form).
    pub fn token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// Whether an id is a special (control) token: `<|im_end|>`, `<|endoftext|>`, ... These are
    /// dropped by `skip_special`. `<think>`, `</think>`, `<tool_call>`, `</tool_call>`,
    /// `<tool_response>`, `</tool_response>` are added tokens but not special.
    pub fn is_special(&self, id: u32) -> bool {
        self.special.contains(&id)
    }

    /// End-of-sequence ids: `tokenizer_config.json`'s `eos_token` (`<|im_end|>` for Qwen), or,
    /// without a config, `<|im_end|>` and `<|endoftext|>`. The caller adds
    /// `generation_config.json`'s `eos_token_id`s.
    pub fn eos_ids(&self) -> Vec<u32> {
        self.eos.clone()
    }

    /// `tokenizer_config.json`'s `bos_token` (null for Qwen; never added by `encode`).
    pub fn bos_id(&self) -> Option<u32> {
        self.bos
    }

    /// `tokenizer_config.json`'s `pad_token` (`<|endoftext|>` for Qwen).
    pub fn pad_id(&self) -> Option<u32> {
        self.pad
    }

    /// The bytes `id` stands for, as the decoder produces them (a byte-level token's bytes, which
    /// may be part of a UTF-8 character; an added token's text). For constrained decoding, which
    /// matches grammars against the bytes of every token.
    pub fn token_bytes(&self, id: u32) -> Result<Vec<u8>, TokenizerError> {
        let mut out = Vec::new();
        if self.byte_level {
            self.push_token_bytes(id, &mut out)?;
        } else {
            out = self.decode(&[id], false)?.into_bytes();
        }
        Ok(out)
    }

    /// The added tokens (`<|im_end|>`, `<think>`, `<tool_call>`, ...): `(id, text)`, by id.
    pub fn added_tokens(&self) -> Vec<(u32, String)> {
        let mut v: Vec<(u32, String)> = self.inner.get_added_tokens_decoder().into_iter().map(|(id, t)| (id, t.content)).collect();
        v.sort_unstable_by_key(|t| t.0);
        v
    }

    /// The wrapped `tokenizers` tokenizer.
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }

    /// Appends the bytes a byte-level decoder produces for `id` (as `tokenizers`' ByteLevel
    /// decoder does: every char mapped back to its byte, or, for a token with a char outside the
    /// byte alphabet, e.g. an added token with non-ASCII text, the token's own UTF-8).
    fn push_token_bytes(&self, id: u32, out: &mut Vec<u8>) -> Result<(), TokenizerError> {
        let token = self.inner.id_to_token(id).ok_or(TokenizerError::UnknownId { id, vocab_size: self.vocab_size })?;
        let start = out.len();
        for c in token.chars() {
            match char_to_byte(c) {
                Some(b) => out.push(b),
                None => {
                    out.truncate(start);
                    out.extend_from_slice(token.as_bytes());
                    break;
                }
            }
        }
        Ok(())
    }
}

/// Inverse of GPT-2's `bytes_to_unicode`: printable Latin-1 bytes map to themselves, the other 68
/// bytes to U+0100..U+0143 in byte order.
fn char_to_byte(c: char) -> Option<u8> {
    const fn printable(b: u32) -> bool {
        (b >= 0x21 && b <= 0x7e) || (b >= 0xa1 && b <= 0xac) || (b >= 0xae && b <= 0xff)
    }
    static TABLE: std::sync::OnceLock<[i16; 0x144]> = std::sync::OnceLock::new();
    let table = TABLE.get_or_init(|| {
        let mut t = [-1i16; 0x144];
        let mut n = 0u32;
        for b in 0..=255u32 {
            if printable(b) {
                t[b as usize] = b as i16;
            } else {
                t[(0x100 + n) as usize] = b as i16;
                n += 1;
            }
        }
        t
    });
    match table.get(c as usize) {
        Some(&b) if b >= 0 => Some(b as u8),
        _ => None,
    }
}

/// Incremental detokeniser for streaming: push ids one by one, get the text that is now certain.
///
/// For a byte-level tokenizer (Qwen) it keeps the undecided tail of the byte stream (at most an
/// incomplete UTF-8 character, 3 bytes) and decodes exactly as `String::from_utf8_lossy` does on
/// the whole stream: O(1) per token. For other decoders it falls back to the prefix/read-offset
/// window of text-generation-inference / vLLM.
pub struct StreamDecoder<'a> {
    tok: &'a Tokenizer,
    skip_special: bool,
    state: StreamState,
}

enum StreamState {
    /// Byte-level: bytes not yet emitted (an incomplete UTF-8 sequence at the end of the stream).
    Bytes { pending: Vec<u8> },
    /// Generic: the ids from `prefix` on; `ids[prefix..read]` was already emitted as text.
    Window { ids: Vec<u32>, prefix: usize, read: usize },
}

impl<'a> StreamDecoder<'a> {
    /// A stream decoder over `tok`; with `skip_special`, special tokens produce no text (as
    /// `tok.decode(ids, true)`).
    pub fn new(tok: &'a Tokenizer, skip_special: bool) -> Self {
        if tok.byte_level {
            Self { tok, skip_special, state: StreamState::Bytes { pending: Vec::new() } }
        } else {
            Self::new_windowed(tok, skip_special)
        }
    }

    /// The generic prefix/read-offset decoder, whatever the tokenizer's decoder (for tests).
    #[doc(hidden)]
    pub fn new_windowed(tok: &'a Tokenizer, skip_special: bool) -> Self {
        Self { tok, skip_special, state: StreamState::Window { ids: Vec::new(), prefix: 0, read: 0 } }
    }

    /// Adds one id; returns the text that became certain (often empty while a multi-byte
    /// character is incomplete). An unknown id is an error and leaves the decoder unchanged.
    pub fn push(&mut self, id: u32) -> Result<String, TokenizerError> {
        self.tok.check_id(id)?;
        if self.skip_special && self.tok.is_special(id) {
            return Ok(String::new());
        }
        match &mut self.state {
            StreamState::Bytes { pending } => {
                self.tok.push_token_bytes(id, pending)?;
                Ok(take_utf8(pending))
            }
            StreamState::Window { ids, prefix, read } => {
                ids.push(id);
                let prefix_text = self.tok.decode_unchecked(&ids[*prefix..*read])?;
                let new_text = self.tok.decode_unchecked(&ids[*prefix..])?;
                let certain = new_text.len() > prefix_text.len() && !new_text.ends_with('\u{FFFD}');
                // No character stays incomplete over this many ids: what is still held back then
                // is an invalid sequence (or ids that decode to nothing), given out as `decode`
                // would. Without this bound the window (and each push's work) grows with a run
                // of such ids, quadratically in all (found by fuzz/decoder).
                let stale = ids.len() - *read >= MAX_UNDECIDED;
                if new_text.starts_with(&prefix_text) && (certain || stale) {
                    let out = new_text[prefix_text.len()..].to_string();
                    // The old read offset becomes the prefix; drop what is before it.
                    ids.drain(..*read);
                    *prefix = 0;
                    *read = ids.len();
                    Ok(out)
                } else {
                    if stale {
                        // The decoder rewrites earlier text: decode the held ids without it.
                        ids.drain(..*read);
                        *prefix = 0;
                        *read = 0;
                    }
                    Ok(String::new())
                }
            }
        }
    }

    /// Returns whatever is left at the end of the stream (an incomplete UTF-8 character becomes
    /// U+FFFD, as in `decode`) and resets the decoder.
    pub fn flush(&mut self) -> String {
        match &mut self.state {
            StreamState::Bytes { pending } => {
                let out = String::from_utf8_lossy(pending).into_owned();
                pending.clear();
                out
            }
            StreamState::Window { ids, prefix, read } => {
                let tok = self.tok;
                let prefix_text = tok.decode_unchecked(&ids[*prefix..*read]).unwrap_or_default();
                let new_text = tok.decode_unchecked(&ids[*prefix..]).unwrap_or_default();
                let out = match new_text.strip_prefix(prefix_text.as_str()) {
                    Some(rest) => rest.to_string(),
                    None => new_text,
                };
                ids.clear();
                *prefix = 0;
                *read = 0;
                out
            }
        }
    }

    /// The tokenizer this decoder reads.
    pub fn tokenizer(&self) -> &'a Tokenizer {
        self.tok
    }
}

/// Removes from the front of `buf` everything whose decoding is certain and returns it as text:
/// complete characters, and U+FFFD for each invalid sequence (the same maximal-subpart rule as
/// `String::from_utf8_lossy`). Leaves only an incomplete character at the end.
fn take_utf8(buf: &mut Vec<u8>) -> String {
    let mut out = String::new();
    let mut start = 0;
    loop {
        match std::str::from_utf8(&buf[start..]) {
            Ok(s) => {
                out.push_str(s);
                start = buf.len();
                break;
            }
            Err(e) => {
                let valid = e.valid_up_to();
                out.push_str(std::str::from_utf8(&buf[start..start + valid]).expect("valid prefix"));
                match e.error_len() {
                    Some(n) => {
                        out.push('\u{FFFD}');
                        start += valid + n;
                    }
                    None => {
                        start += valid;
                        break;
                    }
                }
            }
        }
    }
    buf.drain(..start);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_table_is_a_bijection() {
        let mut seen = [false; 256];
        let mut n = 0;
        for c in 0..0x200u32 {
            if let Some(b) = char::from_u32(c).and_then(char_to_byte) {
                assert!(!seen[b as usize]);
                seen[b as usize] = true;
                n += 1;
            }
        }
        assert_eq!(n, 256);
        assert_eq!(char_to_byte('Ġ'), Some(b' '));
        assert_eq!(char_to_byte('Ċ'), Some(b'\n'));
        assert_eq!(char_to_byte('a'), Some(b'a'));
        assert_eq!(char_to_byte('毕'), None);
    }

    #[test]
    fn take_utf8_matches_lossy() {
        let cases: &[&[u8]] = &[
            b"abc",
            "😀".as_bytes(),
            &[0xf0, 0x9f, 0x98],
            &[0xf0, 0x9f, 0x98, b'a'],
            &[0x80, 0x80, b'x', 0xe4],
            &[0xed, 0xa0, 0x80],
            &[0xc0, 0xaf, 0xff, 0xfe],
            &[0xe4, 0xb8, 0xad, 0xe4],
        ];
        for bytes in cases {
            // feed byte by byte
            let mut buf = Vec::new();
            let mut out = String::new();
            for &b in *bytes {
                buf.push(b);
                out.push_str(&take_utf8(&mut buf));
                assert!(buf.len() <= 3);
            }
            out.push_str(&String::from_utf8_lossy(&buf));
            assert_eq!(out, String::from_utf8_lossy(bytes), "{bytes:x?}");
        }
    }
}
