"""ResNet-20 (CIFAR style, option-A shortcuts) in PyTorch, as dreamddp's tch backend builds it.

Usage: python resnet20_check.py DIR

DIR holds `manifest.json` ({"tensors": [[name, shape, offset], ...], "input": [shape,
offset], "classes": N, "in_ch": C}) and `data.bin` (little-endian f32 at those element
offsets), written by the tch-backend test `resnet20_matches_pytorch`. The script builds the
module, loads the tensors with `load_state_dict(strict=True)` (so every name and shape must
match), runs the input in eval mode and writes `DIR/logits.bin` (f32).
"""

import json
import struct
import sys
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F


class BasicBlock(nn.Module):
    def __init__(self, in_planes, planes, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.stride, self.pad = stride, planes - in_planes

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        shortcut = x
        if self.stride != 1:
            shortcut = shortcut[:, :, :: self.stride, :: self.stride]
        if self.pad:
            lo = self.pad // 2
            shortcut = F.pad(shortcut, (0, 0, 0, 0, lo, self.pad - lo))
        return F.relu(out + shortcut)


class ResNet20(nn.Module):
    def __init__(self, in_ch=3, classes=10, blocks=3):
        super().__init__()
        self.conv1 = nn.Conv2d(in_ch, 16, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(16)
        in_planes = 16
        for i, planes in enumerate([16, 32, 64]):
            layers = []
            for b in range(blocks):
                stride = 2 if i > 0 and b == 0 else 1
                layers.append(BasicBlock(in_planes, planes, stride))
                in_planes = planes
            setattr(self, f"layer{i + 1}", nn.Sequential(*layers))
        self.fc = nn.Linear(64, classes)

    def forward(self, x):
        x = F.relu(self.bn1(self.conv1(x)))
        x = self.layer3(self.layer2(self.layer1(x)))
        return self.fc(x.mean(dim=(2, 3)))


def main(folder):
    folder = Path(folder)
    manifest = json.loads((folder / "manifest.json").read_text())
    data = torch.frombuffer(bytearray((folder / "data.bin").read_bytes()), dtype=torch.float32)

    def take(shape, offset):
        n = 1
        for d in shape:
            n *= d
        return data[offset : offset + n].reshape(shape).clone()

    model = ResNet20(manifest["in_ch"], manifest["classes"])
    state = {name: take(shape, off) for name, shape, off in manifest["tensors"]}
    model.load_state_dict(state, strict=True)
    model.eval()
    with torch.no_grad():
        logits = model(take(*manifest["input"]))
    values = logits.flatten().tolist()
    (folder / "logits.bin").write_bytes(struct.pack(f"<{len(values)}f", *values))
    print(f"pytorch logits {list(logits.shape)}")


if __name__ == "__main__":
    main(sys.argv[1])
