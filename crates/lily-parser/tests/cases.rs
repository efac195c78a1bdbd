//! One test per rule / failure case of the output parser.

mod common;

use common::*;
use lily_parser::{parse, Event, OutputParser, ParserConfig, ToolSpec};
use serde_json::json;

fn weather_call(city: &str) -> String {
    format!(
        "<tool_call>\n<function=get_weather>\n<parameter=city>\n{city}\n</parameter>\n</function>\n</tool_call>"
    )
}

// ----- reasoning / content -----------------------------------------------------------------

#[test]
fn reasoning_then_content_trims_template_newlines() {
    let m = parse1(
        cfg(true),
        "Let me think.\nOK.\n</think>\n\nThe answer is 4.",
    );
    assert_eq!(m.reasoning.as_deref(), Some("Let me think.\nOK."));
    assert_eq!(m.content.as_deref(), Some("The answer is 4."));
    assert!(m.tool_calls.is_empty());
}

#[test]
fn reasoning_without_close_is_all_reasoning() {
    let m = parse1(cfg(true), "thinking forever\nstill thinking <b>bold</b>");
    assert_eq!(
        m.reasoning.as_deref(),
        Some("thinking forever\nstill thinking <b>bold</b>")
    );
    assert_eq!(m.content, None);
}

#[test]
fn plain_content_without_reasoning() {
    let m = parse1(cfg(false), "Hello\n\n  world  \n");
    assert_eq!(m.reasoning, None);
    assert_eq!(m.content.as_deref(), Some("Hello\n\n  world"));
}

#[test]
fn empty_output() {
    for r in [false, true] {
        let m = parse1(cfg(r), "");
        assert_eq!(m, Default::default());
        let m = parse1(cfg(r), "\n\n");
        assert_eq!(m, Default::default());
    }
}

#[test]
fn empty_reasoning_block() {
    let m = parse1(cfg(true), "\n</think>\n\nHi");
    assert_eq!(m.reasoning, None);
    assert_eq!(m.content.as_deref(), Some("Hi"));
}

#[test]
fn model_opens_think_when_prompt_did_not() {
    let m = parse1(cfg(false), "<think>\nhmm\n</think>\n\nHi");
    assert_eq!(m.reasoning.as_deref(), Some("hmm"));
    assert_eq!(m.content.as_deref(), Some("Hi"));
    let m = parse1(cfg(false), "\n<think>hmm"); // never closed: reasoning
    assert_eq!(m.reasoning.as_deref(), Some("hmm"));
    assert_eq!(m.content, None);
}

#[test]
fn duplicated_think_open_is_dropped() {
    let m = parse1(cfg(true), "<think>\nabc\n</think>\n\nx");
    assert_eq!(m.reasoning.as_deref(), Some("abc"));
    assert_eq!(m.content.as_deref(), Some("x"));
}

#[test]
fn stray_close_think_before_content_is_dropped() {
    let m = parse1(cfg(false), "</think>\n\nHi");
    assert_eq!(m.reasoning, None);
    assert_eq!(m.content.as_deref(), Some("Hi"));
}

#[test]
fn think_tags_after_content_are_literal() {
    let t = "Use <think> and </think> to wrap reasoning.";
    let m = parse1(cfg(false), t);
    assert_eq!(m.content.as_deref(), Some(t));
    let m = parse1(
        cfg(true),
        "r\n</think>\n\nThe tag </think> ends it, <think> opens it.",
    );
    assert_eq!(m.reasoning.as_deref(), Some("r"));
    assert_eq!(
        m.content.as_deref(),
        Some("The tag </think> ends it, <think> opens it.")
    );
    // A second <think> inside running reasoning is literal too.
    let m = parse1(cfg(true), "I saw <think> in the docs\n</think>\n\nok");
    assert_eq!(m.reasoning.as_deref(), Some("I saw <think> in the docs"));
}

#[test]
fn html_and_angle_brackets_in_content() {
    let t = "a < b, <div class=\"x\">y</div> & <tool> <tool_calls> <functional> </parameter>";
    let m = parse1(cfg(false), t);
    assert_eq!(m.content.as_deref(), Some(t));
    assert!(m.tool_calls.is_empty());
}

// ----- basic tool calls ----------------------------------------------------------------------

#[test]
fn single_call_typed_arguments() {
    let t = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=metric>\ntrue\n</parameter>\n</function>\n</tool_call>";
    let m = parse1(cfg(false), t);
    assert_eq!(m.content, None);
    assert_eq!(m.reasoning, None);
    assert_eq!(m.tool_calls.len(), 1);
    assert_eq!(m.tool_calls[0].name, "get_weather");
    assert_eq!(
        m.tool_calls[0].arguments,
        r#"{"city":"Paris","days":3,"metric":true}"#
    );
}

#[test]
fn string_parameter_stays_string() {
    let m = parse1(cfg(false), &weather_call("123"));
    assert_eq!(args(&m, 0), json!({"city": "123"}));
    let m = parse1(cfg(false), &weather_call("{\"a\": 1}"));
    assert_eq!(args(&m, 0), json!({"city": "{\"a\": 1}"}));
    let m = parse1(cfg(false), &weather_call("true"));
    assert_eq!(args(&m, 0), json!({"city": "true"}));
}

#[test]
fn content_before_call() {
    let t = format!("Let me check the weather.\n\n{}", weather_call("Paris"));
    let m = parse1(cfg(false), &t);
    assert_eq!(m.content.as_deref(), Some("Let me check the weather."));
    assert_eq!(args(&m, 0), json!({"city": "Paris"}));
}

#[test]
fn content_after_call_is_kept() {
    let t = format!("Before.\n\n{}\nAfter.", weather_call("Paris"));
    let m = parse1(cfg(false), &t);
    assert_eq!(m.content.as_deref(), Some("Before.\n\nAfter."));
    assert_eq!(m.tool_calls.len(), 1);
}

#[test]
fn several_calls_in_one_message() {
    let t = format!(
        "I'll check three cities.\n\n{}\n{}\n{}",
        weather_call("Paris"),
        weather_call("Oslo"),
        weather_call("Lima")
    );
    let r = run_pieces(cfg(false), &[t.as_str()]);
    let m = &r.msg;
    assert_eq!(m.content.as_deref(), Some("I'll check three cities."));
    assert_eq!(m.tool_calls.len(), 3);
    for (i, city) in ["Paris", "Oslo", "Lima"].iter().enumerate() {
        assert_eq!(args(m, i), json!({ "city": city }));
    }
    let starts: Vec<usize> = r
        .events
        .iter()
        .filter_map(|e| match e {
            Event::ToolCallStart { index, .. } => Some(*index),
            _ => None,
        })
        .collect();
    assert_eq!(starts, vec![0, 1, 2]);
    // Ids unique (checked by check_consistent), deterministic by seed, different seeds differ.
    let again = parse1(cfg(false), &t);
    assert_eq!(again.tool_calls[1].id, m.tool_calls[1].id);
    let other = parse1(
        ParserConfig {
            id_seed: Some(8),
            ..cfg(false)
        },
        &t,
    );
    assert_ne!(other.tool_calls[0].id, m.tool_calls[0].id);
    // Random seeds: two parsers give different ids.
    let a = parse(
        ParserConfig {
            id_seed: None,
            ..cfg(false)
        },
        &t,
    );
    let b = parse(
        ParserConfig {
            id_seed: None,
            ..cfg(false)
        },
        &t,
    );
    assert_ne!(a.tool_calls[0].id, b.tool_calls[0].id);
}

#[test]
fn calls_without_separators_and_two_functions_in_one_block() {
    let t = format!("{}{}", weather_call("A"), weather_call("B"));
    let m = parse1(cfg(false), &t);
    assert_eq!(m.tool_calls.len(), 2);
    assert_eq!(m.content, None);
    let t = "<tool_call>\n<function=get_weather>\n<parameter=city>\nA\n</parameter>\n</function>\n<function=get_weather>\n<parameter=city>\nB\n</parameter>\n</function>\n</tool_call>";
    let m = parse1(cfg(false), t);
    assert_eq!(m.tool_calls.len(), 2);
    assert_eq!(args(&m, 1), json!({"city": "B"}));
}

#[test]
fn call_without_parameters() {
    let m = parse1(
        cfg(false),
        "<tool_call>\n<function=get_weather>\n</function>\n</tool_call>",
    );
    assert_eq!(m.tool_calls[0].arguments, "{}");
}

// ----- tool calls inside the reasoning ------------------------------------------------------

#[test]
fn call_inside_reasoning_is_extracted() {
    let t = format!("I need the weather.\n\n{}", weather_call("Paris"));
    let m = parse1(cfg(true), &t);
    assert_eq!(m.reasoning.as_deref(), Some("I need the weather."));
    assert_eq!(m.content, None);
    assert_eq!(args(&m, 0), json!({"city": "Paris"}));
}

#[test]
fn call_inside_reasoning_then_close_and_content() {
    let t = format!(
        "Think.\n{}\nMore thought.\n</think>\n\nDone.",
        weather_call("Paris")
    );
    let m = parse1(cfg(true), &t);
    assert_eq!(m.reasoning.as_deref(), Some("Think.\nMore thought."));
    assert_eq!(m.content.as_deref(), Some("Done."));
    assert_eq!(m.tool_calls.len(), 1);
}

#[test]
fn close_think_right_after_unclosed_call() {
    // The call's closers are missing and </think> follows: the call ends, </think> is honoured.
    let t = "x\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</think>\n\nanswer";
    let m = parse1(cfg(true), t);
    assert_eq!(args(&m, 0), json!({"city": "Paris"}));
    assert_eq!(m.reasoning.as_deref(), Some("x"));
    assert_eq!(m.content.as_deref(), Some("answer"));
}

#[test]
fn tool_call_tag_mentioned_in_prose_is_text() {
    let t = "I could emit <tool_call> tags, but no.\n</think>\n\nHi";
    let m = parse1(cfg(true), t);
    assert_eq!(
        m.reasoning.as_deref(),
        Some("I could emit <tool_call> tags, but no.")
    );
    assert_eq!(m.content.as_deref(), Some("Hi"));
    assert!(m.tool_calls.is_empty());
    let t = "Call it like <function=get_weather> with a city.";
    let m = parse1(cfg(false), t);
    assert_eq!(m.content.as_deref(), Some(t));
    assert!(m.tool_calls.is_empty());
}

// ----- unclosed at end of generation --------------------------------------------------------

#[test]
fn unclosed_parameter_value_at_eos() {
    let t = "<tool_call>\n<function=write_file>\n<parameter=path>\n/a.txt\n</parameter>\n<parameter=content>\nline1\nline2\n";
    let m = parse1(cfg(false), t);
    assert_eq!(
        args(&m, 0),
        json!({"path": "/a.txt", "content": "line1\nline2"})
    );
    assert_eq!(m.content, None);
}

#[test]
fn unclosed_typed_value_at_eos() {
    let t = "<tool_call>\n<function=config>\n<parameter=n>\n42";
    let m = parse1(cfg(false), t);
    assert_eq!(args(&m, 0), json!({"n": 42}));
    let t = "<tool_call>\n<function=config>\n<parameter=opts>\n{\"a\": [1, 2";
    let m = parse1(cfg(false), t);
    assert_eq!(args(&m, 0), json!({"opts": "{\"a\": [1, 2"}));
}

#[test]
fn unclosed_parameter_tag_at_eos_is_text() {
    let t =
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=da";
    let m = parse1(cfg(false), t);
    assert_eq!(args(&m, 0), json!({"city": "Paris"}));
    assert_eq!(m.content.as_deref(), Some("<parameter=da"));
}

#[test]
fn unclosed_function_tag_at_eos_is_text() {
    let t = "Sure.\n\n<tool_call>\n<function=get_wea";
    let m = parse1(cfg(false), t);
    assert!(m.tool_calls.is_empty());
    assert_eq!(m.content.as_deref(), Some(t));
}

#[test]
fn unclosed_tool_call_tag_at_eos_is_text() {
    let m = parse1(cfg(false), "Hi <tool_call>");
    assert_eq!(m.content.as_deref(), Some("Hi <tool_call>"));
    let m = parse1(cfg(false), "<tool_call>\n");
    assert_eq!(m.content.as_deref(), Some("<tool_call>"));
    let m = parse1(cfg(true), "hmm\n<tool_call>\n");
    assert_eq!(m.reasoning.as_deref(), Some("hmm\n<tool_call>"));
    assert!(m.tool_calls.is_empty());
}

#[test]
fn complete_function_tag_then_eos_keeps_call() {
    let m = parse1(cfg(false), "<tool_call>\n<function=get_weather>\n");
    assert_eq!(m.tool_calls.len(), 1);
    assert_eq!(m.tool_calls[0].arguments, "{}");
    assert_eq!(m.content, None);
}

#[test]
fn truncated_closers_at_eos() {
    let t = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</func";
    let m = parse1(cfg(false), t);
    assert_eq!(args(&m, 0), json!({"city": "Paris"}));
    assert_eq!(m.content, None);
    let t = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool";
    let m = parse1(cfg(false), t);
    assert_eq!(args(&m, 0), json!({"city": "Paris"}));
    assert_eq!(m.content, None);
}

// ----- malformed closings -------------------------------------------------------------------

#[test]
fn parameter_closed_by_function_close() {
    let t =
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</function>\n</tool_call>";
    let m = parse1(cfg(false), t);
    assert_eq!(args(&m, 0), json!({"city": "Paris"}));
}

#[test]
fn parameter_closed_by_next_parameter() {
    let t = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>";
    let m = parse1(cfg(false), t);
    assert_eq!(args(&m, 0), json!({"city": "Paris", "days": 3}));
}

#[test]
fn missing_function_and_tool_call_closers() {
    let t = format!(
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</tool_call>\n{}",
        weather_call("Oslo")
    );
    let m = parse1(cfg(false), &t);
    assert_eq!(m.tool_calls.len(), 2);
    assert_eq!(args(&m, 0), json!({"city": "Paris"}));
    let t = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\nThat is all.";
    let m = parse1(cfg(false), t);
    assert_eq!(args(&m, 0), json!({"city": "Paris"}));
    assert_eq!(m.content.as_deref(), Some("That is all."));
    let t = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</tool_call>";
    let m = parse1(cfg(false), t);
    assert_eq!(args(&m, 0), json!({"city": "Paris"}));
}

#[test]
fn one_bad_parameter_does_not_discard_the_call() {
    // vLLM #39771: a malformed <parameter= made the parser drop every call.
    let t = "<tool_call>\n<function=get_weather>\n<parameter=\nbroken\n</parameter>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\nabc\n</parameter>\n</function>\n</tool_call>";
    let m = parse1(cfg(false), t);
    assert_eq!(m.tool_calls.len(), 1);
    assert_eq!(args(&m, 0), json!({"city": "Paris", "days": "abc"}));
    // The stray text is not lost.
    assert!(
        m.content.as_deref().unwrap().contains("broken"),
        "{:?}",
        m.content
    );
}

#[test]
fn stray_text_inside_function_is_kept() {
    let t = "<tool_call>\n<function=get_weather>\nhere you go:\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>";
    let m = parse1(cfg(true), t);
    assert_eq!(args(&m, 0), json!({"city": "Paris"}));
    assert_eq!(m.reasoning.as_deref(), Some("here you go:"));
}

// ----- values ------------------------------------------------------------------------------

#[test]
fn xml_special_characters_in_values() {
    let code = "if a < b && c > d {\n    x = \"<tag attr='1'>&amp;</tag>\";\n}";
    let t = format!(
        "<tool_call>\n<function=write_file>\n<parameter=path>\nsrc/a&b<c>.rs\n</parameter>\n<parameter=content>\n{code}\n</parameter>\n</function>\n</tool_call>"
    );
    let m = parse1(cfg(false), &t);
    assert_eq!(
        args(&m, 0),
        json!({"path": "src/a&b<c>.rs", "content": code})
    );
}

#[test]
fn closing_tag_lookalikes_in_values() {
    let value = "x </parameters> y </param z </parameter>oops </parameter\nClose with </parameter>\nthen more text\n</function> mid-line\n<parameter=nope> too";
    let t = format!(
        "<tool_call>\n<function=write_file>\n<parameter=content>\n{value}\n</parameter>\n<parameter=path>\np\n</parameter>\n</function>\n</tool_call>"
    );
    let m = parse1(cfg(false), &t);
    assert_eq!(args(&m, 0), json!({"content": value, "path": "p"}));
    assert_eq!(m.content, None);
}

#[test]
fn value_spanning_many_lines_keeps_inner_blank_lines() {
    let value = "\n\nline1\n\n    indented\n\tTab\n\n\n";
    let t = format!(
        "<tool_call>\n<function=write_file>\n<parameter=content>\n{value}\n</parameter>\n</function>\n</tool_call>"
    );
    let m = parse1(cfg(false), &t);
    // Exactly the template's newline is removed on each side.
    assert_eq!(args(&m, 0), json!({ "content": value }));
    let big: String = (0..2000)
        .map(|i| format!("line {i} <x> & </y>\n"))
        .collect();
    let t = format!(
        "<tool_call>\n<function=write_file>\n<parameter=content>\n{big}\n</parameter>\n</function>\n</tool_call>"
    );
    let r = run_pieces(cfg(false), &random_split(&t, &mut Rng(99), 7));
    assert_eq!(args(&r.msg, 0), json!({ "content": big }));
}

#[test]
fn value_without_template_newlines() {
    let t = "<tool_call><function=get_weather><parameter=city>Paris</parameter><parameter=days>2</parameter></function></tool_call>";
    let m = parse1(cfg(false), t);
    assert_eq!(args(&m, 0), json!({"city": "Paris", "days": 2}));
}

#[test]
fn nested_json_and_typed_values() {
    let t = "<tool_call>\n<function=config>\n\
<parameter=opts>\n{\"a\": {\"b\": [1, 2, {\"c\": null}]}, \"s\": \"x<y & z>\"}\n</parameter>\n\
<parameter=tags>\n[\"a\", \"b\"]\n</parameter>\n\
<parameter=ratio>\n0.50\n</parameter>\n\
<parameter=n>\n4.0\n</parameter>\n\
<parameter=flag>\nFalse\n</parameter>\n\
<parameter=maybe>\nnull\n</parameter>\n\
<parameter=note>\nnull\n</parameter>\n\
<parameter=mode>\n2\n</parameter>\n\
<parameter=choice>\ntrue\n</parameter>\n\
<parameter=any>\n{\"k\": 1}\n</parameter>\n\
<parameter=extra>\n7\n</parameter>\n\
</function>\n</tool_call>";
    let m = parse1(cfg(false), t);
    assert_eq!(
        args(&m, 0),
        json!({
            "opts": {"a": {"b": [1, 2, {"c": null}]}, "s": "x<y & z>"},
            "tags": ["a", "b"],
            "ratio": 0.5,
            "n": 4,
            "flag": false,
            "maybe": null,
            "note": "null",
            "mode": 2,
            "choice": true,
            "any": "{\"k\": 1}",
            "extra": "7"
        })
    );
    // Compact JSON, keys in emission order, numbers as written.
    assert!(m.tool_calls[0].arguments.starts_with(r#"{"opts":{"a":{"b":[1,2,{"c":null}]},"s":"x<y & z>"},"tags":["a","b"],"ratio":0.50,"n":4,"#));
}

#[test]
fn value_not_matching_schema_is_kept_as_string() {
    let t = "<tool_call>\n<function=config>\n\
<parameter=n>\nabc\n</parameter>\n\
<parameter=ratio>\n1.5x\n</parameter>\n\
<parameter=flag>\nmaybe\n</parameter>\n\
<parameter=opts>\n{broken\n</parameter>\n\
<parameter=tags>\na, b\n</parameter>\n\
<parameter=maybe>\n4.5\n</parameter>\n\
<parameter=mode>\n\"3\"\n</parameter>\n\
</function>\n</tool_call>";
    let m = parse1(cfg(false), t);
    assert_eq!(
        args(&m, 0),
        json!({
            "n": "abc", "ratio": "1.5x", "flag": "maybe", "opts": "{broken",
            "tags": "a, b", "maybe": "4.5", "mode": 3
        })
    );
}

#[test]
fn lenient_numbers() {
    let t = "<tool_call>\n<function=config>\n<parameter=ratio>\n+.5\n</parameter>\n<parameter=n>\n 1e2 \n</parameter>\n<parameter=maybe>\nNaN\n</parameter>\n</function>\n</tool_call>";
    let m = parse1(cfg(false), t);
    assert_eq!(args(&m, 0), json!({"ratio": 0.5, "n": 100, "maybe": "NaN"}));
}

#[test]
fn unknown_function_and_parameter_are_kept() {
    let t = "<tool_call>\n<function=launch_rocket>\n<parameter=target>\nmoon\n</parameter>\n<parameter=count>\n3\n</parameter>\n</function>\n</tool_call>";
    let m = parse1(cfg(false), t);
    assert_eq!(m.tool_calls[0].name, "launch_rocket");
    assert_eq!(args(&m, 0), json!({"target": "moon", "count": "3"}));
}

#[test]
fn no_tools_means_no_tool_parsing() {
    let t = format!("Here:\n\n{}", weather_call("Paris"));
    let m = parse1(cfg_no_tools(false), &t);
    assert!(m.tool_calls.is_empty());
    assert_eq!(m.content.as_deref(), Some(t.as_str()));
}

#[test]
fn quoted_and_spaced_names() {
    let t = "<tool_call>\n<function= \"get_weather\" >\n<parameter='city'>\nParis\n</parameter>\n</function>\n</tool_call>";
    let m = parse1(cfg(false), t);
    assert_eq!(m.tool_calls[0].name, "get_weather");
    assert_eq!(args(&m, 0), json!({"city": "Paris"}));
}

#[test]
fn duplicate_parameter_is_kept_in_text() {
    let t = "<tool_call>\n<function=get_weather>\n<parameter=city>\nA\n</parameter>\n<parameter=city>\nB\n</parameter>\n</function>\n</tool_call>";
    let m = parse1(cfg(false), t);
    assert_eq!(m.tool_calls[0].arguments, r#"{"city":"A","city":"B"}"#);
    assert_eq!(args(&m, 0), json!({"city": "B"}));
}

// ----- other call forms ---------------------------------------------------------------------

#[test]
fn json_form_inside_tool_call() {
    let t = "Checking.\n\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"days\": 2}}\n</tool_call>";
    let m = parse1(cfg(false), t);
    assert_eq!(m.content.as_deref(), Some("Checking."));
    assert_eq!(args(&m, 0), json!({"city": "Paris", "days": 2}));
    // Arguments given as a JSON string.
    let t = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": \"{\\\"city\\\": \\\"Oslo\\\"}\"}\n</tool_call>";
    let m = parse1(cfg(false), t);
    assert_eq!(args(&m, 0), json!({"city": "Oslo"}));
    // Not a call object: literal text.
    let t = "<tool_call>\n{\"foo\": 1}\n</tool_call>";
    let m = parse1(cfg(false), t);
    assert!(m.tool_calls.is_empty());
    assert_eq!(m.content.as_deref(), Some(t));
}

#[test]
fn json_body_inside_function() {
    let t = "<tool_call>\n<function=get_weather>\n{\"city\": \"Paris\", \"days\": 2}\n</function>\n</tool_call>";
    let m = parse1(cfg(false), t);
    assert_eq!(args(&m, 0), json!({"city": "Paris", "days": 2}));
    assert_eq!(m.content, None);
}

#[test]
fn bare_function_without_tool_call_tag() {
    let t = "Ok.\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>";
    let m = parse1(cfg(false), t);
    assert_eq!(m.content.as_deref(), Some("Ok."));
    assert_eq!(args(&m, 0), json!({"city": "Paris"}));
    // Unknown name without <tool_call>: text.
    let t = "<function=other>\n<parameter=x>\n1\n</parameter>\n</function>";
    let m = parse1(cfg(false), t);
    assert!(m.tool_calls.is_empty());
    assert_eq!(m.content.as_deref(), Some(t));
}

#[test]
fn tool_spec_from_openai() {
    let v =
        json!({"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}});
    let t = ToolSpec::from_openai(&v).unwrap();
    assert_eq!(t.name, "f");
    assert_eq!(t.parameters, json!({"type": "object"}));
    let t = ToolSpec::from_openai(&json!({"name": "g"})).unwrap();
    assert_eq!(t.parameters, serde_json::Value::Null);
    assert!(ToolSpec::from_openai(&json!({"type": "function", "function": {}})).is_err());
    assert!(ToolSpec::from_openai(&json!({"type": "retrieval"})).is_err());
    assert!(ToolSpec::from_openai(&json!(3)).is_err());
}

// ----- streaming -----------------------------------------------------------------------------

#[test]
fn emits_only_what_is_certain() {
    let mut p = OutputParser::new(cfg(false));
    assert_eq!(
        p.push("Hello <tool_c"),
        vec![Event::Content("Hello".into())]
    );
    let id = match p.push("all>\n<function=get_weather>\n").as_slice() {
        [Event::ToolCallStart { index: 0, id, name }] if name == "get_weather" => id.clone(),
        other => panic!("{other:?}"),
    };
    assert!(id.starts_with("call_"));
    assert_eq!(
        p.push("<parameter=city>\nPar"),
        vec![Event::ToolCallArguments {
            index: 0,
            fragment: "{\"city\":\"Par".into()
        }]
    );
    assert_eq!(
        p.push("is\n"),
        vec![Event::ToolCallArguments {
            index: 0,
            fragment: "is".into()
        }]
    );
    // "\n" may still be value text, and </parameter> may still be value text.
    assert_eq!(p.push("</parameter>\n"), vec![]);
    assert_eq!(
        p.push("</function>"),
        vec![Event::ToolCallArguments {
            index: 0,
            fragment: "\"".into()
        }]
    );
    assert_eq!(
        p.push("\n</tool_call>"),
        vec![
            Event::ToolCallArguments {
                index: 0,
                fragment: "}".into()
            },
            Event::ToolCallEnd { index: 0 }
        ]
    );
    let (tail, msg) = p.finish();
    assert!(tail.is_empty());
    assert_eq!(msg.content.as_deref(), Some("Hello"));
    assert_eq!(msg.tool_calls[0].arguments, r#"{"city":"Paris"}"#);
}

#[test]
fn reasoning_streams_and_holds_only_whitespace_and_tags() {
    let mut p = OutputParser::new(cfg(true));
    assert_eq!(p.push("Let me"), vec![Event::Reasoning("Let me".into())]);
    assert_eq!(p.push(" think\n"), vec![Event::Reasoning(" think".into())]);
    assert_eq!(p.push("</thi"), vec![]);
    assert_eq!(p.push("nk>\n\n"), vec![]);
    assert_eq!(p.push("Answer"), vec![Event::Content("Answer".into())]);
    let (tail, msg) = p.finish();
    assert!(tail.is_empty());
    assert_eq!(msg.reasoning.as_deref(), Some("Let me think"));
}

#[test]
fn string_values_stream_before_they_end() {
    let value: String = (0..200).map(|i| format!("row {i}\n")).collect();
    let t = format!(
        "<tool_call>\n<function=write_file>\n<parameter=content>\n{value}</parameter>\n</function>\n</tool_call>"
    );
    let pieces = random_split(&t, &mut Rng(5), 5);
    let mut p = OutputParser::new(cfg(false));
    let mut arg_events_before_close = 0;
    for x in &pieces {
        let ev = p.push(x);
        if !p_has_closed(&ev) {
            arg_events_before_close += ev
                .iter()
                .filter(|e| matches!(e, Event::ToolCallArguments { .. }))
                .count();
        }
    }
    assert!(arg_events_before_close > 100, "{arg_events_before_close}");
    let (_, msg) = p.finish();
    let v: serde_json::Value = serde_json::from_str(&msg.tool_calls[0].arguments).unwrap();
    assert_eq!(v["content"], json!(value.strip_suffix('\n').unwrap()));
}

fn p_has_closed(ev: &[Event]) -> bool {
    ev.iter().any(|e| matches!(e, Event::ToolCallEnd { .. }))
}

#[test]
fn typed_value_is_emitted_when_it_ends() {
    let mut p = OutputParser::new(cfg(false));
    p.push("<tool_call>\n<function=config>\n<parameter=n>\n");
    assert_eq!(p.push("12"), vec![]);
    assert_eq!(p.push("3\n</parameter>\n"), vec![]);
    assert_eq!(p.push("</func"), vec![]);
    assert_eq!(
        p.push("tion>"),
        vec![Event::ToolCallArguments {
            index: 0,
            fragment: "123".into()
        }]
    );
    let (_, msg) = p.finish();
    assert_eq!(msg.tool_calls[0].arguments, r#"{"n":123}"#);
}

#[test]
fn whitespace_between_calls_is_not_content() {
    let t = format!("{} \n \n{}\n ", weather_call("A"), weather_call("B"));
    let m = parse1(cfg(false), &t);
    assert_eq!(m.content, None);
    assert_eq!(m.tool_calls.len(), 2);
}
