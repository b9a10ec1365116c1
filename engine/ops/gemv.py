"""x @ W.T for one (or a few) activation rows as a weight-streaming GEMV, chained by PDL (`engine.ops.pdl`).

The LMs' one-row decode chain is bound by reading the weights: each program loads its whole weight slice into
registers before it waits for the activations, so the next projection's weights stream while the previous kernel
finishes. Where K is longer than one slice, the kernel writes fp32 partial products that the add + RMSNorm after it
sums (`norm.add_rms_norm`). With FP8 weights (`engine.ops.fp8.small_rows_companion`) it streams the e4m3 values, half
the bytes, and scales each output channel's fp32 sum before it rounds or stores it.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

from engine.ops import pdl
from engine.ops.platform import HAVE_TRITON
from engine.options import current

if TYPE_CHECKING:
    import torch
else:
    from engine.lazy_torch import torch  # the kernel-compiling children never load it

if HAVE_TRITON:
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    from engine.ops.silu_mul import silu_mul_math

    @triton.jit
    def _gemv_kernel(x_ptr, w_ptr, scale_ptr, out_ptr, rows, stride_x, N: tl.constexpr, K: tl.constexpr,
                     KS: tl.constexpr, SILU_GATE: tl.constexpr, PARTIAL: tl.constexpr, SCALED: tl.constexpr,
                     BLOCK_N: tl.constexpr, PDL: tl.constexpr):
        # One program per (BLOCK_N output columns, K slice of KS): its whole weight slice goes into registers first,
        # and only then (PDL) does it wait for the kernel before it, whose output the activation rows are: this
        # projection's weights stream from HBM while that kernel still runs (engine/ops/pdl.py). Each row is then
        # reduced against them in fp32.
        SPLITS: tl.constexpr = K // KS
        pid = tl.program_id(0)
        split = pid % SPLITS
        cols = (pid // SPLITS) * BLOCK_N + tl.arange(0, BLOCK_N)
        kk = tl.arange(0, KS)
        if PDL:
            gdc_launch_dependents()
        w_ptrs = w_ptr + cols[:, None].to(tl.int64) * K + split * KS + kk[None, :]
        w = tl.load(w_ptrs)
        if SILU_GATE:  # the up rows follow the gate rows
            w_up = tl.load(w_ptrs + N * K)
        if SCALED:  # e4m3 weights: each output channel's scale (the up rows' after the gate rows')
            scale = tl.load(scale_ptr + cols)
            if SILU_GATE:
                scale_up = tl.load(scale_ptr + N + cols)
        if PDL:
            gdc_wait()
        for m in range(rows):
            x = tl.load(x_ptr + m * stride_x + split * KS + kk).to(tl.float32)
            acc = tl.sum(w.to(tl.float32) * x[None, :], axis=1)
            if SCALED:
                acc = acc * scale
            if PARTIAL:  # fp32 partials over the K slices, summed by `add_rms_norm`
                tl.store(out_ptr + (split * rows + m) * N + cols, acc)
            else:
                y = acc.to(out_ptr.dtype.element_ty)  # rounded like a GEMM's output
                if SILU_GATE:  # then silu_mul's op order on the rounded halves
                    up = tl.sum(w_up.to(tl.float32) * x[None, :], axis=1)
                    if SCALED:
                        up = up * scale_up
                    up = up.to(out_ptr.dtype.element_ty)
                    y = silu_mul_math(y.to(tl.float32), up)
                tl.store(out_ptr + m * N + cols, y)


GEMV_SLICE = 2048  # the most K elements per GEMV program: 8 weight rows of them are 32 KB of registers (16-bit)


GEMV_BLOCK_N = 8  # output columns per program (4 with the SiLU gate, whose up rows double the slice)


@functools.lru_cache(maxsize=64)
def gemv_slices(k_dim: int) -> int:
    """Into how many slices `gemv` cuts K: the fewest of a power-of-two length <= GEMV_SLICE (0: none fits)."""
    return next((s for s in range(1, 17) if k_dim % s == 0 and k_dim // s <= GEMV_SLICE
                 and (k_dim // s) & (k_dim // s - 1) == 0 and k_dim // s >= 16), 0)


def gemv_supported(x: torch.Tensor, weight: torch.Tensor, silu_gate: bool = False, partials: bool = False,
                   scaled: bool = False) -> bool:
    """Whether `gemv` takes x (..., K) @ weight (N, K).T: up to `gemv_max_rows` rows (EngineOptions) of a
    16-bit dtype, a contiguous weight of that dtype (scaled: e4m3); K in slices only where the caller sums
    partials."""
    k_dim = x.shape[-1]
    rows = x.numel() // max(k_dim, 1)
    slices = gemv_slices(k_dim)
    block_n = GEMV_BLOCK_N // 2 if silu_gate else GEMV_BLOCK_N
    return (0 < rows <= current().gemv_max_rows and slices > 0
            and (slices == 1 or (partials and not silu_gate)) and weight.dim() == 2 and weight.shape[1] == k_dim
            and weight.shape[0] % ((2 if silu_gate else 1) * block_n) == 0
            and weight.dtype == (torch.float8_e4m3fn if scaled else x.dtype)
            and x.dtype in (torch.float16, torch.bfloat16) and weight.is_contiguous() and x.stride(-1) == 1)


def gemv(x: torch.Tensor, weight: torch.Tensor, silu_gate: bool = False,
         scale: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., K) @ weight.T for a few rows (`gemv_supported`), launched with PDL where `pdl.launch` says so.
    Returns (..., N) in x's dtype, or where K is cut into S slices the fp32 partial products (S, ..., N) for
    `add_rms_norm`. silu_gate: weight is [gate; up] (2N, K), the result silu(x @ gate.T) * (x @ up.T) rounded as
    the GEMM and `silu_mul` round it. scale: with an e4m3 weight, its per-output-channel fp32 scales (2N with the
    gate), each channel's sum multiplied by its scale before anything else."""
    k_dim = x.shape[-1]
    x2 = x.reshape(-1, k_dim)
    rows, slices = x2.shape[0], gemv_slices(k_dim)
    n = weight.shape[0] // (2 if silu_gate else 1)
    block_n = GEMV_BLOCK_N // 2 if silu_gate else GEMV_BLOCK_N
    if slices > 1:
        out = torch.empty((slices, rows, n), dtype=torch.float32, device=x.device)
    else:
        out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    chained = pdl.launch(x2, rows)
    _gemv_kernel[(n // block_n * slices,)](x2, weight, weight if scale is None else scale, out, rows, x2.stride(0),
                                           N=n, K=k_dim, KS=k_dim // slices, SILU_GATE=silu_gate,
                                           PARTIAL=slices > 1, SCALED=scale is not None, BLOCK_N=block_n,
                                           PDL=chained, num_warps=4, **pdl.option(chained))
    return out.view(slices, *x.shape[:-1], n) if slices > 1 else out.view(*x.shape[:-1], n)

