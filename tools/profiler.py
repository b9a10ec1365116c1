"""The profilers, one entry point: `python tools/profiler.py SUBCOMMAND [flags]`; `SUBCOMMAND --help` lists its flags.

    python tools/profiler.py step --model /tmp/full --batch 1,64 --kernels --out profile.json
    python tools/profiler.py trace --model /tmp/full --conc 1,8 --out trace.json
    python tools/profiler.py pyspy pyspy.txt --phases
    python tools/profiler.py timeline service.log --out timeline.json

step and trace profile the engine's decode step on a GPU; pyspy and timeline read what a running service left (a
py-spy record, its DEBUG log). The code is in tools/profiling/. (Not tools/profile.py: a script's folder comes first on
the path, where that name would stand in for the standard library's profile module, which torch._dynamo imports.)
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

# `python tools/profiler.py` puts tools/ first on the path; the profilers import the engine and the benchmarks' harness
# from the repository root.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tools import subcommands  # noqa: E402

# subcommand -> (its function in tools.profiling, "module:function", imported only when it runs: step imports torch;
# what it profiles)
SUBCOMMANDS: subcommands.Table = {
    "step": ("step:step_main", "each component of a decode step in its own CUDA graph, and a request's first audio"),
    "trace": ("step:trace_main", "a torch.profiler trace of steady decode steps: period, idle gaps, copies, kernels"),
    "pyspy": ("pyspy:main", "a py-spy raw record by process and function; --phases: a worker's start by phase"),
    "timeline": ("timeline:main", "each burst's arrivals and admission rounds, from the service's DEBUG log"),
}


def main(argv: list[str] | None = None) -> Any:
    """Run one subcommand; returns what it returns."""
    return subcommands.run("profiler.py", __doc__, "tools.profiling", SUBCOMMANDS,
                           sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    main()
