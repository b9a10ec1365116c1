"""The VAE residual unit's convolutions: the dilated depthwise causal conv with its Snakes, and the 1x1 conv.

A residual unit is Snake -> dilated depthwise causal conv -> Snake -> 1x1 conv -> + x. The depthwise kernel reads the
carried context of every stream in place (no concatenation copy) and applies both Snakes; the 1x1 conv and the
residual add are one batched GEMM (`pointwise_conv_residual`). The eager path is the module's own (vae_layers).
`context_args` / `context_fits` are shared with the upsampler (`engine.ops.upsampler`).
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

from engine.ops import platform
from engine.ops.platform import HAVE_TRITON, fast_sin, row_tile
from engine.options import batch_invariant, current

if TYPE_CHECKING:
    import torch
else:
    from engine.lazy_torch import torch  # the kernel-compiling children never load it

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from engine.ops.platform import row_tile_program
    from engine.ops.snake import snake_math

    @triton.jit
    def x_load(x_row, i, mask, stride_xt, in_alpha, in_shift, IN_SNAKE: tl.constexpr, IN_SHIFT: tl.constexpr,
               FAST_SIN: tl.constexpr):
        """x'[i] in fp32 where mask (see `cat_load`; elsewhere x' of 0)."""
        v = tl.load(x_row + i * stride_xt, mask=mask, other=0.0)
        if IN_SNAKE:
            vf = v.to(tl.float32)
            if IN_SHIFT:
                vf = vf + in_shift
            v = snake_math(vf, in_alpha, FAST_SIN).to(v.dtype)
        return v.to(tl.float32)

    @triton.jit
    def cat_load(x_row, s_row, idx, mask, pad, stride_xt, stride_st, in_alpha, in_shift, HAS_STATE: tl.constexpr,
                  IN_SNAKE: tl.constexpr, IN_SHIFT: tl.constexpr, FAST_SIN: tl.constexpr):
        """cat(state, x')[idx] along time (idx in [0, pad + length)) in fp32, x' = x or, with IN_SNAKE,
        Snake(x [+ in_shift]) rounded to x's dtype (the separate Snake kernel's output; the state holds earlier x');
        without state the zero left-padding of a full-sequence pass."""
        in_x = idx >= pad
        v = x_load(x_row, idx - pad, mask & in_x, stride_xt, in_alpha, in_shift, IN_SNAKE, IN_SHIFT, FAST_SIN)
        if HAS_STATE:
            old = tl.load(s_row + idx * stride_st, mask=mask & (idx < pad), other=0.0).to(tl.float32)
            v = tl.where(in_x, v, old)
        elif IN_SNAKE:  # the zero padding stays zero (Snake(0 + shift) is not)
            v = tl.where(in_x, v, 0.0)
        return v

    @triton.jit
    def store_context(x_row, s_row, new_row, row_mask, length, pad, stride_xt, stride_st, in_alpha, in_shift,
                       HAS_STATE: tl.constexpr, HAS_SLOTS: tl.constexpr, IN_SNAKE: tl.constexpr,
                       IN_SHIFT: tl.constexpr, FAST_SIN: tl.constexpr, BLOCK_P: tl.constexpr):
        """The new carried contexts of a program's rows ((R, 1) pointers, row_mask), the last `pad` frames of
        cat(state, x') (see `cat_load`): with HAS_SLOTS in place of the old ones at s_row, once every thread of the
        program has read them (the caller is the rows' only program that reads them; rows sharing a slot, the
        runner's padding rows on its scratch slot, race there harmlessly: their outputs are discarded), else to
        new_row (contiguous)."""
        i = tl.arange(0, BLOCK_P)[None, :]
        pmask = row_mask & (i < pad)
        tail = cat_load(x_row, s_row, length + i, pmask, pad, stride_xt, stride_st, in_alpha, in_shift, HAS_STATE,
                         IN_SNAKE, IN_SHIFT, FAST_SIN)
        if HAS_SLOTS:
            tl.debug_barrier()
            tl.store(s_row + i * stride_st, tail.to(s_row.dtype.element_ty), mask=pmask)
        else:
            tl.store(new_row + i, tail.to(new_row.dtype.element_ty), mask=pmask)

    @triton.jit
    def conv_finish(acc, c, row_mask, bias_ptr, alpha_ptr, out_dtype, HAS_BIAS: tl.constexpr,
                    OUT_SNAKE: tl.constexpr, FAST_SIN: tl.constexpr):
        """The conv's accumulator + bias, then Snake of it rounded to the output dtype (the eager order)."""
        if HAS_BIAS:
            acc += tl.load(bias_ptr + c, mask=row_mask, other=0.0).to(tl.float32)
        if OUT_SNAKE:
            acc = snake_math(acc.to(out_dtype).to(tl.float32),
                             tl.load(alpha_ptr + c, mask=row_mask, other=1.0).to(tl.float32), FAST_SIN)
        return acc.to(out_dtype)

    @triton.jit
    def narrow(v, dtype, SATURATE: tl.constexpr):
        """v as a GEMM operand of `dtype`; SATURATE (fp32 activations to fp16 operands): clamped to fp16's range
        first, so that an activation beyond it costs its precision, not an infinity (a NaN stays one)."""
        if SATURATE:
            v = tl.clamp(v.to(tl.float32), -65504.0, 65504.0, propagate_nan=tl.PropagateNan.ALL)
        return v.to(dtype)

    @triton.jit
    def _dwconv_kernel(x_ptr, state_ptr, slot_ptr, w_ptr, bias_ptr, alpha_ptr, in_alpha_ptr, in_shift_ptr, y_ptr,
                       new_state_ptr, rows, channels, length, stride_xb, stride_xc, stride_xt, stride_sb, stride_sc,
                       stride_st, K: tl.constexpr, DILATION: tl.constexpr, HAS_STATE: tl.constexpr,
                       HAS_SLOTS: tl.constexpr, HAS_BIAS: tl.constexpr, IN_SNAKE: tl.constexpr,
                       IN_SHIFT: tl.constexpr, OUT_SNAKE: tl.constexpr, FAST_SIN: tl.constexpr,
                       SATURATE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK: tl.constexpr, BLOCK_P: tl.constexpr):
        # A program: BLOCK_R rows (stream, channel) by BLOCK samples. HAS_SLOTS: state holds every slot's context;
        # row b's is slot_ptr[b]'s, replaced in place at the end. IN_SNAKE: the residual unit's first Snake applied
        # to x on load (each sample once per tap: recomputing is cheaper than the separate kernel's pass over the
        # activations), the context holds its outputs. The dilation is a constant: each tap's offset is known to
        # the compiler (with a runtime dilation the same tiling ran ~1.2x slower at a B=128 step's shapes).
        PAD: tl.constexpr = (K - 1) * DILATION
        bc, b, c, row_mask, t = row_tile_program(rows, channels, BLOCK_R, BLOCK)
        x_row = x_ptr + b * stride_xb + c * stride_xc
        in_alpha = tl.load(in_alpha_ptr + c, mask=row_mask, other=1.0).to(tl.float32) if IN_SNAKE else 0.0
        in_shift = tl.load(in_shift_ptr + c, mask=row_mask, other=0.0).to(tl.float32) if IN_SHIFT else 0.0
        mask = row_mask & (t < length)
        first = tl.program_id(1) * BLOCK < PAD  # the row's first block: its first PAD outputs read the context
        acc = tl.zeros((BLOCK_R, BLOCK), dtype=tl.float32)
        for j in tl.static_range(K):  # the outputs whose every tap reads x (t + j * dilation - PAD >= 0)
            i = t + (j * DILATION - PAD)
            acc += tl.load(w_ptr + c * K + j, mask=row_mask, other=0.0).to(tl.float32) * x_load(
                x_row, i, mask & (i >= 0), stride_xt, in_alpha, in_shift, IN_SNAKE, IN_SHIFT, FAST_SIN)
        # rounded as x's dtype (the eager conv's output), then to y's (a GEMM operand's)
        out = conv_finish(acc, c, row_mask, bias_ptr, alpha_ptr, x_ptr.dtype.element_ty, HAS_BIAS, OUT_SNAKE,
                          FAST_SIN)
        tl.store(y_ptr + bc * length + t, narrow(out, y_ptr.dtype.element_ty, SATURATE), mask=mask & (t >= PAD))
        if first:  # only this program of the rows reads the old context, then replaces it
            s_b = tl.load(slot_ptr + b, mask=row_mask, other=0).to(tl.int64) if HAS_SLOTS else b
            s_row = state_ptr + s_b * stride_sb + c * stride_sc
            # the first PAD outputs: taps before x read the context (or the zero padding)
            th = tl.arange(0, BLOCK_P)[None, :]
            head_mask = row_mask & (th < PAD) & (th < length)
            head = tl.zeros((BLOCK_R, BLOCK_P), dtype=tl.float32)
            for j in tl.static_range(K):
                head += tl.load(w_ptr + c * K + j, mask=row_mask, other=0.0).to(tl.float32) * cat_load(
                    x_row, s_row, th + j * DILATION, head_mask, PAD, stride_xt, stride_st, in_alpha, in_shift,
                    HAS_STATE, IN_SNAKE, IN_SHIFT, FAST_SIN)
            head_out = conv_finish(head, c, row_mask, bias_ptr, alpha_ptr, x_ptr.dtype.element_ty, HAS_BIAS,
                                   OUT_SNAKE, FAST_SIN)
            tl.store(y_ptr + bc * length + th, narrow(head_out, y_ptr.dtype.element_ty, SATURATE), mask=head_mask)
            store_context(x_row, s_row, new_state_ptr + bc * PAD, row_mask, length, PAD, stride_xt, stride_st,
                           in_alpha, in_shift, HAS_STATE, HAS_SLOTS, IN_SNAKE, IN_SHIFT, FAST_SIN, BLOCK_P)


# The depthwise conv's most samples a row in a program: long rows, one a program, were the fastest tiling of a
# prototype at a B=128 step's shapes (H200: 104-114 us against 114-139 in 64-sample blocks of 16 rows).
DWCONV_TIME_BLOCK = platform.MAX_TIME_BLOCK
DWCONV_CONTEXT_TILE = 4096  # at most rows x BLOCK_P new-context elements a program: no spills for sm_90 at 4096


def context_args(x: torch.Tensor, state: torch.Tensor | None,
                  slots: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None, tuple[int, ...]]:
    """A VAE kernel's carried-context arguments: the tensor it reads (x, never read, without a state), the slots when
    the context is read and replaced in place (else None), and its (batch, channel, time) strides (zeros without)."""
    if state is None:
        return x, None, (0, 0, 0)
    return state, slots, tuple(state.stride())


def new_context(x: torch.Tensor, state: torch.Tensor | None, source: torch.Tensor, in_place: bool,
                width: int) -> torch.Tensor | None:
    """Where a kernel writes the new carried context of x's (B, C, T) streams (`context_args`' source and whether it
    replaces the old one in place): that buffer itself, a new (B, C, width) one, or None without a state."""
    if in_place:
        return source
    return None if state is None else torch.empty((*x.shape[:2], width), dtype=x.dtype, device=x.device)


def context_fits(state: torch.Tensor | None, slots: torch.Tensor | None, x: torch.Tensor, width: int) -> bool:
    """Whether a kernel can take `state` as the carried context (width frames) of x's (B, C, T) streams: (B, C,
    width) or None; with `slots` (B,), every slot's contexts (slots, C, width) read and replaced at rows slots[b]."""
    b, c = x.shape[:2]
    if slots is not None:
        return (state is not None and state.dim() == 3 and state.shape[1:] == (c, width) and state.dtype == x.dtype
                and slots.shape == (b,) and slots.dtype in (torch.int32, torch.int64) and slots.is_contiguous()
                and slots.device == x.device)
    return state is None or (state.shape == (b, c, width) and state.dtype == x.dtype)


def depthwise_conv_supported(x: torch.Tensor, state: torch.Tensor | None, weight: torch.Tensor,
                             bias: torch.Tensor | None, dilation: int, slots: torch.Tensor | None = None) -> bool:
    """Whether `causal_depthwise_conv` runs its kernel for these arguments."""
    if not (platform.kernels(x) and x.dim() == 3 and weight.dim() == 3):
        return False
    c = x.shape[1]
    pad = (weight.shape[-1] - 1) * dilation
    if weight.shape[:2] != (c, 1) or weight.dtype != x.dtype or (bias is not None and bias.dtype != x.dtype):
        return False
    return context_fits(state, slots, x, pad)


def causal_depthwise_conv_triton(x: torch.Tensor, state: torch.Tensor | None, weight: torch.Tensor,
                                 bias: torch.Tensor | None, dilation: int, out_alpha: torch.Tensor | None = None,
                                 slots: torch.Tensor | None = None, in_alpha: torch.Tensor | None = None,
                                 in_shift: torch.Tensor | None = None,
                                 out_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The carried context `state` (B, C, P) prepended to x' (None: zeros), then the depthwise conv with weight
    (C, 1, K), P = (K - 1) * dilation -> (y (B, C, T), the new context (B, C, P)), both contiguous, y in
    `out_dtype` (None: x's), the context in x's. x' is x, or with `in_alpha` (1, C, 1) `snake(x, in_alpha,
    shift=in_shift)` (in_shift (C,) or None), computed on load: the context holds x' as it would after a separate
    Snake. With `out_alpha` (1, C, 1), y is
    Snake of the conv's output. x and state may have any strides. No copy of the concatenation is made. With
    `slots` (B,): state is (slots, C, P), row b's context is state[slots[b]], and it is replaced there in place
    (returned: state). With `out_dtype` (`gemm_operand_dtype`), y is computed as x's dtype, then narrowed."""
    b, c, t = x.shape
    k = weight.shape[-1]
    pad = (k - 1) * dilation
    y = torch.empty((b, c, t), dtype=out_dtype or x.dtype, device=x.device)
    source, slots, state_strides = context_args(x, state, slots)
    in_place = slots is not None
    new_state = source if in_place else torch.empty((b, c, pad), dtype=x.dtype, device=x.device)
    if b and c:
        # Time blocks of at least the context (or the whole row): only a row's first block reads the context (for
        # its first PAD outputs, a tile of their own). The rows a program also bound that tile and the new context's
        # (rows x BLOCK_P).
        block_p = triton.next_power_of_2(max(pad, 1))
        block_rows, block = row_tile(b * c, t, max(DWCONV_TIME_BLOCK, block_p))
        block_rows = max(1, min(block_rows, DWCONV_CONTEXT_TILE // block_p))
        # in place, only the first time block may read the old context: it must cover it, or be the only block
        assert not in_place or block >= pad or triton.cdiv(t, block) == 1, (t, block, pad)
        w = weight.reshape(c, k).contiguous()
        _dwconv_kernel[(triton.cdiv(b * c, block_rows), max(1, triton.cdiv(t, block)))](
            x, source, slots if in_place else w, w, bias if bias is not None else w,
            out_alpha.reshape(-1) if out_alpha is not None else w, in_alpha.reshape(-1) if in_alpha is not None else w,
            in_shift if in_shift is not None else w, y, new_state, b * c, c, t, *x.stride(), *state_strides, K=k,
            DILATION=dilation, HAS_STATE=state is not None, HAS_SLOTS=in_place,
            HAS_BIAS=bias is not None, IN_SNAKE=in_alpha is not None, IN_SHIFT=in_shift is not None,
            OUT_SNAKE=out_alpha is not None, FAST_SIN=fast_sin(), SATURATE=saturates(x, y), BLOCK_R=block_rows,
            BLOCK=block, BLOCK_P=block_p, num_warps=4)
    return y, new_state


def causal_depthwise_conv(x: torch.Tensor, state: torch.Tensor | None, weight: torch.Tensor, bias: torch.Tensor | None,
                          dilation: int, out_alpha: torch.Tensor | None = None, slots: torch.Tensor | None = None,
                          in_alpha: torch.Tensor | None = None, in_shift: torch.Tensor | None = None,
                          out_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A residual unit's [Snake with `in_alpha` of x + `in_shift`] -> cat(carried context, that) -> dilated
    depthwise causal conv (stride 1) [-> Snake with `out_alpha`] as one kernel: (output, new context). state
    (B, C, (K - 1) * dilation) or None for a full-sequence pass; with `slots` (B,), state holds every slot's
    context, rows slots[b] are read and replaced in place (the new context returned is state itself). Only where
    `depthwise_conv_supported` (the caller checks). `out_dtype`: the output's, when not x's."""
    return causal_depthwise_conv_triton(x, state, weight, bias, dilation, out_alpha, slots, in_alpha, in_shift,
                                        out_dtype)


def match_cudnn_tf32() -> None:
    """The VAE's 1x1 convolutions run as GEMMs (`pointwise_conv_residual`; fp32, or on fp16 operands where
    `gemm_operand_dtype` says): give this process's matmuls cuDNN's TF32 policy, as the convolutions they replace
    had. A process on torch's newer fp32_precision API refuses the legacy flags: its own choice then stands."""
    with contextlib.suppress(RuntimeError):
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32


# The narrowest 1x1 conv whose GEMM takes fp16 operands (H200, B=128 / 256: 256-1024 channels 1.5-4.7x faster than
# TF32; 64-128 slower and 32 1.1x faster, bound by the fp32 residual's traffic).
FP16_GEMM_MIN_CHANNELS = 256


def gemm_operand_dtype(x: torch.Tensor, channels: int | None = None) -> torch.dtype:
    """The dtype of the GEMM operands made from the VAE decoder's activations x (a 1x1 conv of `channels` inputs;
    None: an upsampler): fp16 for fp32 x where the process's matmuls use TF32 (fp16's 10-bit mantissa is TF32's, at
    twice its tensor-core rate; accumulation and output stay fp32) and EngineOptions.vae_fp16_gemm, without autograd
    and not in CUDA's batch-invariant mode (its GEMMs are fixed-shape fp32 tiles); else x's."""
    if (x.dtype == torch.float32 and current().vae_fp16_gemm and torch.backends.cuda.matmul.fp32_precision == "tf32"
            and (channels is None or channels >= FP16_GEMM_MIN_CHANNELS) and not torch.is_grad_enabled()
            and not (x.is_cuda and batch_invariant("cuda"))):
        return torch.float16
    return x.dtype


def saturates(x: torch.Tensor, operand: torch.Tensor) -> bool:
    """Whether a kernel narrowing x to a GEMM operand clamps to fp16's range (fp32 activations, fp16 operands)."""
    return x.dtype == torch.float32 and operand.dtype == torch.float16


def pointwise_conv_residual(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                            residual: torch.Tensor) -> torch.Tensor:
    """residual + conv1d(h, weight (O, C, 1), bias) as one batched GEMM that adds the residual in its
    epilogue (no layout copies around a cuDNN conv, no separate add). Without autograd a contiguous `residual` is
    consumed: the GEMM accumulates into it in place (out of place, the GEMM would first copy it). fp32 GEMMs follow
    the process's matmul TF32 setting, which the CUDA model runner aligns with cuDNN's. h and weight may be fp16
    for an fp32 residual (`gemm_operand_dtype`): fp32 accumulation and output."""
    w = weight[:, :, 0].expand(h.shape[0], -1, -1)  # stride 0 over the batch: no copy
    out = residual if residual.is_contiguous() and not torch.is_grad_enabled() else residual.clone()
    if h.dtype == residual.dtype:
        out.baddbmm_(w, h)
    elif out.is_cuda:
        torch.baddbmm(out, w, h, out_dtype=out.dtype, out=out)
    else:  # the same products and fp32 sums (torch's mixed-dtype GEMM is CUDA's)
        out.baddbmm_(w.to(out.dtype), h.to(out.dtype))
    return out if bias is None else out.add_(bias[:, None])


def mm_out(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """a @ b in `out_dtype`: on CUDA fp16 operands' one GEMM with fp32 accumulation; elsewhere the operands widened."""
    if a.dtype == out_dtype:
        return torch.mm(a, b)
    return torch.mm(a, b, out_dtype=out_dtype) if a.is_cuda else torch.mm(a.to(out_dtype), b.to(out_dtype))
