#!/usr/bin/env python3
"""Parity with transformers on configs lily has never seen: samples random qwen3_5_moe configs,
builds each as a random bf16 Hugging Face checkpoint (tools/make_fixtures.py's builder: real key
names, fused experts, zero-centred norms, sharded), converts it with mlx_lm.convert, and checks
  - `lily score --keep-bf16` on the bf16 checkpoint against transformers in float32,
  - `lily score` on the MLX conversion against MLX-LM in float32,
  - `lily score` quantising the bf16 checkpoint at load against MLX-LM on mlx_lm.convert's bytes
    (identical bytes, so identical numbers),
each within 0.1% perplexity and >= 98% argmax agreement. Needs torch + transformers + mlx-lm.

    python3 tools/parity_hf_random.py --lily target/release/lily [--configs 3] [--seed 0]
"""

import argparse
import json
import random
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import make_fixtures as mf  # noqa: E402


def sample(rng, i):
    hidden = rng.choice([64, 128])
    heads = rng.choice([2, 4, 8])
    kv = rng.choice([h for h in (1, 2, 4) if heads % h == 0])
    hk = rng.choice([1, 2, 4])
    head_dim = rng.choice([32, 64])
    rot = rng.choice([0.25, 0.5])
    half = int(head_dim * rot) // 2
    sec = [half - 2 * (half // 3), half // 3, half // 3]
    experts = rng.choice([4, 8, 16])
    layers = rng.choice([2, 3, 4])
    # mlx-lm needs at least one full-attention layer (it indexes layer interval-1).
    interval = rng.choice([i for i in (2, 3, 4) if i <= layers])
    return dict(
        name=f"rand-{i}", seed=9000 + i, note="random",
        text=dict(vocab_size=rng.choice([320, 384, 448]), hidden_size=hidden, num_hidden_layers=layers,
                  full_attention_interval=interval, num_attention_heads=heads, num_key_value_heads=kv,
                  head_dim=head_dim, rope_theta=rng.choice([10_000, 1_000_000, 10_000_000]), partial_rotary_factor=rot,
                  mrope_section=sec, linear_num_key_heads=hk, linear_num_value_heads=hk * rng.choice([1, 2]),
                  linear_key_head_dim=rng.choice([16, 32]), linear_value_head_dim=rng.choice([16, 32]),
                  linear_conv_kernel_dim=4, num_experts=experts,
                  num_experts_per_tok=rng.choice([k for k in (1, 2, 4) if k <= experts]),
                  moe_intermediate_size=rng.choice([32, 64]), shared_expert_intermediate_size=rng.choice([32, 64]),
                  rms_norm_eps=1e-6),
        q_bits=rng.choice([4, 8]), q_group_size=rng.choice([32, 64]), add_mtp=False, init=dict(router_gain=6.0),
    )


def run(cmd):
    p = subprocess.run([str(c) for c in cmd], capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"failed: {' '.join(map(str, cmd))}\n{p.stderr[-3000:]}")
    return json.loads(p.stdout)


def agree(a, b):
    d = abs(a["perplexity"] - b["perplexity"]) / b["perplexity"]
    g = sum(x == y for x, y in zip(a["argmax"], b["argmax"])) / len(b["argmax"])
    return d, g, d < 1e-3 and g >= 0.98 and a["positions"] == b["positions"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lily", required=True)
    ap.add_argument("--configs", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    fails = 0
    print("| config | check | ppl lily | ppl reference | Δ ppl | argmax |")
    print("|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.configs):
            cfg = sample(rng, i)
            root = Path(tmp) / cfg["name"]
            hf, mlx = root / "hf", root / "mlx"
            mf.build_hf(cfg, hf)
            mf.convert_mlx(cfg, hf, mlx)
            toks = [rng.randrange(cfg["text"]["vocab_size"] - 8) for _ in range(193)]
            tf = root / "tokens.json"
            tf.write_text(json.dumps(toks))
            ref_hf = run([sys.executable, HERE / "hf_score.py", "--model", hf, "--tokens", tf])
            ref_mlx = run([sys.executable, HERE / "mlx_score.py", "--model", mlx, "--tokens", tf])
            checks = [
                ("bf16 vs transformers", run([args.lily, "score", "--model", hf, "--tokens", tf, "--backend", "cpu", "--keep-bf16"]), ref_hf),
                ("mlx vs MLX-LM", run([args.lily, "score", "--model", mlx, "--tokens", tf, "--backend", "cpu"]), ref_mlx),
            ]
            if cfg["q_bits"] == 4 and cfg["q_group_size"] == 64:
                checks.append(("bf16 quantised at load vs MLX-LM", run([args.lily, "score", "--model", hf, "--tokens", tf, "--backend", "cpu"]), ref_mlx))
            t = cfg["text"]
            desc = (f"{t['num_hidden_layers']}L/{t['full_attention_interval']} q{t['num_attention_heads']}/kv{t['num_key_value_heads']}"
                    f" gdn{t['linear_num_key_heads']}/{t['linear_num_value_heads']} E{t['num_experts']}k{t['num_experts_per_tok']}"
                    f" {cfg['q_bits']}b/g{cfg['q_group_size']}")
            for name, ours, ref in checks:
                d, g, ok = agree(ours, ref)
                fails += not ok
                print(f"| {desc} | {name} | {ours['perplexity']:.4f} | {ref['perplexity']:.4f} | {d:.2e} | {100*g:.1f}% |" + ("" if ok else " FAIL"))
    print(f"parity: {fails} failed")
    sys.exit(1 if fails else 0)


if __name__ == "__main__":
    main()
