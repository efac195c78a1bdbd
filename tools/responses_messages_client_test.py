#!/usr/bin/env python3
"""Drives a real `lily serve` with the official clients of the other two APIs: the `openai`
package's Responses API (`responses.create`, streamed and not, with a function tool, a tool call
round-tripped through `function_call_output`, `previous_response_id`, `responses.retrieve`,
structured output through `text.format`) and the `anthropic` package's Messages API
(`messages.create`, `messages.stream`, `messages.count_tokens`, a tool call round-tripped through
`tool_result`, errors). Every answer is parsed by the client's own typed models.

    python3 tools/responses_messages_client_test.py target/release/lily              # the demo model
    python3 tools/responses_messages_client_test.py target/release/lily --model DIR

The demo model's weights are random: tool calls are forced (`tool_choice`), which lily constrains
to the tool's schema, so they are real calls with valid arguments. Prints one line per check and
"N passed, M failed"; exits 1 if any check failed.
"""

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import traceback

import anthropic
import openai

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from openai_client_test import API_KEY, Server  # noqa: E402

CITY_TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather of a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Lyon", "Nice"]}},
                   "required": ["city"], "additionalProperties": False},
}
CITY_TOOL_A = {"name": "get_weather", "description": "The weather of a city.", "input_schema": CITY_TOOL["parameters"]}


def run_checks(base):
    oa = openai.OpenAI(base_url=f"{base}/v1", api_key=API_KEY, max_retries=0, timeout=120)
    an = anthropic.Anthropic(base_url=base, api_key=API_KEY, max_retries=0, timeout=120)
    checks = []

    def check(fn):
        checks.append(fn)
        return fn

    # ------------------------------------------------------------------ Responses

    @check
    def responses_create_whole():
        r = oa.responses.create(model="lily", input="Tell me about the sea.", instructions="Be brief.", max_output_tokens=12,
                                temperature=0, reasoning={"effort": "none"})
        assert r.object == "response" and r.id.startswith("resp_"), r
        assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens", (r.status, r.incomplete_details)
        assert r.usage.output_tokens == 12, r.usage
        assert r.usage.input_tokens > 10 and r.usage.input_tokens_details.cached_tokens >= 0
        assert isinstance(r.output_text, str) and r.output_text, r.output
        assert r.output[0].type == "message" and r.output[0].content[0].type == "output_text"
        got = oa.responses.retrieve(r.id)
        assert got.id == r.id and got.output_text == r.output_text

    @check
    def responses_stream_equals_whole():
        kw = dict(model="lily", input="Tell me about the sea.", max_output_tokens=16, temperature=0, reasoning={"effort": "none"})
        whole = oa.responses.create(**kw)
        types, text, final = [], "", None
        with oa.responses.stream(**kw) as stream:
            for ev in stream:
                types.append(ev.type)
                if ev.type == "response.output_text.delta":
                    text += ev.delta
                if ev.type == "response.incomplete":
                    # (The SDK's get_final_response() only takes response.completed.)
                    final = ev.response
        assert types[:2] == ["response.created", "response.in_progress"], types[:4]
        assert types[-1] == "response.incomplete", types[-3:]
        assert "response.output_item.added" in types and "response.content_part.added" in types
        assert "response.output_text.done" in types and "response.output_item.done" in types
        assert text == whole.output_text == final.output_text, (text, whole.output_text)
        # Also through create(stream=True), the raw event objects.
        evs = list(oa.responses.create(stream=True, **kw))
        assert [e.sequence_number for e in evs] == list(range(len(evs)))
        assert evs[-1].response.usage.output_tokens == 16

    @check
    def responses_function_tool_round_trip():
        first = oa.responses.create(model="lily", input="What is the weather in Paris?", tools=[CITY_TOOL],
                                    tool_choice="required", max_output_tokens=64, reasoning={"effort": "none"})
        calls = [o for o in first.output if o.type == "function_call"]
        assert calls, first.output
        call = calls[0]
        assert call.name == "get_weather" and call.call_id.startswith("call_")
        args = json.loads(call.arguments)
        assert args["city"] in ("Paris", "Lyon", "Nice"), args
        # The stream of a forced call: its argument deltas add up.
        deltas, done = "", None
        with oa.responses.stream(model="lily", input="What is the weather in Paris?", tools=[CITY_TOOL], tool_choice="required",
                                 max_output_tokens=64, reasoning={"effort": "none"}) as s:
            for ev in s:
                if ev.type == "response.function_call_arguments.delta":
                    deltas += ev.delta
                elif ev.type == "response.function_call_arguments.done":
                    done = ev.arguments
            final = s.get_final_response()
        assert done is not None and deltas == done, (deltas, done)
        assert final.status == "completed" and final.output[-1].type == "function_call" and final.output[-1].arguments == done
        json.loads(done)
        # The result goes back, by previous_response_id and statelessly.
        out = {"type": "function_call_output", "call_id": call.call_id, "output": json.dumps({"temp_c": 21})}
        second = oa.responses.create(model="lily", previous_response_id=first.id, input=[out], tools=[CITY_TOOL],
                                     max_output_tokens=8, reasoning={"effort": "none"})
        assert second.previous_response_id == first.id
        assert second.usage.input_tokens > first.usage.input_tokens
        assert second.usage.input_tokens_details.cached_tokens > 0, second.usage
        items = [{"role": "user", "content": "What is the weather in Paris?"}] + [o.model_dump(exclude_none=True) for o in first.output] + [out]
        third = oa.responses.create(model="lily", input=items, tools=[CITY_TOOL], max_output_tokens=8, store=False,
                                    reasoning={"effort": "none"})
        assert third.usage.input_tokens == second.usage.input_tokens, (third.usage, second.usage)

    @check
    def responses_structured_output():
        fmt = {"type": "json_schema", "name": "city", "strict": True,
               "schema": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Lyon"]}},
                          "required": ["city"], "additionalProperties": False}}
        r = oa.responses.create(model="lily", input="Name a city.", text={"format": fmt}, max_output_tokens=64,
                                reasoning={"effort": "none"})
        assert r.status == "completed", r
        assert json.loads(r.output_text)["city"] in ("Paris", "Lyon"), r.output_text

    @check
    def responses_errors():
        try:
            oa.responses.retrieve("resp_does_not_exist")
            raise AssertionError("an unknown id should be a 404")
        except openai.NotFoundError as e:
            assert "resp_does_not_exist" in str(e)
        try:
            oa.responses.create(model="lily", input=[{"type": "function_call_output", "output": "x"}])
            raise AssertionError("a call output without a call_id should be a 400")
        except openai.BadRequestError as e:
            assert e.body["param"] == "input[0].call_id", e.body
        try:
            oa.responses.create(model="lily", input="hi", previous_response_id="resp_nope")
            raise AssertionError("an unknown previous_response_id should be a 404")
        except openai.NotFoundError:
            pass

    # ------------------------------------------------------------------ Messages

    msgs = [{"role": "user", "content": "Tell me about the sea."}]

    @check
    def messages_create():
        m = an.messages.create(model="lily", max_tokens=12, messages=msgs, system="Be brief.", extra_body={"temperature": 0})
        assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_")
        assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 12, (m.stop_reason, m.usage)
        assert m.content and m.content[0].type == "text" and m.content[0].text
        assert m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0) > 5

    @check
    def messages_stream_equals_create():
        kw = dict(model="lily", max_tokens=16, messages=msgs, extra_body={"temperature": 0})
        whole = an.messages.create(**kw)
        types = []
        with an.messages.stream(**kw) as s:
            text = "".join(s.text_stream)
            final = s.get_final_message()
        with an.messages.stream(**kw) as s:
            for ev in s:
                types.append(ev.type)
        assert text == whole.content[0].text == final.content[0].text, (text, whole.content)
        assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 16
        assert types[0] == "message_start" and types[-1] == "message_stop", types
        # The SDK's own stream handler reports the raw events too: content_block_start / delta / stop.
        assert "content_block_start" in types and "content_block_stop" in types and "message_delta" in types, types

    @check
    def messages_thinking_stream():
        with an.messages.stream(model="lily", max_tokens=24, messages=msgs, thinking={"type": "enabled", "budget_tokens": 1024}) as s:
            final = s.get_final_message()
        assert final.content[0].type == "thinking" and final.content[0].thinking, final.content

    @check
    def messages_tool_round_trip():
        m = an.messages.create(model="lily", max_tokens=64, messages=[{"role": "user", "content": "Weather in Paris?"}],
                               tools=[CITY_TOOL_A], tool_choice={"type": "tool", "name": "get_weather"})
        uses = [b for b in m.content if b.type == "tool_use"]
        assert uses and uses[0].name == "get_weather" and uses[0].input["city"] in ("Paris", "Lyon", "Nice"), m.content
        assert m.stop_reason == "tool_use", m.stop_reason
        with an.messages.stream(model="lily", max_tokens=64, messages=[{"role": "user", "content": "Weather in Paris?"}],
                                tools=[CITY_TOOL_A], tool_choice={"type": "any"}) as s:
            final = s.get_final_message()
        assert any(b.type == "tool_use" and b.input.get("city") for b in final.content), final.content
        history = [{"role": "user", "content": "Weather in Paris?"},
                   {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]},
                   {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id, "content": "21 C, sunny"}]}]
        m2 = an.messages.create(model="lily", max_tokens=8, messages=history, tools=[CITY_TOOL_A])
        assert m2.usage.cache_read_input_tokens > 0, m2.usage
        assert m2.usage.input_tokens + m2.usage.cache_read_input_tokens > m.usage.input_tokens + m.usage.cache_read_input_tokens

    @check
    def messages_count_tokens():
        n = an.messages.count_tokens(model="lily", messages=msgs, system="Be brief.")
        m = an.messages.create(model="lily", max_tokens=4, messages=msgs, system="Be brief.")
        assert n.input_tokens == m.usage.input_tokens + m.usage.cache_read_input_tokens, (n, m.usage)
        n2 = an.messages.count_tokens(model="lily", messages=msgs, system="Be brief.", tools=[CITY_TOOL_A])
        assert n2.input_tokens > n.input_tokens + 50

    @check
    def messages_errors():
        try:
            an.messages.create(model="lily", max_tokens=8, messages=[{"role": "user", "content": [{"type": "hologram"}]}])
            raise AssertionError("an unknown block type should be a 400")
        except anthropic.BadRequestError as e:
            assert e.body["type"] == "error" and e.body["error"]["type"] == "invalid_request_error", e.body
            assert "messages[0].content[0].type" in e.body["error"]["message"]
        bad = anthropic.Anthropic(base_url=base, api_key="wrong", max_retries=0)
        try:
            bad.messages.create(model="lily", max_tokens=8, messages=msgs)
            raise AssertionError("a wrong key should be a 401")
        except anthropic.AuthenticationError as e:
            assert e.body["error"]["type"] == "authentication_error", e.body
        # The models list reads in both clients.
        assert [m.id for m in an.models.list().data] == [m.id for m in oa.models.list().data]

    passed = failed = 0
    for fn in checks:
        t = time.time()
        try:
            fn()
            passed += 1
            print(f"PASS {fn.__name__} ({time.time() - t:.1f}s)", flush=True)
        except Exception:  # noqa: BLE001
            failed += 1
            print(f"FAIL {fn.__name__}:\n{traceback.format_exc()}", flush=True)
    return passed, failed


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("binary")
    ap.add_argument("--model")
    ap.add_argument("--cache-dir")
    ap.add_argument("--ctx-size", type=int, default=4096)
    args = ap.parse_args()
    tmp = None
    cache_dir = args.cache_dir or os.environ.get("LILY_CACHE")
    if not cache_dir:
        tmp = tempfile.mkdtemp(prefix="lily-apis-test-")
        cache_dir = tmp
    server = Server(os.path.abspath(args.binary), args.model, cache_dir, args.ctx_size)
    try:
        server.wait_healthy()
        passed, failed = run_checks(server.base)
        if server.proc.poll() is not None:
            failed += 1
            print(f"FAIL server_still_running: exited with {server.proc.returncode}")
    except Exception as e:  # noqa: BLE001
        print(f"FAIL startup: {e}")
        passed, failed = 0, 1
    finally:
        server.stop()
        if failed:
            print("--- server output (tail) ---")
            print(server.output())
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    print(f"{passed} passed, {failed} failed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
