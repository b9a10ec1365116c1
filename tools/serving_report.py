"""The serving-path table from one device call's files (tools/device_bench.sh parts ours, ours_window, ours_hifi,
http, encode): each HTTP sweep beside the in-process pool measured in the same call, with the targets' ratios.

    python tools/serving_report.py docs/results/serving_2026-11-26/run7 [--reference pool_window.json]

The reference pool is the one with the service's engine settings (its coalescing window) unless --reference
names another file; HiFi rows use pool_hifi.json. A call of the http_env part (rounds of services compared,
files http_r<round>_<variant>_mp3_*.json) gets one row per variant and concurrency: the mean over the rounds,
and each round's value.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from collections import defaultdict
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


def rounds_table(run: Path, pool: dict[int, dict]) -> list[str]:
    """Rounds of the http_env part: per variant and concurrency, the mean over rounds (each round's in brackets)."""
    runs: dict[tuple[str, int], list[dict]] = defaultdict(list)
    for path in sorted(run.glob("http_r*_mp3_a.json")):
        m = re.fullmatch(r"http_r(\d+)_(\w+?)_mp3_a\.json", path.name)
        if m:
            for c, h in http_rows(run, f"r{m[1]}_{m[2]}_mp3").items():
                runs[m[2], c].append(h)
    out = ["| variant | c | rounds | pool audio-s/s | HTTP audio-s/s: mean share (each) | HTTP TTFB p95 excess: mean "
           "(each) | streams that underran (each) | service cores |", "|---|---|---|---|---|---|---|---|"]
    for (name, c), hs in sorted(runs.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        p = pool.get(c)
        if p is None:
            continue
        shares = [100 * h["throughput_audio_s_per_s"] / p["throughput_audio_s_per_s"] for h in hs]
        excess = [1000 * (h["ttfb_p95"] - p["ttfb_p95"]) for h in hs]
        out.append(f"| {name} | {c} | {len(hs)} | {p['throughput_audio_s_per_s']:.1f} | "
                   f"{statistics.mean(shares):.1f}% ({', '.join(f'{x:.1f}' for x in shares)}) | "
                   f"{statistics.mean(excess):+.0f} ms ({', '.join(f'{x:+.0f}' for x in excess)}) | "
                   f"{', '.join(str(h['streams_with_underrun']) for h in hs)} | "
                   f"{statistics.mean(h.get('service_cores_mean', 0) for h in hs):.1f} |")
    return out if len(out) > 2 else []


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", type=Path)
    ap.add_argument("--reference", default="pool_window.json")
    a = ap.parse_args(argv)
    pool, hifi = rows(a.run / a.reference), rows(a.run / "pool_hifi.json")
    print("| route | c | pool audio-s/s | HTTP audio-s/s (share) | pool TTFB p95 | HTTP TTFB p95 (excess) | "
          "RTF HTTP/pool | streams that underran | service cores | client cores |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    names = ("mp3", "pcm", "speech", "mp3_httpx", "pcm_httpx")
    for lines in [table(a.run, name, pool) for name in names] + [table(a.run, "hifi", hifi)]:
        if lines:
            print("\n".join(lines))
    if rounds := rounds_table(a.run, pool):
        print("\n" + "\n".join(rounds))


if __name__ == "__main__":
    main()
