#!/usr/bin/env python3
"""Drives a real `lily serve` with the official OpenAI Python client.

Starts the server (the given binary) on a free port with an API key, waits for /health, runs the
checks below with the `openai` package, stops the server, and prints one line per check and a
final "N passed, M failed" line; exits 1 if any check failed.

    pip install -r tools/requirements-test.txt
    python3 tools/openai_client_test.py target/release/lily              # the built-in demo model
    python3 tools/openai_client_test.py target/release/lily --model DIR  # a checkpoint

Without --model the server writes its demo checkpoint into $LILY_CACHE: --cache-dir, else the
LILY_CACHE of this script's environment, else a temporary directory (removed at the end).
"""

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import traceback
import urllib.error
import urllib.request

import openai

API_KEY = "lily-test-key"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(url, key=None, timeout=5):
    req = urllib.request.Request(url)
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.status, r.read().decode()


def metric(base, name):
    _, text = http_get(f"{base}/metrics", API_KEY)
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{name} not in /metrics")


class Server:
    def __init__(self, binary, model, cache_dir, ctx_size):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        cmd = [binary, "serve", "--host", "127.0.0.1", "--port", str(self.port), "--api-key", API_KEY,
               "--backend", "cpu", "--ctx-size", str(ctx_size), "--max-queue", "4"]
        if model:
            cmd += ["--model", model]
        env = dict(os.environ, LILY_CACHE=cache_dir)
        env.pop("LILY_API_KEY", None)
        self.log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT)

    def wait_healthy(self, timeout=300):
        t = time.time()
        while time.time() - t < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"lily serve exited with {self.proc.returncode}:\n{self.output()}")
            try:
                status, body = http_get(f"{self.base}/health")
                if status == 200:
                    return json.loads(body)
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            time.sleep(0.2)
        raise RuntimeError(f"lily serve was not healthy after {timeout}s:\n{self.output()}")

    def output(self):
        self.log.seek(0)
        return self.log.read().decode(errors="replace")[-4000:]

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def extra(obj, name):
    """A field the openai models do not declare (reasoning_content, cached_tokens...)."""
    v = getattr(obj, name, None)
    if v is None and getattr(obj, "model_extra", None):
        v = obj.model_extra.get(name)
    return v


def answer(resp):
    m = resp.choices[0].message
    return (extra(m, "reasoning_content"), m.content)


def usage_tuple(u):
    return (u.prompt_tokens, u.completion_tokens, u.total_tokens)


def run_checks(base, model_id_expected):
    client = openai.OpenAI(base_url=f"{base}/v1", api_key=API_KEY, max_retries=0, timeout=120)
    msgs = [{"role": "user", "content": "Tell me about the sea."}]
    checks = []

    def check(fn):
        checks.append(fn)
        return fn

    @check
    def models_list():
        models = client.models.list().data
        assert len(models) == 1, models
        assert models[0].object == "model"
        if model_id_expected:
            assert models[0].id == model_id_expected, models[0].id
        one = client.models.retrieve(models[0].id)
        assert one.id == models[0].id and one.object == "model", one
        try:
            client.models.retrieve("no-such-model")
            raise AssertionError("an unknown model id should be a 404")
        except openai.NotFoundError:
            pass

    @check
    def greedy_chat_is_deterministic():
        a = client.chat.completions.create(model="lily", messages=msgs, temperature=0, max_tokens=16)
        b = client.chat.completions.create(model="lily", messages=msgs, temperature=0, max_tokens=16)
        assert answer(a) == answer(b), (answer(a), answer(b))
        assert a.usage.completion_tokens == 16 or a.choices[0].finish_reason == "stop"
        assert a.id.startswith("chatcmpl-") and a.object == "chat.completion" and a.created > 0
        assert a.system_fingerprint, a
        cached = a.usage.prompt_tokens_details and b.usage.prompt_tokens_details.cached_tokens
        assert cached and cached > 0, f"the identical second request should reuse the cache: {b.usage}"

    @check
    def seeded_sampling_is_reproducible():
        def ask(seed):
            return answer(client.chat.completions.create(
                model="lily", messages=msgs, temperature=1.0, top_p=0.95, seed=seed, max_tokens=16))
        a, b = ask(1234), ask(1234)
        assert a == b, (a, b)
        others = [ask(1235), ask(1236)]
        assert any(o != a for o in others), "a different seed should give a different answer"

    @check
    def streaming_equals_whole_with_usage():
        whole = client.chat.completions.create(model="lily", messages=msgs, temperature=0, max_tokens=16)
        stream = client.chat.completions.create(model="lily", messages=msgs, temperature=0, max_tokens=16,
                                                stream=True, stream_options={"include_usage": True})
        reasoning, content, usage, finish, roles, ids = "", "", None, None, [], set()
        for chunk in stream:
            ids.add(chunk.id)
            if chunk.usage is not None:
                usage = chunk.usage
            for ch in chunk.choices:
                if ch.delta.role:
                    roles.append(ch.delta.role)
                content += ch.delta.content or ""
                reasoning += extra(ch.delta, "reasoning_content") or ""
                finish = ch.finish_reason or finish
        assert roles[:1] == ["assistant"], roles
        assert len(ids) == 1
        w_reasoning, w_content = answer(whole)
        assert (reasoning or None, content or None) == (w_reasoning or None, w_content or None), \
            ((reasoning, content), answer(whole))
        assert finish == whole.choices[0].finish_reason
        assert usage is not None, "include_usage asked for a usage chunk"
        assert usage_tuple(usage) == usage_tuple(whole.usage), (usage, whole.usage)

    @check
    def text_completions_greedy_and_streamed():
        a = client.completions.create(model="lily", prompt="Once upon a time", temperature=0, max_tokens=12)
        b = client.completions.create(model="lily", prompt="Once upon a time", temperature=0, max_tokens=12)
        assert a.choices[0].text == b.choices[0].text
        s = client.completions.create(model="lily", prompt="Once upon a time", temperature=0, max_tokens=12, stream=True)
        assert "".join(c.choices[0].text for c in s if c.choices) == a.choices[0].text
        lp = client.completions.create(model="lily", prompt="Hi", temperature=0, max_tokens=4, logprobs=2).choices[0].logprobs
        assert lp is not None and len(lp.tokens) == 4 and len(lp.token_logprobs) == 4 and len(lp.top_logprobs[0]) == 2, lp

    @check
    def chat_logprobs():
        r = client.chat.completions.create(model="lily", messages=msgs, temperature=0, max_tokens=6,
                                           logprobs=True, top_logprobs=2)
        lp = r.choices[0].logprobs.content
        assert len(lp) == r.usage.completion_tokens == 6, lp
        assert all(e.logprob <= 0 and len(e.top_logprobs) == 2 for e in lp)

    @check
    def extras_are_honoured_and_unknown_fields_ignored():
        r = client.chat.completions.create(
            model="lily", messages=msgs, max_tokens=4, seed=7,
            extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1,
                        "chat_template_kwargs": {"enable_thinking": False}, "some_unknown_field": {"x": 1}})
        assert r.choices[0].message.role == "assistant"
        assert not extra(r.choices[0].message, "reasoning_content"), "thinking was turned off"

    @check
    def forced_tool_call():
        tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                  "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
        r = client.chat.completions.create(model="lily", messages=msgs, tools=tools, max_tokens=8, temperature=0,
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}})
        calls = r.choices[0].message.tool_calls
        assert calls and calls[0].function.name == "get_weather" and calls[0].id, r
        json.loads(calls[0].function.arguments)
        s = client.chat.completions.create(model="lily", messages=msgs, tools=tools, max_tokens=8, temperature=0,
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                           stream=True)
        names = [tc.function.name for c in s for ch in c.choices for tc in (ch.delta.tool_calls or []) if tc.function and tc.function.name]
        assert names == ["get_weather"], names

    @check
    def multi_turn_reuses_the_cache():
        first = client.chat.completions.create(model="lily", messages=msgs, temperature=0, max_tokens=8)
        history = msgs + [{"role": "assistant", "content": first.choices[0].message.content or ""},
                          {"role": "user", "content": "And the mountains?"}]
        second = client.chat.completions.create(model="lily", messages=history, temperature=0, max_tokens=8)
        cached = second.usage.prompt_tokens_details.cached_tokens
        assert cached and 0 < cached < second.usage.prompt_tokens, second.usage

    @check
    def wrong_api_key_is_401():
        bad = openai.OpenAI(base_url=f"{base}/v1", api_key="not-the-key", max_retries=0)
        try:
            bad.models.list()
        except openai.AuthenticationError as e:
            assert e.status_code == 401 and "key" in str(e.message).lower(), e
        else:
            raise AssertionError("no AuthenticationError")
        try:
            bad.chat.completions.create(model="lily", messages=msgs, max_tokens=2)
        except openai.AuthenticationError:
            pass
        else:
            raise AssertionError("no AuthenticationError")

    @check
    def bad_requests_are_400_with_a_message():
        cases = {
            "no messages": dict(messages=[]),
            "unknown role": dict(messages=[{"role": "wizard", "content": "hi"}]),
            "max_tokens 0": dict(messages=msgs, max_tokens=0),
            "n 2": dict(messages=msgs, n=2),
            "temperature -1": dict(messages=msgs, temperature=-1),
            "impossible schema": dict(messages=msgs, response_format={"type": "json_schema", "json_schema": {
                "name": "x", "schema": {"type": "integer", "minimum": 3, "maximum": 1}}}),
            "prompt too long": dict(messages=[{"role": "user", "content": "hello " * 5000}]),
            "max_tokens over the context": dict(messages=msgs, max_tokens=10**7),
        }
        for name, kw in cases.items():
            try:
                client.chat.completions.create(model="lily", **kw)
            except openai.BadRequestError as e:
                assert e.status_code == 400 and e.message, (name, e)
                err = e.body if isinstance(e.body, dict) else {}
                assert err.get("message"), (name, e.body)
            else:
                raise AssertionError(f"{name}: no BadRequestError")

    @check
    def server_healthy_after_a_client_hangs_up_mid_stream():
        stream = client.chat.completions.create(model="lily", messages=msgs, max_tokens=2000, temperature=0, stream=True)
        for i, _ in enumerate(stream):
            if i >= 3:
                break
        stream.close()
        t = time.time()
        r = client.chat.completions.create(model="lily", messages=msgs, temperature=0, max_tokens=4)
        took = time.time() - t
        assert r.choices[0].message is not None
        assert took < 20, f"the next request took {took:.1f}s: the abandoned generation went on"
        status, body = http_get(f"{base}/health")
        assert status == 200 and json.loads(body)["status"] == "ok", f"health: {status} {body!r}"
        # The engine marks itself idle just after the last event of a request (it may still store a
        # prefix-cache snapshot): allow it a moment, as a client polling /metrics would.
        deadline = time.time() + 5
        while (metric(base, "lily_engine_busy"), metric(base, "lily_queue_depth")) != (0, 0) and time.time() < deadline:
            time.sleep(0.05)
        busy, queue = metric(base, "lily_engine_busy"), metric(base, "lily_queue_depth")
        assert (busy, queue) == (0, 0), f"still busy {busy}, queue {queue} 5 s after the last answer"
        assert metric(base, "lily_completion_tokens_total") < 1000, "the abandoned stream ran to the end"

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
    ap.add_argument("--ctx-size", type=int, default=4096)
    args = ap.parse_args()

    if not (os.path.isfile(args.binary) and os.access(args.binary, os.X_OK)):
        print(f"FAIL startup: {args.binary} is not an executable file")
        print("0 passed, 1 failed")
        sys.exit(1)
    tmp = None
    cache_dir = args.cache_dir or os.environ.get("LILY_CACHE")
    if not cache_dir:
        tmp = tempfile.mkdtemp(prefix="lily-openai-test-")
        cache_dir = tmp
    server = Server(os.path.abspath(args.binary), args.model, cache_dir, args.ctx_size)
    try:
        t = time.time()
        health = server.wait_healthy()
        print(f"lily serve is up on {server.base} after {time.time() - t:.1f}s: {health}", flush=True)
        passed, failed = run_checks(server.base, None if args.model else "lily-demo")
        # The server survived everything above.
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
