//! Fuzz target: the streaming reasoning / tool-call parser, fed arbitrary model output in arbitrary
//! pieces. The first byte chooses thinking mode and which tools are offered; the rest is the text,
//! split into pieces at 0x00 bytes. Checked: no panic; the message is the same whether the text
//! comes in these pieces or whole (the parser's documented property); each call's argument
//! fragments concatenate to its arguments, which are a JSON object.

use lily_parser::{Event, OutputParser, ParsedMessage, ParserConfig, ToolSpec};
use serde_json::json;

fn tools(mask: u8) -> Vec<ToolSpec> {
    let all = [
        ToolSpec::new("get_weather", json!({"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]})),
        ToolSpec::new("calc", json!({"type": "object", "properties": {"x": {"type": "number"}, "ok": {"type": "boolean"}, "tags": {"type": "array", "items": {"type": "string"}}, "opt": {"type": ["string", "null"]}}})),
        ToolSpec::new("free", json!({"type": "object"})),
        ToolSpec::new("nested", json!({"type": "object", "properties": {"cfg": {"type": "object", "properties": {"a": {"type": "integer"}}}}})),
    ];
    all.into_iter().enumerate().filter(|(i, _)| mask & (1 << i) != 0).map(|(_, t)| t).collect()
}

fn run(cfg: &ParserConfig, pieces: &[String]) -> (Vec<Event>, ParsedMessage) {
    let mut p = OutputParser::new(cfg.clone());
    let mut events = Vec::new();
    for piece in pieces {
        events.extend(p.push(piece));
    }
    let (tail, message) = p.finish();
    events.extend(tail);
    (events, message)
}

fn main() {
    afl::fuzz!(|data: &[u8]| {
        let Some((&flags, rest)) = data.split_first() else { return };
        let cfg = ParserConfig { reasoning: flags & 1 != 0, tools: tools(flags >> 1), id_seed: Some(7) };
        let pieces = lily_fuzz::pieces(rest);
        let (events, message) = run(&cfg, &pieces);
        let whole = run(&cfg, &[pieces.concat()]).1;
        assert_eq!(message, whole, "the pieces {pieces:?} give another message than the whole text");
        let mut args: Vec<String> = Vec::new();
        for e in &events {
            match e {
                Event::ToolCallStart { index, .. } => {
                    assert_eq!(*index, args.len(), "tool calls are numbered in order");
                    args.push(String::new());
                }
                Event::ToolCallArguments { index, fragment } => args[*index].push_str(fragment),
                _ => {}
            }
        }
        assert_eq!(args.len(), message.tool_calls.len());
        for (a, call) in args.iter().zip(&message.tool_calls) {
            assert_eq!(a, &call.arguments, "argument fragments of {}", call.name);
            let v: serde_json::Value = serde_json::from_str(a).unwrap_or_else(|e| panic!("arguments {a:?} are not JSON: {e}"));
            assert!(v.is_object(), "{a}");
        }
    });
}
