#!/usr/bin/env python3
"""The real agents against a real `lily serve`: OpenAI's Codex CLI (`codex exec`, Responses API)
and Anthropic's Claude Code (`claude -p`, Messages API), each pointed at lily (the built-in demo
model unless --model is given) through a recording proxy.

The demo model's weights are random, so the answers are nonsense; what is checked is the protocol:
every request each agent sends gets a 200 (or, for a route lily does not serve, a clean JSON
error in the API's shape), every streamed answer is well-formed (each event's data is JSON whose
`type` is the event's name, and the stream ends with the API's terminal event), every whole answer
parses, and each agent ends its one-prompt task without a protocol error of its own. Everything
each client sent (method, path, headers with keys redacted, body) and what came back (status,
event names, body) is written to --log-dir as `codex-requests.jsonl` and `claude-requests.jsonl`.

    python3 tools/agent_clients_test.py target/release/lily --agents .agents/node_modules/.bin

The agents come from npm (`npm install --prefix .agents @openai/codex @anthropic-ai/claude-code`;
.ci/run does it, pinned, into a cache kept between runs). Prints one line per check and a final
"N passed, M failed" line; exits 1 if any check failed.
"""

import argparse
import http.client
import http.server
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

API_KEY = "lily-agent-key"
# The terminal events of each API's stream.
TERMINAL = {
    "/v1/responses": {"response.completed", "response.incomplete", "response.failed"},
    "/v1/messages": {"message_stop", "error"},
}


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def redact(headers):
    out = {}
    for k, v in headers.items():
        out[k] = "<redacted>" if k.lower() in ("authorization", "x-api-key") else v
    return out


class Recorder:
    """The requests one client sent and what lily answered."""

    def __init__(self):
        self.entries = []
        self.lock = threading.Lock()

    def add(self, e):
        with self.lock:
            self.entries.append(e)


def make_proxy(upstream_port, recorder):
    class Proxy(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *a):
            pass

        def handle_one(self):
            n = int(self.headers.get("content-length") or 0)
            body = self.rfile.read(n) if n else b""
            entry = {"time": time.time(), "method": self.command, "path": self.path, "headers": redact(dict(self.headers))}
            try:
                entry["body"] = json.loads(body) if body else None
            except ValueError:
                entry["body_text"] = body.decode("utf-8", "replace")[:2000]
            headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "accept-encoding", "content-length", "connection")}
            conn = http.client.HTTPConnection("127.0.0.1", upstream_port, timeout=600)
            conn.request(self.command, self.path, body=body if body else None, headers=headers)
            r = conn.getresponse()
            entry["status"] = r.status
            ctype = r.getheader("content-type", "")
            entry["content_type"] = ctype
            self.send_response(r.status)
            for k, v in r.getheaders():
                if k.lower() not in ("transfer-encoding", "content-length", "connection"):
                    self.send_header(k, v)
            if ctype.startswith("text/event-stream"):
                self.send_header("transfer-encoding", "chunked")
                self.end_headers()
                raw = b""
                while True:
                    chunk = r.read1(65536)
                    if not chunk:
                        break
                    raw += chunk
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                    self.wfile.flush()
                self.wfile.write(b"0\r\n\r\n")
                self.wfile.flush()
                entry["events"], entry["stream_problems"] = parse_sse(raw.decode("utf-8", "replace"))
            else:
                data = r.read()
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
                try:
                    entry["response"] = json.loads(data) if data else None
                except ValueError:
                    entry["response_text"] = data.decode("utf-8", "replace")[:2000]
            conn.close()
            recorder.add(entry)

        do_GET = do_POST = do_HEAD = do_DELETE = do_PUT = handle_one

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Proxy)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv


def parse_sse(text):
    """(event names, problems) of an SSE body."""
    names, problems = [], []
    for block in text.split("\n\n"):
        lines = [l for l in block.split("\n") if l and not l.startswith(":")]
        if not lines:
            continue
        name = None
        data = []
        for l in lines:
            if l.startswith("event:"):
                name = l[6:].strip()
            elif l.startswith("data:"):
                data.append(l[5:].lstrip(" "))
        try:
            v = json.loads("\n".join(data))
        except ValueError:
            problems.append(f"event {name}: data is not JSON: {data!r:.200}")
            continue
        if v.get("type") != name:
            problems.append(f"event {name}: data type {v.get('type')!r}")
        names.append(name)
    return names, problems


class Lily:
    def __init__(self, binary, model, cache_dir, n_predict, ctx_size):
        self.port = free_port()
        cmd = [binary, "serve", "--host", "127.0.0.1", "--port", str(self.port), "--api-key", API_KEY, "--backend", "cpu",
               "-n", str(n_predict), "--ctx-size", str(ctx_size), "--max-queue", "16"]
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
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.2)
        raise RuntimeError("lily serve did not become healthy")

    def output(self):
        self.log.seek(0)
        return self.log.read().decode("utf-8", "replace")

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def run_client(cmd, env, cwd, timeout):
    """(returncode or None on timeout, output)."""
    try:
        p = subprocess.run(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, timeout=timeout)
        return p.returncode, p.stdout.decode("utf-8", "replace")
    except subprocess.TimeoutExpired as e:
        return None, (e.stdout or b"").decode("utf-8", "replace")


def check_entries(name, entries, api_path, results):
    """The protocol checks on what one client sent and got."""
    calls = [e for e in entries if e["path"].split("?")[0] == api_path]
    results.append((f"{name}: sent requests to {api_path}", len(calls) > 0, f"{len(calls)} of {len(entries)} requests"))
    for i, e in enumerate(entries):
        path = e["path"].split("?")[0]
        label = f"{name}: request {i + 1} {e['method']} {e['path']}"
        if path in (api_path, "/v1/messages/count_tokens", "/v1/models") or path.startswith("/v1/models/"):
            ok = e["status"] == 200
            detail = f"status {e['status']}"
            if not ok:
                detail += f": {json.dumps(e.get('response') or e.get('response_text'))[:400]}"
            if "events" in e:
                problems = list(e["stream_problems"])
                if not e["events"] or e["events"][-1] not in TERMINAL.get(path, set()):
                    problems.append(f"the stream ends with {e['events'][-1:]}, not a terminal event")
                if problems:
                    ok = False
                    detail += "; " + "; ".join(problems)
                else:
                    detail += f", {len(e['events'])} events ending {e['events'][-1]}"
            elif e["status"] == 200 and e.get("response") is None:
                ok = False
                detail += "; the body is not JSON"
            results.append((label, ok, detail))
        else:
            # A route lily does not serve: it must still be a clean JSON error.
            ok = e["status"] in (404, 405) and isinstance(e.get("response"), dict)
            results.append((label + " (not an API route)", ok, f"status {e['status']}"))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("lily")
    ap.add_argument("--model")
    ap.add_argument("--agents", default=".agents/node_modules/.bin", help="the directory holding `codex` and `claude`")
    ap.add_argument("--log-dir", default=None, help="where to write the request logs (default: a temporary directory, printed)")
    ap.add_argument("--timeout", type=float, default=300, help="seconds each agent may run")
    ap.add_argument("-n", type=int, default=64, help="tokens per answer: lily's -n (Codex sends no limit) and Claude Code's "
                    "CLAUDE_CODE_MAX_OUTPUT_TOKENS (it asks for up to 128000, which would run the random demo model to the end of the context)")
    ap.add_argument("--ctx-size", type=int, help="lily's context (default 20480, 4096 with --minimal)")
    ap.add_argument("--only", choices=["codex", "codex-gpt5", "claude"])
    ap.add_argument("--minimal", action="store_true",
                    help="run the agents in their documented minimal modes (Claude Code --bare --tools Read; Codex with short "
                         "instructions and no sub-agent or goal tools): ~2K-token prompts instead of their defaults' 9-12K")
    args = ap.parse_args()
    args.agents = os.path.abspath(args.agents)
    args.lily = os.path.abspath(args.lily)

    log_dir = args.log_dir or tempfile.mkdtemp(prefix="lily-agents-")
    os.makedirs(log_dir, exist_ok=True)
    cache = os.environ.get("LILY_CACHE") or tempfile.mkdtemp(prefix="lily-cache-")
    work = tempfile.mkdtemp(prefix="lily-agent-work-")
    ctx = args.ctx_size or (4096 if args.minimal else 20480)
    server = Lily(args.lily, args.model, cache, args.n, ctx)
    results = []
    try:
        server.wait_healthy()
        # codex-gpt5: Codex told its model is gpt-5.5, for which it knows the tool set it sends
        # (its freeform `apply_patch` tool with a Lark grammar, `tool_search`): lily ignores the name.
        for name in ["codex", "codex-gpt5", "claude"]:
            if args.only and args.only != name:
                continue
            rec = Recorder()
            proxy = make_proxy(server.port, rec)
            base = f"http://127.0.0.1:{proxy.server_address[1]}"
            home = tempfile.mkdtemp(prefix=f"lily-{name}-home-")
            wd = os.path.join(work, name)
            os.makedirs(wd)
            env = dict(os.environ, HOME=home, NO_COLOR="1")
            for k in ["OPENAI_API_KEY", "OPENAI_BASE_URL", "ANTHROPIC_API_KEY", "ANTHROPIC_AUTH_TOKEN", "ANTHROPIC_BASE_URL", "CODEX_HOME"]:
                env.pop(k, None)
            if name.startswith("codex"):
                codex_home = os.path.join(home, ".codex")
                os.makedirs(codex_home)
                with open(os.path.join(codex_home, "config.toml"), "w") as f:
                    f.write(CODEX_CONFIG.format(base=base))
                env.update(CODEX_HOME=codex_home, LILY_API_KEY=API_KEY)
                cmd = [os.path.join(args.agents, "codex"), "exec", "--skip-git-repo-check", "--color", "never"]
                if args.minimal:
                    instructions = os.path.join(home, "instructions.md")
                    with open(instructions, "w") as f:
                        f.write("You are Codex, a coding agent running in a terminal. Be brief.\n")
                    cmd += ["-c", f"model_instructions_file={json.dumps(instructions)}", "--disable", "multi_agent", "--disable", "goals"]
                if name == "codex-gpt5":
                    cmd += ["-m", "gpt-5.5"]
                cmd.append("Write a haiku about the sea.")
                api = "/v1/responses"
            else:
                env.update(ANTHROPIC_BASE_URL=base, ANTHROPIC_API_KEY=API_KEY, CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1",
                           DISABLE_TELEMETRY="1", DISABLE_AUTOUPDATER="1", DISABLE_ERROR_REPORTING="1", DISABLE_BUG_COMMAND="1",
                           ANTHROPIC_MODEL="lily-demo", ANTHROPIC_SMALL_FAST_MODEL="lily-demo", CLAUDE_CODE_SKIP_VERSION_CHECK="1",
                           CLAUDE_CODE_MAX_OUTPUT_TOKENS=str(args.n))
                cmd = [os.path.join(args.agents, "claude"), "-p", "Write a haiku about the sea.", "--max-turns", "1",
                       "--output-format", "json"]
                if args.minimal:
                    cmd += ["--bare", "--tools", "Read"]
                api = "/v1/messages"
            t = time.time()
            rc, out = run_client(cmd, env, wd, args.timeout)
            took = time.time() - t
            proxy.shutdown()
            with open(os.path.join(log_dir, f"{name}-requests.jsonl"), "w") as f:
                for e in rec.entries:
                    f.write(json.dumps(e) + "\n")
            with open(os.path.join(log_dir, f"{name}-output.txt"), "w") as f:
                f.write(out)
            print(f"--- {name}: exit {rc} after {took:.0f} s, {len(rec.entries)} requests; its output (tail):")
            print("\n".join("    " + l for l in out.strip().splitlines()[-15:]))
            check_entries(name, rec.entries, api, results)
            verdict, detail = judge(name, rc, out)
            results.append((f"{name}: ended its task without a protocol error", verdict, detail))
    finally:
        server.stop()
        with open(os.path.join(log_dir, "lily-serve.log"), "w") as f:
            f.write(server.output())
        shutil.rmtree(work, ignore_errors=True)
    failed = 0
    for label, ok, detail in results:
        print(f"{'PASS' if ok else 'FAIL'} {label}: {detail}")
        failed += not ok
    print(f"request logs in {log_dir}")
    print(f"{len(results) - failed} passed, {failed} failed")
    sys.exit(1 if failed else 0)


CODEX_CONFIG = """model = "lily-demo"
model_provider = "lily"
approval_policy = "never"
sandbox_mode = "read-only"
[model_providers.lily]
name = "lily"
base_url = "{base}/v1"
wire_api = "responses"
env_key = "LILY_API_KEY"
stream_max_retries = 0
request_max_retries = 0
"""


def judge(name, rc, out):
    """Whether the agent's own verdict shows a protocol error. The demo model never ends its turn, so
    every answer stops at its token limit, which both agents report as an error of their own
    (Claude Code: `api_error: max_output_tokens`; Codex: "Incomplete response returned, reason:
    max_output_tokens"): that one is the model's doing and accepted; any other is not."""
    low = out.lower()
    bad = [w for w in ["failed to parse", "unexpected status", "stream disconnected", "error decoding", "invalid_request_error",
                       "unexpected event", "stream closed before", "not valid json", "deserializ", "api error: 4", "api error: 5"] if w in low]
    if rc is None:
        return False, "timed out"
    if bad:
        return False, f"exit {rc}; its output mentions {bad}"
    if name == "claude":
        try:
            res = json.loads(out.strip().splitlines()[-1])
        except (ValueError, IndexError):
            return False, f"exit {rc}; its JSON result did not parse"
        at_limit = res.get("is_error") and res.get("api_error") == "max_output_tokens"
        ok = (rc == 0 and not res.get("is_error")) or at_limit
        return ok, f"exit {rc}, {res.get('num_turns')} turns, is_error {res.get('is_error')}, api_error {res.get('api_error')}" + (
            " (the demo model's answers end at the token limit)" if at_limit else "")
    errors = [l for l in out.splitlines() if l.startswith("ERROR")]
    at_limit = errors and all("Incomplete response returned, reason: max_output_tokens" in l for l in errors)
    return rc == 0 or bool(at_limit), f"exit {rc}; errors: {errors[:3]}" + (" (the demo model's answers end at the token limit)" if at_limit else "")


if __name__ == "__main__":
    main()
