"""Where the device's time goes between and inside steady-state decode steps, on a GPU: c streams of the
benchmark's text run in-process (pipelined, as the pool runs them), torch.profiler records a window of steps, and
the trace is reduced to the period per step, the time no kernel or copy runs (idle gaps, grouped by the kernels
around them), the host<->device copies per step and the kernel time per step by name.

    python tools/trace_step.py --model /tmp/full --conc 1,8 --out trace.json

`tools/profile_step.py` times components in isolation; this shows what they leave between them in the engine.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from tools.benchlib import TEXT  # noqa: E402


def device_events(prof: torch.profiler.profile) -> list[dict]:
    """Kernels, copies and memsets of the trace: name, start and end in microseconds, kind, stream."""
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        trace = json.loads(Path(f.name).read_text())
    out = []
    for e in trace.get("traceEvents", []):
        cat = e.get("cat", "")
        if cat in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e:
            out.append({"name": e["name"], "start": float(e["ts"]), "end": float(e["ts"]) + float(e["dur"]),
                        "kind": cat, "stream": e.get("args", {}).get("stream")})
    out.sort(key=lambda e: e["start"])
    return out


def reduce(events: list[dict], start: float, end: float, steps: int, top: int = 12) -> dict:
    """Per step: the window's period, the busy union, the idle gaps (> 0.2 us) by the kernels around them, the
    copies, and the kernel time by name (overlapping PDL launches counted each in full)."""
    gaps: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    busy_until, last = start, events[0]  # (the window starts on an event)
    busy = 0.0
    for e in events:
        if e["start"] > busy_until + 0.2:
            key = f"{last['name'][:40]} -> {e['name'][:40]}"
            gaps[key][0] += e["start"] - busy_until
            gaps[key][1] += 1
        if e["end"] > busy_until:
            busy += e["end"] - max(e["start"], busy_until)
            busy_until, last = e["end"], e
    copies: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    names: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for e in events:
        table = copies if e["kind"] != "kernel" else names
        table[e["name"][:70]][0] += e["end"] - e["start"]
        table[e["name"][:70]][1] += 1
    per = 1000.0 * steps  # us over the window -> ms per step
    idle = sum(v[0] for v in gaps.values())
    return {
        "steps": steps, "period_ms": (end - start) / per, "busy_ms": busy / per, "idle_ms": idle / per,
        "idle_gaps": [{"between": k, "ms_per_step": v[0] / per, "per_step": v[1] / steps}
                      for k, v in sorted(gaps.items(), key=lambda kv: -kv[1][0])[:top]],
        "copies": [{"name": k, "ms_per_step": v[0] / per, "per_step": v[1] / steps}
                   for k, v in sorted(copies.items(), key=lambda kv: -kv[1][0])],
        "kernels": [{"name": k, "ms_per_step": v[0] / per, "per_step": v[1] / steps}
                    for k, v in sorted(names.items(), key=lambda kv: -kv[1][0])[:top]],
    }


def step_sequence(events: list[dict], start: float, end: float) -> list[dict]:
    """One step's device events in start order, runs of the same name merged: name, count, summed duration (us),
    and the idle time before the run (us, against everything that started before it)."""
    runs: list[dict] = []
    busy_until = start
    for e in (e for e in events if start <= e["start"] < end):
        idle = max(0.0, e["start"] - busy_until)
        busy_until = max(busy_until, e["end"])
        name = e["name"][:60]
        if runs and runs[-1]["name"] == name:
            runs[-1]["n"] += 1
            runs[-1]["us"] += e["end"] - e["start"]
            runs[-1]["idle_us"] += idle
        else:
            runs.append({"name": name, "n": 1, "us": e["end"] - e["start"], "idle_us": idle})
    return runs


def trace(engine: LLMEngine, c: int, warm: int, steps: int) -> dict:
    from torch.profiler import ProfilerActivity, profile

    for i in range(c):
        engine.add_request(TEXT, SamplingParams(seed=i, max_generate_length=warm + steps + 10))
    for _ in range(warm):
        engine.step()
    torch.cuda.synchronize()
    # Pipelined, each step() launches one step and reads the one before: `steps` calls cover `steps` device steps.
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        host_ms = 1000 * (time.perf_counter() - t0) / steps
    while engine.has_unfinished():
        engine.step()
    events = device_events(prof)
    # Whole steps only: the DiT's Euler updates come in one cluster per step (~0.4 ms apart inside it, the encoder
    # and the LMs between clusters); the window runs from the first cluster's start to the last one's.
    marks = [e["start"] for e in events if "dit_output_euler" in e["name"]]
    firsts = [t for i, t in enumerate(marks) if i == 0 or t - marks[i - 1] > 1000.0]
    if len(firsts) < 3:
        raise RuntimeError(f"only {len(firsts)} steps found in the trace (marker kernel _dit_output_euler_kernel)")
    window = [e for e in events if firsts[0] <= e["start"] < firsts[-1]]
    out = reduce(window, firsts[0], firsts[-1], len(firsts) - 1, top=40)
    out["one_step"] = step_sequence(events, firsts[-2], firsts[-1])
    out["host_ms_per_step_call"] = host_ms
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--conc", default="1,8")
    ap.add_argument("--warm", type=int, default=30, help="steps before the window (the context grows as in the "
                    "benchmark's first patches)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--sequence", action="store_true", help="also print one step's device events in order")
    ap.add_argument("--out")
    a = ap.parse_args()
    concs = [int(x) for x in a.conc.split(",")]
    engine = LLMEngine(a.model, EngineConfig(max_num_seqs=max(concs), max_model_len=1024,
                                             gpu_memory_utilization=0.8), device="cuda")
    res: dict = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "command": " ".join(sys.argv),
                 "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "conc": {}}
    for c in concs:
        trace(engine, c, 5, 5)  # warm-up of the profiler and the shapes
        r = res["conc"][str(c)] = trace(engine, c, a.warm, a.steps)
        print(f"\nc={c}: period {r['period_ms']:.3f} ms per step, busy {r['busy_ms']:.3f}, idle {r['idle_ms']:.3f}; "
              f"host step() call {r['host_ms_per_step_call']:.3f} ms")
        print("  idle gaps:")
        for g in r["idle_gaps"]:
            print(f"    {1000 * g['ms_per_step']:7.1f} us {g['per_step']:5.1f}x  {g['between']}")
        print("  copies:")
        for g in r["copies"]:
            print(f"    {1000 * g['ms_per_step']:7.1f} us {g['per_step']:5.1f}x  {g['name']}")
        print("  kernels:")
        for g in r["kernels"]:
            print(f"    {1000 * g['ms_per_step']:7.1f} us {g['per_step']:5.1f}x  {g['name']}")
        if a.sequence:
            print("  one step in order (runs of a kernel merged: count, summed us, idle us before):")
            for run in r["one_step"]:
                print(f"    {run['n']:4d}x {run['us']:8.1f} us  idle {run['idle_us']:6.1f}  {run['name']}")
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
