"""Summarise a `py-spy record --format raw --subprocesses` file: where the samples went, by process and by the
innermost Python function (a sample of a thread waiting for the GIL counts where it waits). With `--phases`, a
start-up record (`--idle`, as tools/gpu_host/bench.sh's COLD_PYSPY takes it): the engine worker's main thread by
start-up phase, each with its innermost functions (with --idle a sample is wall time, waits included).

    python tools/profiler.py pyspy pyspy.txt [--top 25] [--json out.json] [--phases]
"""

from __future__ import annotations

import argparse
import collections
import json
import re


def summarise(path: str, top: int) -> dict:
    by_process: collections.Counter[str] = collections.Counter()
    by_function: collections.Counter[str] = collections.Counter()
    total = 0
    with open(path) as f:
        lines = f.readlines()
    for line in lines:
        stack, _, count = line.rstrip("\n").rpartition(" ")
        if not count.isdigit():
            continue
        n = int(count)
        frames = stack.split(";")
        processes = [f for f in frames if f.startswith("process ")]
        # the innermost process frame: py-spy nests a child's stacks under its parent's
        proc = re.sub(r':"(.{0,60}).*"$', r': \1', processes[-1]) if processes else "?"
        code = [f for f in frames if not f.startswith(("process ", "thread "))]
        by_process[proc] += n
        by_function[code[-1] if code else "(no Python frame)"] += n
        total += n
    return {"samples": total,
            "by_process": [{"process": k, "share": v / total} for k, v in by_process.most_common(top)],
            "by_function": [{"function": k, "share": v / total} for k, v in by_function.most_common(top)]}


# The worker's start-up phases, by a function on the stack (the first that matches, in this order); a stack under the
# worker's entry point that matches none has not reached worker_main yet: the imports.
START_PHASES = (
    ("load", "load_model ("),
    ("kv_sizing", "profile_num_blocks ("),
    ("graphs", "capture_graphs ("),
    ("warm_up", "warm_up ("),
    ("kernel_cache", "kernel_cache.py"),  # the manifest lookup before the load, and any wait for the precompile
    ("cuda_init", "set_device ("),
    ("engine_other", "llm_engine.py"),
    ("worker_other", "worker_main ("),
)


def start_phases(path: str, top: int) -> dict:
    """The worker's main-thread samples (stacks under `_run_worker`) by start-up phase, with each phase's innermost
    functions."""
    phases: collections.Counter[str] = collections.Counter()
    inner: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    total = 0
    with open(path) as f:
        for line in f:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            if not count.isdigit() or "_run_worker (" not in stack:
                continue
            phase = next((name for name, frame in START_PHASES if frame in stack), "imports")
            frames = [f for f in stack.split(";") if not f.startswith(("process ", "thread "))]
            phases[phase] += int(count)
            inner[phase][frames[-1] if frames else "(no Python frame)"] += int(count)
            total += int(count)
    return {"worker_samples": total,
            "phases": [{"phase": name, "share": n / total if total else 0.0, "samples": n,
                        "top": [{"function": k, "samples": v} for k, v in inner[name].most_common(top)]}
                       for name, n in phases.most_common()]}


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(prog="profiler.py pyspy", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("raw")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--json")
    ap.add_argument("--phases", action="store_true", help="a start-up record: the worker's phases")
    a = ap.parse_args(argv)
    doc = summarise(a.raw, a.top)
    if a.phases:
        doc["start"] = start_phases(a.raw, a.top)
        print(f"worker main thread: {doc['start']['worker_samples']} samples")
        for row in doc["start"]["phases"]:
            print(f"  {100 * row['share']:5.1f}%  {row['phase']}")
            for fn in row["top"][:8]:
                print(f"           {fn['samples']:6d}  {fn['function']}")
    print(f"{doc['samples']} samples")
    for row in doc["by_process"]:
        print(f"  {100 * row['share']:5.1f}%  {row['process']}")
    for row in doc["by_function"]:
        print(f"  {100 * row['share']:5.1f}%  {row['function']}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(doc, f, indent=1)

