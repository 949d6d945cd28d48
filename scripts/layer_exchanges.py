#!/usr/bin/env python3
"""Per layer, how many deltas a run's devices delivered and how long each exchange took.

Usage: scripts/layer_exchanges.py STRATEGY SUMMARY_JSON...

Each SUMMARY_JSON is a `summary.json` of either engine (a real run's
`docs/fidelity/runs/fidelity-fcc/real/run-K/summary.json`, a simulated seed's
`<fidelity --out>/sim/network-seed-N/summary.json`). From STRATEGY's per-layer timeline (one
entry per delta: cut, then acknowledged) it prints per file and layer: the deltas delivered,
the exchange time (cut to acknowledgement) and the time from one cut of the layer to the next
on the same node, as 10th / 50th / 90th percentiles over deltas cut before 55 s; then, for the
last layer (`head` in the MLP), the exchanges slower than 0.9 s per 10 s of the run, and the
deltas the aggregator applied with their mean staleness. docs/fidelity.md (how to read the cells:
"The model's devices sync the small `head` layer …") quotes them.
"""
import collections
import json
import sys


def quantiles(values):
    values = sorted(values)
    if not values:
        return "-"
    return " / ".join(f"{values[min(len(values) - 1, int(q * len(values)))]:.2f}" for q in (0.1, 0.5, 0.9))


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    strategy = sys.argv[1]
    for path in sys.argv[2:]:
        summary = json.load(open(path))
        runs = [s for s in summary["strategies"] if s["strategy"] == strategy]
        if not runs:
            sys.exit(f"{path}: no strategy {strategy}")
        run = runs[0]
        by_layer = collections.defaultdict(lambda: collections.defaultdict(list))
        for entry in run["timeline"]:
            if entry["end_s"] is not None:
                by_layer[entry["layer"]][entry["node"]].append((entry["start_s"], entry["end_s"]))
        print(path)
        for layer, nodes in sorted(by_layer.items()):
            exchanges, gaps = [], []
            for cuts in nodes.values():
                cuts.sort()
                exchanges += [end - start for start, end in cuts if start < 55]
                gaps += [cuts[i + 1][0] - cuts[i][0] for i in range(len(cuts) - 1) if cuts[i][0] < 55]
            count = sum(len(c) for c in nodes.values())
            print(f"  {layer:<6} {count:>4} deltas  exchange s {quantiles(exchanges):<20} "
                  f"cut to cut s {quantiles(gaps)}")
        last = max(by_layer, key=lambda l: sum(len(c) for c in by_layer[l].values()), default=None)
        if last is not None:
            slow, total = collections.Counter(), collections.Counter()
            for cuts in by_layer[last].values():
                for start, end in cuts:
                    window = int(start // 10) * 10
                    total[window] += 1
                    slow[window] += end - start > 0.9
            print(f"  {last} exchanges over 0.9 s per 10 s: "
                  + " ".join(f"{w}s {slow[w]}/{total[w]}" for w in sorted(total)))
        hist = run["staleness_histogram"]
        items = hist.items() if isinstance(hist, dict) else enumerate(hist)
        counts = [(int(k), v) for k, v in items]
        applied = sum(v for _, v in counts)
        mean = sum(k * v for k, v in counts) / max(applied, 1)
        print(f"  applied {applied} deltas, mean staleness {mean:.2f}")


if __name__ == "__main__":
    main()
