#!/usr/bin/env bash
# Installs CUDA's compiler (nvcc 13.0, its headers and NVVM) from PyPI's wheels into .cuda/ at the
# repository's root — no system CUDA, no GPU needed — and prints the environment that
# `cargo build --features cuda` reads. Usage:
#   env="$(tools/cuda/setup.sh)" && eval "$env" && cargo check -p graphpp --features cuda
# 13.0 matches the driver of the GPU machines graphpp is checked on (driver 580, CUDA 13.0): PTX
# from a newer nvcc would not load there. CUDA_COMPUTE_CAP=90 builds candle's kernels for Hopper
# (H100, H200); set it before running this script for another GPU.
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
dest="$root/.cuda"
# A marker written after the whole install: a half-finished one is redone.
if [ ! -e "$dest/.complete" ]; then
    rm -rf "$dest"
    # --target installs beside, not into, the interpreter (PEP 668's mark does not apply).
    PIP_BREAK_SYSTEM_PACKAGES=1 python3 -m pip install --quiet --disable-pip-version-check --no-deps --target "$dest" \
        nvidia-cuda-nvcc==13.0.88 nvidia-cuda-runtime==13.0.96 nvidia-cuda-crt==13.0.88 \
        nvidia-cuda-cccl==13.0.85 nvidia-nvvm==13.0.88 >&2
    touch "$dest/.complete"
fi
cuda="$dest/nvidia/cu13"
"$cuda/bin/nvcc" --version >&2
echo "export PATH=\"$cuda/bin:\$PATH\" CUDA_HOME=\"$cuda\" CUDA_PATH=\"$cuda\" CUDA_COMPUTE_CAP=\"${CUDA_COMPUTE_CAP:-90}\""
