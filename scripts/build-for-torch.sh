#!/usr/bin/env bash
# Builds a dreamddp binary (--features tch,nccl by default) for a machine whose PyTorch is not
# the 2.13 that the workspace's tch 0.26 binds: GPU machines often have an older torch and no
# Rust toolchain. The binary is built here, against PyPI's wheel of that torch version, and
# carried there; at run time it uses that machine's own torch (LD_LIBRARY_PATH=<torch>/lib).
#
#   scripts/build-for-torch.sh 2.11.0            # prints the stripped binary's path last
#   FEATURES=tch scripts/build-for-torch.sh 2.10.0
#
# How: a copy of this checkout (tracked files) under $WORK/src with `tch` pinned to the release
# for that torch (2.13 → 0.26.0, 2.11 → 0.24.0, 2.10 → 0.23.0), LIBTORCH = the wheel unpacked,
# cargo build --release, strip. This is how the H200 run in docs/gpu.md was made (torch 2.11).
#
# Environment: WORK (default ~/.cache/dreamddp/torch-<version>), FEATURES (default tch,nccl),
# PYTHON (default python3; only downloads the wheel).
set -euo pipefail
V=${1:?usage: scripts/build-for-torch.sh TORCH_VERSION (2.13.0, 2.11.0 or 2.10.0)}
case "$V" in
    2.13.*) TCH=0.26.0 ;;
    2.11.*) TCH=0.24.0 ;;
    2.10.*) TCH=0.23.0 ;;
    *) echo "build-for-torch: no known tch release for torch $V (known: 2.13, 2.11, 2.10)" >&2; exit 2 ;;
esac
ROOT=$(cd "$(dirname "$0")/.." && pwd)
WORK=${WORK:-$HOME/.cache/dreamddp/torch-$V}
FEATURES=${FEATURES:-tch,nccl}
PY=${PYTHON:-python3}
log() { echo "[build-for-torch] $*" >&2; }
mkdir -p "$WORK"
if [ ! -d "$WORK/site/torch/lib" ]; then
    log "downloading torch==$V from PyPI (the C++ libraries and headers are what is used)"
    "$PY" -m pip download -q --no-deps "torch==$V" -d "$WORK/wheel"
    mkdir -p "$WORK/site"
    (cd "$WORK/site" && unzip -q -o "$WORK"/wheel/torch-"$V"-*.whl 'torch/lib/*' 'torch/include/*' 'torch/share/*')
fi
log "copying the checkout to $WORK/src with tch = $TCH"
rm -rf "$WORK/src"
mkdir -p "$WORK/src"
(cd "$ROOT" && git ls-files -z --cached --others --exclude-standard | xargs -0 cp --parents -t "$WORK/src")
sed -i "s/^tch = { version = \"[^\"]*\"/tch = { version = \"=$TCH\"/" "$WORK/src/tch-backend/Cargo.toml"
cd "$WORK/src"
cargo update -q -p tch --precise "$TCH"
log "building --features $FEATURES against $WORK/site/torch"
LIBTORCH="$WORK/site/torch" CARGO_TARGET_DIR="$WORK/target" cargo build --release --features "$FEATURES" >&2
cp "$WORK/target/release/dreamddp" "$WORK/dreamddp"
strip "$WORK/dreamddp"
log "done: run it with LD_LIBRARY_PATH=<that machine's torch>/lib"
echo "$WORK/dreamddp"
