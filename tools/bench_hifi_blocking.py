"""HiFi blocking concurrency: bursts of c whole-utterance requests (/generate_blocking over HTTP; in
process the chunks collected) cloning one cached HiFi voice.

    python tools/bench_hifi_blocking.py --model CKPT --conc 1,5,10 --out hifi_blocking.json
    python tools/bench_hifi_blocking.py --target http --url URL --format mp3 --conc 1,5,10

TTFB here is the first byte of the response: over HTTP the body starts once the whole utterance is
generated (and encoded); in process the audio is in hand when its last chunk is, so TTFB = wall. RTF =
wall / audio seconds; a blocking response cannot underrun.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_hifi_stream  # noqa: E402
import benchlib as bl  # noqa: E402


async def body(target: bl.Target, a: argparse.Namespace, run: bl.Run, bar: Any) -> None:
    await bench_hifi_stream.body(target, a, run, bar, blocking=True)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    a = bench_hifi_stream.parse_args(argv, __doc__, __file__)
    return bl.run_tool("hifi_blocking", a, {"iters": a.iters, "conc": a.conc}, body,
                       total=len(a.conc) * (a.iters + 1), extra_columns=[("wall_mean", "wall", "7.3f")])


if __name__ == "__main__":
    main()
