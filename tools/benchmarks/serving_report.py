"""The serving-path table from one tools/gpu_host/bench.sh output folder (parts ours, ours_window, ours_hifi, http,
encode): each HTTP sweep beside the in-process pool measured back to back with it, with the targets' ratios.

    python tools/bench.py serving-report docs/results/serving_2026-11-27/h100_16vcpu_bda0af5 \
        [--reference pool_window.json]

The reference pool is the one with the service's engine settings (its coalescing window) unless --reference
names another file; HiFi rows use pool_hifi.json. With the folder's encode.json (`bench.py encode`), a last line
says what the host's LAME can do: MP3 throughput over HTTP cannot pass LAME's rate on the cores the API processes
have, so a host whose LAME on its cores runs near the pool's rate is CPU-bound there, not the serving path.
A run of the http_env part (rounds of services compared, files http_r<round>_<variant>_<mp3|pcm>_*.json) gets
one row per variant (and format, when not MP3) and concurrency: the mean over the rounds, and each round's value.
"""

from __future__ import annotations

import json
import re
import statistics
from collections import defaultdict
from pathlib import Path

from tools.benchmarks.harness import subcommand_parser


def rows(path: Path) -> dict[int, dict]:
    return {r["concurrency"]: r for r in json.loads(path.read_text())["results"]} if path.exists() else {}


def http_rows(run: Path, name: str) -> dict[int, dict]:
    return {**rows(run / f"http_{name}_a.json"), **rows(run / f"http_{name}_b.json")}


def versus(h: dict, p: dict) -> tuple[float, float]:
    """An HTTP row against the pool's at the same concurrency: throughput share (%) and TTFB p95 excess (ms)."""
    return (100 * h["throughput_audio_s_per_s"] / p["throughput_audio_s_per_s"],
            1000 * (h["ttfb_p95"] - p["ttfb_p95"]))


def table(run: Path, name: str, pool: dict[int, dict]) -> list[str]:
    out = []
    for c, h in sorted(http_rows(run, name).items()):
        p = pool.get(c)
        if p is None:
            continue
        share, excess = versus(h, p)
        out.append(f"| {name} | {c} | {p['throughput_audio_s_per_s']:.1f} | {h['throughput_audio_s_per_s']:.1f} "
                   f"({share:.1f}%) | {p['ttfb_p95']:.3f} | {h['ttfb_p95']:.3f} "
                   f"({excess:+.0f} ms) | {h['rtf_mean'] / p['rtf_mean']:.2f}x | "
                   f"{h['streams_with_underrun']} | {h.get('service_cores_mean', 0):.1f} | "
                   f"{h.get('client_cores_mean', 0):.1f} |")
    return out


def rounds_table(run: Path, pool: dict[int, dict]) -> list[str]:
    """Rounds of the http_env part: per variant (and format) and concurrency, the mean over rounds (each round's in
    brackets)."""
    runs: dict[tuple[str, int], list[dict]] = defaultdict(list)
    for path in sorted(run.glob("http_r*_a.json")):
        m = re.fullmatch(r"http_r(\d+)_(\w+?)_(mp3|pcm)_a\.json", path.name)
        if m:
            for c, h in http_rows(run, f"r{m[1]}_{m[2]}_{m[3]}").items():
                runs[m[2] if m[3] == "mp3" else f"{m[2]} {m[3]}", c].append(h)
    out = ["| variant | c | rounds | pool audio-s/s | HTTP audio-s/s: mean share (each) | HTTP TTFB p95 excess: mean "
           "(each) | streams that underran (each) | service cores |", "|---|---|---|---|---|---|---|---|"]
    for (name, c), hs in sorted(runs.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        p = pool.get(c)
        if p is None:
            continue
        shares, excess = (list(x) for x in zip(*(versus(h, p) for h in hs), strict=True))
        out.append(f"| {name} | {c} | {len(hs)} | {p['throughput_audio_s_per_s']:.1f} | "
                   f"{statistics.mean(shares):.1f}% ({', '.join(f'{x:.1f}' for x in shares)}) | "
                   f"{statistics.mean(excess):+.0f} ms ({', '.join(f'{x:+.0f}' for x in excess)}) | "
                   f"{', '.join(str(h['streams_with_underrun']) for h in hs)} | "
                   f"{statistics.mean(h.get('service_cores_mean', 0) for h in hs):.1f} |")
    return out if len(out) > 2 else []


def host_lame(run: Path) -> str:
    """MP3 on this host (encode.json, at its quality; files without one: 2): one thread's rate, the best rate over the
    thread counts measured (and per thread there), the client path's cost and the burst floor, where the file has
    them."""
    path = run / "encode.json"
    if not path.exists():
        return ""
    doc = json.loads(path.read_text())
    threads = {r.get("threads"): r.get("audio_s_per_s") for r in doc.get("mp3_threads", [])}
    threads = {n: rate for n, rate in threads.items() if n and rate}
    if not threads:
        return ""
    best = max(threads, key=lambda n: threads[n])
    line = (f"Host LAME (192 kbps q{doc.get('mp3_quality', 2)}, {doc.get('cpus', '?')} vCPUs): 1 thread "
            f"{threads.get(1, float('nan')):.1f} audio-s/s; at most {threads[best]:.1f} audio-s/s, on {best} threads "
            f"({threads[best] / best:.1f} per thread busy; threads measured: "
            f"{', '.join(str(n) for n in sorted(threads))})")
    for row in doc.get("client_path", []):
        cost = row.get("core_s_per_audio_s", float("nan"))
        line += f"; the client path, {row.get('format')}: {cost:.4f} core-s per audio-s"
    for row in doc.get("burst", []):
        line += (f"; {row.get('streams')} first chunks at once on {row.get('threads')} threads: the last encoded "
                 f"after {row.get('last_ms', float('nan')):.1f} ms")
    return line


def main(argv: list[str]) -> None:
    ap = subcommand_parser("serving-report", __doc__)
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
    if lame := host_lame(a.run):
        print("\n" + lame)
