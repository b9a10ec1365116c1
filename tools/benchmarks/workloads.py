"""The workloads over the shared harness (harness.py), in process (`--target pool --model CKPT`) or over HTTP
(`--target http --url URL`): one function per subcommand of tools/bench.py, its docstring the subcommand's help.
Every one writes the harness's results document (its "tool" key: the workload's name in snake case)."""

from __future__ import annotations

import argparse
import time
from typing import Any

from tools.benchmarks import harness as bl

PROMPT_FAMILY_MODES = ("shared-same", "shared-varied", "distinct")


def latents(argv: list[str]) -> dict[str, Any]:
    """Latent concurrency: bursts of c simultaneous requests that each carry the voice prompt inline as latents
    (`prompt_latents` + `prompt_text`; over HTTP `prompt_latents_base64` from /encode_latents), nothing cached.

        python tools/bench.py latents --model CKPT --conc 1,8,32,64 --out latents.json
        python tools/bench.py latents --target http --url http://127.0.0.1:8000 --conc 1,8,32 --out latents_http.json

    Per concurrency: one warm-up burst, then --iters counted bursts (the protocol of `bench.py stream`).
    --voice zeroshot runs the same bursts without a prompt, as the baseline.
    """
    ap = bl.parser(latents.__doc__, "latents", conc="1,8,32,64", patches=100, iters=2)
    ap.add_argument("--voice", choices=["latents", "zeroshot"], default="latents",
                    help="latents: the synthetic clip as inline prompt latents; zeroshot: no prompt")
    a = ap.parse_args(argv)
    a = bl.finish_args(ap, a, max(a.conc), argv, "latents")

    async def body(target: bl.Target, a: argparse.Namespace, run: bl.Run, bar: Any) -> None:
        voice = await target.voice(a.voice, bl.synthetic_clip_wav(a.clip_seconds))
        for c in a.conc:
            run.add(await bl.bursts(target, lambda it, n: [bl.Req(a.text, a.patches, voice) for _ in range(n)], c,
                                    a.iters, bar, label=f"{a.voice} c={c}"))

    params = {"voice": a.voice, "iters": a.iters, "conc": a.conc}
    return bl.run_tool("latents", a, params, body, total=len(a.conc) * (a.iters + 1))


def prompt_vs_reference(argv: list[str]) -> dict[str, Any]:
    """Prompt vs reference hot path: the same text in each conditioning mode, the voice cached beforehand
    (prompt = continuation prompt by id; reference = reference clip; hifi = both from one clip), one request at
    a time (c=1) and in bursts of c.

        python tools/bench.py prompt-vs-reference --model CKPT --conc 1,8 --out pvr.json
        python tools/bench.py prompt-vs-reference --target http --url URL --modes zeroshot,prompt,reference,hifi

    Over HTTP the ids come from /add_prompt, /add_reference and /add_hifi; in process the pool caches the
    prompt (add_prompt) and the reference latents travel with each request (the pool has no reference cache).
    Rows interleave the modes at each concurrency, each with its own warm-up burst.
    """
    ap = bl.parser(prompt_vs_reference.__doc__, "prompt-vs-reference", conc="1,8", patches=40, iters=2)
    ap.add_argument("--modes", default="prompt,reference,hifi",
                    help=f"comma-separated conditioning modes, of {', '.join(bl.VOICE_KINDS)}")
    a = ap.parse_args(argv)
    a.modes = bl.parse_choices(ap, "--modes", a.modes, bl.VOICE_KINDS)
    a = bl.finish_args(ap, a, max(a.conc), argv, "prompt-vs-reference")

    async def body(target: bl.Target, a: argparse.Namespace, run: bl.Run, bar: Any) -> None:
        clip = bl.synthetic_clip_wav(a.clip_seconds)
        voices = {m: await target.voice(m, clip) for m in a.modes}
        for c in a.conc:
            for m in a.modes:
                row = await bl.bursts(target,
                                      lambda it, n, m=m: [bl.Req(a.text, a.patches, voices[m]) for _ in range(n)],
                                      c, a.iters, bar, label=f"{m} c={c}")
                row["mode"] = m
                run.add(row)

    params = {"modes": a.modes, "iters": a.iters, "conc": a.conc}
    return bl.run_tool("prompt_vs_reference", a, params, body, total=len(a.conc) * len(a.modes) * (a.iters + 1))


def prompt_family(argv: list[str]) -> dict[str, Any]:
    """Prompt family hot path: many requests reusing one cached continuation prompt (the prefix cache can serve
    their shared prefill blocks) against the same load with a different prompt per request.

        python tools/bench.py prompt-family --model CKPT --conc 8,32 --out family.json
        python tools/bench.py prompt-family --target http --url URL --conc 8

    Modes (rows, at each concurrency; one warm-up burst each):
    - shared-same: one prompt, the same text -> the whole prefill but its last token can come from the cache;
    - shared-varied: one prompt, a different sentence per request ("Line i: ..." in front) -> only the prompt
      transcript's blocks are shared (the layout is text(prompt transcript + target) then the prompt's audio);
    - distinct: a different synthetic clip per request (registered before its burst, never reused) -> no sharing.
    """
    ap = bl.parser(prompt_family.__doc__, "prompt-family", conc="8", patches=40, iters=2)
    ap.add_argument("--modes", default=",".join(PROMPT_FAMILY_MODES),
                    help=f"comma-separated, of {', '.join(PROMPT_FAMILY_MODES)}")
    a = ap.parse_args(argv)
    a.modes = bl.parse_choices(ap, "--modes", a.modes, PROMPT_FAMILY_MODES)
    a = bl.finish_args(ap, a, max(a.conc), argv, "prompt-family")

    async def body(target: bl.Target, a: argparse.Namespace, run: bl.Run, bar: Any) -> None:
        shared = await target.voice("prompt", bl.synthetic_clip_wav(a.clip_seconds))
        next_seed = 1  # clip seeds of the distinct mode: each used once in the whole run
        for c in a.conc:
            for m in a.modes:
                prepared: dict[int, list[bl.Req]] = {}
                for it in range(a.iters + 1):  # registered ahead, outside the timed bursts
                    if m == "distinct":
                        voices = [await target.voice("prompt", clip)
                                  for clip in bl.clips(c, a.clip_seconds, next_seed)]
                        next_seed += c
                        prepared[it] = [bl.Req(a.text, a.patches, v) for v in voices]
                    elif m == "shared-varied":
                        prepared[it] = [bl.Req(f"Line {it * c + i}: {a.text}", a.patches, shared) for i in range(c)]
                    else:
                        prepared[it] = [bl.Req(a.text, a.patches, shared) for _ in range(c)]
                row = await bl.bursts(target, lambda it, n, p=prepared: p[it], c, a.iters, bar, label=f"{m} c={c}")
                row["mode"] = m
                run.add(row)

    params = {"modes": a.modes, "iters": a.iters, "conc": a.conc}
    return bl.run_tool("prompt_family", a, params, body, total=len(a.conc) * len(a.modes) * (a.iters + 1))


def hifi_stream(argv: list[str]) -> dict[str, Any]:
    """HiFi streaming concurrency: bursts of c streamed requests cloning one cached HiFi voice (one clip as
    continuation prompt and as reference: /add_hifi over HTTP; in process a cached prompt plus the reference
    latents with each request).

        python tools/bench.py hifi-stream --model CKPT --conc 1,5,10 --out hifi_stream.json
        python tools/bench.py hifi-stream --target http --url URL --format mp3 --conc 1,5,10

    Per concurrency: one warm-up burst, then --iters counted bursts. Defaults follow the anchors' HiFi runs
    (40 patches, c = 1, 5, 10).
    """
    return _hifi(argv, "hifi-stream", hifi_stream.__doc__, blocking=False)


def hifi_blocking(argv: list[str]) -> dict[str, Any]:
    """HiFi blocking concurrency: bursts of c whole-utterance requests (/generate_blocking over HTTP; in
    process the chunks collected) cloning one cached HiFi voice.

        python tools/bench.py hifi-blocking --model CKPT --conc 1,5,10 --out hifi_blocking.json
        python tools/bench.py hifi-blocking --target http --url URL --format mp3 --conc 1,5,10

    TTFB here is the first byte of the response: over HTTP the body starts once the whole utterance is
    generated (and encoded); in process the audio is in hand when its last chunk is, so TTFB = wall. RTF =
    wall / audio seconds; a blocking response cannot underrun.
    """
    return _hifi(argv, "hifi-blocking", hifi_blocking.__doc__, blocking=True)


def _hifi(argv: list[str], command: str, doc: str | None, blocking: bool) -> dict[str, Any]:
    """Bursts per concurrency cloning one cached HiFi voice, streamed or blocking (the options of both)."""
    ap = bl.parser(doc, command, conc="1,5,10", patches=40, iters=2)
    a = ap.parse_args(argv)
    a = bl.finish_args(ap, a, max(a.conc), argv, command)

    async def body(target: bl.Target, a: argparse.Namespace, run: bl.Run, bar: Any) -> None:
        voice = await target.voice("hifi", bl.synthetic_clip_wav(a.clip_seconds))
        for c in a.conc:
            run.add(await bl.bursts(target, lambda it, n: [bl.Req(a.text, a.patches, voice) for _ in range(n)], c,
                                    a.iters, bar, label=f"hifi{'-blocking' if blocking else ''} c={c}",
                                    blocking=blocking))

    extra = [("wall_mean", "wall", "7.3f")] if blocking else None
    return bl.run_tool("hifi_blocking" if blocking else "hifi_stream", a, {"iters": a.iters, "conc": a.conc}, body,
                       total=len(a.conc) * (a.iters + 1), extra_columns=extra)


CLOSED_LOOP_COLUMNS = [("started", "started", "7d"), ("achieved_rps", "req/s", "7.2f"),
                       ("in_flight_mean", "inflight", "8.1f"), ("queue_depth_max", "queue", "5d"),
                       ("drain_s", "drain", "6.1f")]


def closed_loop(argv: list[str]) -> dict[str, Any]:
    """Closed-loop users: N users, each sending its next streamed request as soon as the previous one ends,
    for --warmup + --duration seconds; one row per user count.

        python tools/bench.py closed-loop --model CKPT --conc 8,32,64 --duration 60 --out closed.json
        python tools/bench.py closed-loop --target http --url URL --conc 16 --duration 120 --voice hifi

    Counted: the requests started inside the measured window (those still running at its end finish first).
    Throughput = audio seconds that arrived inside the window / its length; achieved rps = requests started in
    the window / its length. Also sampled: requests in flight and the engine's queue (pool snapshot or the
    service's voxcpm_queue_depth gauge), GPU memory every 2 s.
    """
    ap = bl.parser(closed_loop.__doc__, "closed-loop", conc="8", patches=100, iters=None, duration=60.0)
    ap.add_argument("--warmup", type=float, default=5.0, help="seconds before the measured window")
    ap.add_argument("--voice", choices=bl.VOICE_KINDS, default="zeroshot")
    a = ap.parse_args(argv)
    a = bl.finish_args(ap, a, max(a.conc), argv, "closed-loop")

    async def body(target: bl.Target, a: argparse.Namespace, run: bl.Run, bar: Any) -> None:
        voice = await target.voice(a.voice, bl.synthetic_clip_wav(a.clip_seconds))
        for users in a.conc:
            bar.set_postfix_str(f"users={users}")
            run.add(await bl.closed_loop(target, users, a.duration, a.warmup,
                                         lambda i: bl.Req(a.text, a.patches, voice), bar))

    params = {"users": a.conc, "duration_s": a.duration, "warmup_s": a.warmup, "voice": a.voice}
    return bl.run_tool("closed_loop", a, params, body, total=None, extra_columns=CLOSED_LOOP_COLUMNS, unit="req")


OPEN_LOOP_COLUMNS = [("offered_rps", "offer/s", "7.2f"), ("achieved_rps", "arr/s", "7.2f"),
                     ("completed_rps", "done/s", "7.2f"), ("queue_wait_est_p95", "qwait95", "7.3f"),
                     ("in_flight_max", "inflight", "8d"), ("queue_depth_max", "queue", "5d"),
                     ("drain_s", "drain", "6.1f")]


def open_loop(argv: list[str]) -> dict[str, Any]:
    """Open-loop arrival rate: requests arrive as a Poisson process at --rate per second for --duration
    seconds, each streamed however loaded the target is (no client-side limit); one row per rate.

        python tools/bench.py open-loop --model CKPT --rate 1,2,4 --duration 60 --out open.json
        python tools/bench.py open-loop --target http --url URL --rate 0.5,1 --duration 120

    TTFB counts from the scheduled arrival, so it includes queueing. Reported besides the usual metrics:
    offered and achieved arrival rates, completion rate, the drain time after the last arrival window,
    requests in flight, the engine's queue depth (pool snapshot or the service's voxcpm_queue_depth gauge) and
    an estimate of the queueing wait (TTFB minus the TTFB of one request alone, measured first).
    """
    ap = bl.parser(open_loop.__doc__, "open-loop", conc=None, patches=100, iters=None, duration=60.0)
    ap.add_argument("--rate", type=bl.positive_floats, default=bl.positive_floats("1"),
                    help="comma-separated arrival rates, requests per second (default 1)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the arrival times")
    ap.add_argument("--voice", choices=bl.VOICE_KINDS, default="zeroshot")
    a = ap.parse_args(argv)
    # max_num_seqs: room for what is in flight at the highest rate (Little's law with RTF 1 as the bound)
    seqs = min(max(8, round(2 * max(a.rate) * a.patches * 0.16)), 128)
    a = bl.finish_args(ap, a, seqs, argv, "open-loop")

    async def body(target: bl.Target, a: argparse.Namespace, run: bl.Run, bar: Any) -> None:
        voice = await target.voice(a.voice, bl.synthetic_clip_wav(a.clip_seconds))

        def make(i: int) -> bl.Req:
            return bl.Req(a.text, a.patches, voice)

        # the idle TTFB (and the warm-up): a few requests alone, the best of them
        idle = []
        for _ in range(2):
            t0 = time.perf_counter()
            idle.append((await bl.timed_stream(target, make(-1), t0))["ttfb"])
        for rate in a.rate:
            bar.set_postfix_str(f"rate={rate:g}/s")
            run.add(await bl.open_loop(target, rate, a.duration, make, a.seed, idle_ttfb=min(idle), bar=bar))

    params = {"rates": a.rate, "duration_s": a.duration, "seed": a.seed, "voice": a.voice}
    return bl.run_tool("open_loop", a, params, body, total=None, extra_columns=OPEN_LOOP_COLUMNS, unit="req")
