#!/usr/bin/env python3
"""Compares two teacher-forced score JSONs (`lily score` and tools/mlx_score.py print the same shape):

    python3 tools/compare_scores.py A.json B.json [--max-ppl-rel 1e-3] [--min-argmax 0.97]

Prints the perplexities, their relative difference, the argmax agreement and the largest per-position
log-prob difference; exits 1 when the perplexity differs by more than --max-ppl-rel (relative) or the
argmax agrees at fewer than --min-argmax of the positions (the issue's bar: 0.1% and 97%).
"""
import argparse
import json
import sys


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--max-ppl-rel", type=float, default=1e-3)
    ap.add_argument("--min-argmax", type=float, default=0.97)
    args = ap.parse_args()
    a, b = (json.load(open(p)) for p in (args.a, args.b))
    if a["positions"] != b["positions"]:
        print(f"different position counts: {a['positions']} vs {b['positions']}")
        return 1
    n = a["positions"]
    rel = abs(a["perplexity"] / b["perplexity"] - 1.0)
    agree = sum(x == y for x, y in zip(a["argmax"], b["argmax"])) / n
    dlp = max(abs(x - y) for x, y in zip(a["token_logprobs"], b["token_logprobs"]))
    ok = rel <= args.max_ppl_rel and agree >= args.min_argmax
    print(
        f"positions {n}: perplexity {a['perplexity']:.6f} vs {b['perplexity']:.6f} (relative diff {rel:.2e}, "
        f"bar {args.max_ppl_rel:.0e}); argmax agreement {100 * agree:.2f}% (bar {100 * args.min_argmax:.0f}%); "
        f"max |Δ log p| {dlp:.3e} -> {'PASS' if ok else 'FAIL'}"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
