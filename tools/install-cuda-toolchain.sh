#!/usr/bin/env bash
# Installs nvcc 13.0.88 (the GPU machine's CUDA version) from PyPI into ./.cuda-toolchain, so the
# `cuda` feature builds on a machine without CUDA. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
dest=.cuda-toolchain
if [ -x "$dest/nvidia/cu13/bin/nvcc" ]; then
  "$dest/nvidia/cu13/bin/nvcc" --version | tail -n 2
  exit 0
fi
python3 -m pip install --quiet --disable-pip-version-check --target "$dest" \
  nvidia-cuda-nvcc==13.0.88 nvidia-cuda-crt==13.0.88 nvidia-nvvm==13.0.88 \
  nvidia-cuda-cccl==13.0.85 nvidia-cuda-runtime==13.0.96
"$dest/nvidia/cu13/bin/nvcc" --version | tail -n 2
