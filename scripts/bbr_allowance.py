#!/usr/bin/env python3
"""The real congestion controller's ack-aggregation allowance, per node, in a real run.

Usage: scripts/bbr_allowance.py STRATEGY_DIR

STRATEGY_DIR is one strategy's folder of a real run (`<fidelity --out>/real/elastic`), recorded
with the controller's state lines on:

    DREAMDDP_CLUSTER_LOG=info,transport::bbr=debug dreamddp fidelity ...

`transport::bbr` logs `[BBR] state` every 64 rounds with its bandwidth estimate, window and
`min_rtt`. Once STARTUP is over the window is `2 · estimate · min_rtt + allowance`, so each line
gives the allowance. Prints, per node's log (a device's lines are its uplink's connection; the
aggregator's mix its connections), the lines read, the estimate's and the window's range, the
10th / 50th / 90th percentile of the allowance and 100 ms of the median estimate (the
allowance's cap), in KB. docs/fidelity.md quotes these figures.
"""
import glob
import re
import statistics
import sys

ANSI = re.compile(r"\x1b\[[0-9;]*m")


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    for log in sorted(glob.glob(f"{sys.argv[1]}/*/log.txt")):
        rows = []
        for line in open(log):
            line = ANSI.sub("", line)
            if "[BBR] state" not in line:
                continue
            kv = dict(re.findall(r"(\w+)=([\w.]+)", line))
            if kv.get("filled_pipe") != "true":
                continue
            bw, window = float(kv["bandwidth"]), float(kv["window"])
            rtt = float(kv["min_rtt_ms"]) / 1e3
            rows.append((bw, window, window - 2 * bw * rtt))
        if not rows:
            continue
        extra = sorted(r[2] for r in rows)
        n = len(extra)
        print(
            f"{log.split('/')[-2]:<10} lines {n:3}  estimate {min(r[0] for r in rows) / 1e3:.0f}-"
            f"{max(r[0] for r in rows) / 1e3:.0f} KB/s  window {min(r[1] for r in rows) / 1e3:.0f}-"
            f"{max(r[1] for r in rows) / 1e3:.0f} KB  allowance {extra[n // 10] / 1e3:.1f} / "
            f"{statistics.median(extra) / 1e3:.1f} / {extra[min(n - 1, n * 9 // 10)] / 1e3:.1f} KB  "
            f"(100 ms of the estimate: {statistics.median(r[0] for r in rows) * 0.1 / 1e3:.1f} KB)"
        )


if __name__ == "__main__":
    main()
