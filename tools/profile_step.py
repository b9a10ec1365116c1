"""Where a decode step's time goes, on a GPU: each component captured in its own CUDA graph and timed
with CUDA events at batch B, next to the whole captured step, the engine step as the host sees it,
and a new request's time to first audio (prefill + first step) in-process.

    python tools/profile_step.py --model /tmp/full --batch 1,64 --out profile.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from engine.runner.attention import AttentionMetadata  # noqa: E402
from engine.runner.buffers import StepInputs  # noqa: E402
from tools.gpu_check import TEXT, step_ms  # noqa: E402

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
        "VAE decode (streaming, fp32)": graph_ms(lambda: r._decode_audio(idx, latents)),
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


def host_step_ms(engine: LLMEngine, b: int, patches: int = 40) -> tuple[float, float]:
    """(engine.step() wall ms with b running streams, first-audio ms of a request added alone)."""
    ms = step_ms(engine, b, patches)
    firsts = sorted(burst_first_audio(engine, 1, first=i)["ttfb_ms_p50"] for i in range(5))
    return ms, firsts[len(firsts) // 2]


def burst_first_audio(engine: LLMEngine, n: int, first: int = 0) -> dict:
    """n requests added at once (the benchmark's burst): wall ms until each has its first audio, and the wall
    ms of every engine.step() until the last one has (where a burst's TTFB goes: prefills, then decodes).
    Request i (from `first`) has its own text suffix and seed."""
    t0 = time.perf_counter()
    ids = {engine.add_request(TEXT + f" {i}", SamplingParams(seed=i, max_generate_length=3))
           for i in range(first, first + n)}
    firsts: dict[int, float] = {}
    steps = []
    while len(firsts) < n:
        s0 = time.perf_counter()
        events = engine.step()
        steps.append(round(1000 * (time.perf_counter() - s0), 2))
        for ev in events:
            if ev.seq_id in ids and ev.seq_id not in firsts:
                firsts[ev.seq_id] = 1000 * (time.perf_counter() - t0)
    while engine.has_unfinished():
        engine.step()
    ttfb = sorted(firsts.values())
    return {"n": n, "ttfb_ms_p50": ttfb[n // 2], "ttfb_ms_max": ttfb[-1], "step_ms": steps}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--batch", default="1,64")
    ap.add_argument("--out")
    ap.add_argument("--kernels", action="store_true", help="also list the step graph's CUDA kernels (torch.profiler)")
    a = ap.parse_args()
    batches = [int(x) for x in a.batch.split(",")]
    engine = LLMEngine(a.model, EngineConfig(max_num_seqs=max(batches), max_model_len=1024,
                                             gpu_memory_utilization=0.8), device="cuda")
    res: dict = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "command": " ".join(sys.argv),
                 "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "startup_s": engine.startup_s,
                 "startup_phases": engine.startup_phases, "capture_times": engine.runner.capture_times,
                 "options": dataclasses.asdict(engine.config.options), "batches": {}}
    for b in batches:
        step_ms, first_ms = host_step_ms(engine, b)
        with engine.invariance():  # the components as the step runs them (VOXCPM_BATCH_INVARIANT=1: in the mode)
            comp = components(engine, b)
        comp["engine.step() as the host sees it"] = step_ms
        comp["new request alone: add -> first audio (prefill + step)"] = first_ms
        res["batches"][str(b)] = comp
        print(f"\nB={b}")
        for k, v in comp.items():
            print(f"  {k:55s} {v:8.2f} ms")
        graphs = {"kernels": engine.runner.graphs, "kernels_vae": engine.runner.vae_stream.graphs} if a.kernels else {}
        for key, graph_of in graphs.items():
            if b not in graph_of:
                continue
            table = kernel_table(graph_of[b])
            res.setdefault(key, {})[str(b)] = table
            print(f"  {key}: {table['kernels_per_step']:.0f} kernels per step, "
                  f"{table['kernel_ms_per_step']:.2f} ms of kernel time")
            for row in table["top"]:
                print(f"    {row['ms_per_step']:7.3f} ms {row['calls_per_step']:6.0f}x  {row['name']}")
    for b in batches:
        if b >= 8:
            burst_first_audio(engine, b)  # warm-up (prefill shapes)
            res.setdefault("bursts", {})[str(b)] = burst = burst_first_audio(engine, b)
            print(f"burst of {b}: first audio p50 {burst['ttfb_ms_p50']:.1f} ms, last {burst['ttfb_ms_max']:.1f} ms; "
                  f"steps {burst['step_ms']}")
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
