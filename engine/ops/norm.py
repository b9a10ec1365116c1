"""RMSNorm, and the residual add before it, in one pass over each row.

A residual update and the norm after it sit between every pair of GEMMs of a transformer layer; fusing them halves
the launches there. The kernel follows the eager op order and rounding points (fp32 variance, the normalised row
rounded to the dtype before the weight). Where the next GEMM runs on FP8 weights (`engine.ops.fp8`), a second kernel
also quantises the norm's rows as the FP8 GEMM would (`fp8.quantize_rows`, bitwise) and hands them on with the tensor
(`fp8.attach_rows`): one launch and one read of the rows fewer before each such GEMM.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.ops import fp8, pdl, platform
from engine.ops.platform import HAVE_TRITON

if TYPE_CHECKING:
    import torch
else:
    from engine.lazy_torch import torch  # the kernel-compiling children never load it

if HAVE_TRITON:
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    @triton.jit
    def _add_rms_norm_row(x_ptr, h_ptr, w_ptr, x_out_ptr, y_ptr, row, cols, mask, n_cols, split_stride, eps, scale,
                          HAS_H: tl.constexpr, HAS_SCALE: tl.constexpr, SPLITS: tl.constexpr, PDL: tl.constexpr):
        # One row: the residual update stored (HAS_H), then its norm stored and returned (in x's dtype).
        if PDL:  # engine/ops/pdl.py: the next kernel may start; the norm weight is ours, the rows the kernel before's
            gdc_launch_dependents()
        w = tl.load(w_ptr + cols, mask=mask, other=0.0)
        if PDL:
            gdc_wait()
        x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0)
        if HAS_H:
            h = tl.load(h_ptr + row * n_cols + cols, mask=mask, other=0.0)
            if SPLITS > 1:  # h is a split-K GEMM's fp32 partials: summed in split order, rounded as its output
                for s in tl.static_range(1, SPLITS):
                    h += tl.load(h_ptr + s * split_stride.to(tl.int64) + row * n_cols + cols, mask=mask, other=0.0)
                h = h.to(x.dtype)
            if HAS_SCALE:  # eager rounds h * scale to the activation dtype before the add
                h = (h.to(tl.float32) * scale).to(x.dtype)
            x = (x.to(tl.float32) + h.to(tl.float32)).to(x.dtype)
            tl.store(x_out_ptr + row * n_cols + cols, x, mask=mask)
        xf = x.to(tl.float32)
        variance = tl.sum(xf * xf, axis=0) / n_cols
        y = (xf * tl.rsqrt(variance + eps)).to(x.dtype)
        y = (y.to(tl.float32) * w.to(tl.float32)).to(x.dtype)
        tl.store(y_ptr + row * n_cols + cols, y, mask=mask)
        return y

    @triton.jit
    def _add_rms_norm_kernel(x_ptr, h_ptr, w_ptr, x_out_ptr, y_ptr, n_cols, split_stride, eps, scale,
                             HAS_H: tl.constexpr, HAS_SCALE: tl.constexpr, SPLITS: tl.constexpr, BLOCK: tl.constexpr,
                             PDL: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        _add_rms_norm_row(x_ptr, h_ptr, w_ptr, x_out_ptr, y_ptr, row, cols, cols < n_cols, n_cols, split_stride,
                          eps, scale, HAS_H, HAS_SCALE, SPLITS, PDL)

    @triton.jit
    def _add_rms_norm_quantize_kernel(x_ptr, h_ptr, w_ptr, x_out_ptr, y_ptr, q_ptr, s_ptr, n_cols, split_stride, eps,
                                      scale, HAS_H: tl.constexpr, HAS_SCALE: tl.constexpr, SPLITS: tl.constexpr,
                                      BLOCK: tl.constexpr, FLOOR: tl.constexpr, FP8_MAX: tl.constexpr,
                                      INV_MAX: tl.constexpr):
        # `_add_rms_norm_kernel`, then the FP8 row quantiser (`fp8._quantize_rows_kernel`) on the norm as stored.
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        y = _add_rms_norm_row(x_ptr, h_ptr, w_ptr, x_out_ptr, y_ptr, row, cols, mask, n_cols, split_stride, eps,
                              scale, HAS_H, HAS_SCALE, SPLITS, False)
        fp8.store_quantized_row(y.to(tl.float32), q_ptr, s_ptr, row, n_cols, cols, mask, FLOOR, FP8_MAX, INV_MAX)


def add_rms_norm_triton(x: torch.Tensor, h: torch.Tensor | None, scale: float | None, weight: torch.Tensor,
                        eps: float, quantize: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + h * scale, RMSNorm of it) over the last dim; h=None: (x, RMSNorm(x)). h may also be a split-K GEMM's
    fp32 partial products (S, *x.shape) (`linear.residual_linear`): summed in split order and rounded to x's dtype
    first, as the GEMM's own output would be. quantize: the same kernel also quantises the norm's rows for an FP8
    GEMM (`fp8.quantize_rows` of it, bitwise) and attaches them to it (`fp8.attach_rows`)."""
    n = x.shape[-1]
    x2 = x.reshape(-1, n).contiguous()
    splits = 1
    if h is not None and h.dim() == x.dim() + 1:
        if h.shape[1:] != x.shape or h.dtype != torch.float32:
            raise ValueError(f"split-K partials must be fp32 (S, *{tuple(x.shape)}), got {h.dtype} {tuple(h.shape)}")
        splits = h.shape[0]
        if splits == 1:  # one "partial": the GEMM's output, rounded as such
            h = h[0].to(x.dtype)
    h2 = h.reshape(splits, -1, n).contiguous() if h is not None else x2
    x_out = torch.empty_like(x2) if h is not None else x2
    y = torch.empty_like(x2)
    rows, block = x2.shape[0], triton.next_power_of_2(n)
    common = {"HAS_H": h is not None, "HAS_SCALE": scale is not None, "SPLITS": splits, "BLOCK": block,
              "num_warps": max(1, min(16, block // 256))}
    normed = y.view(x.shape)
    if quantize:
        q, row_scale = fp8.empty_rows(rows, n, x2.device)
        if rows:
            _add_rms_norm_quantize_kernel[(rows,)](x2, h2, weight, x_out, y, q, row_scale, n, x2.numel(), eps,
                                                   1.0 if scale is None else scale, **fp8.QUANTISER_CONSTANTS,
                                                   **common)
        fp8.attach_rows(normed, q, row_scale)
    elif rows:
        chained = pdl.launch(x2, rows)
        _add_rms_norm_kernel[(rows,)](x2, h2, weight, x_out, y, n, x2.numel(), eps, 1.0 if scale is None else scale,
                                      PDL=chained, **common, **pdl.option(chained))
    return x_out.view(x.shape), normed


def rms_norm_eager(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Variance in fp32, normalised x rounded to x's dtype, then scaled (the official op order)."""
    variance = x.float().pow(2).mean(-1, keepdim=True)
    return (x * torch.rsqrt(variance + eps)).to(x.dtype) * weight


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if platform.kernels(x) and weight.dtype == x.dtype:
        return add_rms_norm_triton(x, None, None, weight, eps)[1]
    return rms_norm_eager(x, weight, eps)


def add_rms_norm(x: torch.Tensor, h: torch.Tensor, scale: float | None, weight: torch.Tensor,
                 eps: float, quantize: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual update x + h (times muP `scale` when given) and the RMSNorm of the result, which
    the next sub-block reads: one kernel instead of two between every pair of GEMMs. h is the branch's output,
    or the split-K partial products (S, *x.shape) fp32 that `residual_linear` made of it (summed here). quantize: the
    next sub-block's first GEMM runs on FP8 weights; where the kernel runs it also quantises the norm's rows
    (`fp8.rows_of` finds them), saving the FP8 GEMM's own quantiser launch."""
    partials = h.dim() == x.dim() + 1
    if (platform.kernels(x) and weight.dtype == x.dtype and h.shape[int(partials):] == x.shape
            and h.dtype == (torch.float32 if partials else x.dtype)):
        return add_rms_norm_triton(x, h, scale, weight, eps, quantize=quantize and fp8.kernel_quantises(x))
    if partials:
        h = h.sum(0).to(x.dtype)
    x = x + h if scale is None else x + h * scale
    return x, rms_norm_eager(x, weight, eps)
