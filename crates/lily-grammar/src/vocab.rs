//! The model's vocabulary as llguidance sees it: the bytes of every token in a token trie
//! (`toktrie`), built from lily's own tokenizer (the checkpoint's `tokenizer.json`), so the grammar
//! engine and the detokeniser agree byte for byte.
//!
//! Added tokens written as tags (`<|im_end|>`, `<think>`, `</think>`, `<tool_call>`, ...) and the
//! tokenizer's special tokens are *special* in the trie (the byte 0xFF marks them): no regex, JSON
//! string or grammar literal can produce them, only a grammar that names them (`<[id]>` in Lark).
//! So a JSON answer can never contain the `<tool_call>` token, and reasoning markup never leaks
//! into a constrained answer. The stop tokens are the trie's end-of-sequence set: a grammar that
//! is complete allows exactly those.
//!
//! This is what `toktrie_hf_tokenizers` does for a Hugging Face tokenizer; it is done here over
//! lily's tokenizer because that crate pins `tokenizers` 0.21 (lily uses 0.23): a second copy of
//! the library would parse the 248K-token vocabulary again at start-up.

use std::sync::Arc;

use lily_tokenizer::Tokenizer;
use toktrie::{TokRxInfo, TokTrie, TokenId, TokenizerEnv};

use crate::GrammarError;

/// A tokenizer and its token trie, as llguidance's [`TokenizerEnv`].
pub struct Vocab {
    tokenizer: Arc<Tokenizer>,
    trie: TokTrie,
}

/// Whether an added token counts as special in the trie: the tokenizer's special tokens and every
/// added token written as a tag.
fn is_tag(text: &str) -> bool {
    text.len() > 2 && text.starts_with('<') && text.ends_with('>')
}

impl Vocab {
    /// The trie of `tokenizer`'s tokens; `stop_ids` (at least one, each below the vocabulary) end a
    /// generation, the first being the one a finished grammar forces.
    pub fn new(tokenizer: Arc<Tokenizer>, stop_ids: &[u32]) -> Result<Self, GrammarError> {
        let n = tokenizer.vocab_size();
        let Some(&eos) = stop_ids.first() else {
            return Err(GrammarError::Setup("no stop token: a grammar could never end".into()));
        };
        if let Some(&bad) = stop_ids.iter().find(|&&id| id as usize >= n) {
            return Err(GrammarError::Setup(format!("stop token {bad} is outside the vocabulary ({n} tokens)")));
        }
        let mut words: Vec<Vec<u8>> = Vec::with_capacity(n);
        for id in 0..n as u32 {
            // Ids the vocabulary skips (none in Qwen's) stay empty: the trie never offers them.
            words.push(tokenizer.token_bytes(id).unwrap_or_default());
        }
        for (id, text) in tokenizer.added_tokens() {
            if (id as usize) < n && (tokenizer.is_special(id) || is_tag(&text)) {
                let mut w = Vec::with_capacity(text.len() + 1);
                w.push(TokTrie::SPECIAL_TOKEN_MARKER);
                w.extend_from_slice(text.as_bytes());
                words[id as usize] = w;
            }
        }
        let info = TokRxInfo::new(n as u32, eos);
        let mut trie = TokTrie::from(&info, &words);
        if stop_ids.len() > 1 {
            trie = trie.with_eos_tokens(stop_ids);
        }
        Ok(Vocab { tokenizer, trie })
    }

    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    pub fn trie(&self) -> &TokTrie {
        &self.trie
    }
}

impl TokenizerEnv for Vocab {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    /// The tokenizer's own encoding of text the grammar forces (its canonical tokens, which is
    /// what the model saw in training), falling back to the trie for bytes that are not UTF-8.
    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        self.trie.tokenize_with_greedy_fallback(s, |text| match self.tokenizer.encode(text) {
            Ok(ids) => ids,
            // encode fails only on a broken tokenizer; the trie's greedy split is still right.
            Err(_) => self.trie.greedy_tokenize(text.as_bytes()),
        })
    }
}
