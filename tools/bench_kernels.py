"""Micro-benchmarks of the decode step's kernels at its shapes, over their launch parameters:
- attention: the local modules' dense attention (query heads per program, warps) at the DiT's and LocEnc's
  shapes per batch size;
- gemm: every bias-free projection of the four transformer stacks (q/k/v, o, gate/up with the SiLU gate, down)
  at few rows, cuBLAS (F.linear, + silu_mul for gate/up) against `skinny_matmul` with its default
  configuration, and a sweep of its tile configurations at the rows of a B=1 step.
- prefetch: an experiment, the DiT's projection chain at B=1 with each GEMM's weights read into L2 by a side
  branch while the GEMM before it runs (H100: the side branch, at most ~0.6 TB/s from 132 programs, made the
  chain 2-16x slower than plain; not used by the engine);
(Tried and removed, H100 (docs/benchmarks.md, profile step 11): programmatic dependent launch of the DiT's kernels,
with and without an L2 prefetch of each GEMM's weights before it waits, never faster than plain launches (f5283e3);
a split-K Triton GEMM with a deterministic last-arrival reduction at the DiT's 88-352 rows, 6-60% slower than cuBLAS
at every shape (9842888).)
Times come from CUDA events over CUDA-graph replays (launch cost excluded, as inside the captured step); the
GEMMs cycle through enough weight copies that each call reads its weight from HBM, not from L2.

    python tools/bench_kernels.py --model /tmp/full --batch 1,8,64,128 --out kernels.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from engine import triton_kernels  # noqa: E402
from engine.config import TransformerConfig, VoxCPMConfig  # noqa: E402
from engine.models.minicpm import rotary_table  # noqa: E402
from tools.profile_step import graph_ms  # noqa: E402


@triton.jit
def _l2_prefetch_kernel(w_ptr, sink_ptr, n, ITERS: tl.constexpr, BLOCK: tl.constexpr, CACHE: tl.constexpr,
                        EVICT: tl.constexpr):
    # Reads n elements (through L2; CACHE ".cg": not into L1, EVICT "evict_last": kept over streaming data;
    # ptxas refuses the two together) and discards them; the store under a condition no data meets keeps the
    # loads from being optimised away.
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for i in range(ITERS):
        offs = (i * tl.num_programs(0) + tl.program_id(0)) * BLOCK + tl.arange(0, BLOCK)
        acc += tl.load(w_ptr + offs, mask=offs < n, other=0.0, cache_modifier=CACHE,
                       eviction_policy=EVICT).to(tl.float32)
    total = tl.sum(acc, axis=0)
    if total == 1.0e38:
        tl.store(sink_ptr, total)


def l2_prefetch(weight: torch.Tensor, programs: int = 32, block: int = 4096, cache: str = ".cg",
                evict: str = "") -> None:
    """Read `weight` (contiguous) into the L2 cache with `programs` programs, for a GEMM that follows."""
    sink = _PREFETCH_SINK.get(weight.device)
    if sink is None:
        sink = _PREFETCH_SINK[weight.device] = torch.zeros(1, dtype=torch.float32, device=weight.device)
    n = weight.numel()
    _l2_prefetch_kernel[(programs,)](weight, sink, n, ITERS=triton.cdiv(n, programs * block), BLOCK=block,
                                     CACHE=cache, EVICT=evict, num_warps=4)


_PREFETCH_SINK: dict[torch.device, torch.Tensor] = {}


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
    for stack, tcfg, per_request in (("LM", cfg.lm, 1), ("DiT", cfg.dit, dit_rows(cfg)),
                                     ("LocEnc", cfg.encoder, cfg.patch_size + 1)):
        for name, (n, k) in zip(("qkv", "o", "gate_up+silu", "down"), layer_shapes(tcfg), strict=True):
            out.append((f"{stack} {name}", n, k, name == "gate_up+silu", per_request))
    return out


def dit_rows(cfg: VoxCPMConfig) -> int:
    """The DiT's activation rows per request at a decode step: CFG's two sequences of 2 * patch + 3 tokens."""
    return 2 * (2 * cfg.patch_size + 3)


def dit_chain(cfg: VoxCPMConfig, dev: torch.device, dtype: torch.dtype) -> tuple[list[list[torch.Tensor]],
                                                                                  torch.Tensor]:
    """Random weights of every DiT layer (one tensor each: none is read from L2 twice in a step) and the input
    rows of a B=1 step."""
    layers = [[torch.randn(n, k, device=dev, dtype=dtype) * k ** -0.5 for n, k in layer_shapes(cfg.dit)]
              for _ in range(cfg.dit.num_hidden_layers)]
    return layers, torch.randn(dit_rows(cfg), cfg.dit.hidden_size, device=dev, dtype=dtype)


def gemm_us(fn: Callable[[torch.Tensor], object], weight: torch.Tensor) -> float:
    """Microseconds per call of fn(weight copy), cycling through copies worth > 2x the L2 cache."""
    copies = max(2, -(-160 * 2**20 // (weight.numel() * weight.element_size())))
    weights = [weight.clone() for _ in range(copies)]
    return replay_us(lambda: [fn(w) for w in weights]) / copies


def bench_gemm(cfg: VoxCPMConfig, batches: list[int], dev: torch.device, dtype: torch.dtype) -> list[dict]:
    rows = []
    sweep = [(bn, bk, stages, 4) for bn in (16, 32) for bk in (128, 256) for stages in (3, 4)]
    sweep += [(16, 256, 6, 4), (16, 128, 4, 2), (16, 512, 3, 4)]
    for name, n_rows, k_dim, gated, per_request in projections(cfg):
        weight = torch.randn(n_rows, k_dim, device=dev, dtype=dtype) * k_dim ** -0.5
        for b in batches:
            m = b * per_request
            if m > triton_kernels.SKINNY_ROWS:
                continue
            x = torch.randn(m, k_dim, device=dev, dtype=dtype)

            def cublas(w: torch.Tensor, x: torch.Tensor = x, gated: bool = gated) -> torch.Tensor:
                y = torch.nn.functional.linear(x, w)
                return triton_kernels.silu_mul(*y.chunk(2, dim=-1)) if gated else y

            base = gemm_us(cublas, weight)
            ours = gemm_us(lambda w, x=x, g=gated: triton_kernels.skinny_matmul(x, w, silu_gate=g), weight)
            gbytes = weight.numel() * weight.element_size() / 1e3  # per us -> GB/s
            row = {"projection": name, "batch": b, "rows": m, "n": n_rows, "k": k_dim, "cublas_us": round(base, 2),
                   "skinny_us": round(ours, 2), "skinny_config": list(triton_kernels.skinny_config(m, k_dim, n_rows)),
                   "skinny_GBps": round(gbytes / ours), "cublas_GBps": round(gbytes / base)}
            if b == batches[0]:
                best = None
                for bn, bk, stages, warps in sweep:
                    config = (max(16, 1 << (m - 1).bit_length()), bn, bk, stages, warps)
                    if (n_rows // (2 if gated else 1)) % bn or k_dim % bk or bk * config[0] > 16384:
                        continue
                    us = gemm_us(lambda w, x=x, c=config, g=gated: triton_kernels.skinny_matmul(x, w, g, c), weight)
                    if best is None or us < best[0]:
                        best = (us, config)
                if best is not None:
                    row |= {"best_us": round(best[0], 2), "best_config": list(best[1])}
            rows.append(row)
            print(f"{name} rows={m}: cuBLAS {base:.2f} us, skinny {ours:.2f} us ({row['skinny_GBps']} GB/s)"
                  + (f", best {row['best_us']:.2f} us at {row['best_config']}" if "best_us" in row else ""), flush=True)
    return rows


def bench_prefetch(cfg: VoxCPMConfig, dev: torch.device, dtype: torch.dtype) -> list[dict]:
    """The DiT's projection chain at a B=1 step (rows 2 * sequence length, every layer's own weights, from HBM),
    plain against each GEMM's weights read into L2 by a side branch while the GEMM before it runs."""
    layers, x0 = dit_chain(cfg, dev, dtype)
    rows, q = x0.shape[0], layers[0][1].shape[1]  # q heads * head_dim: o's K
    weights = [w for layer in layers for w in layer]

    def gemm(i: int, a: torch.Tensor) -> torch.Tensor:
        w = weights[i]
        kind = i % 4
        if kind == 0:
            return torch.nn.functional.linear(a, w)[:, :q]
        if kind == 2:
            return triton_kernels.silu_mul(*torch.nn.functional.linear(a, w).chunk(2, dim=-1))
        return torch.nn.functional.linear(a, w)

    def plain() -> None:
        a = x0
        for i in range(len(weights)):
            a = gemm(i, a)

    side = torch.cuda.Stream(dev)

    def prefetched(programs: int, ahead: int, cache: str, evict: str) -> None:
        main = torch.cuda.current_stream(dev)
        a = x0
        side.wait_stream(main)
        with torch.cuda.stream(side):
            for j in range(ahead):
                l2_prefetch(weights[j], programs, cache=cache, evict=evict)
        for i in range(len(weights)):
            if i + ahead < len(weights):
                side.wait_stream(main)  # start prefetching GEMM i + ahead once GEMM i - 1 is done
                with torch.cuda.stream(side):
                    l2_prefetch(weights[i + ahead], programs, cache=cache, evict=evict)
            a = gemm(i, a)
        main.wait_stream(side)

    out = [{"variant": "plain", "us_per_layer": round(replay_us(plain) / len(layers), 2)}]
    print(f"DiT layer chain rows={rows}: plain {out[0]['us_per_layer']:.2f} us per layer", flush=True)
    for cache, evict in ((".cg", ""), ("", "evict_last")):
        for programs in (16, 32, 66, 132):
            for ahead in (1, 2):
                us = replay_us(partial(prefetched, programs, ahead, cache, evict)) / len(layers)
                name = f"prefetch {cache or evict} programs={programs} ahead={ahead}"
                out.append({"variant": name, "us_per_layer": round(us, 2)})
                print(f"  {name}: {us:.2f} us per layer", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True, help="checkpoint directory (only its config is read)")
    ap.add_argument("--batch", default="1,8,64,128")
    ap.add_argument("--only", default="attention,gemm", help="which benchmarks: attention, gemm, prefetch")
    ap.add_argument("--out")
    a = ap.parse_args()
    cfg = VoxCPMConfig.from_dir(a.model)
    dev, dtype = torch.device("cuda"), torch.bfloat16
    batches = [int(x) for x in a.batch.split(",")]
    rows = []
    gemm_rows = bench_gemm(cfg, batches, dev, dtype) if "gemm" in a.only else []
    prefetch_rows = bench_prefetch(cfg, dev, dtype) if "prefetch" in a.only else []
    for name, tcfg, seq_len, per_request in (("DiT", cfg.dit, 2 * cfg.patch_size + 1 + 2, 2),
                                             ("LocEnc", cfg.encoder, cfg.patch_size + 1, 1)):
        if "attention" not in a.only:
            break
        hq, hk, d = tcfg.num_attention_heads, tcfg.num_key_value_heads, tcfg.head_dim
        rope = rotary_table(tcfg, seq_len, dev)
        for b in batches:
            n = b * per_request
            # q, k, v as views of one fused projection output, as the model hands them over
            qkv = torch.randn(n, seq_len, (hq + 2 * hk) * d, device=dev, dtype=dtype)
            q, k, v = qkv.split([hq * d, hk * d, hk * d], dim=-1)
            q, k, v = q.view(n, seq_len, hq, d), k.view(n, seq_len, hk, d), v.view(n, seq_len, hk, d)
            group = hq // hk
            attend = partial(triton_kernels.dense_attention, q, k, v, rope[:, 0], rope[:, 1])
            for heads in (h for h in (1, 2, 4, 8, 16) if group % h == 0):
                for warps in (1, 2, 4, 8):
                    us = replay_us(partial(attend, heads_per_program=heads, num_warps=warps))
                    rows.append({"module": name, "batch": b, "sequences": n, "seq_len": seq_len,
                                 "heads_per_program": heads, "num_warps": warps, "us": round(us, 2)})
            best = min((r for r in rows if r["module"] == name and r["batch"] == b), key=lambda r: r["us"])
            auto = replay_us(attend)
            print(f"{name} B={b}: default {auto:.1f} us, best {best['us']:.1f} us at heads={best['heads_per_program']} "
                  f"warps={best['num_warps']}", flush=True)
            rows.append({"module": name, "batch": b, "sequences": n, "seq_len": seq_len, "heads_per_program": "default",
                         "num_warps": 2 if n * hq >= 256 else 4, "us": round(auto, 2)})
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "command": " ".join(sys.argv),
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "rows": rows, "gemm": gemm_rows,
              "prefetch": prefetch_rows}
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
