#!/usr/bin/env python3
"""The side-by-side table of lily and MLX-LM from the rounds tools/gpu_suite.sh's `side` part ran.

    python3 tools/side_table.py OUT/side1 OUT/side2 ...

Each round directory holds mlx_baseline.json (a list of {length, prefill_tps, decode_tps}, written by
../shared/tools/mlx_baseline.py) and lily.json (`lily bench --json`: {"rows": [{length, prefill_tok_s,
decode_tok_s}, ...]}). Prints one markdown row per length: each engine's figure in every round (the
rounds alternated MLX-LM, lily, MLX-LM, lily, ...), and lily's median over MLX-LM's median.
"""
import json
import statistics
import sys
from pathlib import Path


def load(rounds):
    mlx, lily = {}, {}
    for d in rounds:
        d = Path(d)
        if (d / "mlx_baseline.json").exists():
            for r in json.loads((d / "mlx_baseline.json").read_text()):
                mlx.setdefault(r["length"], []).append((r["prefill_tps"], r["decode_tps"]))
        if (d / "lily.json").exists():
            for r in json.loads((d / "lily.json").read_text())["rows"]:
                lily.setdefault(r["length"], []).append((r["prefill_tok_s"], r["decode_tok_s"]))
    return mlx, lily


def cell(vals, i, fmt):
    return " / ".join(fmt.format(v[i]) for v in vals) if vals else "–"


def ratio(a, b, i):
    if not a or not b:
        return "–"
    return f"{statistics.median(v[i] for v in a) / statistics.median(v[i] for v in b):.1f}×"


def main():
    mlx, lily = load(sys.argv[1:])
    print("| length | prefill tok/s, MLX-LM | prefill tok/s, lily | lily/MLX | decode tok/s, MLX-LM | decode tok/s, lily | lily/MLX |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for n in sorted(set(mlx) | set(lily)):
        m, l = mlx.get(n, []), lily.get(n, [])
        print(
            f"| {n} | {cell(m, 0, '{:.0f}')} | {cell(l, 0, '{:.0f}')} | {ratio(l, m, 0)} "
            f"| {cell(m, 1, '{:.1f}')} | {cell(l, 1, '{:.1f}')} | {ratio(l, m, 1)} |"
        )
    return 0 if mlx and lily else 1


if __name__ == "__main__":
    sys.exit(main())
