"""The VAE's streaming upsampler (a causal transposed conv) as one GEMM of every tap plus a Triton overlap-add.

cuDNN searches an algorithm per batch size at start-up and a GEMM per stream is far too narrow for a few frames; one
GEMM over every stream's context and new frames, then an overlap-add writing only the kept outputs, avoids both.
The eager path is the module's own cuDNN conv (vae_layers).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.ops import platform
from engine.ops.platform import HAVE_TRITON, MAX_TIME_BLOCK, row_tile
from engine.ops.vae_conv import context_args, context_fits, mm_out, new_context, saturates

if TYPE_CHECKING:
    import torch
else:
    from engine.lazy_torch import torch  # the kernel-compiling children never load it

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from engine.ops.platform import row_tile_program
    from engine.ops.vae_conv import cat_load, narrow, store_context

    @triton.jit
    def _upsampler_input_kernel(x_ptr, state_ptr, slot_ptr, xin_ptr, new_state_ptr, rows, channels, batch, length,
                                ctx, frames, stride_xb, stride_xc, stride_xt, stride_sb, stride_sc, stride_st,
                                HAS_STATE: tl.constexpr, HAS_SLOTS: tl.constexpr, SATURATE: tl.constexpr,
                                BLOCK_R: tl.constexpr, BLOCK: tl.constexpr, BLOCK_P: tl.constexpr):
        # BLOCK_R (batch, channel) rows: xin[c, b, :] = cat(context, x row) zero-padded to `frames`. With HAS_STATE
        # the new context (the concat's last ctx frames) is written by the program that read the old one (the first
        # frame block, BLOCK >= ctx): with HAS_SLOTS in place of slot_ptr[b]'s row of the per-slot buffer, else to
        # new_state_ptr's row.
        bc, b, c, row_mask, f = row_tile_program(rows, channels, BLOCK_R, BLOCK)
        x_row = x_ptr + b * stride_xb + c * stride_xc
        s_b = tl.load(slot_ptr + b, mask=row_mask, other=0).to(tl.int64) if HAS_SLOTS else b
        s_row = state_ptr + s_b * stride_sb + c * stride_sc
        v = cat_load(x_row, s_row, f, row_mask & (f < ctx + length), ctx, stride_xt, stride_st, 0.0, 0.0, HAS_STATE,
                      False, False, False)
        tl.store(xin_ptr + (c * batch + b) * frames + f, narrow(v, xin_ptr.dtype.element_ty, SATURATE),
                 mask=row_mask & (f < frames))
        if HAS_STATE and tl.program_id(1) == 0:
            store_context(x_row, s_row, new_state_ptr + bc * ctx, row_mask, length, ctx, stride_xt, stride_st, 0.0,
                           0.0, HAS_STATE, HAS_SLOTS, False, False, False, BLOCK_P)

    @triton.jit
    def _overlap_add_kernel(g_ptr, bias_ptr, y_ptr, rows, c_out, out_len, ctx, stride_gb, stride_gr,
                            STRIDE: tl.constexpr, KERNEL: tl.constexpr, HAS_BIAS: tl.constexpr,
                            BLOCK_R: tl.constexpr, BLOCK: tl.constexpr):
        """BLOCK_R (batch, channel) rows of a transposed conv from its per-tap products g: element (b, row, frame)
        at b * stride_gb + row * stride_gr + frame, rows ordered (tap, channel): y[t] = bias + sum over taps
        k = t % STRIDE + r * STRIDE of g[b, k * c_out + c, t // STRIDE + ctx - r]."""
        bc, b, c, row_mask, t = row_tile_program(rows, c_out, BLOCK_R, BLOCK)
        mask = row_mask & (t < out_len)
        j, m = t % STRIDE, t // STRIDE
        acc = tl.zeros((BLOCK_R, BLOCK), dtype=tl.float32)
        g_b = g_ptr + b * stride_gb
        for r in tl.static_range((KERNEL + STRIDE - 1) // STRIDE):
            k = j + r * STRIDE
            acc += tl.load(g_b + (k * c_out + c) * stride_gr + m + ctx - r, mask=mask & (k < KERNEL),
                           other=0.0).to(tl.float32)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + c, mask=row_mask, other=0.0).to(tl.float32)
        tl.store(y_ptr + bc * out_len + t, acc.to(y_ptr.dtype.element_ty), mask=mask)


def upsampler_input(x: torch.Tensor, state: torch.Tensor | None, ctx: int, frames: int,
                    slots: torch.Tensor | None = None,
                    dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The upsampler GEMM's input and the new carried context: x (B, C, n) any strides after its context `state`
    (B, C, ctx) (None: zeros), zero-padded to `frames` >= ctx + n -> ((C, B, frames) contiguous, every stream's frames
    side by side; the last ctx frames of cat(context, x) as (B, C, ctx), None without a state). With `slots` (B,):
    state is (slots, C, ctx), row b's context is state[slots[b]], and it is replaced there in place (returned:
    state), as `causal_depthwise_conv` does. `dtype`: the GEMM input's, when not x's (the context keeps x's)."""
    b, c, n = x.shape
    xin = torch.empty((c, b, frames), dtype=dtype or x.dtype, device=x.device)
    source, slots, state_strides = context_args(x, state, slots)
    in_place = slots is not None
    new_state = new_context(x, state, source, in_place, ctx)
    if b and c:
        block_p = triton.next_power_of_2(max(ctx, 1))
        # frames >= ctx, so the first frame block covers the context (its program alone reads and replaces it)
        block_rows, block = row_tile(b * c, frames, max(MAX_TIME_BLOCK, block_p))
        _upsampler_input_kernel[(triton.cdiv(b * c, block_rows), triton.cdiv(frames, block))](
            x, source, slots if in_place else x, xin, new_state if new_state is not None else xin, b * c, c, b, n,
            ctx, frames, *x.stride(), *state_strides, HAS_STATE=state is not None, HAS_SLOTS=in_place,
            SATURATE=saturates(x, xin), BLOCK_R=block_rows, BLOCK=block, BLOCK_P=block_p, num_warps=4)
    return xin, new_state


def overlap_add(g: torch.Tensor, bias: torch.Tensor | None, stride: int, kernel: int, ctx: int,
                length: int) -> torch.Tensor:
    """The transposed conv's outputs from its per-tap products: g (B, kernel * C_out, F) with unit stride along the
    frames (any batch and row strides), rows ordered (tap, channel), over ctx + `length` input frames (the first ctx
    the carried context; F may be larger, padding) -> (B, C_out, length * stride) contiguous."""
    b, rows, frames = g.shape
    c_out, out_len = rows // kernel, length * stride
    assert g.stride(2) == 1
    y = torch.empty((b, c_out, out_len), dtype=g.dtype, device=g.device)
    if b and c_out and out_len:
        block_rows, block = row_tile(b * c_out, out_len)
        _overlap_add_kernel[(triton.cdiv(b * c_out, block_rows), triton.cdiv(out_len, block))](
            g, bias if bias is not None else g, y, b * c_out, c_out, out_len, ctx, g.stride(0), g.stride(1),
            STRIDE=stride, KERNEL=kernel, HAS_BIAS=bias is not None, BLOCK_R=block_rows, BLOCK=block, num_warps=4)
    return y


def causal_conv_transpose(x: torch.Tensor, state: torch.Tensor | None, weight_taps: torch.Tensor,
                          bias: torch.Tensor | None, stride: int, kernel: int,
                          slots: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """The VAE's streaming upsampler (vae_layers.CausalConvTranspose1d) as one GEMM of every tap over the context
    and the new frames of all streams (cuBLAS, under the matmul TF32 policy that the runner aligns with cuDNN's)
    and one Triton overlap-add writing only the kept outputs, contiguous: no cuDNN algorithm search per batch size
    at start-up, no trimmed view. weight_taps: (kernel * C_out, C_in), rows ordered (tap, channel). state
    (B, C_in, ctx) or None (zeros, no context kept) -> (output, new context (B, C_in, ctx) or None); with `slots`
    (B,), state is every slot's context (slots, C_in, ctx), rows slots[b] are read and replaced in place by the new
    context (returned: state), as `causal_depthwise_conv` does. None where it does not apply (nothing changed; the
    caller then runs cuDNN). weight_taps may be fp16 for fp32 x (`vae_conv.gemm_operand_dtype`): the GEMM's input
    is then made in fp16, its accumulation and output stay fp32."""
    if not (platform.kernels(x) and x.dim() == 3
            and (weight_taps.dtype == x.dtype or (weight_taps.dtype, x.dtype) == (torch.float16, torch.float32))):
        return None
    b, c, n = x.shape
    ctx = (kernel - 1) // stride
    if not context_fits(state, slots, x, ctx):
        return None
    # One GEMM over every stream's frames: the input laid out (C_in, B, F), F = ctx + n padded to a multiple of 4
    # (cuBLAS's fast kernels need 16-byte aligned rows): a handful of frames per stream is far too narrow for a
    # GEMM of its own.
    frames = ctx + n + (-(ctx + n) % 4)
    xin, new_state = upsampler_input(x, state, ctx, frames, slots, weight_taps.dtype)
    g = mm_out(weight_taps, xin.view(c, b * frames), x.dtype).view(-1, b, frames).transpose(0, 1)
    return overlap_add(g, bias, stride, kernel, ctx, n), new_state

