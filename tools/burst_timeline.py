"""How each burst reached an engine worker and how the worker admitted it, from the service's log at DEBUG.

    VOXCPM_LOG_LEVEL=DEBUG voxcpm-serve ... > service.log 2>&1      # the workers log each arrival and step
    python tools/burst_timeline.py service.log [--out timeline.json]

A worker at DEBUG logs each request's arrival ("generate ID received"), each step ("step N: ... W waiting, R
running") and each admission round ("step: prefill K seqs ..."). A burst here is the arrivals at an idle worker
(nothing running or waiting) and what follows until it is idle again. Per burst: how many requests arrived, over
how long (first to last, and to the half), and each admission round's size and time after the first arrival: a
burst the in-process pool admits in one round but HTTP in two has its late round's requests wait one step more.
Times are the log's (millisecond resolution). Prints one line per burst; --out writes them as JSON.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from datetime import datetime
from pathlib import Path
from typing import Any

_LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) worker\[(?P<worker>[^\]]+)\] DEBUG \S+: (?P<msg>.*)$")
_ARRIVAL = re.compile(r"generate (\S+) received")
_ROUND = re.compile(r"step: prefill (\d+) seqs")
_STEP = re.compile(r"step (\d+): [\d.]+ ms, \d+ events, (\d+) waiting, (\d+) running")


def _ms(stamp: str) -> float:
    return datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp() * 1000.0


def timeline(lines: list[str]) -> list[dict[str, Any]]:
    """The bursts of every worker in the log, in the order they began."""
    bursts: list[dict[str, Any]] = []
    current: dict[str, dict[str, Any]] = {}  # worker -> its burst in progress
    arrivals: dict[str, list[float]] = {}
    for line in lines:
        m = _LINE.match(line.rstrip("\n"))
        if m is None:
            continue
        worker, msg, t = m["worker"], m["msg"], _ms(m[1])
        burst = current.get(worker)
        if _ARRIVAL.match(msg):
            if burst is None:
                burst = current[worker] = {"worker": worker, "start": t, "rounds": [], "first_step_ms": None}
                arrivals[worker] = []
                bursts.append(burst)
            arrivals[worker].append(t - burst["start"])
        elif burst is not None and (r := _ROUND.match(msg)):
            burst["rounds"].append({"seqs": int(r[1]), "at_ms": t - burst["start"]})
        elif burst is not None and (s := _STEP.match(msg)):
            if burst["first_step_ms"] is None:
                burst["first_step_ms"] = t - burst["start"]
            if s[2] == "0" and s[3] == "0":  # idle again: the burst is over
                del current[worker]
        if burst is not None:
            got = arrivals[worker]
            burst.update(requests=len(got), spread_ms=got[-1] if got else 0.0,
                         half_ms=sorted(got)[(len(got) - 1) // 2] if got else 0.0)
    for b in bursts:
        b.pop("start")
    return bursts


def describe(b: dict[str, Any]) -> str:
    rounds = ", ".join(f"{r['seqs']} at {r['at_ms']:.0f} ms" for r in b["rounds"]) or "none"
    return (f"worker {b['worker']}: {b['requests']} requests over {b['spread_ms']:.0f} ms (half by "
            f"{b['half_ms']:.0f} ms); admitted in {len(b['rounds'])} round(s): {rounds}")


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("log", type=Path)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    bursts = timeline(a.log.read_text(errors="replace").splitlines())
    for b in bursts:
        print(describe(b))
    if a.out:
        a.out.write_text(json.dumps(bursts, indent=1))
    return bursts


if __name__ == "__main__":
    main(sys.argv[1:])
