//! Structured outputs for lily: what a request may constrain its answer to — a JSON schema, any JSON
//! object, a regular expression, a list of choices, a Lark grammar, or tool calls in Qwen's own XML
//! format with arguments valid for each tool's schema — compiled by `llguidance` into a matcher
//! that gives, before each token, the set of tokens allowed next as a bitmask over the vocabulary.
//!
//! - [`Grammars`]: once per process and model: the vocabulary's token trie and llguidance's parser
//!   factory (about a second or two for Qwen's 248K tokens); compiles a request's [`Plan`] into a
//!   [`Constraint`] (milliseconds; a bad schema or grammar is a [`GrammarError::Invalid`] saying
//!   what is wrong).
//! - [`Constraint`]: a compiled request, cloned into a [`Session`] per generation.
//! - [`Session`]: the generation loop's view: whether the next token is masked, the mask itself
//!   (`u32` words, bit `id % 32` of word `id / 32` set when token `id` is allowed), the tokens that
//!   are certain next (fed without sampling), and the commit of each chosen token.
//!
//! **Reasoning first.** With thinking on, a constraint can wait for the model's own `</think>`:
//! the reasoning is free text, then `\n\n` (as the chat template writes it) and the grammar. Tool
//! calls in "auto" mode wait for the model's own `<tool_call>` token instead (anywhere: Qwen also
//! calls tools from inside its reasoning), then the call is constrained.
//!
//! The modules: `vocab` (the token trie over lily's tokenizer), `format` (answers: JSON, regex,
//! choice, Lark), `tools` (Qwen XML tool calls as a Lark grammar), `session` (gates, masks, forced
//! tokens).

mod format;
mod session;
mod tools;
mod vocab;

use std::sync::Arc;

use llguidance::api::TopLevelGrammar;
use llguidance::{Matcher, ParserFactory};
use lily_tokenizer::Tokenizer;
use toktrie::InferenceCapabilities;

pub use format::{Format, Whitespace};
pub use session::{Constraint, Session};
pub use tools::{resolve_property_refs, CallStart, CallTool, ToolCalls};
pub use vocab::Vocab;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GrammarError {
    /// The request's schema, grammar, regex or choices cannot be compiled (the message says why).
    #[error("{0}")]
    Invalid(String),
    /// The vocabulary could not be prepared.
    #[error("preparing the vocabulary for constrained decoding failed: {0}")]
    Setup(String),
    /// The matcher failed during generation (a grammar too complex for the per-token limits, or a
    /// token the mask did not allow).
    #[error("constrained decoding failed: {0}")]
    Generation(String),
}

/// What a request constrains.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Plan {
    /// The answer's form (`response_format`, `structured_outputs`).
    pub answer: Option<Format>,
    /// Tool calls the grammar writes (alone, or as the alternative to the answer).
    pub calls: Option<ToolCalls>,
    /// The prompt left the model thinking: the grammar starts after the model's `</think>`.
    pub after_reasoning: bool,
    /// The grammar starts at the model's own `<tool_call>` (text before it is free): the "auto"
    /// tool choice with strict tools.
    pub at_tool_call: bool,
}

/// The vocabulary and llguidance's parser factory, for one model.
pub struct Grammars {
    factory: ParserFactory,
    vocab_size: usize,
    /// The stop tokens, the one a finished grammar forces first.
    stops: Vec<u32>,
    think_end: Option<u32>,
    tool_call: Option<u32>,
    tool_call_end: Option<u32>,
    /// What the template writes after `</think>` (`\n\n`), as tokens.
    after_think: Vec<u32>,
}

impl Grammars {
    /// Builds the token trie of `tokenizer` and the parser factory. `stop_ids` end a generation
    /// (a complete grammar allows exactly these); the tokenizer's own end-of-sequence token comes
    /// first among them when present, as the one a finished grammar forces.
    pub fn new(tokenizer: Arc<Tokenizer>, stop_ids: &[u32]) -> Result<Self, GrammarError> {
        let mut stops: Vec<u32> = Vec::new();
        for id in tokenizer.eos_ids().into_iter().filter(|id| stop_ids.contains(id)).chain(stop_ids.iter().copied()) {
            if !stops.contains(&id) {
                stops.push(id);
            }
        }
        let vocab = Vocab::new(Arc::clone(&tokenizer), &stops)?;
        let caps = InferenceCapabilities { ff_tokens: true, conditional_ff_tokens: false, backtrack: false, fork: false };
        let env: toktrie::TokEnv = Arc::new(vocab);
        let mut slices = llguidance::earley::SlicedBiasComputer::general_slices();
        slices.extend(TEXT_SLICES.iter().map(|s| s.to_string()));
        let mut factory = ParserFactory::new(&env, caps, &slices).map_err(|e| GrammarError::Setup(e.to_string()))?;
        factory.quiet();
        let after_think = tokenizer.encode("\n\n").map_err(|e| GrammarError::Setup(e.to_string()))?;
        Ok(Grammars {
            factory,
            vocab_size: tokenizer.vocab_size(),
            stops,
            think_end: tokenizer.token_id("</think>"),
            tool_call: tokenizer.token_id("<tool_call>"),
            tool_call_end: tokenizer.token_id("</tool_call>"),
            after_think,
        })
    }

    /// Tokens in the vocabulary (the bitmask covers them: `vocab_size().div_ceil(32)` words).
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// The token a finished grammar forces (the end of the turn).
    pub fn eos(&self) -> u32 {
        self.stops[0]
    }

    /// Compiles `plan` (once per request).
    pub fn compile(&self, plan: &Plan) -> Result<Constraint, GrammarError> {
        let grammar = self.grammar(plan)?;
        let parser = self.factory.create_parser(grammar).map_err(|e| GrammarError::Invalid(clean_error(&e.to_string())))?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(GrammarError::Invalid(clean_error(&e)));
        }
        let need = |id: Option<u32>, what: &str| id.ok_or_else(|| GrammarError::Setup(format!("the vocabulary has no {what} token")));
        let think_end = if plan.after_reasoning { Some(need(self.think_end, "</think>")?) } else { None };
        let tool_call = if plan.at_tool_call { Some(need(self.tool_call, "<tool_call>")?) } else { None };
        Ok(Constraint::new(matcher, self.stops.clone(), think_end, self.after_think.clone(), tool_call))
    }

    fn grammar(&self, plan: &Plan) -> Result<TopLevelGrammar, GrammarError> {
        if plan.at_tool_call && plan.calls.as_ref().is_none_or(|c| c.start != CallStart::Open) {
            return Err(GrammarError::Invalid("a grammar that starts at the model's <tool_call> must write whole calls".into()));
        }
        match (&plan.answer, &plan.calls) {
            (None, None) => Err(GrammarError::Invalid("nothing to constrain".into())),
            (Some(answer), None) => answer.top_level(),
            (answer, Some(calls)) => {
                let ids = tools::Ids {
                    tool_call: self.tool_call.ok_or_else(|| GrammarError::Setup("the vocabulary has no <tool_call> token".into()))?,
                    tool_call_end: self
                        .tool_call_end
                        .ok_or_else(|| GrammarError::Setup("the vocabulary has no </tool_call> token".into()))?,
                };
                let mut lark = tools::lark(calls, &ids)?;
                let mut grammars = Vec::new();
                match answer {
                    None => lark.push_str("start: calls\n"),
                    Some(a) => {
                        let (rule, sub) = a.lark_rule("answer")?;
                        lark.push_str("start: answer | calls\n");
                        lark.push_str(&rule);
                        grammars.extend(sub);
                    }
                }
                let mut top = TopLevelGrammar::from_lark(lark);
                top.grammars.extend(grammars);
                Ok(top)
            }
        }
    }
}

/// Token classes whose masks llguidance precomputes (its "slices"), beside its JSON-string ones:
/// runs of text without `<`, which every raw tool-call value admits (its only exclusions are markup
/// tags), in the lengths a bounded value can still take. Without them each token of a raw value
/// walks the whole 248K-token trie (about 6 ms on one core instead of tens of µs).
const TEXT_SLICES: [&str; 3] = [r"[^<]{1,10}", r"[^<]{1,30}", r"[^<]+"];

/// llguidance's errors can carry a long trace; keep the message's first lines.
fn clean_error(e: &str) -> String {
    let mut out = String::new();
    for line in e.lines().filter(|l| !l.trim().is_empty()).take(4) {
        if !out.is_empty() {
            out.push_str("; ");
        }
        out.push_str(line.trim());
    }
    if out.len() > 600 {
        let mut cut = 600;
        while !out.is_char_boundary(cut) {
            cut -= 1;
        }
        out.truncate(cut);
        out.push('…');
    }
    out
}
