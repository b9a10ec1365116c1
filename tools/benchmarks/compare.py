"""Side-by-side table of two `bench.py stream` result files (ours vs theirs), with ours/theirs ratios.

    python tools/bench.py compare ours.json nano.json --md compare.md

Also reads the anchor files of shared/bench/results (same keys). Ratios: for TTFB and RTF below 1 means
ours is faster; for throughput above 1 means ours serves more audio per second.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tools.benchmarks.harness import subcommand_parser


def load(path: str) -> dict[str, Any]:
    doc = json.loads(Path(path).read_text())
    doc.setdefault("engine", Path(path).stem)
    return doc


def rows_by_c(doc: dict[str, Any]) -> dict[int, dict[str, Any]]:
    return {int(r["concurrency"]): r for r in doc.get("results", [])}


def fmt(v: float | None, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or b is None or b == 0 else f"{a / b:.2f}"


def underruns(r: dict[str, Any] | None) -> str:
    if r is None:
        return "-"
    return f"{r.get('streams_with_underrun', 0)}/{r.get('requests', 0)} ({r.get('underrun_s_total', 0.0):.1f}s)"


def describe(doc: dict[str, Any]) -> str:
    startup = doc.get("startup_s")
    parts = [f"{doc.get('engine')} {doc.get('engine_version') or ''}".strip(),
             f"mode={doc.get('mode', 'zeroshot')}", f"patches={doc.get('patches')}", f"iters={doc.get('iters')}",
             f"startup={fmt(startup, '.1f')}s", f"gpu={doc.get('gpu_name') or '?'}"]
    pool = doc.get("pool") or {}
    if pool:
        parts.append(f"max_num_seqs={pool.get('max_num_seqs')} eager={pool.get('enforce_eager')}")
    if doc.get("complete") is False:
        parts.append("INCOMPLETE (cut off)")
    return ", ".join(parts)


def mismatches(ours: dict[str, Any], theirs: dict[str, Any]) -> list[str]:
    # A ratio is only meaningful under the same protocol; say so when it is not.
    notes = []
    for key in ("mode", "patches", "iters", "gpu_name", "sample_rate"):
        a, b = ours.get(key), theirs.get(key)
        if a is not None and b is not None and a != b:
            notes.append(f"{key} differs: ours {a!r} vs theirs {b!r}")
    return notes


def compare(ours: dict[str, Any], theirs: dict[str, Any]) -> str:
    o, t = rows_by_c(ours), rows_by_c(theirs)
    lines = [f"- ours: {describe(ours)}", f"- theirs: {describe(theirs)}"]
    lines += [f"- WARNING: {n}" for n in mismatches(ours, theirs)]
    lines += ["", "| c | TTFB p50 ours / theirs (s) | ratio | TTFB p95 ours / theirs (s) | ratio "
              "| RTF mean ours / theirs | ratio | audio-s/s ours / theirs | ratio "
              "| underruns ours | underruns theirs |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in sorted(set(o) | set(t)):
        a, b = o.get(c, {}), t.get(c, {})
        cells = [str(c)]
        for key, spec in (("ttfb_p50", ".3f"), ("ttfb_p95", ".3f"), ("rtf_mean", ".3f"),
                          ("throughput_audio_s_per_s", ".1f")):
            cells.append(f"{fmt(a.get(key), spec)} / {fmt(b.get(key), spec)}")
            cells.append(ratio(a.get(key), b.get(key)))
        cells += [underruns(a or None), underruns(b or None)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> None:
    ap = subcommand_parser("compare", __doc__)
    ap.add_argument("ours")
    ap.add_argument("theirs")
    ap.add_argument("--md", help="also write the table here (markdown)")
    a = ap.parse_args(argv)
    text = compare(load(a.ours), load(a.theirs))
    print(text, end="")
    if a.md:
        Path(a.md).write_text(f"# {Path(a.ours).name} vs {Path(a.theirs).name}\n\n{text}")
