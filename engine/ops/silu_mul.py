"""SiLU(gate) * up over the two halves of the fused gate/up projection, one kernel instead of three."""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.ops import platform
from engine.ops.platform import HAVE_TRITON

if TYPE_CHECKING:
    import torch
else:
    from engine.lazy_torch import torch  # the kernel-compiling children never load it

if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def silu_mul_math(g, u):
        """SiLU(g) * u for fp32 g and u in the dtype, rounded as F.silu and the product round it (to u's dtype)."""
        s = (g / (1.0 + tl.exp(-g))).to(u.dtype)  # F.silu rounds to the dtype before the product
        return (s.to(tl.float32) * u.to(tl.float32)).to(u.dtype)

    @triton.jit
    def _silu_mul_kernel(g_ptr, u_ptr, o_ptr, n_cols, stride_g, stride_u, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < n_cols
        g = tl.load(g_ptr + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + row * stride_u + cols, mask=mask, other=0.0)
        tl.store(o_ptr + row * n_cols + cols, silu_mul_math(g, u), mask=mask)


def silu_mul_triton(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up; gate and up may be strided views (the halves of one projection)."""
    n = gate.shape[-1]
    g2, u2 = gate.reshape(-1, n), up.reshape(-1, n)
    if g2.stride(-1) != 1:
        g2 = g2.contiguous()
    if u2.stride(-1) != 1:
        u2 = u2.contiguous()
    out = torch.empty(g2.shape, dtype=up.dtype, device=up.device)
    if g2.shape[0]:
        block = min(1024, triton.next_power_of_2(n))
        _silu_mul_kernel[(g2.shape[0], triton.cdiv(n, block))](g2, u2, out, n, g2.stride(0), u2.stride(0),
                                                                 BLOCK=block, num_warps=4)
    return out.view(gate.shape)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    if platform.kernels(gate):
        return silu_mul_triton(gate, up)
    return torch.nn.functional.silu(gate) * up

