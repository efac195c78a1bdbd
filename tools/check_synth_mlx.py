#!/usr/bin/env python3
"""Check a `lily synth` checkpoint with mlx-lm itself.

    python3 tools/check_synth_mlx.py DIR [--layers N] [--tokens T] [--no-forward]

1. Layout: builds mlx-lm's model from DIR/config.json (minus its quantisation block), casts it as
   `mlx_lm.convert` does (bf16, A_log kept f32), quantises it with `mlx_lm.utils.quantize_model` and the
   model's own quant_predicate, and compares every parameter name, shape and dtype with the
   safetensors headers, and the resulting `quantization` block with config.json's.
2. Load: `mlx_lm.utils.load_model(DIR, lazy=True, strict=True)` (names and shapes must match exactly).
3. Tokenizer (when the vocabulary is Qwen's): loads with transformers and checks known ids.
4. Forward (unless --no-forward): T tokens through the model (optionally only its first N layers, to
   keep memory bounded on a full-size checkpoint) with every float parameter in f32 (the reference),
   and again with the residual stream and branch outputs rounded to bf16 (what a bf16 engine does);
   prints the top-1 probability per position (vs uniform 1/V), the top-1/top-2 logit gap, and the
   top-1 agreement and logit difference between the two (must be >= 98%). Also reports mlx's own
   bf16 forward, which on the CPU is a poor reference (its bf16 quantized matmul accumulates in bf16).
Exit status 1 if a check fails.
"""
import argparse
import copy
import json
import struct
import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_map, tree_map_with_path
from mlx_lm.utils import _get_classes, load_model, quantize_model

DT = {"U32": mx.uint32, "BF16": mx.bfloat16, "F32": mx.float32, "F16": mx.float16}


def headers(d: Path):
    out = {}
    for f in sorted(d.glob("model*.safetensors")):
        with open(f, "rb") as fh:
            n = struct.unpack("<Q", fh.read(8))[0]
            h = json.loads(fh.read(n))
        assert h.get("__metadata__") == {"format": "mlx"}, f"{f.name}: metadata {h.get('__metadata__')}"
        for k, v in h.items():
            if k != "__metadata__":
                out[k] = (DT[v["dtype"]], tuple(v["shape"]))
    return out


def check_layout(d: Path, config: dict) -> bool:
    cfg = copy.deepcopy(config)
    q = cfg.pop("quantization")
    qc = cfg.pop("quantization_config")
    ok = q == qc
    if not ok:
        print("FAIL: quantization != quantization_config")
    model_class, args_class = _get_classes(cfg)
    model = model_class(args_class.from_dict(cfg))
    cast = getattr(model, "cast_predicate", lambda _: True)
    model.update(
        tree_map_with_path(
            lambda k, v: v.astype(mx.bfloat16) if cast(k) and mx.issubdtype(v.dtype, mx.floating) else v,
            model.parameters(),
        )
    )
    model, qcfg = quantize_model(model, cfg, q["group_size"], q["bits"], mode=q.get("mode", "affine"))
    want = {k: (v.dtype, tuple(v.shape)) for k, v in tree_flatten(model.parameters())}
    have = headers(d)
    missing = sorted(set(want) - set(have))
    extra = sorted(set(have) - set(want))
    wrong = sorted(k for k in set(want) & set(have) if want[k] != have[k])
    for name, items in (("missing", missing), ("unexpected", extra), ("wrong dtype/shape", wrong)):
        if items:
            ok = False
            print(f"FAIL: {len(items)} {name}: " + ", ".join(f"{k} {have.get(k)} vs {want.get(k)}" for k in items[:8]))
    if qcfg["quantization"] != q:
        ok = False
        print(f"FAIL: quantization block differs from mlx-lm's:\n  ours  {q}\n  mlx   {qcfg['quantization']}")
    print(f"layout: {len(have)} tensors, {'OK' if ok else 'MISMATCH'} against mlx-lm's quantised qwen3_5_moe")
    return ok


def check_tokenizer(d: Path) -> bool:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(d))
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>\n<think>\n", add_special_tokens=True)
    want = [248045, 846, 198, 5834, 248046, 198, 248068, 198]
    ok = ids == want and tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>" and tok.bos_token is None
    print(f"tokenizer: {type(tok).__name__}, ids {ids}, eos {tok.eos_token!r}, pad {tok.pad_token!r}: {'OK' if ok else 'FAIL'}")
    return ok


def manual_forward(model, x, round_bf16: bool):
    """The language model's forward pass, layer by layer; with `round_bf16`, the residual stream and
    every branch output are rounded to bf16 (a bf16 engine's main source of error) while the model
    itself computes in whatever precision its parameters have."""
    from mlx_lm.models.base import create_attention_mask, create_ssm_mask

    lm = model.language_model
    r = (lambda t: t.astype(mx.bfloat16).astype(mx.float32)) if round_bf16 else (lambda t: t)
    h = r(lm.model.embed_tokens(x))
    fa, sm = create_attention_mask(h, None), create_ssm_mask(h, None)
    for layer in lm.model.layers:
        n = layer.input_layernorm(h)
        y = layer.linear_attn(n, sm, None) if layer.is_linear else layer.self_attn(n, fa, None)
        h = r(h + r(y))
        h = r(h + r(layer.mlp(layer.post_attention_layernorm(h))))
    out = lm.model.norm(h)
    logits = lm.model.embed_tokens.as_linear(out) if lm.args.tie_word_embeddings else lm.lm_head(out)
    return np.array(logits.astype(mx.float32))[0]


def forward(d: Path, config: dict, layers, n_tokens: int) -> bool:
    text = config.get("text_config", config)
    n_layers = text["num_hidden_layers"]
    over = None
    if layers is not None and layers < n_layers:
        t2 = dict(text, num_hidden_layers=layers)
        if "layer_types" in t2:
            t2["layer_types"] = t2["layer_types"][:layers]
        over = {"text_config": t2} if "text_config" in config else t2
    model, _ = load_model(d, lazy=True, strict=over is None, model_config=over)
    vocab = text["vocab_size"]
    rng = np.random.default_rng(0)
    if vocab >= 248077:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(d))
        prompt = "<|im_start|>user\nWrite a short poem about the sea, in English.<|im_end|>\n<|im_start|>assistant\n<think>\n"
        ids = tok.encode(prompt)
        ids = (ids + list(rng.integers(0, 248044, n_tokens)))[:n_tokens]
    else:
        ids = list(rng.integers(0, vocab, n_tokens))
    x = mx.array([[int(i) for i in ids]])
    # mlx as loaded (bf16 parameters and activations). Note: on the CPU, mlx's bf16
    # quantized_matmul has ~2% relative error (it accumulates in bf16), so this is a poor reference.
    try:
        mlx_bf16 = np.array(model(x).astype(mx.float32))[0]
    except (RuntimeError, IndexError) as e:  # mlx-lm/CPU limits, e.g. bf16 gather_mm, no full-attention layer
        mlx_bf16 = None
        mlx_err = f"{type(e).__name__}: {e}"
    model.update(tree_map(lambda v: v.astype(mx.float32) if mx.issubdtype(v.dtype, mx.floating) else v, model.parameters()))
    a = manual_forward(model, x, round_bf16=False)
    b = manual_forward(model, x, round_bf16=True)
    ok = bool(np.isfinite(a).all() and np.isfinite(b).all())
    p = np.exp(a - a.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    top = np.sort(a, -1)
    top1p = p.max(-1)
    gap = top[:, -1] - top[:, -2]
    agree = (a.argmax(-1) == b.argmax(-1)).mean()
    rel = np.abs(a - b).max(-1) / a.std(-1)
    print(f"forward: {len(ids)} tokens, {layers or n_layers}/{n_layers} layers, vocab {vocab} (uniform p = {1 / vocab:.2e}); f32 reference")
    print(f"  logits: std {a.std(-1).mean():.2f}, max |logit| {np.abs(a).max():.1f}, {len(set(a.argmax(-1).tolist()))} distinct top-1 tokens")
    print("  top-1 p per position: " + " ".join(f"{v:.2f}" for v in top1p))
    print(f"  top-1 p: min {top1p.min():.3f} median {np.median(top1p):.3f}; top1-top2 gap: min {gap.min():.2f} median {np.median(gap):.2f}")
    print(f"  f32 vs bf16-rounded residual stream: top-1 agreement {agree * 100:.1f}%, max |diff| / std {rel.max():.3f} (median {np.median(rel):.3f})")
    if mlx_bf16 is not None:
        agree_mlx = (a.argmax(-1) == mlx_bf16.argmax(-1)).mean()
        print(f"  f32 vs mlx bf16 as loaded (CPU bf16 qmm, ~2% error per matmul): top-1 agreement {agree_mlx * 100:.1f}%")
    else:
        print(f"  mlx's own bf16 forward: n/a ({mlx_err})")
    if top1p.min() < 100.0 / vocab:
        ok = False
        print("FAIL: some position's top-1 probability is within 100x of uniform")
    if agree < 0.98:
        ok = False
        print("FAIL: top-1 agreement under bf16 rounding below 98%")
    return ok


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("dir", type=Path)
    ap.add_argument("--layers", type=int, default=None, help="run the forward pass through the first N layers only")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--no-forward", action="store_true")
    args = ap.parse_args()
    mx.set_default_device(mx.cpu)
    d = args.dir
    config = json.loads((d / "config.json").read_text())
    ok = check_layout(d, config)
    model, _ = load_model(d, lazy=True, strict=True)
    del model
    print("load_model(strict=True, lazy=True): OK")
    text = config.get("text_config", config)
    if text["vocab_size"] >= 248077:
        ok &= check_tokenizer(d)
    if not args.no_forward:
        ok &= forward(d, config, args.layers, args.tokens)
    print("ALL OK" if ok else "FAILED")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
