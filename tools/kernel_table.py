#!/usr/bin/env python3
"""Reads `nsys stats --report cuda_gpu_kern_sum --format csv` on stdin and prints the kernels by total
GPU time: share, total ms, calls, mean µs (names shortened). Used by tools/gpu_suite.sh (profile)."""
import csv
import sys

lines = [l for l in sys.stdin if "," in l]
rows = list(csv.DictReader(lines))
if not rows:
    print("no kernel rows")
    sys.exit(0)
key = lambda r, k: next(v for kk, v in r.items() if kk and kk.strip().startswith(k))
total = sum(float(key(r, "Total Time")) for r in rows)
print(f"{'share':>6} {'total ms':>9} {'calls':>7} {'mean us':>8}  kernel")
for r in sorted(rows, key=lambda r: -float(key(r, "Total Time")))[:40]:
    t = float(key(r, "Total Time"))
    print(f"{100 * t / total:5.1f}% {t / 1e6:9.2f} {int(key(r, 'Instances')):7d} {float(key(r, 'Avg')) / 1e3:8.2f}  {key(r, 'Name')[:90]}")
print(f"total GPU kernel time {total / 1e6:.1f} ms")
