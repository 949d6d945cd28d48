#!/usr/bin/env python3
"""How long a datagram waits for a delivery opportunity of a mahimahi trace.

Usage: scripts/trace_gaps.py TRACE [TRACE ...]

Prints, per trace, its mean rate, its longest gap between delivery opportunities, the mean
wait of a datagram arriving at a random moment for the next opportunity (what an
acknowledgement crossing this direction waits in the relay when the direction is idle), and
the share of time spent in gaps of 100 ms or more. docs/fidelity.md quotes these figures.
"""
import sys


def stats(path):
    times = [int(line) for line in open(path) if line.strip()]
    distinct = sorted(set(times))
    gaps = [b - a for a, b in zip(distinct, distinct[1:])]
    duration_ms = times[-1] - times[0]
    span = sum(gaps)
    return {
        "mbit_per_s": len(times) * 1500 * 8 / duration_ms / 1000,
        "max_gap_ms": max(gaps),
        "mean_wait_ms": sum(g * g for g in gaps) / 2 / span,
        "time_in_gaps_100ms": sum(g for g in gaps if g >= 100) / span,
    }


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    for path in sys.argv[1:]:
        try:
            s = stats(path)
        except (OSError, ValueError) as e:
            sys.exit(f"{path}: not a readable mahimahi trace ({e})")
        print(
            f"{path}: {s['mbit_per_s']:.2f} Mbit/s, longest gap {s['max_gap_ms']} ms, "
            f"mean wait for the next opportunity {s['mean_wait_ms']:.0f} ms, "
            f"{100 * s['time_in_gaps_100ms']:.0f} % of the time in gaps >= 100 ms"
        )


if __name__ == "__main__":
    main()
