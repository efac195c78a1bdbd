#!/usr/bin/env python3
"""Generate the tiny qwen3_5_moe reference fixtures under tests/fixtures/.

    python3 tools/make_fixtures.py [--only NAME ...] [--out tests/fixtures]

For every config in CONFIGS this script
  1. builds a transformers `Qwen3_5MoeForConditionalGeneration` (tiny vision tower, real key names),
     randomises every parameter (seeded) and saves it in bf16 (A_log in f32, as in the real
     checkpoint), sharded, with model.safetensors.index.json, generation_config.json and a small
     byte-level BPE tokenizer  ->  <name>/hf/
  2. converts that checkpoint with mlx-lm's own converter (mlx_lm.convert.convert, quantize=True)
     ->  <name>/mlx/
  3. writes a 193-token prompt  ->  <name>/tokens.json
     (16 uniformly random ids, then 177 ids sampled at temperature 1 from the float32 HF model, so
     the reference perplexity is far below the vocabulary size)
  4. scores the prompt with mlx-lm in float32 on the MLX checkpoint  ->  ref_mlx.json,
     ref_mlx_hidden.safetensors
  5. scores it with transformers in float32 on the bf16 HF checkpoint  ->  ref_hf.json,
     ref_hf_hidden.safetensors
  6. prints MLX-vs-HF agreement, and finally writes tests/fixtures/README.md and manifest.json.

Everything is seeded; re-running regenerates byte-identical files (same library versions, see
tools/requirements-reference.txt).
"""

import argparse
import json
import math
import os
import platform
import shutil
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

import numpy as np
import torch

import mlx.core as mx
import mlx_lm
import safetensors
import tokenizers
import transformers
from safetensors.numpy import save_file as np_save_file
from safetensors.torch import load_file as pt_load_file
from safetensors.torch import save_file as pt_save_file

TOOLS = Path(__file__).resolve().parent
sys.path.insert(0, str(TOOLS))
import hf_score  # noqa: E402
import mlx_score  # noqa: E402

REPO = TOOLS.parent
PROMPT_LEN = 193
N_UNIFORM = 16  # leading uniformly random ids; the rest are sampled from the model

# ---------------------------------------------------------------------------------------------
# Configs. `layer_types` (transformers) and `full_attention_interval` (mlx-lm, which derives the
# pattern as (i+1) % interval == 0 -> full attention) are always written consistently.
# ---------------------------------------------------------------------------------------------
CONFIGS = [
    dict(
        name="tiny-a",
        seed=1001,
        note="production-shaped: 4-bit g64 like mlx-community/Qwen3.6-35B-A3B-4bit; has mtp.* tensors",
        text=dict(
            vocab_size=512,
            hidden_size=128,
            num_hidden_layers=4,
            full_attention_interval=4,  # layer 3 is full attention
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=64,
            rope_theta=10_000_000,
            partial_rotary_factor=0.25,  # rotary dim 16
            mrope_section=[3, 3, 2],
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=32,
            linear_value_head_dim=32,
            linear_conv_kernel_dim=4,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=64,
            shared_expert_intermediate_size=64,
            rms_norm_eps=1e-6,
        ),
        q_bits=4,
        q_group_size=64,
        add_mtp=True,
    ),
    dict(
        name="tiny-b",
        seed=2002,
        note="8-bit g32; GQA 8:1; 6 layers, full attention at 2 and 5; 16 experts top-4",
        text=dict(
            vocab_size=384,
            hidden_size=64,
            num_hidden_layers=6,
            full_attention_interval=3,  # layers 2 and 5 are full attention
            num_attention_heads=8,
            num_key_value_heads=1,
            head_dim=32,
            rope_theta=10_000_000,
            partial_rotary_factor=0.25,  # rotary dim 8
            mrope_section=[2, 1, 1],
            linear_num_key_heads=4,
            linear_num_value_heads=8,
            linear_key_head_dim=16,
            linear_value_head_dim=32,
            linear_conv_kernel_dim=4,
            num_experts=16,
            num_experts_per_tok=4,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=64,
            rms_norm_eps=1e-6,
        ),
        q_bits=8,
        q_group_size=32,
        add_mtp=False,
        init=dict(bigram=0.6, logit_gain=2.5),  # hidden 64: needs a stronger successor term
    ),
    dict(
        name="tiny-c",
        seed=3003,
        note=(
            "4-bit g128 with unquantised Linears (input dim 64 is not a multiple of 128): "
            "linear_attn.out_proj, switch_mlp.down_proj and shared_expert.down_proj stay bf16; "
            "MHA (no GQA), one GDN head (Hv == Hk), top-1 routing, partial_rotary_factor 0.5, "
            "rope_theta 1e6, rms_norm_eps 1e-5, last layer is linear attention"
        ),
        text=dict(
            vocab_size=320,
            hidden_size=128,
            num_hidden_layers=3,
            full_attention_interval=2,  # layer 1 is full attention; layers 0 and 2 linear
            num_attention_heads=2,
            num_key_value_heads=2,
            head_dim=64,
            rope_theta=1_000_000,
            partial_rotary_factor=0.5,  # rotary dim 32
            mrope_section=[6, 5, 5],
            linear_num_key_heads=1,
            linear_num_value_heads=1,
            linear_key_head_dim=64,
            linear_value_head_dim=64,
            linear_conv_kernel_dim=4,
            num_experts=4,
            num_experts_per_tok=1,
            moe_intermediate_size=64,
            shared_expert_intermediate_size=64,
            rms_norm_eps=1e-5,
        ),
        q_bits=4,
        q_group_size=128,
        add_mtp=False,
        init=dict(router_gain=6.0),  # top-1 routing: keep router near-ties rare
    ),
]

# Initialisation gains (see randomise()). Chosen so that the logits are peaked (stable argmax), MoE
# routing has few near-ties, and a random network does not amplify small numeric differences:
#   logit_gain: lm_head std * sqrt(H); bigram: weight of the "successor" component of lm_head;
#   router_gain: router logit std; out_gain: scale of o_proj/out_proj/down_proj (x 1/sqrt(fan_in)).
DEFAULT_INIT = dict(logit_gain=2.0, router_gain=4.0, out_gain=0.4, bigram=0.5)

# Special tokens appended after the BPE vocabulary (ids = n_bpe .. n_bpe+4).
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
# Qwen3.5 pre-tokenizer regex (as in the architecture doc).
QWEN_PRETOK = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
CORPUS = """\
Lily is a Rust inference engine for the Qwen3.5 and Qwen3.6 mixture-of-experts models.
The decoder alternates Gated DeltaNet linear attention layers with gated full attention layers,
and every layer ends in a sparse mixture of experts with one shared expert.
These tiny random models exist only to check that two implementations agree, token by token.
The quick brown fox jumps over the lazy dog. 0123456789 + - * / = ( ) [ ] { } < > ; : , . ! ?
fn main() { let x: Vec<u32> = (0..10).map(|i| i * i).collect(); println!("{:?}", x); }
def forward(self, x): return self.lm_head(self.norm(x))
Beautiful is better than ugly. Explicit is better than implicit. Simple is better than complex.
Complex is better than complicated. Flat is better than nested. Sparse is better than dense.
Readability counts. Special cases aren't special enough to break the rules.
Although practicality beats purity. Errors should never pass silently.
Unless explicitly silenced. In the face of ambiguity, refuse the temptation to guess.
There should be one-- and preferably only one --obvious way to do it.
Now is better than never. Although never is often better than *right* now.
If the implementation is hard to explain, it's a bad idea.
If the implementation is easy to explain, it may be a good idea.
Namespaces are one honking great idea -- let's do more of those!
"""


# ---------------------------------------------------------------------------------------------
def build_tokenizer(vocab_size, out_dir):
    """A small deterministic byte-level BPE (Qwen-style pre-tokenizer) + ChatML special tokens.

    Its size is below the model's vocab_size, like the real model (padded embedding rows)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_PRETOK), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    n_bpe_target = vocab_size - len(SPECIAL_TOKENS) - 16
    trainer = trainers.BpeTrainer(
        vocab_size=n_bpe_target,
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS.splitlines(keepends=True), trainer)
    tok.add_special_tokens(SPECIAL_TOKENS)
    assert tok.get_vocab_size() <= vocab_size
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        clean_up_tokenization_spaces=False,
    )
    fast.save_pretrained(out_dir)
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    return ids, tok.get_vocab_size()


def make_hf_config(cfg, special_ids):
    t = cfg["text"]
    L = t["num_hidden_layers"]
    interval = t["full_attention_interval"]
    layer_types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(L)]
    text = dict(t)
    for k in ("rope_theta", "partial_rotary_factor", "mrope_section"):
        text.pop(k)
    text.update(
        layer_types=layer_types,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": t["rope_theta"],
            "partial_rotary_factor": t["partial_rotary_factor"],
            "mrope_section": t["mrope_section"],
            "mrope_interleaved": True,
        },
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        attention_bias=False,
        hidden_act="silu",
        bos_token_id=special_ids["<|endoftext|>"],
        eos_token_id=special_ids["<|endoftext|>"],
        pad_token_id=None,
        dtype="float32",  # randomised in f32, cast to bf16 before saving
    )
    assert 2 * sum(t["mrope_section"]) == int(t["head_dim"] * t["partial_rotary_factor"])
    vision = dict(
        depth=1,
        hidden_size=16,
        intermediate_size=16,
        num_heads=1,
        patch_size=2,
        temporal_patch_size=1,
        spatial_merge_size=2,
        out_hidden_size=t["hidden_size"],
        num_position_embeddings=4,
    )
    return transformers.Qwen3_5MoeConfig(text_config=text, vision_config=vision, tie_word_embeddings=False)


def randomise(model, cfg):
    """Give every parameter a sensible, non-trivial random value (deterministic)."""
    g = torch.Generator().manual_seed(cfg["seed"])
    H = cfg["text"]["hidden_size"]
    ini = dict(DEFAULT_INIT, **cfg.get("init", {}))

    def normal(shape, std, mean=0.0):
        return torch.randn(shape, generator=g, dtype=torch.float32) * std + mean

    with torch.no_grad():
        for name, p in model.named_parameters():
            shape = tuple(p.shape)
            if name.startswith("model.visual."):
                v = normal(shape, 0.02, 1.0 if ("norm" in name and name.endswith(".weight")) else 0.0)
            elif name.endswith("embed_tokens.weight"):
                v = normal(shape, 1.0)
                emb = v
            elif name == "lm_head.weight":
                # random rows plus a "successor" component: row perm[x] is aligned with the
                # embedding of token x, so the current token makes one next token clearly
                # likelier (peaked, stable argmax) while the layers still shift the logits.
                perm = torch.randperm(shape[0], generator=g)
                succ = torch.empty_like(emb)
                succ[perm] = emb
                b = ini["bigram"]
                v = (math.sqrt(1 - b * b) * normal(shape, 1.0) + b * succ) * (ini["logit_gain"] / math.sqrt(H))
            elif name.endswith("linear_attn.norm.weight"):  # plain-weight gated RMSNorm
                v = normal(shape, 0.1, 1.0)
            elif name.endswith("norm.weight"):  # zero-centred (1+w) RMSNorms incl. q_norm/k_norm
                v = normal(shape, 0.1)
            elif name.endswith("linear_attn.A_log"):  # decay rate A in [0.05, 3]
                v = torch.log(torch.rand(shape, generator=g) * 2.95 + 0.05)
            elif name.endswith("linear_attn.dt_bias"):
                v = normal(shape, 0.5)
            elif name.endswith("conv1d.weight"):  # [C, 1, K]
                v = normal(shape, 1.0 / math.sqrt(shape[-1]))
            elif name.endswith("mlp.gate.weight"):  # router: logits ~ N(0, router_gain^2)
                v = normal(shape, ini["router_gain"] / math.sqrt(H))
            elif name.endswith("experts.gate_up_proj"):  # [E, 2I, H]
                v = normal(shape, 1.0 / math.sqrt(shape[-1]))
            elif name.endswith("experts.down_proj"):  # [E, H, I]
                v = normal(shape, ini["out_gain"] / math.sqrt(shape[-1]))
            elif name.endswith(("o_proj.weight", "out_proj.weight", "shared_expert.down_proj.weight")):
                v = normal(shape, ini["out_gain"] / math.sqrt(shape[-1]))
            elif name.endswith(".weight") and len(shape) == 2:  # nn.Linear [out, in]
                v = normal(shape, 1.0 / math.sqrt(shape[-1]))
            else:
                raise RuntimeError(f"no init rule for {name} {shape}")
            p.copy_(v)


def to_bf16_keep_alog(model):
    """bf16 everywhere except linear_attn.A_log, which the real checkpoint stores in f32."""
    alogs = {n: p.detach().clone() for n, p in model.named_parameters() if n.endswith("A_log")}
    model.to(torch.bfloat16)
    for n, p in model.named_parameters():
        if n in alogs:
            p.data = alogs[n]
    model.config.dtype = torch.bfloat16
    model.config.text_config.dtype = torch.bfloat16
    model.config.vision_config.dtype = torch.bfloat16


def add_mtp_tensors(hf_dir, cfg):
    """Append a few mtp.* tensors to the last shard (real checkpoints carry an MTP head; the text
    forward must skip them)."""
    g = torch.Generator().manual_seed(cfg["seed"] + 7)
    H = cfg["text"]["hidden_size"]
    extra = {
        "mtp.fc.weight": (torch.randn(H, 2 * H, generator=g) / math.sqrt(2 * H)).to(torch.bfloat16),
        "mtp.norm.weight": (torch.randn(H, generator=g) * 0.1).to(torch.bfloat16),
        "mtp.pre_fc_norm_hidden.weight": (torch.randn(H, generator=g) * 0.1).to(torch.bfloat16),
    }
    idx_path = hf_dir / "model.safetensors.index.json"
    idx = json.loads(idx_path.read_text())
    last = sorted(set(idx["weight_map"].values()))[-1]
    tensors = pt_load_file(str(hf_dir / last))
    tensors.update(extra)
    pt_save_file(tensors, str(hf_dir / last), metadata={"format": "pt"})
    for k, v in extra.items():
        idx["weight_map"][k] = last
        idx["metadata"]["total_size"] += v.numel() * v.element_size()
    idx["weight_map"] = dict(sorted(idx["weight_map"].items()))
    idx_path.write_text(json.dumps(idx, indent=2, sort_keys=True) + "\n")
    return list(extra)


def build_hf(cfg, hf_dir):
    hf_dir.mkdir(parents=True)
    special_ids, n_tok = build_tokenizer(cfg["text"]["vocab_size"], hf_dir)
    torch.manual_seed(cfg["seed"])  # for anything transformers initialises internally
    config = make_hf_config(cfg, special_ids)
    model = transformers.Qwen3_5MoeForConditionalGeneration(config)
    randomise(model, cfg)
    to_bf16_keep_alog(model)
    model.generation_config = transformers.GenerationConfig(
        bos_token_id=special_ids["<|endoftext|>"],
        eos_token_id=[special_ids["<|im_end|>"], special_ids["<|endoftext|>"]],
        pad_token_id=special_ids["<|endoftext|>"],
        do_sample=True,
        temperature=1.0,
        top_k=20,
        top_p=0.95,
    )
    # save_original_format=False keeps the fused experts layout (gate_up_proj [E,2I,H],
    # down_proj [E,H,I]) of the real checkpoints; transformers 5.x would otherwise "revert" to
    # per-expert experts.{e}.{gate,up,down}_proj.weight keys.
    model.save_pretrained(hf_dir, max_shard_size="512KB", save_original_format=False)
    mtp = add_mtp_tensors(hf_dir, cfg) if cfg["add_mtp"] else []
    return special_ids, n_tok, mtp


def convert_mlx(cfg, hf_dir, mlx_dir):
    from mlx_lm.convert import convert

    convert(
        hf_path=str(hf_dir),
        mlx_path=str(mlx_dir),
        quantize=True,
        q_group_size=cfg["q_group_size"],
        q_bits=cfg["q_bits"],
    )


def sample_prompt(model, cfg):
    """N_UNIFORM uniform ids, then ids sampled (T=1) from the float32 HF model."""
    V = cfg["text"]["vocab_size"]
    rng = np.random.default_rng(cfg["seed"])
    toks = [int(x) for x in rng.integers(0, V, size=N_UNIFORM)]
    with torch.no_grad():
        while len(toks) < PROMPT_LEN:
            logits = model(input_ids=torch.tensor([toks]), use_cache=False).logits[0, -1].double()
            p = torch.softmax(logits, -1).numpy()
            p = p / p.sum()
            toks.append(int(rng.choice(V, p=p)))
    return toks


def write_json(path, obj):
    path.write_text(json.dumps(obj) + "\n")


def save_hidden(path, tensors):
    np_save_file({k: np.ascontiguousarray(v, dtype=np.float32) for k, v in tensors.items()}, str(path))


def describe_quant(mlx_dir):
    cfgj = json.loads((mlx_dir / "config.json").read_text())
    q = cfgj.get("quantization", {})
    overrides = {k: v for k, v in q.items() if isinstance(v, dict)}
    from safetensors import safe_open

    unquantised = []
    with safe_open(str(mlx_dir / "model.safetensors"), "np") as f:
        keys = list(f.keys())
    for k in keys:
        if k.endswith(".weight"):
            base = k[: -len(".weight")]
            if f"{base}.scales" not in keys and any(
                s in base for s in ("proj", "lm_head", "embed_tokens", "mlp.gate", "shared_expert_gate")
            ):
                unquantised.append(k)
    return q, overrides, sorted(set(unquantised))


def equivalence_check(name, hf_dir, tokens, t_hf):
    """Semantic cross-check of the two references without quantisation: convert hf/ with mlx-lm
    *unquantised*, replace the norm weights (which mlx-lm folds as bf16(1+w)) by 1+w in float32,
    run the MLX float32 forward and compare with the transformers float32 forward. Only float32
    rounding (and any MoE routing near-tie) should remain."""
    import tempfile

    from mlx.utils import tree_flatten
    from mlx_lm.convert import convert

    hf_w = {}
    for f in sorted(hf_dir.glob("model-*.safetensors")):
        hf_w.update(pt_load_file(str(f)))
    with tempfile.TemporaryDirectory() as tmp:
        dst = Path(tmp) / "mlx-bf16"
        convert(hf_path=str(hf_dir), mlx_path=str(dst), quantize=False)
        model, _ = mlx_score.load_f32(dst)
    folded = (".input_layernorm.weight", ".post_attention_layernorm.weight", "model.norm.weight",
              ".q_norm.weight", ".k_norm.weight")
    upd = []
    for k, _v in tree_flatten(model.parameters()):
        if k.endswith(folded):
            hk = k.replace("language_model.model.", "model.language_model.", 1)
            upd.append((k, mx.array(1.0 + hf_w[hk].float().numpy())))
    model.load_weights(upd, strict=False)
    hidden, _final, logits = mlx_score.forward_with_hidden(model, tokens)
    per_tok = [
        np.sqrt(((h - t_hf[f"hidden.{l}"]) ** 2).mean(-1) / (t_hf[f"hidden.{l}"] ** 2).mean(-1))
        for l, h in enumerate(hidden)
    ]
    med = max(float(np.median(e)) for e in per_tok)
    worst = max(float(e.max()) for e in per_tok)
    dlogit = float(np.abs(logits - t_hf["logits"]).max())
    print(f"[{name}] equivalence (MLX unquantised, f32 (1+w) norms vs HF): per-token rel diff median "
          f"{med:.2e} worst {worst:.2e}, max |dlogit| {dlogit:.2e}")
    assert med < 1e-4, (med, worst, dlogit)
    return dict(unquantised_median_rel_diff=med, unquantised_worst_rel_diff=worst,
                unquantised_max_abs_logit_diff=dlogit)


def compare(name, r_mlx, r_hf, t_mlx, t_hf, V):
    lp_m = np.array(r_mlx["token_logprobs"], dtype=np.float64)
    lp_h = np.array(r_hf["token_logprobs"], dtype=np.float64)
    am_m = np.array(r_mlx["argmax"])
    am_h = np.array(r_hf["argmax"])
    agree = float(np.mean(am_m == am_h))
    # probability of the top-1 token (HF), to show the logits are peaked
    lg = t_hf["logits"][:-1].astype(np.float64)
    pr = np.exp(lg - lg.max(-1, keepdims=True))
    pr /= pr.sum(-1, keepdims=True)
    top1 = pr.max(-1)
    srt = np.sort(lg, axis=-1)
    margin = srt[:, -1] - srt[:, -2]
    stats = dict(
        ppl_mlx=r_mlx["perplexity"],
        ppl_hf=r_hf["perplexity"],
        ppl_rel_diff=abs(r_mlx["perplexity"] - r_hf["perplexity"]) / r_hf["perplexity"],
        top1_agreement=agree,
        mean_abs_logprob_diff=float(np.mean(np.abs(lp_m - lp_h))),
        max_abs_logprob_diff=float(np.max(np.abs(lp_m - lp_h))),
        hf_mean_top1_prob=float(top1.mean()),
        hf_median_top1_margin=float(np.median(margin)),
        uniform_prob=1.0 / V,
        final_hidden_rel_rms_diff=float(
            np.sqrt(np.mean((t_mlx["final"] - t_hf["final"]) ** 2) / np.mean(t_hf["final"] ** 2))
        ),
    )
    print(f"[{name}] perplexity  MLX(quantised) {stats['ppl_mlx']:.4f}   HF(bf16) {stats['ppl_hf']:.4f}   "
          f"rel diff {100 * stats['ppl_rel_diff']:.2f}%   (vocab {V})")
    print(f"[{name}] top-1 agreement MLX vs HF: {100 * agree:.1f}%   mean|dlogp| {stats['mean_abs_logprob_diff']:.4f}"
          f"   max|dlogp| {stats['max_abs_logprob_diff']:.4f}")
    print(f"[{name}] HF mean top-1 prob {stats['hf_mean_top1_prob']:.3f} (uniform {1.0 / V:.4f}), "
          f"median top-1 margin {stats['hf_median_top1_margin']:.3f}, final-norm rel RMS diff "
          f"{stats['final_hidden_rel_rms_diff']:.4f}")
    for l in range(len([k for k in t_hf if k.startswith("hidden.")])):
        a, b = t_mlx[f"hidden.{l}"], t_hf[f"hidden.{l}"]
        rel = float(np.sqrt(np.mean((a - b) ** 2) / np.mean(b ** 2)))
        stats[f"hidden.{l}_rel_rms_diff"] = rel
    print(f"[{name}] per-layer rel RMS diff: "
          + ", ".join(f"{stats[f'hidden.{l}_rel_rms_diff']:.4f}" for l in range(len(t_hf) - 2)))
    # Sanity bounds: a useful fixture has peaked but finite predictions, and the two references
    # must be close (they differ only by quantisation).
    assert 1.5 < stats["ppl_hf"] < V / 4, stats
    assert stats["ppl_rel_diff"] < 0.25, stats
    assert agree > 0.75, stats
    assert all(np.isfinite(v).all() for v in t_hf.values()) and all(np.isfinite(v).all() for v in t_mlx.values())
    return stats


def make_one(cfg, root):
    name = cfg["name"]
    out = root / name
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    hf_dir, mlx_dir = out / "hf", out / "mlx"
    print(f"=== {name}: {cfg['note']}")

    special_ids, n_tok, mtp = build_hf(cfg, hf_dir)
    convert_mlx(cfg, hf_dir, mlx_dir)

    # transformers reference model (bf16 checkpoint computed in f32); also samples the prompt.
    hf_model = hf_score.load_f32(hf_dir)
    tokens = sample_prompt(hf_model, cfg)
    assert len(tokens) == PROMPT_LEN and all(0 <= t < cfg["text"]["vocab_size"] for t in tokens)
    write_json(out / "tokens.json", tokens)

    r_mlx, t_mlx = mlx_score.score_mlx(mlx_dir, tokens)
    write_json(out / "ref_mlx.json", r_mlx)
    save_hidden(out / "ref_mlx_hidden.safetensors", t_mlx)

    r_hf, t_hf = hf_score.score_hf(hf_dir, tokens, model=hf_model)
    write_json(out / "ref_hf.json", r_hf)
    save_hidden(out / "ref_hf_hidden.safetensors", t_hf)

    # The HF hooks must agree with HF's own hidden_states output (entry l+1 = after layer l for
    # l < L-1; the last entry is captured before the final norm in this version).
    with torch.no_grad():
        o = hf_model(input_ids=torch.tensor([tokens]), use_cache=False, output_hidden_states=True)
    L = cfg["text"]["num_hidden_layers"]
    for l in range(L - 1):
        assert np.array_equal(o.hidden_states[l + 1][0].numpy(), t_hf[f"hidden.{l}"]), l
    hf_last_is = (
        "after layer L-1 (not normed)"
        if np.array_equal(o.hidden_states[-1][0].numpy(), t_hf[f"hidden.{L - 1}"])
        else "after the final norm"
        if np.array_equal(o.hidden_states[-1][0].numpy(), t_hf["final"])
        else "something else"
    )

    stats = compare(name, r_mlx, r_hf, t_mlx, t_hf, cfg["text"]["vocab_size"])
    stats.update(equivalence_check(name, hf_dir, tokens, t_hf))
    q, overrides, unq = describe_quant(mlx_dir)
    print(f"[{name}] mlx quantization: bits {q.get('bits')} group_size {q.get('group_size')} mode {q.get('mode')}, "
          f"{len(overrides)} per-path overrides, unquantised linears: {len(unq)}")
    return dict(
        name=name,
        note=cfg["note"],
        seed=cfg["seed"],
        text_config=cfg["text"],
        layer_types=["full_attention" if (i + 1) % cfg["text"]["full_attention_interval"] == 0
                     else "linear_attention" for i in range(L)],
        q_bits=cfg["q_bits"],
        q_group_size=cfg["q_group_size"],
        quant_overrides=overrides,
        unquantised_weights=unq,
        tokenizer_size=n_tok,
        special_token_ids=special_ids,
        mtp_tensors=mtp,
        hf_hidden_states_last_entry=hf_last_is,
        prompt=dict(length=PROMPT_LEN, uniform_prefix=N_UNIFORM),
        stats=stats,
    )


def file_table(root):
    rows = []
    for p in sorted(root.rglob("*")):
        if p.is_file():
            rows.append((str(p.relative_to(root)), p.stat().st_size))
    return rows


def write_readme(root, results, argv):
    versions = {
        "python": platform.python_version(),
        "mlx": mx.__version__,
        "mlx-lm": mlx_lm.__version__,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "safetensors": safetensors.__version__,
        "tokenizers": tokenizers.__version__,
        "numpy": np.__version__,
    }
    manifest = dict(generator="tools/make_fixtures.py", versions=versions, fixtures=results)
    (root / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")

    rows = file_table(root)
    total = sum(s for _, s in rows) + 0
    L = []
    w = L.append
    w("# Reference fixtures for the qwen3_5_moe forward pass")
    w("")
    w("Generated by `tools/make_fixtures.py`; do not edit by hand. Regenerate everything with")
    w("")
    w("```sh")
    w("pip install -r tools/requirements-reference.txt   # CPU only; exact versions matter")
    w("python3 tools/make_fixtures.py")
    w("```")
    w("")
    w("Versions used: " + ", ".join(f"{k} {v}" for k, v in versions.items()) + ".")
    w("The script is seeded and deterministic: re-running it with these versions on the same platform")
    w("(linux x86_64, CPU) reproduces every file byte for byte. Another BLAS / CPU may change the last bits")
    w("of the float32 references (and, in rare cases, a sampled prompt token); the checked-in files are the")
    w("reference.")
    w("")
    w("## What each fixture is")
    w("")
    w("Each `<name>/` is a tiny random model of the real `qwen3_5_moe` architecture (Qwen3.5/3.6 MoE:")
    w("Gated DeltaNet + gated full attention + sparse MoE with a shared expert), built with")
    w("transformers' own `Qwen3_5MoeForConditionalGeneration` (with a minimal vision tower, so the")
    w("checkpoint has the real multimodal key names), every parameter randomised.")
    w("")
    w("| fixture | layers (L=linear/GDN, F=full) | hidden | q/kv heads × head_dim (rotary) | GDN k/v heads × dims | experts (top-k) × inter, shared | vocab | MLX quant | notes |")
    w("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        t = r["text_config"]
        pat = "".join("F" if x == "full_attention" else "L" for x in r["layer_types"])
        rot = int(t["head_dim"] * t["partial_rotary_factor"])
        w(f"| `{r['name']}` | {pat} (interval {t['full_attention_interval']}) | {t['hidden_size']} | "
          f"{t['num_attention_heads']}/{t['num_key_value_heads']} × {t['head_dim']} ({rot}, θ={t['rope_theta']:g}) | "
          f"{t['linear_num_key_heads']}/{t['linear_num_value_heads']} × {t['linear_key_head_dim']}/{t['linear_value_head_dim']} | "
          f"{t['num_experts']} ({t['num_experts_per_tok']}) × {t['moe_intermediate_size']}, {t['shared_expert_intermediate_size']} | "
          f"{t['vocab_size']} | {r['q_bits']}-bit g{r['q_group_size']} (router + shared_expert_gate 8-bit g64) | {r['note']} |")
    w("")
    w("Files in each `<name>/`:")
    w("")
    w("- `hf/`: the transformers checkpoint, bf16 (except `linear_attn.A_log`, f32 as in the real")
    w("  checkpoint), saved with `save_pretrained(max_shard_size=\"512KB\", save_original_format=False)`, so it is")
    w("  sharded (`model-0000i-of-0000n.safetensors` + `model.safetensors.index.json`) and keeps the fused")
    w("  experts layout `mlp.experts.gate_up_proj` [E, 2I, H] (rows 0..I-1 gate, I..2I-1 up) and")
    w("  `mlp.experts.down_proj` [E, H, I]. Keys: `model.language_model.*`, `lm_head.weight`, `model.visual.*`")
    w("  (must be skipped), and in `tiny-a` also `mtp.*` (must be skipped). Norms are zero-centred (1+w),")
    w("  except `linear_attn.norm.weight` (plain weight, ≈1). `conv1d.weight` is [C, 1, K]. Also")
    w("  `config.json` (`layer_types` and `full_attention_interval` both present and consistent),")
    w("  `generation_config.json`, and a small byte-level BPE tokenizer (`tokenizer.json`, fewer entries than")
    w("  `vocab_size`, like the real padded vocabulary; special tokens `<|endoftext|>`, `<|im_start|>`,")
    w("  `<|im_end|>`, `<think>`, `</think>` follow the BPE entries).")
    w("- `mlx/`: output of mlx-lm's own converter on `hf/`:")
    w("  `mlx_lm.convert.convert(hf_path, mlx_path, quantize=True, q_group_size=G, q_bits=B)`")
    w("  (equivalently `python -m mlx_lm convert --hf-path <name>/hf --mlx-path <name>/mlx -q --q-group-size G --q-bits B`).")
    w("  `config.json` carries the top-level `quantization` block (and an identical `quantization_config`),")
    w("  with per-path 8-bit g64 overrides for every `mlp.gate` and `mlp.shared_expert_gate` (mlx-lm's")
    w("  `quant_predicate`). Keys are `language_model.model.*` / `language_model.lm_head.*`; experts are split")
    w("  into `switch_mlp.{gate,up,down}_proj`; norms already have +1 folded in; conv1d is [C, K, 1];")
    w("  `A_log` stays f32; Linears whose input dim is not a multiple of the group size stay unquantised bf16.")
    w("  These are the bytes `lily` must reproduce when it quantises `hf/` at load with the same settings.")
    w("- `tokens.json`: the 193-token prompt (JSON array). The first 16 ids are uniform random (seeded); the")
    w("  other 177 are sampled at temperature 1 from the float32 HF model (seeded), so the perplexity is far")
    w("  below the vocabulary size while the prompt still starts with surprising tokens.")
    w("- `ref_mlx.json`: mlx-lm float32 reference on `mlx/` (every floating parameter, including")
    w("  quantisation scales/biases, cast to f32; one forward call over all 193 tokens, no cache):")
    w("  `{\"positions\": 192, \"perplexity\": P, \"token_logprobs\": [192], \"argmax\": [192]}` where")
    w("  `token_logprobs[i]` = log p(tokens[i+1] | tokens[0..=i]) from a float32 log_softmax of the logits at")
    w("  position i, `argmax[i]` = argmax of those logits, P = exp(-mean(token_logprobs)).")
    w("- `ref_mlx_hidden.safetensors`: float32 `hidden.{l}` [193, hidden] = residual stream after decoder")
    w("  layer l (before the final norm), `final` [193, hidden] = after the final norm, `logits` [193, vocab].")
    w("- `ref_hf.json`, `ref_hf_hidden.safetensors`: the same from transformers on `hf/`, loaded straight into")
    w("  float32 (bf16→f32 is exact), eager attention, eager experts loop, no grad, no cache (GDN runs the")
    w("  chunked torch path). Per-layer states come from forward hooks on the decoder layers and the final")
    w("  norm.")
    w("")
    w("`tools/mlx_score.py --model DIR --tokens FILE` and `tools/hf_score.py --model DIR --tokens FILE` print")
    w("the same JSON for any MLX-format / transformers checkpoint (`--hidden-out F` also writes the hidden")
    w("states), e.g. to cross-check `lily score` on checkpoints written by the Rust side.")
    w("")
    w("`manifest.json` lists the configs, quantisation overrides, unquantised weights, special-token ids and")
    w("the agreement statistics below.")
    w("")
    w("## MLX (quantised) vs transformers (bf16) agreement")
    w("")
    w("Both references are float32 computations; they differ only by the MLX quantisation (and float32")
    w("rounding / MoE routing near-ties), so they are close but not identical.")
    w("")
    w("| fixture | PPL MLX | PPL HF | rel diff | top-1 agreement | mean abs Δlogprob | max abs Δlogprob | HF mean top-1 prob | HF median top-1 margin (nats) | final-norm rel RMS diff |")
    w("|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        s = r["stats"]
        w(f"| `{r['name']}` | {s['ppl_mlx']:.3f} | {s['ppl_hf']:.3f} | {100 * s['ppl_rel_diff']:.2f}% | "
          f"{100 * s['top1_agreement']:.1f}% | {s['mean_abs_logprob_diff']:.4f} | {s['max_abs_logprob_diff']:.4f} | "
          f"{s['hf_mean_top1_prob']:.3f} (uniform {s['uniform_prob']:.4f}) | {s['hf_median_top1_margin']:.2f} | "
          f"{s['final_hidden_rel_rms_diff']:.4f} |")
    w("")
    w("Semantic cross-check (not stored): converting `hf/` with mlx-lm *without* quantisation and restoring")
    w("the norm weights to 1+w in float32 (mlx-lm folds them as bf16(1+w), see below), the MLX and")
    w("transformers float32 forwards agree to float32 rounding:")
    w("")
    w("| fixture | per-token rel diff of hidden states, median / worst | max abs Δlogit |")
    w("|---|---|---|")
    for r in results:
        s = r["stats"]
        w(f"| `{r['name']}` | {s['unquantised_median_rel_diff']:.1e} / {s['unquantised_worst_rel_diff']:.1e} | "
          f"{s['unquantised_max_abs_logit_diff']:.1e} |")
    w("")
    w("## Notes for loaders and comparisons")
    w("")
    w("- mlx-lm folds the zero-centred norms as `bf16(w_bf16 + 1.0)` (the add happens on the bf16 array, so")
    w("  the sum is rounded to bf16), for `input_layernorm`, `post_attention_layernorm`, `model.norm`,")
    w("  `q_norm`, `k_norm`. To reproduce `mlx/` bytes, do the same. `linear_attn.norm.weight` is copied")
    w("  unchanged. This bf16 rounding alone moves the hidden states by ~0.1–1 % (RMS) relative to")
    w("  transformers.")
    w("- The per-path overrides in `quantization` are `{\"group_size\": 64, \"bits\": 8}` without a `mode` key;")
    w("  the top-level entry has `\"mode\": \"affine\"`. `quantization_config` is an identical copy.")
    w("- mlx-lm rewrites `text_config.rope_parameters.rope_type` to `type` in the saved `mlx/config.json` and")
    w("  drops `vision_config`; `hf/config.json` has `rope_type`. Accept both spellings.")
    w("- The router 8-bit override is applied after the global divisibility test: a Linear is only")
    w("  quantised if its input dim is a multiple of the *global* group size, then the predicate may")
    w("  override bits/group size.")
    w("- `hf/` experts are fused (`gate_up_proj`/`down_proj`, no `.weight` suffix). transformers 5.x's")
    w("  default `save_pretrained` would instead write per-expert `experts.{e}.{gate,up,down}_proj.weight`")
    w("  (its \"original format\"); a robust loader may accept both.")
    w("- transformers' `output_hidden_states` tuple is `[embeddings, after layer 0, …, after layer L-2,")
    w("  after the final norm]` in this version: the last entry is normed and \"after layer L-1\" is not")
    w("  in it. The `hidden.{L-1}` tensors here come from hooks.")
    w("- Logits are not peaked by accident: each `lm_head` row is partly aligned with the embedding of a")
    w("  random \"predecessor\" token, routers have large logits (few top-k near-ties), and the output")
    w("  projections are scaled down (0.4/√fan_in), so argmax and routing are stable under small numeric")
    w("  differences; see `randomise()` in the generator.")
    w("")
    w("## Files")
    w("")
    w("| file | bytes |")
    w("|---|---|")
    for p, s in rows:
        if p == "README.md":
            continue
        w(f"| `{p}` | {s} |")
    w("")
    w(f"Total (excluding this README): {total} bytes.")
    w("")
    (root / "README.md").write_text("\n".join(L))


def main():
    ap = argparse.ArgumentParser(description="generate tests/fixtures (tiny qwen3_5_moe references)")
    ap.add_argument("--out", default=str(REPO / "tests" / "fixtures"))
    ap.add_argument("--only", nargs="*", help="only these fixture names (README/manifest are then not rewritten)")
    args = ap.parse_args()
    root = Path(args.out)
    root.mkdir(parents=True, exist_ok=True)
    mx.set_default_device(mx.cpu)
    # One thread: float reductions (and hence the sampled prompt) do not depend on the core count.
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)

    results = []
    for cfg in CONFIGS:
        if args.only and cfg["name"] not in args.only:
            continue
        results.append(make_one(cfg, root))
    if not args.only:
        write_readme(root, results, sys.argv)
        rows = file_table(root)
        print(f"total size of {root}: {sum(s for _, s in rows)} bytes in {len(rows)} files")


if __name__ == "__main__":
    main()
