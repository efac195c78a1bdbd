//! What `lily run` and `lily chat` share: the generation flags, rendering a conversation with the
//! checkpoint's chat template, and streaming one answer to the terminal — reasoning dimmed on
//! stderr, the answer on stdout — with the speed after it.

use std::io::{IsTerminal, Write};
use std::sync::atomic::{AtomicBool, Ordering};

use anyhow::Result;
use lily_engine::{generate, ChatModel, Flow, GenSpec, LoadedModel, Outcome, PrefixCache};
use lily_parser::{Event, OutputParser, ParsedMessage, ParserConfig};
use lily_sampler::SamplingParams;
use serde_json::{json, Map, Value};

#[derive(clap::Args, Clone, Debug)]
pub struct GenArgs {
    /// Most tokens to generate for one answer.
    #[arg(long, default_value_t = 2048)]
    pub max_tokens: usize,
    /// Sampling temperature (0 = greedy). Unset: the checkpoint's generation_config.json.
    #[arg(long)]
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
    #[arg(long)]
    pub seed: Option<u64>,
    /// Answer without thinking first (the template's enable_thinking=false).
    #[arg(long)]
    pub no_think: bool,
    /// A system prompt.
    #[arg(long)]
    pub system: Option<String>,
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
        }
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
    pub history: Vec<u32>,
    pub full: Vec<u32>,
    pub thinking: bool,
}

pub fn render(m: &ChatModel, messages: &[Value], kwargs: &Map<String, Value>) -> Result<Prompt> {
    let full_text = m.template.render(messages, None, true, kwargs)?;
    let history_text = m.template.render(messages, None, false, kwargs)?;
    let full = m.tokenizer.encode(&full_text)?;
    let mut history = m.tokenizer.encode(&history_text)?;
    if !full.starts_with(&history) || history.len() >= full.len() {
        history.clear();
    }
    let thinking = full_text.trim_end().ends_with("<think>");
    Ok(Prompt { history, full, thinking })
}

/// Generates one answer to `prompt`, streaming it; reuses and refills `cache`.
pub fn answer(
    m: &mut ChatModel,
    cache: &mut PrefixCache<lily_cpu::State>,
    prompt: &Prompt,
    spec: &GenSpec,
    stop: &AtomicBool,
) -> Result<(ParsedMessage, Outcome, usize)> {
    let tty_err = std::io::stderr().is_terminal();
    let LoadedModel::Cpu(backend) = &mut m.model;
    let (cached, mut state) = match cache.lookup(&prompt.full) {
        Some((n, s)) => (n, s),
        None => (0, lily_model::Backend::new_state(backend)),
    };
    let t = std::time::Instant::now();
    let mut history_run = 0;
    if prompt.history.len() > cached {
        history_run = prompt.history.len() - cached;
        lily_engine::generate::prefill(backend, &mut state, &prompt.history[cached..])?;
        let bytes = lily_model::Backend::state_bytes(backend, &state);
        cache.insert(prompt.history.clone(), state.clone(), bytes);
    }
    let history_time = t.elapsed();
    let mut parser = OutputParser::new(ParserConfig { reasoning: prompt.thinking, tools: Vec::new(), id_seed: None });
    let mut out = std::io::stdout();
    let mut err = std::io::stderr();
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
    let outcome = generate(backend, &mut state, &prompt.full, &m.tokenizer, spec, |step| {
        show(parser.push(step.text));
        if stop.load(Ordering::Relaxed) {
            Flow::Cancel
        } else {
            Flow::Continue
        }
    })?;
    let mut outcome = outcome;
    outcome.prefilled += history_run;
    outcome.prefill_time += history_time;
    show(parser.push(&outcome.trailing_text));
    let (events, message) = parser.finish();
    show(events);
    // The state now holds the prompt and every generated token but the last.
    let mut tokens = prompt.full.clone();
    tokens.extend_from_slice(&outcome.tokens[..outcome.tokens.len().saturating_sub(1)]);
    let bytes = lily_model::Backend::state_bytes(backend, &state);
    cache.insert(tokens, state, bytes);
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
        o.finish.as_str()
    )
}
