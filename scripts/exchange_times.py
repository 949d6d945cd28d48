#!/usr/bin/env python3
"""Per node and layer, how long its delta exchanges took in a real run and a simulated one.

Usage: scripts/exchange_times.py REAL_SUMMARY SIM_SUMMARY [STRATEGY]

Both files are `summary.json` files of `dreamddp fidelity` (`real/summary.json`, `sim/summary.json`);
STRATEGY defaults to `elastic`. From each strategy's per-layer timeline (a delta's cut to its
acknowledgement) it prints, per node and layer: the exchanges completed, the span from the first
cut to the last acknowledgement (a node's training time, roughly), and the 10th / 50th / 90th
percentile of an exchange's duration in seconds. docs/fidelity.md quotes these figures.
"""
import json
import sys


def timeline(path, strategy):
    summary = json.load(open(path))
    for s in summary["strategies"]:
        if s["strategy"] == strategy:
            return s["timeline"]
    sys.exit(f"{path}: no strategy {strategy!r}")


def cell(events):
    if not events:
        return "-"
    d = sorted(e["end_s"] - e["start_s"] for e in events)
    start = min(e["start_s"] for e in events)
    end = max(e["end_s"] for e in events)
    n = len(d)
    return (
        f"n={n:3d} span {start:5.1f}-{end:5.1f} s "
        f"p10/p50/p90 {d[n // 10]:.2f}/{d[n // 2]:.2f}/{d[9 * n // 10]:.2f} s"
    )


def main():
    if len(sys.argv) not in (3, 4):
        sys.exit(__doc__)
    strategy = sys.argv[3] if len(sys.argv) == 4 else "elastic"
    real = timeline(sys.argv[1], strategy)
    sim = timeline(sys.argv[2], strategy)
    nodes = sorted({e["node"] for e in real} | {e["node"] for e in sim})
    layers = sorted({e["layer"] for e in real} | {e["layer"] for e in sim})
    for node in nodes:
        for layer in layers:
            pick = lambda t: [e for e in t if e["node"] == node and e["layer"] == layer]
            print(f"{node:8s} {layer:5s} real {cell(pick(real))} | sim {cell(pick(sim))}")


if __name__ == "__main__":
    main()
