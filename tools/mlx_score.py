#!/usr/bin/env python3
"""Teacher-forced float32 scoring of an MLX-format qwen3_5_moe checkpoint with mlx-lm.

    python3 tools/mlx_score.py --model DIR --tokens FILE [--device cpu|gpu] [--dtype float32|native]
                               [--hidden-out FILE.safetensors]

DIR is an mlx-lm checkpoint (config.json with an optional top-level `quantization` block and
model*.safetensors), e.g. tests/fixtures/tiny-a/mlx or a checkpoint written by `lily`.
FILE is a JSON array of token ids. Prints (to stdout) the same JSON as tests/fixtures/*/ref_mlx.json:

    {"positions": N-1, "perplexity": P, "token_logprobs": [...], "argmax": [...]}

where token_logprobs[i] = log p(tokens[i+1] | tokens[0..=i]) from a float32 log_softmax of the
logits at position i, argmax[i] = argmax of those logits and P = exp(-mean(token_logprobs)).

Every floating-point parameter (including quantisation scales and biases) is cast to float32
before the forward pass (bf16 -> f32 is exact), so the only approximation left relative to the
dequantised weights is float32 arithmetic. The whole prompt runs as one forward call, without a
cache, exactly like `Qwen3_5TextModel.__call__` (causal mask for attention, no SSM mask).

--dtype native skips that cast: the model runs in the checkpoint's own dtype (bf16 scales, biases and
norms, so bf16 activations), as `mlx_lm.generate` would run it; the log-softmax is still float32. It
is the "MLX-LM's own bf16 run" the numerics bar compares against.

--device gpu runs on MLX's GPU backend (the CUDA build on the GPU machine) with TF32 turned off
(MLX_ENABLE_TF32=0), so float32 products stay float32. The CPU backend (the default) runs its
quantised products on one core: the full-size 35B checkpoint takes many minutes there. Progress
goes to stderr with elapsed seconds.
"""

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

# Read by MLX when it starts: keep float32 matrix products in float32 on the GPU.
os.environ.setdefault("MLX_ENABLE_TF32", "0")

import mlx.core as mx
import numpy as np
from mlx.utils import tree_map
from mlx_lm.models.base import create_attention_mask, create_ssm_mask
from mlx_lm.utils import load_model


T0 = time.time()


def progress(msg):
    print(f"[{time.time() - T0:7.1f} s] {msg}", file=sys.stderr, flush=True)


def load_f32(model_dir, native=False):
    """Load an mlx-lm checkpoint and cast every floating parameter to float32 (unless `native`)."""
    model, config = load_model(Path(model_dir))
    if native:
        mx.eval(model.parameters())
        progress(f"loaded {model_dir} (parameters in their own dtype)")
        return model, config

    def to_f32(x):
        if isinstance(x, mx.array) and mx.issubdtype(x.dtype, mx.floating):
            return x.astype(mx.float32)
        return x

    model.update(tree_map(to_f32, model.parameters()))
    mx.eval(model.parameters())
    progress(f"loaded {model_dir} (floating parameters as float32)")
    return model, config


def _text_parts(model):
    lm = model.language_model if hasattr(model, "language_model") else model
    return lm, lm.model


def forward_with_hidden(model, tokens):
    """Run the text model over `tokens` in one call.

    Returns (hidden, final, logits) as float32 numpy arrays:
      hidden[l] [T, H] = residual stream after decoder layer l (before the final norm),
      final     [T, H] = after the final norm,
      logits    [T, V].
    Mirrors mlx_lm.models.qwen3_5.Qwen3_5TextModel.__call__ / TextModel.__call__ with cache=None.
    """
    lm, tm = _text_parts(model)
    inputs = mx.array(np.asarray(tokens, dtype=np.int32))[None]
    h = tm.embed_tokens(inputs)
    fa_mask = create_attention_mask(h, None)
    ssm_mask = create_ssm_mask(h, None)
    hidden = []
    for i, layer in enumerate(tm.layers):
        mask = ssm_mask if layer.is_linear else fa_mask
        h = layer(h, mask=mask, cache=None)
        mx.eval(h)
        hidden.append(h)
        progress(f"layer {i} done")
    final = tm.norm(h)
    if lm.args.tie_word_embeddings:
        logits = tm.embed_tokens.as_linear(final)
    else:
        logits = lm.lm_head(final)
    mx.eval(final, logits)

    # The unrolled loop must reproduce the model's own __call__ exactly.
    ref = model(inputs)
    mx.eval(ref)
    progress("model(inputs) done")
    if not mx.array_equal(ref, logits).item():
        diff = mx.max(mx.abs(ref - logits)).item()
        raise RuntimeError(f"unrolled MLX forward differs from model(inputs): max |diff| = {diff}")

    def np32(x):
        return np.array(x.astype(mx.float32)[0], dtype=np.float32)

    return [np32(x) for x in hidden], np32(final), np32(logits)


def score_from_logits(tokens, logits):
    """logits: float32 numpy [T, V]. Log-softmax in float32 (via mlx)."""
    lg = mx.array(logits.astype(np.float32))
    logp = lg - mx.logsumexp(lg, axis=-1, keepdims=True)
    logp = np.array(logp, dtype=np.float32)
    T = len(tokens)
    targets = np.asarray(tokens[1:], dtype=np.int64)
    lp = logp[np.arange(T - 1), targets]
    am = np.argmax(logits[: T - 1], axis=-1)
    return make_result(lp, am)


def make_result(token_logprobs, argmax):
    lp = [float(x) for x in np.asarray(token_logprobs, dtype=np.float32)]
    am = [int(x) for x in argmax]
    ppl = math.exp(-sum(lp) / len(lp))
    return {"positions": len(lp), "perplexity": ppl, "token_logprobs": lp, "argmax": am}


def score_mlx(model_dir, tokens, native=False):
    """Returns (result_dict, tensors) where tensors holds hidden.{l}, final, logits (float32)."""
    model, _ = load_f32(model_dir, native)
    hidden, final, logits = forward_with_hidden(model, tokens)
    result = score_from_logits(tokens, logits)
    tensors = {f"hidden.{l}": h for l, h in enumerate(hidden)}
    tensors["final"] = final
    tensors["logits"] = logits
    return result, tensors


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="MLX-format checkpoint directory")
    ap.add_argument("--tokens", required=True, help="JSON array of token ids")
    ap.add_argument("--hidden-out", help="optionally write hidden.{l}/final/logits (f32 safetensors)")
    ap.add_argument("--device", choices=["cpu", "gpu"], default="cpu", help="MLX device (default cpu)")
    ap.add_argument("--dtype", choices=["float32", "native"], default="float32",
                    help="float32: every floating parameter cast to float32 (the reference); native: as stored (bf16)")
    args = ap.parse_args()
    mx.set_default_device(mx.gpu if args.device == "gpu" else mx.cpu)
    progress(f"device {mx.default_device()}")
    tokens = json.loads(Path(args.tokens).read_text())
    result, tensors = score_mlx(args.model, tokens, args.dtype == "native")
    if args.hidden_out:
        from safetensors.numpy import save_file

        save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, args.hidden_out)
    json.dump(result, sys.stdout)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
