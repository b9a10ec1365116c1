"""The rotary embedding of q and k, alone or together with the K/V write into the paged cache.

Every Triton-backend step (decode and prefill) rotates k and writes it and v straight into their cache slots in one
kernel, instead of the rotary and two scatters per layer. `rotate_row` is shared with the attention kernels, which
rotate on load. The math is the eager expression in fp32, rounded to the dtype.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.ops import platform
from engine.ops.platform import HAVE_TRITON

if TYPE_CHECKING:
    import torch
else:
    from engine.lazy_torch import torch  # the kernel-compiling children never load it

if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def rotate_row(src, dst, cos_row, sin_row, HALF: tl.constexpr):
        """One head's rotary embedding in fp32 (x * cos + rotate_half(x) * sin), rounded to the input dtype."""
        d = tl.arange(0, HALF)
        c1, c2 = tl.load(cos_row + d), tl.load(cos_row + HALF + d)
        s1, s2 = tl.load(sin_row + d), tl.load(sin_row + HALF + d)
        x1 = tl.load(src + d)
        x2 = tl.load(src + HALF + d)
        x1f, x2f = x1.to(tl.float32), x2.to(tl.float32)
        tl.store(dst + d, (x1f * c1 - x2f * s1).to(x1.dtype))
        tl.store(dst + HALF + d, (x2f * c2 + x1f * s2).to(x1.dtype))

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
        rotate_row(src, dst, cos_ptr + t * stride_ct, sin_ptr + t * stride_st, HALF)

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
            rotate_row(q_ptr + t * stride_qt + (h + HQ) * stride_qh, q_out_ptr + (t * HQ + h + HQ) * (2 * HALF),
                        cos_row, sin_row, HALF)
        elif h < HK:
            src, dst = k_ptr + t * stride_kt + h * stride_kh, k_cache_ptr + slot_row + h * (2 * HALF)
            if ROPE:
                rotate_row(src, dst, cos_row, sin_row, HALF)
            else:
                e = tl.arange(0, 2 * HALF)
                tl.store(dst + e, tl.load(src + e))
        else:
            e = tl.arange(0, 2 * HALF)
            hv = h - HK
            tl.store(v_cache_ptr + slot_row + hv * (2 * HALF) + e, tl.load(v_ptr + t * stride_vt + hv * stride_vh + e))


def rotary_supported(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    half = q.shape[-1] // 2
    return (q.dim() == 3 and k.dim() == 3 and half >= 1 and half & (half - 1) == 0 and q.stride(-1) == 1
            and k.stride(-1) == 1 and cos.dim() == 2 and sin.dim() == 2 and cos.stride(-1) == sin.stride(-1) == 1
            and cos.shape == sin.shape == (q.shape[0], q.shape[-1]) and k.shape[0] == q.shape[0]
            and k.shape[-1] == q.shape[-1])


def rotary_store_supported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                           v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> bool:
    half = q.shape[-1] // 2
    return (q.dim() == k.dim() == v.dim() == 3 and half >= 1 and half & (half - 1) == 0
            and q.stride(-1) == k.stride(-1) == v.stride(-1) == 1 and k.shape == v.shape
            and k.shape[0] == q.shape[0] and k.shape[-1] == q.shape[-1] and k_cache.is_contiguous()
            and v_cache.is_contiguous() and k_cache.shape[-2:] == k.shape[-2:] == v_cache.shape[-2:]
            and k_cache.dtype == v_cache.dtype == k.dtype == v.dtype
            and slot_mapping.dtype == torch.int64 and slot_mapping.is_contiguous())


def rotary_qk_triton(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
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


def rotary_store_kv_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor | None,
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


def rotary_eager(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (..., L, heads, head_dim); cos/sin: (L, head_dim) fp32, broadcast over heads; applied in fp32."""
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return (xf * cos.unsqueeze(-2) + rotated * sin.unsqueeze(-2)).to(x.dtype)


def rotary_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
              sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding of queries and keys (one kernel for both on CUDA)."""
    if platform.kernels(q) and rotary_supported(q, k, cos, sin):
        return rotary_qk_triton(q, k, cos, sin)
    return rotary_eager(q, cos, sin), rotary_eager(k, cos, sin)


def rotary_store_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rope: torch.Tensor | None,
                    k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor | None:
    """A causal layer's rotary embedding (rope (T, 2, D) rows, or None) and K/V cache write as one kernel; returns
    the rotated q, or None where the kernel does not apply (the caller then rotates and scatters itself)."""
    if not (platform.kernels(q) and rotary_store_supported(q, k, v, k_cache, v_cache, slot_mapping)):
        return None
    if rope is not None and not rotary_supported(q, k, rope[..., 0, :], rope[..., 1, :]):
        return None
    cos, sin = (rope[..., 0, :], rope[..., 1, :]) if rope is not None else (None, None)
    return rotary_store_kv_triton(q, k, v, cos, sin, k_cache, v_cache, slot_mapping)

