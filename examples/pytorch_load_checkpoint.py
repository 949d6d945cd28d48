#!/usr/bin/env python3
"""Load a dreamddp checkpoint (`train --save`, or `cluster`'s global.safetensors) into the
equivalent PyTorch nn.Module.

    python examples/pytorch_load_checkpoint.py CHECKPOINT.safetensors
    python examples/pytorch_load_checkpoint.py CHECKPOINT.safetensors --check BATCH.safetensors

dreamddp writes PyTorch's parameter names and layouts (`fc1.weight` is [out, in],
`conv1.weight` is [out, in, kh, kw]), so `load_state_dict(..., strict=True)` takes the file as
it is. The built-in models are rebuilt here as nn.Sequential with the same layer names;
their sizes are read off the tensors. With --check, BATCH holds `input` and the `logits`
dreamddp computed for it; the script runs the PyTorch module on `input` and fails unless the
largest absolute difference is at most --tol (default 1e-5).
"""
import argparse
import collections
import sys

import torch
from safetensors import safe_open
from safetensors.torch import load_file
from torch import nn


def mlp(state):
    """flatten, fc1, relu1, ..., fcK, reluK, head."""
    layers = [("flatten", nn.Flatten())]
    k = 1
    while f"fc{k}.weight" in state:
        out_f, in_f = state[f"fc{k}.weight"].shape
        layers += [(f"fc{k}", nn.Linear(in_f, out_f)), (f"relu{k}", nn.ReLU())]
        k += 1
    out_f, in_f = state["head.weight"].shape
    layers.append(("head", nn.Linear(in_f, out_f)))
    return nn.Sequential(collections.OrderedDict(layers))


def cnn(state):
    """conv1, relu1, pool1, conv2, relu2, pool2, flatten, fc1, relu3, head (5x5, pad 2)."""
    c1o, c1i, k, _ = state["conv1.weight"].shape
    c2o, c2i, _, _ = state["conv2.weight"].shape
    f1o, f1i = state["fc1.weight"].shape
    ho, hi = state["head.weight"].shape
    return nn.Sequential(collections.OrderedDict([
        ("conv1", nn.Conv2d(c1i, c1o, k, padding=k // 2)),
        ("relu1", nn.ReLU()),
        ("pool1", nn.MaxPool2d(2, 2)),
        ("conv2", nn.Conv2d(c2i, c2o, k, padding=k // 2)),
        ("relu2", nn.ReLU()),
        ("pool2", nn.MaxPool2d(2, 2)),
        ("flatten", nn.Flatten()),
        ("fc1", nn.Linear(f1i, f1o)),
        ("relu3", nn.ReLU()),
        ("head", nn.Linear(hi, ho)),
    ]))


BUILDERS = {"mlp": mlp, "cnn": cnn}


def load(path):
    with safe_open(path, framework="pt") as f:
        meta = f.metadata() or {}
    kind = meta.get("dreamddp.model")
    if kind not in BUILDERS:
        sys.exit(f"{path}: model {kind!r} has no PyTorch twin in this script (known: {sorted(BUILDERS)})")
    state = load_file(path)
    module = BUILDERS[kind](state)
    module.load_state_dict(state, strict=True)
    return kind, meta, module.eval()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint")
    ap.add_argument("--check", metavar="BATCH", help="safetensors with `input` and dreamddp's `logits`")
    ap.add_argument("--tol", type=float, default=1e-5)
    args = ap.parse_args()
    kind, meta, module = load(args.checkpoint)
    params = sum(p.numel() for p in module.parameters())
    print(f"loaded {kind} ({params} parameters, data set {meta.get('dreamddp.dataset', '?')}) into:\n{module}")
    if args.check:
        batch = load_file(args.check)
        with torch.no_grad():
            logits = module(batch["input"])
        diff = (logits - batch["logits"]).abs().max().item()
        agree = (logits.argmax(1) == batch["logits"].argmax(1)).float().mean().item()
        print(f"max |logits(PyTorch) - logits(dreamddp)| = {diff:.3e} over {tuple(logits.shape)}; "
              f"argmax agreement {agree * 100:.1f} %")
        if not diff <= args.tol:
            sys.exit(f"FAIL: difference {diff:.3e} exceeds {args.tol:.1e}")
        print("OK")


if __name__ == "__main__":
    main()
