#!/usr/bin/env python3
"""PyTorch baseline for `dreamddp bench`: times one SGD training step on the CPU.

Builds the same networks as the built-in engine (`engine::models::mlp` with hidden sizes
512-256-128 and `engine::models::cnn`), feeds a fixed random batch (no data set download),
and times forward + softmax cross-entropy + backward + plain SGD update
(`p -= lr * grad`). After warmup it times each of N steps separately and prints one JSON
object per model on stdout:

    {"model", "threads", "batch", "steps", "ms_per_step_median", "ms_p10", "ms_p90",
     "torch_version", "final_loss"}

Run with the interpreter that `bench/install_torch.sh` prints, e.g.
    python torch_step.py --model mlp --threads 1 --steps 50
"""

import argparse
import json
import os
import statistics
import sys
import time
import warnings

# The private venv has no NumPy, and this script needs none.
warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
# Hide any GPU: this is a CPU baseline, and CUDA initialization must not be timed.
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

import torch  # noqa: E402  (after the environment is set)
from torch import nn  # noqa: E402

MNIST_PIXELS = 28 * 28
CLASSES = 10
MLP_HIDDEN = (512, 256, 128)


def build_mlp() -> nn.Module:
    """784 -> 512 -> 256 -> 128 -> 10 with ReLU between linear layers (engine `mlp`)."""
    layers: list[nn.Module] = []
    width = MNIST_PIXELS
    for hidden in MLP_HIDDEN:
        layers += [nn.Linear(width, hidden), nn.ReLU()]
        width = hidden
    layers.append(nn.Linear(width, CLASSES))
    return nn.Sequential(*layers)


def build_cnn() -> nn.Module:
    """conv 1->16 5x5 pad 2, relu, maxpool 2, conv 16->32 5x5 pad 2, relu, maxpool 2,
    flatten, fc 1568->128, relu, head 128->10 (engine `cnn`)."""
    return nn.Sequential(
        nn.Conv2d(1, 16, 5, padding=2),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 5, padding=2),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(32 * 7 * 7, 128),
        nn.ReLU(),
        nn.Linear(128, CLASSES),
    )


def time_model(name: str, threads: int, steps: int, warmup: int, batch: int, lr: float) -> dict:
    """Times `steps` training steps of model `name` after `warmup` untimed ones."""
    gen = torch.Generator().manual_seed(0)
    if name == "mlp":
        model = build_mlp()
        inputs = torch.randn(batch, MNIST_PIXELS, generator=gen)
    elif name == "cnn":
        model = build_cnn()
        inputs = torch.randn(batch, 1, 28, 28, generator=gen)
    else:
        raise ValueError(f"unknown model {name!r} (expected mlp or cnn)")
    labels = torch.randint(0, CLASSES, (batch,), generator=gen)
    model.train()
    # Plain SGD (no momentum, no weight decay): the same update the Rust side applies.
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    loss_fn = nn.CrossEntropyLoss()

    def step() -> float:
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model(inputs), labels)
        loss.backward()
        optimizer.step()
        return loss.item()

    for _ in range(warmup):
        step()
    times_ms = []
    loss = float("nan")
    for _ in range(steps):
        start = time.perf_counter()
        loss = step()
        times_ms.append((time.perf_counter() - start) * 1e3)
    times_ms.sort()

    def quantile(q: float) -> float:
        return times_ms[min(len(times_ms) - 1, int(q * len(times_ms)))]

    return {
        "model": name,
        "threads": threads,
        "batch": batch,
        "steps": steps,
        "ms_per_step_median": statistics.median(times_ms),
        "ms_p10": quantile(0.10),
        "ms_p90": quantile(0.90),
        "torch_version": torch.__version__,
        "final_loss": loss,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="mlp,cnn", help="comma-separated: mlp, cnn")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads")
    parser.add_argument("--steps", type=int, default=50, help="timed steps")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--lr", type=float, default=0.01)
    args = parser.parse_args()
    if args.threads < 1 or args.steps < 1 or args.warmup < 0 or args.batch < 1:
        parser.error("--threads, --steps and --batch must be >= 1, --warmup >= 0")

    torch.set_num_threads(args.threads)
    torch.set_num_interop_threads(1)
    torch.manual_seed(0)
    for name in args.model.split(","):
        name = name.strip()
        try:
            result = time_model(name, args.threads, args.steps, args.warmup, args.batch, args.lr)
        except ValueError as err:
            print(f"torch_step.py: {err}", file=sys.stderr)
            return 2
        print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
