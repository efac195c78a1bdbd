# Every decode kernel's own duration, from ncu: reads the CSV of
#   ncu --graph-profiling node --cache-control none --clock-control none \
#       --metrics gpu__time_duration.sum --csv --launch-count 4000 \
#       lily bench --backend cuda --model M --lengths 4K --decode-tokens 3 --repeats 1 > ncu.csv
# and prints the last complete decode step (the kernels from one embed_* launch to the next, 200-500
# of them), summed by kernel name (docs/PERF.md, 2026-12-03 sixth session). Each kernel runs alone
# under ncu, so the sum is the step without the overlap programmatic dependent launch gives.
#   python3 tools/ncu_decode_step.py ncu.csv [any second argument: also list the step's first 40]
import csv, sys, collections
rows = list(csv.DictReader(l for l in open(sys.argv[1]) if l.startswith('"')))
ks = [(r["Kernel Name"], float(r["Metric Value"].replace(",", "")), r["Metric Unit"], r.get("Grid Size", ""), r.get("Block Size", "")) for r in rows if r["Metric Name"] == "gpu__time_duration.sum"]
scale = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3}
ks = [(n, v * scale.get(u, 1.0), g, b) for n, v, u, g, b in ks]
starts = [i for i, k in enumerate(ks) if k[0].startswith("embed")]
steps = [(a, b) for a, b in zip(starts, starts[1:]) if 200 < b - a < 500]
print(f"{len(ks)} kernels, {len(starts)} embeds, {len(steps)} decode-sized steps: {[b - a for a, b in steps][-6:]}")
a, b = steps[-1]
step = ks[a:b]
tot = sum(v for _, v, _, _ in step)
print(f"last step: {b - a} kernels, sum of durations {tot:.1f} us")
by = collections.OrderedDict()
for n, v, g, bl in step:
    key = n.split("(")[0]
    c, s, mn, mx = by.get(key, (0, 0.0, 1e9, 0.0))
    by[key] = (c + 1, s + v, min(mn, v), max(mx, v))
print("| kernel | count | sum us | mean us | min | max |")
for k, (c, s, mn, mx) in sorted(by.items(), key=lambda kv: -kv[1][1]):
    print(f"| {k} | {c} | {s:.1f} | {s / c:.2f} | {mn:.2f} | {mx:.2f} |")
if len(sys.argv) > 2:
    for n, v, g, bl in step[:40]:
        print(f"{n.split('(')[0]:40s} {v:7.2f} grid {g} block {bl}")
