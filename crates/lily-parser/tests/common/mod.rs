//! Shared helpers of the lily-parser tests.
#![allow(dead_code)]

use lily_parser::{Event, OutputParser, ParsedMessage, ParserConfig, ToolSpec};
use serde_json::{json, Value};

pub fn tools() -> Vec<ToolSpec> {
    vec![
        ToolSpec::new(
            "get_weather",
            json!({"type": "object", "properties": {
                "city": {"type": "string"},
                "days": {"type": "integer"},
                "metric": {"type": "boolean"}
            }, "required": ["city"]}),
        ),
        ToolSpec::new(
            "write_file",
            json!({"type": "object", "properties": {
                "path": {"type": "string"},
                "content": {"type": "string"}
            }}),
        ),
        ToolSpec::new(
            "config",
            json!({"type": "object", "properties": {
                "opts": {"type": "object"},
                "tags": {"type": "array", "items": {"type": "string"}},
                "ratio": {"type": "number"},
                "n": {"type": "integer"},
                "flag": {"type": "boolean"},
                "maybe": {"type": ["integer", "null"]},
                "note": {"type": ["string", "null"]},
                "mode": {"enum": [1, 2, 3]},
                "choice": {"anyOf": [{"type": "integer"}, {"type": "boolean"}]},
                "any": {}
            }}),
        ),
    ]
}

pub fn cfg(reasoning: bool) -> ParserConfig {
    ParserConfig {
        reasoning,
        tools: tools(),
        id_seed: Some(7),
    }
}

pub fn cfg_no_tools(reasoning: bool) -> ParserConfig {
    ParserConfig {
        reasoning,
        tools: vec![],
        id_seed: Some(7),
    }
}

pub struct Run {
    pub events: Vec<Event>,
    pub msg: ParsedMessage,
}

/// Feed `pieces` one by one, finish, and check that the events agree with the message.
pub fn run_pieces<S: AsRef<str>>(cfg: ParserConfig, pieces: &[S]) -> Run {
    let mut p = OutputParser::new(cfg);
    let mut events = Vec::new();
    for x in pieces {
        events.extend(p.push(x.as_ref()));
    }
    let (tail, msg) = p.finish();
    events.extend(tail);
    check_consistent(&events, &msg);
    Run { events, msg }
}

pub fn parse1(cfg: ParserConfig, text: &str) -> ParsedMessage {
    run_pieces(cfg, &[text]).msg
}

pub fn args(msg: &ParsedMessage, i: usize) -> Value {
    serde_json::from_str(&msg.tool_calls[i].arguments).expect("arguments are JSON")
}

/// Events rebuild the message exactly; calls are well nested; arguments are JSON objects.
pub fn check_consistent(events: &[Event], msg: &ParsedMessage) {
    let mut reasoning = String::new();
    let mut content = String::new();
    let mut calls: Vec<(String, String, String, bool)> = Vec::new();
    let mut open: Option<usize> = None;
    for e in events {
        match e {
            Event::Reasoning(s) => {
                assert!(!s.is_empty(), "empty reasoning event");
                reasoning.push_str(s)
            }
            Event::Content(s) => {
                assert!(!s.is_empty(), "empty content event");
                content.push_str(s)
            }
            Event::ToolCallStart { index, id, name } => {
                assert_eq!(open, None, "call started inside another");
                assert_eq!(*index, calls.len(), "call indices are sequential");
                calls.push((id.clone(), name.clone(), String::new(), false));
                open = Some(*index);
            }
            Event::ToolCallArguments { index, fragment } => {
                assert_eq!(open, Some(*index), "arguments outside their call");
                assert!(!fragment.is_empty());
                calls[*index].2.push_str(fragment);
            }
            Event::ToolCallEnd { index } => {
                assert_eq!(open, Some(*index), "end of a call that is not open");
                calls[*index].3 = true;
                open = None;
            }
        }
    }
    assert_eq!(open, None, "a call was left open");
    let nz = |s: String| if s.is_empty() { None } else { Some(s) };
    assert_eq!(nz(reasoning), msg.reasoning, "reasoning events != message");
    assert_eq!(nz(content), msg.content, "content events != message");
    assert_eq!(calls.len(), msg.tool_calls.len());
    let mut ids = std::collections::HashSet::new();
    for (c, t) in calls.iter().zip(&msg.tool_calls) {
        assert_eq!(c.0, t.id);
        assert_eq!(c.1, t.name);
        assert_eq!(c.2, t.arguments, "argument fragments != arguments");
        assert!(c.3);
        assert!(t.id.starts_with("call_"));
        assert!(ids.insert(t.id.clone()), "duplicate id");
        let v: Value = serde_json::from_str(&t.arguments)
            .unwrap_or_else(|e| panic!("arguments not JSON ({e}): {:?}", t.arguments));
        assert!(v.is_object(), "arguments not an object: {}", t.arguments);
    }
}

/// Tiny deterministic PRNG for the property tests.
pub struct Rng(pub u64);
impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    pub fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

/// Split `s` at random char boundaries into pieces of 1..=max bytes (roughly).
pub fn random_split(s: &str, rng: &mut Rng, max: usize) -> Vec<String> {
    let mut out = Vec::new();
    let mut cur = String::new();
    let mut want = 1 + rng.below(max);
    for c in s.chars() {
        cur.push(c);
        if cur.len() >= want {
            out.push(std::mem::take(&mut cur));
            want = 1 + rng.below(max);
        }
    }
    if !cur.is_empty() {
        out.push(cur);
    }
    out
}

/// Pieces of exactly one char each.
pub fn char_split(s: &str) -> Vec<String> {
    s.chars().map(|c| c.to_string()).collect()
}
