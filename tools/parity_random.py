#!/usr/bin/env python3
"""Parity on configs lily has never seen: samples random qwen3_5_moe configs, writes each as a random
MLX 4/8-bit checkpoint with `lily synth`, and scores the same bytes with `lily score` (CPU) and with
MLX-LM in float32 (tools/mlx_score.py). Fails unless, for every config, the perplexities agree within
0.1% and the argmax agrees at >= 98% of the positions.

    python3 tools/parity_random.py --lily target/release/lily [--configs 4] [--seed 0] [--positions 192]
"""

import argparse
import json
import random
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent


def sample_config(rng):
    hidden = rng.choice([64, 128, 192, 256])
    heads = rng.choice([2, 4, 8])
    kv = rng.choice([h for h in (1, 2, 4) if heads % h == 0])
    k_heads = rng.choice([1, 2, 4])
    v_heads = k_heads * rng.choice([1, 2, 4])
    experts = rng.choice([4, 8, 16, 32])
    layers = rng.choice([2, 3, 4, 6])
    # mlx-lm needs at least one full-attention layer (it indexes layer interval-1).
    interval = rng.choice([i for i in (1, 2, 3, 4) if i <= layers])
    text = {
        "model_type": "qwen3_5_moe_text",
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "full_attention_interval": interval,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": rng.choice([32, 64]),
        "rms_norm_eps": 1e-6,
        "vocab_size": rng.choice([512, 1000, 2048]),
        "max_position_embeddings": 4096,
        "linear_num_key_heads": k_heads,
        "linear_num_value_heads": v_heads,
        "linear_key_head_dim": rng.choice([16, 32, 64]),
        "linear_value_head_dim": rng.choice([16, 32, 64]),
        "linear_conv_kernel_dim": 4,
        "num_experts": experts,
        "num_experts_per_tok": rng.choice([k for k in (1, 2, 4, 8) if k <= experts]),
        "moe_intermediate_size": rng.choice([32, 64, 96, 128]),
        "shared_expert_intermediate_size": rng.choice([32, 64, 128]),
        "tie_word_embeddings": rng.random() < 0.25,
        "rope_parameters": {"rope_type": "default", "rope_theta": rng.choice([10000.0, 1e6, 1e7]),
                            "partial_rotary_factor": rng.choice([0.25, 0.5, 1.0])},
    }
    quant = {"bits": rng.choice([4, 8]), "group_size": rng.choice([32, 64, 128])}
    return {"model_type": "qwen3_5_moe", "text_config": text}, quant


def run(cmd):
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"failed: {' '.join(map(str, cmd))}\n{p.stderr}")
    return p.stdout


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lily", required=True)
    ap.add_argument("--configs", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--positions", type=int, default=192)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    failures = 0
    print("| # | layers | interval | heads q/kv | gdn k/v | experts | bits/group | ppl lily | ppl mlx | Δ ppl | argmax |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.configs):
            cfg, q = sample_config(rng)
            d = Path(tmp) / f"m{i}"
            cfg_file = Path(tmp) / f"c{i}.json"
            cfg_file.write_text(json.dumps(cfg))
            run([args.lily, "synth", "--config", cfg_file, "--out", d, "--seed", str(args.seed + i),
                 "--bits", str(q["bits"]), "--group-size", str(q["group_size"])])
            t = cfg["text_config"]
            toks = [rng.randrange(t["vocab_size"]) for _ in range(args.positions + 1)]
            tok_file = Path(tmp) / f"t{i}.json"
            tok_file.write_text(json.dumps(toks))
            ours = json.loads(run([args.lily, "score", "--model", d, "--tokens", tok_file, "--backend", "cpu"]))
            ref = json.loads(run([sys.executable, HERE / "mlx_score.py", "--model", d, "--tokens", tok_file]))
            dppl = abs(ours["perplexity"] - ref["perplexity"]) / ref["perplexity"]
            agree = sum(a == b for a, b in zip(ours["argmax"], ref["argmax"])) / len(ref["argmax"])
            ok = dppl < 1e-3 and agree >= 0.98 and ours["positions"] == ref["positions"]
            failures += not ok
            print(f"| {i} | {t['num_hidden_layers']} | {t['full_attention_interval']} | {t['num_attention_heads']}/{t['num_key_value_heads']} "
                  f"| {t['linear_num_key_heads']}/{t['linear_num_value_heads']} | {t['num_experts']} top {t['num_experts_per_tok']} "
                  f"| {q['bits']}/{q['group_size']} | {ours['perplexity']:.4f} | {ref['perplexity']:.4f} | {dppl:.2e} | {100*agree:.1f}% |"
                  + ("" if ok else " FAIL"))
    print(f"parity: {args.configs - failures} passed, {failures} failed")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
