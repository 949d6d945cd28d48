#!/usr/bin/env bash
# The prepared GPU check of issue 10: one run on a machine with NVIDIA GPUs, a few minutes,
# one summary table. It records what the machine is, builds (or takes) a dreamddp binary with
# the tch and nccl features, and runs:
#   1. the NCCL probe through `train --collective nccl` (the NCCL all-reduce itself does not
#      exist yet, so the best outcome today is the probe succeeding and `train` saying so);
#   2. tch CUDA training of `mlp` and `resnet20`, each beside the same run on the CPU
#      (accuracy difference; the goal is within 0.3 points);
#   3. the step time of ssgd, wfbp, localsgd and dreamddp on the GPU (mlp), side by side.
# Without a GPU (no nvidia-smi, or it lists none) the GPU rows run on the CPU instead and the
# table says so: that is how this script's own logic is tested on a CPU machine.
#
# Environment (all optional):
#   DREAMDDP_BIN   a dreamddp binary built with --features tch,nccl (skips the build)
#   LIBTORCH       a torch installation (the folder of torch/__init__.py); otherwise the
#                  system python3's torch, then bench/install_torch.sh (needs PyPI)
#   STEPS          training steps of the accuracy runs (default 600; resnet20 runs STEPS/3)
#   TIMING_STEPS   steps of each strategy-timing run (default 200)
#   DATASET        default auto (MNIST when found, else the embedded digits)
#   OUT            output folder (default gpu-check-out)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-check-out}
STEPS=${STEPS:-600}
TIMING_STEPS=${TIMING_STEPS:-200}
DATASET=${DATASET:-auto}
mkdir -p "$OUT"
SUMMARY=$OUT/summary.tsv
printf 'check\tresult\tdetail\n' > "$SUMMARY"
row() { printf '%s\t%s\t%s\n' "$1" "$2" "$3" >> "$SUMMARY"; echo "[gpu-check] $1: $2 ${3:+($3)}" >&2; }
finish() {
    echo
    column -t -s $'\t' "$SUMMARY" 2>/dev/null || cat "$SUMMARY"
    echo "(table: $SUMMARY; logs and run summaries: $OUT/)"
    exit "${1:-0}"
}

# 0. The machine.
GPUS=0
if command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$OUT/gpus.txt" 2>&1 || true
    GPUS=$(grep -c . "$OUT/gpus.txt" 2>/dev/null || echo 0)
    grep -qi "failed\|error" "$OUT/gpus.txt" && GPUS=0
fi
if [ "$GPUS" -gt 0 ]; then
    DEVICE=cuda:0
    row machine "$GPUS GPU(s)" "$(head -1 "$OUT/gpus.txt")"
else
    DEVICE=cpu
    row machine "no GPU" "the GPU rows below ran on the CPU: they test this script, not a GPU"
fi

# 1. libtorch and the binary.
if [ -z "${LIBTORCH:-}" ]; then
    if python3 -c 'import torch' >/dev/null 2>&1; then
        LIBTORCH=$(python3 -c 'import os, torch; print(os.path.dirname(torch.__file__))')
    elif PY=$(bash bench/install_torch.sh 2>"$OUT/install_torch.log" | sed -n 's/^python=//p') && [ -x "$PY" ]; then
        LIBTORCH=$("$PY" -c 'import os, torch; print(os.path.dirname(torch.__file__))')
    fi
fi
if [ -z "${LIBTORCH:-}" ] || [ ! -d "$LIBTORCH/lib" ]; then
    row libtorch "missing" "no torch for python3 and bench/install_torch.sh failed (see $OUT/install_torch.log); set LIBTORCH"
    finish 1
fi
export LIBTORCH
export LD_LIBRARY_PATH="$LIBTORCH/lib:${LD_LIBRARY_PATH:-}"
row libtorch ok "$LIBTORCH"
if [ -z "${DREAMDDP_BIN:-}" ]; then
    export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$HOME/.cache/dreamddp/target}
    if ! command -v cargo >/dev/null 2>&1; then
        row build "no cargo" "install Rust, or pass DREAMDDP_BIN"
        finish 1
    fi
    if ! cargo build --release --features tch,nccl > "$OUT/build.log" 2>&1; then
        row build failed "see $OUT/build.log"
        finish 1
    fi
    DREAMDDP_BIN=$CARGO_TARGET_DIR/release/dreamddp
fi
row build ok "$DREAMDDP_BIN"
BIN=$DREAMDDP_BIN

# 2. The NCCL probe (`--collective nccl` stops either way today; what it says is the result).
"$BIN" train --quiet --collective nccl --backend tch --device "$DEVICE" --steps 1 --eval-every 0 \
    > "$OUT/probe.log" 2>&1
probe=$(grep -m1 -i "error\|collective" "$OUT/probe.log" | cut -c1-200)
if grep -q "no NCCL all-reduce" "$OUT/probe.log"; then
    row nccl-probe "NCCL usable" "$probe"
else
    row nccl-probe "NCCL not usable" "$probe"
fi

# 3. Accuracy: the GPU run beside the same run on the CPU.
metric() { python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); a=d.get("test_accuracy"); print("%.2f" % (a*100) if a is not None else "%.3f" % d["val_loss"])' "$1" 2>/dev/null; }
step_ms() { python3 -c 'import json,sys; print("%.2f" % json.load(open(sys.argv[1]))["mean_step_ms"])' "$1" 2>/dev/null; }
for model in mlp resnet20; do
    steps=$STEPS
    [ "$model" = resnet20 ] && steps=$((STEPS / 3))
    for dev in "$DEVICE" cpu; do
        tag=$model-${dev//:/}
        [ "$dev" = cpu ] && [ "$DEVICE" = cpu ] && [ -f "$OUT/$model-cpu.json" ] && continue
        "$BIN" train --quiet --backend tch --device "$dev" --model "$model" --dataset "$DATASET" \
            --strategy ssgd --steps "$steps" --out "$OUT/$tag.json" > "$OUT/$tag.log" 2>&1 ||
            row "$tag" failed "see $OUT/$tag.log"
    done
    gpu=$(metric "$OUT/$model-${DEVICE//:/}.json"); cpu=$(metric "$OUT/$model-cpu.json")
    if [ -n "$gpu" ] && [ -n "$cpu" ]; then
        diff=$(python3 -c "print('%.2f' % abs($gpu - $cpu))")
        row "accuracy $model ($steps steps)" "$DEVICE $gpu % vs cpu $cpu %" "difference $diff points; goal <= 0.3"
    fi
done

# 4. Step time of the four strategies on the GPU.
for s in ssgd wfbp localsgd dreamddp; do
    "$BIN" train --quiet --backend tch --device "$DEVICE" --model mlp --dataset "$DATASET" \
        --strategy "$s" --steps "$TIMING_STEPS" --eval-every 0 --out "$OUT/time-$s.json" \
        > "$OUT/time-$s.log" 2>&1 || { row "step $s" failed "see $OUT/time-$s.log"; continue; }
    row "step time $s (mlp, $DEVICE)" "$(step_ms "$OUT/time-$s.json") ms" "$TIMING_STEPS steps"
done
row overlap "not measured" "needs the NCCL all-reduce (CUDA events around each bucket), not built yet"
finish 0
