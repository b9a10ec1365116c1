"""HiFi streaming concurrency: bursts of c streamed requests cloning one cached HiFi voice (one clip as
continuation prompt and as reference: /add_hifi over HTTP; in process a cached prompt plus the reference
latents with each request).

    python tools/bench_hifi_stream.py --model CKPT --conc 1,5,10 --out hifi_stream.json
    python tools/bench_hifi_stream.py --target http --url URL --format mp3 --conc 1,5,10

Per concurrency: one warm-up burst, then --iters counted bursts. Defaults follow the anchors' HiFi runs
(40 patches, c = 1, 5, 10).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import benchlib as bl  # noqa: E402


def parse_args(argv: list[str] | None = None, doc: str | None = __doc__, tool_file: str = __file__
               ) -> argparse.Namespace:
    """The options of both HiFi tools (`doc` and `tool_file`: the calling tool's)."""
    ap = bl.parser(doc, conc="1,5,10", patches=40, iters=2)
    a = ap.parse_args(argv)
    return bl.finish_args(ap, a, max(a.conc), argv, tool_file)


async def body(target: bl.Target, a: argparse.Namespace, run: bl.Run, bar: Any, blocking: bool = False) -> None:
    """Bursts per concurrency cloning one cached HiFi voice; also the body of bench_hifi_blocking."""
    voice = await target.voice("hifi", bl.synthetic_clip_wav(a.clip_seconds))
    for c in a.conc:
        run.add(await bl.bursts(target, lambda it, n: [bl.Req(a.text, a.patches, voice) for _ in range(n)], c,
                                a.iters, bar, label=f"hifi{'-blocking' if blocking else ''} c={c}", blocking=blocking))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    a = parse_args(argv)
    return bl.run_tool("hifi_stream", a, {"iters": a.iters, "conc": a.conc}, body,
                       total=len(a.conc) * (a.iters + 1))


if __name__ == "__main__":
    main()
