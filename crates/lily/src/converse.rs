//! What `lily run` and `lily chat` share: the generation flags, rendering a conversation with the
//! checkpoint's chat template, and streaming one answer to the terminal — reasoning dimmed on
//! stderr, the answer on stdout — with the speed after it; and the answer's constraint
//! (`--json-schema`, `--json`).

use std::io::{IsTerminal, Write};
use std::sync::atomic::{AtomicBool, Ordering};

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Context, Result};
use lily_engine::{generate_cached, ChatModel, Flow, GenSpec, LoadedState, Outcome, PrefixCache};
use lily_grammar::{Format, Grammars, Plan, Whitespace};
use lily_parser::{Event, OutputParser, ParsedMessage, ParserConfig};
use lily_sampler::SamplingParams;
use serde_json::{json, Map, Value};

#[derive(clap::Args, Clone, Debug)]
pub struct GenArgs {
    /// Most tokens to generate for one answer.
    #[arg(short = 'n', long, visible_alias = "n-predict", default_value_t = 2048)]
    pub max_tokens: usize,
    /// Sampling temperature (0 = greedy). Unset: the checkpoint's generation_config.json.
    #[arg(long, visible_alias = "temp")]
    pub temperature: Option<f32>,
    #[arg(long)]
    pub top_p: Option<f32>,
    #[arg(long)]
    pub top_k: Option<i32>,
    #[arg(long)]
    pub min_p: Option<f32>,
    #[arg(long)]
    pub presence_penalty: Option<f32>,
    #[arg(long)]
    pub repetition_penalty: Option<f32>,
    /// Seed for reproducible sampling.
    #[arg(short = 's', long)]
    pub seed: Option<u64>,
    /// Answer without thinking first (the template's enable_thinking=false).
    #[arg(long)]
    pub no_think: bool,
    /// A system prompt.
    #[arg(long)]
    pub system: Option<String>,
    /// Constrain the answer to JSON valid for the JSON Schema in FILE (after the reasoning, when
    /// thinking is on).
    #[arg(long, value_name = "FILE", conflicts_with = "json")]
    pub json_schema: Option<PathBuf>,
    /// Constrain the answer to a JSON object.
    #[arg(long)]
    pub json: bool,
}

/// The answer's constraint from `--json-schema` / `--json`: the model's grammar factory and the
/// format, compiled for each prompt (whether it leaves the model thinking decides where it starts).
pub struct Structured {
    grammars: Grammars,
    format: Format,
}

impl Structured {
    /// Sets `spec`'s constraint for `prompt`.
    pub fn constrain(&self, spec: &mut GenSpec, prompt: &Prompt) -> Result<()> {
        let plan = Plan { answer: Some(self.format.clone()), after_reasoning: prompt.thinking, ..Default::default() };
        spec.constraint = Some(self.grammars.compile(&plan)?);
        Ok(())
    }
}

impl GenArgs {
    pub fn spec(&self, m: &ChatModel) -> GenSpec {
        GenSpec {
            sampling: SamplingParams {
                temperature: self.temperature,
                top_p: self.top_p,
                top_k: self.top_k,
                min_p: self.min_p,
                presence_penalty: self.presence_penalty,
                repetition_penalty: self.repetition_penalty,
                seed: self.seed,
                ..Default::default()
            },
            defaults: m.defaults.clone(),
            stop_strings: Vec::new(),
            stop_ids: m.stop_ids.clone(),
            max_tokens: Some(self.max_tokens),
            skip_special: true,
            constraint: None,
        }
    }
    /// The constraint `--json-schema` or `--json` asks for (the schema checked now: a bad one is an
    /// error naming the file).
    pub fn structured(&self, m: &ChatModel) -> Result<Option<Structured>> {
        let format = match (&self.json_schema, self.json) {
            (Some(path), _) => {
                let text = std::fs::read_to_string(path).with_context(|| format!("--json-schema {}", path.display()))?;
                let schema: Value =
                    serde_json::from_str(&text).with_context(|| format!("--json-schema {}: not valid JSON", path.display()))?;
                Format::JsonSchema { schema, strict: true, whitespace: Whitespace::Bounded }
            }
            (None, true) => Format::JsonObject { whitespace: Whitespace::Bounded },
            (None, false) => return Ok(None),
        };
        let grammars = Grammars::new(Arc::new(m.tokenizer.clone()), &m.stop_ids)?;
        let st = Structured { grammars, format };
        // Compile once now, so a bad schema fails before any model work.
        st.grammars.compile(&Plan { answer: Some(st.format.clone()), ..Default::default() }).map_err(|e| match &self.json_schema {
            Some(p) => anyhow::anyhow!("--json-schema {}: {e}", p.display()),
            None => anyhow::anyhow!("--json: {e}"),
        })?;
        Ok(Some(st))
    }
    pub fn kwargs(&self) -> Map<String, Value> {
        let mut k = Map::new();
        if self.no_think {
            k.insert("enable_thinking".into(), json!(false));
        }
        k
    }
}

pub fn dim(on: bool, s: &str) -> String {
    if on {
        format!("\x1b[2m{s}\x1b[0m")
    } else {
        s.to_string()
    }
}

/// One rendered turn: the prompt's history (what a later turn will share) and the full prompt.
pub struct Prompt {
    /// Prompt tokens that are conversation history (a prefix of `full`; 0 if none).
    pub history: usize,
    pub full: Vec<u32>,
    pub thinking: bool,
}

pub fn render(m: &ChatModel, messages: &[Value], kwargs: &Map<String, Value>) -> Result<Prompt> {
    let full_text = m.template.render(messages, None, true, kwargs)?;
    let history_text = m.template.render(messages, None, false, kwargs)?;
    let ids = m.tokenizer.encode(&history_text)?;
    let full = match full_text.strip_prefix(history_text.as_str()) {
        Some(rest) => m.tokenizer.encode_after(&history_text, &ids, rest)?,
        None => m.tokenizer.encode(&full_text)?,
    };
    let history = if full.starts_with(&ids) && ids.len() < full.len() { ids.len() } else { 0 };
    let thinking = full_text.trim_end().ends_with("<think>");
    Ok(Prompt { history, full, thinking })
}

/// Generates one answer to `prompt`, streaming it to the terminal; reuses and refills `cache`.
pub fn answer(
    m: &mut ChatModel,
    cache: &mut PrefixCache<LoadedState>,
    prompt: &Prompt,
    spec: &GenSpec,
    stop: &AtomicBool,
) -> Result<(ParsedMessage, Outcome, usize)> {
    let tty_err = std::io::stderr().is_terminal();
    answer_to(m, cache, prompt, spec, stop, &mut std::io::stdout(), &mut std::io::stderr(), tty_err)
}

/// [`answer`], the answer written to `out` and the reasoning to `err` (dimmed when `dim_err`).
/// Once `stop` is set nothing more is written: the text of the token being generated, and any
/// held back, are dropped (and left out of the message returned, so the history holds what the
/// user saw).
#[allow(clippy::too_many_arguments)]
pub fn answer_to(
    m: &mut ChatModel,
    cache: &mut PrefixCache<LoadedState>,
    prompt: &Prompt,
    spec: &GenSpec,
    stop: &AtomicBool,
    out: &mut dyn Write,
    err: &mut dyn Write,
    dim_err: bool,
) -> Result<(ParsedMessage, Outcome, usize)> {
    let tty_err = dim_err;
    let backend = &mut m.model;
    let mut parser = OutputParser::new(ParserConfig { reasoning: prompt.thinking, tools: Vec::new(), id_seed: None });
    let (out, err) = (out, err);
    let mut show = |events: Vec<Event>| {
        for e in events {
            match e {
                Event::Reasoning(t) => {
                    let _ = write!(err, "{}", dim(tty_err, &t));
                    let _ = err.flush();
                }
                Event::Content(t) => {
                    let _ = write!(out, "{t}");
                    let _ = out.flush();
                }
                Event::ToolCallStart { name, .. } => {
                    let _ = write!(out, "\n[tool call {name}] ");
                }
                Event::ToolCallArguments { fragment, .. } => {
                    let _ = write!(out, "{fragment}");
                }
                Event::ToolCallEnd { .. } => {
                    let _ = writeln!(out);
                }
            }
        }
    };
    let done = generate_cached(backend, cache, &prompt.full, prompt.history, &m.tokenizer, spec, |_| Flow::Continue, |step| {
        // Ctrl-C came while this token was being made: it is not shown.
        if stop.load(Ordering::Relaxed) {
            return Flow::Cancel;
        }
        show(parser.push(step.text));
        Flow::Continue
    })?;
    let Some(done) = done else { anyhow::bail!("generation was cancelled before it started") };
    let (outcome, cached) = (done.outcome, done.cached_tokens);
    if outcome.finish != lily_engine::FinishReason::Cancelled {
        show(parser.push(&outcome.trailing_text));
    }
    let (events, message) = parser.finish();
    if outcome.finish != lily_engine::FinishReason::Cancelled {
        show(events);
    }
    Ok((message, outcome, cached))
}

pub fn speed_line(o: &Outcome, cached: usize) -> String {
    format!(
        "[{} prompt tokens ({} cached) at {:.1} tok/s, {} generated at {:.1} tok/s, {}]",
        o.prefilled + cached,
        cached,
        o.prefill_tok_s(),
        o.tokens.len(),
        o.decode_tok_s(),
        match o.finish {
            lily_engine::FinishReason::Cancelled => "stopped",
            ref f => f.as_str(),
        }
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicBool;

    /// A terminal that presses Ctrl-C as soon as it shows something, and counts what it is given
    /// after that.
    struct Tripwire<'a> {
        stop: &'a AtomicBool,
        shown: usize,
        after_stop: usize,
    }

    impl Write for Tripwire<'_> {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            if self.stop.load(Ordering::SeqCst) {
                self.after_stop += b.len();
            } else if !b.is_empty() {
                self.shown += b.len();
                self.stop.store(true, Ordering::SeqCst);
            }
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    fn model() -> ChatModel {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tiny-a/mlx");
        ChatModel::open(&dir, lily_engine::BackendKind::Cpu, &Default::default()).unwrap()
    }

    fn args() -> GenArgs {
        GenArgs {
            max_tokens: 60,
            temperature: Some(0.0),
            top_p: None,
            top_k: None,
            min_p: None,
            presence_penalty: None,
            repetition_penalty: None,
            seed: None,
            no_think: false,
            system: None,
            json_schema: None,
            json: false,
        }
    }

    #[test]
    fn nothing_is_printed_after_ctrl_c() {
        let mut m = model();
        let messages = vec![json!({"role": "user", "content": "Hello"})];
        let p = render(&m, &messages, &Map::new()).unwrap();
        let spec = args().spec(&m);
        let stop = AtomicBool::new(false);
        let mut cache = PrefixCache::new(0);
        let (mut out, mut err) = (Tripwire { stop: &stop, shown: 0, after_stop: 0 }, Tripwire { stop: &stop, shown: 0, after_stop: 0 });
        let (_, outcome, _) = answer_to(&mut m, &mut cache, &p, &spec, &stop, &mut out, &mut err, false).unwrap();
        assert!(out.shown + err.shown > 0, "something was shown before Ctrl-C");
        assert_eq!((out.after_stop, err.after_stop), (0, 0), "text printed after Ctrl-C");
        assert_eq!(outcome.finish, lily_engine::FinishReason::Cancelled);
        assert!(outcome.tokens.len() < 60);
        assert!(speed_line(&outcome, 0).ends_with("stopped]"));

        // Ctrl-C before the first token: nothing at all.
        let stop = AtomicBool::new(true);
        let (mut out, mut err) = (Tripwire { stop: &stop, shown: 0, after_stop: 0 }, Tripwire { stop: &stop, shown: 0, after_stop: 0 });
        let (msg, outcome, _) = answer_to(&mut m, &mut cache, &p, &spec, &stop, &mut out, &mut err, false).unwrap();
        assert_eq!(out.after_stop + err.after_stop + out.shown + err.shown, 0);
        assert_eq!(outcome.tokens.len(), 1);
        assert!(msg.content.unwrap_or_default().is_empty() && msg.reasoning.unwrap_or_default().is_empty());
    }
}
