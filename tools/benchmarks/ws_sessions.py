"""Live-text WebSocket sessions against a running voxcpm-serve (/v1/audio/speech/stream): what a voice agent sees.

    python tools/bench.py ws ws://127.0.0.1:8000 --conc 1,16 --word-ms 50 --out ws.json

Per row, --conc sessions open together; each sends session.config (PCM), then the text one word per input.text
message every --word-ms (an LLM's token stream), then input.done, and reads until session.done. Per session:
- first_audio_after_boundary: from sending the word that completed the first segment (the first word past the end
  of segment 0's text, as its audio.done reports it; input.done where the text is one segment) to its first audio
  frame: the service's time to first audio of a live session;
- underruns: gaps where a listener who starts playing at the first frame and plays every frame back to back runs
  out of audio (the segments' pauses are in the frames, so a pause is no gap);
- audio seconds, segments, wall (connect to session.done), RTF = wall / audio seconds.
Each row also has the first-audio percentiles and the underrun totals over its sessions. --api-key sends the key as
`Authorization: Bearer`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from typing import Any

from tools.benchmarks.harness import (
    TEXT,
    command_line,
    count_underruns,
    mean,
    percentile,
    subcommand_parser,
    write_json,
)

ROUTE = "/v1/audio/speech/stream"


def words_of(text: str) -> list[tuple[int, str]]:
    """The text as word deltas ("word "), each with its offset in the text the service receives."""
    out, offset = [], 0
    for word in text.split():
        out.append((offset, word + " "))
        offset += len(word) + 1
    return out


async def session(a: argparse.Namespace, text: str, t0: float) -> dict[str, Any]:
    from websockets.asyncio.client import connect

    headers = {"Authorization": f"Bearer {a.api_key}"} if a.api_key else None
    config: dict[str, Any] = {"type": "session.config", "response_format": "pcm", "voice": a.voice,
                              "split_granularity": a.granularity}
    if a.patches:
        config["max_generate_length"] = a.patches
    if a.seed is not None:
        config["seed"] = a.seed
    words = words_of(text)
    sent_at: list[float] = []  # when each word left, since t0
    arrivals: list[float] = []
    durations: list[float] = []
    done_events: list[dict[str, Any]] = []
    done_sent: list[float] = []
    rate = 0

    async def feed(ws: Any) -> None:
        for _, word in words:
            sent_at.append(time.perf_counter() - t0)
            await ws.send(json.dumps({"type": "input.text", "text": word}))
            await asyncio.sleep(a.word_ms / 1000)
        done_sent.append(time.perf_counter() - t0)
        await ws.send(json.dumps({"type": "input.done"}))

    try:
        async with connect(a.url + ROUTE, additional_headers=headers, max_size=None, open_timeout=60) as ws:
            await ws.send(json.dumps(config))
            feeder = asyncio.create_task(feed(ws))
            try:
                async for msg in ws:
                    if isinstance(msg, bytes):
                        arrivals.append(time.perf_counter() - t0)
                        durations.append(len(msg) / 2 / rate)
                        continue
                    ev = json.loads(msg)
                    if ev["type"] == "audio.start":
                        rate = ev["sample_rate"]
                    elif ev["type"] == "audio.done":
                        done_events.append(ev)
                    elif ev["type"] == "error":
                        return {"error": ev["message"]}
                    elif ev["type"] == "session.done":
                        break
            finally:
                feeder.cancel()
    except Exception as e:  # noqa: BLE001  (a failed session is a result)
        return {"error": f"{type(e).__name__}: {e}"}
    if not arrivals or not done_events:
        return {"error": "the session produced no audio"}
    first_end = done_events[0]["text_end"]
    trigger = next((sent_at[i] for i, (offset, _) in enumerate(words) if offset >= first_end and i < len(sent_at)),
                   done_sent[0] if done_sent else sent_at[-1])
    gaps, gap_s = count_underruns(arrivals, durations)
    audio_s = sum(durations)
    wall = arrivals[-1]
    return {"first_boundary_s": trigger, "first_audio_s": arrivals[0],
            "first_audio_after_boundary": arrivals[0] - trigger, "audio_s": audio_s, "segments": len(done_events),
            "wall": wall, "rtf": wall / audio_s, "gaps": gaps, "gap_s": gap_s, "frames": len(arrivals),
            "input_done_s": done_sent[0] if done_sent else None}


async def run_row(a: argparse.Namespace, n: int, text: str) -> dict[str, Any]:
    t0 = time.perf_counter()
    results = await asyncio.gather(*(session(a, text, t0) for _ in range(n)))
    ok = [r for r in results if "error" not in r]
    errors = [r["error"] for r in results if "error" in r]
    first = [r["first_audio_after_boundary"] for r in ok]
    return {"sessions": n, "failed": len(errors), "errors": errors[:5],
            "first_audio_after_boundary_p50": percentile(first, 50),
            "first_audio_after_boundary_p95": percentile(first, 95),
            "first_audio_after_boundary_max": max(first) if first else None,
            "sessions_with_underrun": sum(1 for r in ok if r["gaps"] > 0),
            "underrun_gaps_total": sum(r["gaps"] for r in ok), "underrun_s_total": sum(r["gap_s"] for r in ok),
            "audio_s_mean": mean([r["audio_s"] for r in ok]), "segments_mean": mean([r["segments"] for r in ok]),
            "wall_mean": mean([r["wall"] for r in ok]), "rtf_mean": mean([r["rtf"] for r in ok]),
            "per_session": ok}


def main(argv: list[str]) -> dict[str, Any]:
    ap = subcommand_parser("ws", __doc__)
    ap.add_argument("url", help="the service, ws://host:port (http:// is taken as ws://)")
    ap.add_argument("--conc", default="1,16", help="comma list: sessions opened together, one row each")
    ap.add_argument("--word-ms", type=float, default=50.0, help="one word sent every this many milliseconds")
    ap.add_argument("--repeat", type=int, default=1, help="the protocol's text this many times over")
    ap.add_argument("--patches", type=int, help="max_generate_length per segment (default: the service's)")
    ap.add_argument("--granularity", choices=["sentence", "clause"], default="sentence")
    ap.add_argument("--voice", default="default")
    ap.add_argument("--seed", type=int)
    ap.add_argument("--api-key")
    ap.add_argument("--label", default="", help="a name for this run in the JSON")
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    a.url = a.url.rstrip("/").replace("http://", "ws://", 1).replace("https://", "wss://", 1)
    text = " ".join([TEXT] * a.repeat)
    doc: dict[str, Any] = {"tool": "bench_ws", "argv": command_line("ws", argv), "label": a.label, "url": a.url,
                           "route": ROUTE, "format": "pcm", "word_ms": a.word_ms, "words": len(text.split()),
                           "patches": a.patches, "granularity": a.granularity, "results": []}
    for n in [int(x) for x in a.conc.split(",") if x.strip()]:
        row = asyncio.run(run_row(a, n, text))
        doc["results"].append(row)
        print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items() if k != "per_session"},
              flush=True)
        write_json(a.out, doc)
    return doc
