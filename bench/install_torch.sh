#!/usr/bin/env bash
# Installs the PyTorch baseline of `dreamddp bench` into a private virtual environment
# outside the repository (idempotent: exits at once when it is already there and imports).
#
# Only PyPI is reachable, and PyPI's Linux x86_64 `torch` wheel is the CUDA build. Its
# Python extension links libtorch_cuda.so, whose NEEDED list names cudart, cupti, cublas,
# cublasLt, cudnn, nvrtc, cufft, curand, cusparse (+ nvJitLink), cusparseLt, cufile, nccl
# and nvshmem, so `import torch` fails without those shared libraries even for CPU-only
# work. This script therefore installs, with --no-deps:
#   * torch itself,
#   * exactly the nvidia-* runtime wheels whose libraries the dynamic linker must find,
#   * the pure-Python packages `import torch` needs, and `safetensors` (the checkpoint test
#     loads dreamddp's checkpoints with `safetensors.torch`).
# It skips what the full dependency list adds on top (triton, cuda-bindings, cuda-toolkit,
# cusolver, nvtx, setuptools), none of which CPU training touches.
#
# Environment:
#   DREAMDDP_TORCH_DIR  where the venv lives (default: ${XDG_CACHE_HOME:-~/.cache}/dreamddp/torch)
#   PYTHON              interpreter to build the venv from (default: python3)
#
# The last line printed on stdout is `python=<path of the venv's interpreter>`.
set -euo pipefail

TORCH_VERSION=2.13.0
# Pins resolved by pip for torch==2.13.0 (the versions its metadata asks for).
NVIDIA_WHEELS=(
    nvidia-cuda-runtime==13.0.96
    nvidia-cuda-cupti==13.0.85
    nvidia-cublas==13.1.1.3
    nvidia-cuda-nvrtc==13.0.88
    nvidia-cufft==12.0.0.61
    nvidia-cufile==1.15.1.6
    nvidia-curand==10.4.0.35
    nvidia-cusparse==12.6.3.3
    nvidia-nvjitlink==13.5.37
    nvidia-cudnn-cu13==9.20.0.48
    nvidia-cusparselt-cu13==0.8.1
    nvidia-nccl-cu13==2.29.7
    nvidia-nvshmem-cu13==3.4.5
)
PURE_WHEELS=(
    typing_extensions==4.16.0
    filelock==4.3.1
    fsspec==2026.9.0
    jinja2==3.1.6
    markupsafe==3.0.4
    networkx==3.6.1
    sympy==1.14.0
    mpmath==1.3.0
    safetensors==0.8.0
)

ROOT=${DREAMDDP_TORCH_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/dreamddp/torch}
VENV=$ROOT/venv-$TORCH_VERSION
VPY=$VENV/bin/python
STAMP=$VENV/.dreamddp-installed
BASE_PY=${PYTHON:-python3}

log() { echo "[install_torch] $*" >&2; }

import_check() {
    # Hide any GPU so the check only proves the CPU path works.
    CUDA_VISIBLE_DEVICES="" "$VPY" -c \
        'import torch, safetensors.torch; x = torch.ones(2, 2); assert float((x @ x).sum()) == 8.0; print(torch.__version__)'
}

if [[ -f $STAMP ]] && version=$(import_check 2>/dev/null); then
    log "torch $version already installed in $VENV"
    echo "python=$VPY"
    exit 0
fi

if ! command -v "$BASE_PY" >/dev/null 2>&1; then
    log "error: no Python interpreter '$BASE_PY' on PATH (set PYTHON=...)"
    exit 2
fi
if ! "$BASE_PY" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else 1)'; then
    log "error: torch $TORCH_VERSION needs Python >= 3.10, $BASE_PY is $("$BASE_PY" -V 2>&1)"
    exit 2
fi

start=$(date +%s)
mkdir -p "$ROOT"
if [[ ! -x $VPY ]]; then
    log "creating venv $VENV"
    "$BASE_PY" -m venv "$VENV"
fi
# --no-cache-dir: the wheels are ~2.3 GB (3.7 GB installed); keeping a second copy in pip's cache helps no one.
PIP=("$VPY" -m pip install --no-deps --no-cache-dir --disable-pip-version-check --progress-bar off)
log "installing pure-Python dependencies: ${PURE_WHEELS[*]}"
"${PIP[@]}" "${PURE_WHEELS[@]}" >&2
log "installing the CUDA runtime libraries libtorch_cuda.so links against: ${NVIDIA_WHEELS[*]}"
"${PIP[@]}" "${NVIDIA_WHEELS[@]}" >&2
log "installing torch==$TORCH_VERSION (no dependencies)"
"${PIP[@]}" "torch==$TORCH_VERSION" >&2

if ! version=$(import_check); then
    log "error: torch was installed in $VENV but 'import torch' fails (see above)"
    exit 3
fi
touch "$STAMP"
log "torch $version ready in $VENV ($(du -sh "$VENV" | cut -f1), $(($(date +%s) - start)) s)"
echo "python=$VPY"
