"""Export a LeNet-5 (28x28 grayscale, 10 classes) as TorchScript for dreamddp's tch backend.

Usage: python export_model.py OUT.pt [--seed N]

The model is an nn.Sequential with named children, so dreamddp's sync units are its
parameterized children, in forward order: conv1, conv2, fc1, fc2, fc3. Train it with
`dreamddp train --backend tch --model OUT.pt --dataset mnist` (any module saved with `torch.jit.script(...).save`
or `torch.jit.trace(...).save` loads the same way; units are the top-level children).
"""

import argparse
from collections import OrderedDict

import torch
import torch.nn as nn


def lenet5(classes: int = 10) -> nn.Module:
    return nn.Sequential(
        OrderedDict(
            [
                ("conv1", nn.Conv2d(1, 6, 5, padding=2)),  # 28x28 -> 28x28
                ("relu1", nn.ReLU()),
                ("pool1", nn.MaxPool2d(2)),  # -> 14x14
                ("conv2", nn.Conv2d(6, 16, 5)),  # -> 10x10
                ("relu2", nn.ReLU()),
                ("pool2", nn.MaxPool2d(2)),  # -> 5x5
                ("flatten", nn.Flatten()),
                ("fc1", nn.Linear(16 * 5 * 5, 120)),
                ("relu3", nn.ReLU()),
                ("fc2", nn.Linear(120, 84)),
                ("relu4", nn.ReLU()),
                ("fc3", nn.Linear(84, classes)),
            ]
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="where to write the TorchScript module (.pt)")
    parser.add_argument("--seed", type=int, default=0, help="initialization seed")
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    model = lenet5()
    scripted = torch.jit.script(model)
    check = scripted(torch.zeros(2, 1, 28, 28))
    assert check.shape == (2, 10), check.shape
    scripted.save(args.out)
    params = sum(p.numel() for p in model.parameters())
    print(f"saved LeNet-5 ({params} parameters) to {args.out}")


if __name__ == "__main__":
    main()
