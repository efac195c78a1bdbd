//! Structured outputs through the real server on the CPU: a tiny random checkpoint with the real
//! 248K-token vocabulary, which unconstrained never writes valid JSON — so every valid answer here
//! is the grammar's doing. For 22 schemas (nested objects, arrays, enums, bounded numbers, anyOf,
//! oneOf, required and optional fields, patterns, $defs) every answer, streamed and whole, parses and
//! validates (the `jsonschema` crate); JSON mode always gives an object; forced and strict tool
//! calls always have valid arguments; the reasoning stays free before the answer; text completions
//! take the same fields; and a bad schema, regex or grammar is a 400 naming the field, after which
//! the server still answers. The schemas are bounded (strings with `maxLength`, arrays with
//! `maxItems`, no extra properties) so that a random model finishes them: an unbounded string is
//! valid to the grammar however long the model keeps writing it.

mod common;

use common::*;
use serde_json::{json, Value};

fn no_think() -> Value {
    json!({"enable_thinking": false})
}

/// A chat request for a schema, thinking off.
fn schema_request(schema: &Value, seed: u64) -> Value {
    json!({"messages": user("Answer in JSON."), "max_tokens": 600, "temperature": 1.0, "seed": seed,
        "chat_template_kwargs": no_think(),
        "response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": true}}})
}

fn validate(schema: &Value, text: &str) -> Result<Value, String> {
    let v: Value = serde_json::from_str(text).map_err(|e| format!("not JSON ({e}): {text:?}"))?;
    let validator = jsonschema::validator_for(schema).map_err(|e| format!("the test's schema is bad: {e}"))?;
    if let Err(e) = validator.validate(&v) {
        return Err(format!("does not validate ({e}): {text}"));
    }
    Ok(v)
}

/// A streamed chat answer put together: (reasoning, content, tool calls by index, finish_reason).
fn assemble(chunks: &[Value]) -> (String, String, Vec<(String, String)>, Value) {
    let (mut r, mut c) = (String::new(), String::new());
    let mut calls: Vec<(String, String)> = Vec::new();
    let mut finish = Value::Null;
    for ch in chunks {
        let Some(choice) = ch["choices"].get(0) else { continue };
        let d = &choice["delta"];
        r.push_str(d["reasoning_content"].as_str().unwrap_or(""));
        c.push_str(d["content"].as_str().unwrap_or(""));
        for tc in d["tool_calls"].as_array().into_iter().flatten() {
            let i = tc["index"].as_u64().unwrap() as usize;
            if calls.len() <= i {
                calls.resize(i + 1, (String::new(), String::new()));
            }
            if let Some(n) = tc["function"]["name"].as_str() {
                calls[i].0.push_str(n);
            }
            calls[i].1.push_str(tc["function"]["arguments"].as_str().unwrap_or(""));
        }
        if !choice["finish_reason"].is_null() {
            finish = choice["finish_reason"].clone();
        }
    }
    (r, c, calls, finish)
}

fn schemas() -> Vec<(&'static str, Value)> {
    vec![
        ("flat object, bounded integer", json!({"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 99}},
            "required": ["ok", "n"], "additionalProperties": false})),
        ("short string", json!({"type": "object", "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 12}}, "required": ["name"], "additionalProperties": false})),
        ("string enum", json!({"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"], "additionalProperties": false})),
        ("nested object with a zip pattern", json!({"type": "object", "properties": {
            "address": {"type": "object", "properties": {"street": {"type": "string", "maxLength": 20}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["street", "zip"], "additionalProperties": false}},
            "required": ["address"], "additionalProperties": false})),
        ("array of bounded integers", json!({"type": "array", "items": {"type": "integer", "minimum": -10, "maximum": 10}, "minItems": 1, "maxItems": 5})),
        ("array of enums", json!({"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 2, "maxItems": 3})),
        ("number with exclusive bounds", json!({"type": "object", "properties": {"p": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1}},
            "required": ["p"], "additionalProperties": false})),
        ("anyOf string or integer", json!({"type": "object", "properties": {"v": {"anyOf": [{"type": "string", "maxLength": 4}, {"type": "integer", "minimum": 0, "maximum": 9}]}},
            "required": ["v"], "additionalProperties": false})),
        ("required and optional fields", json!({"type": "object", "properties": {
            "id": {"type": "integer", "minimum": 1, "maximum": 999}, "note": {"type": "string", "maxLength": 8}, "flag": {"type": "boolean"}},
            "required": ["id"], "additionalProperties": false})),
        ("const", json!({"type": "object", "properties": {"kind": {"const": "event"}, "at": {"type": "integer", "minimum": 0, "maximum": 23}},
            "required": ["kind", "at"], "additionalProperties": false})),
        ("nullable string", json!({"type": "object", "properties": {"nick": {"type": ["string", "null"], "maxLength": 6}}, "required": ["nick"], "additionalProperties": false})),
        ("a bare boolean", json!({"type": "boolean"})),
        ("array of objects", json!({"type": "array", "maxItems": 3, "items": {"type": "object",
            "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 5}, "y": {"type": "integer", "minimum": 0, "maximum": 5}},
            "required": ["x", "y"], "additionalProperties": false}})),
        ("date pattern", json!({"type": "object", "properties": {"day": {"type": "string", "pattern": "^\\d{4}-\\d{2}-\\d{2}$"}}, "required": ["day"], "additionalProperties": false})),
        ("enum of mixed values", json!({"type": "object", "properties": {"v": {"enum": [1, "two", null, true, 3.5]}}, "required": ["v"], "additionalProperties": false})),
        ("oneOf tagged objects", json!({"oneOf": [
            {"type": "object", "properties": {"type": {"const": "cat"}, "lives": {"type": "integer", "minimum": 1, "maximum": 9}}, "required": ["type", "lives"], "additionalProperties": false},
            {"type": "object", "properties": {"type": {"const": "dog"}, "good": {"type": "boolean"}}, "required": ["type", "good"], "additionalProperties": false}]})),
        ("$defs and $ref (Pydantic's shape)", json!({"$defs": {"Point": {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9},
                "y": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["x", "y"], "additionalProperties": false}},
            "type": "object", "properties": {"a": {"$ref": "#/$defs/Point"}, "b": {"$ref": "#/$defs/Point"}}, "required": ["a", "b"], "additionalProperties": false})),
        ("deeply nested", json!({"type": "object", "properties": {"l1": {"type": "object", "properties": {"l2": {"type": "array", "maxItems": 2, "items": {
            "type": "object", "properties": {"l3": {"enum": ["x", "y"]}}, "required": ["l3"], "additionalProperties": false}}},
            "required": ["l2"], "additionalProperties": false}}, "required": ["l1"], "additionalProperties": false})),
        ("pattern and length together", json!({"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]+$", "minLength": 2, "maxLength": 4}},
            "required": ["code"], "additionalProperties": false})),
        ("negative and decimal bounds", json!({"type": "object", "properties": {"t": {"type": "number", "minimum": -40.5, "maximum": -0.5}},
            "required": ["t"], "additionalProperties": false})),
        ("integer enum", json!({"type": "object", "properties": {"level": {"type": "integer", "enum": [1, 2, 3]}}, "required": ["level"], "additionalProperties": false})),
        ("tuple of prefix items", json!({"type": "array", "prefixItems": [{"type": "boolean"}, {"enum": ["lo", "hi"]}], "items": false, "minItems": 2})),
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_answer_validates_for_22_schemas_streamed_and_whole() {
    let s = start_cpu(default_config()).await;
    let all = schemas();
    assert!(all.len() >= 20);
    for (i, (what, schema)) in all.iter().enumerate() {
        let v = s.chat(schema_request(schema, i as u64)).await;
        let choice = &v["choices"][0];
        let content = choice["message"]["content"].as_str().unwrap_or_else(|| panic!("{what}: no content: {v}"));
        assert_eq!(choice["finish_reason"], "stop", "{what}: {v}");
        validate(schema, content).unwrap_or_else(|e| panic!("{what}: {e}"));

        let mut body = schema_request(schema, 1000 + i as u64);
        body["stream"] = json!(true);
        let chunks = s.stream_chunks("/v1/chat/completions", &body).await;
        let (_, content, _, finish) = assemble(&chunks);
        assert_eq!(finish, "stop", "{what} (streamed)");
        validate(schema, &content).unwrap_or_else(|e| panic!("{what} (streamed): {e}"));
    }
    // The same requests without the grammar: never JSON (a random model writes word salad).
    for (i, (what, _)) in all.iter().enumerate().take(6) {
        let v = s
            .chat(json!({"messages": user("Answer in JSON."), "max_tokens": 30, "temperature": 1.0, "seed": i, "chat_template_kwargs": no_think()}))
            .await;
        let content = v["choices"][0]["message"]["content"].as_str().unwrap_or("");
        assert!(serde_json::from_str::<Value>(content).is_err(), "{what}: unconstrained output parsed: {content:?}");
    }
    s.assert_healthy().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_mode_always_gives_an_object() {
    let s = start_cpu(default_config()).await;
    // JSON mode bounds nothing: a bias towards closing quotes and braces lets the random model
    // (whose logits are sharp: the top token is often 10+ nats ahead) finish its strings and objects.
    // The grammar, not the bias, makes it JSON: see the check below.
    let bias = json!({token_id("\"").to_string(): 16, token_id("}").to_string(): 16, token_id("\"}").to_string(): 16});
    for seed in 0..6u64 {
        let mut body = json!({"messages": user("JSON please."), "max_tokens": 800, "temperature": 1.0, "seed": seed,
            "chat_template_kwargs": no_think(), "logit_bias": bias, "response_format": {"type": "json_object"}});
        let content = if seed % 2 == 0 {
            let v = s.chat(body).await;
            assert_eq!(v["choices"][0]["finish_reason"], "stop", "seed {seed}: {v}");
            v["choices"][0]["message"]["content"].as_str().unwrap().to_string()
        } else {
            body["stream"] = json!(true);
            let (_, content, _, finish) = assemble(&s.stream_chunks("/v1/chat/completions", &body).await);
            assert_eq!(finish, "stop", "seed {seed} (streamed)");
            content
        };
        let v: Value = serde_json::from_str(&content).unwrap_or_else(|e| panic!("seed {seed}: not JSON ({e}): {content:?}"));
        assert!(v.is_object(), "seed {seed}: {v}");
        // With the same bias and no grammar: not an object.
        let free = s
            .chat(json!({"messages": user("JSON please."), "max_tokens": 40, "temperature": 1.0, "seed": seed,
                "chat_template_kwargs": no_think(), "logit_bias": bias}))
            .await;
        let text = free["choices"][0]["message"]["content"].as_str().unwrap_or("");
        assert!(!serde_json::from_str::<Value>(text).is_ok_and(|v| v.is_object()), "seed {seed}: unconstrained output is an object: {text:?}");
    }
}

fn strict_tools() -> Value {
    json!([
        {"type": "function", "function": {"name": "get_weather", "strict": true, "description": "Weather of a city",
            "parameters": {"type": "object", "properties": {
                "city": {"type": "string", "enum": ["Paris", "Lyon", "Nice"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
                "detail": {"type": "string", "maxLength": 10}},
            "required": ["city", "days"], "additionalProperties": false}}},
        {"type": "function", "function": {"name": "book_room", "strict": true, "description": "Book a hotel room",
            "parameters": {"type": "object", "properties": {
                "guest": {"type": "string", "minLength": 1, "maxLength": 8},
                "nights": {"type": "integer", "minimum": 1, "maximum": 5},
                "breakfast": {"type": "boolean"},
                "tags": {"type": "array", "items": {"enum": ["quiet", "view"]}, "maxItems": 2}},
            "required": ["guest", "nights", "breakfast"], "additionalProperties": false}}}
    ])
}

fn tool_schema(tools: &Value, name: &str) -> Value {
    tools.as_array().unwrap().iter().find(|t| t["function"]["name"] == name).unwrap_or_else(|| panic!("no tool {name}"))["function"]["parameters"].clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forced_and_strict_tool_calls_always_have_valid_arguments() {
    let s = start_cpu(default_config()).await;
    let tools = strict_tools();
    let tool_call = token_id("<tool_call>");
    let cases: Vec<(&str, Value)> = vec![
        ("required", json!("required")),
        ("named", json!({"type": "function", "function": {"name": "book_room"}})),
        ("auto (the model's own <tool_call>)", json!("auto")),
    ];
    let mut calls_seen = 0;
    for (what, choice) in cases {
        for seed in 0..4u64 {
            let mut body = json!({"messages": user("Plan my trip."), "tools": tools, "tool_choice": choice, "max_tokens": 400,
                "temperature": 1.0, "seed": seed, "chat_template_kwargs": no_think()});
            // The random model would go on making calls (`\n` then the next `<tool_call>`) rather
            // than end its turn: a bias ends it after a call. In "auto" it would never open a call by
            // itself: a bias makes it start one.
            let mut bias = json!({token_id("<|im_end|>").to_string(): 20});
            if what.starts_with("auto") {
                bias[tool_call.to_string()] = json!(30);
            }
            body["logit_bias"] = bias;
            let calls: Vec<(String, String)> = if seed % 2 == 0 {
                let v = s.chat(body).await;
                assert_eq!(v["choices"][0]["finish_reason"], "tool_calls", "{what} seed {seed}: {v}");
                v["choices"][0]["message"]["tool_calls"]
                    .as_array()
                    .unwrap_or_else(|| panic!("{what} seed {seed}: no tool calls: {v}"))
                    .iter()
                    .map(|c| (c["function"]["name"].as_str().unwrap().to_string(), c["function"]["arguments"].as_str().unwrap().to_string()))
                    .collect()
            } else {
                body["stream"] = json!(true);
                let (_, _, calls, finish) = assemble(&s.stream_chunks("/v1/chat/completions", &body).await);
                assert_eq!(finish, "tool_calls", "{what} seed {seed} (streamed)");
                calls
            };
            assert!(!calls.is_empty(), "{what} seed {seed}");
            if what == "named" {
                assert_eq!(calls.len(), 1, "a named tool choice is one call");
                assert_eq!(calls[0].0, "book_room");
            }
            for (name, args) in &calls {
                validate(&tool_schema(&tools, name), args).unwrap_or_else(|e| panic!("{what} seed {seed}, {name}: {e}"));
                calls_seen += 1;
            }
        }
    }
    assert!(calls_seen >= 12);
    // parallel_tool_calls: without the bias the random model makes call after call; with
    // `parallel_tool_calls: false` the grammar ends the turn after one.
    for seed in 0..2u64 {
        let body = |parallel: bool| {
            json!({"messages": user("Plan my trip."), "tools": tools, "tool_choice": "required", "parallel_tool_calls": parallel,
                "max_tokens": 300, "temperature": 1.0, "seed": seed, "chat_template_kwargs": no_think()})
        };
        let many = s.chat(body(true)).await;
        let n = many["choices"][0]["message"]["tool_calls"].as_array().map_or(0, Vec::len);
        assert!(n > 1, "seed {seed}: the random model was expected to make several calls: {many}");
        let one = s.chat(body(false)).await;
        assert_eq!(one["choices"][0]["message"]["tool_calls"].as_array().map(Vec::len), Some(1), "{one}");
        assert_eq!(one["choices"][0]["finish_reason"], "tool_calls");
    }
    s.assert_healthy().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_reasoning_is_free_and_the_answer_follows_it() {
    let s = start_cpu(default_config()).await;
    let schema = &schemas()[0].1;
    let think_end = token_id("</think>");
    let mut reasoned = 0;
    for seed in 0..3u64 {
        // Thinking on (the template's default). A bias closes the random model's reasoning after a
        // few tokens and keeps it from ending the turn inside it; the grammar then masks `</think>`.
        let mut body = schema_request(schema, seed);
        body.as_object_mut().unwrap().remove("chat_template_kwargs");
        body["logit_bias"] = json!({think_end.to_string(): 20, token_id("<|im_end|>").to_string(): -100, token_id("<|endoftext|>").to_string(): -100});
        let v = s.chat(body).await;
        let m = &v["choices"][0]["message"];
        assert_eq!(v["choices"][0]["finish_reason"], "stop", "{v}");
        validate(schema, m["content"].as_str().unwrap()).unwrap_or_else(|e| panic!("seed {seed}: {e}"));
        if m["reasoning_content"].as_str().is_some_and(|r| !r.is_empty()) {
            reasoned += 1;
        }
    }
    assert!(reasoned > 0, "the reasoning was never written: the test shows nothing");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_or_a_call_when_both_are_offered() {
    // What the openai-agents SDK sends for an agent with an output type and tools.
    let s = start_cpu(default_config()).await;
    let tools = strict_tools();
    let schema = &schemas()[2].1;
    let (mut answers, mut calls) = (0, 0);
    for seed in 0..8u64 {
        let mut body = schema_request(schema, seed);
        body["tools"] = tools.clone();
        let v = s.chat(body).await;
        let m = &v["choices"][0]["message"];
        match m["tool_calls"].as_array() {
            Some(tc) if !tc.is_empty() => {
                calls += 1;
                for c in tc {
                    let name = c["function"]["name"].as_str().unwrap();
                    validate(&tool_schema(&tools, name), c["function"]["arguments"].as_str().unwrap()).unwrap();
                }
            }
            _ => {
                answers += 1;
                validate(schema, m["content"].as_str().unwrap_or_else(|| panic!("seed {seed}: neither: {v}"))).unwrap();
            }
        }
    }
    assert_eq!(answers + calls, 8);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn text_completions_take_the_same_fields() {
    let s = start_cpu(default_config()).await;
    let schema = &schemas()[1].1;
    let (st, v) = s
        .post("/v1/completions", &json!({"prompt": "Data:", "max_tokens": 300, "temperature": 1.0, "seed": 1,
            "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}}))
        .await;
    assert_eq!(st, 200, "{v}");
    validate(schema, v["choices"][0]["text"].as_str().unwrap()).unwrap();
    let (st, v) = s
        .post("/v1/completions", &json!({"prompt": "Pick:", "max_tokens": 20, "seed": 2, "structured_outputs": {"choice": ["left", "right", "up"]}}))
        .await;
    assert_eq!(st, 200, "{v}");
    assert!(["left", "right", "up"].contains(&v["choices"][0]["text"].as_str().unwrap()), "{v}");
    let (st, v) = s
        .post("/v1/completions", &json!({"prompt": "Id:", "max_tokens": 20, "seed": 3, "structured_outputs": {"regex": "[A-Z]{2}-[0-9]{3}"}}))
        .await;
    assert_eq!(st, 200, "{v}");
    let text = v["choices"][0]["text"].as_str().unwrap();
    let b = text.as_bytes();
    assert!(b.len() == 6 && b[..2].iter().all(u8::is_ascii_uppercase) && b[2] == b'-' && b[3..].iter().all(u8::is_ascii_digit), "{text:?}");
    // A Lark grammar, streamed.
    let body = json!({"prompt": "Say:", "max_tokens": 30, "seed": 4, "stream": true,
        "structured_outputs": {"grammar": "start: greeting \" \" name\ngreeting: \"hello\" | \"hi\"\nname: /[a-z]{1,5}/"}});
    let text: String = s.stream_chunks("/v1/completions", &body).await.iter().filter_map(|c| c["choices"][0]["text"].as_str().map(str::to_string)).collect();
    let (g, n) = text.split_once(' ').unwrap_or_else(|| panic!("{text:?}"));
    assert!(["hello", "hi"].contains(&g) && (1..=5).contains(&n.len()) && n.bytes().all(|c| c.is_ascii_lowercase()), "{text:?}");
    // The older vLLM field names.
    let (st, v) = s.post("/v1/completions", &json!({"prompt": "Pick:", "max_tokens": 20, "seed": 5, "guided_choice": ["yes", "no"]})).await;
    assert_eq!(st, 200, "{v}");
    assert!(["yes", "no"].contains(&v["choices"][0]["text"].as_str().unwrap()), "{v}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_schema_grammar_or_regex_is_a_400_naming_it() {
    let s = start_cpu(default_config()).await;
    let rf = |schema: Value| json!({"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": true}});
    let chat = |extra: Value| {
        let mut b = json!({"messages": user("hi"), "max_tokens": 4});
        for (k, v) in extra.as_object().unwrap() {
            b[k] = v.clone();
        }
        b
    };
    let cases: Vec<(&str, Value, &str, &str)> = vec![
        ("a type that does not exist", chat(json!({"response_format": rf(json!({"type": "strnig"}))})), "response_format.json_schema.schema", "strnig"),
        ("a schema that is not an object", chat(json!({"response_format": rf(json!(5))})), "response_format.json_schema.schema", "schema"),
        ("an impossible range", chat(json!({"response_format": rf(json!({"type": "integer", "minimum": 5, "maximum": 1}))})), "response_format.json_schema.schema", ""),
        ("a keyword lily cannot enforce (strict)", chat(json!({"response_format": rf(json!({"type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}}))})),
            "response_format.json_schema.schema", "if"),
        ("a broken $ref", chat(json!({"response_format": rf(json!({"$ref": "#/$defs/Nope"}))})), "response_format.json_schema.schema", "Nope"),
        ("json_schema without its object", chat(json!({"response_format": {"type": "json_schema"}})), "response_format.json_schema", "json_schema"),
        ("an unknown response_format", chat(json!({"response_format": {"type": "yaml"}})), "response_format", "yaml"),
        ("a bad regex", chat(json!({"structured_outputs": {"regex": "([a-z]"}})), "structured_outputs.regex", ""),
        ("a grammar with an undefined rule", chat(json!({"structured_outputs": {"grammar": "start: foo bar\nfoo: \"x\""}})), "structured_outputs.grammar", "bar"),
        ("a GBNF grammar", chat(json!({"structured_outputs": {"grammar": "root ::= \"a\""}})), "structured_outputs.grammar", "GBNF"),
        ("no choices", chat(json!({"structured_outputs": {"choice": []}})), "structured_outputs.choice", "list"),
        ("two kinds at once", chat(json!({"structured_outputs": {"regex": "a", "choice": ["b"]}})), "structured_outputs", "one kind"),
        ("both fields", chat(json!({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}})), "structured_outputs.regex", "twice"),
        ("a strict tool with a bad schema", chat(json!({"tools": [{"type": "function", "function": {"name": "f", "strict": true,
            "parameters": {"type": "object", "properties": {"n": {"type": "integer", "minimum": "low"}}, "required": ["n"]}}}], "tool_choice": "required"})),
            "tools[0].function.parameters.properties.n.minimum", "number"),
        ("a bad regex in a completion", json!({"prompt": "x", "max_tokens": 2, "structured_outputs": {"regex": "(("}}), "structured_outputs.regex", ""),
    ];
    for (what, body, param, needle) in cases {
        let path = if body.get("prompt").is_some() { "/v1/completions" } else { "/v1/chat/completions" };
        let (st, v) = s.post(path, &body).await;
        assert_error(st, &v, 400, Some(param));
        let msg = v["error"]["message"].as_str().unwrap();
        assert!(msg.contains(needle), "{what}: the message should mention {needle:?}: {msg}");
        eprintln!("{what}: {msg}");
    }
    s.assert_healthy().await;
    // And a good constrained request still works after all of them.
    let v = s.chat(schema_request(&schemas()[2].1, 9)).await;
    validate(&schemas()[2].1, v["choices"][0]["message"]["content"].as_str().unwrap()).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_scripted_model_reasons_then_answers_in_json() {
    // The scripted "model" writes `<think>\nJust greet.\n</think>\n\nHello there!…`: its reasoning
    // survives untouched, and its answer is replaced by what the grammar allows.
    let (s, _) = start_scripted(default_config(), std::time::Duration::ZERO).await;
    let schema = json!({"type": "object", "properties": {"greeting": {"enum": ["hi", "hello"]}}, "required": ["greeting"], "additionalProperties": false});
    for stream in [false, true] {
        let mut body = json!({"messages": user("hi"), "temperature": 0, "max_tokens": 100,
            "response_format": {"type": "json_schema", "json_schema": {"name": "g", "schema": schema}}});
        let (reasoning, content) = if stream {
            body["stream"] = json!(true);
            let (r, c, _, finish) = assemble(&s.stream_chunks("/v1/chat/completions", &body).await);
            assert_eq!(finish, "stop");
            (r, c)
        } else {
            let v = s.chat(body).await;
            let m = &v["choices"][0]["message"];
            (m["reasoning_content"].as_str().unwrap_or("").to_string(), m["content"].as_str().unwrap().to_string())
        };
        assert_eq!(reasoning, "Just greet.");
        validate(&schema, &content).unwrap();
    }
    // response_format text is no constraint at all.
    let v = s.chat(json!({"messages": user("hi"), "response_format": {"type": "text"}})).await;
    assert_eq!(v["choices"][0]["message"]["content"], "Hello there! Ünïcödé 🌷 works.");
}
