#!/usr/bin/env python3
"""Writes a copy of an edge scenario whose trace links carry a fraction of their capacity.

The experiment behind docs/fidelity.md's "goodput" finding: does the simulator predict the real
run once its sender gets only part of a trace's capacity, as QUIC through the relay does?

    python3 scripts/scale_traces.py 0.6 /tmp/goodput60            # default-2core, 60 %
    cargo run --release -- simulate /tmp/goodput60/scenario.toml --strategies elastic

Mbit/s traces (`format = "mbps"`) have every rate multiplied by FACTOR; mahimahi traces keep
FACTOR of their delivery opportunities, spread evenly (timestamps unchanged, so the trace's
period is too). Traces are read from ../shared/data/traces (or $DREAMDDP_TRACES_DIR, else the
copies in simulations/traces); the scenario is `simulations/scenarios/<name>.toml`.
"""

import os
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def traces_dir() -> Path:
    env = os.environ.get("DREAMDDP_TRACES_DIR")
    if env:
        return Path(env)
    shared = ROOT.parent / "shared" / "data" / "traces"
    if (shared / "ATT-LTE-driving-2016.up").is_file():
        return shared
    return ROOT / "simulations" / "traces"


def scale_mbps(text: str, factor: float) -> str:
    out = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2:
            out.append(f"{parts[0]}\t{float(parts[1]) * factor}")
    return "\n".join(out) + "\n"


def thin_mahimahi(text: str, factor: float) -> str:
    kept, credit = [], 0.0
    for line in text.splitlines():
        if not line.strip():
            continue
        credit += factor
        if credit >= 1.0 - 1e-9:
            kept.append(line)
            credit -= 1.0
    return "\n".join(kept) + "\n"


def main() -> None:
    if len(sys.argv) not in (3, 4):
        sys.exit("usage: scale_traces.py FACTOR OUTDIR [SCENARIO (default default-2core)]")
    factor, out = float(sys.argv[1]), Path(sys.argv[2])
    name = sys.argv[3] if len(sys.argv) == 4 else "default-2core"
    if not 0.0 < factor <= 1.0:
        sys.exit(f"FACTOR {factor}: must be in (0, 1]")
    scenario = (ROOT / "simulations" / "scenarios" / f"{name}.toml").read_text()
    out.mkdir(parents=True, exist_ok=True)
    src = traces_dir()
    for path, fmt in re.findall(r'trace = \{ path = "([^"]+)", format = "(\w+)" \}', scenario):
        text = (src / path).read_text()
        scaled = scale_mbps(text, factor) if fmt == "mbps" else thin_mahimahi(text, factor)
        (out / path).write_text(scaled)
    (out / "scenario.toml").write_text(scenario)
    print(out / "scenario.toml")


if __name__ == "__main__":
    main()
