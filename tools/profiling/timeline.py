"""How each burst reached an engine worker and how the worker admitted it, from the service's log at DEBUG.

    VOXCPM_LOG_LEVEL=DEBUG voxcpm-serve ... > service.log 2>&1      # the workers log each arrival and step
    python tools/profiler.py timeline service.log [--out timeline.json]

A worker at DEBUG logs each request's arrival ("generate ID received"), each step ("step N: ... W waiting, R
running") and each admission round ("step: prefill K seqs ..."); an API process's engine client at DEBUG (the
service sets it from the same VOXCPM_LOG_LEVEL) logs when its event loop hands a request to the sender thread
("generate ID to worker N") and when the sender has written it ("generate ID sent"), as does the in-process pool's
client of `bench.py stream` at DEBUG (labelled `client`, on stderr). A burst here is the arrivals
at an idle worker (nothing running or waiting) and what follows until it is idle again (or, for requests refused
before any step, until an arrival more than a second after the last). Per burst: how many requests
arrived, over how long (first to last, and to the half), and each admission round's size and time after the first
arrival (a burst the in-process pool admits in one round but HTTP in two has its late round's requests wait one
step more); with the API processes' lines, where the arrivals' spread comes from: the API processes handing the
requests over (spread from the first), the sender threads (hand-off to written) and the worker (written to read).
With enough steps, their mean spacing after admission (the engine's steady period as the worker ran it). Times are
the log's (millisecond resolution). Prints one line per burst; --out writes them as JSON.
"""

from __future__ import annotations

import argparse
import json
import re
from datetime import datetime
from pathlib import Path
from typing import Any

_LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) worker\[(?P<worker>[^\]]+)\] DEBUG \S+: (?P<msg>.*)$")
_API_LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) (?:api\[\d+\]|client) DEBUG \S+: generate (\S+) "
                       r"(to worker|sent)")
_ARRIVAL = re.compile(r"generate (\S+) received")
_ROUND = re.compile(r"step: prefill (\d+) seqs")
IDLE_GAP_MS = 1000.0  # an arrival this long after the last, with no step between them, begins another burst
_STEP = re.compile(r"step (\d+): [\d.]+ ms, \d+ events, (\d+) waiting, (\d+) running")


def _ms(stamp: str) -> float:
    return datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp() * 1000.0


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def timeline(lines: list[str]) -> list[dict[str, Any]]:
    """The bursts of every worker in the log, in the order they began."""
    bursts: list[dict[str, Any]] = []
    current: dict[str, dict[str, Any]] = {}  # worker -> its burst in progress
    api: dict[str, dict[str, float]] = {}  # request id -> {"to worker": t, "sent": t}
    for line in lines:
        if a := _API_LINE.match(line):
            api.setdefault(a[2], {})[a[3]] = _ms(a[1])
            continue
        m = _LINE.match(line.rstrip("\n"))
        if m is None:
            continue
        worker, msg, t = m["worker"], m["msg"], _ms(m[1])
        burst = current.get(worker)
        if arrival := _ARRIVAL.match(msg):
            if burst is not None and burst["first_step_ms"] is None and t - burst["read"][-1][1] > IDLE_GAP_MS:
                burst = None  # its requests were refused before any step: this arrival begins the next burst
            if burst is None:
                burst = current[worker] = {"worker": worker, "start": t, "rounds": [], "first_step_ms": None,
                                           "read": [], "steps": []}
                bursts.append(burst)
            burst["read"].append((arrival[1], t))  # (request id, when the worker read it)
        elif burst is not None and (r := _ROUND.match(msg)):
            burst["rounds"].append({"seqs": int(r[1]), "at_ms": t - burst["start"]})
        elif burst is not None and (s := _STEP.match(msg)):
            if burst["first_step_ms"] is None:
                burst["first_step_ms"] = t - burst["start"]
            burst["steps"].append(t)
            if s[2] == "0" and s[3] == "0":  # idle again: the burst is over
                del current[worker]
    for b in bursts:
        start, read, steps = b.pop("start"), b.pop("read"), b.pop("steps")
        after = [t - start for _, t in read]
        b.update(requests=len(read), spread_ms=after[-1], half_ms=_pct(after, 0.5), steps=len(steps))
        # The steady decode period, as the log's stamps space the step lines: the admission's steps and the last
        # (its audio behind no step) left out.
        periods = [y - x for x, y in zip(steps[2:-2], steps[3:-1], strict=True)]
        if len(periods) >= 10:
            b["step_period_ms_mean"] = round((steps[-2] - steps[2]) / (len(steps) - 4), 3)
            b["step_period_ms_p50"] = _pct(periods, 0.5)
        paths = [(api[rid], t) for rid, t in read if {"to worker", "sent"} <= api.get(rid, {}).keys()]
        if paths:  # the API processes' side of this burst
            first = min(x["to worker"] for x, _ in paths)
            handed = [x["to worker"] - first for x, _ in paths]
            sender = [x["sent"] - x["to worker"] for x, _ in paths]
            pipe = [t - x["sent"] for x, t in paths]
            b["api"] = {"requests": len(paths), "handed_spread_ms": max(handed), "handed_half_ms": _pct(handed, 0.5),
                        "sender_p50_ms": _pct(sender, 0.5), "sender_max_ms": max(sender),
                        "worker_read_p50_ms": _pct(pipe, 0.5), "worker_read_max_ms": max(pipe),
                        "first_handed_before_first_read_ms": start - first}
    return bursts


def describe(b: dict[str, Any]) -> str:
    rounds = ", ".join(f"{r['seqs']} at {r['at_ms']:.0f} ms" for r in b["rounds"]) or "none"
    first_step = "none" if b["first_step_ms"] is None else f"{b['first_step_ms']:.0f} ms"
    line = (f"worker {b['worker']}: {b['requests']} requests over {b['spread_ms']:.0f} ms (half by "
            f"{b['half_ms']:.0f} ms); admitted in {len(b['rounds'])} round(s): {rounds}; first step ended {first_step} "
            "after the first arrival")
    if "step_period_ms_mean" in b:
        line += f"; {b['steps']} steps, {b['step_period_ms_mean']:.2f} ms apart (mean)"
    if a := b.get("api"):
        line += (f"; their clients (API processes or bench.py's) handed them over in {a['handed_spread_ms']:.0f} ms "
                 f"(half by {a['handed_half_ms']:.0f}), sender threads {a['sender_p50_ms']:.1f} / "
                 f"{a['sender_max_ms']:.1f} ms (p50 / max), worker read {a['worker_read_p50_ms']:.1f} / "
                 f"{a['worker_read_max_ms']:.1f} ms")
    return line


def main(argv: list[str]) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(prog="profiler.py timeline", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("log", type=Path)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    bursts = timeline(a.log.read_text(errors="replace").splitlines())
    for b in bursts:
        print(describe(b))
    if a.out:
        a.out.write_text(json.dumps(bursts, indent=1))
    return bursts

