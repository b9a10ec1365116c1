"""A VAE residual unit of few channels as one kernel: Snake -> dilated depthwise causal conv -> Snake -> 1x1 conv
-> + x, the 1x1 conv a `tl.dot` on the depthwise conv's output while it is still in registers.

The two-kernel path (`engine.ops.vae_conv`: the depthwise conv writes its output, a cuBLAS GEMM reads it back with
the residual and writes the sum) moves 20 bytes an fp32 element; this kernel reads x and writes the output, 8. At the
decoder's last four blocks (32-256 channels, 245k samples a stream each) a step is bandwidth-bound there. A program
holds one stream's time block for every output channel, so wider units (the acc would not fit the registers) keep
the two-kernel path. The eager path is the module's own (vae_layers); the carried context is read and replaced as
`causal_depthwise_conv` does (`context_args`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.ops import platform
from engine.ops.platform import HAVE_TRITON, fast_sin
from engine.ops.vae_conv import context_args, context_fits, new_context
from engine.options import current

if TYPE_CHECKING:
    import torch
else:
    from engine.lazy_torch import torch  # the kernel-compiling children never load it

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from engine.ops.vae_conv import cat_load, conv_finish, store_context

    @triton.jit
    def _residual_unit_kernel(x_ptr, state_ptr, slot_ptr, dw_ptr, dw_bias_ptr, in_alpha_ptr, in_shift_ptr,
                              out_alpha_ptr, pw_ptr, y_ptr, new_state_ptr, channels, length, stride_xb, stride_xc,
                              stride_xt, stride_sb, stride_sc, stride_st, K: tl.constexpr, DILATION: tl.constexpr,
                              HAS_STATE: tl.constexpr, HAS_SLOTS: tl.constexpr, HAS_BIAS: tl.constexpr,
                              IN_SHIFT: tl.constexpr, FAST_SIN: tl.constexpr, PRECISION: tl.constexpr,
                              BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_T: tl.constexpr,
                              BLOCK_P: tl.constexpr):
        # A program: stream b, samples [tb * BLOCK_T, +BLOCK_T), every output channel. Per BLOCK_K input channels:
        # the depthwise conv of Snake(x + shift) (recomputed per tap, as the conv kernel does) and its Snake, then
        # acc += W[:, those channels] @ that. Only the first time block reads the context (BLOCK_T >= its width, or
        # one block), and replaces it after its reads, channel block by channel block.
        PAD: tl.constexpr = (K - 1) * DILATION
        b = tl.program_id(0).to(tl.int64)
        t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)[None, :]
        t_mask = t < length
        m = tl.arange(0, BLOCK_C)[:, None]  # output channels
        s_b = tl.load(slot_ptr + b).to(tl.int64) if HAS_SLOTS else b
        first = tl.program_id(1) == 0
        acc = tl.zeros((BLOCK_C, BLOCK_T), dtype=tl.float32)
        for k0 in tl.range(0, channels, BLOCK_K):
            c = k0 + tl.arange(0, BLOCK_K)[:, None]  # input channels (BLOCK_K, 1)
            c_mask = c < channels
            x_row = x_ptr + b * stride_xb + c * stride_xc
            s_row = state_ptr + s_b * stride_sb + c * stride_sc
            in_alpha = tl.load(in_alpha_ptr + c, mask=c_mask, other=1.0).to(tl.float32)
            in_shift = tl.load(in_shift_ptr + c, mask=c_mask, other=0.0).to(tl.float32) if IN_SHIFT else 0.0
            h = tl.zeros((BLOCK_K, BLOCK_T), dtype=tl.float32)
            for j in tl.static_range(K):  # output t reads cat(context, x') at t + j * dilation
                h += tl.load(dw_ptr + c * K + j, mask=c_mask, other=0.0).to(tl.float32) * cat_load(
                    x_row, s_row, t + j * DILATION, c_mask & t_mask, PAD, stride_xt, stride_st, in_alpha, in_shift,
                    HAS_STATE, True, IN_SHIFT, FAST_SIN)
            h = conv_finish(h, c, c_mask, dw_bias_ptr, out_alpha_ptr, y_ptr.dtype.element_ty, HAS_BIAS, True,
                            FAST_SIN)
            w = tl.load(pw_ptr + m * channels + tl.trans(c), mask=(m < channels) & tl.trans(c_mask), other=0.0)
            acc = tl.dot(w, h, acc, input_precision=PRECISION)  # (columns past the length: never stored)
            if HAS_STATE and first:
                store_context(x_row, s_row, new_state_ptr + (b * channels + c) * PAD, c_mask, length, PAD, stride_xt,
                               stride_st, in_alpha, in_shift, HAS_STATE, HAS_SLOTS, True, IN_SHIFT, FAST_SIN,
                               BLOCK_P)
        mask = (m < channels) & t_mask
        acc += tl.load(x_ptr + b * stride_xb + m * stride_xc + t * stride_xt, mask=mask, other=0.0).to(tl.float32)
        tl.store(y_ptr + (b * channels + m) * length + t, acc.to(y_ptr.dtype.element_ty), mask=mask)


# An H200's fastest tiles at the decoder's shapes (tools/bench.py kernels --only vae): the accumulator (every output
# channel x BLOCK_T samples) at RESIDUAL_UNIT_TILE elements a program, BLOCK_T at least the widest context (54).
RESIDUAL_UNIT_TILE = 16384
RESIDUAL_UNIT_BLOCK_K = 32
RESIDUAL_UNIT_WARPS = 8
RESIDUAL_UNIT_MIN_PROGRAMS = 264  # time blocks are halved (to the context's width) while fewer programs would run


def residual_unit_supported(x: torch.Tensor, state: torch.Tensor | None, weight: torch.Tensor,
                            bias: torch.Tensor | None, pointwise: torch.Tensor, dilation: int,
                            slots: torch.Tensor | None = None) -> bool:
    """Whether `fused_residual_unit` runs for these arguments: CUDA kernels, the unit's channels at most
    EngineOptions.vae_fused_unit_channels, the depthwise weight (C, 1, K) and pointwise weight (C, C, 1) in x's
    dtype, the context as `context_fits` takes it."""
    if not (platform.kernels(x) and x.dim() == 3 and weight.dim() == 3 and pointwise.dim() == 3):
        return False
    c = x.shape[1]
    if not 0 < c <= current().vae_fused_unit_channels:
        return False
    if (weight.shape[:2] != (c, 1) or pointwise.shape != (c, c, 1)
            or any(p is not None and p.dtype != x.dtype for p in (weight, bias, pointwise))):
        return False
    return context_fits(state, slots, x, (weight.shape[-1] - 1) * dilation)


def fused_residual_unit(x: torch.Tensor, state: torch.Tensor | None, weight: torch.Tensor, bias: torch.Tensor | None,
                        dilation: int, in_alpha: torch.Tensor, in_shift: torch.Tensor | None, out_alpha: torch.Tensor,
                        pointwise: torch.Tensor,
                        slots: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x + conv1x1(Snake_out(dwconv(cat(state, Snake_in(x + in_shift))))) without the 1x1 conv's bias -> (output
    (B, C, T) contiguous, new context (B, C, P) or None without a state). x (B, C, T) any strides, not written;
    weight (C, 1, K), P = (K - 1) * dilation; alphas (1, C, 1); in_shift (C,) or None; pointwise (C, C, 1). The
    context as `causal_depthwise_conv` takes and replaces it (with `slots`: in place, returned: state). fp32 1x1
    convs follow the process's matmul TF32 setting, as the cuBLAS GEMM they replace does. Only where
    `residual_unit_supported` (the caller checks)."""
    b, c, t = x.shape
    k = weight.shape[-1]
    pad = (k - 1) * dilation
    y = torch.empty((b, c, t), dtype=x.dtype, device=x.device)
    source, slots, state_strides = context_args(x, state, slots)
    in_place = slots is not None
    new_state = new_context(x, state, source, in_place, pad)
    if b and c and t:
        block_c = max(16, triton.next_power_of_2(c))
        block_p = triton.next_power_of_2(max(pad, 1))
        least = max(16, block_p)
        block_t = max(least, RESIDUAL_UNIT_TILE // block_c)
        while block_t > least and b * triton.cdiv(t, block_t) < RESIDUAL_UNIT_MIN_PROGRAMS:
            block_t //= 2
        # only the first time block reads the old context: it must cover it, or be the only block
        assert block_t >= pad or triton.cdiv(t, block_t) == 1, (t, block_t, pad)
        precision = "tf32" if x.dtype != torch.float32 or torch.backends.cuda.matmul.allow_tf32 else "ieee"
        dw = weight.reshape(c, k).contiguous()
        pw = pointwise.reshape(c, c).contiguous()
        _residual_unit_kernel[(b, triton.cdiv(t, block_t))](
            x, source, slots if in_place else dw, dw, bias if bias is not None else dw, in_alpha.reshape(-1),
            in_shift if in_shift is not None else dw, out_alpha.reshape(-1), pw, y,
            new_state if new_state is not None else y, c, t, *x.stride(), *state_strides, K=k, DILATION=dilation,
            HAS_STATE=state is not None, HAS_SLOTS=in_place, HAS_BIAS=bias is not None,
            IN_SHIFT=in_shift is not None, FAST_SIN=fast_sin(), PRECISION=precision, BLOCK_C=block_c,
            BLOCK_K=min(RESIDUAL_UNIT_BLOCK_K, block_c), BLOCK_T=block_t, BLOCK_P=block_p,
            num_warps=RESIDUAL_UNIT_WARPS)
    return y, new_state
