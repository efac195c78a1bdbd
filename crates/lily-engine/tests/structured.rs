//! The generation loop under a grammar, on the CPU with a tiny random model (tiny-b: its own
//! 368-token byte-level vocabulary, so masks are cheap and many requests run fast):
//! - constrained output always parses and validates against the schema (sampled with several
//!   seeds), where the same requests unconstrained are not JSON at all;
//! - a backend that applies the mask "on the device" (its mask callback, then `pick_on_cpu_masked`)
//!   generates exactly what the host path generates, greedy and seeded, with penalties and bias;
//! - reasoning first: with the gate on `</think>`, the text before it is free and what follows is
//!   `\n\n` and valid JSON;
//! - certain tokens are fed without sampling, unless log-probabilities are wanted;
//! - the prefix cache's end snapshot holds exactly what the state ran.

use std::path::PathBuf;
use std::sync::Arc;

use lily_cpu::CpuModel;
use lily_engine::{generate, generate_cached, Flow, GenSpec, Outcome, PrefixCache};
use lily_grammar::{Format, Grammars, Plan, Whitespace};
use lily_model::{Backend, BackendError, DevicePick, LoadOptions, Logits, MaskFill, ModelConfig, ModelWeights};
use lily_sampler::{pick_on_cpu_masked, SamplingParams};
use lily_tokenizer::Tokenizer;
use serde_json::{json, Value};

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tiny-b/mlx")
}

struct Setup {
    w: Arc<ModelWeights>,
    tok: Arc<Tokenizer>,
    grammars: Grammars,
    stop_ids: Vec<u32>,
}

fn setup() -> Setup {
    let dir = fixture();
    let w = Arc::new(ModelWeights::load(&dir, &LoadOptions::default()).unwrap());
    let tok = Arc::new(Tokenizer::from_dir(&dir).unwrap());
    let stop_ids = vec![tok.token_id("<|im_end|>").unwrap(), tok.token_id("<|endoftext|>").unwrap()];
    let grammars = Grammars::new(Arc::clone(&tok), &stop_ids).unwrap();
    Setup { w, tok, grammars, stop_ids }
}

/// The CPU model, choosing tokens and applying masks "on the device".
struct Masking {
    inner: CpuModel,
    masked_picks: usize,
}

impl Backend for Masking {
    type State = lily_cpu::State;
    fn name(&self) -> &'static str {
        "masking-cpu"
    }
    fn config(&self) -> &ModelConfig {
        self.inner.config()
    }
    fn new_state(&self) -> Self::State {
        self.inner.new_state()
    }
    fn state_len(&self, s: &Self::State) -> usize {
        self.inner.state_len(s)
    }
    fn state_bytes(&self, s: &Self::State) -> usize {
        self.inner.state_bytes(s)
    }
    fn forward(&mut self, s: &mut Self::State, tokens: &[u32], logits: Logits) -> Result<Vec<f32>, BackendError> {
        self.inner.forward(s, tokens, logits)
    }
    fn picks_on_device(&self) -> bool {
        true
    }
    fn forward_pick(&mut self, s: &mut Self::State, tokens: &[u32], pick: &DevicePick) -> Result<u32, BackendError> {
        let mut logits = self.inner.forward(s, tokens, Logits::Last)?;
        Ok(pick_on_cpu_masked(&mut logits, pick, None))
    }
    fn masks_on_device(&self) -> bool {
        true
    }
    fn forward_pick_masked(&mut self, s: &mut Self::State, tokens: &[u32], pick: &DevicePick, fill: &mut MaskFill<'_>) -> Result<u32, BackendError> {
        let mut logits = self.inner.forward(s, tokens, Logits::Last)?;
        let mut mask = vec![0u32; pick.vocab.div_ceil(32)];
        fill(&mut mask)?;
        self.masked_picks += 1;
        Ok(pick_on_cpu_masked(&mut logits, pick, Some(&mask)))
    }
}

fn prompt(tok: &Tokenizer) -> Vec<u32> {
    tok.encode("<|im_start|>user\nGive me JSON.<|im_end|>\n<|im_start|>assistant\n").unwrap()
}

fn run<B: Backend>(b: &mut B, s: &Setup, spec: &GenSpec) -> (Outcome, String, Vec<Option<f32>>) {
    let mut state = b.new_state();
    let mut text = String::new();
    let mut lps = Vec::new();
    let out = generate(b, &mut state, &prompt(&s.tok), &s.tok, spec, |step| {
        text.push_str(step.text);
        lps.push(step.logprob);
        Flow::Continue
    })
    .unwrap();
    text.push_str(&out.trailing_text);
    (out, text, lps)
}

fn schema_spec(s: &Setup, schema: &Value, sampling: SamplingParams, after_reasoning: bool) -> GenSpec {
    let plan = Plan {
        answer: Some(Format::JsonSchema { schema: schema.clone(), strict: true, whitespace: Whitespace::Bounded }),
        after_reasoning,
        ..Default::default()
    };
    GenSpec {
        sampling,
        stop_ids: s.stop_ids.clone(),
        max_tokens: Some(400),
        skip_special: true,
        constraint: Some(s.grammars.compile(&plan).unwrap()),
        ..Default::default()
    }
}

fn schemas() -> Vec<Value> {
    vec![
        json!({"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": -5, "maximum": 5}},
               "required": ["ok", "n"], "additionalProperties": false}),
        json!({"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 4}),
        json!({"type": "object", "properties": {"id": {"type": "string", "pattern": "^[a-f0-9]{4}$"},
               "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2}},
               "required": ["id"], "additionalProperties": false}),
        json!({"anyOf": [{"type": "null"}, {"type": "object", "properties": {"x": {"type": "number", "minimum": 0, "maximum": 1}},
               "required": ["x"], "additionalProperties": false}]}),
    ]
}

fn validate(schema: &Value, text: &str) -> Result<Value, String> {
    let v: Value = serde_json::from_str(text.trim()).map_err(|e| format!("not JSON ({e}): {text:?}"))?;
    let validator = jsonschema::validator_for(schema).unwrap();
    validator.validate(&v).map_err(|e| format!("invalid ({e}): {text}"))?;
    Ok(v)
}

#[test]
fn constrained_output_validates_where_unconstrained_output_is_not_json() {
    let s = setup();
    let mut host = CpuModel::new(Arc::clone(&s.w));
    for (i, schema) in schemas().iter().enumerate() {
        for seed in 0..4u64 {
            let sampling = SamplingParams { temperature: Some(1.0), seed: Some(seed), ..Default::default() };
            let spec = schema_spec(&s, schema, sampling.clone(), false);
            let (out, text, _) = run(&mut host, &s, &spec);
            assert_eq!(out.finish, lily_engine::FinishReason::Stop, "schema {i} seed {seed}: {text:?}");
            assert_eq!(out.tokens.last(), Some(&s.stop_ids[0]), "the turn ends with the end-of-turn token");
            validate(schema, &text).unwrap_or_else(|e| panic!("schema {i} seed {seed}: {e}"));
            assert!(out.masked_steps > 0 && out.masked_steps + out.forced_tokens >= out.tokens.len());
            // The same request without the grammar: not JSON.
            let free = GenSpec { constraint: None, max_tokens: Some(out.tokens.len().max(8)), ..spec };
            let (_, free_text, _) = run(&mut host, &s, &free);
            assert!(serde_json::from_str::<Value>(free_text.trim()).is_err(), "schema {i} seed {seed}: unconstrained output parsed: {free_text:?}");
        }
    }
}

#[test]
fn device_masking_generates_what_the_host_path_generates() {
    let s = setup();
    let schema = &schemas()[2];
    let cases = [
        SamplingParams { temperature: Some(0.0), ..Default::default() },
        SamplingParams { temperature: Some(0.9), top_p: Some(0.9), seed: Some(7), ..Default::default() },
        SamplingParams {
            temperature: Some(0.7),
            top_k: Some(20),
            presence_penalty: Some(0.5),
            repetition_penalty: Some(1.2),
            logit_bias: vec![(1, 3.0), (20, -2.0)],
            seed: Some(3),
            ..Default::default()
        },
    ];
    for sampling in cases {
        let spec = schema_spec(&s, schema, sampling.clone(), false);
        let mut host = CpuModel::new(Arc::clone(&s.w));
        let mut dev = Masking { inner: CpuModel::new(Arc::clone(&s.w)), masked_picks: 0 };
        let (want, want_text, _) = run(&mut host, &s, &spec);
        let (got, got_text, _) = run(&mut dev, &s, &spec);
        assert_eq!(got.tokens, want.tokens, "{sampling:?}: {got_text:?} vs {want_text:?}");
        assert_eq!(dev.masked_picks, got.masked_steps, "every masked step went through the device's mask");
        assert!(dev.masked_picks > 0);
        validate(schema, &got_text).unwrap();
    }
}

#[test]
fn reasoning_comes_first_then_the_grammar() {
    let s = setup();
    let think_end = s.tok.token_id("</think>").unwrap();
    let schema = &schemas()[0];
    let mut host = CpuModel::new(Arc::clone(&s.w));
    let mut saw_reasoning = 0;
    for seed in 0..4u64 {
        // A bias makes the tiny model close its reasoning after a few tokens (the grammar then
        // masks `</think>` out), and keeps it from ending the turn while it reasons (the grammar
        // still ends it: a one-token mask wins over any bias).
        let bias = vec![(think_end, 4.0), (s.stop_ids[0], -100.0), (s.stop_ids[1], -100.0)];
        let sampling = SamplingParams { temperature: Some(1.0), seed: Some(seed), logit_bias: bias, ..Default::default() };
        let mut spec = schema_spec(&s, schema, sampling, true);
        spec.skip_special = false;
        let (out, text, _) = run(&mut host, &s, &spec);
        assert_eq!(out.finish, lily_engine::FinishReason::Stop, "{text:?}");
        let (reasoning, answer) = text.split_once("</think>").unwrap_or_else(|| panic!("no </think>: {text:?}"));
        assert!(!reasoning.contains("</think>"));
        assert_eq!(out.tokens.last(), Some(&s.stop_ids[0]), "the turn ends with the end-of-turn token");
        assert!(answer.starts_with("\n\n"), "the template's blank line follows </think>: {answer:?}");
        validate(schema, answer).unwrap_or_else(|e| panic!("seed {seed}: {e}"));
        saw_reasoning += usize::from(!reasoning.trim().is_empty());
    }
    assert!(saw_reasoning > 0, "the reasoning was always empty: the test would not show it is free");
}

#[test]
fn certain_tokens_ride_without_sampling_unless_logprobs_are_wanted() {
    let s = setup();
    // A fixed key: `{"answer":` is certain before any choice.
    let schema = json!({"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"], "additionalProperties": false});
    let mut host = CpuModel::new(Arc::clone(&s.w));
    let greedy = SamplingParams { temperature: Some(0.0), ..Default::default() };
    let (out, text, _) = run(&mut host, &s, &schema_spec(&s, &schema, greedy.clone(), false));
    validate(&schema, &text).unwrap();
    assert!(out.forced_tokens > 0, "{out:?}");
    assert_eq!(out.masked_steps + out.forced_tokens, out.tokens.len());
    let with_lp = SamplingParams { logprobs: true, ..greedy };
    let (out, text, lps) = run(&mut host, &s, &schema_spec(&s, &schema, with_lp, false));
    validate(&schema, &text).unwrap();
    assert_eq!(out.forced_tokens, 0);
    assert!(lps.iter().all(Option::is_some), "every token has its log-probability");
}

#[test]
fn the_end_snapshot_holds_what_the_state_ran() {
    let s = setup();
    let schema = json!({"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"], "additionalProperties": false});
    let spec = schema_spec(&s, &schema, SamplingParams { temperature: Some(0.0), ..Default::default() }, false);
    let mut m = CpuModel::new(Arc::clone(&s.w));
    let mut cache = PrefixCache::new(1 << 30);
    let p = prompt(&s.tok);
    let first = generate_cached(&mut m, &mut cache, &p, 0, &s.tok, &spec, |_| Flow::Continue, |_| Flow::Continue).unwrap().unwrap();
    // Ask again with the answer as the prompt's continuation: the snapshot is a prefix of it, and
    // the cached run continues exactly as a cold one.
    let mut longer = p.clone();
    longer.extend_from_slice(&first.outcome.tokens);
    longer.extend(s.tok.encode("\n<|im_start|>user\nAgain.<|im_end|>\n<|im_start|>assistant\n").unwrap());
    let warm = generate_cached(&mut m, &mut cache, &longer, 0, &s.tok, &spec, |_| Flow::Continue, |_| Flow::Continue).unwrap().unwrap();
    assert!(warm.cached_tokens > p.len(), "the end snapshot was not reused: {}", warm.cached_tokens);
    let mut cold_state = m.new_state();
    let cold = generate(&mut m, &mut cold_state, &longer, &s.tok, &spec, |_| Flow::Continue).unwrap();
    assert_eq!(warm.outcome.tokens, cold.tokens);
}

#[test]
fn several_snapshot_points_each_keep_a_snapshot_that_later_prompts_resume_from() {
    // generate_cached_at: the end of a system prompt and the end of the history are both kept, so a
    // prompt sharing only the system prompt resumes from there, and answers as a cold run does.
    let s = setup();
    let spec = GenSpec {
        sampling: SamplingParams { temperature: Some(0.0), ..Default::default() },
        stop_ids: s.stop_ids.clone(),
        max_tokens: Some(4),
        skip_special: true,
        ..Default::default()
    };
    let mut m = CpuModel::new(Arc::clone(&s.w));
    let mut cache = PrefixCache::new(1 << 30);
    let system = s.tok.encode("<|im_start|>system\nYou are a helpful assistant who answers in one line.<|im_end|>\n").unwrap();
    let turn = |q: &str| s.tok.encode(&format!("<|im_start|>user\n{q}<|im_end|>\n")).unwrap();
    let gen_prompt = s.tok.encode("<|im_start|>assistant\n").unwrap();
    let mut a = system.clone();
    a.extend(turn("What is the capital of France?"));
    let history = a.len();
    a.extend(&gen_prompt);
    let first = lily_engine::generate_cached_at(&mut m, &mut cache, &a, &[system.len(), history], &s.tok, &spec, |_| Flow::Continue, |_| Flow::Continue)
        .unwrap()
        .unwrap();
    assert_eq!(first.cached_tokens, 0);
    assert_eq!(first.outcome.prefilled, a.len(), "every prompt token ran once, across the two points and the rest");
    // Another first question: only the system prompt is shared.
    let mut b = system.clone();
    b.extend(turn("Name a large river."));
    b.extend(&gen_prompt);
    let warm = lily_engine::generate_cached_at(&mut m, &mut cache, &b, &[system.len()], &s.tok, &spec, |_| Flow::Continue, |_| Flow::Continue).unwrap().unwrap();
    assert_eq!(warm.cached_tokens, system.len());
    assert_eq!(warm.outcome.prefilled, b.len() - system.len());
    let mut cold_state = m.new_state();
    let cold = generate(&mut m, &mut cold_state, &b, &s.tok, &spec, |_| Flow::Continue).unwrap();
    assert_eq!(warm.outcome.tokens, cold.tokens);
    // The same question again: resumes from the history's end.
    let again = lily_engine::generate_cached(&mut m, &mut cache, &a, history, &s.tok, &spec, |_| Flow::Continue, |_| Flow::Continue).unwrap().unwrap();
    assert!(again.cached_tokens >= history, "{}", again.cached_tokens);
}
