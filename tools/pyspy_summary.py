"""Summarise a `py-spy record --format raw --subprocesses` file: where the samples went, by process and by the
innermost Python function (a sample of a thread waiting for the GIL counts where it waits).

    python tools/pyspy_summary.py pyspy.txt [--top 25] [--json out.json]
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import sys


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


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("raw")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    doc = summarise(a.raw, a.top)
    print(f"{doc['samples']} samples")
    for row in doc["by_process"]:
        print(f"  {100 * row['share']:5.1f}%  {row['process']}")
    for row in doc["by_function"]:
        print(f"  {100 * row['share']:5.1f}%  {row['function']}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(doc, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
