"""Bidirectional attention within each short sequence (LocEnc, DiT), the rotary embedding applied on load.

The local modules attend over sequences of at most `MAX_DENSE_LEN` tokens, where library flash kernels waste most of
their 64-128-row tiles. One program takes one sequence and one to G query heads of a GQA group, loading K and V
once, and either loops over its heads (`attend_heads`, shared with the layer-stack kernel in `engine.ops.layer_stack`)
or stacks their query rows into one tile (`attend_stacked`: one pair of dots for all of them instead of a chain per
head).
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
                                ROPE: tl.constexpr, DOT_PRECISION: tl.constexpr, STACKED: tl.constexpr):
        # One program per sequence and HEADS query heads of one kv head (HEADS divides GROUP).
        if STACKED:
            attend_stacked(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, o_ptr, tl.program_id(0).to(tl.int64),
                           tl.program_id(1) * HEADS, tl.num_programs(1) * HEADS, stride_qn, stride_ql, stride_qh,
                           stride_kn, stride_kl, stride_kh, stride_vn, stride_vl, stride_vh, stride_cl, stride_sl,
                           seq_len, sm_scale, GROUP, HEADS, HALF, BLOCK_L, ROPE, DOT_PRECISION)
        else:
            attend_heads(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, o_ptr, tl.program_id(0).to(tl.int64),
                         tl.program_id(1) * HEADS, tl.num_programs(1) * HEADS, stride_qn, stride_ql, stride_qh,
                         stride_kn, stride_kl, stride_kh, stride_vn, stride_vl, stride_vh, stride_cl, stride_sl,
                         seq_len, sm_scale, GROUP, HEADS, HALF, BLOCK_L, ROPE, DOT_PRECISION, "")

    @triton.jit
    def _rotary_rows(cos_ptr, sin_ptr, positions, mask, stride_cl, stride_sl, HALF: tl.constexpr):
        """The rotary table's rows at `positions`, each as two halves: cos1, cos2, sin1, sin2 (fp32)."""
        d = tl.arange(0, HALF)[None, :]
        cb = cos_ptr + positions[:, None] * stride_cl
        sb = sin_ptr + positions[:, None] * stride_sl
        return (tl.load(cb + d, mask=mask, other=0.0), tl.load(cb + HALF + d, mask=mask, other=0.0),
                tl.load(sb + d, mask=mask, other=0.0), tl.load(sb + HALF + d, mask=mask, other=0.0))

    @triton.jit
    def _rotate(x1, x2, c1, c2, s1, s2):
        """The rotary embedding of rows given as two halves, in fp32 rounded to the dtype: what the eager rotary hands
        to attention."""
        x1f, x2f = x1.to(tl.float32), x2.to(tl.float32)
        return (x1f * c1 - x2f * s1).to(x1.dtype), (x2f * c2 + x1f * s2).to(x1.dtype)

    @triton.jit
    def _keys_values(k_ptr, v_ptr, n, hk, stride_kn, stride_kl, stride_kh, stride_vn, stride_vl, stride_vh, seq_len,
                     c1, c2, s1, s2, HALF: tl.constexpr, BLOCK_L: tl.constexpr, ROPE: tl.constexpr,
                     CACHE: tl.constexpr):
        """Sequence n's keys (rotated with the table rows c1..s2 where ROPE) and values of kv head hk, each as two
        halves of the head dimension."""
        rows = tl.arange(0, BLOCK_L)[:, None]
        rmask = rows < seq_len
        d = tl.arange(0, HALF)[None, :]
        kb = k_ptr + n * stride_kn + hk * stride_kh + rows * stride_kl
        vb = v_ptr + n * stride_vn + hk * stride_vh + rows * stride_vl
        k1 = tl.load(kb + d, mask=rmask, other=0.0, cache_modifier=CACHE)
        k2 = tl.load(kb + HALF + d, mask=rmask, other=0.0, cache_modifier=CACHE)
        if ROPE:
            k1, k2 = _rotate(k1, k2, c1, c2, s1, s2)
        v1 = tl.load(vb + d, mask=rmask, other=0.0, cache_modifier=CACHE)
        v2 = tl.load(vb + HALF + d, mask=rmask, other=0.0, cache_modifier=CACHE)
        return k1, k2, v1, v2

    @triton.jit
    def _softmax_values(q1, q2, k1, k2, v1, v2, key_ok, sm_scale, DOT_PRECISION: tl.constexpr):
        """softmax(q k^T * sm_scale) v over the valid keys, q/k/v as two halves of the head dimension; the
        probabilities rounded to the dtype before the second dot."""
        scores = tl.dot(q1, tl.trans(k1), input_precision=DOT_PRECISION)
        scores += tl.dot(q2, tl.trans(k2), input_precision=DOT_PRECISION)
        scores = tl.where(key_ok, scores * sm_scale, float("-inf"))
        p = tl.exp(scores - tl.max(scores, axis=1)[:, None])
        p = (p / tl.sum(p, axis=1)[:, None]).to(v1.dtype)
        return tl.dot(p, v1, input_precision=DOT_PRECISION), tl.dot(p, v2, input_precision=DOT_PRECISION)

    @triton.jit
    def attend_heads(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, o_ptr, n, first_head, num_heads,
                     stride_qn, stride_ql, stride_qh, stride_kn, stride_kl, stride_kh,
                     stride_vn, stride_vl, stride_vh, stride_cl, stride_sl, seq_len, sm_scale,
                     GROUP: tl.constexpr, HEADS: tl.constexpr, HALF: tl.constexpr, BLOCK_L: tl.constexpr,
                     ROPE: tl.constexpr, DOT_PRECISION: tl.constexpr, CACHE: tl.constexpr):
        """Sequence n's attention for query heads first_head .. first_head + HEADS - 1 of one kv head, one after
        another: K, V and the rotary rows are loaded (and K rotated) once for all of them. Output rows
        (n * seq_len + l) of num_heads heads. CACHE: the loads' cache modifier (".cg" where q/k/v were written by
        other programs of the same launch: L1 is not coherent)."""
        rows = tl.arange(0, BLOCK_L)
        rmask = rows[:, None] < seq_len
        d = tl.arange(0, HALF)[None, :]
        c1, c2, s1, s2 = 0.0, 0.0, 0.0, 0.0
        if ROPE:
            c1, c2, s1, s2 = _rotary_rows(cos_ptr, sin_ptr, rows, rmask, stride_cl, stride_sl, HALF)
        k1, k2, v1, v2 = _keys_values(k_ptr, v_ptr, n, first_head // GROUP, stride_kn, stride_kl, stride_kh, stride_vn,
                                      stride_vl, stride_vh, seq_len, c1, c2, s1, s2, HALF, BLOCK_L, ROPE, CACHE)
        key_ok = rows[None, :] < seq_len
        for i in tl.static_range(HEADS):
            h = first_head + i
            qb = q_ptr + n * stride_qn + h * stride_qh + rows[:, None] * stride_ql
            q1 = tl.load(qb + d, mask=rmask, other=0.0, cache_modifier=CACHE)
            q2 = tl.load(qb + HALF + d, mask=rmask, other=0.0, cache_modifier=CACHE)
            if ROPE:
                q1, q2 = _rotate(q1, q2, c1, c2, s1, s2)
            o1, o2 = _softmax_values(q1, q2, k1, k2, v1, v2, key_ok, sm_scale, DOT_PRECISION)
            ob = o_ptr + (n * seq_len + rows[:, None]) * (num_heads * 2 * HALF) + h * (2 * HALF)
            tl.store(ob + d, o1.to(o_ptr.dtype.element_ty), mask=rmask)
            tl.store(ob + HALF + d, o2.to(o_ptr.dtype.element_ty), mask=rmask)

    @triton.jit
    def attend_stacked(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, o_ptr, n, first_head, num_heads,
                       stride_qn, stride_ql, stride_qh, stride_kn, stride_kl, stride_kh,
                       stride_vn, stride_vl, stride_vh, stride_cl, stride_sl, seq_len, sm_scale,
                       GROUP: tl.constexpr, HEADS: tl.constexpr, HALF: tl.constexpr, BLOCK_L: tl.constexpr,
                       ROPE: tl.constexpr, DOT_PRECISION: tl.constexpr):
        """`attend_heads`' result with the HEADS heads' query rows stacked into one (HEADS * BLOCK_L)-row tile (row
        r: head first_head + r // BLOCK_L at position r % BLOCK_L): one pair of dots for all of them. The rotary rows
        are loaded once and broadcast over the heads. Plain loads: not for q/k/v written in the same launch (the
        layer kernel's, which needs `attend_heads`' ".cg")."""
        rows = tl.arange(0, BLOCK_L)
        rmask = rows[:, None] < seq_len
        c1, c2, s1, s2 = 0.0, 0.0, 0.0, 0.0
        if ROPE:
            c1, c2, s1, s2 = _rotary_rows(cos_ptr, sin_ptr, rows, rmask, stride_cl, stride_sl, HALF)
        k1, k2, v1, v2 = _keys_values(k_ptr, v_ptr, n, first_head // GROUP, stride_kn, stride_kl, stride_kh, stride_vn,
                                      stride_vl, stride_vh, seq_len, c1, c2, s1, s2, HALF, BLOCK_L, ROPE, "")
        h3 = first_head + tl.arange(0, HEADS)[:, None, None]
        l3 = rows[None, :, None]
        d3 = tl.arange(0, HALF)[None, None, :]
        qb = q_ptr + n * stride_qn + h3 * stride_qh + l3 * stride_ql + d3
        q1 = tl.load(qb, mask=l3 < seq_len, other=0.0)
        q2 = tl.load(qb + HALF, mask=l3 < seq_len, other=0.0)
        if ROPE:
            q1, q2 = _rotate(q1, q2, c1[None, :, :], c2[None, :, :], s1[None, :, :], s2[None, :, :])
        q1 = tl.reshape(q1, (HEADS * BLOCK_L, HALF))
        q2 = tl.reshape(q2, (HEADS * BLOCK_L, HALF))
        o1, o2 = _softmax_values(q1, q2, k1, k2, v1, v2, rows[None, :] < seq_len, sm_scale, DOT_PRECISION)
        r = tl.arange(0, HEADS * BLOCK_L)[:, None]
        pos = r % BLOCK_L
        d = tl.arange(0, HALF)[None, :]
        ob = o_ptr + (n * seq_len + pos) * (num_heads * 2 * HALF) + (first_head + r // BLOCK_L) * (2 * HALF) + d
        tl.store(ob, o1.to(o_ptr.dtype.element_ty), mask=pos < seq_len)
        tl.store(ob + HALF, o2.to(o_ptr.dtype.element_ty), mask=pos < seq_len)


MAX_DENSE_LEN = 64  # longest sequence `dense_attention` takes (LocEnc: patch + 1, DiT: 2 * patch + 3)


def dense_attention_supported(q: torch.Tensor, k: torch.Tensor) -> bool:
    dim = q.shape[-1]
    return (q.dim() == 4 and q.shape[1] <= MAX_DENSE_LEN and dim >= 32 and dim & (dim - 1) == 0
            and q.shape[2] % k.shape[2] == 0 and q.dtype in (torch.float32, torch.float16, torch.bfloat16))


def dense_attention_heads(sequences: int, heads: int, group: int, seq_len: int) -> int:
    """`dense_attention`'s default query heads per program, stacked into one tile: a whole GQA group (its largest
    power-of-two divisor: a tile's rows are a power of two), halved while the tile would pass 128 rows or fewer than
    8 programs would run. On an H200 (`tools/bench.py kernels --only attention`, 2026-11-29) a whole group stacked
    on 4 warps was the fastest of every variant swept from B=64 to 256 (DiT B=128 11.8 against 17.9 us for the best
    loop over heads, B=256 27.7 against 38.3; LocEnc B=128 6.5 against 11.4); at B=1, half a group."""
    per_program = group & -group
    while per_program % 2 == 0 and (per_program * dense_block(seq_len) > 128
                                    or sequences * heads // per_program < 8):
        per_program //= 2
    return per_program


def dense_block(seq_len: int) -> int:
    """The rows of one head's tile of queries (stacked: of each head's part of the tile), and of the keys'."""
    return max(16, 1 << (seq_len - 1).bit_length())


DENSE_ATTENTION_WARPS = 4  # the stacked tile's best at every batch swept (2 and 8 slower, 1 spills)


def dense_attention_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor | None,
                           sin: torch.Tensor | None, heads_per_program: int | None = None,
                           num_warps: int | None = None, stacked: bool = True) -> torch.Tensor:
    """Bidirectional attention within each sequence: q (N, L, Hq, D), k/v (N, L, Hk, D) (unit stride in D),
    rotary rows cos/sin (L, D) fp32 applied to q and k first (None: no rotary) -> (N, L, Hq * D).
    heads_per_program: query heads sharing one program (and one load of K/V); None: `dense_attention_heads`.
    num_warps: None: `DENSE_ATTENTION_WARPS`. stacked: a program's heads as one tile of query rows (`attend_stacked`,
    where their count is a power of two) or one after another (`attend_heads`). `tools/bench.py kernels --only
    attention` sweeps all three."""
    n, seq_len, hq, dim = q.shape
    group = hq // k.shape[2]
    heads = math.gcd(heads_per_program or dense_attention_heads(n, hq, group, seq_len), group)  # one kv head each
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
            BLOCK_L=dense_block(seq_len), ROPE=rope,
            DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
            STACKED=stacked and heads & (heads - 1) == 0,  # a stacked tile's rows: a power of two
            num_warps=num_warps or DENSE_ATTENTION_WARPS)
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
        # Batch-invariant: one head per program (by default the heads follow the batch's size below 8 programs).
        fixed = q.is_cuda and batch_invariant("cuda")
        return dense_attention_triton(q, k, v, cos, sin, *((1, 4, False) if fixed else ()))
    return dense_attention_eager(q, k, v, rope)
