"""The Triton kernels of engine/ops/ against the eager torch expressions they replace.

On CPU they run through Triton's interpreter in subprocesses (TRITON_INTERPRET=1 must be set before `triton.jit`
runs), which print one JSON line per case; on CUDA the same cases run compiled. The interpreter checks fp32 and fp16
only: its bf16 `tl.dot` returns garbage and its bf16 casts truncate (Triton 3.6), so bf16 is checked on CUDA. The
VAE convolutions' cases, minutes in the interpreter, run there each configuration in one of the two dtypes (`shared`).
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
import torch.nn.functional as F

from engine import options
from engine.ops.platform import HAVE_TRITON
from tests.conftest import interpreter_rows, patch_triton_interpreter, relative_error

REPO_ROOT = Path(__file__).resolve().parent.parent
BOUNDS = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 1.6e-2}  # max relative error (a few ulps)
CASE_BOUNDS = {("vae_fp16_gemm", torch.float32): 2e-3}  # fp32 activations through fp16 GEMM operands: fp16's ulps


def bound(case: str, dtype: torch.dtype) -> float:
    return CASE_BOUNDS.get((case, dtype), BOUNDS[dtype])
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
INTERPRETED = ("fp32", "fp16")


@contextlib.contextmanager
def exact_fp32_on_cuda() -> Iterator[None]:
    """No TF32 in cuDNN convolutions or matmuls (fp32 references compare like with like), restored afterwards."""
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


def _cases(device: str) -> dict[str, Callable[[torch.dtype], float]]:
    """Each case: dtype -> max relative error of the kernel against the eager expression (same inputs)."""
    from engine.models.minicpm import dense_attention as dense_attend
    from engine.ops import cfg_euler as cfg_euler_ops
    from engine.ops import dense_attention as dense_attention_ops
    from engine.ops import gemv as gemv_ops
    from engine.ops import (
        layer_stack,
        linear,
        norm,
        paged_attention,
        platform,
        rotary,
        skinny_gemm,
        upsampler,
        vae_conv,
    )
    from engine.ops import silu_mul as silu_mul_ops
    from engine.ops import snake as snake_ops

    def rand(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
        return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(device, dtype)

    def shared(configs: tuple, dtype: torch.dtype) -> list[tuple[int, Any]]:
        """(index, configuration) pairs a case runs: on CUDA all of them; in the interpreter (CPU CI, where the VAE
        cases' grids take minutes) each in one of the two dtypes, alternating, so every path runs and both dtypes'
        roundings are checked."""
        pairs = list(enumerate(configs))
        return pairs if device != "cpu" else pairs[INTERPRETED.index(DTYPE_NAMES[dtype])::2]

    def add_rms_norm(dtype: torch.dtype) -> float:
        x, h = rand(3, 7, 96, dtype=dtype, seed=1), rand(3, 7, 96, dtype=dtype, seed=2)
        w = rand(96, dtype=dtype, seed=3)
        errs = []
        for scale in (None, 0.37):
            xs_ref = x + h if scale is None else x + h * scale
            xs, y = norm.add_rms_norm_triton(x, h, scale, w, 1e-5)
            errs += [relative_error(xs, xs_ref), relative_error(y, norm.rms_norm_eager(xs_ref, w, 1e-5))]
        _, y = norm.add_rms_norm_triton(x, None, None, w, 1e-6)
        errs.append(relative_error(y, norm.rms_norm_eager(x, w, 1e-6)))
        from engine.ops import fp8 as fp8_ops  # quantize=True: the same two outputs, and the norm's rows quantised
        xs, y = norm.add_rms_norm_triton(x, h, 0.37, w, 1e-5)  # by the row quantiser's rule, attached to it
        xs_q, y_q = norm.add_rms_norm_triton(x, h, 0.37, w, 1e-5, quantize=True)
        assert torch.equal(xs_q, xs) and torch.equal(y_q, y)
        q, q_scale = getattr(y_q, fp8_ops.ROWS_ATTR)
        ref_q, ref_scale = fp8_ops.quantize_rows_triton(y.reshape(-1, 96))
        assert torch.equal(q_scale, ref_scale) and torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8))
        assert fp8_ops.quantized(y_q)[0] is q and not hasattr(y, fp8_ops.ROWS_ATTR)
        for splits in (1, 2, 4):  # h as a split-K GEMM's fp32 partials: summed, rounded to the dtype, then added
            parts = rand(splits, 3, 7, 96, dtype=torch.float32, seed=20 + splits)
            h_sum = parts.sum(0).to(dtype)
            for scale in (None, 0.37):
                xs_ref = x + h_sum if scale is None else x + h_sum * scale
                xs, y = norm.add_rms_norm_triton(x, parts, scale, w, 1e-5)
                errs += [relative_error(xs, xs_ref), relative_error(y, norm.rms_norm_eager(xs_ref, w, 1e-5))]
        return max(errs)

    def silu_mul(dtype: torch.dtype) -> float:
        gate, up = rand(2, 5, 160, dtype=dtype, seed=4).chunk(2, dim=-1)  # strided halves, as in the MLP
        return relative_error(silu_mul_ops.silu_mul_triton(gate, up), F.silu(gate) * up)

    def skinny_matmul(dtype: torch.dtype) -> float:
        errs = []
        for rows, k_dim, n in ((1, 64, 48), (5, 96, 32), (22, 32, 64), (40, 48, 16)):
            x = rand(rows, k_dim, dtype=dtype, seed=90 + rows)
            w = rand(n, k_dim, dtype=dtype, seed=91 + rows) * k_dim ** -0.5
            errs.append(relative_error(skinny_gemm.skinny_matmul(x, w), F.linear(x, w)))
            gate, up = F.linear(x, torch.cat([w, w.flip(0)])).chunk(2, dim=-1)
            errs.append(relative_error(skinny_gemm.skinny_matmul(x, torch.cat([w, w.flip(0)]), silu_gate=True),
                                       F.silu(gate) * up))
        x = rand(2, 3, 64, dtype=dtype, seed=99)  # leading dims kept; another tile configuration
        w = rand(32, 64, dtype=dtype, seed=98)
        errs.append(relative_error(skinny_gemm.skinny_matmul(x, w, config=(16, 32, 32, 2, 4)), F.linear(x, w)))
        return max(errs)

    def gemv(dtype: torch.dtype) -> float:
        """The one-row GEMV (engine/pdl.py) through the dispatch that serves it: `linear.linear` (a strided row, two
        rows), the SiLU-gated gate/up, and the o/down projections' `residual_linear`, whose K cut into slices comes
        back as fp32 partials that `add_rms_norm` sums. fp32 rows stay on F.linear (the GEMV holds 16-bit weights)."""

        errs = []
        with mock.patch.object(platform, "kernels", platform.usable), \
                options.override(gemv_max_rows=2), \
                mock.patch.object(gemv_ops, "gemv", wraps=gemv_ops.gemv) as spy:
            for rows, k_dim, n in ((1, 64, 48), (2, 128, 32)):
                x = rand(rows, k_dim + 32, dtype=dtype, seed=140 + rows)[:, 16:16 + k_dim]  # rows of a wider tensor
                w = rand(n, k_dim, dtype=dtype, seed=141 + rows) * k_dim ** -0.5
                errs.append(relative_error(linear.linear(x, w), F.linear(x, w)))
            x = rand(1, 64, dtype=dtype, seed=143)
            w = rand(48, 64, dtype=dtype, seed=144) * 0.125
            gate, up = F.linear(x, w).chunk(2, dim=-1)
            errs.append(relative_error(linear.silu_gate_linear(x, w), F.silu(gate) * up))
            with mock.patch.object(gemv_ops, "GEMV_SLICE", 32):
                x, res = rand(1, 96, dtype=dtype, seed=145), rand(1, 16, dtype=dtype, seed=146)
                w = rand(16, 96, dtype=dtype, seed=147) * 0.1
                parts = linear.residual_linear(x, w)
                if dtype != torch.float32:
                    assert parts.shape == (3, 1, 16) and parts.dtype == torch.float32, (parts.shape, parts.dtype)
                    errs.append(relative_error(parts.sum(0).to(dtype), F.linear(x, w)))
                norm_w = rand(16, dtype=dtype, seed=148)
                h_ref = parts.sum(0).to(dtype) if parts.dim() == 3 else F.linear(x, w)
                errs.append(relative_error(norm.add_rms_norm(res, parts, None, norm_w, 1e-5)[1],
                                           norm.rms_norm_eager(res + h_ref, norm_w, 1e-5)))
        expected = 0 if dtype == torch.float32 else 4
        assert spy.call_count == expected, f"the GEMV served {spy.call_count} of the {expected} projections"
        return max(errs)

    def lora(dtype: torch.dtype) -> float:
        """Both kernel paths of the LoRA term (engine/ops/lora.py: the one kernel of a few rows; for many, the shrink
        GEMM and the expand kernel) against the eager masked GEMMs over every
        slot: rows of two adapters and none, a slot of a lower rank (zero-padded), leading rows with inner rows (the
        DiT's tokens), q/k/v as one term (A stacked, B block-diagonal), an fp32 split-K partial as the output, and more
        rows than one program's."""
        from engine.ops import lora as lora_ops

        k_dim = 96
        errs = []
        # the slot count is a runtime value of the kernels: 2 or 3 slots, a rank of 8 (below one dot's 16) or 24 (no
        # power of two)
        for slots_n, rank in ((2, 8), (3, 24)):
            column_slots = torch.arange(slots_n, device=device).repeat_interleave(rank)
            for lead, inner, outs, partial in ((3, 1, (40,), False), (2, 5, (40,), False), (2, 5, (48, 16, 16), False),
                                               (1, 1, (48, 16, 16), False), (3, 1, (40,), True),
                                               (13, 7, (48, 16, 16), False), (9, 1, (72,), True),
                                               (40, 7, (48, 16, 16), False)):
                groups = len(outs)
                a = rand(groups * slots_n * rank, k_dim, dtype=dtype, seed=300 + lead) * k_dim ** -0.5
                b = torch.zeros(sum(outs), groups * slots_n * rank, dtype=dtype, device=device)
                starts = [0, *itertools.accumulate(outs)]  # each group's first output column (B is block-diagonal)
                for g, width in enumerate(outs):
                    cols = slice(g * slots_n * rank, (g + 1) * slots_n * rank)
                    b[starts[g]:starts[g] + width, cols] = rand(width, slots_n * rank, dtype=dtype, seed=310 + g) * 0.5
                a[rank + 5:2 * rank], b[:, rank + 5:2 * rank] = 0, 0  # slot 1 holds a rank-5 adapter
                slots = torch.tensor([1, -1, 0, slots_n - 1] * 10, device=device)[:lead]
                x = rand(lead, inner, k_dim, dtype=dtype, seed=320 + inner).squeeze(1)
                mask = lora_ops.slot_mask(slots, column_slots, dtype)
                delta = lora_ops.lora_delta(x, a, b, mask)
                ends = (starts[1], starts[2]) if groups > 1 else None
                paths = [lambda y, x=x, a=a, b=b, slots=slots, ends=ends, r=rank, columns=slots_n * rank:
                         lora_ops.add_lora_expand(x, y, a, b, slots, r, columns, ends)]
                if lead <= lora_ops.KERNEL_MAX_LEAD:
                    paths.append(lambda y, x=x, a=a, b=b, slots=slots, ends=ends, r=rank:
                                 lora_ops.add_lora_kernel(x, y, a, b, slots, r, ends))
                for add_term in paths:
                    if partial:
                        out = rand(2, *x.shape[:-1], sum(outs), dtype=torch.float32, seed=330)
                        ref = out.clone()
                        ref[0] += delta.float()
                        add_term(out[0])
                    else:
                        out = rand(*x.shape[:-1], sum(outs), dtype=dtype, seed=330)
                        ref = out + delta
                        add_term(out)
                    errs.append(relative_error(out, ref))
        return max(errs)

    def rotary_qk(dtype: torch.dtype) -> float:
        q, k, _ = rand(6, 8 * 32, dtype=dtype, seed=5).split([4 * 32, 2 * 32, 2 * 32], dim=-1)
        q, k = q.view(6, 4, 32), k.view(6, 2, 32)
        rope = rand(6, 2, 32, dtype=torch.float32, seed=6)
        cos, sin = rope[:, 0], rope[:, 1]
        qo, ko = rotary.rotary_qk_triton(q, k, cos, sin)
        return max(relative_error(qo, rotary.rotary_eager(q, cos, sin)),
                   relative_error(ko, rotary.rotary_eager(k, cos, sin)))

    def rotary_store_kv(dtype: torch.dtype) -> float:
        """Rotary + paged-cache write: q rotated out, k rotated and v copied into their slots, other slots kept."""
        t, hq, hk, dim = 5, 4, 2, 32
        q, k, v = rand(t, (hq + 2 * hk) * dim, dtype=dtype, seed=13).split([hq * dim, hk * dim, hk * dim], dim=-1)
        q, k, v = q.view(t, hq, dim), k.view(t, hk, dim), v.view(t, hk, dim)  # strided views, as in the model
        rope = rand(t, 2, dim, dtype=torch.float32, seed=14)
        slots = torch.tensor([7, 2, 11, 0, 5], device=device)
        errs = []
        for r in (rope, None):
            k_cache = rand(3, 4, hk, dim, dtype=dtype, seed=15)  # (blocks, block_size, heads, dim)
            v_cache = rand(3, 4, hk, dim, dtype=dtype, seed=16)
            k_ref, v_ref = k_cache.clone().view(-1, hk, dim), v_cache.clone().view(-1, hk, dim)
            cos, sin = (r[:, 0], r[:, 1]) if r is not None else (None, None)
            q_ref = rotary.rotary_eager(q, cos, sin) if r is not None else q
            k_ref[slots] = rotary.rotary_eager(k, cos, sin) if r is not None else k
            v_ref[slots] = v
            q_out = rotary.rotary_store_kv_triton(q, k, v, cos, sin, k_cache, v_cache, slots)
            errs += [relative_error(q_out, q_ref), relative_error(k_cache.view(-1, hk, dim), k_ref),
                     relative_error(v_cache.view(-1, hk, dim), v_ref)]
        return max(errs)

    def dense(dtype: torch.dtype) -> float:
        errs = []
        # (sequences, length, query heads, kv heads): GQA groups of 4, and of 3 (its heads are not stacked); 8
        # sequences: the fewest where the default stacks a whole group (`dense_attention_heads`)
        assert dense_attention_ops.dense_attention_heads(8, 4, 4, 11) == 4 > dense_attention_ops.dense_attention_heads(
            5, 4, 4, 11)
        for n, length, hq, hk in ((3, 11, 4, 1), (2, 5, 4, 1), (1, 33, 4, 1), (8, 11, 4, 1), (5, 11, 6, 2)):
            q, k, v = rand(n, length, (hq + 2 * hk) * 32, dtype=dtype, seed=7 + length).split(
                [hq * 32, hk * 32, hk * 32], dim=-1)
            q, k, v = q.view(n, length, hq, 32), k.view(n, length, hk, 32), v.view(n, length, hk, 32)
            rope = rand(length, 2, 32, dtype=torch.float32, seed=8)
            for r in (rope, None):
                cos, sin = (r[:, 0], r[:, 1]) if r is not None else (None, None)
                ref = dense_attend(0, q, k, v, r)  # off CUDA: rotary + SDPA
                # the default, or 1 / 2 / a whole group per program; the heads one after another, or their rows in
                # one tile (in the interpreter each pair in one dtype: every head count both ways in each)
                for _, (heads, stacked) in shared(((None, False), (None, True), (1, True), (1, False), (2, False),
                                                   (2, True), (hq // hk, True), (hq // hk, False)), dtype):
                    out = dense_attention_ops.dense_attention_triton(q, k, v, cos, sin, heads, stacked=stacked)
                    errs.append(relative_error(out, ref))
        return max(errs)

    def snake(dtype: torch.dtype) -> float:
        x = rand(2, 6, 50, dtype=dtype, seed=9)[..., 5:42]  # a strided view, like a trimmed conv output
        alpha = rand(1, 6, 1, dtype=dtype, seed=10).abs() + 0.2
        ref = x + (alpha + 1e-9).reciprocal() * torch.sin(alpha * x).pow(2)
        scale, shift = rand(6, dtype=dtype, seed=11), rand(6, dtype=dtype, seed=12)
        xa = x * scale[:, None] + shift[:, None]
        ref_affine = xa + (alpha + 1e-9).reciprocal() * torch.sin(alpha * xa).pow(2)
        xs = x + shift[:, None]
        ref_shift = xs + (alpha + 1e-9).reciprocal() * torch.sin(alpha * xs).pow(2)
        return max(relative_error(snake_ops.snake_triton(x, alpha), ref),
                   relative_error(snake_ops.snake_triton(x, alpha, scale, shift), ref_affine),
                   relative_error(snake_ops.snake_triton(x, alpha, None, shift), ref_shift))

    def dwconv_snake(dtype: torch.dtype) -> float:
        errs = []
        # 11 channels at 140 samples: rows packed into two programs (packed tiling); 1100 samples: two time blocks
        # (only the first reads the context)
        for seed, (length, dilation, streaming, channels) in shared((
                (5, 3, True, 6), (80, 3, True, 6), (20, 1, True, 6), (30, 9, True, 6), (40, 9, False, 6),
                (4, 1, False, 6), (140, 9, True, 11), (140, 9, False, 11), (1100, 9, True, 3)), dtype):
            pad = 6 * dilation
            x = rand(2, channels, length + 9, dtype=dtype, seed=20 + seed)[..., 4:length + 4]  # strided view
            alpha = rand(1, channels, 1, dtype=dtype, seed=30 + seed).abs() + 0.2
            weight = rand(channels, 1, 7, dtype=dtype, seed=40 + seed) * 0.3
            bias = rand(channels, dtype=dtype, seed=50 + seed) if seed % 2 else None
            state = rand(2, channels, pad + 3, dtype=dtype, seed=60 + seed)[..., 3:] if streaming else None
            xcat = torch.cat([state if streaming else x.new_zeros(2, channels, pad), x], dim=-1)
            y_ref = F.conv1d(xcat.float(), weight.float(), None if bias is None else bias.float(),
                             dilation=dilation, groups=channels).to(dtype)  # fp32 accumulation, as cuDNN
            y, new_state = vae_conv.causal_depthwise_conv_triton(x, state, weight, bias, dilation)
            errs += [relative_error(y, y_ref), relative_error(new_state, xcat[..., length:])]
            s_ref = y_ref + (alpha + 1e-9).reciprocal() * torch.sin(alpha * y_ref).pow(2)  # Snake after the conv
            y, new_state = vae_conv.causal_depthwise_conv_triton(x, state, weight, bias, dilation, alpha)
            errs += [relative_error(y, s_ref), relative_error(new_state, xcat[..., length:])]
            if streaming:  # the contexts in per-slot buffers (rows 3 and 0 of 4), read and replaced in place
                slots = torch.tensor([3, 0], device=device)
                buffers = rand(4, channels, pad, dtype=dtype, seed=70 + seed)
                buffers[slots] = state
                untouched = buffers[1:3].clone()
                y, returned = vae_conv.causal_depthwise_conv_triton(x, buffers, weight, bias, dilation, alpha, slots)
                assert returned is buffers and torch.equal(buffers[1:3], untouched), "rows of other slots changed"
                errs += [relative_error(y, s_ref), relative_error(buffers[slots], xcat[..., length:])]
            # the Snake before the conv on load (with a per-channel shift, and without): against the Snake kernel's
            # output fed to the conv; the context holds Snake outputs
            in_alpha = rand(1, channels, 1, dtype=dtype, seed=80 + seed).abs() + 0.2
            for shift in (rand(channels, dtype=dtype, seed=90 + seed), None):
                xs = snake_ops.snake_triton(x, in_alpha, None, shift)
                xs_cat = torch.cat([state if streaming else x.new_zeros(2, channels, pad), xs], dim=-1)
                ys_ref = F.conv1d(xs_cat.float(), weight.float(), None if bias is None else bias.float(),
                                  dilation=dilation, groups=channels).to(dtype)
                ys_ref = ys_ref + (alpha + 1e-9).reciprocal() * torch.sin(alpha * ys_ref).pow(2)
                y, new_state = vae_conv.causal_depthwise_conv_triton(x, state, weight, bias, dilation, alpha,
                                                                    in_alpha=in_alpha, in_shift=shift)
                errs += [relative_error(y, ys_ref), relative_error(new_state, xs_cat[..., length:])]
                if streaming:
                    buffers = rand(4, channels, pad, dtype=dtype, seed=75 + seed)
                    buffers[slots] = state
                    y, _ = vae_conv.causal_depthwise_conv_triton(x, buffers, weight, bias, dilation, alpha, slots,
                                                                in_alpha, shift)
                    errs += [relative_error(y, ys_ref), relative_error(buffers[slots], xs_cat[..., length:])]
        return max(errs)

    def residual_unit(dtype: torch.dtype) -> float:
        """The VAE residual unit's kernel path (Snake, conv + Snake, GEMM + residual) against its layers, over
        three streamed chunks and a full-sequence pass (exact fp32 GEMMs/convs on both sides)."""
        from engine.models.vae_layers import ResidualUnit

        torch.manual_seed(70)
        unit = ResidualUnit(8, dilation=3, groups=8).to(device, dtype)
        for snake_layer in (unit.block[0], unit.block[2]):
            snake_layer.alpha.data.uniform_(0.3, 1.5)
        unit.block[1].state_slot = 0
        chunks = [rand(2, 8, n, dtype=dtype, seed=71 + n) for n in (4, 9, 30)]
        errs = []
        with exact_fp32_on_cuda(), torch.no_grad(), mock.patch.object(platform, "kernels", platform.usable), \
                mock.patch.object(vae_conv, "pointwise_conv_residual", wraps=vae_conv.pointwise_conv_residual) as spy:
            states_ref, states = [torch.zeros(2, 8, 18, dtype=dtype, device=device)], [None]
            states[0] = states_ref[0].clone()
            for x in chunks:
                ref = x + unit.block(x, states_ref)  # the layers one by one
                errs += [relative_error(unit(x.clone(), states), ref),  # (the kernel path consumes its input)
                         relative_error(states[0], states_ref[0])]
            full = torch.cat(chunks, dim=-1)
            errs.append(relative_error(unit(full.clone()), full + unit.block(full)))
            # a strided input (a block's first unit gets a trimmed transposed-conv output): out of place
            wide = rand(2, 8, 40, dtype=dtype, seed=79)
            strided = wide[..., 3:33]
            errs.append(relative_error(unit(strided), strided + unit.block(strided)))
            assert torch.equal(wide, rand(2, 8, 40, dtype=dtype, seed=79))  # its storage left alone
            assert spy.call_count == len(chunks) + 2, "the residual unit did not take its kernel path"
        return max(errs)

    def conv_transpose(dtype: torch.dtype) -> float:
        """The VAE upsampler's kernel path (one GEMM of every tap + the overlap-add kernel) against the module's
        cuDNN path, over streamed chunks of 1, 3 and 7 frames (strided views) and a full-sequence pass, with the new
        context. The shipped geometry (kernel 2 x stride) carries one frame of context; a kernel of 3 x stride
        carries two, so a chunk of one frame is shorter than its context (the new context then spans both)."""
        from engine.models.vae_layers import CausalConvTranspose1d, SlotStates

        errs = []
        with exact_fp32_on_cuda():
            # (96, 24, 4, 2): packed, 192 input rows and 48 output rows each fill two programs
            geometries = ((32, 16, 2, 2), (16, 40, 5, 2), (64, 16, 8, 2), (16, 24, 3, 3), (96, 24, 4, 2))
            for seed, (c_in, c_out, stride, taps) in shared(geometries, dtype):
                torch.manual_seed(100 + seed)
                conv = CausalConvTranspose1d(c_in, c_out, taps * stride, stride, (taps - 1) * stride).to(device, dtype)
                conv.state_slot = 0
                states_ref = [rand(2, c_in, conv.context, dtype=dtype, seed=110 + seed)]
                states = [states_ref[0].clone()]
                # the contexts also in per-slot buffers (rows 3 and 0 of 4), read and replaced in place by the kernel
                slots = torch.tensor([3, 0], device=device)
                buffers = rand(4, c_in, conv.context, dtype=dtype, seed=115 + seed)
                buffers[slots] = states_ref[0]
                untouched = buffers[1:3].clone()
                with torch.no_grad(), \
                        mock.patch.object(upsampler, "overlap_add", wraps=upsampler.overlap_add) as spy:
                    for n in (1, 3, 7):
                        x = rand(2, c_in, n + 2, dtype=dtype, seed=120 + n)[..., 1:n + 1]  # a strided view
                        with mock.patch.object(platform, "kernels", lambda x: False):
                            ref = conv(x, states_ref)
                        with mock.patch.object(platform, "kernels", platform.usable):
                            errs += [relative_error(conv(x, states), ref), relative_error(states[0], states_ref[0]),
                                     relative_error(conv(x, SlotStates([buffers], slots)), ref),
                                     relative_error(buffers[slots], states_ref[0])]
                    assert torch.equal(buffers[1:3], untouched), "rows of other slots changed"
                    x = rand(2, c_in, 9, dtype=dtype, seed=130)
                    with mock.patch.object(platform, "kernels", lambda x: False):
                        ref = conv(x)
                    with mock.patch.object(platform, "kernels", platform.usable):
                        errs.append(relative_error(conv(x), ref))
                    assert spy.call_count == 7, "the upsampler did not take its kernel path"
        return max(errs)

    def vae_fp16_gemm(dtype: torch.dtype) -> float:
        """An fp32 VAE decoder's GEMMs on fp16 operands (`vae_conv.gemm_operand_dtype`, where matmuls use TF32): a
        residual unit's 1x1 conv (its minimum channels lowered to this unit's 16) and an upsampler, streamed over
        three chunks, against the exact fp32 layers; an activation beyond fp16's range saturates (finite output).
        Other dtypes keep their own operands."""
        from engine.models.vae_layers import CausalConvTranspose1d, ResidualUnit

        torch.manual_seed(140)
        unit = ResidualUnit(16, dilation=3, groups=16, fp16_gemm=True).to(device, dtype)
        for snake_layer in (unit.block[0], unit.block[2]):
            snake_layer.alpha.data.uniform_(0.3, 1.5)
        unit.block[1].state_slot = 0
        up = CausalConvTranspose1d(32, 16, 4, 2, 2).to(device, dtype)
        up.state_slot = 0
        errs, operands = [], set()
        unit_states = [[rand(2, 16, 18, dtype=dtype, seed=141)] for _ in range(2)]
        up_states = [[rand(2, 32, 1, dtype=dtype, seed=142)] for _ in range(2)]
        saved = torch.backends.cuda.matmul.allow_tf32
        with torch.no_grad(), mock.patch.object(vae_conv, "FP16_GEMM_MIN_CHANNELS", 16), \
                mock.patch.object(vae_conv, "pointwise_conv_residual", wraps=vae_conv.pointwise_conv_residual) as pw, \
                mock.patch.object(upsampler, "mm_out", wraps=upsampler.mm_out) as mm:
            try:
                for seed, n in enumerate((4, 9, 30)):
                    x, z = rand(2, 16, n, dtype=dtype, seed=143 + seed), rand(2, 32, n, dtype=dtype, seed=146 + seed)
                    with exact_fp32_on_cuda(), mock.patch.object(platform, "kernels", lambda x: False):  # exact layers
                        refs = (x + unit.block(x, unit_states[0]), up(z, up_states[0]))
                    torch.backends.cuda.matmul.allow_tf32 = True  # (as the CUDA runner has it)
                    with mock.patch.object(platform, "kernels", platform.usable):
                        ours = (unit(x.clone(), unit_states[1]), up(z, up_states[1]))
                    errs += [relative_error(a, b) for a, b in zip(ours, refs, strict=True)]
                    errs += [relative_error(unit_states[1][0], unit_states[0][0]),
                             relative_error(up_states[1][0], up_states[0][0])]
                if dtype == torch.float32:  # far beyond fp16's range: clamped operands, no infinity; a NaN stays one
                    with mock.patch.object(platform, "kernels", platform.usable):
                        huge = unit(rand(2, 16, 9, dtype=dtype, seed=149) * 1e6), up(z * 1e6)
                        z[0, 0, 0] = float("nan")
                        poisoned = up(z)
                    assert all(torch.isfinite(h).all() for h in huge), "an fp16 operand overflowed"
                    assert poisoned[0].isnan().any(), "a NaN activation was clamped to a number"
            finally:
                torch.backends.cuda.matmul.allow_tf32 = saved
        assert pw.call_count and mm.call_count, "a GEMM did not take the kernel path"
        operands = {c.args[0].dtype for c in pw.call_args_list} | {c.args[0].dtype for c in mm.call_args_list}
        expected = torch.float16 if dtype == torch.float32 else dtype
        assert operands == {expected}, f"GEMM operands {operands}, not {expected}"
        return max(errs)

    def vae_decoder(dtype: torch.dtype) -> float:
        """The streaming VAE decoder's kernel path (biases and the sample-rate condition carried into the next
        Snake kernel) against its layers one by one, over three streamed chunks."""
        from engine.config import AudioVAEConfig
        from engine.models.audio_vae import AudioVAE
        from engine.models.vae_decoder import Decoder
        from engine.models.vae_layers import SlotStates

        torch.manual_seed(90)
        cfg = AudioVAEConfig.from_dict({"encoder_dim": 4, "encoder_rates": [2, 2], "latent_dim": 8, "decoder_dim": 32,
                                        "decoder_rates": [2, 3]}, version=2)
        vae = AudioVAE(cfg, 2).to(device, dtype)
        for name, param in vae.decoder.named_parameters():
            if name.endswith("alpha"):
                param.data.uniform_(0.3, 1.5)
            elif name.endswith("bias") or "embed" in name:
                param.data.uniform_(-0.5, 0.5)  # biases that matter: they are what the kernel path defers
        errs = []
        with exact_fp32_on_cuda(), torch.no_grad():
            ref, ours = vae.streaming_decoder(2), vae.streaming_decoder(2)
            # and as the runner keeps them: every slot's state in buffers, the two streams at slots 2 and 0
            slots = torch.tensor([2, 0], device=device)
            buffers = [torch.zeros(3, *state.shape[1:], device=device, dtype=dtype) for state in ours.states]
            with mock.patch.object(Decoder, "_forward_deferred", wraps=vae.decoder._forward_deferred) as spy:
                for seed, n in enumerate((1, 3, 2)):
                    z = rand(2, 8, n, dtype=dtype, seed=91 + seed)
                    with mock.patch.object(platform, "kernels", lambda x: False):  # the layers one by one
                        expected = ref.decode_chunk(z)
                    with mock.patch.object(platform, "kernels", platform.usable):
                        errs.append(relative_error(ours.decode_chunk(z), expected))
                        in_slots = vae.decoder(z, ours.sr_idx, SlotStates(buffers, slots))
                    errs.append(relative_error(in_slots, expected))
                    errs += [relative_error(a, b) for a, b in zip(ours.states, ref.states, strict=True)]
                    errs += [relative_error(buf[slots], b) for buf, b in zip(buffers, ref.states, strict=True)]
                    assert all(not buf[1].any() for buf in buffers), "a third slot's state changed"
            assert spy.call_count == 6, "the decoder did not take its kernel path"
        return max(errs)

    def cfg_euler(dtype: torch.dtype) -> float:
        x = rand(3, 64, 4, dtype=dtype, seed=80)
        cfg = (rand(3, 1, 1, dtype=torch.float32, seed=82).abs() + 1.0).to(dtype)
        errs = []
        # v contiguous, and transposed as the DiT returns it ((2B, P, D) memory viewed as (2B, D, P))
        for v in (rand(6, 64, 4, dtype=dtype, seed=81), rand(6, 4, 64, dtype=dtype, seed=81).transpose(1, 2)):
            ref = cfg_euler_ops.cfg_euler_step(x.cpu(), v.cpu(), cfg.cpu(), 0.0917).to(device)  # eager (CPU tensors)
            errs.append(relative_error(cfg_euler_ops.cfg_euler_step_triton(x, v, cfg.reshape(3), 0.0917), ref))
            # and the sampler's call (cfg (B, 1, 1), v as the DiT returns it) takes the kernel, not the eager ops
            with mock.patch.object(platform, "kernels", platform.usable), \
                    mock.patch.object(cfg_euler_ops, "cfg_euler_step_triton",
                                      wraps=cfg_euler_ops.cfg_euler_step_triton) as spy:
                errs.append(relative_error(cfg_euler_ops.cfg_euler_step(x, v, cfg, 0.0917), ref))
            assert spy.call_count == 1, "cfg_euler_ops.cfg_euler_step fell back to the eager ops"
        return max(errs)

    def dit_step(dtype: torch.dtype) -> float:
        """A DiT evaluation's input (the leading tokens, then in_proj of the noisy patch for both CFG halves) and its
        output projection with the guided Euler step, one kernel each, against the eager ops; the sampler's calls
        take them."""
        b, d, p, t, h = 3, 64, 4, 7, 96
        x, leading = rand(b, d, p, dtype=dtype, seed=83), rand(2 * b, t, h, dtype=dtype, seed=84)
        hidden = rand(2 * b, t + p, h, dtype=dtype, seed=85)
        cfg = (rand(b, 1, 1, dtype=torch.float32, seed=86).abs() + 1.0).to(dtype)
        in_proj, out_proj = torch.nn.Linear(d, h).to(device, dtype), torch.nn.Linear(h, d).to(device, dtype)
        with torch.no_grad():
            for i, lin in enumerate((in_proj, out_proj)):
                lin.weight.copy_(rand(*lin.weight.shape, dtype=dtype, seed=87 + i) * lin.weight.shape[1] ** -0.5)
                lin.bias.copy_(rand(*lin.bias.shape, dtype=dtype, seed=89 + i) * 0.1)
            cpu_in, cpu_out = copy.deepcopy(in_proj).cpu(), copy.deepcopy(out_proj).cpu()
            seq_ref = torch.cat((leading.cpu(), cpu_in(torch.cat((x, x)).cpu().transpose(1, 2))), dim=1).to(device)
            step_ref = cfg_euler_ops.cfg_euler_step(x.cpu(), cpu_out(hidden.cpu()[:, t:]).transpose(1, 2), cfg.cpu(),
                                            0.0917).to(device)
            seq = cfg_euler_ops.dit_input_triton(x, leading, in_proj.weight, in_proj.bias)
            step = cfg_euler_ops.dit_output_euler_triton(hidden[:, t:], out_proj.weight, out_proj.bias, x,
                                                         cfg.reshape(b), 0.0917)
            errs = [relative_error(seq, seq_ref), relative_error(step, step_ref)]
            with mock.patch.object(platform, "kernels", platform.usable), \
                    mock.patch.object(cfg_euler_ops, "dit_input_triton",
                                      wraps=cfg_euler_ops.dit_input_triton) as spy_in, \
                    mock.patch.object(cfg_euler_ops, "dit_output_euler_triton",
                                      wraps=cfg_euler_ops.dit_output_euler_triton) as spy_out:
                errs += [relative_error(cfg_euler_ops.dit_input(x, leading, in_proj), seq_ref),
                         relative_error(cfg_euler_ops.dit_output_euler(hidden[:, t:], out_proj, x, cfg, 0.0917),
                                        step_ref)]
            assert spy_in.call_count == spy_out.call_count == 1, "the sampler's calls fell back to the eager ops"
        return max(errs)

    def dispatch(dtype: torch.dtype) -> float:
        """The model's calls take the new kernels where they apply: the Triton backend's attention against the torch
        backend's, as rotary + cache write in one kernel then the paged kernel, and (16-key splits: the third
        sequence's context is split) as the split decode kernel doing the rotary and the cache write itself; and the
        MLP's gated projection."""
        from engine.ops import linear, platform, rotary, skinny_gemm
        from engine.runner.attention import AttentionMetadata, PagedKVCache

        hq, hk, dim, bs = 4, 2, 32, 4
        lens = [5, 1, 19]  # context per sequence, the new token included
        tables = torch.tensor([[2, 0, 0, 0, 0, 0], [1, 0, 0, 0, 0, 0], [3, 4, 5, 6, 7, 0]], dtype=torch.int32,
                              device=device)
        slots = torch.tensor([int(tables[i, (n - 1) // bs]) * bs + (n - 1) % bs for i, n in enumerate(lens)],
                             device=device)
        meta = AttentionMetadata(False, slots, tables, torch.arange(3, dtype=torch.int32, device=device),
                                 torch.tensor(lens, dtype=torch.int32, device=device))
        q = rand(3, hq, dim, dtype=dtype, seed=17)
        k, v = rand(3, hk, dim, dtype=dtype, seed=18), rand(3, hk, dim, dtype=dtype, seed=19)
        errs = []
        for rope in (rand(3, 2, dim, dtype=torch.float32, seed=20), None):
            out = {}
            for backend, split_keys in (("torch", 0), ("triton", 0), ("triton", 16)):
                cache = PagedKVCache(1, 8, bs, hk, dim, dtype, device, backend=backend)
                cache.k.copy_(rand(*cache.k.shape, dtype=dtype, seed=21))
                cache.v.copy_(rand(*cache.v.shape, dtype=dtype, seed=22))
                kernels = platform.usable if backend == "triton" else platform.kernels  # the torch one: eager ops
                fused_write = rotary.rotary_store_kv_triton
                with mock.patch.object(platform, "kernels", kernels), \
                        options.override(attn_split_keys=split_keys), \
                        mock.patch.object(rotary, "rotary_store_kv_triton", wraps=fused_write) as spy:
                    out[backend, split_keys] = (cache.attend_fn(meta)(0, q, k, v, rope), cache.k.clone(),
                                                cache.v.clone())
                assert spy.call_count == (backend == "triton" and not split_keys), \
                    f"{backend} split {split_keys}: separate rotary + K/V write used {spy.call_count}x"
                assert all(bool((c == 0).all()) for c in paged_attention._counters.values())
            for ours in (out["triton", 0], out["triton", 16]):
                errs += [relative_error(a, b) for a, b in zip(ours, out["torch", 0], strict=True)]
        x = rand(5, 64, dtype=dtype, seed=23)
        w = rand(96, 64, dtype=dtype, seed=24) * 0.125
        gate, up = F.linear(x, w).chunk(2, dim=-1)
        with mock.patch.object(platform, "kernels", platform.usable), \
                mock.patch.object(skinny_gemm, "skinny_matmul", wraps=skinny_gemm.skinny_matmul) as spy:
            errs.append(relative_error(linear.silu_gate_linear(x, w), F.silu(gate) * up))
        assert spy.call_count == 1, "linear.silu_gate_linear did not take the skinny kernel"
        return max(errs)

    def gated_gemm(dtype: torch.dtype) -> float:
        """The gate/up GEMM with the SiLU gate in its epilogue (`engine.ops.gated_gemm`) against F.linear + SiLU * up:
        one partial row tile (the default tiles), 100 rows of a 3-d strided input in small tiles (row tiles grouped,
        several column tiles); and taken by `linear.silu_gate_linear` from EngineOptions.gated_gemm_min_rows rows where
        the weight has its interleaved companion (16-bit weights: `attach_gated_gemm` leaves fp32 ones without)."""
        from engine.config import TransformerConfig
        from engine.models.minicpm import MLP, attach_gated_gemm
        from engine.ops import gated_gemm as gated_ops
        from engine.ops import linear, platform

        def reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            gate, up = F.linear(x, w).chunk(2, dim=-1)
            return F.silu(gate) * up

        errs = []
        w = rand(256, 64, dtype=dtype, seed=25) * 0.125
        x = rand(7, 64, dtype=dtype, seed=26)
        errs.append(relative_error(gated_ops.gated_gemm(x, gated_ops.interleave(w)), reference(x, w)))
        x3 = rand(4, 25, 80, dtype=dtype, seed=27)[..., 8:72]  # rows with a stride of 80
        small = (16, 32, 32, 2, 4, 2)
        errs.append(relative_error(gated_ops.gated_gemm(x3, gated_ops.interleave(w), small), reference(x3, w)))
        if dtype != torch.float32 and (device == "cpu" or torch.cuda.get_device_capability()[0] >= 9):
            for split in (False, True):  # the persistent kernel over tensor descriptors, loads in warps of their own
                out = gated_ops.gated_gemm_persistent(x3, gated_ops.interleave(w), small, split, programs=3)
                errs.append(relative_error(out, reference(x3, w)))
        mlp = MLP(TransformerConfig(hidden_size=64, intermediate_size=128, num_attention_heads=2, num_key_value_heads=1,
                                    num_hidden_layers=1, rms_norm_eps=1e-6)).to(device, dtype)
        mlp.fuse_projections()
        assert attach_gated_gemm(mlp) == (dtype != torch.float32)
        if dtype != torch.float32:
            x = rand(100, 64, dtype=dtype, seed=28)
            with mock.patch.object(platform, "kernels", platform.usable), options.override(gated_gemm_min_rows=80), \
                    mock.patch.object(gated_ops, "gated_gemm", wraps=gated_ops.gated_gemm) as spy:
                errs.append(relative_error(linear.silu_gate_linear(x, mlp.gate_up_weight),
                                           reference(x, mlp.gate_up_weight)))
                linear.silu_gate_linear(x[:70], mlp.gate_up_weight)  # below the rows: not this kernel
            assert spy.call_count == 1, f"the gated GEMM served {spy.call_count} of 2 calls, not 1"
        return max(errs)

    def dense_layer_stack(dtype: torch.dtype) -> float:
        """A local module's stack as layer kernels (`engine.ops.layer_stack`) against its eager layers: with and without
        rotary and muP scale, 1-2 sequences, and taken by MiniCPM.forward where the kernels serve the tensor. On CUDA
        also fused (grid barriers), with a wide MLP whose units outnumber the resident programs (each program takes
        several), and the barrier counters back at zero after every launch."""
        from engine.config import TransformerConfig
        from engine.models.minicpm import MiniCPM, fuse_projections, rotary_table
        from engine.ops import platform

        errs = []
        modes = ["phases"] + (["fused"] if device == "cuda" else [])  # the interpreter cannot run grid barriers
        configs = [(False, False, 128), (True, True, 128)] + ([(False, False, 8192)] if device == "cuda" else [])
        for mup, no_rope, ffn in configs:
            cfg = TransformerConfig(hidden_size=64, intermediate_size=ffn, num_attention_heads=4, num_key_value_heads=2,
                                    num_hidden_layers=2, rms_norm_eps=1e-5, kv_channels=32, use_mup=mup,
                                    scale_depth=0.7, no_rope=no_rope)  # muP residual scale 0.49
            torch.manual_seed(31)
            stack = MiniCPM(cfg).to(device, dtype)
            with torch.no_grad():
                for name, p in stack.named_parameters():
                    if name.endswith("norm.weight"):
                        p.copy_(rand(*p.shape, dtype=dtype, seed=32) * 0.5 + 1.0)
            fuse_projections(stack)
            for n, length in ((2, 11), (1, 5)):
                x = rand(n, length, 64, dtype=dtype, seed=33 + length)
                rope = rotary_table(cfg, length, torch.device(device))
                with mock.patch.object(platform, "kernels", lambda _: False):
                    ref = stack.forward_local(x, rope)
                assert layer_stack.supported(stack, x)
                stack_rope = rope if stack.uses_rope else None
                for mode in modes:
                    with options.override(layer_kernel=mode):
                        errs.append(relative_error(layer_stack.dense_stack(stack, x, stack_rope), ref))
                    if mode == "fused":
                        counters = layer_stack._sync[layer_stack._device(x.device)]
                        assert counters.tolist() == [0, 0], f"barrier counters left at {counters.tolist()}"
                with mock.patch.object(platform, "kernels", platform.usable), \
                        mock.patch.object(layer_stack, "dense_stack", wraps=layer_stack.dense_stack) as spy:
                    errs.append(relative_error(stack.forward_local(x, rope), ref))
                assert spy.call_count == 1, "MiniCPM.forward did not take the layer kernels"
        return max(errs)

    def fp8_weights(dtype: torch.dtype) -> float:
        """FP8 companions read by the weight-streaming GEMV below `fp8_min_rows` (`fp8.small_rows_companion`): plain,
        SiLU-gated and K in slices as fp32 partials, against the same projections on the dequantised weights (the
        e4m3 values times their scales) in the eager ops. fp32 rows stay on F.linear with the fp32 weights (the GEMV
        holds 16-bit rows)."""
        from engine.ops import fp8 as fp8_ops

        def dequantized(w: torch.Tensor) -> torch.Tensor:
            companion = fp8_ops.companion_of(w)
            assert companion is not None
            return companion.dequantized(torch.float32)

        def weights_read(w: torch.Tensor) -> torch.Tensor:
            return w.float() if dtype == torch.float32 else dequantized(w)

        errs = []
        with mock.patch.object(platform, "kernels", platform.usable), \
                mock.patch.object(gemv_ops, "gemv", wraps=gemv_ops.gemv) as spy:
            x = rand(1, 64, dtype=dtype, seed=160)
            w = rand(48, 64, dtype=dtype, seed=161) * 0.125
            fp8_ops.attach(w)
            ref = F.linear(x.float(), weights_read(w)).to(dtype)
            errs.append(relative_error(linear.linear(x, w), ref))
            gate, up = ref.chunk(2, dim=-1)
            errs.append(relative_error(linear.silu_gate_linear(x, w), F.silu(gate) * up))
            with mock.patch.object(gemv_ops, "GEMV_SLICE", 32):
                x, w = rand(1, 96, dtype=dtype, seed=162), rand(16, 96, dtype=dtype, seed=163) * 0.1
                fp8_ops.attach(w)
                parts = linear.residual_linear(x, w)
                if dtype != torch.float32:
                    assert parts.shape == (3, 1, 16) and parts.dtype == torch.float32, (parts.shape, parts.dtype)
                    parts = parts.sum(0)
                errs.append(relative_error(parts, F.linear(x.float(), weights_read(w))))
        expected = 0 if dtype == torch.float32 else 3
        assert spy.call_count == expected, f"the GEMV served {spy.call_count} of the 3 projections, not {expected}"
        assert all(c.kwargs.get("scale") is not None for c in spy.call_args_list), "a GEMV read 16-bit weights"
        return max(errs)

    def fp8_gemm(dtype: torch.dtype) -> float:
        """The Triton FP8 GEMM (`engine.ops.fp8_gemm`), tiled and (sm90+) persistent, plain and with the SiLU gate over
        the interleaved weight, against the same product of the e4m3 values times their scales in float64, rounded
        where `_scaled_mm` and `silu_mul` round (the output; each half, then SiLU and the product): 37 rows (a partial
        row tile, several column tiles, row tiles grouped), x rows with a stride (the tiled kernel reads it)."""
        from engine.ops import fp8 as fp8_ops
        from engine.ops import fp8_gemm as fp8_gemm_ops

        if device == "cuda" and torch.cuda.get_device_capability() < (8, 9):
            pytest.skip("e4m3 dots need sm89 or newer")
        x = rand(37, 64, dtype=dtype, seed=170)
        weight = fp8_ops.quantize_weight(rand(64, 64, dtype=dtype, seed=171) * 0.125)
        x_fp8, x_scale = fp8_ops.quantize_rows_reference(x)
        wide = torch.zeros(37, 96, dtype=x_fp8.dtype, device=x_fp8.device)
        wide[:, 16:80] = x_fp8
        x_fp8 = wide[:, 16:80]  # rows with a stride of 96
        exact = ((x_fp8.double() * x_scale.double()) @ (weight.data.double() * weight.scale.double().view(-1, 1)).t())
        plain_ref = exact.to(dtype)
        gate, up = plain_ref.chunk(2, dim=-1)
        gated_ref = F.silu(gate.float()).to(dtype).float().mul(up.float()).to(dtype)
        gated_weight = fp8_ops.interleaved(weight)
        errs = []
        persistent = device == "cpu" or torch.cuda.get_device_capability()[0] >= 9  # tensor descriptors
        for tiles in ((16, 16, 32, 2, 4, 2, False), (32, 16, 64, 2, 4, 1, True))[:2 if persistent else 1]:
            out = fp8_gemm_ops.fp8_matmul(x_fp8, x_scale, weight.data, weight.scale, dtype, tiles, programs=3)
            errs.append(relative_error(out, plain_ref))
            out = fp8_gemm_ops.fp8_matmul(x_fp8, x_scale, gated_weight.data, gated_weight.scale, dtype, tiles,
                                          gated=True, programs=3)
            errs.append(relative_error(out, gated_ref))
        return max(errs)

    def packed_rows(case: Callable[[torch.dtype], float]) -> Callable[[torch.dtype], float]:
        """A VAE row kernel's case with rows packed up to `platform.ROW_TILE_ELEMENTS` a program, as a large batch
        packs them (rows across streams, the last program's rows partly masked; the depthwise conv's 11-channel rows
        in two programs)."""
        def run(dtype: torch.dtype) -> float:
            with mock.patch.object(platform, "ROW_TILE_MIN_PROGRAMS", 1):
                return case(dtype)
        return run

    def both_row_tilings(case: Callable[[torch.dtype], float]) -> Callable[[torch.dtype], float]:
        """The case with the default tiling (one row a program at these small sizes) and again packed."""
        packed = packed_rows(case)
        return lambda dtype: max(case(dtype), packed(dtype))

    snake, dwconv_snake, residual_unit, conv_transpose = map(
        both_row_tilings, (snake, dwconv_snake, residual_unit, conv_transpose))
    # The interpreter runs the whole decoder packed only (its parts' cases run both tilings): one row a program, the
    # default, took it 124 s of CPU, packed 6 s.
    vae_decoder = packed_rows(vae_decoder) if device == "cpu" else both_row_tilings(vae_decoder)
    return {"add_rms_norm": add_rms_norm, "silu_mul": silu_mul, "skinny_matmul": skinny_matmul, "gemv": gemv,
            "rotary_qk": rotary_qk,
            "rotary_store_kv": rotary_store_kv, "dispatch": dispatch, "dense_attention": dense,
            "snake": snake, "dwconv_snake": dwconv_snake, "residual_unit": residual_unit,
            "conv_transpose": conv_transpose, "vae_decoder": vae_decoder, "vae_fp16_gemm": vae_fp16_gemm,
            "cfg_euler": cfg_euler, "dit_step": dit_step,
            "gated_gemm": gated_gemm, "dense_layer_stack": dense_layer_stack, "lora": lora, "fp8_weights": fp8_weights,
            "fp8_gemm": fp8_gemm}


def _interpreter_main(shard: int = 0, shards: int = 1) -> None:
    """Entry point of a subprocess (TRITON_INTERPRET=1): one JSON line per case and dtype, of this shard's cases."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    patch_triton_interpreter()  # the paged attention kernel (in the dispatch case) needs it under triton 3.6
    mine = interpreter_shard(shard, shards)
    for name, case in _cases("cpu").items():
        if name not in mine:
            continue
        for dtype_name in INTERPRETED:
            if f"{name}-{dtype_name}" in CASE_NAMES:
                print(json.dumps({"case": f"{name}-{dtype_name}", "err": case(DTYPES[dtype_name])}), flush=True)


# Seconds each case took in the interpreter (the dtypes it runs there, two processes on the 2-core AMD EPYC VM,
# 2026-11-30; every other case took 2 s or less): the shards' cases are dealt longest first to the least loaded shard
# (the slow cases by index would share one shard). The suite waited ~8.5 min for these before the VAE cases shared
# their configurations between the dtypes and dense attention's large batch went from 64 sequences to 8; then ~6 min
# (a 20-min suite's) before the whole decoder ran packed only and dense attention's tilings alternated between dtypes;
# all cases took 303 s of CPU before the interpreter's helpers stopped re-patching the language
# (`patch_triton_interpreter`) and 182 s after.
INTERPRETER_SECONDS = {"dwconv_snake": 46, "conv_transpose": 45, "vae_fp16_gemm": 23, "dense_layer_stack": 20,
                       "dense_attention": 19, "residual_unit": 13, "vae_decoder": 4}


def interpreter_shard(shard: int, shards: int) -> set[str]:
    """The case names shard `shard` of `shards` runs (the same deal in every shard's process)."""
    loads = [0.0] * shards
    deal: list[set[str]] = [set() for _ in range(shards)]
    for name in sorted(CASES, key=lambda n: -INTERPRETER_SECONDS.get(n, 1)):
        least = loads.index(min(loads))
        deal[least].add(name)
        loads[least] += INTERPRETER_SECONDS.get(name, 1)
    return deal[shard]


@pytest.fixture(scope="module")
def interpreter_results() -> dict[str, float]:
    if not HAVE_TRITON:
        pytest.skip("triton is not importable")
    return {r["case"]: r["err"] for r in interpreter_rows("tests.test_ops_kernels")}


CASES = ("add_rms_norm", "silu_mul", "skinny_matmul", "gemv", "rotary_qk", "rotary_store_kv", "dispatch",
         "dense_attention", "snake", "dwconv_snake", "residual_unit", "conv_transpose", "vae_decoder",
         "vae_fp16_gemm", "cfg_euler",
         "dit_step", "gated_gemm", "dense_layer_stack", "lora", "fp8_weights", "fp8_gemm")
# The whole VAE decoder runs in the interpreter in fp32 only (its parts' cases check fp16 too; CUDA checks all three).
CASE_NAMES = [f"{c}-{d}" for c in CASES for d in INTERPRETED if (c, d) != ("vae_decoder", "fp16")]


@pytest.mark.timeout(900)  # the first one waits for the interpreter's shards (interpreter_rows' own limit)
@pytest.mark.parametrize("name", CASE_NAMES)
def test_interpreter_matches_eager(interpreter_results: dict[str, float], name: str) -> None:
    assert name in interpreter_results, f"case {name} did not run"
    case, dtype_name = name.rsplit("-", 1)
    limit = bound(case, DTYPES[dtype_name])
    assert interpreter_results[name] <= limit, f"{name}: max relative error {interpreter_results[name]:.2e} > {limit}"


@pytest.mark.skipif(not (HAVE_TRITON and torch.cuda.is_available()), reason="needs CUDA and triton")
@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("case_name", CASES)
def test_cuda_matches_eager(case_name: str, dtype_name: str) -> None:
    # One test a case and dtype: the VAE cases compile tens of kernel variants each (~100 s a dtype), so the CUDA
    # suite can be spread over processes.
    dtype = DTYPES[dtype_name]
    err = _cases("cuda")[case_name](dtype)
    limit = bound(case_name, dtype)
    assert err <= limit, f"{case_name}-{dtype_name}: max relative error {err:.2e} > {limit}"


@pytest.mark.skipif(not HAVE_TRITON, reason="needs triton")
def test_every_case_is_listed() -> None:
    assert tuple(_cases("cpu")) == CASES


@pytest.mark.skipif(not (HAVE_TRITON and torch.cuda.is_available()), reason="needs CUDA and triton")
def test_refused_cooperative_grid_is_halved_cuda() -> None:
    """A fused layer-kernel grid larger than the GPU can hold at once (what an MPS client with an SM limit meets) is
    refused by the driver as a cooperative launch; the launch halves it until accepted, keeps that size as the
    device's cap (a later launch is not refused again), and computes what the per-phase launches compute."""
    from engine.config import TransformerConfig
    from engine.models.minicpm import MiniCPM, fuse_projections, rotary_table
    from engine.ops import layer_stack

    cfg = TransformerConfig(hidden_size=64, intermediate_size=8192, num_attention_heads=4, num_key_value_heads=2,
                            num_hidden_layers=2, rms_norm_eps=1e-5, kv_channels=32)
    torch.manual_seed(41)
    stack = MiniCPM(cfg).to("cuda", torch.float32)
    fuse_projections(stack)
    x = torch.randn(2, 11, 64, device="cuda")
    rope = rotary_table(cfg, 11, torch.device("cuda"))
    assert layer_stack.supported(stack, x)
    with options.override(layer_kernel="phases"):
        ref = layer_stack.dense_stack(stack, x, rope)
    dev = layer_stack._device(x.device)
    real_launch = layer_stack._launch_fused

    def oversized(grid: int, args: tuple, kwargs: dict, device: torch.device) -> None:
        real_launch(grid * 64, args, kwargs, device)  # far more programs than the SMs hold at once

    with options.override(layer_kernel="fused"), options.override(layer_cooperative=True), \
            mock.patch.object(layer_stack, "_launch_fused", oversized), \
            mock.patch.dict(layer_stack._grid_cap, clear=True), \
            mock.patch.object(layer_stack, "_plain_launch", set()):
        out = layer_stack.dense_stack(stack, x, rope)
        cap = layer_stack._grid_cap.get(dev)
        with mock.patch.object(layer_stack, "log") as log:
            again = layer_stack.dense_stack(stack, x, rope)  # starts from the remembered cap
        assert cap is not None, "the oversized cooperative grid was not refused"
        assert layer_stack._grid_cap[dev] == cap and not log.warning.called, "a later launch was refused again"
        assert not layer_stack._plain_launch
    assert relative_error(out, ref) <= BOUNDS[torch.float32]
    assert torch.equal(again, out)
    assert layer_stack._sync[dev].tolist() == [0, 0], "barrier counters left set"


@pytest.mark.skipif(not (HAVE_TRITON and torch.cuda.is_available()), reason="needs CUDA and triton")
def test_split_k_residual_projections_match_one_gemm_cuda() -> None:
    """Where `residual_splits` splits (K >= 1024, few outputs), a decoder stack's o and down projections come back as
    fp32 partials that the add + RMSNorm kernel sums: the stack's output matches the one-GEMM path's within bf16
    rounding, and the split path really ran (o: K 1024, 2 slices; down: K 4096, 4 slices; the kernel got them)."""
    from engine.config import TransformerConfig
    from engine.models import minicpm
    from engine.models.minicpm import MiniCPM, fuse_projections, rotary_table
    from engine.ops import linear, norm

    cfg = TransformerConfig(hidden_size=256, intermediate_size=4096, num_attention_heads=8, num_key_value_heads=2,
                            num_hidden_layers=2, rms_norm_eps=1e-5, kv_channels=128)
    torch.manual_seed(43)
    stack = MiniCPM(cfg).to("cuda", torch.bfloat16)
    fuse_projections(stack)
    x = torch.randn(4, 24, 256, device="cuda", dtype=torch.bfloat16)  # 96 rows: above the layer kernel's 64
    rope = rotary_table(cfg, 24, torch.device("cuda"))
    shapes: list[tuple[int, ...]] = []

    def recording(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        out = linear.residual_linear(a, w)
        shapes.append(tuple(out.shape))
        return out

    with torch.inference_mode():
        with options.override(split_k=False):
            ref = stack.forward_local(x, rope)
        with mock.patch.object(minicpm, "residual_linear", recording), \
                mock.patch.object(norm, "add_rms_norm_triton", wraps=norm.add_rms_norm_triton) as kernel:
            out = stack.forward_local(x, rope)
    assert shapes == [(2, 4, 24, 256), (4, 4, 24, 256)] * 2, shapes
    assert sum(c.args[1] is not None and c.args[1].dim() == 4 for c in kernel.call_args_list) == 4
    assert relative_error(out, ref) <= BOUNDS[torch.bfloat16]


@pytest.mark.skipif(not (HAVE_TRITON and torch.cuda.is_available()), reason="needs CUDA and triton")
def test_pdl_chain_matches_plain_launches_cuda() -> None:
    """The one-row chain of GEMV and add + RMSNorm kernels launched with PDL (engine/pdl.py) computes exactly what
    plain launches of the same kernels compute, eager and replayed in a CUDA graph over new inputs: a kernel that read
    its predecessor's output before that was written would differ. Also checks the launches were PDL ones."""
    from engine.ops import gemv, linear, norm, pdl

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("PDL needs sm_90 or newer")
    torch.manual_seed(51)
    hidden, ffn, layers = 512, 1536, 6
    weights = [dict(qkv=torch.randn(3 * hidden, hidden, device="cuda").bfloat16() * hidden ** -0.5,
                    o=torch.randn(hidden, hidden, device="cuda").bfloat16() * hidden ** -0.5,
                    gate_up=torch.randn(2 * ffn, hidden, device="cuda").bfloat16() * hidden ** -0.5,
                    down=torch.randn(hidden, ffn, device="cuda").bfloat16() * ffn ** -0.5,
                    norm=torch.rand(hidden, device="cuda").bfloat16() + 0.5) for _ in range(layers)]
    x_in = torch.randn(1, hidden, device="cuda").bfloat16()

    def chain() -> torch.Tensor:
        x, normed = x_in, norm.rms_norm(x_in, weights[0]["norm"], 1e-5)
        for w in weights:
            qkv = linear.linear(normed, w["qkv"])
            x, normed = norm.add_rms_norm(x, linear.residual_linear(qkv[:, :hidden], w["o"]), None, w["norm"], 1e-5)
            gated = linear.silu_gate_linear(normed, w["gate_up"])
            x, normed = norm.add_rms_norm(x, linear.residual_linear(gated, w["down"]), None, w["norm"], 1e-5)
        return normed

    with mock.patch.object(gemv, "GEMV_SLICE", 512):  # the down projection's K in 3 slices: partials
        with options.override(pdl=False):
            plain = chain()
        with mock.patch.object(pdl, "option", wraps=pdl.option) as spy:
            chained = chain()
        assert sum(c.args[0] for c in spy.call_args_list) == 1 + 6 * layers, "not every kernel was a PDL launch"
        assert torch.equal(chained, plain)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = chain()
        for i in range(10):
            x_in.copy_(torch.randn(1, hidden, device="cuda").bfloat16())
            with options.override(pdl=False):
                ref = chain()
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, ref), f"replay {i}: the PDL chain differs from plain launches"
