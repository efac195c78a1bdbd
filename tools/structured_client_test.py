#!/usr/bin/env python3
"""Structured outputs through real clients against a real `lily serve`: the official `openai`
client's `chat.completions.parse` with a Pydantic model, and an `openai-agents` agent with an
`output_type` and one tool (the SDK sends the tools and `response_format: json_schema` in the same
request, then the tool's result, until the model answers in the output type).

Starts the server (the given binary; the built-in demo model unless --model), runs the checks,
stops it, and prints one line per check and a final "N passed, M failed" line; exits 1 if any
check failed.

    pip install -r tools/requirements-ci.txt
    python3 tools/structured_client_test.py target/release/lily

The demo model has random weights: it never writes JSON by itself, so every parsed answer here is
the grammar's doing. Its schemas are bounded (enums, integer ranges, short strings), as a random
model would otherwise write one string forever, and thinking is off (a random model never closes
its reasoning; the grammar would wait for it).
"""

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from typing import List, Literal

import openai
from pydantic import BaseModel, Field

from openai_client_test import API_KEY, Server

NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}


class City(BaseModel):
    name: Literal["Paris", "Lyon", "Nice"]
    population: int = Field(ge=0, le=10_000_000)
    coastal: bool
    tags: List[Literal["old", "big", "sunny"]] = Field(max_length=2)


class Report(BaseModel):
    city: Literal["Paris", "Lyon"]
    temperature_c: int = Field(ge=-50, le=60)


def token_id(binary, model_dir, text):
    out = subprocess.run([binary, "tokenize", "--model", model_dir], input=text, capture_output=True, text=True, check=True)
    ids = json.loads(out.stdout)
    assert len(ids) == 1, (text, ids)
    return ids[0]


def run_checks(base, binary, model_dir):
    client = openai.OpenAI(base_url=f"{base}/v1", api_key=API_KEY, max_retries=0, timeout=300)
    checks = []

    def check(fn):
        checks.append(fn)
        return fn

    @check
    def parse_with_a_pydantic_model():
        for seed in range(4):
            r = client.chat.completions.parse(
                model="lily", messages=[{"role": "user", "content": "Describe a French city."}], response_format=City,
                temperature=1.0, seed=seed, max_tokens=400, extra_body=NO_THINK)
            m = r.choices[0].message
            assert r.choices[0].finish_reason == "stop", r
            assert isinstance(m.parsed, City), m
            assert City.model_validate_json(m.content) == m.parsed

    @check
    def parse_streamed_events_end_in_the_parsed_object():
        with client.chat.completions.stream(
                model="lily", messages=[{"role": "user", "content": "A city, please."}], response_format=City,
                temperature=1.0, seed=11, max_tokens=400, extra_body=NO_THINK) as stream:
            for _ in stream:
                pass
            final = stream.get_final_completion()
        assert isinstance(final.choices[0].message.parsed, City), final

    @check
    def json_mode_and_a_bad_schema():
        r = client.chat.completions.create(
            model="lily", messages=[{"role": "user", "content": "JSON!"}], response_format={"type": "json_object"},
            max_tokens=400, temperature=1.0, seed=3, extra_body=NO_THINK | {"logit_bias": {str(token_id(binary, model_dir, '"')): 16, str(token_id(binary, model_dir, "}")): 16}})
        assert isinstance(json.loads(r.choices[0].message.content), dict), r
        try:
            client.chat.completions.create(
                model="lily", messages=[{"role": "user", "content": "x"}], max_tokens=4,
                response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integer", "minimum": 3, "maximum": 1}}})
        except openai.BadRequestError as e:
            assert e.status_code == 400 and "minimum" in str(e.message), e
            assert (e.body or {}).get("param") == "response_format.json_schema.schema", e.body
        else:
            raise AssertionError("an impossible schema was accepted")

    @check
    def an_agent_with_an_output_type_and_a_tool():
        from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled

        set_tracing_disabled(True)
        calls = []

        @function_tool
        def get_temperature(city: Literal["Paris", "Lyon"]) -> int:
            """The temperature in a city, in degrees Celsius."""
            calls.append(city)
            return 21

        # The first turn must call the tool (tool_choice "required"; the SDK then resets it to
        # "auto"). A random model would go on calling it turn after turn: a bias against opening
        # another call lets it answer (the grammar still offers both).
        no_more_calls = {str(token_id(binary, model_dir, "<tool_call>")): -100}
        model = OpenAIChatCompletionsModel(model="lily", openai_client=openai.AsyncOpenAI(base_url=f"{base}/v1", api_key=API_KEY, max_retries=0, timeout=300))
        agent = Agent(
            name="weather", instructions="Look the temperature up, then report it.", tools=[get_temperature],
            output_type=Report, model=model,
            model_settings=ModelSettings(temperature=1.0, max_tokens=400, tool_choice="required",
                                         extra_body=NO_THINK | {"logit_bias": no_more_calls, "seed": 5}))
        result = asyncio.run(Runner.run(agent, "How warm is it in Paris?", max_turns=4))
        assert isinstance(result.final_output, Report), result.final_output
        assert calls and all(c in ("Paris", "Lyon") for c in calls), calls

    passed = failed = 0
    for fn in checks:
        t = time.time()
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - every failure is reported, then the next check runs
            failed += 1
            detail = "".join(traceback.format_exception_only(type(e), e)).strip()
            print(f"FAIL {fn.__name__} ({time.time() - t:.1f}s): {detail[:2000]}", flush=True)
        else:
            passed += 1
            print(f"ok   {fn.__name__} ({time.time() - t:.1f}s)", flush=True)
    return passed, failed


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("binary", help="path to the lily binary")
    ap.add_argument("--model", help="checkpoint directory (default: the built-in demo model)")
    ap.add_argument("--cache-dir", help="LILY_CACHE for the server (default: $LILY_CACHE, else a temporary directory)")
    args = ap.parse_args()

    tmp = None
    cache_dir = args.cache_dir or os.environ.get("LILY_CACHE")
    if not cache_dir:
        tmp = tempfile.mkdtemp(prefix="lily-structured-test-")
        cache_dir = tmp
    binary = os.path.abspath(args.binary)
    server = Server(binary, args.model, cache_dir, 4096)
    try:
        t = time.time()
        health = server.wait_healthy()
        print(f"lily serve is up on {server.base} after {time.time() - t:.1f}s: {health}", flush=True)
        model_dir = args.model or os.path.join(cache_dir, "demo-qwen3.6-tiny-v1")
        passed, failed = run_checks(server.base, binary, model_dir)
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
