#!/usr/bin/env bash
# The prepared GPU check of issue 10: one run on a machine with NVIDIA GPUs, a few minutes,
# one summary table. It records what the machine is, builds (or takes) a dreamddp binary with
# the tch and nccl features, and runs:
#   1. `dreamddp nccl-check`: NCCL all-reduce (in place on libtorch CUDA tensors, and the
#      host-staged collective the trainer uses) against a CPU reference, and the share of the
#      per-unit all-reduces hidden behind backward on mlp and resnet20 (CUDA events);
#   2. `train --collective nccl` end to end: ssgd, wfbp, localsgd, dreamddp (mlp) and dreamddp
#      (resnet20) through the device path beside the CPU collective, and the host-staged path;
#   3. tch CUDA training of `mlp` and `resnet20`, each beside the same run on the CPU
#      (accuracy difference; the goal is within 0.3 points);
#   4. the step time of ssgd, wfbp, localsgd and dreamddp on the GPU (mlp), side by side.
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
#   DREAMDDP_DATA_DIR  folder with the data sets (MNIST IDX files), as `train` reads it
#   OUT            output folder (default gpu-check-out)
#   ONLY_NCCL      set: stop after the NCCL rows (skip the accuracy and step-time rows)
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
# pip's NCCL (nvidia-nccl-cu1x) beside torch: tell the probe where it is. The binary itself
# uses the NCCL libtorch loaded when there is one (two NCCLs in a process break each other);
# every copy found is listed in $OUT/nccl-libs.txt.
find "$LIBTORCH/.." /usr/lib /usr/local -name 'libnccl.so*' 2>/dev/null | xargs -r ls -lL > "$OUT/nccl-libs.txt" 2>&1
NCCL_DIR=$LIBTORCH/../nvidia/nccl/lib
[ -d "$NCCL_DIR" ] || NCCL_DIR=$(find "$LIBTORCH/../nvidia" -name 'libnccl.so*' 2>/dev/null | head -1 | xargs -r dirname)
[ -n "$NCCL_DIR" ] && [ -z "${DREAMDDP_NCCL_LIB:-}" ] && export DREAMDDP_NCCL_LIB=$NCCL_DIR
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

metric() { python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); a=d.get("test_accuracy"); print("%.2f" % (a*100) if a is not None else "%.3f" % d["val_loss"])' "$1" 2>/dev/null; }
step_ms() { python3 -c 'import json,sys; print("%.2f" % json.load(open(sys.argv[1]))["mean_step_ms"])' "$1" 2>/dev/null; }

# 2. NCCL: correctness against a CPU reference and the overlap of per-unit all-reduces.
if "$BIN" nccl-check --out "$OUT/nccl-check.json" > "$OUT/nccl-check.log" 2>&1; then
    worst=$(python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); print("%.1e" % max(r["rel_error"] for r in d["correctness"]), d["nccl_version"], d["devices"])' "$OUT/nccl-check.json")
    set -- $worst
    row "nccl all-reduce vs cpu" "max relative error $1" "NCCL $2, world $3 (every GPU); goal <= 1e-6"
    python3 - "$OUT/nccl-check.json" >> "$SUMMARY" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for r in d["overlap"]:
    print("overlap %s\t%.1f %% hidden behind compute\t%.1f %% behind the same backward; %d/%d all-reduces started before backward ended; compute %.3f ms, all-reduce %.3f ms/step; step %.3f ms with NCCL vs %.3f without" % (
        r["model"], 100 * r["hidden_share"], 100 * r["hidden_in_backward_share"], r["started_before_backward_end"], r["all_reduces"],
        r["compute_ms"], r["comm_ms"], r["step_ms_with_nccl"], r["step_ms_without"]))
PY
else
    row nccl-check failed "$(grep -m1 -i error "$OUT/nccl-check.log" | cut -c1-200)"
fi
# 2b. The trainer over NCCL (one worker on the GPU): each strategy through the device path
# (buckets built in GPU memory) beside the same run over the CPU collective, and dreamddp and
# ssgd through the host-staged path; accuracy and step time side by side. A failing run is
# run again with NCCL_DEBUG=INFO (log kept) to say why.
nccl_train() { # tag model strategy steps collective [env...]
    local tag=$1 model=$2 strategy=$3 steps=$4 collective=$5; shift 5
    env NCCL_DEBUG=WARN "$@" "$BIN" train --quiet --collective "$collective" --workers 1 --backend tch \
        --device "$DEVICE" --model "$model" --dataset "$DATASET" --strategy "$strategy" --steps "$steps" \
        --eval-every 0 --out "$OUT/$tag.json" > "$OUT/$tag.log" 2>&1 && return 0
    env NCCL_DEBUG=INFO "$@" "$BIN" train --quiet --collective "$collective" --workers 1 --backend tch \
        --device "$DEVICE" --model "$model" --dataset "$DATASET" --strategy "$strategy" --steps 20 \
        --eval-every 0 --out "$OUT/$tag-info.json" > "$OUT/$tag-info.log" 2>&1
    return 1
}
if [ "$GPUS" -gt 0 ]; then
    for run in "mlp ssgd $STEPS" "mlp wfbp $STEPS" "mlp localsgd $STEPS" "mlp dreamddp $STEPS" "resnet20 ssgd $((STEPS / 3))" "resnet20 dreamddp $((STEPS / 3))"; do
        set -- $run; model=$1; s=$2; steps=$3
        ok=1
        nccl_train "nccl-$model-$s" "$model" "$s" "$steps" nccl || ok=0
        nccl_train "cpucoll-$model-$s" "$model" "$s" "$steps" cpu || true
        if [ $ok = 1 ]; then
            row "train --collective nccl $s ($model)" \
                "$(metric "$OUT/nccl-$model-$s.json") % vs $(metric "$OUT/cpucoll-$model-$s.json") % (cpu collective)" \
                "step $(step_ms "$OUT/nccl-$model-$s.json") ms vs $(step_ms "$OUT/cpucoll-$model-$s.json") ms; 1 worker on $DEVICE, $steps steps, device path"
        else
            row "train --collective nccl $s ($model)" failed \
                "$(grep -m1 -i error "$OUT/nccl-$model-$s.log" | cut -c1-200); NCCL: $(grep -m1 'NCCL WARN' "$OUT/nccl-$model-$s.log" "$OUT/nccl-$model-$s-info.log" | cut -c1-200)"
        fi
    done
    # cuDNN's convolution kernels are not deterministic: the same resnet20 run again, on both
    # collectives, shows how far two runs of one configuration land apart.
    steps=$((STEPS / 3))
    nccl_train nccl-resnet20-dreamddp-again resnet20 dreamddp "$steps" nccl &&
        nccl_train cpucoll-resnet20-dreamddp-again resnet20 dreamddp "$steps" cpu &&
        row "run to run (resnet20 dreamddp)" \
            "nccl $(metric "$OUT/nccl-resnet20-dreamddp.json") / $(metric "$OUT/nccl-resnet20-dreamddp-again.json") %, cpu collective $(metric "$OUT/cpucoll-resnet20-dreamddp.json") / $(metric "$OUT/cpucoll-resnet20-dreamddp-again.json") %" \
            "two runs of each, same seed, $steps steps"
    # A mixed node: worker 0 on the GPU, worker 1 on CPU threads (--device cuda:0,cpu), the
    # CPU collective between them, beside both workers on the GPU.
    for devices in cuda:0,cpu "$DEVICE"; do
        tag=mixed-${devices//[:,]/}
        "$BIN" train --quiet --workers 2 --backend tch --device "$devices" --model mlp --dataset "$DATASET" \
            --strategy dreamddp --steps "$STEPS" --eval-every 0 --out "$OUT/$tag.json" > "$OUT/$tag.log" 2>&1 &&
            row "train --device $devices --workers 2 (mlp dreamddp)" "$(metric "$OUT/$tag.json") %" \
                "step $(step_ms "$OUT/$tag.json") ms; collective: $(grep -o 'collective: [a-z]*' "$OUT/$tag.log" | head -1)" ||
            row "train --device $devices --workers 2 (mlp dreamddp)" failed "$(grep -m1 -i error "$OUT/$tag.log" | cut -c1-200)"
    done
    for s in dreamddp ssgd; do
        nccl_train "nccl-host-mlp-$s" mlp "$s" "$STEPS" nccl DREAMDDP_NCCL_STAGING=host &&
            row "train --collective nccl $s (mlp), host-staged" "$(metric "$OUT/nccl-host-mlp-$s.json") %" \
                "step $(step_ms "$OUT/nccl-host-mlp-$s.json") ms; DREAMDDP_NCCL_STAGING=host" ||
            row "train --collective nccl $s (mlp), host-staged" failed "$(grep -m1 -i error "$OUT/nccl-host-mlp-$s.log" | cut -c1-200)"
    done
fi
if [ -n "${ONLY_NCCL:-}" ]; then
    finish 0
fi

# 3. Accuracy: the GPU run beside the same run on the CPU.
for model in mlp resnet20; do
    steps=$STEPS
    [ "$model" = resnet20 ] && steps=$((STEPS / 3))
    for dev in "$DEVICE" cpu; do
        tag=$model-${dev//:/}
        [ "$dev" = cpu ] && [ "$DEVICE" = cpu ] && [ -f "$OUT/$model-cpu.json" ] && continue
        "$BIN" train --quiet --backend tch --device "$dev" --model "$model" --dataset "$DATASET" \
            --strategy ssgd --steps "$steps" --eval-every 0 --out "$OUT/$tag.json" > "$OUT/$tag.log" 2>&1 ||
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
finish 0
