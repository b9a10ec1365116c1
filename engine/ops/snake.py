"""The VAE's Snake activation x + sin^2(alpha x) / alpha, optionally of a per-channel affine of x, in one pass.

Unfused it is five passes over the largest activations of a step. `snake_math` is shared with the depthwise
convolution (`engine.ops.vae_conv`), which applies it on load and after the conv. The sine may be the hardware
approximation (EngineOptions.fast_sin).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.ops import platform
from engine.ops.platform import HAVE_TRITON, fast_sin, row_tile

if TYPE_CHECKING:
    import torch
else:
    from engine.lazy_torch import torch  # the kernel-compiling children never load it

if HAVE_TRITON:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice

    from engine.ops.platform import row_tile_program

    @triton.jit
    def snake_math(x, alpha, FAST_SIN: tl.constexpr):
        """x + sin^2(alpha x) / alpha in fp32 (the official op order)."""
        if FAST_SIN:  # noqa: SIM108 (a constexpr branch: only one side is compiled)
            s = libdevice.fast_sinf(alpha * x)
        else:
            s = tl.sin(alpha * x)
        return x + (1.0 / (alpha + 1e-9)) * (s * s)

    @triton.jit
    def _snake_kernel(x_ptr, alpha_ptr, scale_ptr, shift_ptr, o_ptr, rows, channels, length, stride_b, stride_c,
                      stride_t, HAS_SCALE: tl.constexpr, HAS_SHIFT: tl.constexpr, FAST_SIN: tl.constexpr,
                      BLOCK_R: tl.constexpr, BLOCK: tl.constexpr):
        bc, b, c, row_mask, t = row_tile_program(rows, channels, BLOCK_R, BLOCK)  # rows: (stream, channel)
        mask = row_mask & (t < length)
        x = tl.load(x_ptr + b * stride_b + c * stride_c + t * stride_t, mask=mask, other=0.0).to(tl.float32)
        if HAS_SCALE:  # a per-channel affine map first (the VAE's sample-rate condition, deferred biases)
            x = x * tl.load(scale_ptr + c, mask=row_mask).to(tl.float32)
        if HAS_SHIFT:
            x = x + tl.load(shift_ptr + c, mask=row_mask).to(tl.float32)
        out = snake_math(x, tl.load(alpha_ptr + c, mask=row_mask, other=1.0).to(tl.float32), FAST_SIN)
        tl.store(o_ptr + bc * length + t, out.to(o_ptr.dtype.element_ty), mask=mask)


def snake_triton(x: torch.Tensor, alpha: torch.Tensor, scale: torch.Tensor | None = None,
                 shift: torch.Tensor | None = None) -> torch.Tensor:
    """x (B, C, T) any strides, alpha (1, C, 1) -> contiguous x + sin^2(alpha x) / alpha in x's dtype, of
    x * scale + shift when given (each (C,), fp32 math)."""
    b, c, t = x.shape
    out = torch.empty((b, c, t), dtype=x.dtype, device=x.device)
    if b and c and t:
        block_rows, block = row_tile(b * c, t)
        _snake_kernel[(triton.cdiv(b * c, block_rows), triton.cdiv(t, block))](
            x, alpha.reshape(-1), x if scale is None else scale, x if shift is None else shift, out, b * c, c, t,
            x.stride(0), x.stride(1), x.stride(2), HAS_SCALE=scale is not None, HAS_SHIFT=shift is not None,
            FAST_SIN=fast_sin(), BLOCK_R=block_rows, BLOCK=block, num_warps=4)
    return out


def snake(x: torch.Tensor, alpha: torch.Tensor, scale: torch.Tensor | None = None,
          shift: torch.Tensor | None = None) -> torch.Tensor:
    """The VAE's Snake activation x + sin^2(alpha x) / alpha (the official op order): five passes over
    the largest activations of the step when unfused. With per-channel `scale` / `shift` ((C,)), of
    x * scale + shift (in the same kernel on CUDA)."""
    if platform.kernels(x) and x.dim() == 3:
        return snake_triton(x, alpha, scale, shift)
    if scale is not None:
        x = x * scale[:, None]
    if shift is not None:
        x = x + shift[:, None]
    return x + (alpha + 1e-9).reciprocal() * torch.sin(alpha * x).pow(2)

