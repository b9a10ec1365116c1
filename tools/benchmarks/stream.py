"""Burst streaming benchmark: voxcpm-serve or nano-vllm-voxcpm, measured with one protocol.

    python tools/bench.py stream --engine voxcpm-serve --model CKPT --conc 1,8,32,64 --out ours.json
    python tools/bench.py stream --engine nanovllm --model CKPT --out nano.json   # flash_attn shim on PYTHONPATH

Protocol (the one the anchors in shared/bench were measured with):
- for each concurrency c: one warm-up burst, then --iters counted bursts of c requests submitted at once;
- per request: TTFB (burst submit -> first chunk), wall (submit -> last chunk), audio seconds,
  RTF = wall / audio, playback underruns for a listener who starts at the first chunk (a gap when a
  chunk arrives more than 1 ms after the buffered audio ran out);
- per burst: throughput = audio seconds generated / burst wall seconds;
- per concurrency, ours: worker_send_ms_mean, how long the workers' messages (a step's events) waited from being
  queued for this process to being written to it.
The JSON keeps the anchor files' keys (results[].ttfb_p50, rtf_mean, throughput_audio_s_per_s, ...) so
`bench.py compare` reads ours, theirs and the anchors alike. It is rewritten after every concurrency,
so a run cut off by a time limit still leaves the finished rows ("complete": false).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tqdm import tqdm

if TYPE_CHECKING:
    import torch

# The measurement helpers, the protocol's text and the environment facts are shared with the other benchmarks.
from tools.benchmarks.harness import (
    CLIP_TEXT,
    TEXT,
    PoolTarget,
    Req,
    add_pool_arguments,
    bursts,
    command_line,
    engine_version,
    gpu_index,
    gpu_mem_used_mib,
    merged_pool_kwargs,
    nvidia_smi,
    subcommand_parser,
    synthetic_clip_wav,
    torch_facts,
    write_json,
)

# ---------------------------------------------------------------- driver


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = subcommand_parser("stream", __doc__)
    ap.add_argument("--engine", choices=["voxcpm-serve", "nanovllm"], required=True)
    ap.add_argument("--model", required=True, help="checkpoint directory (official VoxCPM layout)")
    ap.add_argument("--conc", default="1,8,32,64", help="comma-separated concurrencies")
    ap.add_argument("--iters", type=int, default=2, help="counted bursts per concurrency (after one warm-up)")
    ap.add_argument("--patches", type=int, help="patches per request (default 100; 40 in hifi mode)")
    ap.add_argument("--mode", choices=["zeroshot", "hifi"], default="zeroshot",
                    help="hifi: a synthetic 5 s clip as prompt and as reference")
    add_pool_arguments(ap)
    ap.add_argument("--loras", type=int, default=0, help="voxcpm-serve: this many random runtime LoRA adapters "
                    "(the official VoxCPM2 recipe: LM and DiT, --lora-rank, alpha = rank) registered, the requests "
                    "using them in turn (max_loras defaults to it)")
    ap.add_argument("--lora-rank", type=int, default=32)
    ap.add_argument("--out", help="write the results JSON here")
    a = ap.parse_args(argv)
    a.argv = command_line("stream", argv)
    a.conc = [int(x) for x in a.conc.split(",") if x.strip()]
    if not a.conc or min(a.conc) < 1:
        ap.error("--conc needs positive integers")
    if a.devices == "auto":  # one GPU, as the anchors; nvidia-smi keeps CUDA out of this process
        a.devices = "0" if nvidia_smi("name", 0) is not None else "cpu"
    a.devices = [int(x) if x.strip().isdigit() else x.strip() for x in a.devices.split(",") if x.strip()]
    a.patches = a.patches or (40 if a.mode == "hifi" else 100)
    a.max_num_seqs = a.max_num_seqs or max(a.conc)
    a.pool_kwargs = merged_pool_kwargs(ap, a.pool_kwargs)
    if a.loras:
        if a.engine != "voxcpm-serve":
            ap.error("--loras: runtime adapters are voxcpm-serve's")
        a.pool_kwargs.setdefault("max_loras", a.loras)
        a.pool_kwargs.setdefault("max_lora_rank", a.lora_rank)
    return a


def random_adapters(model: str | torch.nn.Module, count: int, rank: int, out: Path) -> list[Path]:
    """`count` random adapters in the official format (LM and DiT targets, alpha = rank) for the checkpoint at
    `model`, or for a loaded backbone."""
    from engine.io.checkpoint import load_model
    from engine.io.lora import LoRAConfig, random_adapter

    backbone = load_model(model, "cpu").backbone if isinstance(model, str) else model
    config = LoRAConfig(enable_lm=True, enable_dit=True, r=rank, alpha=rank)
    return [random_adapter(backbone, out / f"bench{i}", config, seed=i) for i in range(count)]


def print_table(doc: dict[str, Any]) -> None:
    head = (f"{'c':>4} {'reqs':>5} {'fail':>4} {'ttfb50':>7} {'ttfb95':>7} {'ttfb99':>7} {'rtf':>6} {'rtf95':>6} "
            f"{'aud-s/s':>8} {'underrun':>9} {'gap-s':>7} {'mem-MiB':>8}")
    print(f"\n{doc['engine']} {doc['engine_version']}  mode={doc['mode']} patches={doc['patches']} "
          f"iters={doc['iters']} startup={doc['startup_s']:.1f}s  gpu={doc.get('gpu_name')}")
    print(head)

    def f(v: float | None, spec: str) -> str:
        return "-" if v is None else format(v, spec)

    for r in doc["results"]:
        print(f"{r['concurrency']:>4} {r['requests']:>5} {r['failed']:>4} {f(r['ttfb_p50'], '7.3f')} "
              f"{f(r['ttfb_p95'], '7.3f')} {f(r['ttfb_p99'], '7.3f')} {f(r['rtf_mean'], '6.3f')} "
              f"{f(r['rtf_p95'], '6.3f')} {f(r['throughput_audio_s_per_s'], '8.1f')} "
              f"{r['streams_with_underrun']:>4}/{r['requests']:<4} {r['underrun_s_total']:7.2f} "
              f"{r['gpu_mem_used_mib_max'] if r['gpu_mem_used_mib_max'] is not None else '-':>8}")


async def bench(a: argparse.Namespace) -> dict[str, Any]:
    dev0 = gpu_index(a.devices)
    doc: dict[str, Any] = {
        "engine": a.engine, "engine_version": engine_version(a.engine), "argv": a.argv,
        "date_utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "mode": a.mode, "patches": a.patches, "iters": a.iters, "text_words": len(TEXT.split()),
        "pool": {"max_num_seqs": a.max_num_seqs, "max_model_len": a.max_model_len,
                 "max_num_batched_tokens": a.max_num_batched_tokens,
                 "gpu_memory_utilization": a.gpu_memory_utilization, "enforce_eager": a.enforce_eager,
                 "inference_timesteps": a.inference_timesteps, "devices": a.devices, **a.pool_kwargs},
        **torch_facts(dev0, touch_cuda=False), "complete": False, "results": [],
    }
    adapters = random_adapters(a.model, a.loras, a.lora_rank, Path(tempfile.mkdtemp())) if a.loras else []
    doc["loras"] = {"count": a.loras, "rank": a.lora_rank} if a.loras else None
    t = time.perf_counter()
    target = PoolTarget(a)
    try:
        await target.start()
        doc["startup_s"] = time.perf_counter() - t
        doc["model_info"] = target.facts.get("model_info")  # ours: start-up phases (load, KV sizing, graphs)
        pool, sr, channels = target.pool, target.sample_rate, target.channels
        doc.update(sample_rate=sr, channels=channels, gpu_mem_used_mib_after_startup=gpu_mem_used_mib(dev0))
        tqdm.write(json.dumps({"startup_s": round(doc["startup_s"], 2), "sample_rate": sr}), file=sys.stderr)

        cond: dict[str, Any] = {}
        if a.mode == "hifi":  # one clip as both continuation prompt (inline latents, no cache) and reference
            wav = synthetic_clip_wav()
            lat = await pool.encode_latents(wav, "wav")
            ref = lat
            if a.engine == "voxcpm-serve":  # our pool pads a reference clip on the right, a prompt on the left
                ref = await pool.encode_latents(wav, "wav", padding="right")
            cond = {"prompt_latents": lat, "prompt_text": CLIP_TEXT, "ref_audio_latents": ref}

        names = [f"bench{i}" for i in range(len(adapters))]
        for name, path in zip(names, adapters, strict=True):
            await pool.register_lora(name, str(path))
            async for _ in pool.generate(TEXT, max_generate_length=1, lora_name=name):  # resident before the bursts
                pass

        def lora_of(i: int) -> dict[str, str]:
            return {"lora_name": names[i % len(names)]} if names else {}

        with tqdm(total=len(a.conc) * (a.iters + 1), desc="bursts", unit="burst", file=sys.stderr) as bar:
            for c in a.conc:
                before = await worker_counters(pool) if a.engine == "voxcpm-serve" else None
                row = await bursts(target, lambda it, n: [Req(TEXT, a.patches, {**cond, **lora_of(it * n + i)})
                                                          for i in range(n)], c, a.iters, bar)
                del row["label"]  # the anchor files' rows have none
                if before is not None:  # ours: how long the workers' messages waited from queued to written, their
                    # garbage collector's passes during this concurrency and the longest since they started
                    after = await worker_counters(pool)
                    messages, seconds, passes = (now - then for now, then in zip(after[:3], before[:3], strict=True))
                    row["worker_send_ms_mean"] = round(1000 * seconds / max(1, messages), 3)
                    row["worker_gc_passes"] = int(passes)
                    row["worker_gc_longest_ms"] = round(1000 * after[3], 3)
                doc["results"].append(row)
                tqdm.write(json.dumps({k: row[k] for k in ("concurrency", "ttfb_p50", "ttfb_p95", "rtf_mean",
                                                         "throughput_audio_s_per_s", "streams_with_underrun",
                                                         "failed")}), file=sys.stderr)
                write_json(a.out, doc)
    finally:
        await target.stop()
    doc["complete"] = True
    return doc


async def worker_counters(pool: Any) -> tuple[int, float, int, float]:
    """Our workers' counters so far, from one stats call: messages written to clients, the seconds they waited from
    queued to written, garbage-collector passes, the longest pass (s)."""
    stats = [s for s in await pool.stats() if s is not None]
    return (sum(s.messages_sent for s in stats), sum(s.send_seconds for s in stats),
            sum(s.gc_collections for s in stats), max((s.gc_longest_s for s in stats), default=0.0))


def main(argv: list[str]) -> None:
    a = parse_args(argv)
    doc = asyncio.run(bench(a))
    doc.update(torch_facts(gpu_index(a.devices), touch_cuda=True))
    write_json(a.out, doc)
    print_table(doc)
