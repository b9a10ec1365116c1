"""Micro-benchmarks of the decode step's kernels at its shapes, over their launch parameters:
- attention: the local modules' dense attention (query heads per program, warps, heads stacked in one tile or one
  after another) at the DiT's and LocEnc's shapes per batch size;
- gemm: every bias-free projection of the four transformer stacks (q/k/v, o, gate/up with the SiLU gate, down)
  at few rows, cuBLAS (F.linear, + silu_mul for gate/up) against `skinny_matmul` with its default
  configuration, and a sweep of its tile configurations at the rows of a B=1 step;
- layer: the DiT's and LocEnc's stacks as separate kernels per layer against the layer kernel (engine/layer_stack.py);
- splitk: the o and down projections with the residual add + RMSNorm after them, one cuBLAS GEMM against the
  split-K partials of `linear.residual_linear` (2 and 4 slices of K) and what `linear.residual_splits` picks;
- mlp: the DiT's MLP (gate/up GEMM, `silu_mul`, down GEMM) at each batch's rows, whole and in 2-8 row chunks (each
  chunk's gate/up output small enough to stay in L2), with its three parts alone, and the gate/up GEMM with `silu_mul`
  in its epilogue as one Triton GEMM (`engine.ops.gated_gemm`) over its tile configurations;
- vae: the streaming VAE decoder's residual units at a step's shapes (each decoder block's channels, a patch's samples
  at its rate, dilations 1 / 3 / 9): the depthwise conv kernel as the decoder runs it (both Snakes, every stream's
  context read and replaced in place), without the Snake on its input (what recomputing it on every tap costs),
  without either Snake, with other time blocks and rows a program; the 1x1 conv + residual after it as cuBLAS's
  batched GEMM (after a copy of x, as the unit consumes its input), also on fp16 operands (the depthwise conv then
  writes fp16); a copy of x alone, the memory floor of one read and one write of the unit's activations; each block's
  upsampler (input kernel, GEMM of every tap, overlap-add) on fp32 (TF32) and on fp16 operands;
- barrier: what one of the layer kernel's grid barriers costs (a grid of one or two programs per SM through 84
  barriers, with and without a store and a load of another program's data between them), against a kernel boundary
  in a CUDA graph (84 dependent launches of the same grid).
(Tried and removed on the H100 (docs/benchmarks.md, "Refuted"): the DiT's GEMM weights read into L2 by a
side branch while the GEMM before runs, 2-16x slower (d3fa620); programmatic dependent launch of the DiT's kernels,
with and without an L2 prefetch of each GEMM's weights before it waits, never faster than plain launches (f5283e3);
a split-K Triton GEMM with a deterministic last-arrival reduction at the DiT's 88-352 rows, 6-60% slower than cuBLAS
at every shape (9842888); the gated GEMM with two accumulators over [gate; up] (H200: 1-3% slower than one over
interleaved rows) or reading its interleaved tiles by tensor descriptors (no faster) (6dfd008); the VAE's 1x1 conv +
residual as a Triton GEMM over every stream, faster than the batched GEMM here but not in the engine's VAE graph
(2855e5b).)
Times come from CUDA events over CUDA-graph replays (launch cost excluded, as inside the captured step); the
GEMMs cycle through enough weight copies that each call reads its weight from HBM, not from L2.

    python tools/bench.py kernels --model /tmp/full --batch 1,8,64,128 --out kernels.json
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from functools import partial
from itertools import product
from pathlib import Path
from unittest import mock

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from engine import options
from engine.config import AudioVAEConfig, TransformerConfig, VoxCPMConfig
from engine.models import dit_rows_per_stream
from engine.models.minicpm import MiniCPM, fuse_projections, rotary_table
from engine.ops import (
    dense_attention,
    fp8,
    fp8_gemm,
    gated_gemm,
    layer_stack,
    linear,
    norm,
    platform,
    silu_mul,
    skinny_gemm,
    upsampler,
    vae_conv,
)
from tools.benchmarks.harness import subcommand_parser
from tools.profiling.step import graph_ms


def replay_us(fn: Callable[[], object]) -> float:
    """Mean microseconds of `fn` captured in a CUDA graph and replayed."""
    return 1000 * graph_ms(fn, reps=50)


def layer_shapes(tcfg: TransformerConfig) -> list[tuple[int, int]]:
    """(output rows, K) of a layer's fused q/k/v, o, fused gate/up and down weights."""
    h, q = tcfg.hidden_size, tcfg.num_attention_heads * tcfg.head_dim
    kv, ffn = tcfg.num_key_value_heads * tcfg.head_dim, tcfg.intermediate_size
    return [(q + 2 * kv, h), (h, q), (2 * ffn, h), (h, ffn)]


def projections(cfg: VoxCPMConfig) -> list[tuple[str, int, int, bool, int]]:
    """(name, output rows of the weight, K, SiLU-gated, activation rows per request at a decode step)."""
    out = []
    for stack, tcfg, per_request in (("LM", cfg.lm, 1), ("DiT", cfg.dit, dit_rows_per_stream(cfg)),
                                     ("LocEnc", cfg.encoder, cfg.patch_size + 1)):
        for name, (n, k) in zip(("qkv", "o", "gate_up+silu", "down"), layer_shapes(tcfg), strict=True):
            out.append((f"{stack} {name}", n, k, name == "gate_up+silu", per_request))
    return out


def weight_copies(weight: torch.Tensor) -> list[torch.Tensor]:
    """Copies of a weight worth > 2x the L2 cache, so that a GEMM cycling through them reads from HBM."""
    copies = max(2, -(-160 * 2**20 // (weight.numel() * weight.element_size())))
    return [weight.clone() for _ in range(copies)]


def gemm_us(fn: Callable[[torch.Tensor], object], weights: list[torch.Tensor]) -> float:
    """Microseconds per call of fn(weight copy), cycling through `weight_copies`."""
    return replay_us(lambda: [fn(w) for w in weights]) / len(weights)


def bench_gemm(cfg: VoxCPMConfig, batches: list[int], dev: torch.device, dtype: torch.dtype) -> list[dict]:
    rows = []
    sweep = [(bn, bk, stages, 4) for bn in (16, 32) for bk in (128, 256) for stages in (3, 4)]
    sweep += [(16, 256, 6, 4), (16, 128, 4, 2), (16, 512, 3, 4)]
    for name, n_rows, k_dim, gated, per_request in projections(cfg):
        weight = torch.randn(n_rows, k_dim, device=dev, dtype=dtype) * k_dim ** -0.5
        weights = weight_copies(weight)  # once per projection, for every call below
        for b in batches:
            m = b * per_request
            if m > options.current().skinny_rows:
                continue
            x = torch.randn(m, k_dim, device=dev, dtype=dtype)

            def cublas(w: torch.Tensor, x: torch.Tensor = x, gated: bool = gated) -> torch.Tensor:
                y = torch.nn.functional.linear(x, w)
                return silu_mul.silu_mul_triton(*y.chunk(2, dim=-1)) if gated else y

            base = gemm_us(cublas, weights)
            ours = gemm_us(lambda w, x=x, g=gated: skinny_gemm.skinny_matmul(x, w, silu_gate=g), weights)
            gbytes = weight.numel() * weight.element_size() / 1e3  # per us -> GB/s
            row = {"projection": name, "batch": b, "rows": m, "n": n_rows, "k": k_dim, "cublas_us": round(base, 2),
                   "skinny_us": round(ours, 2), "skinny_config": list(skinny_gemm.skinny_config(m, k_dim, n_rows)),
                   "skinny_GBps": round(gbytes / ours), "cublas_GBps": round(gbytes / base)}
            if b == batches[0]:
                best = None
                for bn, bk, stages, warps in sweep:
                    config = (skinny_gemm.skinny_config(m, k_dim, n_rows)[0], bn, bk, stages, warps)
                    if (n_rows // (2 if gated else 1)) % bn or k_dim % bk or bk * config[0] > 16384:
                        continue
                    us = gemm_us(lambda w, x=x, c=config, g=gated: skinny_gemm.skinny_matmul(x, w, g, c), weights)
                    if best is None or us < best[0]:
                        best = (us, config)
                if best is not None:
                    row |= {"best_us": round(best[0], 2), "best_config": list(best[1])}
            rows.append(row)
            print(f"{name} rows={m}: cuBLAS {base:.2f} us, skinny {ours:.2f} us ({row['skinny_GBps']} GB/s)"
                  + (f", best {row['best_us']:.2f} us at {row['best_config']}" if "best_us" in row else ""), flush=True)
    return rows


def bench_splitk(cfg: VoxCPMConfig, batches: list[int], dev: torch.device, dtype: torch.dtype) -> list[dict]:
    """Each stack's o and down projection followed by the residual add + RMSNorm, as `DecoderLayer` runs them: one
    cuBLAS GEMM against `linear.residual_linear`'s split-K partials over 2 and 4 slices of K (the kernel summing
    them), and what `linear.residual_splits` picks, at the rows of each batch size (LM: one per request)."""

    rows = []
    for stack, tcfg, per_request in (("LM", cfg.lm, 1), ("DiT", cfg.dit, dit_rows_per_stream(cfg)),
                                     ("LocEnc", cfg.encoder, cfg.patch_size + 1)):
        for name, (n, k_dim) in zip(("o", "down"), layer_shapes(tcfg)[1::2], strict=True):
            weight = torch.randn(n, k_dim, device=dev, dtype=dtype) * k_dim ** -0.5
            weights = weight_copies(weight)
            norm_w = torch.rand(n, device=dev, dtype=dtype) + 0.5
            for b in batches:
                m = b * per_request
                x = torch.randn(m, k_dim, device=dev, dtype=dtype)
                resid = torch.randn(m, n, device=dev, dtype=dtype)
                row = {"projection": f"{stack} {name}", "batch": b, "rows": m, "n": n, "k": k_dim,
                       "picked_splits": linear.residual_splits(m, k_dim, n)}
                for splits in (1, 2, 4):
                    with mock.patch.object(linear, "residual_splits", lambda *_, s=splits: s):
                        if splits > 1 and linear.residual_linear(x, weight).dim() == 2:
                            row[f"splits{splits}_us"] = None  # not split here (VOXCPM_SPLIT_K=0, or K / S unaligned)
                            continue
                        us = gemm_us(lambda w, x=x, r=resid, g=norm_w: norm.add_rms_norm(
                            r, linear.residual_linear(x, w), None, g, 1e-5), weights)
                    row[f"splits{splits}_us"] = round(us, 2)
                rows.append(row)
                print(f"{stack} {name} rows={m}: one GEMM {row['splits1_us']} us, 2 slices {row['splits2_us']},"
                      f" 4 slices {row['splits4_us']} (picked {row['picked_splits']})", flush=True)
    return rows


def bench_mlp_chunks(cfg: VoxCPMConfig, batches: list[int], dev: torch.device, dtype: torch.dtype) -> list[dict]:
    """The DiT's MLP at the rows of each batch size (`dit_rows_per_stream` per request), whole and in row chunks."""
    h, f = cfg.dit.hidden_size, cfg.dit.intermediate_size
    gate_up = torch.randn(2 * f, h, device=dev, dtype=dtype) * h ** -0.5
    down = torch.randn(h, f, device=dev, dtype=dtype) * f ** -0.5
    interleaved = gated_gemm.interleave(gate_up)
    rows = []
    for b in batches:
        m = b * dit_rows_per_stream(cfg)
        x, out = torch.randn(m, h, device=dev, dtype=dtype), torch.empty(m, h, device=dev, dtype=dtype)
        gu = F.linear(x, gate_up)
        gated = silu_mul.silu_mul(gu[:, :f], gu[:, f:])
        parts = {"gate_up": lambda x=x: F.linear(x, gate_up),
                 "silu_mul": lambda gu=gu: silu_mul.silu_mul(gu[:, :f], gu[:, f:]),
                 "down": lambda g=gated, o=out: torch.mm(g, down.t(), out=o)}
        row: dict[str, object] = {"batch": b, "rows": m}
        row.update({f"{k}_us": round(replay_us(fn), 2) for k, fn in parts.items()})
        for chunks in (1, 2, 3, 4, 8):
            mlp = partial(_mlp_in_chunks, x, gate_up, down, out, chunks)
            row[f"mlp_{chunks}_chunks_us"] = round(replay_us(mlp), 2)
        row["gate_up_silu_mul_us"] = round(replay_us(lambda x=x: silu_mul.silu_mul(*F.linear(x, gate_up).chunk(2, -1))),
                                           2)
        for config in GATED_GEMM_CONFIGS:
            err = (gated_gemm.gated_gemm(x, interleaved, config).float() - gated.float()).abs().max().item()
            row[f"gated_gemm_{'x'.join(map(str, config))}"] = {
                "us": round(replay_us(partial(gated_gemm.gated_gemm, x, interleaved, config)), 2), "max_abs_err": err}
        for config, split in PERSISTENT_VARIANTS:
            fn = partial(gated_gemm.gated_gemm_persistent, x, interleaved, config, split)
            row[f"persistent_{'x'.join(map(str, config))}{'_ws' if split else ''}"] = {
                "us": round(replay_us(fn), 2), "max_abs_err": (fn().float() - gated.float()).abs().max().item()}
        rows.append(row)
        print("mlp:", json.dumps(row), flush=True)
    return rows


# FP8 GEMM tiles swept (engine.ops.fp8_gemm.Fp8Tiles): (BLOCK_M, BLOCK_N, BLOCK_K, stages, warps, GROUP_M, persistent)
FP8_SWEEP: list[fp8_gemm.Fp8Tiles] = [
    (128, 128, 128, 4, 8, 8, False), (128, 64, 128, 4, 4, 8, False), (64, 128, 128, 4, 4, 8, False),
    (128, 256, 128, 3, 8, 8, False), (128, 128, 64, 5, 8, 8, False), (128, 128, 128, 4, 8, 8, True),
    (128, 64, 128, 4, 4, 8, True)]
# and for the LMs' and LocEnc's few rows (weight-streaming: narrow tiles, many programs)
FP8_FEW_ROWS_SWEEP: list[fp8_gemm.Fp8Tiles] = [
    (64, 64, 128, 4, 4, 8, False), (64, 32, 128, 4, 4, 8, False), (128, 32, 128, 4, 4, 8, False),
    (64, 64, 256, 3, 4, 8, False), (128, 64, 256, 3, 8, 8, False), (64, 32, 256, 4, 4, 8, False),
    (64, 64, 128, 4, 4, 8, True), (64, 32, 128, 5, 4, 8, True), (128, 32, 128, 5, 4, 8, True)]
FP8_STACKS = {"fp8": ("DiT",), "fp8lm": ("LM", "LocEnc")}  # --only names -> stacks


def bench_fp8(cfg: VoxCPMConfig, batches: list[int], dev: torch.device, stacks: tuple[str, ...] = ("DiT",)
              ) -> list[dict]:
    """A stack's projections on FP8 weights at each batch's rows: `torch._scaled_mm` (cuBLAS) against the Triton FP8
    GEMM at each of FP8_SWEEP's and FP8_FEW_ROWS_SWEEP's tiles, beside the bf16
    cuBLAS GEMM the step runs below `fp8_min_rows` and the row quantiser an FP8 GEMM's input needs where no kernel
    before it quantised it; the gate/up projection also as cuBLAS + the fused SiLU-gated quantiser against the
    Triton GEMM with the gate in its epilogue + the row quantiser (what the down projection reads)."""
    rows = []
    per_stack = {"DiT": (cfg.dit, dit_rows_per_stream(cfg)), "LM": (cfg.lm, 1),
                 "LocEnc": (cfg.encoder, cfg.patch_size + 1)}
    for stack, name, (n, k_dim) in ((s, name, shape) for s in stacks for name, shape in zip(
            ("qkv", "o", "gate_up", "down"), layer_shapes(per_stack[s][0]), strict=True)):
        bf16_weight = torch.randn(n, k_dim, device=dev, dtype=torch.bfloat16) * k_dim ** -0.5
        weight = fp8.quantize_weight(bf16_weight)
        gated = name == "gate_up"
        if gated:
            weight = fp8.interleaved(weight)
        weights = [fp8.Fp8Weight(d, weight.scale.clone()) for d in weight_copies(weight.data)]
        bf16_weights = weight_copies(bf16_weight)
        sweep = FP8_SWEEP + FP8_FEW_ROWS_SWEEP
        for b in batches:
            m = b * per_stack[stack][1]
            x = torch.randn(m, k_dim, device=dev, dtype=torch.bfloat16)
            xq, xs = fp8.quantize_rows(x)
            row: dict[str, object] = {"projection": f"{stack} {name}", "batch": b, "rows": m, "n": n, "k": k_dim}
            if bf16_weights:
                row["bf16_cublas_us"] = round(gemm_us(
                    (lambda w, x=x, half=n // 2: silu_mul.silu_mul(*F.linear(x, w).split(half, -1))) if gated
                    else (lambda w, x=x: F.linear(x, w)), bf16_weights), 2)
                row["quantize_rows_us"] = round(replay_us(lambda x=x: fp8.quantize_rows(x)), 2)
            if gated:  # cuBLAS on the plain weight (the interleaved rows' order does not change its time)
                row["cublas_silu_quant_us"] = round(gemm_us(
                    lambda w, q=xq, s=xs: fp8.silu_mul_quantized(fp8.scaled_matmul(q, s, w, torch.bfloat16)),
                    weights), 2)
            row["cublas_us"] = round(gemm_us(lambda w, q=xq, s=xs: fp8.scaled_matmul(q, s, w, torch.bfloat16),
                                             weights), 2)
            best = None
            for tiles in sweep:
                if not fp8_gemm.tiles_fit(k_dim, n, tiles, gated):
                    continue
                try:
                    us = gemm_us(lambda w, t=tiles, q=xq, s=xs, g=gated: fp8_gemm.fp8_matmul(q, s, w.data, w.scale,
                                                                                             torch.bfloat16, t, g),
                                 weights)
                except Exception as e:  # noqa: BLE001 - a tile that does not compile (shared memory) is reported
                    row["x".join(map(str, tiles))] = type(e).__name__
                    continue
                row["x".join(map(str, tiles))] = round(us, 2)
                if best is None or us < best[0]:
                    best = (us, tiles)
            if best is not None:
                out = fp8_gemm.fp8_matmul(xq, xs, weight.data, weight.scale, torch.bfloat16, best[1], gated)
                row |= {"best_us": round(best[0], 2), "best_tiles": list(best[1])}
                ref = fp8.scaled_matmul(xq, xs, weight, torch.bfloat16)
                if gated:  # the interleaved weight's halves as (gate_i, up_i) column pairs
                    ref = silu_mul.silu_mul(ref[:, 0::2], ref[:, 1::2])
                    row["triton_gated_quant_us"] = round(gemm_us(lambda w, t=best[1], q=xq, s=xs: fp8.quantize_rows(
                        fp8_gemm.fp8_matmul(q, s, w.data, w.scale, torch.bfloat16, t, True)), weights), 2)
                row["max_rel_err"] = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
            rows.append(row)
            print("fp8:", json.dumps(row), flush=True)
    return rows


# the gated GEMM's tiles swept (engine.ops.gated_gemm.GatedGemmConfig); its default is the first
GATED_GEMM_CONFIGS: list[gated_gemm.GatedGemmConfig] = [
    gated_gemm.DEFAULT_CONFIG, (128, 128, 64, 4, 8, 8), (128, 64, 64, 4, 4, 8), (128, 64, 64, 5, 8, 8),
    (256, 64, 64, 3, 8, 8), (128, 128, 32, 5, 8, 8), (128, 128, 64, 3, 8, 16)]


# the persistent gated GEMM's (tiles, warp-specialised loads) swept (engine.ops.gated_gemm.gated_gemm_persistent)
PERSISTENT_VARIANTS: list[tuple[gated_gemm.GatedGemmConfig, bool]] = [
    (c, split) for split in (False, True)
    for c in (gated_gemm.DEFAULT_CONFIG, (128, 128, 64, 4, 8, 8), (128, 64, 64, 4, 4, 8), (128, 128, 64, 3, 8, 16))]


def _mlp_in_chunks(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, out: torch.Tensor, chunks: int) -> None:
    """down(silu(x gate^T) * (x up^T)) for `chunks` slices of x's rows in turn, into out."""
    f, step = down.shape[1], -(-x.shape[0] // chunks)
    for i in range(0, x.shape[0], step):
        gu = F.linear(x[i:i + step], gate_up)
        torch.mm(silu_mul.silu_mul(gu[:, :f], gu[:, f:]), down.t(), out=out[i:i + step])


def sweep_us(run: Callable[[], object], layers: int, setting: str, values: dict[str, object]) -> dict[str, float | str]:
    """us per layer of a fused layer-kernel stack with the engine option `setting` at each value (by label; a value
    that does not compile or launch, e.g. out of shared memory, is reported by its exception's name). A dict value
    sets several options at once (`setting` then only names the sweep)."""
    out: dict[str, float | str] = {}
    for label, value in values.items():
        settings = value if isinstance(value, dict) else {setting: value}
        with options.override(**settings), torch.no_grad():
            try:
                out[label] = round(replay_us(run) / layers, 2)
            except Exception as e:
                out[label] = type(e).__name__
    print(f"  {setting} sweep -> us per layer: {out}", flush=True)
    return out


def bench_layer(cfg: VoxCPMConfig, batches: list[int], dev: torch.device, dtype: torch.dtype) -> list[dict]:
    """The DiT's and LocEnc's whole stacks (every layer its own random weights, read from HBM) at a decode step's
    rows: the layers' separate kernels against the layer kernel (`engine.ops.layer_stack`) as one launch per stack
    (grid barriers) and as one launch per phase; the outputs' relative error against the separate kernels'."""
    out = []
    for name, tcfg, seq_len, per_request in (("DiT", cfg.dit, dit_rows_per_stream(cfg) // 2, 2),
                                             ("LocEnc", cfg.encoder, cfg.patch_size + 1, 1)):
        with torch.device(dev):
            stack = MiniCPM(tcfg).to(dtype)
        with torch.no_grad():
            for p in stack.parameters():
                p.normal_(1.0 if p.dim() == 1 else 0.0, 0.1 if p.dim() == 1 else p.shape[-1] ** -0.5)
        fuse_projections(stack)
        rope = rotary_table(tcfg, seq_len, dev)
        for b in batches:
            x = torch.randn(b * per_request, seq_len, tcfg.hidden_size, device=dev, dtype=dtype)
            if not layer_stack.supported(stack, x):
                continue
            row: dict = {"module": name, "batch": b, "rows": x.shape[0] * seq_len, "layers": len(stack.layers)}
            outputs = {}
            for mode in ("off", "phases", "fused"):
                with options.override(layer_kernel=mode), torch.no_grad():
                    outputs[mode] = stack.forward_local(x, rope).float()
                    us = replay_us(partial(stack.forward_local, x, rope))
                    row[f"{mode}_us_per_layer"] = round(us / len(stack.layers), 2)
            for mode in ("phases", "fused"):
                ref = outputs["off"]
                row[f"{mode}_rel_err"] = float((outputs[mode] - ref).abs().max() / ref.abs().max())
            with options.override(layer_kernel="phases"), torch.no_grad():
                row["phase_us"] = [round(replay_us(partial(layer_stack.dense_stack, stack, x, rope, (phase,)))
                                         / len(stack.layers), 2) for phase in range(7)]
            run = partial(stack.forward_local, x, rope)
            if b == batches[0] and name == "DiT":  # (K tile, stages, warps, programs per SM) of the fused kernel
                launches = [(bk, st, 4, 1) for bk in (64, 128, 256) for st in (3, 4, 5, 6, 8)] + [
                    (128, st, 4, 2) for st in (4, 5)]
                row["fused_sweep_us_per_layer"] = sweep_us(run, len(stack.layers), "layer_launch",
                                                           {str(v): v for v in launches})
            if b == batches[0]:  # output columns per unit, with (K tile, stages, warps, programs per SM)
                row["block_n_sweep_us_per_layer"] = sweep_us(run, len(stack.layers), "layer_block_n", {
                    f"{bn} {launch}": {"layer_block_n": bn, "layer_launch": launch}
                    for bn in (16, 32, 64) for launch in ((128, 4, 4, 2), (128, 4, 4, 1), (128, 6, 4, 1),
                                                          (64, 6, 4, 1), (256, 3, 4, 1))})
            if b == batches[0]:  # MB per projection prefetched into L2
                row["prefetch_sweep_us_per_layer"] = sweep_us(run, len(stack.layers), "layer_prefetch_mb",
                                                              {str(mb): float(mb) for mb in (0, 2, 4, 8, 16, 32)})
            out.append(row)
            print(f"{name} B={b} ({row['rows']} rows): us per layer: separate kernels {row['off_us_per_layer']}, "
                  f"phases {row['phases_us_per_layer']}, fused {row['fused_us_per_layer']}; rel err phases "
                  f"{row['phases_rel_err']:.2e}, fused {row['fused_rel_err']:.2e}; per phase {row['phase_us']}",
                  flush=True)
    return out


@triton.jit
def _barrier_chain(sync_ptr, data_ptr, n, EXCHANGE: tl.constexpr):
    # n grid barriers (the layer kernel's); EXCHANGE: each program stores a line before and reads its neighbour's after
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    offs = tl.arange(0, 128)
    acc = tl.zeros((128,), dtype=tl.float32)
    for i in range(n):
        if EXCHANGE:
            tl.store(data_ptr + pid * 128 + offs, acc + i)
        layer_stack._grid_sync(sync_ptr, (i + 1) * nprog, True)
        if EXCHANGE:
            acc += tl.load(data_ptr + ((pid + 1) % nprog) * 128 + offs, cache_modifier=".cg")
    tl.store(data_ptr + pid * 128 + offs, acc)
    if tl.atomic_add(sync_ptr + 1, 1, sem="acq_rel", scope="gpu") == nprog - 1:  # counters reset for the next launch
        tl.atomic_xchg(sync_ptr, 0, sem="relaxed", scope="gpu")
        tl.atomic_xchg(sync_ptr + 1, 0, sem="relaxed", scope="gpu")


@triton.jit
def _neighbour_step(src_ptr, dst_ptr):
    # one dependent launch: each program reads its neighbour's line of the previous launch
    pid = tl.program_id(0)
    offs = tl.arange(0, 128)
    x = tl.load(src_ptr + ((pid + 1) % tl.num_programs(0)) * 128 + offs)
    tl.store(dst_ptr + pid * 128 + offs, x + 1)


def bench_barrier(dev: torch.device, n: int = 84) -> dict[str, float]:
    """us per grid barrier and per kernel boundary (CUDA-graph replays), one and two programs per SM."""
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    sync = torch.zeros(2, dtype=torch.int32, device=dev)
    out: dict[str, float] = {"sms": sms, "barriers": n}
    for per_sm in (1, 2):
        grid = sms * per_sm
        a, b = torch.zeros(grid * 128, device=dev), torch.zeros(grid * 128, device=dev)
        for exchange in (False, True):
            def chain(count: int, ex: bool = exchange, g: int = grid, data: torch.Tensor = a) -> None:
                _barrier_chain[(g,)](sync, data, count, EXCHANGE=ex, num_warps=4)
            per = 1000 * (graph_ms(partial(chain, n), reps=50) - graph_ms(partial(chain, 0), reps=50)) / n
            out[f"barrier_us_{per_sm}_per_sm{'_exchange' if exchange else ''}"] = round(per, 3)

        def launches(g: int = grid, x: torch.Tensor = a, y: torch.Tensor = b) -> None:
            for i in range(n):
                _neighbour_step[(g,)](x if i % 2 == 0 else y, y if i % 2 == 0 else x, num_warps=4)
        out[f"boundary_us_{per_sm}_per_sm"] = round(1000 * graph_ms(launches, reps=20) / n, 3)
    print("barrier:", json.dumps(out), flush=True)
    return out


DILATIONS = (1, 3, 9)
KERNEL_TAPS = 7


def unit_shapes(cfg: VoxCPMConfig) -> list[tuple[int, int]]:
    """(channels, samples of one step's patch) at each decoder block's output, where its residual units run."""
    return [(channels // 2, frames * rate) for channels, rate, frames in upsampler_shapes(cfg)]


def upsampler_shapes(cfg: VoxCPMConfig) -> list[tuple[int, int, int]]:
    """(input channels, stride, input frames of one step's patch) of each decoder block's upsampler."""
    vae = AudioVAEConfig.from_dict(cfg.audio_vae, cfg.version)
    shapes, length, channels = [], cfg.patch_size, vae.decoder_dim
    for rate in vae.decoder_rates:
        shapes.append((channels, rate, length))
        length, channels = length * rate, channels // 2
    return shapes


def bench_vae(cfg: VoxCPMConfig, batches: list[int], dev: torch.device) -> list[dict]:
    """The VAE residual units (module docstring): one row per batch, block and dilation (fp32, the decoder's dtype by
    default); prints each batch's sums."""
    rows: list[dict] = []
    vae_conv.match_cudnn_tf32()  # the 1x1 GEMMs as the CUDA runner has them
    for b in batches:
        sums: dict[str, float] = {}
        for channels, length in unit_shapes(cfg):
            for dilation in DILATIONS:
                pad = (KERNEL_TAPS - 1) * dilation
                x = torch.randn(b, channels, length, device=dev)
                state = torch.randn(b, channels, pad, device=dev)
                slots = torch.arange(b, device=dev, dtype=torch.int32)
                weight = torch.randn(channels, 1, KERNEL_TAPS, device=dev) * 0.3
                bias = torch.randn(channels, device=dev)
                alpha1, alpha2 = (torch.rand(1, channels, 1, device=dev) + 0.5 for _ in range(2))
                conv = partial(vae_conv.causal_depthwise_conv, x, state, weight, bias, dilation, slots=slots)
                h, _ = conv(alpha2, in_alpha=alpha1)
                pointwise = torch.randn(channels, channels, 1, device=dev) * channels ** -0.5
                residual = torch.empty_like(x)
                y = torch.empty_like(x)
                runs = {"dwconv": partial(conv, alpha2, in_alpha=alpha1),
                        "dwconv_out_snake_only": partial(conv, alpha2),
                        "dwconv_no_snake": partial(conv, None),
                        "dwconv_fp16_out": partial(conv, alpha2, in_alpha=alpha1, out_dtype=torch.float16),
                        "pointwise_residual": lambda h=h, w=pointwise, r=residual, x=x: (
                            r.copy_(x), vae_conv.pointwise_conv_residual(h, w, None, r)),
                        "pointwise_residual_fp16": lambda h=h.half(), w=pointwise.half(), r=residual, x=x: (
                            r.copy_(x), vae_conv.pointwise_conv_residual(h, w, None, r)),
                        "copy_of_x": lambda x=x, y=y: y.copy_(x)}
                row: dict[str, object] = {"batch": b, "channels": channels, "samples": length, "dilation": dilation,
                                          "mb_of_x": round(x.numel() * 4 / 2 ** 20, 1)}
                for name, fn in runs.items():
                    row[f"{name}_us"] = round(1000 * graph_ms(fn, reps=50), 2)
                for time_block, tile in ((64, 1024), (256, 1024)):
                    with (mock.patch.object(vae_conv, "DWCONV_TIME_BLOCK", time_block),
                          mock.patch.object(platform, "ROW_TILE_ELEMENTS", tile)):
                        row[f"dwconv_block_{time_block}_tile_{tile}_us"] = round(
                            1000 * graph_ms(partial(conv, alpha2, in_alpha=alpha1), reps=50), 2)
                for key, value in row.items():
                    if key.endswith("_us"):
                        sums[key] = round(sums.get(key, 0.0) + float(value), 1)  # type: ignore[arg-type]
                rows.append(row)
        for c_in, rate, n in upsampler_shapes(cfg):
            c_out, taps = c_in // 2, 2 * rate  # the official geometry: kernel 2 x stride, one frame of context
            x = torch.randn(b, c_in, n, device=dev)
            state = torch.randn(b, c_in, (taps - 1) // rate, device=dev)
            slots = torch.arange(b, device=dev, dtype=torch.int32)
            weight = torch.randn(taps * c_out, c_in, device=dev) * c_in ** -0.5
            bias = torch.randn(c_out, device=dev)
            row = {"batch": b, "upsampler_in": c_in, "upsampler_out": c_out, "frames": n}
            for name, dtype in (("tf32", torch.float32), ("fp16", torch.float16)):
                key = f"upsampler_{name}_us"
                row[key] = round(1000 * graph_ms(partial(
                    upsampler.causal_conv_transpose, x, state, weight.to(dtype), bias, rate, taps, slots), reps=50), 2)
                sums[key] = round(sums.get(key, 0.0) + row[key], 1)
            rows.append(row)
        print(f"vae B={b} sums over the residual units and the upsamplers:", json.dumps(sums), flush=True)
        rows.append({"batch": b, "sums_us": sums})
    return rows


def main(argv: list[str]) -> None:
    ap = subcommand_parser("kernels", __doc__)
    ap.add_argument("--model", required=True, help="checkpoint directory (only its config is read)")
    ap.add_argument("--batch", default="1,8,64,128")
    ap.add_argument("--only", default="attention,gemm,layer",
                    help="which benchmarks: attention, gemm, layer, barrier, splitk, mlp (with the fused gated GEMM), "
                         "vae, fp8 (the DiT's FP8 projections: cuBLAS against the Triton FP8 GEMM's tiles), "
                         "fp8lm (the same for the LMs and LocEnc, beside their bf16 GEMMs)")
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    cfg = VoxCPMConfig.from_dir(a.model)
    dev, dtype = torch.device("cuda"), torch.bfloat16
    batches = [int(x) for x in a.batch.split(",")]
    only = set(a.only.split(","))
    rows = []
    gemm_rows = bench_gemm(cfg, batches, dev, dtype) if "gemm" in only else []
    layer_rows = bench_layer(cfg, batches, dev, dtype) if "layer" in only else []
    barrier = bench_barrier(dev) if "barrier" in only else {}
    mlp_rows = bench_mlp_chunks(cfg, batches, dev, dtype) if "mlp" in only else []
    vae_rows = bench_vae(cfg, batches, dev) if "vae" in only else []
    fp8_rows = [r for key, stacks in FP8_STACKS.items() if key in only for r in bench_fp8(cfg, batches, dev, stacks)]
    with torch.inference_mode():  # residual_linear splits only without autograd
        splitk_rows = bench_splitk(cfg, batches, dev, dtype) if "splitk" in only else []
    attention = (("DiT", cfg.dit, dit_rows_per_stream(cfg) // 2, 2), ("LocEnc", cfg.encoder, cfg.patch_size + 1, 1))
    for name, tcfg, seq_len, per_request in attention if "attention" in only else ():
        hq, hk, d = tcfg.num_attention_heads, tcfg.num_key_value_heads, tcfg.head_dim
        rope = rotary_table(tcfg, seq_len, dev)
        for b in batches:
            n = b * per_request
            # q, k, v as views of one fused projection output, as the model hands them over
            qkv = torch.randn(n, seq_len, (hq + 2 * hk) * d, device=dev, dtype=dtype)
            q, k, v = qkv.split([hq * d, hk * d, hk * d], dim=-1)
            q, k, v = q.view(n, seq_len, hq, d), k.view(n, seq_len, hk, d), v.view(n, seq_len, hk, d)
            group = hq // hk
            attend = partial(dense_attention.dense_attention_triton, q, k, v, rope[:, 0], rope[:, 1])
            for heads, warps, stacked in product((h for h in (1, 2, 4, 8, 16) if group % h == 0), (1, 2, 4, 8),
                                                 (False, True)):
                us = replay_us(partial(attend, heads_per_program=heads, num_warps=warps, stacked=stacked))
                rows.append({"module": name, "batch": b, "sequences": n, "seq_len": seq_len, "heads_per_program": heads,
                             "num_warps": warps, "stacked": stacked, "us": round(us, 2)})
            best = min((r for r in rows if r["module"] == name and r["batch"] == b), key=lambda r: r["us"])
            auto = replay_us(attend)
            print(f"{name} B={b}: default {auto:.1f} us, best {best['us']:.1f} us at heads={best['heads_per_program']} "
                  f"warps={best['num_warps']} stacked={best['stacked']}", flush=True)
            rows.append({"module": name, "batch": b, "sequences": n, "seq_len": seq_len, "heads_per_program": "default",
                         "default_heads": dense_attention.dense_attention_heads(n, hq, group, seq_len),
                         "num_warps": dense_attention.DENSE_ATTENTION_WARPS, "stacked": True, "us": round(auto, 2)})
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "command": " ".join(sys.argv),
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "rows": rows, "gemm": gemm_rows,
              "layer": layer_rows, "barrier": barrier, "splitk": splitk_rows, "mlp": mlp_rows,
              "vae": vae_rows, "fp8": fp8_rows}
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1))
