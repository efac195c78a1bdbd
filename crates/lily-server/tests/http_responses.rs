//! OpenAI's Responses API over real HTTP, with the scripted backend (a "model" that writes a known
//! answer: reasoning, content and a tool call): the whole response and every event of the stream
//! in order, the stream equal to the whole response, the same prompt and answer as chat
//! completions give for the same conversation, function and freeform (custom) tool calls round-
//! tripped through `function_call_output` / `custom_tool_call_output` and `previous_response_id`,
//! the store (GET, DELETE, 404s), the token limit (`incomplete`), thinking off by effort, JSON
//! schemas through `text.format`, and 30+ bad requests each refused in OpenAI's error shape with the
//! server healthy after them.

mod common;

use std::time::Duration;

use common::*;
use lily_template::ChatTemplate;
use serde_json::{json, Value};

async fn scripted() -> Server {
    start_scripted(default_config(), Duration::ZERO).await.0
}

/// Prompt tokens of a chat request as the server should count them.
fn prompt_tokens(body: &Value) -> u64 {
    let text = ChatTemplate::builtin().render_request(body).unwrap();
    tokenizer().encode(&text).unwrap().len() as u64
}

fn weather_fn() -> Value {
    json!({"type": "function", "name": "get_weather", "description": "Weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}})
}

fn weather_request() -> Value {
    json!({"model": "whatever", "instructions": "Be brief.", "input": "What's the weather in Paris?", "tools": [weather_fn()],
        "temperature": 0.7, "top_p": 0.9, "store": true, "metadata": {"a": "b"}, "some_future_field": 1})
}

/// The chat-completions request for the same conversation.
fn weather_chat() -> Value {
    json!({"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What's the weather in Paris?"}],
        "tools": [weather_tool()]})
}

async fn create(s: &Server, body: &Value) -> Value {
    let (status, v) = s.post("/v1/responses", body).await;
    assert_eq!(status, 200, "{v}");
    v
}

/// Output items of a response by type.
fn items<'a>(r: &'a Value, ty: &str) -> Vec<&'a Value> {
    r["output"].as_array().unwrap().iter().filter(|i| i["type"] == ty).collect()
}

/// The response object without what differs between two runs of the same request.
fn comparable(r: &Value) -> Value {
    let mut r = r.clone();
    for k in ["id", "created_at", "completed_at"] {
        r.as_object_mut().unwrap().remove(k);
    }
    r["usage"]["input_tokens_details"]["cached_tokens"] = json!(0);
    for it in r["output"].as_array_mut().unwrap() {
        it.as_object_mut().unwrap().remove("id");
        if it.get("call_id").is_some() {
            it["call_id"] = json!("call");
        }
    }
    r
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_whole_response_is_what_chat_completions_answers() {
    let s = scripted().await;
    let r = create(&s, &weather_request()).await;
    assert_eq!(r["object"], "response");
    assert!(r["id"].as_str().unwrap().starts_with("resp_"));
    assert_eq!(r["status"], "completed");
    assert_eq!(r["model"], "whatever");
    assert_eq!(r["instructions"], "Be brief.");
    assert_eq!(r["metadata"], json!({"a": "b"}));
    assert_eq!(r["parallel_tool_calls"], true);
    assert_eq!(r["tool_choice"], "auto");
    assert_eq!(r["tools"][0]["name"], "get_weather");
    assert_eq!(r["error"], Value::Null);
    let types: Vec<&str> = r["output"].as_array().unwrap().iter().map(|i| i["type"].as_str().unwrap()).collect();
    assert_eq!(types, ["reasoning", "message", "function_call"], "{r}");
    let rs = items(&r, "reasoning")[0];
    assert!(rs["id"].as_str().unwrap().starts_with("rs_"));
    assert_eq!(rs["content"], json!([{"type": "reasoning_text", "text": "The user wants the weather."}]));
    let msg = items(&r, "message")[0];
    assert_eq!(msg["role"], "assistant");
    assert_eq!(msg["status"], "completed");
    assert_eq!(msg["content"][0]["type"], "output_text");
    assert_eq!(msg["content"][0]["text"], "Let me check.");
    assert_eq!(msg["content"][0]["annotations"], json!([]));
    let call = items(&r, "function_call")[0];
    assert!(call["id"].as_str().unwrap().starts_with("fc_"));
    assert!(call["call_id"].as_str().unwrap().starts_with("call_"));
    assert_eq!(call["name"], "get_weather");
    assert_eq!(call["status"], "completed");
    let args: Value = serde_json::from_str(call["arguments"].as_str().unwrap()).unwrap();
    assert_eq!(args, json!({"city": "Paris & <Lyon>"}));
    // One engine: the prompt is the chat request's, token for token, and so is the answer.
    let u = &r["usage"];
    assert_eq!(u["input_tokens"].as_u64().unwrap(), prompt_tokens(&weather_chat()));
    assert_eq!(u["input_tokens_details"]["cached_tokens"], 0);
    assert_eq!(u["total_tokens"].as_u64().unwrap(), u["input_tokens"].as_u64().unwrap() + u["output_tokens"].as_u64().unwrap());
    let reasoning_tokens = tokenizer().encode("The user wants the weather.").unwrap().len() as u64;
    assert_eq!(u["output_tokens_details"]["reasoning_tokens"].as_u64().unwrap(), reasoning_tokens);
    let chat = s.chat(weather_chat()).await;
    let cm = &chat["choices"][0]["message"];
    assert_eq!(cm["reasoning_content"], rs["content"][0]["text"]);
    assert_eq!(cm["content"], msg["content"][0]["text"]);
    assert_eq!(cm["tool_calls"][0]["function"]["arguments"], call["arguments"]);
    assert_eq!(chat["usage"]["completion_tokens"], u["output_tokens"]);
    // The same conversation again: its prompt came from the prefix cache the chat request left.
    assert_eq!(chat["usage"]["prompt_tokens"], u["input_tokens"]);
    let again = create(&s, &weather_request()).await;
    assert!(again["usage"]["input_tokens_details"]["cached_tokens"].as_u64().unwrap() > 0, "{}", again["usage"]);
}

/// Event types with runs of the same delta collapsed to one.
fn shape(events: &[(String, Value)]) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for (name, _) in events {
        if name.ends_with(".delta") && out.last() == Some(name) {
            continue;
        }
        out.push(name.clone());
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_stream_is_the_documented_event_sequence_and_equals_the_whole_response() {
    let s = scripted().await;
    let whole = create(&s, &weather_request()).await;
    let mut body = weather_request();
    body["stream"] = json!(true);
    let events = s.stream_events("/v1/responses", &[], &body).await;
    let expected = [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ];
    assert_eq!(shape(&events), expected, "{events:#?}");
    // Sequence numbers count up from 0; one response id throughout.
    for (i, (_, e)) in events.iter().enumerate() {
        assert_eq!(e["sequence_number"], i as u64);
    }
    let created = &events[0].1["response"];
    assert_eq!(created["status"], "in_progress");
    assert_eq!(created["output"], json!([]));
    let done = &events.last().unwrap().1["response"];
    assert_eq!(done["id"], created["id"]);
    assert_eq!(done["status"], "completed");
    // The completed response is the whole one.
    assert_eq!(comparable(done), comparable(&whole));
    // Deltas add up to the items' texts; every delta names its item and output index.
    let mut texts = [String::new(), String::new(), String::new()];
    for (name, e) in &events {
        let slot = match name.as_str() {
            "response.reasoning_text.delta" => 0,
            "response.output_text.delta" => 1,
            "response.function_call_arguments.delta" => 2,
            _ => continue,
        };
        assert_eq!(e["output_index"], slot as u64);
        assert_eq!(e["item_id"], done["output"][slot]["id"]);
        texts[slot].push_str(e["delta"].as_str().unwrap());
    }
    assert_eq!(texts[0], done["output"][0]["content"][0]["text"].as_str().unwrap());
    assert_eq!(texts[1], done["output"][1]["content"][0]["text"].as_str().unwrap());
    assert_eq!(texts[2], done["output"][2]["arguments"].as_str().unwrap());
    let added: Vec<&Value> = events.iter().filter(|(n, _)| n == "response.output_item.added").map(|(_, e)| &e["item"]).collect();
    assert!(added.iter().all(|i| i["status"] == "in_progress"));
    assert_eq!(added[2]["arguments"], "");
    let fdone = events.iter().find(|(n, _)| n == "response.function_call_arguments.done").unwrap();
    assert_eq!(fdone.1["arguments"], done["output"][2]["arguments"]);
    let tdone = events.iter().find(|(n, _)| n == "response.output_text.done").unwrap();
    assert_eq!(tdone.1["text"], "Let me check.");
    // A stored streamed response can be read back.
    let id = done["id"].as_str().unwrap();
    let (status, got) = s.get(&format!("/v1/responses/{id}")).await;
    assert_eq!(status, 200);
    assert_eq!(serde_json::from_str::<Value>(&got).unwrap(), *done);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_function_call_round_trips_through_its_output() {
    let s = scripted().await;
    let first = create(&s, &weather_request()).await;
    let call = items(&first, "function_call")[0].clone();
    let call_id = call["call_id"].as_str().unwrap();
    // Continued by id: only the tool's output is new.
    let by_id = create(&s, &json!({"previous_response_id": first["id"], "instructions": "Be brief.", "tools": [weather_fn()],
        "input": [{"type": "function_call_output", "call_id": call_id, "output": "{\"temp_c\": 21}"}]}))
    .await;
    assert_eq!(by_id["previous_response_id"], first["id"]);
    // Stateless: the whole conversation given back as items (reasoning, message and call included).
    let mut input = vec![json!({"role": "user", "content": "What's the weather in Paris?"})];
    input.extend(first["output"].as_array().unwrap().iter().cloned());
    input.push(json!({"type": "function_call_output", "call_id": call_id, "output": [{"type": "input_text", "text": "{\"temp_c\": 21}"}]}));
    let stateless = create(&s, &json!({"instructions": "Be brief.", "tools": [weather_fn()], "input": input, "store": false})).await;
    // Both are the chat request with the assistant's call and the tool's result.
    let chat = json!({"messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What's the weather in Paris?"},
        {"role": "assistant", "content": "Let me check.", "reasoning_content": "The user wants the weather.",
            "tool_calls": [{"id": call_id, "type": "function", "function": {"name": "get_weather", "arguments": call["arguments"]}}]},
        {"role": "tool", "tool_call_id": call_id, "content": "{\"temp_c\": 21}"}],
        "tools": [weather_tool()]});
    let want = prompt_tokens(&chat);
    assert_eq!(by_id["usage"]["input_tokens"].as_u64().unwrap(), want);
    assert_eq!(stateless["usage"]["input_tokens"].as_u64().unwrap(), want);
    // The first turn's prompt came from the cache.
    let first_prompt = first["usage"]["input_tokens"].as_u64().unwrap();
    let cached = by_id["usage"]["input_tokens_details"]["cached_tokens"].as_u64().unwrap();
    assert!(cached >= first_prompt - 8, "cached {cached} of a first prompt of {first_prompt}");
    // The text shows where the result went: the template's <tool_response>, after the call.
    let text = ChatTemplate::builtin().render_request(&chat).unwrap();
    assert!(text.contains("<tool_response>\n{\"temp_c\": 21}\n</tool_response>"), "{text}");
    assert_eq!(comparable(&by_id)["output"], comparable(&stateless)["output"]);
    // An unknown call id in the output is no error (the template renders it in place).
    let v = create(&s, &json!({"input": [{"role": "user", "content": "hi"}, {"type": "function_call_output", "call_id": "nope", "output": "x"}]})).await;
    assert_eq!(v["status"], "completed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_custom_tool_call_is_freeform_text_and_round_trips() {
    let s = scripted().await;
    let tools = json!([{"type": "custom", "name": "apply_patch", "description": "Edit files with a patch.",
        "format": {"type": "grammar", "syntax": "lark", "definition": "start: begin_patch hunk+ end_patch\nbegin_patch: \"*** Begin Patch\" LF"}}, weather_fn()]);
    let body = json!({"input": "[[patch]] add hello.txt", "tools": tools, "stream": true});
    let events = s.stream_events("/v1/responses", &[], &body).await;
    let done = &events.last().unwrap().1["response"];
    let call = done["output"].as_array().unwrap().iter().find(|i| i["type"] == "custom_tool_call").unwrap_or_else(|| panic!("{done}"));
    let patch = "*** Begin Patch\n*** Add File: hello.txt\n+Hello \"world\"\n*** End Patch";
    assert_eq!(call["name"], "apply_patch");
    assert_eq!(call["input"], patch);
    assert!(call["id"].as_str().unwrap().starts_with("ctc_"));
    let names: Vec<&str> = events.iter().map(|(n, _)| n.as_str()).collect();
    let i = names.iter().position(|n| *n == "response.custom_tool_call_input.delta").expect("input delta");
    assert_eq!(names[i + 1], "response.custom_tool_call_input.done");
    assert_eq!(events[i + 1].1["input"], patch);
    assert!(!names.contains(&"response.function_call_arguments.delta"));
    // The tool is offered to the model as a function of one string, with its grammar described.
    let prompt = ChatTemplate::builtin().render_request(&json!({"messages": user("x"), "tools": [{"type": "function", "function": {"name": "apply_patch"}}]})).unwrap();
    assert!(prompt.contains("apply_patch"));
    // Round trip: the call and its output go back into the prompt.
    let call_id = call["call_id"].as_str().unwrap();
    let v = create(&s, &json!({"previous_response_id": done["id"], "tools": tools,
        "input": [{"type": "custom_tool_call_output", "call_id": call_id, "output": "Done!"}]})).await;
    assert_eq!(v["status"], "completed");
    let stateless = create(&s, &json!({"tools": tools, "store": false, "input": [
        {"role": "user", "content": "[[patch]] add hello.txt"},
        {"type": "custom_tool_call", "call_id": call_id, "name": "apply_patch", "input": patch},
        {"type": "custom_tool_call_output", "call_id": call_id, "output": "Done!"}]})).await;
    // Same prompt except the reasoning kept in the stored turn (the template keeps it after the last user message).
    let (a, b) = (v["usage"]["input_tokens"].as_u64().unwrap(), stateless["usage"]["input_tokens"].as_u64().unwrap());
    assert!(a > b && a - b < 16, "{a} vs {b}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn namespaced_tools_are_offered_and_their_calls_carry_the_namespace() {
    let s = scripted().await;
    let body = json!({"input": "What's the weather in Paris?", "tools": [
        {"type": "namespace", "name": "meteo", "description": "Weather tools", "tools": [weather_fn()]},
        {"type": "web_search", "external_web_access": false}]});
    let r = create(&s, &body).await;
    let call = items(&r, "function_call")[0];
    assert_eq!(call["name"], "get_weather");
    assert_eq!(call["namespace"], "meteo");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_store_keeps_gets_and_deletes_and_unknown_ids_are_404() {
    let s = scripted().await;
    let r = create(&s, &json!({"input": "Say hello."})).await;
    let id = r["id"].as_str().unwrap();
    let (status, got) = s.get(&format!("/v1/responses/{id}")).await;
    assert_eq!(status, 200);
    assert_eq!(serde_json::from_str::<Value>(&got).unwrap(), r);
    // Not stored: nothing to get.
    let r2 = create(&s, &json!({"input": "Say hello.", "store": false})).await;
    let (status, body) = s.get(&format!("/v1/responses/{}", r2["id"].as_str().unwrap())).await;
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_error(status, &v, 404, None);
    assert_eq!(v["error"]["code"], "response_not_found");
    // Unknown ids: GET, DELETE and previous_response_id.
    let (status, body) = s.get("/v1/responses/resp_nope").await;
    assert_error(status, &serde_json::from_str(&body).unwrap(), 404, None);
    let (status, v) = s.post("/v1/responses", &json!({"input": "hi", "previous_response_id": "resp_nope"})).await;
    assert_error(status, &v, 404, Some("previous_response_id"));
    assert!(v["error"]["message"].as_str().unwrap().contains("resp_nope"));
    let r = s.http.delete(s.url(&format!("/v1/responses/{id}"))).send().await.unwrap();
    assert_eq!(r.status().as_u16(), 200);
    assert_eq!(r.json::<Value>().await.unwrap(), json!({"id": id, "object": "response.deleted", "deleted": true}));
    let (status, _) = s.get(&format!("/v1/responses/{id}")).await;
    assert_eq!(status, 404);
    let r = s.http.delete(s.url(&format!("/v1/responses/{id}"))).send().await.unwrap();
    assert_eq!(r.status().as_u16(), 404);
    // The plain answer, and output_text as the SDKs build it.
    let r = create(&s, &json!({"input": [{"role": "user", "content": [{"type": "input_text", "text": "Say hello."}]}]})).await;
    let text: String = items(&r, "message").iter().map(|m| m["content"][0]["text"].as_str().unwrap()).collect();
    assert_eq!(text, "Hello there! Ünïcödé 🌷 works.");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_token_limit_makes_the_response_incomplete() {
    let s = scripted().await;
    let r = create(&s, &json!({"input": "Say hello.", "max_output_tokens": 3})).await;
    assert_eq!(r["status"], "incomplete");
    assert_eq!(r["incomplete_details"], json!({"reason": "max_output_tokens"}));
    assert_eq!(r["usage"]["output_tokens"], 3);
    assert_eq!(r["max_output_tokens"], 3);
    assert_eq!(r["output"][0]["status"], "incomplete");
    let events = s.stream_events("/v1/responses", &[], &json!({"input": "Say hello.", "max_output_tokens": 3, "stream": true})).await;
    let (last, e) = events.last().unwrap();
    assert_eq!(last, "response.incomplete");
    assert_eq!(e["response"]["incomplete_details"]["reason"], "max_output_tokens");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reasoning_effort_none_turns_thinking_off() {
    let s = scripted().await;
    let r = create(&s, &json!({"input": "Say hello.", "reasoning": {"effort": "none"}})).await;
    assert!(items(&r, "reasoning").is_empty(), "{r}");
    assert_eq!(items(&r, "message")[0]["content"][0]["text"], "Hello there! Ünïcödé 🌷 works.");
    let off = json!({"messages": user("Say hello."), "chat_template_kwargs": {"enable_thinking": false}});
    assert_eq!(r["usage"]["input_tokens"].as_u64().unwrap(), prompt_tokens(&off));
    assert_eq!(r["reasoning"]["effort"], "none");
    let r = create(&s, &json!({"input": "Say hello.", "reasoning": {"effort": "high", "summary": "auto"}})).await;
    assert_eq!(items(&r, "reasoning")[0]["content"][0]["text"], "Just greet.");
    assert_eq!(r["usage"]["input_tokens"].as_u64().unwrap(), prompt_tokens(&json!({"messages": user("Say hello.")})));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn text_format_json_schema_constrains_the_answer() {
    let s = scripted().await;
    let schema = json!({"type": "object", "properties": {"greeting": {"enum": ["hi", "hello"]}}, "required": ["greeting"], "additionalProperties": false});
    for stream in [false, true] {
        let body = json!({"input": "hi", "temperature": 0, "max_output_tokens": 100, "stream": stream,
            "text": {"format": {"type": "json_schema", "name": "g", "schema": schema, "strict": true}}});
        let r = if stream { s.stream_events("/v1/responses", &[], &body).await.last().unwrap().1["response"].clone() } else { create(&s, &body).await };
        assert_eq!(r["status"], "completed", "{r}");
        assert_eq!(items(&r, "reasoning")[0]["content"][0]["text"], "Just greet.");
        let text = items(&r, "message")[0]["content"][0]["text"].as_str().unwrap().to_string();
        let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{text}: {e}"));
        assert!(v["greeting"] == "hi" || v["greeting"] == "hello", "{v}");
        assert_eq!(r["text"]["format"]["type"], "json_schema");
    }
    // A schema that cannot be compiled names its field.
    let (status, v) = s.post("/v1/responses", &json!({"input": "hi", "text": {"format": {"type": "json_schema", "name": "g", "schema": {"type": "nonsense"}}}})).await;
    assert_error(status, &v, 400, Some("text.format.schema"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn developer_and_late_system_messages_render() {
    let s = scripted().await;
    let input = json!([
        {"role": "developer", "content": "Be brief."},
        {"role": "system", "content": "And kind."},
        {"role": "user", "content": "Say hello."},
        {"role": "assistant", "content": "Hello."},
        {"role": "system", "content": "It is Monday now."},
        {"role": "user", "content": "Say hello again."}]);
    let r = create(&s, &json!({"input": input, "instructions": "You are lily."})).await;
    assert_eq!(r["status"], "completed");
    let chat = json!({"messages": [
        {"role": "system", "content": "You are lily.\n\nBe brief.\n\nAnd kind."},
        {"role": "user", "content": "Say hello."},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "It is Monday now."},
        {"role": "user", "content": "Say hello again."}]});
    assert_eq!(r["usage"]["input_tokens"].as_u64().unwrap(), prompt_tokens(&chat));
    // Chat completions take the same messages (the template alone would refuse them).
    let mut messages = vec![json!({"role": "system", "content": "You are lily."})];
    messages.extend(input.as_array().unwrap().iter().cloned());
    let v = s.chat(json!({"messages": messages})).await;
    assert_eq!(v["usage"]["prompt_tokens"], r["usage"]["input_tokens"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_get_openai_errors_naming_the_field_and_the_server_stays_healthy() {
    let s = scripted().await;
    let cases: Vec<(Value, &str)> = vec![
        (json!([]), ""),
        (json!({}), "input"),
        (json!({"input": 5}), "input"),
        (json!({"input": []}), "input"),
        (json!({"input": [5]}), "input[0]"),
        (json!({"input": [{"content": "x"}]}), "input[0].type"),
        (json!({"input": [{"role": "robot", "content": "x"}]}), "input[0].role"),
        (json!({"input": [{"role": "user"}]}), "input[0].content"),
        (json!({"input": [{"role": "user", "content": {"a": 1}}]}), "input[0].content"),
        (json!({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]}), "input[0].content[0].type"),
        (json!({"input": [{"role": "user", "content": [{"type": "input_text"}]}]}), "input[0].content[0].text"),
        (json!({"input": [{"role": "user", "content": [{"type": "wat", "text": "x"}]}]}), "input[0].content[0].type"),
        (json!({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}), "input[0].call_id"),
        (json!({"input": [{"type": "function_call", "call_id": "c", "arguments": "{}"}]}), "input[0].name"),
        (json!({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": {"a": 1}}]}), "input[0].arguments"),
        (json!({"input": [{"type": "function_call_output", "output": "x"}]}), "input[0].call_id"),
        (json!({"input": [{"type": "function_call_output", "call_id": "c", "output": 5}]}), "input[0].output"),
        (json!({"input": [{"type": "custom_tool_call", "call_id": "c", "name": "p"}]}), "input[0].input"),
        (json!({"input": [{"type": "reasoning", "summary": "x"}]}), "input[0].summary"),
        (json!({"input": [{"type": "item_reference", "id": "x"}]}), "input[0].type"),
        (json!({"input": [{"type": "teleport"}]}), "input[0].type"),
        (json!({"input": "hi", "instructions": 5}), "instructions"),
        (json!({"input": "hi", "tools": {"a": 1}}), "tools"),
        (json!({"input": "hi", "tools": [{"name": "f"}]}), "tools[0].type"),
        (json!({"input": "hi", "tools": [{"type": "function"}]}), "tools[0].name"),
        (json!({"input": "hi", "tools": [{"type": "function", "name": "f", "parameters": "x"}]}), "tools[0].parameters"),
        (json!({"input": "hi", "tools": [{"type": "function", "name": "f", "parameters": {"type": "object", "properties": {"a": {"type": 5}}}}]}), "tools[0].parameters.properties.a.type"),
        (json!({"input": "hi", "tools": [{"type": "teleporter"}]}), "tools[0].type"),
        (json!({"input": "hi", "tools": [{"type": "custom", "name": "p", "format": {"type": "bnf"}}]}), "tools[0].format.type"),
        (json!({"input": "hi", "tools": [{"type": "namespace", "name": "n"}]}), "tools[0].tools"),
        (json!({"input": "hi", "tools": [weather_fn()], "tool_choice": "sometimes"}), "tool_choice"),
        (json!({"input": "hi", "tools": [weather_fn()], "tool_choice": {"type": "function", "name": "nope"}}), "tool_choice"),
        (json!({"input": "hi", "tool_choice": "required"}), "tool_choice"),
        (json!({"input": "hi", "tools": [weather_fn()], "tool_choice": {"type": "web_search"}}), "tool_choice.type"),
        (json!({"input": "hi", "parallel_tool_calls": "yes"}), "parallel_tool_calls"),
        (json!({"input": "hi", "max_output_tokens": 0}), "max_output_tokens"),
        (json!({"input": "hi", "max_output_tokens": 1.5}), "max_output_tokens"),
        (json!({"input": "hi", "max_output_tokens": 100000}), "max_output_tokens"),
        (json!({"input": "hi", "temperature": "hot"}), "temperature"),
        (json!({"input": "hi", "temperature": -1}), "temperature"),
        (json!({"input": "hi", "top_p": 7}), "top_p"),
        (json!({"input": "hi", "reasoning": "high"}), "reasoning"),
        (json!({"input": "hi", "reasoning": {"effort": "extreme"}}), "reasoning.effort"),
        (json!({"input": "hi", "text": {"format": {"type": "yaml"}}}), "text.format.type"),
        (json!({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}}), "text.format.schema"),
        (json!({"input": "hi", "text": {"format": {"type": "json_schema", "schema": 3}}}), "text.format.schema"),
        (json!({"input": "hi", "stream": "yes"}), "stream"),
        (json!({"input": "hi", "store": 1}), "store"),
        (json!({"input": "hi", "model": 5}), "model"),
        (json!({"input": "hi", "metadata": []}), "metadata"),
        (json!({"input": "hi", "include": [1]}), "include[0]"),
        (json!({"input": "hi", "background": true}), "background"),
        (json!({"input": "hi", "conversation": "conv_1"}), "conversation"),
        (json!({"input": "hi", "top_logprobs": 5}), "top_logprobs"),
        (json!({"input": "hi", "previous_response_id": 5}), "previous_response_id"),
        (json!({"input": "x".repeat(200_000)}), "input"),
    ];
    assert!(cases.len() >= 30);
    for (body, param) in &cases {
        let (status, v) = s.post("/v1/responses", body).await;
        assert_error(status, &v, 400, if param.is_empty() { None } else { Some(param) });
        assert!(!v["error"]["message"].as_str().unwrap().contains("serde"), "{v}");
    }
    // Not JSON, the wrong content type, a wrong method: errors in the same shape.
    let (status, v) = s.post_raw("/v1/responses", b"{not json".to_vec()).await;
    assert_error(status, &v, 400, None);
    let r = s.http.post(s.url("/v1/responses")).header("content-type", "text/plain").body("hi").send().await.unwrap();
    assert_eq!(r.status().as_u16(), 415);
    assert_error_shape(&r.json().await.unwrap());
    let r = s.http.put(s.url("/v1/responses")).send().await.unwrap();
    assert_eq!(r.status().as_u16(), 405);
    assert_error_shape(&r.json().await.unwrap());
    s.assert_healthy().await;
    let r = create(&s, &json!({"input": "Say hello."})).await;
    assert_eq!(r["status"], "completed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_api_key_is_checked_in_either_header() {
    let mut cfg = default_config();
    cfg.api_key = Some("sekret".into());
    let (mut s, _) = start_scripted(cfg, Duration::ZERO).await;
    s.api_key = None;
    let (status, v) = s.post("/v1/responses", &json!({"input": "hi"})).await;
    assert_error(status, &v, 401, None);
    let (status, v) = s.post_with("/v1/responses", &[("authorization", "Bearer sekret")], &json!({"input": "Say hello."})).await;
    assert_eq!(status, 200, "{v}");
    let (status, _) = s.post_with("/v1/responses", &[("x-api-key", "sekret")], &json!({"input": "Say hello."})).await;
    assert_eq!(status, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_failure_is_response_failed_in_the_stream_and_a_500_whole() {
    let s = scripted().await;
    let events = s.stream_events("/v1/responses", &[], &json!({"input": "[[panic]]", "stream": true})).await;
    let names: Vec<&str> = events.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names.first(), Some(&"response.created"));
    assert_eq!(names.last(), Some(&"response.failed"), "{names:?}");
    let r = &events.last().unwrap().1["response"];
    assert_eq!(r["status"], "failed");
    assert_eq!(r["error"]["code"], "server_error");
    assert!(r["error"]["message"].as_str().unwrap().len() > 5);
    let (status, v) = s.post("/v1/responses", &json!({"input": "[[panic]]"})).await;
    assert_error(status, &v, 500, None);
    s.assert_healthy().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tool_call_under_a_json_format_is_not_a_500() {
    // Found by http_mutations: tools with a JSON answer format (an answer or a call), the model
    // calling the (untyped) tool right after its reasoning. The tool-call grammar ended a free body
    // with `</function>\n` in one terminal, and llguidance's forced-token computation panicked there
    // (a 500, on chat completions too); the terminal now ends at `</function>` (lily-grammar).
    let s = scripted().await;
    let schema = json!({"type": "object", "properties": {"a": {"enum": ["x", "y"]}}, "required": ["a"]});
    let params = json!({"type": "object", "properties": {"input": {"type": "string"}}, "required": ["input"]});
    let patch = "*** Begin Patch\n*** Add File: hello.txt\n+Hello \"world\"\n*** End Patch";
    for stream in [false, true] {
        let body = json!({"input": "[[patch]] add hello.txt", "max_output_tokens": 100, "stream": stream,
            "text": {"format": {"type": "json_schema", "name": "g", "schema": schema}},
            "tools": [{"type": "function", "name": "apply_patch", "parameters": params}]});
        let r = if stream { s.stream_events("/v1/responses", &[], &body).await.last().unwrap().1["response"].clone() } else { create(&s, &body).await };
        assert_eq!(r["status"], "completed", "{r}");
        let call = items(&r, "function_call")[0];
        assert_eq!(serde_json::from_str::<Value>(call["arguments"].as_str().unwrap()).unwrap(), json!({"input": patch}));
    }
    let chat = json!({"messages": user("[[patch]] add hello.txt"), "max_tokens": 100,
        "tools": [{"type": "function", "function": {"name": "apply_patch", "parameters": params}}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "g", "schema": schema}}});
    let v = s.chat(chat).await;
    assert_eq!(v["choices"][0]["finish_reason"], "tool_calls", "{v}");
}
