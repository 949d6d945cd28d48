#!/usr/bin/env python3
"""How long each real trainer took to connect: from the run's common start (its config's
`[node] start_at_unix_ms`, since 2026-12-07) or, in runs recorded before, its `[START]` log line,
to its first `[LINK] ... up` line.

Usage: scripts/connect_times.py FIDELITY_OUT [FIDELITY_OUT ...]

FIDELITY_OUT is a `dreamddp fidelity --out` folder; its `real/<strategy>/<node>/log.txt` files are
read. Prints one line per node and strategy, in seconds. docs/fidelity.md quotes these figures.
"""
import datetime
import glob
import os
import re
import sys


def stamp(line):
    return datetime.datetime.fromisoformat(line[:26] + "+00:00").timestamp()


def common_start(log):
    """The node's `start_at_unix_ms` in seconds, from the config beside its log; None if absent."""
    try:
        text = open(os.path.join(os.path.dirname(log), "config.toml")).read()
    except OSError:
        return None
    m = re.search(r"^start_at_unix_ms\s*=\s*(\d+)", text, re.M)
    return int(m.group(1)) / 1e3 if m else None


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    for out in sys.argv[1:]:
        for log in sorted(glob.glob(os.path.join(out, "real", "*", "*", "log.txt"))):
            lines = open(log).read().splitlines()
            start = next((l for l in lines if "[START]" in l), None)
            up = next((l for l in lines if "[LINK]" in l and l.rstrip().endswith(" up")), None)
            if start is None or up is None:
                continue
            strategy, node = log.split(os.sep)[-3:-1]
            since = common_start(log)
            seconds = stamp(up) - (since if since is not None else stamp(start))
            print(f"{out} {strategy:9s} {node:8s} {seconds:6.2f}")


if __name__ == "__main__":
    main()
