"""Causal attention over the paged KV cache as one Triton kernel (CUDA; CPU only through TRITON_INTERPRET=1).

Every query token is independent: it attends to cached positions 0..context_len-1 of its sequence, found
through that sequence's block table row. So one kernel serves decode (one query per sequence, context = length)
and prefill (each new token at position p with context p + 1, cached prefix or not).

Grid (T, num_kv_heads): a program takes the G = num_heads // num_kv_heads query heads sharing one kv head
(padded to >= 16 rows so `tl.dot` applies), walks the keys in tiles of BLOCK_N tokens with an online softmax in
fp32, and writes the G output rows. Each token of a tile looks up its own physical block, so a tile may span
several cache blocks (or part of one) and BLOCK_N is independent of the cache's block size.

Split along the keys (flash-decoding) when T * num_kv_heads programs would leave most SMs idle (a decode step of a
few sequences): grid (T, num_kv_heads, splits), each program takes SPLIT_KEYS consecutive keys of its token's context
and stores its partial softmax (running max, sum, unnormalised output) in fp32; the last of a row's active splits to
finish (an arrival counter per (token, kv head), reset by that program) combines them in split order, so the result
does not depend on which program finishes last. A decode step's attention then costs about one tile's latency plus
the combine, instead of one tile per SPLIT_KEYS keys of context one after another. Such a decode also takes the
new token's q/k/v unrotated (`decode_attention`): the programs rotate their q heads, and the split holding the token's
own position writes its rotated k and its v to the cache first, in place of a separate rotary-and-store kernel.

Capturable in a CUDA graph: the grid depends only on shapes, all per-sequence data is read on the device, nothing
is synchronised or allocated from data values. Compile (call once) before capturing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.ops import pdl, rotary
from engine.ops.platform import HAVE_TRITON, interpreted
from engine.options import current

if TYPE_CHECKING:
    import torch
else:
    from engine.lazy_torch import torch  # the kernel-compiling children never load it

_LOG2E = 1.4426950408889634
# Keys per tile, by element size: 128-key tiles are the faster for 16-bit caches; fp32 ones that large spill
# registers, so fp32 uses 64.
_BLOCK_N = {2: 128, 4: 64}
_NUM_WARPS = 4
_NUM_STAGES = 2
# The largest number of (token, kv head) rows a call may have for splitting its keys (EngineOptions.attn_split_keys
# per program): more rows already spread over the SMs.
SPLIT_MAX_ROWS = 64
# Per device: the split rows' arrival counters, all 0 between launches. One set per device, so split launches must not
# run concurrently on two streams of one device (the engine runs its LMs on one stream; the VAE's has no attention).
_counters: dict[object, torch.Tensor] = {}

if HAVE_TRITON:
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import gdc_wait

    from engine.ops.rotary import rotate_row

    @triton.jit
    def _paged_attention_kernel(
        q_ptr, k_ptr, v_ptr, out_ptr, block_tables_ptr, row_index_ptr, context_lens_ptr, part_ptr, count_ptr,
        new_k_ptr, new_v_ptr, slot_ptr, cos_ptr, sin_ptr,
        stride_qt, stride_qh, stride_ot, stride_oh,
        stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
        stride_nkt, stride_nkh, stride_nvt, stride_nvh, stride_ct, stride_st,
        qk_scale,  # softmax scale * log2(e): scores live in the exp2 domain
        G: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, DOT_PRECISION: tl.constexpr, SPLIT_KEYS: tl.constexpr, NEW_KV: tl.constexpr,
        ROPE: tl.constexpr, PDL: tl.constexpr,
    ):
        # SPLIT_KEYS > 0: program_id(2) is this program's split; part_ptr holds per (token, kv head, split) the partial
        # [max (BLOCK_G), sum (BLOCK_G), output (BLOCK_G x HEAD_DIM)] in fp32; count_ptr the rows' arrival counters.
        # NEW_KV (a decode step, with SPLIT_KEYS): q, new_k and new_v are each token's projections, not yet rotated
        # (ROPE: cos/sin rows per token) nor stored: every program rotates its q heads, and the split that reads the
        # token's own position (the last) first writes its k (rotated) and v to the token's slot (`rotary_store_kv`'s
        # work, without its kernel).
        t = tl.program_id(0).to(tl.int64)
        kv_head = tl.program_id(1)
        # The step's inputs (rows, lengths, block tables) and the cache's earlier keys are written by no kernel of the
        # PDL chain, so they may be read before its wait; q/k/v (the kernel before's output) only after it.
        row = tl.load(row_index_ptr + t).to(tl.int64)
        ctx = tl.load(context_lens_ptr + t)
        if PDL:  # engine/ops/pdl.py. No early start for the next kernel: its weight stream would delay these loads.
            if SPLIT_KEYS > 0:  # this split's first tile of cached keys and values into L2 while waiting
                _prefetch_tile(k_ptr + kv_head * stride_kh, v_ptr + kv_head * stride_vh,
                               block_tables_ptr + row * stride_bt, tl.program_id(2) * SPLIT_KEYS, ctx - 1, stride_kb,
                               stride_ks, stride_vb, stride_vs, HEAD_DIM, BLOCK_N, BLOCK_SIZE)
            gdc_wait()
        if SPLIT_KEYS > 0:
            split = tl.program_id(2)
            lo = split * SPLIT_KEYS
            hi = tl.minimum(ctx, lo + SPLIT_KEYS)
            # a row of context 0 still writes its zero output; never more splits than the grid has (a context past
            # the tables' capacity would otherwise leave its row's counter unreset for every later launch)
            active = tl.minimum(tl.maximum(tl.cdiv(ctx, SPLIT_KEYS), 1), tl.num_programs(2))
        else:
            split = 0
            lo = 0
            hi = ctx
            active = 1
        if split < active:
            if NEW_KV:
                _new_token(q_ptr, k_ptr, v_ptr, part_ptr, new_k_ptr, new_v_ptr, slot_ptr, cos_ptr, sin_ptr, t, kv_head,
                           split, active, stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs,
                           stride_vh, stride_nkt, stride_nkh, stride_nvt, stride_nvh, stride_ct, stride_st, G, BLOCK_G,
                           HEAD_DIM, BLOCK_SIZE, ROPE)
            _attend_keys(q_ptr, k_ptr, v_ptr, out_ptr, block_tables_ptr, part_ptr, count_ptr, t, kv_head, row, lo,
                         hi, split, active, stride_qt, stride_qh, stride_ot, stride_oh, stride_kb, stride_ks, stride_kh,
                         stride_vb, stride_vs, stride_vh, stride_bt, qk_scale, G, BLOCK_G, HEAD_DIM, BLOCK_N,
                         BLOCK_SIZE, DOT_PRECISION, SPLIT_KEYS, NEW_KV)

    @triton.jit
    def prefetch_l2(ptrs):
        """`prefetch.global.L2` of the 128-byte line of every pointer: nothing held, nothing waited for."""
        tl.inline_asm_elementwise("prefetch.global.L2 [$1];", "=r,l", [ptrs], dtype=tl.int32, is_pure=False, pack=1)

    @triton.jit
    def _prefetch_tile(k_head, v_head, bt_row, lo, hi, stride_kb, stride_ks, stride_vb, stride_vs,
                       HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr):
        # The 128-byte lines of keys and values lo..hi-1 (at most a tile) into L2.
        LINE: tl.constexpr = 1024 // k_head.dtype.element_ty.primitive_bitwidth  # elements per 128-byte line
        pos = lo + tl.arange(0, BLOCK_N)
        valid = pos < hi
        block = tl.load(bt_row + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        slot = (pos % BLOCK_SIZE).to(tl.int64)
        lines = tl.arange(0, max(HEAD_DIM // LINE, 1)) * LINE
        k_lines = tl.where(valid[:, None], k_head + block[:, None] * stride_kb + slot[:, None] * stride_ks
                           + lines[None, :], k_head)
        v_lines = tl.where(valid[:, None], v_head + block[:, None] * stride_vb + slot[:, None] * stride_vs
                           + lines[None, :], v_head)
        prefetch_l2(k_lines)
        prefetch_l2(v_lines)

    @triton.jit
    def _new_token(q_ptr, k_ptr, v_ptr, part_ptr, new_k_ptr, new_v_ptr, slot_ptr, cos_ptr, sin_ptr, t, kv_head, split,
                   active, stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                   stride_nkt, stride_nkh, stride_nvt, stride_nvh, stride_ct, stride_st, G: tl.constexpr,
                   BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, ROPE: tl.constexpr):
        # This program's q heads rotated into the output area of its partial (`_scratch_q`, overwritten at the end),
        # and, by the last split, the token's k (rotated) and v into its cache slot.
        HALF: tl.constexpr = HEAD_DIM // 2
        q_rot = _scratch_q(part_ptr, t, kv_head, split, BLOCK_G, HEAD_DIM)
        cos_row, sin_row = cos_ptr + t * stride_ct, sin_ptr + t * stride_st
        e = tl.arange(0, HEAD_DIM)
        for g in tl.static_range(G):
            src = q_ptr + t * stride_qt + (kv_head * G + g) * stride_qh
            if ROPE:
                rotate_row(src, q_rot + g * HEAD_DIM, cos_row, sin_row, HALF)
            else:
                tl.store(q_rot + g * HEAD_DIM + e, tl.load(src + e).to(tl.float32))
        if split == active - 1:
            slot = tl.load(slot_ptr + t)
            block, offset = slot // BLOCK_SIZE, slot % BLOCK_SIZE
            k_dst = k_ptr + block * stride_kb + offset * stride_ks + kv_head * stride_kh
            k_src = new_k_ptr + t * stride_nkt + kv_head * stride_nkh
            if ROPE:
                rotate_row(k_src, k_dst, cos_row, sin_row, HALF)
            else:
                tl.store(k_dst + e, tl.load(k_src + e))
            tl.store(v_ptr + block * stride_vb + offset * stride_vs + kv_head * stride_vh + e,
                     tl.load(new_v_ptr + t * stride_nvt + kv_head * stride_nvh + e))
        tl.debug_barrier()  # all of it stored before any thread of the program reads it back

    @triton.jit
    def _scratch_q(part_ptr, t, kv_head, split, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr):
        PART: tl.constexpr = BLOCK_G * (HEAD_DIM + 2)
        return part_ptr + ((t * tl.num_programs(1) + kv_head) * tl.num_programs(2) + split) * PART + 2 * BLOCK_G

    @triton.jit
    def _attend_keys(q_ptr, k_ptr, v_ptr, out_ptr, block_tables_ptr, part_ptr, count_ptr, t, kv_head, row, lo, hi,
                     split, active, stride_qt, stride_qh, stride_ot, stride_oh, stride_kb, stride_ks, stride_kh,
                     stride_vb, stride_vs, stride_vh, stride_bt, qk_scale, G: tl.constexpr, BLOCK_G: tl.constexpr,
                     HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                     DOT_PRECISION: tl.constexpr, SPLIT_KEYS: tl.constexpr, NEW_KV: tl.constexpr):
        # keys lo..hi-1 of one token's context for the query heads of one kv head; the output, or this split's partial
        offs_g = tl.arange(0, BLOCK_G)
        offs_d = tl.arange(0, HEAD_DIM)
        offs_n = tl.arange(0, BLOCK_N)
        g_mask = offs_g < G
        heads = kv_head * G + offs_g  # the query heads of this kv head (GQA)

        if NEW_KV:  # q rotated by `_new_token`, in fp32 scratch (the dot's operand dtype is the cache's)
            q = tl.load(_scratch_q(part_ptr, t, kv_head, split, BLOCK_G, HEAD_DIM) + offs_g[:, None] * HEAD_DIM
                        + offs_d[None, :], mask=g_mask[:, None], other=0.0).to(k_ptr.dtype.element_ty)
        else:
            q = tl.load(q_ptr + t * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                        mask=g_mask[:, None], other=0.0)

        m = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
        l = tl.zeros([BLOCK_G], dtype=tl.float32)
        acc = tl.zeros([BLOCK_G, HEAD_DIM], dtype=tl.float32)

        bt_row = block_tables_ptr + row * stride_bt
        k_head = k_ptr + kv_head * stride_kh
        v_head = v_ptr + kv_head * stride_vh
        # Only tiles holding at least one valid key: block table entries past the sequence are never read, and
        # every visited tile has a finite max, so m never stays -inf inside the loop.
        for start in range(lo, hi, BLOCK_N):
            pos = start + offs_n
            valid = pos < hi
            block = tl.load(bt_row + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
            slot = (pos % BLOCK_SIZE).to(tl.int64)
            # Masked loads: slots past ctx may hold stale or uninitialised data (even NaN), and 0 * NaN = NaN in p @ v.
            k = tl.load(k_head + block[:, None] * stride_kb + slot[:, None] * stride_ks + offs_d[None, :],
                        mask=valid[:, None], other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
            s = tl.where(valid[None, :], s, float("-inf"))

            m_new = tl.maximum(m, tl.max(s, axis=1))
            p = tl.math.exp2(s - m_new[:, None])
            alpha = tl.math.exp2(m - m_new)  # 0 on the first tile (m = -inf)
            l = l * alpha + tl.sum(p, axis=1)

            v = tl.load(v_head + block[:, None] * stride_vb + slot[:, None] * stride_vs + offs_d[None, :],
                        mask=valid[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            m = m_new

        out_ptrs = out_ptr + t * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
        if active == 1:
            # ctx == 0 (e.g. padding rows of a captured batch): acc is 0, so the output is 0, not 0/0.
            out = acc / tl.where(l > 0.0, l, 1.0)[:, None]
            tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=g_mask[:, None])
        elif SPLIT_KEYS > 0:
            if NEW_KV:
                tl.debug_barrier()  # every thread done reading q from the scratch the partial's output overwrites
            PART: tl.constexpr = BLOCK_G * (HEAD_DIM + 2)
            row_parts = part_ptr + (t * tl.num_programs(1) + kv_head) * tl.num_programs(2) * PART
            mine = row_parts + split * PART
            tl.store(mine + offs_g, m)
            tl.store(mine + BLOCK_G + offs_g, l)
            tl.store(mine + 2 * BLOCK_G + offs_g[:, None] * HEAD_DIM + offs_d[None, :], acc)
            counter = count_ptr + t * tl.num_programs(1) + kv_head
            tl.debug_barrier()  # every thread's partial stored before the arrival is published
            if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == active - 1:
                tl.debug_barrier()
                # The last split of the row: the partials combined in split order (exp2 domain, as in the loop).
                m_all = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
                for j in range(active):
                    m_all = tl.maximum(m_all, tl.load(row_parts + j * PART + offs_g, cache_modifier=".cg"))
                l_all = tl.zeros([BLOCK_G], dtype=tl.float32)
                acc_all = tl.zeros([BLOCK_G, HEAD_DIM], dtype=tl.float32)
                for j in range(active):
                    part = row_parts + j * PART
                    w = tl.math.exp2(tl.load(part + offs_g, cache_modifier=".cg") - m_all)
                    l_all += tl.load(part + BLOCK_G + offs_g, cache_modifier=".cg") * w
                    acc_all += tl.load(part + 2 * BLOCK_G + offs_g[:, None] * HEAD_DIM + offs_d[None, :],
                                       cache_modifier=".cg") * w[:, None]
                tl.store(out_ptrs, (acc_all / l_all[:, None]).to(out_ptr.dtype.element_ty), mask=g_mask[:, None])
                tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")  # ready for the next launch


def split_keys_for(num_tokens: int, num_kv_heads: int, table_keys: int) -> int:
    """Keys per program of a call with these rows and block tables of `table_keys` slots, 0 for no split. The splits
    cover the longest context the tables can hold (the grid may not depend on the lengths, which live on the device);
    splits past a token's context end at once."""
    split_keys = current().attn_split_keys
    if split_keys <= 0 or table_keys <= split_keys or num_tokens * num_kv_heads > SPLIT_MAX_ROWS:
        return 0
    return split_keys


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    row_index: torch.Tensor, context_lens: torch.Tensor, scale: float | None = None,
                    new_kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                    rope: torch.Tensor | None = None) -> torch.Tensor:
    """q: (T, num_heads, head_dim), one row per query token (any number of tokens per sequence).
    block_tables: (R, W) int32 (entries past a sequence's blocks may be anything, e.g. -1 or 0; never read).
    row_index: (T,) int32, which block_tables row each query token belongs to.
    context_lens: (T,) int32, how many cached tokens (positions 0..n-1) this query token attends to
    (for causal prefill of a token at position p this is p + 1; for decode it is the sequence length).
    Returns (T, num_heads, head_dim) in q's dtype. GQA: num_heads is a multiple of num_kv_heads; query head h uses
    kv head h // (num_heads // num_kv_heads). scale defaults to head_dim ** -0.5. new_kv / rope: see
    `decode_attention` (q then not yet rotated, the new K/V not yet in the cache)."""
    if not HAVE_TRITON:
        raise RuntimeError("paged_attention needs triton, which is not importable here; use the torch attention path")
    if not q.is_cuda and not interpreted():
        raise RuntimeError("paged_attention runs on CUDA tensors (CPU only with TRITON_INTERPRET=1 set before import)")

    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, cache_head_dim = k_cache.shape
    assert v_cache.shape == k_cache.shape, f"k_cache {tuple(k_cache.shape)} != v_cache {tuple(v_cache.shape)}"
    assert cache_head_dim == head_dim, f"q head_dim {head_dim} != cache head_dim {cache_head_dim}"
    assert head_dim >= 16 and head_dim & (head_dim - 1) == 0, f"head_dim must be a power of two >= 16, got {head_dim}"
    assert num_heads % num_kv_heads == 0, f"num_heads {num_heads} not a multiple of num_kv_heads {num_kv_heads}"
    assert q.dtype == k_cache.dtype == v_cache.dtype, f"dtypes differ: {q.dtype}, {k_cache.dtype}, {v_cache.dtype}"
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1, "cache head_dim must be contiguous"
    assert block_tables.dim() == 2 and block_tables.stride(1) == 1, "block_tables must be (R, W) with unit stride"
    assert row_index.shape == (num_tokens,) and context_lens.shape == (num_tokens,)
    if q.stride(-1) != 1:  # views of a fused projection keep unit stride; anything else is copied
        q = q.contiguous()

    out = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return out
    group = num_heads // num_kv_heads
    block_g = max(16, triton.next_power_of_2(group))
    scale = head_dim ** -0.5 if scale is None else scale
    block_n = _BLOCK_N[q.element_size()]
    split_keys = split_keys_for(num_tokens, num_kv_heads, block_tables.shape[1] * block_size)
    splits = triton.cdiv(block_tables.shape[1] * block_size, split_keys) if split_keys else 1
    if split_keys:
        block_n = min(block_n, split_keys)
        parts = torch.empty((num_tokens, num_kv_heads, splits, block_g * (head_dim + 2)), dtype=torch.float32,
                            device=q.device)
        counters = _counters.get(q.device)
        if counters is None:
            if q.is_cuda and torch.cuda.is_current_stream_capturing():
                raise RuntimeError("paged_attention: the first split launch on a device inside a CUDA-graph capture "
                                   "(its counters must be zeroed outside it: run the call once before capturing)")
            counters = _counters[q.device] = torch.zeros(SPLIT_MAX_ROWS, dtype=torch.int32, device=q.device)
        assert num_tokens * num_kv_heads <= counters.numel()  # split_keys_for's bound
    else:
        splits, parts, counters = 1, out, row_index  # not read
    if new_kv is not None:
        assert split_keys, "the new tokens' K/V are stored by the split kernel only (decode_attention checks)"
        new_k, new_v, slot_mapping = new_kv
        cos, sin = (rope[:, 0], rope[:, 1]) if rope is not None else (new_k, new_k)  # not read without rotary
    else:
        new_k = new_v = slot_mapping = cos = sin = row_index  # not read
    chained = pdl.launch(q, num_tokens)
    _paged_attention_kernel[(num_tokens, num_kv_heads, splits)](
        q, k_cache, v_cache, out, block_tables, row_index, context_lens, parts, counters,
        new_k, new_v, slot_mapping, cos, sin,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
        *((new_k.stride(0), new_k.stride(1), new_v.stride(0), new_v.stride(1)) if new_kv is not None else (0,) * 4),
        *((cos.stride(0), sin.stride(0)) if new_kv is not None and rope is not None else (0, 0)),
        scale * _LOG2E,
        G=group, BLOCK_G=block_g, HEAD_DIM=head_dim, BLOCK_N=block_n, BLOCK_SIZE=block_size,
        # fp32 caches get exact fp32 dots (tf32 would cost ~1e-3 relative error); bf16/fp16 use tensor cores
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", SPLIT_KEYS=split_keys,
        NEW_KV=new_kv is not None, ROPE=new_kv is not None and rope is not None, PDL=chained,
        num_warps=_NUM_WARPS, num_stages=_NUM_STAGES, **pdl.option(chained),
    )
    return out


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rope: torch.Tensor | None,
                     k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                     block_tables: torch.Tensor, row_index: torch.Tensor,
                     context_lens: torch.Tensor) -> torch.Tensor | None:
    """A decode step's attention with the new tokens' rotary embedding (rope (T, 2, D) fp32 rows, or None) and
    K/V cache write inside the split kernel: q (T, Hq, D), k/v (T, Hk, D) the token's projections (unit stride in D),
    one new token per row at position context_lens - 1 (a decode step: no other row of the call may read that
    position, so several tokens of one sequence in one call are not allowed), slot_mapping (T,) int64 its flat cache
    slot. None where it does not apply (keys not split for this call, or layouts it does not take: those of the
    separate rotary + K/V write kernel, and this kernel's q layouts): the caller then rotates and stores first
    (`rotary.rotary_store_kv`) and calls `paged_attention`."""
    if not (HAVE_TRITON and (q.is_cuda or interpreted())):
        return None
    if not rotary.rotary_store_supported(q, k, v, k_cache, v_cache, slot_mapping):
        return None
    if rope is not None and not rotary.rotary_supported(q, k, rope[..., 0, :], rope[..., 1, :]):
        return None
    t, _, dim = q.shape
    hk, block_size = k_cache.shape[-2], k_cache.shape[1]
    if not split_keys_for(t, hk, block_tables.shape[1] * block_size):
        return None
    if not (q.dtype == k_cache.dtype and dim >= 16 and q.shape[1] % hk == 0):
        return None
    return paged_attention(q, k_cache, v_cache, block_tables, row_index, context_lens, new_kv=(k, v, slot_mapping),
                           rope=rope)
