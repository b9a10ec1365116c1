"""HTTP burst benchmark of a running voxcpm-serve: what its clients see, and what the service burns for it.

    python tools/bench.py http http://127.0.0.1:8000 --conc 1,8,32,64,128 --procs 8 --format mp3 \
        --pid SERVICE_PID --out http_mp3.json

The protocol of `bench.py stream` (per concurrency: one warm-up burst, then --iters counted bursts of c
requests at once; TTFB = first audio byte after the burst began, RTF = wall / audio seconds, underruns for a
listener who starts at the first byte; throughput = audio seconds / burst wall) from the client's side, over
--procs client processes that start each burst together: one Python client process cannot drive more than ~32
streams (its own core saturates and the numbers become the client's). Each request's send is timed too (httpcore's
trace: when its body was on the wire, when the response headers came): `sent_*` is the client's own delay within a
burst, `ttfb_after_send_*` the part of TTFB that is the service's.

--client raw replaces httpx with a lean HTTP/1.1 client (h11 on asyncio streams): each stream's keep-alive
connection is opened before the first burst and its request bytes are made before each burst's start, so a
process puts all its requests on the wire within a millisecond (httpx takes 2-3 ms a request: at c=128 the
last requests of a burst left 40-50 ms after it began, and TTFB counted from the burst's start included that).
The responses are read and timed the same way.

Routes: /generate (--route generate), /v1/audio/speech streaming (--route speech); --voice hifi registers one
synthetic 5 s clip with /add_hifi and sends its hifi_id. Audio seconds come from the bytes: PCM exactly, MP3
from its frame headers.

With --pid (the service's main process), the CPU time of it and every process under it is read at the start
and end of each concurrency (warm-up burst included) and reported per role, by process name (the service
names its processes voxcpm-worker<i> and voxcpm-api<i>): cores used on average, and core-seconds per audio
second (the capacity-planning figure).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import multiprocessing as mp
import time
import urllib.parse
from typing import Any

from tools.benchmarks.harness import (
    CFG_VALUE,
    CLIP_TEXT,
    TEMPERATURE,
    TEXT,
    Mp3Counter,
    command_line,
    mean,
    percentile,
    request_record,
    request_stats,
    subcommand_parser,
    synthetic_clip_wav,
    write_json,
)


def long_text(chars: int) -> str:
    """The protocol's paragraph again and again (a paragraph break between), cut after the last whole sentence that
    fits `chars`: a long-form request, spoken as segments of `max_generate_length` patches each."""
    text = "\n\n".join([TEXT] * (chars // len(TEXT) + 1))[:chars]
    return text[:text.rfind(".") + 1]


def body_of(a: argparse.Namespace, hifi_id: str | None, sample_rate: int) -> tuple[str, dict[str, Any]]:
    text = long_text(a.text_chars) if a.text_chars else TEXT
    if a.route == "speech":
        body: dict[str, Any] = {"model": "tts-1", "input": text, "voice": hifi_id or "default",
                                "response_format": a.format, "max_generate_length": a.patches}
        if a.format == "pcm":  # the model's rate, as /generate sends (OpenAI's pcm default, 24 kHz, is resampled)
            body["sample_rate"] = sample_rate
        return "/v1/audio/speech", body
    body = {"target_text": text, "max_generate_length": a.patches, "cfg_value": CFG_VALUE,
            "temperature": TEMPERATURE, "response_format": a.format}
    if hifi_id:
        body["hifi_id"] = hifi_id
    return "/generate", body


def counter(fmt: str, sample_rate: int):  # noqa: ANN201 (bytes -> seconds)
    if fmt == "mp3":
        return Mp3Counter().feed
    held = [0]

    def pcm(data: bytes) -> float:  # a network piece may end mid-sample
        held[0] += len(data)
        n, held[0] = divmod(held[0], 2)
        return n / sample_rate

    return pcm


def timed_record(arrivals: list[float], durations: list[float], sent: float | None,
                 headers: float | None) -> dict[str, Any]:
    """One request's record (without its per-piece lists) and when its send and its response headers happened."""
    rec = request_record(arrivals, durations)
    del rec["arrivals"], rec["durations"]
    rec["sent"], rec["headers"] = sent, headers
    return rec


async def client_bursts(a: argparse.Namespace, n: int, bursts: int, barrier: Any, hifi_id: str | None,
                        sample_rate: int) -> list[list[dict[str, Any]]]:
    import httpx

    path, body = body_of(a, hifi_id, sample_rate)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=1024)
    out = []
    async with httpx.AsyncClient(base_url=a.url, timeout=httpx.Timeout(600.0), limits=limits) as client:
        for _ in range(bursts):
            await asyncio.to_thread(barrier.wait)
            t0 = time.perf_counter()

            async def one(t0: float = t0) -> dict[str, Any]:
                count = counter(a.format, sample_rate)
                arrivals, durations = [], []
                marks: dict[str, float] = {}

                async def trace(event: str, info: dict[str, Any]) -> None:  # httpcore's progress of this request
                    if event in (SENT, HEADERS):
                        marks[event] = time.perf_counter() - t0

                try:
                    async with client.stream("POST", path, json=body, extensions={"trace": trace}) as r:
                        if r.status_code != 200:
                            return {"error": f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"}
                        async for data in r.aiter_raw():
                            seconds = count(data)
                            if seconds > 0:
                                arrivals.append(time.perf_counter() - t0)
                                durations.append(seconds)
                    return timed_record(arrivals, durations, marks.get(SENT), marks.get(HEADERS))
                except Exception as e:  # noqa: BLE001  (a failed request is a result)
                    return {"error": f"{type(e).__name__}: {e}"}

            out.append(await asyncio.gather(*(one() for _ in range(n))))
    return out


async def raw_bursts(a: argparse.Namespace, n: int, bursts: int, barrier: Any, hifi_id: str | None,
                     sample_rate: int) -> list[list[dict[str, Any]]]:
    """client_bursts on h11 and asyncio streams: connections opened and requests made before a burst starts."""
    import h11

    url = urllib.parse.urlsplit(a.url)
    host, port = url.hostname or "127.0.0.1", url.port or 80
    path, body = body_of(a, hifi_id, sample_rate)
    payload = json.dumps(body).encode()
    headers = [("Host", url.netloc), ("Content-Type", "application/json"), ("Content-Length", str(len(payload)))]

    async def connect() -> tuple[asyncio.StreamReader, asyncio.StreamWriter, h11.Connection]:
        reader, writer = await asyncio.open_connection(host, port)
        return reader, writer, h11.Connection(h11.CLIENT)

    async def one(link: tuple[asyncio.StreamReader, asyncio.StreamWriter, h11.Connection], t0: float,
                  sent: float) -> dict[str, Any]:
        reader, _, conn = link
        count = counter(a.format, sample_rate)
        arrivals, durations, status, headers_at, error = [], [], 0, None, b""
        try:
            while True:
                ev = conn.next_event()
                if ev is h11.NEED_DATA:
                    conn.receive_data(await reader.read(1 << 16))
                elif isinstance(ev, h11.Response):
                    status, headers_at = ev.status_code, time.perf_counter() - t0
                elif isinstance(ev, h11.Data):
                    if status != 200:
                        error += ev.data
                    elif (seconds := count(ev.data)) > 0:
                        arrivals.append(time.perf_counter() - t0)
                        durations.append(seconds)
                elif isinstance(ev, h11.EndOfMessage | h11.ConnectionClosed):
                    break
            if status != 200:
                return {"error": f"HTTP {status}: {error[:200]!r}"}
            return timed_record(arrivals, durations, sent, headers_at)
        except Exception as e:  # noqa: BLE001  (a failed request is a result)
            return {"error": f"{type(e).__name__}: {e}"}

    links = [await connect() for _ in range(n)]
    out = []
    for _ in range(bursts):
        wires = [conn.send(h11.Request(method="POST", target=path, headers=headers)) + conn.send(h11.Data(data=payload))
                 + conn.send(h11.EndOfMessage()) for _, _, conn in links]
        await asyncio.to_thread(barrier.wait)
        t0 = time.perf_counter()
        sent = []
        for (_, writer, _), wire in zip(links, wires, strict=True):
            writer.write(wire)  # straight into the socket: asyncio writes at once when the buffer is empty
            sent.append(time.perf_counter() - t0)
        out.append(await asyncio.gather(*(one(link, t0, s) for link, s in zip(links, sent, strict=True))))
        for i, (_, writer, conn) in enumerate(links):  # the next request on the same connection, or a new one
            if conn.our_state is h11.DONE and conn.their_state is h11.DONE:
                conn.start_next_cycle()
            else:
                writer.close()
                links[i] = await connect()
    for _, writer, _ in links:
        writer.close()
    return out


SENT = "http11.send_request_body.complete"  # the request is on the wire: what came before is the client's
HEADERS = "http11.receive_response_headers.complete"  # the service accepted it (a stream's headers go out at once)


def send_stats(reqs: list[dict[str, Any]]) -> dict[str, Any]:
    """When the client got each request onto the wire after the burst began, when the response headers came, and
    TTFB counted from the request's own send (the part that is the service's): p50 / p95 seconds."""
    timed = [r for r in reqs if r.get("sent") is not None]
    if not timed:
        return {}
    sent, since_sent = [r["sent"] for r in timed], [r["ttfb"] - r["sent"] for r in timed]
    headers = [r["headers"] - r["sent"] for r in timed if r.get("headers") is not None]
    return {"sent_p50": percentile(sent, 50), "sent_p95": percentile(sent, 95),
            "headers_after_send_p50": percentile(headers, 50), "headers_after_send_p95": percentile(headers, 95),
            "ttfb_after_send_p50": percentile(since_sent, 50), "ttfb_after_send_p95": percentile(since_sent, 95)}


def client_process(a: argparse.Namespace, n: int, bursts: int, barrier: Any, hifi_id: str | None,
                   sample_rate: int, results: Any) -> None:
    bursts_of = raw_bursts if a.client == "raw" else client_bursts
    out = asyncio.run(bursts_of(a, n, bursts, barrier, hifi_id, sample_rate))
    results.put((out, time.process_time()))  # the client's own CPU seconds: the box is shared with the service


def role(name: str) -> str:
    for prefix in ("voxcpm-worker", "voxcpm-api"):
        if name.startswith(prefix):
            return prefix.removeprefix("voxcpm-")
    return "other"


def cpu_times(pid: int | None) -> dict[int, tuple[str, float]]:
    """CPU seconds (user + system) of `pid` and every process under it, with its role."""
    if not pid:
        return {}
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return {}
    out = {}
    for proc in procs:
        try:
            t = proc.cpu_times()
            out[proc.pid] = (role(proc.name()), t.user + t.system)
        except psutil.Error:
            continue
    return out


def cpu_report(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]], wall: float,
               audio_s: float) -> dict[str, Any]:
    used: dict[str, float] = {}
    for pid, (name, t) in after.items():
        used[name] = used.get(name, 0.0) + t - before.get(pid, (name, 0.0))[1]
    total = sum(used.values())
    return {"service_cores_mean": total / wall if wall else None,
            "service_cores_by_role": {k: v / wall for k, v in sorted(used.items())},
            "core_s_per_audio_s": total / audio_s if audio_s else None,
            "core_s_per_audio_s_by_role": {k: v / audio_s for k, v in sorted(used.items())} if audio_s else {}}


def run_concurrency(a: argparse.Namespace, c: int, hifi_id: str | None, sample_rate: int) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    procs_n = max(1, min(a.procs, c))
    shares = [c // procs_n + (1 if i < c % procs_n else 0) for i in range(procs_n)]
    barrier, results = ctx.Barrier(procs_n), ctx.Queue()
    procs = [ctx.Process(target=client_process, args=(a, n, a.iters + 1, barrier, hifi_id, sample_rate, results))
             for n in shares]
    cpu0, t0 = cpu_times(a.pid), time.perf_counter()
    for p in procs:
        p.start()
    got = [results.get() for _ in procs]
    for p in procs:
        p.join()
    wall = time.perf_counter() - t0
    per_proc = [out for out, _ in got]
    client_cpu = sum(cpu for _, cpu in got)
    cpu1 = cpu_times(a.pid)
    reqs, errors, bursts, audio_all = [], [], [], 0.0
    for b in range(a.iters + 1):
        res = [r for pp in per_proc for r in pp[b]]
        audio_all += sum(r.get("audio_s", 0.0) for r in res)
        if b == 0:
            continue  # the warm-up burst
        errors += [r["error"] for r in res if "error" in r]
        ok = [r for r in res if "error" not in r]
        reqs += ok
        if ok:
            bursts.append(sum(r["audio_s"] for r in ok) / max(r["wall"] for r in ok))
    row = {"concurrency": c, **request_stats(reqs, errors), **send_stats(reqs),
           "throughput_audio_s_per_s": mean(bursts), "client_procs": procs_n, "client_cores_mean": client_cpu / wall}
    if cpu1:
        row.update(cpu_report(cpu0, cpu1, wall, audio_all))
    return row


def main(argv: list[str]) -> None:
    import httpx

    ap = subcommand_parser("http", __doc__)
    ap.add_argument("url")
    ap.add_argument("--conc", default="1,8,32")
    ap.add_argument("--iters", type=int, default=2)
    ap.add_argument("--patches", type=int, default=100, help="patches per request (per segment with --text-chars)")
    ap.add_argument("--text-chars", type=int, default=0, help="a long text of this many characters (the protocol's "
                                                              "paragraph repeated), spoken as segments")
    ap.add_argument("--procs", type=int, default=8, help="client processes a burst is spread over")
    ap.add_argument("--route", choices=["generate", "speech"], default="generate")
    ap.add_argument("--voice", choices=["zeroshot", "hifi"], default="zeroshot")
    ap.add_argument("--format", choices=["mp3", "pcm"], default="mp3")
    ap.add_argument("--client", choices=["httpx", "raw"], default="httpx",
                    help="httpx, or a lean h11 client that puts a burst's requests on the wire at once")
    ap.add_argument("--pid", type=int, help="the service's main process: CPU per role")
    ap.add_argument("--label", default="", help="a name for this run in the JSON")
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    a.url = a.url.rstrip("/")
    info = httpx.get(a.url + "/info", timeout=30).json()
    sample_rate = int(info["model"]["sample_rate"])
    hifi_id = None
    if a.voice == "hifi":
        clip = base64.b64encode(synthetic_clip_wav(5.0)).decode()
        r = httpx.post(a.url + "/add_hifi", json={"wav_base64": clip, "prompt_text": CLIP_TEXT}, timeout=120)
        r.raise_for_status()
        hifi_id = r.json()["hifi_id"]
    doc: dict[str, Any] = {"tool": "bench_http", "argv": command_line("http", argv), "label": a.label,
                           "url": a.url, "client": a.client, "route": a.route, "voice": a.voice, "format": a.format,
                           "patches": a.patches, "text_chars": a.text_chars, "iters": a.iters,
                           "sample_rate": sample_rate,
                           "service": {k: info.get(k) for k in ("mp3", "queue_coalesce_ms", "api_processes")},
                           "results": []}
    for c in [int(x) for x in a.conc.split(",") if x.strip()]:
        row = run_concurrency(a, c, hifi_id, sample_rate)
        doc["results"].append(row)
        print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()
               if k in ("concurrency", "failed", "ttfb_p50", "ttfb_p95", "sent_p95", "ttfb_after_send_p95", "rtf_mean",
                        "throughput_audio_s_per_s",
                        "streams_with_underrun", "service_cores_mean", "core_s_per_audio_s", "client_cores_mean")},
              flush=True)
        write_json(a.out, doc)
