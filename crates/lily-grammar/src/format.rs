//! Answer formats: what `response_format` and `structured_outputs` ask for (a JSON schema, any JSON
//! object, a regex, one of a list of strings, a Lark grammar), as llguidance grammars — whole, or as
//! one rule of a larger Lark grammar (the answer beside tool calls).

use llguidance::api::{GrammarWithLexer, TopLevelGrammar};
use serde_json::{json, Value};

use crate::GrammarError;

/// Whitespace a JSON answer may hold between its tokens.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Whitespace {
    /// Up to 20 spaces, tabs or newlines in each gap (room for indentation, as llama.cpp allows;
    /// bounded, so a model cannot wander off into endless blank space).
    #[default]
    Bounded,
    /// None at all (vLLM's `disable_any_whitespace`).
    None,
}

/// The skipped span between two JSON tokens, when [`Whitespace::Bounded`].
const BOUNDED_WHITESPACE: &str = r"[\x20\x0A\x0D\x09]{1,20}";

/// An answer's form.
#[derive(Clone, Debug, PartialEq)]
pub enum Format {
    /// Any JSON object (`response_format: {"type": "json_object"}`).
    JsonObject { whitespace: Whitespace },
    /// JSON valid for `schema` (`json_schema`). Not `strict`: keywords llguidance does not
    /// implement are ignored (with `strict` they are an error).
    JsonSchema { schema: Value, strict: bool, whitespace: Whitespace },
    /// Text that matches the regular expression as a whole (Rust `regex` syntax).
    Regex(String),
    /// Exactly one of these strings.
    Choice(Vec<String>),
    /// A grammar in llguidance's Lark dialect (`start:` is the answer).
    Lark(String),
}

impl Format {
    /// The schema with llguidance's compile options (whitespace, strictness) set, unless the
    /// schema sets its own (`x-guidance`).
    fn schema(&self) -> Result<Value, GrammarError> {
        let (schema, strict, ws) = match self {
            Format::JsonObject { whitespace } => (json!({"type": "object"}), true, *whitespace),
            Format::JsonSchema { schema, strict, whitespace } => (schema.clone(), *strict, *whitespace),
            _ => unreachable!("only JSON formats have a schema"),
        };
        let mut schema = match schema {
            Value::Object(m) => m,
            Value::Bool(true) => serde_json::Map::new(),
            Value::Bool(false) => return Err(GrammarError::Invalid("the schema `false` admits no value".into())),
            other => return Err(GrammarError::Invalid(format!("a JSON schema must be an object, got {other}"))),
        };
        if !schema.contains_key("x-guidance") {
            let opts = match ws {
                Whitespace::Bounded => json!({"whitespace_flexible": true, "whitespace_pattern": BOUNDED_WHITESPACE, "lenient": !strict}),
                Whitespace::None => json!({"whitespace_flexible": false, "lenient": !strict}),
            };
            schema.insert("x-guidance".into(), opts);
        }
        Ok(Value::Object(schema))
    }

    /// The whole grammar, when the answer is all there is.
    pub(crate) fn top_level(&self) -> Result<TopLevelGrammar, GrammarError> {
        Ok(match self {
            Format::JsonObject { .. } | Format::JsonSchema { .. } => TopLevelGrammar::from_json_schema(self.schema()?),
            Format::Regex(rx) => TopLevelGrammar::from_regex(rx),
            Format::Choice(choices) => TopLevelGrammar::from_regex(&choice_regex(choices)?),
            Format::Lark(text) => TopLevelGrammar::from_lark(lark_text(text)?),
        })
    }

    /// The answer as the Lark rule `name` (for `start: answer | calls`), and any grammar it refers to.
    pub(crate) fn lark_rule(&self, name: &str) -> Result<(String, Vec<GrammarWithLexer>), GrammarError> {
        Ok(match self {
            Format::JsonObject { .. } | Format::JsonSchema { .. } => (format!("{name}: %json {}\n", self.schema()?), Vec::new()),
            Format::Regex(rx) => (format!("{name}: /{}/\n", llguidance::regex_to_lark(rx, "")), Vec::new()),
            Format::Choice(choices) => {
                let alts: Vec<String> = nonempty(choices)?.iter().map(|c| lark_string(c)).collect();
                (format!("{name}: {}\n", alts.join(" | ")), Vec::new())
            }
            Format::Lark(text) => {
                let sub = format!("{name}_grammar");
                let mut g = GrammarWithLexer::from_lark(lark_text(text)?);
                g.name = Some(sub.clone());
                (format!("{name}: @{sub}\n"), vec![g])
            }
        })
    }
}

fn nonempty(choices: &[String]) -> Result<&[String], GrammarError> {
    if choices.is_empty() {
        return Err(GrammarError::Invalid("the list of choices is empty".into()));
    }
    Ok(choices)
}

/// One of `choices`, exactly.
fn choice_regex(choices: &[String]) -> Result<String, GrammarError> {
    Ok(nonempty(choices)?.iter().map(|c| regex_syntax::escape(c)).collect::<Vec<_>>().join("|"))
}

/// A Lark string literal for `s` (the Lark reader takes JSON string syntax).
pub(crate) fn lark_string(s: &str) -> String {
    serde_json::to_string(s).expect("a string serialises")
}

fn lark_text(text: &str) -> Result<String, GrammarError> {
    if text.trim().is_empty() {
        return Err(GrammarError::Invalid("the grammar is empty".into()));
    }
    if text.contains("::=") {
        return Err(GrammarError::Invalid(
            "this looks like a GBNF grammar (`::=`); lily takes grammars in llguidance's Lark syntax (`rule: ...`, `start:` first)".into(),
        ));
    }
    Ok(text.to_string())
}
