"""Causal attention over the paged KV cache as one Triton kernel (CUDA; CPU only through TRITON_INTERPRET=1).

Every query token is independent: it attends to cached positions 0..context_len-1 of its sequence, found
through that sequence's block table row. So one kernel serves decode (one query per sequence, context = length)
and prefill (each new token at position p with context p + 1, cached prefix or not).

Grid (T, num_kv_heads): a program takes the G = num_heads // num_kv_heads query heads sharing one kv head
(padded to >= 16 rows so `tl.dot` applies), walks the keys in tiles of BLOCK_N tokens with an online softmax in
fp32, and writes the G output rows. Each token of a tile looks up its own physical block, so a tile may span
several cache blocks (or part of one) and BLOCK_N is independent of the cache's block size.

Capturable in a CUDA graph: the grid depends only on shapes, all per-sequence data is read on the device, nothing
is synchronised or allocated from data values. Compile (call once) before capturing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
else:
    from engine.lazy_torch import torch  # the kernel-compiling children never load it

try:  # triton is absent on e.g. macOS; the module must still import there
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # pragma: no cover - depends on the platform
    HAVE_TRITON = False

_LOG2E = 1.4426950408889634
# Keys per tile, by element size. Measured on an H200 (16 heads / 2 kv heads / head_dim 128, 4 warps, 2 stages):
# 16-bit decode of 64 sequences x 1000 tokens took 36 us with 128-key tiles vs 46 us with 64; fp32 128-key tiles
# spill registers (10x slower), so fp32 uses 64.
_BLOCK_N = {2: 128, 4: 64}
_NUM_WARPS = 4
_NUM_STAGES = 2

if HAVE_TRITON:

    @triton.jit
    def _paged_attention_kernel(
        q_ptr, k_ptr, v_ptr, out_ptr, block_tables_ptr, row_index_ptr, context_lens_ptr,
        stride_qt, stride_qh, stride_ot, stride_oh,
        stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
        qk_scale,  # softmax scale * log2(e): scores live in the exp2 domain
        G: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, DOT_PRECISION: tl.constexpr,
    ):
        t = tl.program_id(0).to(tl.int64)
        kv_head = tl.program_id(1)
        row = tl.load(row_index_ptr + t).to(tl.int64)
        ctx = tl.load(context_lens_ptr + t)

        offs_g = tl.arange(0, BLOCK_G)
        offs_d = tl.arange(0, HEAD_DIM)
        offs_n = tl.arange(0, BLOCK_N)
        g_mask = offs_g < G
        heads = kv_head * G + offs_g  # the query heads of this kv head (GQA)

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
        for start in range(0, ctx, BLOCK_N):
            pos = start + offs_n
            valid = pos < ctx
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

        # ctx == 0 (e.g. padding rows of a captured batch): acc is 0, so the output is 0, not 0/0.
        out = acc / tl.where(l > 0.0, l, 1.0)[:, None]
        tl.store(out_ptr + t * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=g_mask[:, None])


def _is_interpreted() -> bool:
    return type(_paged_attention_kernel).__name__ == "InterpretedFunction"


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    row_index: torch.Tensor, context_lens: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """q: (T, num_heads, head_dim), one row per query token (any number of tokens per sequence).
    block_tables: (R, W) int32 (entries past a sequence's blocks may be anything, e.g. -1 or 0; never read).
    row_index: (T,) int32, which block_tables row each query token belongs to.
    context_lens: (T,) int32, how many cached tokens (positions 0..n-1) this query token attends to
    (for causal prefill of a token at position p this is p + 1; for decode it is the sequence length).
    Returns (T, num_heads, head_dim) in q's dtype. GQA: num_heads is a multiple of num_kv_heads; query head h uses
    kv head h // (num_heads // num_kv_heads). scale defaults to head_dim ** -0.5."""
    if not HAVE_TRITON:
        raise RuntimeError("paged_attention needs triton, which is not importable here; use the torch attention path")
    if not q.is_cuda and not _is_interpreted():
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
    scale = head_dim ** -0.5 if scale is None else scale
    grid = (num_tokens, num_kv_heads)
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, out, block_tables, row_index, context_lens,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
        scale * _LOG2E,
        G=group, BLOCK_G=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim, BLOCK_N=_BLOCK_N[q.element_size()],
        BLOCK_SIZE=block_size,
        # fp32 caches get exact fp32 dots (tf32 would cost ~1e-3 relative error); bf16/fp16 use tensor cores
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=_NUM_WARPS, num_stages=_NUM_STAGES,
    )
    return out
