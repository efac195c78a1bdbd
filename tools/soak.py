#!/usr/bin/env python3
"""A soak of `lily serve` (issue #14 item 11): N requests of mixed kinds against a running server,
checking every answer is well formed, and sampling the server's host RSS and the GPU's memory as it
goes. Standard library only (it runs on the GPU machine, which has no network for pip).

    python3 tools/soak.py --port 8080 --pid PID [--requests 1000] [--seed 1]

Kinds, drawn at random (seeded): streamed chat, non-streamed chat, a stream the client hangs up on
after a few chunks (cancelled), a request repeating an earlier prompt plus a turn (cached prefix),
chat with tools (the answer parses either as text or as tool calls), /v1/completions, and prompts of
16 to ~6,000 tokens. Prints a line per 100 requests (RSS, GPU memory, failures) and a JSON summary;
exits non-zero when any answer was malformed or the server stopped answering.
"""
import argparse
import http.client
import json
import random
import subprocess
import sys
import time

WORDS = ("the river runs past old stone walls while engineers measure load and flow in the quiet "
         "valley below a bridge of iron and glass that carries trains at night").split()


def text(rng, n_words):
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


def rss_mb(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def gpu_mb():
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10).stdout
        return float(out.split()[0])
    except Exception:
        return None


def post(port, path, body, timeout=300):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    c.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    return c, c.getresponse()


def read_stream(resp, cancel_after=None, times=None):
    """Reads an SSE stream; returns (chunks, saw_done). With cancel_after, closes after that many;
    with a list `times`, appends each chunk's arrival time (time.perf_counter())."""
    chunks, done = [], False
    while True:
        line = resp.fp.readline()
        if not line:
            break
        line = line.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            done = True
            break
        chunks.append(json.loads(data))  # every chunk must be JSON
        if times is not None:
            times.append(time.perf_counter())
        if cancel_after is not None and len(chunks) >= cancel_after:
            break
    return chunks, done


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def one(rng, port, history, kind):
    """Runs one request of `kind`; returns None when well formed, else what was wrong."""
    max_tokens = rng.choice([1, 8, 16, 32, 64])
    if kind == "cached" and history:
        msgs = rng.choice(history) + [{"role": "user", "content": text(rng, 12)}]
    else:
        n = rng.choice([8, 40, 200, 800, 3000]) if kind != "long" else rng.choice([3000, 4500])
        msgs = [{"role": "system", "content": text(rng, 20)}, {"role": "user", "content": text(rng, n)}]
    body = {"model": "lily", "messages": msgs, "max_tokens": max_tokens, "temperature": rng.choice([0, 0.7, 1.0]),
            "seed": rng.randrange(1 << 30)}
    if kind == "tools":
        body["tools"] = TOOLS
    if kind == "completion":
        c, r = post(port, "/v1/completions", {"model": "lily", "prompt": text(rng, 100), "max_tokens": max_tokens})
        raw = r.read()
        if r.status != 200:
            return f"completion status {r.status}: {raw[:200]!r}"
        j = json.loads(raw)
        return None if j["choices"][0]["text"] is not None else "completion without text"
    stream = kind in ("stream", "cancel", "cached", "long")
    body["stream"] = stream
    c, r = post(port, "/v1/chat/completions", body)
    if r.status != 200:
        return f"{kind} status {r.status}: {r.read()[:200]!r}"
    if stream:
        chunks, done = read_stream(r, cancel_after=rng.randrange(1, 4) if kind == "cancel" else None)
        c.close()
        if kind == "cancel":
            return None
        if not done:
            return f"{kind}: stream ended without [DONE] after {len(chunks)} chunks"
        reason = [ch["choices"][0].get("finish_reason") for ch in chunks if ch.get("choices")]
        if not any(reason):
            return f"{kind}: no finish_reason in the stream"
        content = "".join((ch["choices"][0].get("delta") or {}).get("content") or "" for ch in chunks if ch.get("choices"))
        history.append(msgs + [{"role": "assistant", "content": content}])
        del history[:-50]
        return None
    j = json.loads(r.read())
    c.close()
    msg = j["choices"][0]["message"]
    if kind == "tools" and msg.get("tool_calls"):
        for tc in msg["tool_calls"]:
            json.loads(tc["function"]["arguments"])  # must parse
    if "usage" not in j or j["usage"]["completion_tokens"] > max_tokens:
        return f"{kind}: bad usage {j.get('usage')}"
    return None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, default=8080)
    ap.add_argument("--pid", type=int, required=True)
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--seconds", type=float, default=1e9, help="stop early after this long")
    a = ap.parse_args()
    rng = random.Random(a.seed)
    kinds = ["stream"] * 4 + ["chat"] * 2 + ["cancel"] * 2 + ["cached"] * 3 + ["tools"] * 2 + ["completion", "long"]
    history, failures, samples, counts = [], [], [], {}
    t0 = time.time()
    done = 0
    for i in range(a.requests):
        if time.time() - t0 > a.seconds:
            break
        kind = rng.choice(kinds)
        counts[kind] = counts.get(kind, 0) + 1
        try:
            err = one(rng, a.port, history, kind)
        except Exception as e:  # a dropped connection, a malformed body
            err = f"{kind}: {type(e).__name__}: {e}"
        if err:
            failures.append(err)
        done += 1
        if done % 100 == 0 or done == 1:
            s = {"requests": done, "rss_mb": rss_mb(a.pid), "gpu_mb": gpu_mb(), "failures": len(failures),
                 "seconds": round(time.time() - t0, 1)}
            samples.append(s)
            print(json.dumps(s), flush=True)
    s = {"requests": done, "rss_mb": rss_mb(a.pid), "gpu_mb": gpu_mb(), "failures": len(failures), "seconds": round(time.time() - t0, 1)}
    samples.append(s)
    print(json.dumps({"summary": s, "kinds": counts, "first_failures": failures[:10], "samples": samples}))
    sys.exit(1 if failures or rss_mb(a.pid) is None else 0)


if __name__ == "__main__":
    main()
