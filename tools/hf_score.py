#!/usr/bin/env python3
"""Teacher-forced float32 scoring of a Hugging Face (transformers) qwen3_5_moe checkpoint.

    python3 tools/hf_score.py --model DIR --tokens FILE [--hidden-out FILE.safetensors]

DIR is a transformers checkpoint (config.json + model*.safetensors, typically bf16), e.g.
tests/fixtures/tiny-a/hf. FILE is a JSON array of token ids. The weights are loaded straight into
float32 (bf16 -> f32 is exact; f32 tensors such as A_log are kept as stored), eager attention,
eager experts loop, eval mode, no grad, one forward call over the whole prompt without a cache.
Prints the same JSON as tests/fixtures/*/ref_hf.json:

    {"positions": N-1, "perplexity": P, "token_logprobs": [...], "argmax": [...]}

token_logprobs[i] = log p(tokens[i+1] | tokens[0..=i]) (float32 log_softmax of the logits at i),
argmax[i] = argmax of those logits, P = exp(-mean(token_logprobs)).
"""

import argparse
import json
import math
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np
import torch


def load_f32(model_dir):
    import transformers

    cfg = transformers.AutoConfig.from_pretrained(model_dir)
    kwargs = dict(dtype=torch.float32, attn_implementation="eager", output_loading_info=True)
    if cfg.model_type == "qwen3_5_moe":
        cls = transformers.Qwen3_5MoeForConditionalGeneration
        kwargs["experts_implementation"] = "eager"
    elif cfg.model_type == "qwen3_5_moe_text":
        cls = transformers.Qwen3_5MoeForCausalLM
        kwargs["experts_implementation"] = "eager"
    else:
        cls = transformers.AutoModelForCausalLM
    model, info = cls.from_pretrained(model_dir, **kwargs)
    # A text-only checkpoint with the multimodal config lacks the (unused) vision tower: allow that.
    missing = [k for k in info.get("missing_keys", []) if not k.startswith("model.visual.")]
    mismatched = list(info.get("mismatched_keys", []))
    if missing or mismatched:
        raise RuntimeError(f"checkpoint does not cover the model: missing={missing} mismatched={mismatched}")
    model = model.float().eval()
    return model


def text_model_of(model):
    m = model.model
    return m.language_model if hasattr(m, "language_model") else m


@torch.no_grad()
def forward_with_hidden(model, tokens):
    """Returns (hidden list [T,H], final [T,H], logits [T,V]) as float32 numpy.

    hidden[l] is the output of decoder layer l (residual stream, before the final norm), captured
    with forward hooks; final is the output of the final norm. (HF's own output_hidden_states is
    [embeddings, after layer 0, ...] and is not used here.)
    """
    tm = text_model_of(model)
    captured = {}
    hooks = []
    for l, layer in enumerate(tm.layers):
        def hook(_m, _inp, out, l=l):
            captured[l] = (out[0] if isinstance(out, tuple) else out).detach().clone()
        hooks.append(layer.register_forward_hook(hook))
    hooks.append(tm.norm.register_forward_hook(lambda _m, _i, out: captured.__setitem__("final", out.detach().clone())))
    try:
        ids = torch.tensor([list(tokens)], dtype=torch.long)
        out = model(input_ids=ids, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    logits = out.logits[0].float().numpy()
    hidden = [captured[l][0].float().numpy() for l in range(len(tm.layers))]
    final = captured["final"][0].float().numpy()
    return hidden, final, logits


def score_from_logits(tokens, logits):
    lg = torch.from_numpy(np.ascontiguousarray(logits, dtype=np.float32))
    logp = torch.log_softmax(lg, dim=-1).numpy()
    T = len(tokens)
    targets = np.asarray(tokens[1:], dtype=np.int64)
    lp = logp[np.arange(T - 1), targets]
    am = np.argmax(logits[: T - 1], axis=-1)
    lp = [float(x) for x in lp.astype(np.float32)]
    return {
        "positions": len(lp),
        "perplexity": math.exp(-sum(lp) / len(lp)),
        "token_logprobs": lp,
        "argmax": [int(x) for x in am],
    }


def score_hf(model_dir, tokens, model=None):
    """Returns (result_dict, tensors) where tensors holds hidden.{l}, final, logits (float32)."""
    if model is None:
        model = load_f32(model_dir)
    hidden, final, logits = forward_with_hidden(model, tokens)
    result = score_from_logits(tokens, logits)
    tensors = {f"hidden.{l}": h for l, h in enumerate(hidden)}
    tensors["final"] = final
    tensors["logits"] = logits
    return result, tensors


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="transformers checkpoint directory")
    ap.add_argument("--tokens", required=True, help="JSON array of token ids")
    ap.add_argument("--hidden-out", help="optionally write hidden.{l}/final/logits (f32 safetensors)")
    args = ap.parse_args()
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    tokens = json.loads(Path(args.tokens).read_text())
    result, tensors = score_hf(args.model, tokens)
    if args.hidden_out:
        from safetensors.numpy import save_file

        save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, args.hidden_out)
    json.dump(result, sys.stdout)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
