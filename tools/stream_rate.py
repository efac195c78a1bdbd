#!/usr/bin/env python3
"""What a user of `lily serve` sees (issue #10 item 6): one streamed chat completion with a prompt of
about CONTEXT tokens and MAX generated tokens (greedy), timed at the client from the SSE chunks as
they arrive. Prints one JSON line: time to first token, decode tok/s over the tokens after the first
(completion tokens from the final usage chunk, minus one, over the time from the first content chunk
to the last), and the server's own usage. Standard library only (it runs on the GPU machine).

    python3 tools/stream_rate.py --port 8080 --context 4096 --max 256 [--repeats 3]

Compare with `lily bench --lengths 4K` on the same machine and model: the bench's decode rate is
the engine's alone; the difference is the server's tokenisation, parsing, detokenisation and SSE.
"""
import argparse
import json
import random
import time

from soak import WORDS, post, read_stream


def once(port, words, max_tokens, seed):
    rng = random.Random(seed)
    prompt = " ".join(rng.choice(WORDS) for _ in range(words))
    body = {"model": "lily", "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    c, r = post(port, "/v1/chat/completions", body, timeout=600)
    if r.status != 200:
        raise SystemExit(f"status {r.status}: {r.read()[:300]!r}")
    times = []
    chunks, _ = read_stream(r, times=times)
    c.close()
    usage = next((ch["usage"] for ch in chunks if ch.get("usage")), None)
    # Arrival times of the chunks that carry generated text (content or reasoning).
    text_times = [t for ch, t in zip(chunks, times)
                  if any((x.get("delta") or {}).get(k) for x in ch.get("choices") or []
                         for k in ("content", "reasoning_content", "reasoning"))]
    first = text_times[0] if text_times else None
    last = text_times[-1] if text_times else None
    n = (usage or {}).get("completion_tokens", len(text_times))
    rate = (n - 1) / (last - first) if first is not None and last > first and n > 1 else None
    return {"prompt_tokens": (usage or {}).get("prompt_tokens"), "completion_tokens": n, "content_chunks": len(text_times),
            "ttft_s": round(first - t0, 4) if first is not None else None,
            "decode_tok_s": round(rate, 1) if rate else None}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, default=8080)
    ap.add_argument("--context", type=int, default=4096, help="prompt length in tokens (about: one word is one token here)")
    ap.add_argument("--max", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    runs = [once(a.port, a.context, a.max, seed) for seed in range(a.repeats)]
    rates = sorted(r["decode_tok_s"] for r in runs if r["decode_tok_s"])
    print(json.dumps({"runs": runs, "median_decode_tok_s": rates[len(rates) // 2] if rates else None}))


if __name__ == "__main__":
    main()
