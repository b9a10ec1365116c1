"""The serving-path table from one device call's files (tools/device_bench.sh parts ours, ours_window, ours_hifi,
http, encode): each HTTP sweep beside the in-process pool measured in the same call, with the targets' ratios.

    python tools/serving_report.py docs/results/serving_2026-11-26/run7 [--reference pool_window.json]

The reference pool is the one with the service's engine settings (its coalescing window) unless --reference
names another file; HiFi rows use pool_hifi.json.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def rows(path: Path) -> dict[int, dict]:
    return {r["concurrency"]: r for r in json.loads(path.read_text())["results"]} if path.exists() else {}


def http_rows(run: Path, name: str) -> dict[int, dict]:
    return {**rows(run / f"http_{name}_a.json"), **rows(run / f"http_{name}_b.json")}


def table(run: Path, name: str, pool: dict[int, dict]) -> list[str]:
    out = []
    for c, h in sorted(http_rows(run, name).items()):
        p = pool.get(c)
        if p is None:
            continue
        share = h["throughput_audio_s_per_s"] / p["throughput_audio_s_per_s"]
        out.append(f"| {name} | {c} | {p['throughput_audio_s_per_s']:.1f} | {h['throughput_audio_s_per_s']:.1f} "
                   f"({100 * share:.1f}%) | {p['ttfb_p95']:.3f} | {h['ttfb_p95']:.3f} "
                   f"({1000 * (h['ttfb_p95'] - p['ttfb_p95']):+.0f} ms) | {h['rtf_mean'] / p['rtf_mean']:.2f}x | "
                   f"{h['streams_with_underrun']} | {h.get('service_cores_mean', 0):.1f} | "
                   f"{h.get('client_cores_mean', 0):.1f} |")
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", type=Path)
    ap.add_argument("--reference", default="pool_window.json")
    a = ap.parse_args(argv)
    pool, hifi = rows(a.run / a.reference), rows(a.run / "pool_hifi.json")
    print("| route | c | pool audio-s/s | HTTP audio-s/s (share) | pool TTFB p95 | HTTP TTFB p95 (excess) | "
          "RTF HTTP/pool | streams that underran | service cores | client cores |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name in ("mp3", "pcm", "speech"):
        print("\n".join(table(a.run, name, pool)))
    print("\n".join(table(a.run, "hifi", hifi)))


if __name__ == "__main__":
    main()
