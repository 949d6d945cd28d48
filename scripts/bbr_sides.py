#!/usr/bin/env python3
"""The real congestion controllers' estimate, window, allowance and min_rtt, by side of the link.

Usage: scripts/bbr_sides.py REAL_DIR [MAX_RATE_KBPS]

REAL_DIR is a real run's folder, or a folder of several (`real/run-K/`), whose strategies'
folders hold `bbr-state.txt`: the `[BBR]` lines of every process, each prefixed with its node
(`agg-0 …`, `edge-0 …`). docs/fidelity/runs/fidelity-fcc/real/run-3 to run-5 hold them; a new
recording gets them with

    DREAMDDP_CLUSTER_LOG=info,transport::bbr=debug dreamddp fidelity ... --out OUT
    for n in agg-0 edge-0 ...; do sed 's/\\x1b\\[[0-9;]*m//g' OUT/real/STRATEGY/$n/log.txt \\
        | grep '\\[BBR\\]' | sed "s/^/$n /"; done > OUT/real/STRATEGY/bbr-state.txt

`transport::bbr` logs `[BBR] state` every 64 rounds. Lines after STARTUP whose estimate is
between 50 kB/s and MAX_RATE_KBPS (300 by default: `fidelity-fcc`'s first 115 s, 1.2–1.4 Mbit/s)
are grouped by strategy, side (`agg`: the aggregator's sender, the devices' downlinks; `dev`:
a device's uplink) and link (`near`: min_rtt under 100 ms), and printed as medians: the
estimate, the window, the allowance (`window − 2 · estimate · min_rtt`, its 10th / 50th / 90th
percentile) and min_rtt. docs/fidelity.md ("The real controllers' windows") quotes them.
"""
import collections
import glob
import re
import statistics
import sys


def main():
    if len(sys.argv) not in (2, 3):
        sys.exit(__doc__)
    root = sys.argv[1]
    max_rate = float(sys.argv[2]) * 1e3 if len(sys.argv) == 3 else 300e3
    files = sorted(glob.glob(f"{root}/*/bbr-state.txt") + glob.glob(f"{root}/run-*/*/bbr-state.txt"))
    if not files:
        sys.exit(f"no */bbr-state.txt under {root}")
    groups = collections.defaultdict(list)
    for path in files:
        strategy = path.split("/")[-2]
        for line in open(path):
            kv = dict(re.findall(r"(\w+)=([\w.]+)", line))
            if kv.get("filled_pipe") != "true":
                continue
            rtt = float(kv["min_rtt_ms"]) / 1e3
            bw, window = float(kv["bandwidth"]), float(kv["window"])
            if rtt < 0.001 or not 50e3 <= bw <= max_rate:
                continue
            side = "agg" if line.startswith("agg") else "dev"
            link = "near" if rtt < 0.1 else "far"
            groups[(strategy, side, link)].append((bw, window, window - 2 * bw * rtt, rtt))
    print(f"{'strategy':<10} {'side':<4} {'link':<5} {'lines':>5} {'est kB/s':>9} {'win KB':>7} "
          f"{'allowance KB p10/50/90':>23} {'min_rtt ms':>10}")
    for (strategy, side, link), rows in sorted(groups.items()):
        allowance = sorted(r[2] / 1e3 for r in rows)
        pct = [allowance[min(len(allowance) - 1, int(q * len(allowance)))] for q in (0.1, 0.5, 0.9)]
        print(f"{strategy:<10} {side:<4} {link:<5} {len(rows):>5} "
              f"{statistics.median(r[0] for r in rows) / 1e3:>9.0f} "
              f"{statistics.median(r[1] for r in rows) / 1e3:>7.1f} "
              f"{pct[0]:>9.1f} / {pct[1]:>4.1f} / {pct[2]:>4.1f} "
              f"{statistics.median(r[3] for r in rows) * 1e3:>10.1f}")


if __name__ == "__main__":
    main()
