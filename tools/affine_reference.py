#!/usr/bin/env python3
"""Reference outputs of MLX's affine quantiser, for lily's bit-exactness test.

Builds one adversarial bf16 matrix (rows of random normals at many scales, constant and all-zero
rows, single huge outliers, rows whose minimum has the larger magnitude, exact rounding ties, tiny
values around MLX's eps = 1e-7, subnormals, values near the bf16 maximum) and saves, for bits 4 and 8
and group sizes 32/64/128, what `mx.quantize(w, group_size, bits)` returns on the CPU.

Output (safetensors, < 1 MB): `w` bf16 [R, C]; for each case `b{bits}_g{gs}.{weight,scales,biases}`
(u32 [R, C*bits/32], bf16 [R, C/gs], bf16 [R, C/gs]); metadata records the mlx version.

    python3 tools/affine_reference.py [OUT]   (default crates/lily-model/tests/data/affine_ref.safetensors)
"""
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np

C = 256  # columns: a multiple of every group size


def bf16_round(a):
    """float32 numpy -> values exactly representable in bf16 (round to nearest even)."""
    return np.array(mx.array(a.astype(np.float32)).astype(mx.bfloat16).astype(mx.float32))


def build(rng):
    rows = []

    def add(r):
        r = np.asarray(r, dtype=np.float32)
        assert r.shape == (C,)
        rows.append(r)

    # Random normals across scales, and shifted (all-positive / all-negative) variants.
    for e in range(-9, 5):
        add(rng.standard_normal(C) * 10.0**e)
    for e in (-3, 0, 2):
        add(rng.standard_normal(C) * 10.0**e + 3 * 10.0**e)
        add(rng.standard_normal(C) * 10.0**e - 3 * 10.0**e)
        add(np.abs(rng.standard_normal(C)) * 10.0**e)
        add(-np.abs(rng.standard_normal(C)) * 10.0**e)
    # Uniform, a typical weight scale.
    for _ in range(6):
        add(rng.uniform(-0.05, 0.05, C))
    # Constant rows, including zero and negative zero.
    for v in (0.0, -0.0, 1.0, -1.0, 0.02, -3.5e-3, 7.0, 1e-8, -1e-8, 65504.0, 1e30):
        add(np.full(C, v))
    # One huge outlier in an otherwise normal row (and the negative of it), anywhere in a group.
    for pos, mag in ((0, 1e3), (37, -1e3), (64, 5e4), (127, -7.0), (200, 1e6)):
        r = rng.standard_normal(C) * 0.01
        r[pos] = mag
        add(r)
    # Minimum of larger magnitude than the maximum, and exact |min| == |max| ties.
    for _ in range(3):
        r = rng.uniform(-1.0, 0.3, C)
        add(r)
    r = rng.uniform(-1, 1, C)
    for g in range(0, C, 32):
        r[g], r[g + 1] = 0.75, -0.75
    add(r)
    r = rng.uniform(-1, 1, C)
    for g in range(0, C, 32):
        r[g], r[g + 1] = -2.0, 2.0
    add(r)
    # Exact rounding ties. A group spanning [0, 15] (4 bits) quantises with scale -1 and bias 15,
    # so k + 0.5 lands exactly between two codes; same idea for [0, 255] with 8 bits (halves below 128
    # are exact in bf16) and for power-of-two rescalings of both.
    for mult in (1.0, 2.0**-6, 2.0**10, -1.0):
        r = np.zeros(C)
        for g in range(0, C, 32):
            r[g : g + 32] = np.concatenate([[0.0, 15.0], rng.integers(0, 15, 30) + 0.5])
        add(r * mult)
        r = np.zeros(C)
        for g in range(0, C, 32):
            r[g : g + 32] = np.concatenate([[0.0, 255.0], rng.integers(0, 127, 30) + 0.5])
        add(r * mult)
    # Ties that only appear after the q0 adjustment: edge/scale near k + 0.5.
    for lo in (-1.0, -0.25, -7.0):
        r = rng.uniform(lo, 1.0, C)
        for g in range(0, C, 32):
            r[g], r[g + 1] = lo, 1.0
        add(r)
    # Tiny values around eps = 1e-7: the range/n_bins clamp, and q0 == 0 (|edge| < eps / 2).
    for s in (1e-6, 3e-7, 1e-7, 4e-8, 1e-8, 1e-12):
        add(rng.standard_normal(C) * s)
        add(np.abs(rng.standard_normal(C)) * s)
    # bf16 subnormals (< 1.18e-38) and values near the bf16 maximum (range overflowing to inf).
    add(rng.standard_normal(C) * 1e-39)
    add(rng.standard_normal(C) * 1e38)
    r = rng.standard_normal(C)
    r[::32] = 3.3e38
    r[1::32] = -3.3e38
    add(r)
    # A sparse row (mostly zeros) and a row of a few distinct values.
    r = np.zeros(C)
    r[rng.integers(0, C, 10)] = rng.standard_normal(10)
    add(r)
    add(rng.choice([-0.5, 0.0, 0.25, 1.0], C))
    return bf16_round(np.stack(rows))


def main():
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "crates/lily-model/tests/data/affine_ref.safetensors")
    rng = np.random.default_rng(20260101)
    w32 = build(rng)
    w = mx.array(w32).astype(mx.bfloat16)
    tensors = {"w": w}
    with mx.stream(mx.cpu):
        for bits in (4, 8):
            for gs in (32, 64, 128):
                q, s, b = mx.quantize(w, group_size=gs, bits=bits)
                mx.eval(q, s, b)
                assert q.dtype == mx.uint32 and s.dtype == mx.bfloat16 and b.dtype == mx.bfloat16
                tensors[f"b{bits}_g{gs}.weight"] = q
                tensors[f"b{bits}_g{gs}.scales"] = s
                tensors[f"b{bits}_g{gs}.biases"] = b
    out.parent.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out), tensors, metadata={"mlx_version": mx.__version__, "rows": str(w.shape[0])})
    print(f"{out}: {w.shape[0]} rows x {C}, mlx {mx.__version__}, {out.stat().st_size} bytes")


if __name__ == "__main__":
    main()
