"""Triton kernels for the element-wise chains and the short dense attention of a decode step (CUDA;
CPU only through TRITON_INTERPRET=1, for tests).

Why hand-written rather than torch.compile'd: the profile of a B=64 step on an H100 showed the compiled
(dynamic-shape) rotary and SiLU-gate kernels at 3-6x their memory-bound time, cuDNN's flash attention
spending 46 us per call on the DiT's 11-token sequences (tiles of 64-128 rows), and the compiled Snake
recompiling per VAE stage until dynamo's limit; compiling them also dominated a cold start (the engine no
longer uses torch.compile at all). These kernels
compile once per dtype and block size and follow the eager op order and rounding points:

- `add_rms_norm`: residual update (times the muP scale) and the RMSNorm of the result, one row per program (the
  update may be a split-K GEMM's fp32 partials, summed here);
- `silu_mul`: SiLU(gate) * up over the halves of the fused gate/up projection;
- `rotary_qk`: rotary embedding of q and k of the causal LMs (one token and head per program);
- `rotary_store_kv`: the same with k (rotated) and v written straight into their paged-cache slots (every Triton-
  backend step, decode and prefill: one kernel instead of the rotary and two scatters per layer);
- `dense_attention`: the local encoder's and DiT's bidirectional attention over sequences of <= 64 tokens
  with the rotary embedding applied on load (one sequence and 1..G query heads of a GQA group per program);
- `snake`: the VAE's Snake activation x + sin^2(alpha x) / alpha on (B, C, T) activations of any strides;
- `causal_depthwise_conv`: a residual unit's Snake, carried-context concat, dilated depthwise causal conv and the
  Snake after it in one pass, also returning the new carried context;
- `upsampler_input`, `overlap_add`: the VAE upsampler's GEMM input (the carried context and the new frames of every
  stream side by side, the context replaced in place) and the transposed conv's outputs from its per-tap products;
- `cfg_euler_step`: one Euler step of the flow sampler with CFG-zero* guidance, one row per program;
- `dit_input`: a DiT evaluation's input rows (the leading tokens, then in_proj of the noisy patch for both CFG
  halves) in one kernel; `dit_output_euler`: its output projection and the guided Euler step in one kernel;
- `skinny_matmul`: a bias-free projection of a few rows, weight-streaming (one program per 16 output columns),
  with the SiLU gate fused in for the gate/up projection (the one place it beat cuBLAS on the H100).
"""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
else:
    from engine.lazy_torch import torch  # the kernel-compiling children never load it

from engine import pdl
from engine.options import current
from engine.triton_attention import HAVE_TRITON, _is_interpreted

if HAVE_TRITON:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    from engine.triton_attention import _rotate_row

    @triton.jit
    def _add_rms_norm_kernel(x_ptr, h_ptr, w_ptr, x_out_ptr, y_ptr, n_cols, split_stride, eps, scale,
                             HAS_H: tl.constexpr, HAS_SCALE: tl.constexpr, SPLITS: tl.constexpr, BLOCK: tl.constexpr,
                             PDL: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        if PDL:  # engine/pdl.py: the next kernel may start; the norm weight is ours, the rows the kernel before's
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
        tl.store(y_ptr + row * n_cols + cols, (y.to(tl.float32) * w.to(tl.float32)).to(x.dtype), mask=mask)

    @triton.jit
    def _silu_mul_kernel(g_ptr, u_ptr, o_ptr, n_cols, stride_g, stride_u, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < n_cols
        g = tl.load(g_ptr + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + row * stride_u + cols, mask=mask, other=0.0)
        s = (g / (1.0 + tl.exp(-g))).to(u.dtype)  # F.silu rounds to the dtype before the product
        tl.store(o_ptr + row * n_cols + cols, (s.to(tl.float32) * u.to(tl.float32)).to(u.dtype), mask=mask)

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
            g = y.to(tl.float32)
            up = acc_up.to(o_ptr.dtype.element_ty)
            s = (g / (1.0 + tl.exp(-g))).to(up.dtype)
            y = (s.to(tl.float32) * up.to(tl.float32)).to(up.dtype)
        tl.store(o_ptr + m[None, :] * stride_o + cols[:, None], y, mask=m_mask[None, :])

    @triton.jit
    def _gemv_kernel(x_ptr, w_ptr, out_ptr, rows, stride_x, N: tl.constexpr, K: tl.constexpr, KS: tl.constexpr,
                     SILU_GATE: tl.constexpr, PARTIAL: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr):
        # One program per (BLOCK_N output columns, K slice of KS): its whole weight slice goes into registers first,
        # and only then (PDL) does it wait for the kernel before it, whose output the activation rows are: this
        # projection's weights stream from HBM while that kernel still runs (engine/pdl.py). Each row is then reduced
        # against them in fp32.
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
        if PDL:
            gdc_wait()
        for m in range(rows):
            x = tl.load(x_ptr + m * stride_x + split * KS + kk).to(tl.float32)
            acc = tl.sum(w.to(tl.float32) * x[None, :], axis=1)
            if PARTIAL:  # fp32 partials over the K slices, summed by `add_rms_norm`
                tl.store(out_ptr + (split * rows + m) * N + cols, acc)
            else:
                y = acc.to(out_ptr.dtype.element_ty)  # rounded like a GEMM's output
                if SILU_GATE:  # then silu_mul's op order on the rounded halves
                    up = tl.sum(w_up.to(tl.float32) * x[None, :], axis=1).to(out_ptr.dtype.element_ty)
                    g = y.to(tl.float32)
                    s = (g / (1.0 + tl.exp(-g))).to(up.dtype)
                    y = (s.to(tl.float32) * up.to(tl.float32)).to(up.dtype)
                tl.store(out_ptr + m * N + cols, y)

    @triton.jit
    def _rotary_kernel(q_ptr, k_ptr, cos_ptr, sin_ptr, q_out_ptr, k_out_ptr, stride_qt, stride_qh, stride_kt,
                       stride_kh, stride_ct, stride_st, HQ: tl.constexpr, HK: tl.constexpr, HALF: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        if h < HQ:
            src = q_ptr + t * stride_qt + h * stride_qh
            dst = q_out_ptr + (t * HQ + h) * (2 * HALF)
        else:
            src = k_ptr + t * stride_kt + (h - HQ) * stride_kh
            dst = k_out_ptr + (t * HK + h - HQ) * (2 * HALF)
        _rotate_row(src, dst, cos_ptr + t * stride_ct, sin_ptr + t * stride_st, HALF)

    @triton.jit
    def _rotary_store_kv_kernel(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, slot_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr,
                                stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ct, stride_st,
                                HQ: tl.constexpr, HK: tl.constexpr, HALF: tl.constexpr, ROPE: tl.constexpr):
        # One (token, head) per program: with ROPE the q heads first (rotated to q_out); then the k heads (rotated
        # with ROPE, else copied) and the v heads (copied) into the token's cache slot.
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1) - (HQ if ROPE else 0)  # < 0: a q head
        slot_row = tl.load(slot_ptr + t) * (HK * 2 * HALF)
        cos_row, sin_row = cos_ptr + t * stride_ct, sin_ptr + t * stride_st
        if h < 0:
            _rotate_row(q_ptr + t * stride_qt + (h + HQ) * stride_qh, q_out_ptr + (t * HQ + h + HQ) * (2 * HALF),
                        cos_row, sin_row, HALF)
        elif h < HK:
            src, dst = k_ptr + t * stride_kt + h * stride_kh, k_cache_ptr + slot_row + h * (2 * HALF)
            if ROPE:
                _rotate_row(src, dst, cos_row, sin_row, HALF)
            else:
                e = tl.arange(0, 2 * HALF)
                tl.store(dst + e, tl.load(src + e))
        else:
            e = tl.arange(0, 2 * HALF)
            hv = h - HK
            tl.store(v_cache_ptr + slot_row + hv * (2 * HALF) + e, tl.load(v_ptr + t * stride_vt + hv * stride_vh + e))

    @triton.jit
    def _dense_attention_kernel(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, o_ptr,
                                stride_qn, stride_ql, stride_qh, stride_kn, stride_kl, stride_kh,
                                stride_vn, stride_vl, stride_vh, stride_cl, stride_sl, seq_len, sm_scale,
                                GROUP: tl.constexpr, HEADS: tl.constexpr, HALF: tl.constexpr, BLOCK_L: tl.constexpr,
                                ROPE: tl.constexpr, DOT_PRECISION: tl.constexpr):
        # One program per sequence and HEADS query heads of one kv head (HEADS divides GROUP).
        attend_heads(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, o_ptr, tl.program_id(0).to(tl.int64),
                     tl.program_id(1) * HEADS, tl.num_programs(1) * HEADS, stride_qn, stride_ql, stride_qh,
                     stride_kn, stride_kl, stride_kh, stride_vn, stride_vl, stride_vh, stride_cl, stride_sl, seq_len,
                     sm_scale, GROUP, HEADS, HALF, BLOCK_L, ROPE, DOT_PRECISION, "")

    @triton.jit
    def attend_heads(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, o_ptr, n, first_head, num_heads,
                     stride_qn, stride_ql, stride_qh, stride_kn, stride_kl, stride_kh,
                     stride_vn, stride_vl, stride_vh, stride_cl, stride_sl, seq_len, sm_scale,
                     GROUP: tl.constexpr, HEADS: tl.constexpr, HALF: tl.constexpr, BLOCK_L: tl.constexpr,
                     ROPE: tl.constexpr, DOT_PRECISION: tl.constexpr, CACHE: tl.constexpr):
        """Sequence n's attention for query heads first_head .. first_head + HEADS - 1 of one kv head: K, V and the
        rotary rows are loaded (and K rotated) once for all of them. Output rows (n * seq_len + l) of num_heads
        heads. CACHE: the loads' cache modifier (".cg" where q/k/v were written by other programs of the same
        launch: L1 is not coherent)."""
        hk = first_head // GROUP
        rows = tl.arange(0, BLOCK_L)
        rmask = rows[:, None] < seq_len
        d = tl.arange(0, HALF)[None, :]
        kb = k_ptr + n * stride_kn + hk * stride_kh + rows[:, None] * stride_kl
        vb = v_ptr + n * stride_vn + hk * stride_vh + rows[:, None] * stride_vl
        k1 = tl.load(kb + d, mask=rmask, other=0.0, cache_modifier=CACHE)
        k2 = tl.load(kb + HALF + d, mask=rmask, other=0.0, cache_modifier=CACHE)
        v1 = tl.load(vb + d, mask=rmask, other=0.0, cache_modifier=CACHE)
        v2 = tl.load(vb + HALF + d, mask=rmask, other=0.0, cache_modifier=CACHE)
        dtype = o_ptr.dtype.element_ty
        if ROPE:  # rotary in fp32, rounded to the dtype: what the eager rotary hands to attention
            cb = cos_ptr + rows[:, None] * stride_cl
            sb = sin_ptr + rows[:, None] * stride_sl
            c1 = tl.load(cb + d, mask=rmask, other=0.0)
            c2 = tl.load(cb + HALF + d, mask=rmask, other=0.0)
            s1 = tl.load(sb + d, mask=rmask, other=0.0)
            s2 = tl.load(sb + HALF + d, mask=rmask, other=0.0)
            k1f, k2f = k1.to(tl.float32), k2.to(tl.float32)
            k1, k2 = (k1f * c1 - k2f * s1).to(dtype), (k2f * c2 + k1f * s2).to(dtype)
        key_ok = tl.arange(0, BLOCK_L)[None, :] < seq_len
        for i in tl.static_range(HEADS):
            h = first_head + i
            qb = q_ptr + n * stride_qn + h * stride_qh + rows[:, None] * stride_ql
            q1 = tl.load(qb + d, mask=rmask, other=0.0, cache_modifier=CACHE)
            q2 = tl.load(qb + HALF + d, mask=rmask, other=0.0, cache_modifier=CACHE)
            if ROPE:
                q1f, q2f = q1.to(tl.float32), q2.to(tl.float32)
                q1, q2 = (q1f * c1 - q2f * s1).to(dtype), (q2f * c2 + q1f * s2).to(dtype)
            scores = tl.dot(q1, tl.trans(k1), input_precision=DOT_PRECISION)
            scores += tl.dot(q2, tl.trans(k2), input_precision=DOT_PRECISION)
            scores = tl.where(key_ok, scores * sm_scale, float("-inf"))
            p = tl.exp(scores - tl.max(scores, axis=1)[:, None])
            p = (p / tl.sum(p, axis=1)[:, None]).to(dtype)
            o1 = tl.dot(p, v1, input_precision=DOT_PRECISION)
            o2 = tl.dot(p, v2, input_precision=DOT_PRECISION)
            ob = o_ptr + (n * seq_len + rows[:, None]) * (num_heads * 2 * HALF) + h * (2 * HALF)
            tl.store(ob + d, o1.to(dtype), mask=rmask)
            tl.store(ob + HALF + d, o2.to(dtype), mask=rmask)

    @triton.jit
    def _snake(x, alpha, FAST_SIN: tl.constexpr):
        """x + sin^2(alpha x) / alpha in fp32 (the official op order)."""
        if FAST_SIN:  # noqa: SIM108 (a constexpr branch: only one side is compiled)
            s = libdevice.fast_sinf(alpha * x)
        else:
            s = tl.sin(alpha * x)
        return x + (1.0 / (alpha + 1e-9)) * (s * s)

    @triton.jit
    def _snake_kernel(x_ptr, alpha_ptr, scale_ptr, shift_ptr, o_ptr, channels, length, stride_b, stride_c, stride_t,
                      HAS_SCALE: tl.constexpr, HAS_SHIFT: tl.constexpr, FAST_SIN: tl.constexpr, BLOCK: tl.constexpr):
        bc = tl.program_id(0).to(tl.int64)
        b, c = bc // channels, bc % channels
        t = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = t < length
        x = tl.load(x_ptr + b * stride_b + c * stride_c + t * stride_t, mask=mask, other=0.0).to(tl.float32)
        if HAS_SCALE:  # a per-channel affine map first (the VAE's sample-rate condition, deferred biases)
            x = x * tl.load(scale_ptr + c).to(tl.float32)
        if HAS_SHIFT:
            x = x + tl.load(shift_ptr + c).to(tl.float32)
        out = _snake(x, tl.load(alpha_ptr + c).to(tl.float32), FAST_SIN)
        tl.store(o_ptr + bc * length + t, out.to(o_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _cat_load(x_row, s_row, idx, mask, pad, stride_xt, stride_st, in_alpha, in_shift, HAS_STATE: tl.constexpr,
                  IN_SNAKE: tl.constexpr, IN_SHIFT: tl.constexpr, FAST_SIN: tl.constexpr):
        """cat(state, x')[idx] along time (idx in [0, pad + length)) in fp32, x' = x or, with IN_SNAKE,
        Snake(x [+ in_shift]) rounded to x's dtype (the separate Snake kernel's output; the state holds earlier x');
        without state the zero left-padding of a full-sequence pass."""
        in_x = idx >= pad
        v = tl.load(x_row + (idx - pad) * stride_xt, mask=mask & in_x, other=0.0)
        if IN_SNAKE:
            vf = v.to(tl.float32)
            if IN_SHIFT:
                vf = vf + in_shift
            v = _snake(vf, in_alpha, FAST_SIN).to(v.dtype)
        v = v.to(tl.float32)
        if HAS_STATE:
            old = tl.load(s_row + idx * stride_st, mask=mask & (idx < pad), other=0.0).to(tl.float32)
            v = tl.where(in_x, v, old)
        elif IN_SNAKE:  # the zero padding stays zero (Snake(0 + shift) is not)
            v = tl.where(in_x, v, 0.0)
        return v

    @triton.jit
    def _store_context(x_row, s_row, new_row, length, pad, stride_xt, stride_st, in_alpha, in_shift,
                       HAS_STATE: tl.constexpr, HAS_SLOTS: tl.constexpr, IN_SNAKE: tl.constexpr,
                       IN_SHIFT: tl.constexpr, FAST_SIN: tl.constexpr, BLOCK_P: tl.constexpr):
        """A row's new carried context, the last `pad` frames of cat(state, x') (see `_cat_load`): with HAS_SLOTS in
        place of the old one at s_row, once every thread of the program has read that (the caller is the row's
        only program that reads it; rows sharing a slot, the runner's padding rows on its scratch slot, race there
        harmlessly: their outputs are discarded), else to new_row (contiguous)."""
        i = tl.arange(0, BLOCK_P)
        pmask = i < pad
        tail = _cat_load(x_row, s_row, length + i, pmask, pad, stride_xt, stride_st, in_alpha, in_shift, HAS_STATE,
                         IN_SNAKE, IN_SHIFT, FAST_SIN)
        if HAS_SLOTS:
            tl.debug_barrier()
            tl.store(s_row + i * stride_st, tail.to(s_row.dtype.element_ty), mask=pmask)
        else:
            tl.store(new_row + i, tail.to(new_row.dtype.element_ty), mask=pmask)

    @triton.jit
    def _dwconv_kernel(x_ptr, state_ptr, slot_ptr, w_ptr, bias_ptr, alpha_ptr, in_alpha_ptr, in_shift_ptr, y_ptr,
                       new_state_ptr, channels, length, pad, dilation, stride_xb, stride_xc, stride_xt, stride_sb,
                       stride_sc, stride_st, K: tl.constexpr, HAS_STATE: tl.constexpr, HAS_SLOTS: tl.constexpr,
                       HAS_BIAS: tl.constexpr, IN_SNAKE: tl.constexpr, IN_SHIFT: tl.constexpr,
                       OUT_SNAKE: tl.constexpr, FAST_SIN: tl.constexpr, BLOCK: tl.constexpr, BLOCK_P: tl.constexpr):
        # HAS_SLOTS: state holds every slot's context; row b's is slot_ptr[b]'s, replaced in place at the end.
        # IN_SNAKE: the residual unit's first Snake applied to x on load (each sample once per tap: recomputing is
        # cheaper than the separate kernel's pass over the activations), the context holds its outputs.
        bc = tl.program_id(0).to(tl.int64)
        b, c = bc // channels, bc % channels
        x_row = x_ptr + b * stride_xb + c * stride_xc
        s_b = tl.load(slot_ptr + b).to(tl.int64) if HAS_SLOTS else b
        s_row = state_ptr + s_b * stride_sb + c * stride_sc
        in_alpha = tl.load(in_alpha_ptr + c).to(tl.float32) if IN_SNAKE else 0.0
        in_shift = tl.load(in_shift_ptr + c).to(tl.float32) if IN_SHIFT else 0.0
        t = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = t < length
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for j in tl.static_range(K):
            acc += tl.load(w_ptr + c * K + j).to(tl.float32) * _cat_load(
                x_row, s_row, t + j * dilation, mask, pad, stride_xt, stride_st, in_alpha, in_shift, HAS_STATE,
                IN_SNAKE, IN_SHIFT, FAST_SIN)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + c).to(tl.float32)
        if OUT_SNAKE:  # the Snake after the conv, on the conv's output rounded to its dtype (the eager order)
            acc = _snake(acc.to(y_ptr.dtype.element_ty).to(tl.float32), tl.load(alpha_ptr + c).to(tl.float32),
                         FAST_SIN)
        tl.store(y_ptr + bc * length + t, acc.to(y_ptr.dtype.element_ty), mask=mask)
        if tl.program_id(1) == 0:  # only this program of the row reads the old context (one time block, or >= pad)
            _store_context(x_row, s_row, new_state_ptr + bc * pad, length, pad, stride_xt, stride_st, in_alpha,
                           in_shift, HAS_STATE, HAS_SLOTS, IN_SNAKE, IN_SHIFT, FAST_SIN, BLOCK_P)


    @triton.jit
    def _upsampler_input_kernel(x_ptr, state_ptr, slot_ptr, xin_ptr, new_state_ptr, channels, batch, length, ctx,
                                frames, stride_xb, stride_xc, stride_xt, stride_sb, stride_sc, stride_st,
                                HAS_STATE: tl.constexpr, HAS_SLOTS: tl.constexpr, BLOCK: tl.constexpr,
                                BLOCK_P: tl.constexpr):
        # One (batch, channel) row: xin[c, b, :] = cat(context, x row) zero-padded to `frames`. With HAS_STATE the new
        # context (the concat's last ctx frames) is written by the program that read the old one (the first frame
        # block, BLOCK >= ctx): with HAS_SLOTS in place of slot_ptr[b]'s row of the per-slot buffer, else to
        # new_state_ptr's row.
        bc = tl.program_id(0).to(tl.int64)
        b, c = bc // channels, bc % channels
        x_row = x_ptr + b * stride_xb + c * stride_xc
        s_b = tl.load(slot_ptr + b).to(tl.int64) if HAS_SLOTS else b
        s_row = state_ptr + s_b * stride_sb + c * stride_sc
        f = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        v = _cat_load(x_row, s_row, f, f < ctx + length, ctx, stride_xt, stride_st, 0.0, 0.0, HAS_STATE, False,
                      False, False)
        tl.store(xin_ptr + (c * batch + b) * frames + f, v.to(xin_ptr.dtype.element_ty), mask=f < frames)
        if HAS_STATE and tl.program_id(1) == 0:
            _store_context(x_row, s_row, new_state_ptr + bc * ctx, length, ctx, stride_xt, stride_st, 0.0, 0.0,
                           HAS_STATE, HAS_SLOTS, False, False, False, BLOCK_P)

    @triton.jit
    def _overlap_add_kernel(g_ptr, bias_ptr, y_ptr, c_out, out_len, ctx, stride_gb, stride_gr,
                            STRIDE: tl.constexpr, KERNEL: tl.constexpr, HAS_BIAS: tl.constexpr,
                            BLOCK: tl.constexpr):
        """One (batch, channel) row of a transposed conv from its per-tap products g: element (b, row, frame) at
        b * stride_gb + row * stride_gr + frame, rows ordered (tap, channel): y[t] = bias + sum over taps
        k = t % STRIDE + r * STRIDE of g[b, k * c_out + c, t // STRIDE + ctx - r]."""
        bc = tl.program_id(0).to(tl.int64)
        b, c = bc // c_out, bc % c_out
        t = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = t < out_len
        j, m = t % STRIDE, t // STRIDE
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        g_b = g_ptr + b * stride_gb
        for r in tl.static_range((KERNEL + STRIDE - 1) // STRIDE):
            k = j + r * STRIDE
            acc += tl.load(g_b + (k * c_out + c) * stride_gr + m + ctx - r, mask=mask & (k < KERNEL),
                           other=0.0).to(tl.float32)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + c).to(tl.float32)
        tl.store(y_ptr + bc * out_len + t, acc.to(y_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _cfg_euler_math(x, vc, vu, cfg, dt, mask, dtype: tl.constexpr):
        """x - dt * (vu * s + cfg * (vc - vu * s)), s = <vc, vu> / (|vu|^2 + 1e-8) over the masked elements (fp32
        values of dtype), rounded to dtype at every point where the eager expression rounds."""
        dot = tl.sum(tl.where(mask, (vc * vu).to(dtype).to(tl.float32), 0.0)).to(dtype).to(tl.float32)
        norm = tl.sum(tl.where(mask, (vu * vu).to(dtype).to(tl.float32), 0.0)).to(dtype).to(tl.float32)
        norm = (norm + 1e-8).to(dtype).to(tl.float32)
        scale = (dot / norm).to(dtype).to(tl.float32)
        a = (vu * scale).to(dtype).to(tl.float32)
        d = (vc - a).to(dtype).to(tl.float32)
        e = (cfg * d).to(dtype).to(tl.float32)
        f = (a + e).to(dtype).to(tl.float32)
        g = (dt * f).to(dtype).to(tl.float32)
        return (x - g).to(dtype)

    @triton.jit
    def _cfg_euler_kernel(x_ptr, v_ptr, cfg_ptr, o_ptr, n, inner, batch, dt, stride_vb, stride_vo, stride_vi,
                          BLOCK: tl.constexpr):
        """One row of `cfg_euler_step`. x and the output are contiguous rows of n = outer * inner values; v's rows
        have strides (outer, inner) (the DiT's transposed output)."""
        row = tl.program_id(0).to(tl.int64)
        i = tl.arange(0, BLOCK)
        m = i < n
        v_off = (i // inner) * stride_vo + (i % inner) * stride_vi
        x = tl.load(x_ptr + row * n + i, mask=m, other=0.0).to(tl.float32)
        vc = tl.load(v_ptr + row * stride_vb + v_off, mask=m, other=0.0).to(tl.float32)
        vu = tl.load(v_ptr + (row + batch) * stride_vb + v_off, mask=m, other=0.0).to(tl.float32)
        cfg = tl.load(cfg_ptr + row).to(tl.float32)
        tl.store(o_ptr + row * n + i, _cfg_euler_math(x, vc, vu, cfg, dt, m, o_ptr.dtype.element_ty), mask=m)

    # The batch not specialised (1, multiples of 16): one variant per dtype and model shape, whatever the batch.
    @triton.jit(do_not_specialize=["batch", "lead_len"])
    def _dit_input_kernel(x_ptr, lead_ptr, w_ptr, b_ptr, seq_ptr, batch, lead_len, hidden, stride_ln, stride_lt,
                          D: tl.constexpr, P: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
        """One (sequence, position) row of a DiT evaluation's input, BLOCK_H columns of it: the leading tokens'
        row, or in_proj of the noisy patch's frame (x of the conditional and the unconditional half alike): the
        product rounded, then the bias added and rounded, as the eager linear of a strided input (a matmul, then
        the bias add) rounds."""
        row = tl.program_id(0)
        n, t = row // (lead_len + P), row % (lead_len + P)
        h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        hm = h < hidden
        out = seq_ptr + row.to(tl.int64) * hidden + h
        if t < lead_len:
            tl.store(out, tl.load(lead_ptr + n * stride_ln + t * stride_lt + h, mask=hm, other=0.0), mask=hm)
        else:
            d = tl.arange(0, BLOCK_D)
            xv = tl.load(x_ptr + ((n % batch) * D + d) * P + (t - lead_len), mask=d < D, other=0.0).to(tl.float32)
            w = tl.load(w_ptr + h[:, None] * D + d[None, :], mask=hm[:, None] & (d[None, :] < D), other=0.0)
            dtype = seq_ptr.dtype.element_ty
            acc = tl.sum(w.to(tl.float32) * xv[None, :], axis=1).to(dtype).to(tl.float32)  # the matmul's rounding
            acc += tl.load(b_ptr + h, mask=hm, other=0.0).to(tl.float32)
            tl.store(out, acc.to(dtype), mask=hm)

    @triton.jit(do_not_specialize=["batch", "lead_len"])
    def _dit_output_euler_kernel(h_ptr, w_ptr, b_ptr, x_ptr, cfg_ptr, o_ptr, batch, lead_len, dt, stride_hn,
                                 stride_ht, D: tl.constexpr, P: tl.constexpr, H: tl.constexpr, BLOCK_D: tl.constexpr,
                                 BLOCK_P: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr):
        """One row b: the conditional and unconditional velocities out_proj(h[b or batch + b, lead_len:]) (rounded
        as the eager linear of that strided slice rounds), then `cfg_euler_step`'s update of x[b]."""
        b = tl.program_id(0).to(tl.int64)
        d = tl.arange(0, BLOCK_D)
        p = tl.arange(0, BLOCK_P)
        k = tl.arange(0, BLOCK_K)
        dtype = o_ptr.dtype.element_ty
        w_rows = w_ptr + d[:, None] * H + k[None, :]
        hc = h_ptr + b * stride_hn + (lead_len + p)[None, :] * stride_ht + k[:, None]
        hu = hc + batch * stride_hn
        pm = p[None, :] < P
        acc_c = tl.zeros((BLOCK_D, BLOCK_P), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_D, BLOCK_P), dtype=tl.float32)
        for k0 in range(0, H, BLOCK_K):
            w = tl.load(w_rows + k0, mask=d[:, None] < D, other=0.0)
            acc_c = tl.dot(w, tl.load(hc + k0, mask=pm, other=0.0), acc_c, input_precision=DOT_PRECISION)
            acc_u = tl.dot(w, tl.load(hu + k0, mask=pm, other=0.0), acc_u, input_precision=DOT_PRECISION)
        bias = tl.load(b_ptr + d, mask=d < D, other=0.0).to(tl.float32)[:, None]
        # the eager linear of a strided input: the matmul rounded, then the bias added and rounded
        vc = (acc_c.to(dtype).to(tl.float32) + bias).to(dtype).to(tl.float32)
        vu = (acc_u.to(dtype).to(tl.float32) + bias).to(dtype).to(tl.float32)
        m = (d[:, None] < D) & pm
        offs = b * D * P + d[:, None] * P + p[None, :]
        x = tl.load(x_ptr + offs, mask=m, other=0.0).to(tl.float32)
        cfg = tl.load(cfg_ptr + b).to(tl.float32)
        tl.store(o_ptr + offs, _cfg_euler_math(x, vc, vu, cfg, dt, m, dtype), mask=m)


def fast_sin() -> bool:
    """Snake's sin as the hardware approximation (EngineOptions.fast_sin; its error is far below the TF32
    convolutions'): CUDA libdevice's, so not in the interpreter, not on ROCm."""
    return current().fast_sin and not _is_interpreted() and torch.version.hip is None


MAX_DENSE_LEN = 64  # longest sequence `dense_attention` takes (LocEnc: patch + 1, DiT: 2 * patch + 3)


def usable(x: torch.Tensor) -> bool:
    """Whether the kernels can run on this tensor's device."""
    return HAVE_TRITON and (x.is_cuda or _is_interpreted())


def add_rms_norm(x: torch.Tensor, h: torch.Tensor | None, scale: float | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + h * scale, RMSNorm of it) over the last dim; h=None: (x, RMSNorm(x)). h may also be a split-K GEMM's
    fp32 partial products (S, *x.shape) (`fused.residual_linear`): summed in split order and rounded to x's dtype
    first, as the GEMM's own output would be."""
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
    if x2.shape[0]:
        block = triton.next_power_of_2(n)
        chained = pdl.launch(x2, x2.shape[0])
        _add_rms_norm_kernel[(x2.shape[0],)](x2, h2, weight, x_out, y, n, x2.numel(), eps,
                                              1.0 if scale is None else scale, HAS_H=h is not None,
                                              HAS_SCALE=scale is not None, SPLITS=splits, BLOCK=block, PDL=chained,
                                              num_warps=max(1, min(16, block // 256)), **pdl.option(chained))
    return x_out.view(x.shape), y.view(x.shape)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
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


# `skinny_matmul` serves the gate/up projection up to EngineOptions.skinny_rows rows (at most 64: larger tiles would
# not fit in shared memory): there a decode step's GEMMs read each weight once for a handful of rows.


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
    block_k = next(b for b in (128, 64, 32, 16) if k_dim % b == 0)  # the H100 sweep's best for the gated GEMMs
    return block_m, 16, block_k, 4, 4


def skinny_matmul(x: torch.Tensor, weight: torch.Tensor, silu_gate: bool = False,
                  config: tuple[int, int, int, int, int] | None = None) -> torch.Tensor:
    """x (..., K) @ weight.T for a few rows (`skinny_supported`): one program per 16 output columns streams
    their weight rows once (no split-K, no reduction kernel). silu_gate: weight is [gate; up] (2N, K) and
    the result silu(x @ gate.T) * (x @ up.T), as the gate/up GEMM then `silu_mul` round it. config: as
    `skinny_config` returns (default), for tools/bench_kernels.py's sweep."""
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


GEMV_SLICE = 2048  # the most K elements per GEMV program: 8 weight rows of them are 32 KB of registers (16-bit)
GEMV_BLOCK_N = 8  # output columns per program (4 with the SiLU gate, whose up rows double the slice)


@functools.lru_cache(maxsize=64)
def gemv_slices(k_dim: int) -> int:
    """Into how many slices `gemv` cuts K: the fewest of a power-of-two length <= GEMV_SLICE (0: none fits)."""
    return next((s for s in range(1, 17) if k_dim % s == 0 and k_dim // s <= GEMV_SLICE
                 and (k_dim // s) & (k_dim // s - 1) == 0 and k_dim // s >= 16), 0)


def gemv_supported(x: torch.Tensor, weight: torch.Tensor, silu_gate: bool = False, partials: bool = False) -> bool:
    """Whether `gemv` takes x (..., K) @ weight (N, K).T: up to `gemv_max_rows` rows (EngineOptions) of a
    16-bit dtype, a contiguous weight; K in slices only where the caller sums partials."""
    k_dim = x.shape[-1]
    rows = x.numel() // max(k_dim, 1)
    slices = gemv_slices(k_dim)
    block_n = GEMV_BLOCK_N // 2 if silu_gate else GEMV_BLOCK_N
    return (0 < rows <= current().gemv_max_rows and slices > 0
            and (slices == 1 or (partials and not silu_gate)) and weight.dim() == 2 and weight.shape[1] == k_dim
            and weight.shape[0] % ((2 if silu_gate else 1) * block_n) == 0 and x.dtype == weight.dtype
            and x.dtype in (torch.float16, torch.bfloat16) and weight.is_contiguous() and x.stride(-1) == 1)


def gemv(x: torch.Tensor, weight: torch.Tensor, silu_gate: bool = False) -> torch.Tensor:
    """x (..., K) @ weight.T for a few rows (`gemv_supported`), launched with PDL where `pdl.launch` says so.
    Returns (..., N) in x's dtype, or where K is cut into S slices the fp32 partial products (S, ..., N) for
    `add_rms_norm`. silu_gate: weight is [gate; up] (2N, K), the result silu(x @ gate.T) * (x @ up.T) rounded as
    the GEMM and `silu_mul` round it."""
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
    _gemv_kernel[(n // block_n * slices,)](x2, weight, out, rows, x2.stride(0), N=n, K=k_dim, KS=k_dim // slices,
                                           SILU_GATE=silu_gate, PARTIAL=slices > 1, BLOCK_N=block_n, PDL=chained,
                                           num_warps=4, **pdl.option(chained))
    return out.view(slices, *x.shape[:-1], n) if slices > 1 else out.view(*x.shape[:-1], n)


def rotary_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
              sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q (T, Hq, D), k (T, Hk, D) with unit stride in D; cos/sin (T, D) fp32 -> rotated (contiguous) q, k."""
    t, hq, dim = q.shape
    hk = k.shape[1]
    q_out = torch.empty((t, hq, dim), dtype=q.dtype, device=q.device)
    k_out = torch.empty((t, hk, dim), dtype=k.dtype, device=k.device)
    if t:
        _rotary_kernel[(t, hq + hk)](q, k, cos, sin, q_out, k_out, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
                                     cos.stride(0), sin.stride(0), HQ=hq, HK=hk, HALF=dim // 2, num_warps=1)
    return q_out, k_out


def rotary_store_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor | None,
                    sin: torch.Tensor | None, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    slot_mapping: torch.Tensor) -> torch.Tensor:
    """A causal layer's new tokens into its paged cache in one kernel: k rotated (cos/sin (T, D) fp32; None: no
    rotary) and v written to their flat slots of k_cache/v_cache (contiguous (..., Hk, D)); returns q rotated
    (contiguous) or, without rotary, q itself. q (T, Hq, D), k/v (T, Hk, D) with unit stride in D."""
    t, hq, dim = q.shape
    hk = k.shape[1]
    rope = cos is not None and sin is not None
    q_out = torch.empty((t, hq, dim), dtype=q.dtype, device=q.device) if rope else q
    if t:
        _rotary_store_kv_kernel[(t, (hq if rope else 0) + 2 * hk)](
            q, k, v, cos if rope else k, sin if rope else k, slot_mapping, q_out, k_cache, v_cache, q.stride(0),
            q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0) if rope else 0,
            sin.stride(0) if rope else 0, HQ=hq, HK=hk, HALF=dim // 2, ROPE=rope, num_warps=1)
    return q_out


def rotary_store_supported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                           v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> bool:
    half = q.shape[-1] // 2
    return (q.dim() == k.dim() == v.dim() == 3 and half >= 1 and half & (half - 1) == 0
            and q.stride(-1) == k.stride(-1) == v.stride(-1) == 1 and k.shape == v.shape
            and k.shape[0] == q.shape[0] and k.shape[-1] == q.shape[-1] and k_cache.is_contiguous()
            and v_cache.is_contiguous() and k_cache.shape[-2:] == k.shape[-2:] == v_cache.shape[-2:]
            and k_cache.dtype == v_cache.dtype == k.dtype == v.dtype
            and slot_mapping.dtype == torch.int64 and slot_mapping.is_contiguous())


def _time_block(length: int) -> int:
    """Samples per program along time: <= 1024, but few enough blocks for grid axis 1 (< 65536)."""
    block = min(1024, triton.next_power_of_2(max(length, 1)))
    while triton.cdiv(length, block) > 65535:
        block *= 2
    return block


def rotary_supported(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    half = q.shape[-1] // 2
    return (q.dim() == 3 and k.dim() == 3 and half >= 1 and half & (half - 1) == 0 and q.stride(-1) == 1
            and k.stride(-1) == 1 and cos.dim() == 2 and sin.dim() == 2 and cos.stride(-1) == sin.stride(-1) == 1
            and cos.shape == sin.shape == (q.shape[0], q.shape[-1]) and k.shape[0] == q.shape[0]
            and k.shape[-1] == q.shape[-1])


def dense_attention_supported(q: torch.Tensor, k: torch.Tensor) -> bool:
    dim = q.shape[-1]
    return (q.dim() == 4 and q.shape[1] <= MAX_DENSE_LEN and dim >= 32 and dim & (dim - 1) == 0
            and q.shape[2] % k.shape[2] == 0 and q.dtype in (torch.float32, torch.float16, torch.bfloat16))


def dense_attention_warps(sequences: int, heads: int) -> int:
    """`dense_attention`'s default warps per program: 2 from 256 (sequence, head) pairs on, else 4."""
    return 2 if sequences * heads >= 256 else 4


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor | None,
                    sin: torch.Tensor | None, heads_per_program: int | None = None,
                    num_warps: int | None = None) -> torch.Tensor:
    """Bidirectional attention within each sequence: q (N, L, Hq, D), k/v (N, L, Hk, D) (unit stride in D),
    rotary rows cos/sin (L, D) fp32 applied to q and k first (None: no rotary) -> (N, L, Hq * D).
    heads_per_program: query heads sharing one program (and one load of K/V); None: EngineOptions.dense_heads
    (default 0), where 0 means as many of a GQA group as keep >= 256 programs (small batches keep one head
    per program, for parallelism). num_warps: None picks 2 from 256 (sequence, head) pairs on, else 4 (the H100
    sweep of tools/bench_kernels.py: DiT at B=128 33.8 us with 4 warps, 18.1 us with 2; ~5 us either way at B=1)."""
    n, seq_len, hq, dim = q.shape
    group = hq // k.shape[2]
    heads_per_program = heads_per_program or current().dense_heads or None
    heads = heads_per_program or 1
    while heads_per_program is None and group % (heads * 2) == 0 and n * hq // (heads * 2) >= 256:
        heads *= 2
    heads = math.gcd(heads, group)  # a program's heads must share one kv head
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    out = torch.empty((n, seq_len, hq * dim), dtype=q.dtype, device=q.device)
    if n and seq_len:
        rope = cos is not None and sin is not None
        _dense_attention_kernel[(n, hq // heads)](
            q, k, v, cos if rope else q, sin if rope else q, out,
            q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2), cos.stride(0) if cos is not None else 0,
            sin.stride(0) if sin is not None else 0,
            seq_len, dim ** -0.5, GROUP=group, HEADS=heads, HALF=dim // 2,
            BLOCK_L=max(16, triton.next_power_of_2(seq_len)), ROPE=rope,
            DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
            num_warps=num_warps or dense_attention_warps(n, hq))
    return out


def snake(x: torch.Tensor, alpha: torch.Tensor, scale: torch.Tensor | None = None,
          shift: torch.Tensor | None = None) -> torch.Tensor:
    """x (B, C, T) any strides, alpha (1, C, 1) -> contiguous x + sin^2(alpha x) / alpha in x's dtype, of
    x * scale + shift when given (each (C,), fp32 math)."""
    b, c, t = x.shape
    out = torch.empty((b, c, t), dtype=x.dtype, device=x.device)
    if b and c and t:
        block = _time_block(t)
        _snake_kernel[(b * c, triton.cdiv(t, block))](
            x, alpha.reshape(-1), x if scale is None else scale, x if shift is None else shift, out, c, t,
            x.stride(0), x.stride(1), x.stride(2), HAS_SCALE=scale is not None, HAS_SHIFT=shift is not None,
            FAST_SIN=fast_sin(), BLOCK=block, num_warps=4)
    return out


def _context_args(x: torch.Tensor, state: torch.Tensor | None,
                  slots: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None, tuple[int, ...]]:
    """A VAE kernel's carried-context arguments: the tensor it reads (x, never read, without a state), the slots when
    the context is read and replaced in place (else None), and its (batch, channel, time) strides (zeros without)."""
    if state is None:
        return x, None, (0, 0, 0)
    return state, slots, tuple(state.stride())


def causal_depthwise_conv(x: torch.Tensor, state: torch.Tensor | None, weight: torch.Tensor, bias: torch.Tensor | None,
                          dilation: int, out_alpha: torch.Tensor | None = None, slots: torch.Tensor | None = None,
                          in_alpha: torch.Tensor | None = None,
                          in_shift: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The carried context `state` (B, C, P) prepended to x' (None: zeros), then the depthwise conv with weight
    (C, 1, K), P = (K - 1) * dilation -> (y (B, C, T), the new context (B, C, P)), both contiguous in x's
    dtype. x' is x, or with `in_alpha` (1, C, 1) `snake(x, in_alpha, shift=in_shift)` (in_shift (C,) or None),
    computed on load: the context holds x' as it would after a separate Snake. With `out_alpha` (1, C, 1), y is
    Snake of the conv's output. x and state may have any strides. No copy of the concatenation is made. With
    `slots` (B,): state is (slots, C, P), row b's context is state[slots[b]], and it is replaced there in place
    (returned: state)."""
    b, c, t = x.shape
    k = weight.shape[-1]
    pad = (k - 1) * dilation
    y = torch.empty((b, c, t), dtype=x.dtype, device=x.device)
    source, slots, state_strides = _context_args(x, state, slots)
    in_place = slots is not None
    new_state = source if in_place else torch.empty((b, c, pad), dtype=x.dtype, device=x.device)
    if b and c:
        block = _time_block(t)
        # in place, only the first time block may read the old context: it must cover it, or be the only block
        assert not in_place or block >= pad or triton.cdiv(t, block) == 1, (t, block, pad)
        w = weight.reshape(c, k).contiguous()
        _dwconv_kernel[(b * c, max(1, triton.cdiv(t, block)))](
            x, source, slots if in_place else w, w, bias if bias is not None else w,
            out_alpha.reshape(-1) if out_alpha is not None else w, in_alpha.reshape(-1) if in_alpha is not None else w,
            in_shift if in_shift is not None else w, y, new_state, c, t, pad, dilation, *x.stride(), *state_strides,
            K=k, HAS_STATE=state is not None, HAS_SLOTS=in_place,
            HAS_BIAS=bias is not None, IN_SNAKE=in_alpha is not None, IN_SHIFT=in_shift is not None,
            OUT_SNAKE=out_alpha is not None, FAST_SIN=fast_sin(), BLOCK=block,
            BLOCK_P=triton.next_power_of_2(max(pad, 1)), num_warps=4)
    return y, new_state


def upsampler_input(x: torch.Tensor, state: torch.Tensor | None, ctx: int, frames: int,
                    slots: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The upsampler GEMM's input and the new carried context: x (B, C, n) any strides after its context `state`
    (B, C, ctx) (None: zeros), zero-padded to `frames` >= ctx + n -> ((C, B, frames) contiguous, every stream's frames
    side by side; the last ctx frames of cat(context, x) as (B, C, ctx), None without a state). With `slots` (B,):
    state is (slots, C, ctx), row b's context is state[slots[b]], and it is replaced there in place (returned:
    state), as `causal_depthwise_conv` does."""
    b, c, n = x.shape
    xin = torch.empty((c, b, frames), dtype=x.dtype, device=x.device)
    source, slots, state_strides = _context_args(x, state, slots)
    in_place = slots is not None
    new_state = (source if in_place else None if state is None
                 else torch.empty((b, c, ctx), dtype=x.dtype, device=x.device))
    if b and c:
        block = max(_time_block(frames), triton.next_power_of_2(max(ctx, 1)))
        _upsampler_input_kernel[(b * c, triton.cdiv(frames, block))](
            x, source, slots if in_place else x, xin, new_state if new_state is not None else xin, c, b, n, ctx,
            frames, *x.stride(), *state_strides, HAS_STATE=state is not None, HAS_SLOTS=in_place, BLOCK=block,
            BLOCK_P=triton.next_power_of_2(max(ctx, 1)), num_warps=4)
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
        block = _time_block(out_len)
        _overlap_add_kernel[(b * c_out, triton.cdiv(out_len, block))](
            g, bias if bias is not None else g, y, c_out, out_len, ctx, g.stride(0), g.stride(1), STRIDE=stride,
            KERNEL=kernel, HAS_BIAS=bias is not None, BLOCK=block, num_warps=4)
    return y


def cfg_euler_step(x: torch.Tensor, v: torch.Tensor, cfg: torch.Tensor, dt: float) -> torch.Tensor:
    """x (B, D, P) one Euler step with CFG-zero* guidance; v (2B, D, P) of any strides: conditional rows,
    then unconditional; cfg (B,) per-row guidance. One dtype; x contiguous. One program per row."""
    b, d, p = x.shape
    out = torch.empty_like(x)
    if b:
        _cfg_euler_kernel[(b,)](x, v, cfg, out, d * p, p, b, dt, v.stride(0), v.stride(1), v.stride(2),
                                BLOCK=triton.next_power_of_2(d * p), num_warps=1 if d * p <= 512 else 4)
    return out


def dit_input(x: torch.Tensor, leading: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """cat(leading, in_proj(cat(x, x).transpose(1, 2))) along positions: x (B, D, P) contiguous, leading (2B, T, H)
    with unit column stride, in_proj's weight (H, D) and bias (H,) -> (2B, T + P, H) in one kernel."""
    b, d, p = x.shape
    n, lead_len, hidden = leading.shape
    seq = torch.empty((n, lead_len + p, hidden), dtype=leading.dtype, device=x.device)
    block_h = min(256, triton.next_power_of_2(hidden))
    _dit_input_kernel[(n * (lead_len + p), triton.cdiv(hidden, block_h))](
        x, leading, weight, bias, seq, b, lead_len, hidden, leading.stride(0), leading.stride(1), D=d, P=p,
        BLOCK_H=block_h, BLOCK_D=triton.next_power_of_2(d), num_warps=4)
    return seq


def dit_output_euler(h: torch.Tensor, lead_len: int, weight: torch.Tensor, bias: torch.Tensor, x: torch.Tensor,
                     cfg: torch.Tensor, dt: float) -> torch.Tensor:
    """cfg_euler_step(x, out_proj(h[:, lead_len:]).transpose(1, 2), cfg, dt) in one kernel: h (2B, T + P, H) with
    unit column stride, out_proj's weight (D, H) contiguous and bias (D,), x (B, D, P) contiguous, cfg (B,)."""
    b, d, p = x.shape
    hidden = h.shape[-1]
    out = torch.empty_like(x)
    block_k = next(k for k in (64, 32, 16) if hidden % k == 0)
    _dit_output_euler_kernel[(b,)](
        h, weight, bias, x, cfg, out, b, lead_len, dt, h.stride(0), h.stride(1), D=d, P=p, H=hidden,
        BLOCK_D=max(16, triton.next_power_of_2(d)), BLOCK_P=max(16, triton.next_power_of_2(p)), BLOCK_K=block_k,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32", num_warps=4)
    return out
