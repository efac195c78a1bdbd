#!/usr/bin/env python3
"""The chunked gated delta rule's rounding points, emulated in float64 (numpy; one head, Dk = Dv = 128,
64-token chunks), against the exact recurrence: which operand precisions a prefill kernel may take
before it is built. Forms (--forms, comma-separated; all by default):
  mlx_bf16  q, k, v rounded to bf16, then the f32 recurrence (MLX-LM's bf16 run: the issue's yardstick)
  today     the default bf16 pair (kernels/gdn_chunked.cu: gdn_chunk_prep_tc1_bf, gdn_chunk_state_bf32s3):
            the prep's products on 1xTF32 operands (cvt.rna), the f32 solve, W, P, Q~, K~ stored in bf16
            and U in f32; the pass on bf16 operands (S^T, V'^T, W, Q~, K~, P), f32 sums and state
  bf16prep  the prep on bf16 operands: q, k, v staged in bf16, K K^T, Q K^T, W = bf16(X diag(s)) K and
            U = bf16(X diag(beta)) V with f32 sums; then as `today`
  f16prep   the same on f16 operands (11 significant bits, as tf32's: the same error as `today`)
Printed: rms and max of (out - exact), relative to the exact output's rms and max, a row per case.
docs/PERF.md (twenty-first and twenty-eighth sessions) has its tables; python3 tools/gdn_chunked_numerics.py"""
import argparse
import warnings

import numpy as np

warnings.filterwarnings("ignore")  # exp of the unused upper triangle's decays overflows; masked out


def bf16(x):
    u = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000  # to nearest, ties to even
    return u.astype(np.uint32).view(np.float32).astype(np.float64)


def tf32(x):
    u = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x1000) & 0xFFFFE000  # cvt.rna: to nearest, ties away from zero
    return u.astype(np.uint32).view(np.float32).astype(np.float64)


def f16(x):
    return np.asarray(x, dtype=np.float32).astype(np.float16).astype(np.float64)


def f32(x):
    return np.asarray(x, dtype=np.float32).astype(np.float64)


def exact(q, k, v, g, beta, s0):
    s = s0.copy()
    out = np.zeros((len(q), v.shape[1]))
    for t in range(len(q)):
        s = np.exp(g[t]) * s
        s = s + beta[t] * np.outer(k[t], v[t] - s.T @ k[t])
        out[t] = s.T @ q[t]
    return out


def recurrent_f32(q, k, v, g, beta, s0):
    s = f32(s0)
    out = np.zeros((len(q), v.shape[1]))
    for t in range(len(q)):
        s = f32(np.exp(f32(g[t])) * s)
        pred = f32(s.T @ k[t])
        s = f32(s + f32(beta[t] * np.outer(k[t], f32(v[t] - pred))))
        out[t] = f32(s.T @ q[t])
    return out


def chunked(q, k, v, g, beta, s0, form):
    """The chunked form with `form`'s prep operands; the stores and the pass as the default bf16 pair."""
    op = {"today": tf32, "bf16prep": bf16, "f16prep": f16}[form]
    if form != "today":  # staged in the operand format once
        q, k, v = op(q), op(k), op(v)
    t_len, dv = q.shape[0], v.shape[1]
    s = f32(s0)
    out = np.zeros((t_len, dv))
    for c0 in range(0, t_len, 64):
        n = min(64, t_len - c0)
        qc, kc, vc, be = q[c0:c0 + n], k[c0:c0 + n], v[c0:c0 + n], f32(beta[c0:c0 + n])
        gam = np.cumsum(g[c0:c0 + n].astype(np.float64))  # f64 prefix sum, as the prep
        eg, ek = f32(np.exp(f32(gam))), f32(np.exp(f32(gam[-1] - gam)))
        dec = f32(np.exp(f32(gam[:, None] - gam[None, :])))
        kk, qk = f32(op(kc) @ op(kc).T), f32(op(qc) @ op(kc).T)
        a = np.tril(f32(kk * f32(be[:, None] * dec)), -1)
        p = bf16(np.tril(f32(qk * dec)))
        x = f32(np.linalg.inv(np.eye(n) + a))  # the f32 solve
        w = bf16(f32(op(x * f32(be * eg)[None, :]) @ op(kc)))
        u = f32(op(x * be[None, :]) @ op(vc))
        qt, kt = bf16(eg[:, None] * qc), bf16(ek[:, None] * kc)
        sb = bf16(s)
        vb = bf16(f32(u - f32(w @ sb)))
        out[c0:c0 + n] = f32(f32(qt @ sb) + f32(p @ vb))
        s = f32(f32(np.exp(f32(gam[-1])) * s) + f32(kt.T @ vb))
    return out


def inputs(rng, t_len, decay, dk=128, dv=128):
    """q, k L2-normed (q by 1/sqrt(Dk) too), v normal, g = decay (or U(-0.2, 0) for 'mixed'), beta =
    sigmoid(N(0, 2)), a random initial state."""
    q, k, v = rng.standard_normal((t_len, dk)), rng.standard_normal((t_len, dk)), rng.standard_normal((t_len, dv))
    q /= np.linalg.norm(q, axis=1, keepdims=True) * np.sqrt(dk)
    k /= np.linalg.norm(k, axis=1, keepdims=True)
    g = -rng.uniform(0.0, 0.2, t_len) if decay == "mixed" else np.full(t_len, float(decay))
    beta = 1 / (1 + np.exp(-2 * rng.standard_normal(t_len)))
    return f32(q), f32(k), f32(v), f32(g), f32(beta), f32(0.5 * rng.standard_normal((dk, dv)))


def rel_err(o, ref):
    d = o - ref
    return np.sqrt(np.mean(d * d)) / np.sqrt(np.mean(ref * ref)), np.abs(d).max() / np.abs(ref).max()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--forms", default="mlx_bf16,today,bf16prep,f16prep")
    args = ap.parse_args()
    forms = args.forms.split(",")
    print("| T, decay (seed) | " + " | ".join(f"{f} rms / max" for f in forms) + " |")
    print("|---|" + "---|" * len(forms))
    for t_len, decay, seed in [(2048, "mixed", 0), (2048, "mixed", 1), (1000, -1e-3, 2), (1000, -5.0, 3)]:
        q, k, v, g, beta, s0 = inputs(np.random.default_rng(seed), t_len, decay)
        ref = exact(q, k, v, g, beta, s0)
        row = []
        for f in forms:
            o = recurrent_f32(bf16(q), bf16(k), bf16(v), g, beta, s0) if f == "mlx_bf16" else chunked(q, k, v, g, beta, s0, f)
            row.append(rel_err(o, ref))
        print(f"| {t_len}, g {decay} ({seed}) | " + " | ".join(f"{a:.2e} / {b:.2e}" for a, b in row) + " |", flush=True)


if __name__ == "__main__":
    main()
