"""A bias-free projection of a few rows, weight-streaming, with the SiLU gate optionally fused in.

For a handful of rows a GEMM reads each weight once; one program per 16 output columns streams its weight rows and
needs no split-K or reduction kernel. It serves the gate/up projection (`linear.silu_gate_linear`), the one place
it beat cuBLAS, up to EngineOptions.skinny_rows rows.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.ops.platform import HAVE_TRITON
from engine.options import current

if TYPE_CHECKING:
    import torch
else:
    from engine.lazy_torch import torch  # the kernel-compiling children never load it

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from engine.ops.silu_mul import silu_mul_math

    @triton.jit
    def _skinny_matmul_kernel(x_ptr, w_ptr, o_ptr, rows, n_out, stride_x, stride_o, K: tl.constexpr,
                              SILU_GATE: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
                              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        # The weight tile is the dot's left operand (its rows are output columns): a few activation rows
        # fill the dot's narrow side, and each program streams BLOCK_N weight rows once, K-contiguous.
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        m = tl.arange(0, BLOCK_M)
        kk = tl.arange(0, BLOCK_K)
        m_mask = m < rows
        w_ptrs = w_ptr + cols[:, None].to(tl.int64) * K + kk[None, :]
        x_ptrs = x_ptr + m[None, :] * stride_x + kk[:, None]
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        up_offset = n_out.to(tl.int64) * K
        for _ in range(0, K, BLOCK_K):
            xt = tl.load(x_ptrs, mask=m_mask[None, :], other=0.0)
            acc = tl.dot(tl.load(w_ptrs), xt, acc, input_precision=DOT_PRECISION)
            if SILU_GATE:  # the up rows follow the gate rows: same columns, one more accumulator
                acc_up = tl.dot(tl.load(w_ptrs + up_offset), xt, acc_up, input_precision=DOT_PRECISION)
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
        y = acc.to(o_ptr.dtype.element_ty)  # rounded like a GEMM's output
        if SILU_GATE:  # then silu_mul's op order on the rounded halves
            up = acc_up.to(o_ptr.dtype.element_ty)
            y = silu_mul_math(y.to(tl.float32), up)
        tl.store(o_ptr + m[None, :] * stride_o + cols[:, None], y, mask=m_mask[None, :])


def skinny_supported(x: torch.Tensor, weight: torch.Tensor, silu_gate: bool = False) -> bool:
    """Whether `skinny_matmul` takes x (..., K) @ weight (N, K).T: few rows, K and the output width multiples
    of 16, one dtype, a contiguous weight."""
    rows = x.numel() // max(x.shape[-1], 1)
    k_dim, n = x.shape[-1], weight.shape[0] // (2 if silu_gate else 1)
    return (0 < rows <= current().skinny_rows and weight.dim() == 2 and weight.shape[1] == k_dim and k_dim % 16 == 0
            and n % 16 == 0 and x.dtype == weight.dtype and weight.is_contiguous()
            and x.dtype in (torch.float16, torch.bfloat16, torch.float32))


def skinny_config(rows: int, k_dim: int, n: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_stages, num_warps) of `skinny_matmul` for this shape."""
    block_m = max(16, triton.next_power_of_2(rows))
    block_k = next(b for b in (128, 64, 32, 16) if k_dim % b == 0)  # `tools/bench.py kernels`' best for the gated GEMMs
    return block_m, 16, block_k, 4, 4


def skinny_matmul(x: torch.Tensor, weight: torch.Tensor, silu_gate: bool = False,
                  config: tuple[int, int, int, int, int] | None = None) -> torch.Tensor:
    """x (..., K) @ weight.T for a few rows (`skinny_supported`): one program per 16 output columns streams
    their weight rows once (no split-K, no reduction kernel). silu_gate: weight is [gate; up] (2N, K) and
    the result silu(x @ gate.T) * (x @ up.T), as the gate/up GEMM then `silu_mul` round it. config: as
    `skinny_config` returns (default), for `tools/bench.py kernels`' sweep."""
    k_dim = x.shape[-1]
    x2 = x.reshape(-1, k_dim)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    rows = x2.shape[0]
    n = weight.shape[0] // (2 if silu_gate else 1)
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    block_m, block_n, block_k, stages, warps = config or skinny_config(rows, k_dim, n)
    assert rows <= block_m and n % block_n == 0 and k_dim % block_k == 0, (rows, n, k_dim, config)
    _skinny_matmul_kernel[(n // block_n,)](
        x2, weight, out, rows, n, x2.stride(0), out.stride(0), K=k_dim, SILU_GATE=silu_gate,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32", BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_K=block_k, num_stages=stages, num_warps=warps)
    return out.view(*x.shape[:-1], n)

