"""What runtime LoRA adapters cost a decode step, on a GPU: the captured step at each batch B without terms (the plain
graph, which a step of one adapter runs on the weights with it merged) and with them (rows using the adapters in
turn), each graph's kernels summed by name (torch.profiler), and what switching the merged adapter costs
(`LoRASlots.merge`: host and device ms).

    python tools/bench.py lora-step --model /tmp/full --loras 4 --rank 32 --batch 1,64 --out lora_step.json
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import torch

from engine import EngineConfig, LLMEngine
from engine.io.checkpoint import load_model
from tools.benchmarks.harness import subcommand_parser
from tools.benchmarks.stream import random_adapters
from tools.profiling.step import graph_ms, kernel_table, step_inputs_at_context


def merge_ms(engine: LLMEngine, slots: int, reps: int = 12) -> dict[str, float]:
    """Host and device milliseconds of one switch of the merged adapter, cycling through the slots and the base."""
    lora = engine.runner.lora
    assert lora is not None
    host, device = [], []
    for i in range(reps):
        target = i % (slots + 1) - 1  # -1 (the base), 0, 1, ...
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        t0 = time.perf_counter()
        lora.merge(target)
        host.append(1000 * (time.perf_counter() - t0))
        end.record()
        torch.cuda.synchronize()
        device.append(start.elapsed_time(end))
    lora.merge(-1)
    torch.cuda.synchronize()
    return {"host_ms_median": sorted(host)[len(host) // 2], "device_ms_median": sorted(device)[len(device) // 2],
            "rewrites": lora.rewrites}


@torch.inference_mode()
def terms(engine: LLMEngine, batches: list[int], slots: int) -> list[dict[str, object]]:
    """Each kind of term of a step at each batch (the first layer of each stack, q/k/v as one and o), its rows using
    the slots in turn: microseconds of `add_lora` / `add_lora_qkv` on the kernel path and on the eager masked GEMMs
    (`EngineOptions.lora_kernel` off), each captured in a graph, and the kernel path's error against the eager one."""
    from engine import options
    from engine.ops import lora as lora_ops

    bb = engine.runner.model.backbone
    stacks = {"base_lm": (bb.base_lm, 1), "residual_lm": (bb.residual_lm, 1),
              "dit": (bb.feat_decoder.estimator.decoder, bb.condition_tokens + 1 + engine.runner.cfg.patch_size)}
    ctx = bb.lora_context
    rows = []
    for b in batches:
        for name, (stack, inner) in stacks.items():
            attention = stack.layers[0].self_attn
            lead = 2 * b if name == "dit" else b  # the DiT's CFG halves
            gen = torch.Generator(device="cuda").manual_seed(b)
            slot_of_row = torch.arange(lead, device="cuda") % slots
            for kind, width in (("qkv", attention.qkv_weight.shape[1]), ("o", attention.o_proj.in_features)):
                shape = (lead, inner, width) if name == "dit" else (lead, width)
                x = torch.randn(shape, generator=gen, device="cuda", dtype=attention.qkv_weight.dtype)
                weight = attention.qkv_weight if kind == "qkv" else attention.o_proj.weight
                out = torch.nn.functional.linear(x, weight)

                def add(x: torch.Tensor = x, out: torch.Tensor = out, attention: torch.nn.Module = attention,
                        kind: str = kind) -> torch.Tensor:
                    if kind == "qkv":
                        return lora_ops.add_lora_qkv(attention, x, out.clone())
                    return lora_ops.add_lora(attention.o_proj, x, out.clone())

                before = ctx.mask, ctx.slots
                ctx.mask, ctx.slots = ctx.rows(slot_of_row, x.dtype), slot_of_row
                row: dict[str, object] = {"batch": b, "stack": name, "term": kind, "x": list(x.shape)}
                try:
                    results = {}
                    for variant in ("off", "kernels"):  # EngineOptions.lora_kernel
                        with options.override(lora_kernel=variant == "kernels"):
                            results[variant] = add().float()
                            row[f"{variant}_us"] = 1000 * graph_ms(add)
                finally:
                    ctx.mask, ctx.slots = before
                scale = results["off"].abs().max()
                for variant in ("kernels",):
                    row[f"{variant}_rel_err"] = ((results[variant] - results["off"]).abs().max() / scale).item()
                rows.append(row)
                print(json.dumps(rows[-1]), flush=True)
    return rows


@torch.inference_mode()
def step_graphs(engine: LLMEngine, b: int, slots: int) -> dict[str, object]:
    """The plain and the term graph of bucket b, replayed on b rows (`step_inputs_at_context`), rows using the slots
    in turn."""
    r = engine.runner
    assert b in r.graphs and b in r.term_graphs
    step_inputs_at_context(engine, b).lora_slots.copy_(torch.arange(b) % slots)
    assert r.lora is not None
    r.lora.merge(-1)  # the term graph adds the terms to the base weights
    plain, terms = graph_ms(r.graphs[b]), graph_ms(r.term_graphs[b])
    return {"plain_ms": plain, "terms_ms": terms, "ratio": terms / plain,
            "plain_kernels": kernel_table(r.graphs[b]), "terms_kernels": kernel_table(r.term_graphs[b], top=25)}


def main(argv: list[str]) -> None:
    ap = subcommand_parser("lora-step", __doc__)
    ap.add_argument("--model", required=True)
    ap.add_argument("--loras", type=int, default=4)
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--batch", default="1,64", help="batch buckets (comma-separated)")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    batches = [int(b) for b in a.batch.split(",")]
    engine = LLMEngine(load_model(a.model, "cuda"), EngineConfig(max_num_seqs=max(batches), max_model_len=1024,
                                                                  max_loras=a.loras, max_lora_rank=a.rank), "cuda")
    lora = engine.runner.lora
    assert lora is not None
    for i, path in enumerate(random_adapters(a.model, a.loras, a.rank, Path(tempfile.mkdtemp()))):
        engine.register_lora(f"bench{i}", str(path))
        slot, _ = lora.acquire(lora.resolve(f"bench{i}"))  # resident
        lora.release(slot)
    doc: dict[str, object] = {"model": a.model, "loras": a.loras, "rank": a.rank, "gpu": torch.cuda.get_device_name(),
                              "merge": merge_ms(engine, a.loras)}
    print(json.dumps({"merge": doc["merge"]}), flush=True)
    doc["terms"] = terms(engine, batches, a.loras)
    for b in batches:
        row = step_graphs(engine, b, a.loras)
        doc[f"B={b}"] = row
        print(json.dumps({"batch": b, **{k: row[k] for k in ("plain_ms", "terms_ms", "ratio")}}), flush=True)
        for name in ("plain_kernels", "terms_kernels"):
            table = row[name]
            assert isinstance(table, dict)
            print(f"  {name}: {table['kernels_per_step']:.0f} kernels, {table['kernel_ms_per_step']:.3f} ms")
            for k in table["top"]:
                print(f"    {k['ms_per_step']:7.3f} ms {k['calls_per_step']:6.0f}x  {k['name']}")
    if a.out:
        a.out.write_text(json.dumps(doc, indent=1))
