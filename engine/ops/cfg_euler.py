"""The flow sampler's Euler step with CFG-zero* guidance, and the DiT evaluation's input and output around it.

Each of the 9 Euler steps of a patch runs the DiT on the conditional and unconditional halves; on CUDA the input
rows (leading tokens + in_proj of the noisy patch for both halves), and the output projection together with the
guided step, are one kernel each instead of copies, concatenations, a GEMM and the step's element-wise ops.
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

    @triton.jit(do_not_specialize=["batch"])
    def _dit_output_euler_kernel(h_ptr, w_ptr, b_ptr, x_ptr, cfg_ptr, o_ptr, batch, dt, stride_hn,
                                 stride_ht, D: tl.constexpr, P: tl.constexpr, H: tl.constexpr, BLOCK_D: tl.constexpr,
                                 BLOCK_P: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr):
        """One row b: the conditional and unconditional velocities out_proj(h[b or batch + b]) (rounded
        as the eager linear of a strided input rounds), then `cfg_euler_step`'s update of x[b]."""
        b = tl.program_id(0).to(tl.int64)
        d = tl.arange(0, BLOCK_D)
        p = tl.arange(0, BLOCK_P)
        k = tl.arange(0, BLOCK_K)
        dtype = o_ptr.dtype.element_ty
        w_rows = w_ptr + d[:, None] * H + k[None, :]
        hc = h_ptr + b * stride_hn + p[None, :] * stride_ht + k[:, None]
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


def cfg_euler_step_triton(x: torch.Tensor, v: torch.Tensor, cfg: torch.Tensor, dt: float) -> torch.Tensor:
    """x (B, D, P) one Euler step with CFG-zero* guidance; v (2B, D, P) of any strides: conditional rows,
    then unconditional; cfg (B,) per-row guidance. One dtype; x contiguous. One program per row."""
    b, d, p = x.shape
    out = torch.empty_like(x)
    if b:
        _cfg_euler_kernel[(b,)](x, v, cfg, out, d * p, p, b, dt, v.stride(0), v.stride(1), v.stride(2),
                                BLOCK=triton.next_power_of_2(d * p), num_warps=1 if d * p <= 512 else 4)
    return out


def dit_input_triton(x: torch.Tensor, leading: torch.Tensor, weight: torch.Tensor,
                     bias: torch.Tensor) -> torch.Tensor:
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


def dit_output_euler_triton(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, x: torch.Tensor,
                            cfg: torch.Tensor, dt: float) -> torch.Tensor:
    """cfg_euler_step(x, out_proj(h).transpose(1, 2), cfg, dt) in one kernel: h (2B, P, H) the noisy patch's rows with
    unit column stride (any row strides), out_proj's weight (D, H) contiguous and bias (D,), x (B, D, P) contiguous,
    cfg (B,)."""
    b, d, p = x.shape
    hidden = h.shape[-1]
    out = torch.empty_like(x)
    block_k = next(k for k in (64, 32, 16) if hidden % k == 0)
    _dit_output_euler_kernel[(b,)](
        h, weight, bias, x, cfg, out, b, dt, h.stride(0), h.stride(1), D=d, P=p, H=hidden,
        BLOCK_D=max(16, triton.next_power_of_2(d)), BLOCK_P=max(16, triton.next_power_of_2(p)), BLOCK_K=block_k,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32", num_warps=4)
    return out


def cfg_euler_step(x: torch.Tensor, v: torch.Tensor, cfg: torch.Tensor, dt: float) -> torch.Tensor:
    """One Euler step with CFG-zero* guidance: x (B, D, P); v (2B, D, P) the conditional velocities, then the
    unconditional ones, which are rescaled by their optimal projection on the conditional ones and guided
    with per-row strength cfg (B, 1, 1)."""
    b = x.shape[0]
    if (platform.kernels(x) and x.dim() == 3 and x.dtype == v.dtype == cfg.dtype and x.is_contiguous()
            and v.shape == (2 * b, *x.shape[1:]) and cfg.numel() == b and x.shape[1] * x.shape[2] <= 4096):
        return cfg_euler_step_triton(x, v, cfg.reshape(b).contiguous(), dt)
    v_cond, v_uncond = v[:b], v[b:]
    dot = (v_cond.reshape(b, -1) * v_uncond.reshape(b, -1)).sum(1, keepdim=True)
    norm = v_uncond.reshape(b, -1).pow(2).sum(1, keepdim=True) + 1e-8
    scale = (dot / norm).view(b, 1, 1)
    return x - dt * (v_uncond * scale + cfg * (v_cond - v_uncond * scale))


def dit_input(x: torch.Tensor, leading: torch.Tensor, in_proj: torch.nn.Linear) -> torch.Tensor:
    """A DiT evaluation's input: the leading tokens (2B, T, H), then in_proj of the noisy patch x (B, D, P) for the
    conditional and the unconditional half alike -> (2B, T + P, H). On CUDA one kernel instead of two
    concatenations, a transpose copy and the GEMM."""
    b, d, p = x.shape
    if (platform.kernels(x) and x.is_contiguous() and leading.stride(-1) == 1 and leading.shape[0] == 2 * b
            and x.dtype == leading.dtype == in_proj.weight.dtype and in_proj.bias is not None and d <= 256
            and in_proj.weight.is_contiguous()):
        return dit_input_triton(x, leading, in_proj.weight, in_proj.bias)
    return torch.cat((leading, in_proj(torch.cat((x, x)).transpose(1, 2))), dim=1)


def dit_output_euler(h: torch.Tensor, out_proj: torch.nn.Linear, x: torch.Tensor, cfg: torch.Tensor,
                     dt: float) -> torch.Tensor:
    """The Euler step after a DiT evaluation: the velocities out_proj(h) of the noisy patch's rows h (2B, P, H)
    (conditional rows, then unconditional; any row strides) guided into x (`cfg_euler_step`). On CUDA one kernel
    instead of a copy, the GEMM and the step."""
    b, d, p = x.shape
    if (platform.kernels(x) and x.is_contiguous() and h.stride(-1) == 1 and h.dim() == 3 and h.shape[:2] == (2 * b, p)
            and x.dtype == h.dtype == cfg.dtype == out_proj.weight.dtype and out_proj.bias is not None
            and out_proj.weight.is_contiguous() and d <= 128 and p <= 16 and cfg.numel() == b
            and h.shape[-1] % 16 == 0):
        return dit_output_euler_triton(h, out_proj.weight, out_proj.bias, x, cfg.reshape(b).contiguous(), dt)
    return cfg_euler_step(x, out_proj(h).transpose(1, 2), cfg, dt)

