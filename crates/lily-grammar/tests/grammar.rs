//! lily-grammar on the real Qwen3.6 vocabulary (assets/qwen3.6-tokenizer.json.gz):
//! - the token trie holds each token's exact bytes (texts encode and the tokens' bytes put back
//!   together give the text), with the tag-shaped added tokens special;
//! - random walks through the masks (a uniformly random allowed token at every step) always end in
//!   output that `lily-parser` turns into tool calls whose arguments validate against the tools'
//!   schemas, and in JSON that validates against the answer's schema — the grammar and the parser
//!   agree, whatever odd text (markup-like `<`, newlines, multi-byte pieces) the walk picks;
//! - sessions open at `</think>` (then `\n\n`), or at the model's `<tool_call>`, and end with the
//!   end-of-turn token;
//! - bad inputs are `GrammarError::Invalid` saying what is wrong.

use std::io::Read;
use std::sync::{Arc, OnceLock};

use lily_grammar::{resolve_property_refs, CallStart, CallTool, Format, GrammarError, Grammars, Plan, ToolCalls, Whitespace};
use lily_parser::{OutputParser, ParserConfig, ToolSpec};
use lily_tokenizer::Tokenizer;
use serde_json::{json, Value};

fn tokenizer() -> Arc<Tokenizer> {
    static TOK: OnceLock<Arc<Tokenizer>> = OnceLock::new();
    TOK.get_or_init(|| {
        let gz = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../assets/qwen3.6-tokenizer.json.gz");
        let mut json = Vec::new();
        flate2::read::GzDecoder::new(std::fs::File::open(&gz).unwrap()).read_to_end(&mut json).unwrap();
        let config = br#"{"add_bos_token": false, "bos_token": null, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "split_special_tokens": false}"#;
        Arc::new(Tokenizer::from_json_bytes_with_config(&json, Some(config)).unwrap())
    })
    .clone()
}

fn grammars() -> &'static Grammars {
    static G: OnceLock<Grammars> = OnceLock::new();
    G.get_or_init(|| {
        let tok = tokenizer();
        let stops = [tok.token_id("<|endoftext|>").unwrap(), tok.token_id("<|im_end|>").unwrap()];
        Grammars::new(tok, &stops).unwrap()
    })
}

fn id(t: &str) -> u32 {
    tokenizer().token_id(t).unwrap()
}

fn allowed(mask: &[u32]) -> Vec<u32> {
    let mut v = Vec::new();
    for (w, &bits) in mask.iter().enumerate() {
        let mut b = bits;
        while b != 0 {
            v.push(w as u32 * 32 + b.trailing_zeros());
            b &= b - 1;
        }
    }
    v
}

/// xorshift64*: test randomness only.
struct Rng(u64);
impl Rng {
    fn below(&mut self, n: usize) -> usize {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        (self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) % n as u64) as usize
    }
}

/// A random walk under `plan`: at each step the forced tokens, else a random allowed one (the end
/// of the turn half the time it is allowed). Returns the tokens, ending with a stop token (the
/// generation loop ends there).
fn walk(plan: &Plan, seed: u64, max: usize) -> Vec<u32> {
    let g = grammars();
    let c = g.compile(plan).unwrap();
    let mut s = c.start();
    let mut rng = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
    let mut mask = vec![0u32; g.vocab_size().div_ceil(32)];
    let mut out = Vec::new();
    let eos = g.eos();
    while out.len() < max {
        let forced = s.forced();
        let next = if let Some(&f) = forced.first() {
            f
        } else {
            s.fill_mask(&mut mask).unwrap();
            let ok = allowed(&mask);
            if ok.contains(&eos) && rng.below(2) == 0 {
                eos
            } else {
                ok[rng.below(ok.len())]
            }
        };
        s.commit(next).unwrap();
        out.push(next);
        if next == eos || next == id("<|endoftext|>") {
            return out;
        }
    }
    panic!("seed {seed}: no end after {max} tokens: {:?}", tokenizer().decode(&out, false).unwrap());
}

fn validate(schema: &Value, v: &Value) -> Result<(), String> {
    jsonschema::validator_for(schema).unwrap().validate(v).map_err(|e| format!("{e}: {v}"))
}

#[test]
fn the_trie_holds_every_tokens_bytes() {
    let tok = tokenizer();
    let g = grammars();
    assert_eq!(g.vocab_size(), tok.vocab_size());
    for text in ["Hello, wereld! 你好 🦀 — naïve café", "fn main() { println!(\"{}\", 1 << 3); }\n\t\r\n", "{\"a\": [1, 2.5e-3, null]}"] {
        let ids = tok.encode(text).unwrap();
        let mut bytes = Vec::new();
        for &i in &ids {
            bytes.extend(tok.token_bytes(i).unwrap());
        }
        assert_eq!(String::from_utf8(bytes).unwrap(), text);
    }
    assert_eq!(tok.token_bytes(id("<think>")).unwrap(), b"<think>");
}

fn tools() -> Vec<CallTool> {
    let weather = ToolSpec::new(
        "get_weather",
        json!({"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 6},
            "days": {"type": "integer", "minimum": 1, "maximum": 7},
            "units": {"enum": ["C", "F"]},
            "at": {"type": "string", "pattern": "^[0-2][0-9]:[0-5][0-9]$"},
            "near": {"type": "object", "properties": {"lat": {"type": "number", "minimum": -90, "maximum": 90}}, "required": ["lat"], "additionalProperties": false}},
            "required": ["city", "days"], "additionalProperties": false}),
    );
    let note = ToolSpec::new(
        "note",
        json!({"$defs": {"Tag": {"enum": ["todo", "done"]}}, "type": "object", "properties": {
            "text": {"anyOf": [{"type": "string", "maxLength": 5}, {"type": "null"}]},
            "tag": {"$ref": "#/$defs/Tag"},
            "flags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2}},
            "required": ["text", "tag"], "additionalProperties": false}),
    );
    vec![CallTool { spec: weather, typed: true }, CallTool { spec: note, typed: true }]
}

fn parse_calls(text: &str, tools: &[CallTool]) -> lily_parser::ParsedMessage {
    let specs: Vec<ToolSpec> =
        tools.iter().map(|t| ToolSpec::new(t.spec.name.clone(), resolve_property_refs(&t.spec.parameters))).collect();
    let mut p = OutputParser::new(ParserConfig { reasoning: false, tools: specs, id_seed: Some(1) });
    p.push(text);
    p.finish().1
}

#[test]
fn random_walks_through_tool_calls_always_parse_to_valid_arguments() {
    let tools = tools();
    let tok = tokenizer();
    let mut calls = 0;
    for (start, prefix) in [
        (CallStart::Open, ""),
        (CallStart::Name, "<tool_call>\n<function="),
        (CallStart::Body("note".to_string()), "<tool_call>\n<function=note>\n"),
    ] {
        let plan = Plan { calls: Some(ToolCalls { tools: tools.clone(), start: start.clone(), parallel: true }), ..Default::default() };
        for seed in 0..12u64 {
            let ids = walk(&plan, seed, 3000);
            let text = format!("{prefix}{}", tok.decode(&ids, true).unwrap());
            let msg = parse_calls(&text, &tools);
            assert!(!msg.tool_calls.is_empty(), "{start:?} seed {seed}: no call in {text:?}");
            assert!(msg.content.is_none(), "{start:?} seed {seed}: text outside the calls: {:?} in {text:?}", msg.content);
            if let CallStart::Body(_) = start {
                assert_eq!(msg.tool_calls.len(), 1, "a call whose name the prompt gave is the only one");
            }
            for call in &msg.tool_calls {
                let tool = tools.iter().find(|t| t.spec.name == call.name).unwrap_or_else(|| panic!("unknown tool {}", call.name));
                let args: Value = serde_json::from_str(&call.arguments).unwrap();
                validate(&tool.spec.parameters, &args).unwrap_or_else(|e| panic!("{start:?} seed {seed}: {e}\n{text:?}"));
                calls += 1;
            }
        }
    }
    assert!(calls >= 36);
}

#[test]
fn random_walks_through_json_answers_validate() {
    let tok = tokenizer();
    let schema = json!({"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 8}, "n": {"type": "integer", "minimum": -3, "maximum": 300},
        "xs": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}, "opt": {"type": "boolean"}},
        "required": ["name", "n", "xs"], "additionalProperties": false});
    for ws in [Whitespace::Bounded, Whitespace::None] {
        let plan = Plan { answer: Some(Format::JsonSchema { schema: schema.clone(), strict: true, whitespace: ws }), ..Default::default() };
        for seed in 0..10u64 {
            let ids = walk(&plan, seed, 2000);
            let text = tok.decode(&ids, true).unwrap();
            let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("seed {seed}: {e}: {text:?}"));
            validate(&schema, &v).unwrap();
            if ws == Whitespace::None {
                assert_eq!(text, v.to_string(), "no whitespace at all");
            }
        }
    }
    // Choices and regexes are matched whole.
    let plan = Plan { answer: Some(Format::Choice(vec!["yes".into(), "no".into(), "a<b".into()])), ..Default::default() };
    for seed in 0..6 {
        let text = tok.decode(&walk(&plan, seed, 50), true).unwrap();
        assert!(["yes", "no", "a<b"].contains(&text.as_str()), "{text:?}");
    }
}

#[test]
fn sessions_open_after_the_reasoning_or_at_the_models_tool_call() {
    let g = grammars();
    let schema = json!({"type": "object", "properties": {"k": {"enum": ["v"]}}, "required": ["k"], "additionalProperties": false});
    // No whitespace: then the whole answer is certain.
    let plan = Plan { answer: Some(Format::JsonSchema { schema, strict: true, whitespace: Whitespace::None }), after_reasoning: true, ..Default::default() };
    let mut s = g.compile(&plan).unwrap().start();
    assert!(!s.masks_next() && !s.started() && s.forced().is_empty());
    for t in tokenizer().encode("free reasoning: { not JSON").unwrap() {
        s.commit(t).unwrap();
    }
    assert!(!s.started());
    s.commit(id("</think>")).unwrap();
    assert!(s.started() && s.masks_next());
    let blank = tokenizer().encode("\n\n").unwrap();
    assert_eq!(s.forced(), blank, "the template's blank line after </think>");
    // The same token under a one-token mask, for a caller that samples everything.
    let mut mask = vec![0u32; g.vocab_size().div_ceil(32)];
    s.fill_mask(&mut mask).unwrap();
    assert_eq!(allowed(&mask), vec![blank[0]]);
    for t in blank {
        s.commit(t).unwrap();
    }
    // `{"k":"v"}` is all certain, then the end of the turn.
    let mut text = Vec::new();
    loop {
        let f = s.forced();
        assert!(!f.is_empty(), "the answer is certain: {:?}", tokenizer().decode(&text, false));
        for t in f {
            s.commit(t).unwrap();
            text.push(t);
        }
        if s.is_done() && text.last() == Some(&g.eos()) {
            break;
        }
    }
    let out = tokenizer().decode(&text, true).unwrap();
    assert_eq!(serde_json::from_str::<Value>(&out).unwrap(), json!({"k": "v"}));
    assert!(s.forced().is_empty());

    // "auto" with strict tools: free text until the model's own <tool_call>.
    let plan = Plan { calls: Some(ToolCalls { tools: tools(), start: CallStart::Open, parallel: false }), at_tool_call: true, ..Default::default() };
    let mut s = g.compile(&plan).unwrap().start();
    for t in tokenizer().encode("Let me check the weather.").unwrap() {
        s.commit(t).unwrap();
    }
    assert!(!s.started());
    s.commit(id("<tool_call>")).unwrap();
    assert!(s.started());
    let f = s.forced();
    // The call's opening is certain (all but the `=`, which may join the name in one token).
    assert_eq!(tokenizer().decode(&f, false).unwrap(), "\n<function");
    // A grammar that starts at the model's <tool_call> must write whole calls.
    let bad = Plan { calls: Some(ToolCalls { tools: tools(), start: CallStart::Name, parallel: false }), at_tool_call: true, ..Default::default() };
    assert!(matches!(g.compile(&bad), Err(GrammarError::Invalid(_))));
}

#[test]
fn bad_inputs_say_what_is_wrong() {
    let g = grammars();
    let answer = |f: Format| g.compile(&Plan { answer: Some(f), ..Default::default() }).err();
    let schema = |s: Value| Format::JsonSchema { schema: s, strict: true, whitespace: Whitespace::Bounded };
    let cases: Vec<(Option<GrammarError>, &str)> = vec![
        (answer(schema(json!({"type": "nope"}))), "nope"),
        (answer(schema(json!(false))), "admits no value"),
        (answer(schema(json!([1]))), "must be an object"),
        (answer(schema(json!({"type": "string", "format": "no-such-format"}))), "no-such-format"),
        (answer(Format::Regex("[a-".into())), "regex"),
        (answer(Format::Choice(vec![])), "empty"),
        (answer(Format::Lark("".into())), "empty"),
        (answer(Format::Lark("root ::= \"x\"".into())), "GBNF"),
        (answer(Format::Lark("start: missing".into())), "missing"),
    ];
    for (err, needle) in cases {
        match err {
            Some(GrammarError::Invalid(msg)) => assert!(msg.contains(needle), "{msg:?} should mention {needle:?}"),
            other => panic!("expected an Invalid error mentioning {needle:?}, got {other:?}"),
        }
    }
    // Not strict: a keyword llguidance does not implement is ignored instead.
    let lenient = Format::JsonSchema { schema: json!({"type": "string", "format": "no-such-format"}), strict: false, whitespace: Whitespace::Bounded };
    assert!(answer(lenient).is_none());
    // Tool schemas llguidance or the parser cannot honour.
    let tool = |params: Value| {
        let calls = ToolCalls { tools: vec![CallTool { spec: ToolSpec::new("f", params), typed: true }], start: CallStart::Open, parallel: false };
        g.compile(&Plan { calls: Some(calls), ..Default::default() }).err().map(|e| e.to_string()).unwrap_or_default()
    };
    assert!(tool(json!({"type": "object", "properties": {"a": {"type": "string"}}, "required": ["b"]})).contains("`b`"));
    assert!(tool(json!({"type": "object", "properties": {"a": {"type": "string", "pattern": "(("}}})).contains("pattern"));
    assert!(tool(json!({"type": "object", "properties": {"a": {"type": "string", "minLength": 5, "maxLength": 2}}})).contains("maxLength"));
}

#[test]
fn property_refs_resolve_for_typing() {
    let s = json!({"$defs": {"P": {"type": "object", "properties": {"x": {"type": "integer"}}}},
        "properties": {"p": {"$ref": "#/$defs/P", "description": "a point"}, "q": {"type": "string"}}});
    let r = resolve_property_refs(&s);
    assert_eq!(r["properties"]["p"]["type"], "object");
    assert_eq!(r["properties"]["p"]["description"], "a point");
    assert!(r["properties"]["p"].get("$ref").is_none());
    assert_eq!(r["properties"]["q"], json!({"type": "string"}));
    // A reference cycle stops.
    let cyc = json!({"$defs": {"A": {"$ref": "#/$defs/A"}}, "properties": {"a": {"$ref": "#/$defs/A"}}});
    let _ = resolve_property_refs(&cyc);
}

#[test]
fn an_untyped_call_body_ends_at_its_function_tag_and_forced_tokens_never_fail() {
    // An untyped tool (not strict, under "auto" with an answer format) has a free body up to
    // `</function>`. Fed a whole call token by token, asking for the forced tokens at every step
    // (as the generation loop does), every token is allowed and the call completes. (The body's
    // terminal used to end with `</function>\n`, and llguidance's forced-token computation then
    // panicked there, failing the request.)
    let g = grammars();
    let untyped = vec![CallTool { spec: ToolSpec::new("apply_patch", json!({"type": "object", "properties": {"input": {"type": "string"}}})), typed: false }];
    let plan = Plan {
        answer: Some(Format::JsonObject { whitespace: Whitespace::Bounded }),
        calls: Some(ToolCalls { tools: untyped, start: CallStart::Open, parallel: true }),
        at_tool_call: true,
        ..Default::default()
    };
    let mut s = g.compile(&plan).unwrap().start();
    let call = "<tool_call>\n<function=apply_patch>\n<parameter=input>\n*** Begin Patch\n+a </parameter> b\n*** End Patch\n</parameter>\n</function>\n</tool_call>";
    let mut mask = vec![0u32; g.vocab_size().div_ceil(32)];
    let mut pending: std::collections::VecDeque<u32> = tokenizer().encode(call).unwrap().into();
    while let Some(t) = pending.pop_front() {
        let forced = s.forced();
        if !forced.is_empty() {
            // What the grammar forces is what the call holds next.
            let f = forced[0];
            assert_eq!(f, t, "forced {:?} where the call has {:?}", tokenizer().decode(&[f], false), tokenizer().decode(&[t], false));
            s.commit(f).unwrap();
            continue;
        }
        if s.masks_next() {
            s.fill_mask(&mut mask).unwrap();
            assert!(allowed(&mask).contains(&t), "{:?} not allowed", tokenizer().decode(&[t], false));
        }
        s.commit(t).unwrap();
    }
    // After the call: another one, or the end of the turn.
    s.fill_mask(&mut mask).unwrap();
    let next = allowed(&mask);
    assert!(next.contains(&g.eos()) || s.is_done(), "the turn can end after the call");
}
