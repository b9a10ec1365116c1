"""Where a decode step's time goes, on a GPU, two ways (the subcommands `step` and `trace` of tools/profiler.py):

- step: each component captured in its own CUDA graph and timed with CUDA events at batch B, next to the whole
  captured step, the engine step as the host sees it, a new request's time to first audio (prefill + first step)
  in-process, with its prompt's blocks from the prefix cache and without, and the prefill's graphs per bucket;
- trace: c streams of the benchmark's text run in-process (pipelined, as the pool runs them), torch.profiler records
  a window of steps, and the trace is reduced to the period per step, the time no kernel or copy runs (idle gaps,
  grouped by the kernels around them), the host<->device copies per step and the kernel time per step by name:
  what the components timed in isolation leave between them in the engine.

    python tools/profiler.py step --model /tmp/full --batch 1,64 --out profile.json
    python tools/profiler.py trace --model /tmp/full --conc 1,8 --out trace.json
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.runner.attention import AttentionMetadata
from engine.runner.buffers import StepInputs
from engine.serving.collector import freeze_startup_heap
from tools.benchmarks.harness import TEXT as PROTOCOL_TEXT
from tools.gpu_check import TEXT, step_ms

CONTEXT = 150  # tokens before the new one in `components` (the benchmark text's prompt is ~130, then one per patch)


def graph_ms(fn: Callable[[], object] | torch.cuda.CUDAGraph, reps: int = 20) -> float:
    """Mean milliseconds of `fn` captured (or of an already captured graph) replayed."""
    if isinstance(fn, torch.cuda.CUDAGraph):
        g = fn
    else:
        fn()  # warm-up
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
    g.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def step_inputs_at_context(engine: LLMEngine, b: int) -> StepInputs:
    """The inputs of a b-row step, written in the decode buffers (the engine's last step may have used another row
    count, whose layout shares these bytes): the first b slots, a context of CONTEXT tokens read from block 0, new
    keys to scratch."""
    r = engine.runner
    assert r.buffers is not None and r.base_cache is not None
    inputs = r.buffers.step_inputs(b)
    inputs.fill_padding(r.scratch_slot, r.base_cache.scratch_slot)
    inputs.slot_index.copy_(torch.arange(b))
    inputs.positions.fill_(CONTEXT)
    inputs.context_lens.fill_(CONTEXT + 1)
    return inputs


@torch.inference_mode()
def components(engine: LLMEngine, b: int) -> dict[str, float]:
    r = engine.runner
    bb = r.model.backbone
    buf = r.buffers
    assert buf is not None and r.base_cache is not None and r.residual_cache is not None
    inputs = step_inputs_at_context(engine, b)
    idx = inputs.slot_index
    lm_h, res_h, prev = r.lm_hidden[idx], r.residual_hidden[idx], r.prev_patch[idx]
    noise, cfg, pos = inputs.noise, inputs.cfg, inputs.positions
    meta = AttentionMetadata(False, inputs.slot_mapping, inputs.block_tables, buf.row_index[:b],
                             inputs.context_lens)
    patch = bb.sample_patch(lm_h, res_h, prev, noise, cfg, r.inference_timesteps)
    embed = bb.encode_patches(patch)
    rope = bb.rope_tables["lm"][pos]
    lm_next = bb.fsq_layer(bb.base_lm(embed, rope, r.base_cache.attend_fn(meta)))
    res_in = bb.residual_input(lm_next, embed)
    latents = r._latents(patch[:, None])
    return {
        "DiT solve (CFG, all Euler steps)": graph_ms(lambda: bb.sample_patch(lm_h, res_h, prev, noise, cfg,
                                                                             r.inference_timesteps)),
        "LocEnc": graph_ms(lambda: bb.encode_patches(patch)),
        "base LM step + FSQ": graph_ms(lambda: bb.fsq_layer(bb.base_lm(embed, rope, r.base_cache.attend_fn(meta)))),
        "residual LM step": graph_ms(lambda: bb.residual_lm(res_in, rope, r.residual_cache.attend_fn(meta))),
        "stop head": graph_ms(lambda: bb.stop_logits(lm_h)),
        f"VAE decode (streaming, {engine.config.vae_dtype or 'float32'})":
            graph_ms(lambda: r._decode_audio(idx, latents)),
        # From VOXCPM_VAE_OVERLAP_MIN_BATCH on (32) the step graph stops at the LMs and the VAE graph runs behind it;
        # below, the VAE is inside the step graph.
        "whole step (one graph)" if b not in r.vae_stream.graphs else "step graph without the VAE":
            graph_ms(r.graphs[b]) if b in r.graphs else float("nan"),
        **({"VAE graph (overlaps the next step)": graph_ms(r.vae_stream.graphs[b])}
           if b in r.vae_stream.graphs else {}),
    }


def kernel_table(graph: torch.cuda.CUDAGraph, reps: int = 5, top: int = 15) -> dict[str, object]:
    """CUDA kernels of the whole-step graph (torch.profiler sees kernels inside graph replays):
    kernels per step, summed kernel ms per step, and the `top` kernel names by time."""
    from torch.profiler import ProfilerActivity, profile

    graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            graph.replay()
        torch.cuda.synchronize()
    rows = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    rows.sort(key=lambda e: e.device_time_total, reverse=True)
    return {
        "kernels_per_step": sum(e.count for e in rows) / reps,
        "kernel_ms_per_step": sum(e.device_time_total for e in rows) / reps / 1000,
        "top": [{"name": e.key[:90], "calls_per_step": e.count / reps, "ms_per_step": e.device_time_total / reps / 1000}
                for e in rows[:top]],
    }


UNCACHED = itertools.count(10_000)  # request numbers of texts no earlier request began with


def host_step_ms(engine: LLMEngine, b: int, patches: int = 40) -> tuple[float, float, float]:
    """(engine.step() wall ms with b running streams, first-audio ms of a request added alone: the median of 5 whose
    text's blocks but the last come from the prefix cache, and of 5 whose text has no block there)."""
    ms = step_ms(engine, b, patches)
    cached = [burst_first_audio(engine, 1, first=i)["ttfb_ms_p50"] for i in range(5)]
    uncached = [burst_first_audio(engine, 1, first=next(UNCACHED), uncached=True)["ttfb_ms_p50"] for _ in range(5)]
    return ms, statistics.median(cached), statistics.median(uncached)


def burst_first_audio(engine: LLMEngine, n: int, first: int = 0, uncached: bool = False, patches: int = 3,
                      text: str | None = None) -> dict:
    """n requests of `patches` patches added at once (the benchmark's burst): wall ms until each has its first audio,
    the ms the adds took, and the wall ms of every engine.step() until the last one has (where a burst's TTFB goes:
    prefills, then decodes). With more than 3 patches also the whole burst (its wall, audio-s/s, its last steps, the
    median step and the mean of the steady ones: what a burst costs beyond its steps). Request i (from `first`) has its
    own seed and its number after the text, or with `uncached` before it (so no block of its prompt is in the prefix
    cache); with `text`, every request that text as it is (as `bench.py stream` sends the protocol's)."""
    t0 = time.perf_counter()
    texts = {i: text if text is not None else f"{i}. {TEXT}" if uncached else f"{TEXT} {i}"
             for i in range(first, first + n)}
    ids = {engine.add_request(text, SamplingParams(seed=i, max_generate_length=patches)) for i, text in texts.items()}
    add_ms = 1000 * (time.perf_counter() - t0)
    firsts: dict[int, float] = {}
    steps: list[float] = []
    first_audio_steps = 0  # steps until every request had its first audio
    samples = 0
    while engine.has_unfinished():
        s0 = time.perf_counter()
        events = engine.step()
        steps.append(round(1000 * (time.perf_counter() - s0), 2))
        for ev in events:
            if ev.seq_id in ids:
                firsts.setdefault(ev.seq_id, 1000 * (time.perf_counter() - t0))
                samples += len(ev.audio) if ev.audio is not None else 0
        if not first_audio_steps and len(firsts) == n:
            first_audio_steps = len(steps)
    wall = time.perf_counter() - t0
    ttfb = sorted(firsts.values())
    out = {"n": n, "patches": patches, "add_ms": round(add_ms, 2), "ttfb_ms_p50": ttfb[n // 2],
           "ttfb_ms_max": ttfb[-1], "step_ms": steps[:first_audio_steps]}
    if patches > 3:
        steady = steps[first_audio_steps:-1]  # after every request's first audio, before the last step
        out.update(wall_s=round(wall, 4), audio_s_per_s=round(samples / engine.sample_rate / wall, 1),
                   steps=len(steps), median_step_ms=statistics.median(steps), last_step_ms=steps[-4:],
                   steady_step_ms_mean=round(statistics.fmean(steady), 3) if steady else None)
    return out


# ---------------------------------------------------------------- trace


def device_events(prof: torch.profiler.profile) -> list[dict]:
    """Kernels, copies and memsets of the trace: name, start and end in microseconds, kind, stream."""
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        trace = json.loads(Path(f.name).read_text())
    out = []
    for e in trace.get("traceEvents", []):
        cat = e.get("cat", "")
        if cat in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e:
            out.append({"name": e["name"], "start": float(e["ts"]), "end": float(e["ts"]) + float(e["dur"]),
                        "kind": cat, "stream": e.get("args", {}).get("stream")})
    out.sort(key=lambda e: e["start"])
    return out


def reduce(events: list[dict], start: float, end: float, steps: int, top: int = 12) -> dict:
    """Per step: the window's period, the busy union, the idle gaps (> 0.2 us) by the kernels around them, the
    copies, and the kernel time by name (overlapping PDL launches counted each in full)."""
    gaps: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    busy_until, last = start, events[0]  # (the window starts on an event)
    busy = 0.0
    for e in events:
        if e["start"] > busy_until + 0.2:
            key = f"{last['name'][:40]} -> {e['name'][:40]}"
            gaps[key][0] += e["start"] - busy_until
            gaps[key][1] += 1
        if e["end"] > busy_until:
            busy += e["end"] - max(e["start"], busy_until)
            busy_until, last = e["end"], e
    copies: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    names: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for e in events:
        table = copies if e["kind"] != "kernel" else names
        table[e["name"][:70]][0] += e["end"] - e["start"]
        table[e["name"][:70]][1] += 1
    per = 1000.0 * steps  # us over the window -> ms per step
    idle = sum(v[0] for v in gaps.values())
    return {
        "steps": steps, "period_ms": (end - start) / per, "busy_ms": busy / per, "idle_ms": idle / per,
        "idle_gaps": [{"between": k, "ms_per_step": v[0] / per, "per_step": v[1] / steps}
                      for k, v in sorted(gaps.items(), key=lambda kv: -kv[1][0])[:top]],
        "copies": [{"name": k, "ms_per_step": v[0] / per, "per_step": v[1] / steps}
                   for k, v in sorted(copies.items(), key=lambda kv: -kv[1][0])],
        "kernels": [{"name": k, "ms_per_step": v[0] / per, "per_step": v[1] / steps}
                    for k, v in sorted(names.items(), key=lambda kv: -kv[1][0])[:top]],
    }


def step_sequence(events: list[dict], start: float, end: float) -> list[dict]:
    """One step's device events in start order, runs of the same name merged: name, count, summed duration (us),
    and the idle time before the run (us, against everything that started before it)."""
    runs: list[dict] = []
    busy_until = start
    for e in (e for e in events if start <= e["start"] < end):
        idle = max(0.0, e["start"] - busy_until)
        busy_until = max(busy_until, e["end"])
        name = e["name"][:60]
        if runs and runs[-1]["name"] == name:
            runs[-1]["n"] += 1
            runs[-1]["us"] += e["end"] - e["start"]
            runs[-1]["idle_us"] += idle
        else:
            runs.append({"name": name, "n": 1, "us": e["end"] - e["start"], "idle_us": idle})
    return runs


def step_starts(marks: list[float]) -> list[float]:
    """The first of each step's DiT Euler updates, from all of them in time order (us): they come in one cluster per
    step, an update's solve apart inside it (0.3 ms at B=1, 2-4 ms at B=128-256), the encoder, the LMs and the VAE
    between clusters. A gap of more than 1.5 median gaps (most gaps are inside a cluster) starts a step."""
    gaps = sorted(b - a for a, b in zip(marks, marks[1:], strict=False))
    split = 1.5 * gaps[len(gaps) // 2] if gaps else 0.0
    return [t for i, t in enumerate(marks) if i == 0 or t - marks[i - 1] > split]


def trace(engine: LLMEngine, c: int, warm: int, steps: int) -> dict:
    from torch.profiler import ProfilerActivity, profile

    for i in range(c):
        engine.add_request(PROTOCOL_TEXT, SamplingParams(seed=i, max_generate_length=warm + steps + 10))
    for _ in range(warm):
        engine.step()
    torch.cuda.synchronize()
    # Pipelined, each step() launches one step and reads the one before: `steps` calls cover `steps` device steps.
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        host_ms = 1000 * (time.perf_counter() - t0) / steps
    while engine.has_unfinished():
        engine.step()
    events = device_events(prof)
    # Whole steps only: the window runs from the first step's first Euler update to the last one's.
    firsts = step_starts([e["start"] for e in events if "dit_output_euler" in e["name"]])
    if len(firsts) < 3:
        raise RuntimeError(f"only {len(firsts)} steps found in the trace (marker kernel _dit_output_euler_kernel)")
    window = [e for e in events if firsts[0] <= e["start"] < firsts[-1]]
    out = reduce(window, firsts[0], firsts[-1], len(firsts) - 1, top=40)
    out["one_step"] = step_sequence(events, firsts[-2], firsts[-1])
    out["host_ms_per_step_call"] = host_ms
    return out



# ---------------------------------------------------------------- the subcommands


def gpu_engine(model: str, max_num_seqs: int, **options: Any) -> LLMEngine:
    """The engine both profiles run: on the GPU, 1024 tokens a sequence, 0.8 of the GPU memory (`options`: other
    EngineConfig fields)."""
    return LLMEngine(model, EngineConfig(max_num_seqs=max_num_seqs, max_model_len=1024, gpu_memory_utilization=0.8,
                                         **options), device="cuda")


def run_facts() -> dict[str, str]:
    """The GPU, torch, the command and the date, at the head of both profiles' JSON."""
    return {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "command": " ".join(sys.argv),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def write_json(path: str | None, doc: dict) -> None:
    if path:
        Path(path).write_text(json.dumps(doc, indent=1))


def step_main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(prog="profiler.py step", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--batch", default="1,64")
    ap.add_argument("--out")
    ap.add_argument("--kernels", action="store_true", help="also list the step graph's CUDA kernels (torch.profiler)")
    ap.add_argument("--top", type=int, default=15, help="with --kernels: how many kernel names, by time")
    ap.add_argument("--engine-kwargs", default="{}", help="JSON of other EngineConfig fields, e.g. "
                    "'{\"vae_dtype\": \"bfloat16\"}'")
    ap.add_argument("--burst-patches", type=int, default=3, help="patches a request of the bursts (B >= 8) makes; "
                    "more than 3: the whole burst's wall and steps too")
    ap.add_argument("--burst-text", choices=("check", "protocol"), default="check",
                    help="the bursts' text: gpu_check's sentence with each request's number after it, or the "
                    "protocol's paragraph as `bench.py stream` sends it (~5x the prompt: the same work as its bursts)")
    a = ap.parse_args(argv)
    burst_text = PROTOCOL_TEXT if a.burst_text == "protocol" else None
    batches = [int(x) for x in a.batch.split(",")]
    kwargs = json.loads(a.engine_kwargs)
    engine = gpu_engine(a.model, max(batches), **kwargs)
    res: dict = {**run_facts(), "engine_kwargs": kwargs, "startup_s": engine.startup_s,
                 "startup_phases": engine.startup_phases, "capture_times": engine.runner.capture_times,
                 "options": dataclasses.asdict(engine.config.options), "batches": {}}
    # The prefill's graphs alone, per bucket (its LocEnc's: for prompts with audio rows), every token row padding (it
    # reads nothing and writes the scratch KV slot, not the blocks of an earlier prefill).
    runner = engine.runner
    buffers = runner.prefill_buffers
    assert buffers is not None
    buffers.inputs.fill_padding(buffers.scratch_kv_slot)
    graphs = runner.step_graphs
    res["prefill_graphs_ms"] = {**{f"prefill T={t}": graph_ms(g) for t, g in sorted(graphs.prefill.items())},
                                **{f"encode A={t}": graph_ms(g) for t, g in sorted(graphs.encode.items())}}
    for b in batches:
        step_ms, first_ms, uncached_ms = host_step_ms(engine, b)
        with engine.invariance():  # the components as the step runs them (VOXCPM_BATCH_INVARIANT=1: in the mode)
            comp = components(engine, b)
        comp["engine.step() as the host sees it"] = step_ms
        comp["new request alone: add -> first audio (prefill + step)"] = first_ms
        comp["the same, no block of its prompt cached"] = uncached_ms
        res["batches"][str(b)] = comp
        print(f"\nB={b}")
        for k, v in comp.items():
            print(f"  {k:55s} {v:8.2f} ms")
        graphs = {"kernels": engine.runner.graphs, "kernels_vae": engine.runner.vae_stream.graphs} if a.kernels else {}
        for key, graph_of in graphs.items():
            if b not in graph_of:
                continue
            table = kernel_table(graph_of[b], top=a.top)
            res.setdefault(key, {})[str(b)] = table
            print(f"  {key}: {table['kernels_per_step']:.0f} kernels per step, "
                  f"{table['kernel_ms_per_step']:.2f} ms of kernel time")
            for row in table["top"]:
                print(f"    {row['ms_per_step']:7.3f} ms {row['calls_per_step']:6.0f}x  {row['name']}")
    # The heap so far out of the collector, as a worker's is after its start-up: a full pass over the engine's
    # objects inside a burst would be timed as the engine's.
    freeze_startup_heap()
    for b in batches:
        if b >= 8:
            burst_first_audio(engine, b, patches=a.burst_patches, text=burst_text)  # warm-up (prefill shapes)
            res.setdefault("bursts", {})[str(b)] = burst = burst_first_audio(engine, b, patches=a.burst_patches,
                                                                             text=burst_text)
            print(f"burst of {b}: adds {burst['add_ms']:.1f} ms, first audio p50 {burst['ttfb_ms_p50']:.1f} ms, last "
                  f"{burst['ttfb_ms_max']:.1f} ms; steps {burst['step_ms']}"
                  + (f"; wall {burst['wall_s']:.3f} s ({burst['audio_s_per_s']} audio-s/s), median step "
                     f"{burst['median_step_ms']} ms, steady mean {burst['steady_step_ms_mean']} ms, the last "
                     f"{burst['last_step_ms']}" if "wall_s" in burst else ""))
    write_json(a.out, res)


def trace_main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(prog="profiler.py trace", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--conc", default="1,8")
    ap.add_argument("--warm", type=int, default=30, help="steps before the window (the context grows as in the "
                    "benchmark's first patches)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--sequence", action="store_true", help="also print one step's device events in order")
    ap.add_argument("--engine-kwargs", default="{}", help="JSON of other EngineConfig fields, as for `step`")
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    concs = [int(x) for x in a.conc.split(",")]
    kwargs = json.loads(a.engine_kwargs)
    engine = gpu_engine(a.model, max(concs), **kwargs)
    res: dict = {**run_facts(), "engine_kwargs": kwargs, "conc": {}}
    for c in concs:
        trace(engine, c, 5, 5)  # warm-up of the profiler and the shapes
        r = res["conc"][str(c)] = trace(engine, c, a.warm, a.steps)
        print(f"\nc={c}: period {r['period_ms']:.3f} ms per step, busy {r['busy_ms']:.3f}, idle {r['idle_ms']:.3f}; "
              f"host step() call {r['host_ms_per_step_call']:.3f} ms")
        print("  idle gaps:")
        for g in r["idle_gaps"]:
            print(f"    {1000 * g['ms_per_step']:7.1f} us {g['per_step']:5.1f}x  {g['between']}")
        print("  copies:")
        for g in r["copies"]:
            print(f"    {1000 * g['ms_per_step']:7.1f} us {g['per_step']:5.1f}x  {g['name']}")
        print("  kernels:")
        for g in r["kernels"]:
            print(f"    {1000 * g['ms_per_step']:7.1f} us {g['per_step']:5.1f}x  {g['name']}")
        if a.sequence:
            print("  one step in order (runs of a kernel merged: count, summed us, idle us before):")
            for run in r["one_step"]:
                print(f"    {run['n']:4d}x {run['us']:8.1f} us  idle {run['idle_us']:6.1f}  {run['name']}")
    write_json(a.out, res)
