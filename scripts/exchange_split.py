#!/usr/bin/env python3
"""Where a real exchange's time goes: from a trainer's cut to the aggregator's apply, and from
the apply to the acknowledgement the trainer handled.

Usage: scripts/exchange_split.py STRATEGY_DIR [NODE]

STRATEGY_DIR is one strategy's folder of a real run (`<fidelity --out>/real/elastic`), recorded
with the aggregator's apply lines on:

    DREAMDDP_CLUSTER_LOG=info,cpu_aggregator=debug dreamddp fidelity ...

NODE defaults to `cloud-0`. The trainer's `[SYNC] layer=L version=V ... ms=M` line ends an
exchange that began M ms before it (the cut); the aggregator's `[APPLY] layer=L version=V` line
is when that delta was applied. Prints, per layer, the exchanges matched and the 10th / 50th /
90th percentile of cut -> apply, apply -> acknowledgement handled, and the whole exchange, in
seconds. docs/fidelity.md quotes these figures.
"""
import datetime
import re
import sys

ANSI = re.compile(r"\x1b\[[0-9;]*m")


def stamp(line):
    return datetime.datetime.fromisoformat(line[:26] + "+00:00").timestamp()


def main():
    if len(sys.argv) not in (2, 3):
        sys.exit(__doc__)
    run = sys.argv[1]
    node = sys.argv[2] if len(sys.argv) == 3 else "cloud-0"
    applied = {}
    for line in open(f"{run}/agg-0/log.txt"):
        line = ANSI.sub("", line)
        m = re.search(r"\[APPLY\] layer=(\w+) version=(\d+)", line)
        if m:
            applied[(m.group(1), int(m.group(2)))] = stamp(line)
    if not applied:
        sys.exit(f"{run}/agg-0/log.txt has no [APPLY] lines: record with DREAMDDP_CLUSTER_LOG=info,cpu_aggregator=debug")
    rows = {}
    for line in open(f"{run}/{node}/log.txt"):
        line = ANSI.sub("", line)
        m = re.search(r"\[SYNC\] layer=(\w+) version=(\d+) bytes=\d+ ms=([\d.]+)", line)
        if not m:
            continue
        end = stamp(line)
        total = float(m.group(3)) / 1e3
        at = applied.get((m.group(1), int(m.group(2))))
        if at is not None:
            rows.setdefault(m.group(1), []).append((at - (end - total), end - at, total))
    for layer, r in sorted(rows.items()):
        n = len(r)

        def pct(i):
            s = sorted(x[i] for x in r)
            return f"{s[n // 10]:.3f}/{s[n // 2]:.3f}/{s[9 * n // 10]:.3f}"

        print(f"{node} {layer:5s} n={n:3d} cut->apply {pct(0)}  apply->ack {pct(1)}  exchange {pct(2)} s")


if __name__ == "__main__":
    main()
