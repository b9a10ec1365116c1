"""Bidirectional attention within each short sequence (LocEnc, DiT), the rotary embedding applied on load.

The local modules attend over sequences of at most `MAX_DENSE_LEN` tokens, where library flash kernels waste most of
their 64-128-row tiles. One program takes one sequence and one to G query heads of a GQA group, loading K and V
once. `attend_heads` is shared with the layer-stack kernel (`engine.ops.layer_stack`).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from engine.ops import platform
from engine.ops.platform import HAVE_TRITON
from engine.ops.rotary import rotary_qk
from engine.options import batch_invariant

if TYPE_CHECKING:
    import torch
else:
    from engine.lazy_torch import torch  # the kernel-compiling children never load it

if HAVE_TRITON:
    import triton
    import triton.language as tl

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


MAX_DENSE_LEN = 64  # longest sequence `dense_attention` takes (LocEnc: patch + 1, DiT: 2 * patch + 3)


def dense_attention_supported(q: torch.Tensor, k: torch.Tensor) -> bool:
    dim = q.shape[-1]
    return (q.dim() == 4 and q.shape[1] <= MAX_DENSE_LEN and dim >= 32 and dim & (dim - 1) == 0
            and q.shape[2] % k.shape[2] == 0 and q.dtype in (torch.float32, torch.float16, torch.bfloat16))


def dense_attention_heads(sequences: int, heads: int, group: int) -> int:
    """`dense_attention`'s default query heads per program: as many of a GQA group as keep >= 512 programs (small
    batches keep one head per program, for parallelism). On an H200 (`tools/bench.py kernels --only attention`,
    2026-11-29) this was the fastest choice at every batch measured, 1 to 256, for the DiT and LocEnc."""
    per_program = 1
    while group % (per_program * 2) == 0 and sequences * heads // (per_program * 2) >= 512:
        per_program *= 2
    return per_program


def dense_attention_warps(sequences: int, heads: int, per_program: int = 1) -> int:
    """`dense_attention`'s default warps per program: 4 below 256 (sequence, head) pairs, 1 from 1024 programs on
    (a GQA group's heads all in each: DiT at B=256 38.8 against 51.9 us with 2), else 2."""
    if sequences * heads < 256:
        return 4
    return 1 if sequences * heads // per_program >= 1024 else 2


def dense_attention_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor | None,
                           sin: torch.Tensor | None, heads_per_program: int | None = None,
                           num_warps: int | None = None) -> torch.Tensor:
    """Bidirectional attention within each sequence: q (N, L, Hq, D), k/v (N, L, Hk, D) (unit stride in D),
    rotary rows cos/sin (L, D) fp32 applied to q and k first (None: no rotary) -> (N, L, Hq * D).
    heads_per_program: query heads sharing one program (and one load of K/V); None: `dense_attention_heads`.
    num_warps: None: `dense_attention_warps` (`tools/bench.py kernels --only attention` sweeps both)."""
    n, seq_len, hq, dim = q.shape
    group = hq // k.shape[2]
    heads = math.gcd(heads_per_program or dense_attention_heads(n, hq, group), group)  # one kv head per program
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
            num_warps=num_warps or dense_attention_warps(n, hq, heads))
    return out


def dense_attention_eager(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          rope: torch.Tensor | None) -> torch.Tensor:
    """The rotary embedding of q and k, then SDPA within each sequence (the official op order)."""
    if rope is not None:
        q, k = rotary_qk(q, k, rope[..., 0, :], rope[..., 1, :])
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    if not q.is_cuda:  # the CPU kernels' summation order (exact parity) is that of contiguous inputs
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    o = torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    return o.transpose(1, 2).flatten(-2)


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rope: torch.Tensor | None) -> torch.Tensor:
    """Bidirectional attention within each short sequence: q (N, L, Hq, D), k/v (N, L, Hkv, D), rotary rows `rope`
    (L, 2, D) applied to q and k first -> (N, L, Hq * D). On CUDA one kernel does both, where it takes the shapes."""
    if platform.kernels(q) and dense_attention_supported(q, k):
        cos, sin = (rope[:, 0, :], rope[:, 1, :]) if rope is not None else (None, None)
        # Batch-invariant: one head per program and fixed warps (by default both follow the batch's size).
        return dense_attention_triton(q, k, v, cos, sin, *((1, 4) if q.is_cuda and batch_invariant("cuda") else ()))
    return dense_attention_eager(q, k, v, rope)
