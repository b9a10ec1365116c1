"""Fused versions of the transformer's and the VAE's element-wise chains, chosen per call.

A decode step is launch-bound at small batch: the DiT alone runs 9 Euler evaluations x 12 layers, and
unfused, every RMSNorm, rotary embedding, SiLU gate and residual add is 4-10 tiny kernels. On CUDA the
functions here run the Triton kernels of `engine.triton_kernels` (a residual add together with the norm
after it, q's rotary with k's, the local modules' rotary inside their attention, the VAE's Snake in one
pass, the residual unit's depthwise conv reading its carried context in place with the next Snake fused in,
its 1x1 conv and residual add as one GEMM, the decoder's biases and sample-rate condition carried into the next
Snake as a per-channel affine, the sampler's CFG Euler step). The math is the eager expression with the same
rounding points; what can differ is fp32 summation order, Triton's approximate fp32 division, the Snake's
hardware sine approximation (VOXCPM_FAST_SIN=0: exact), the deferred biases' add order (and an fp32 FMA where
the condition multiplies and adds) and the VAE GEMM's TF32 and add order —
all far below the bf16 model's and the TF32 convolutions' own error. CPU keeps the eager ops (CI, exact
parity). Set VOXCPM_FUSE=0 to disable all of it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine import triton_attention, triton_kernels
from engine.options import current


def kernels(x: torch.Tensor) -> bool:
    """Whether the Triton kernels serve this tensor (CUDA, triton importable, fusion enabled)."""
    return current().fuse and x.is_cuda and triton_kernels.usable(x)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Variance in fp32, normalised x rounded to x's dtype, then scaled (the official op order)."""
    variance = x.float().pow(2).mean(-1, keepdim=True)
    return (x * torch.rsqrt(variance + eps)).to(x.dtype) * weight


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if kernels(x) and weight.dtype == x.dtype:
        return triton_kernels.add_rms_norm(x, None, None, weight, eps)[1]
    return _rms_norm(x, weight, eps)


def add_rms_norm(x: torch.Tensor, h: torch.Tensor, scale: float | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual update x + h (times muP `scale` when given) and the RMSNorm of the result, which
    the next sub-block reads: one kernel instead of two between every pair of GEMMs. h is the branch's output,
    or the split-K partial products (S, *x.shape) fp32 that `residual_linear` made of it (summed here)."""
    partials = h.dim() == x.dim() + 1
    if (kernels(x) and weight.dtype == x.dtype and h.shape[int(partials):] == x.shape
            and h.dtype == (torch.float32 if partials else x.dtype)):
        return triton_kernels.add_rms_norm(x, h, scale, weight, eps)
    if partials:
        h = h.sum(0).to(x.dtype)
    x = x + h if scale is None else x + h * scale
    return x, _rms_norm(x, weight, eps)


# Split-K (EngineOptions.split_k): where a GEMM has few output tiles for its length of K, cuBLAS leaves most SMs
# idle; a strided batched GEMM over slices of K writes fp32 partials that the add + RMSNorm after it sums.


def residual_splits(rows: int, k_dim: int, n: int) -> int:
    """How many K slices `residual_linear` uses for (rows, K) @ (K, n): 1 (one GEMM) where splitting measured no
    faster on the H100 (`bench_kernels --only splitk`: many outputs, or a short K)."""
    outputs = rows * n
    if k_dim < 1024 or outputs > (1100 << 10 if k_dim >= 4096 else 360 << 10):
        return 1
    return 4 if k_dim >= 4096 and n <= 1024 and outputs <= 180 << 10 else 2


def split_k_views(x2: torch.Tensor, weight: torch.Tensor, splits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Views for a batched GEMM over `splits` slices of K (no copies): x2 (rows, K) contiguous -> (S, rows, K/S) with
    strides (K/S, K, 1); weight (N, K) contiguous -> (S, K/S, N), column-major slices that cuBLAS reads as they are.
    bmm of the two, summed over S, is x2 @ weight.T."""
    rows, k_dim = x2.shape
    part = k_dim // splits
    return (x2.view(rows, splits, part).transpose(0, 1),
            weight.view(weight.shape[0], splits, part).permute(1, 2, 0))


def residual_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight.T for the last projection of a residual branch, which `add_rms_norm` adds to the stream: the output,
    or on CUDA where `residual_splits` says so, its S partial products over slices of K, (S, *x.shape[:-1], N)
    fp32 (fp32 accumulation throughout; only the summation order differs from one GEMM's). One-row calls go to the
    GEMV kernel (`linear`), which returns partials where it cuts K into slices."""
    if kernels(x) and triton_kernels.gemv_supported(x, weight, partials=True):
        return triton_kernels.gemv(x, weight)
    k_dim, n = x.shape[-1], weight.shape[0]
    x2 = x.reshape(-1, k_dim)
    splits = residual_splits(x2.shape[0], k_dim, n) if current().split_k and kernels(x) else 1
    # Each slice a whole number of 16-byte rows (cuBLAS's aligned kernels), K a multiple of the slice count.
    if (splits == 1 or k_dim % (8 * splits) or x.dtype not in (torch.float16, torch.bfloat16)
            or weight.dtype != x.dtype or not weight.is_contiguous() or torch.is_grad_enabled()):
        return F.linear(x, weight)
    x_slices, w_slices = split_k_views(x2.contiguous(), weight, splits)
    return torch.bmm(x_slices, w_slices, out_dtype=torch.float32).view(splits, *x.shape[:-1], n)


def _rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (..., L, heads, head_dim); cos/sin: (L, head_dim) fp32, broadcast over heads; applied in fp32."""
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return (xf * cos.unsqueeze(-2) + rotated * sin.unsqueeze(-2)).to(x.dtype)


def rotary_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
              sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding of queries and keys (one kernel for both on CUDA)."""
    if kernels(q) and triton_kernels.rotary_supported(q, k, cos, sin):
        return triton_kernels.rotary_qk(q, k, cos, sin)
    return _rotary(q, cos, sin), _rotary(k, cos, sin)


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rope: torch.Tensor | None,
                     k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                     block_tables: torch.Tensor, row_index: torch.Tensor,
                     context_lens: torch.Tensor) -> torch.Tensor | None:
    """A decode step's attention with the new tokens' rotary embedding and K/V cache write inside the split kernel
    (`engine.triton_attention.decode_attention`), where the layouts are those the separate rotary + K/V write kernel
    takes; None otherwise (the caller then rotates and stores first)."""
    if not triton_kernels.rotary_store_supported(q, k, v, k_cache, v_cache, slot_mapping):
        return None
    if rope is not None and not triton_kernels.rotary_supported(q, k, rope[..., 0, :], rope[..., 1, :]):
        return None
    return triton_attention.decode_attention(q, k, v, rope, k_cache, v_cache, slot_mapping, block_tables, row_index,
                                             context_lens)


def rotary_store_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rope: torch.Tensor | None,
                    k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor | None:
    """A causal layer's rotary embedding (rope (T, 2, D) rows, or None) and K/V cache write as one kernel; returns
    the rotated q, or None where the kernel does not apply (the caller then rotates and scatters itself)."""
    if not (kernels(q) and triton_kernels.rotary_store_supported(q, k, v, k_cache, v_cache, slot_mapping)):
        return None
    if rope is not None and not triton_kernels.rotary_supported(q, k, rope[..., 0, :], rope[..., 1, :]):
        return None
    cos, sin = (rope[..., 0, :], rope[..., 1, :]) if rope is not None else (None, None)
    return triton_kernels.rotary_store_kv(q, k, v, cos, sin, k_cache, v_cache, slot_mapping)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    if kernels(gate):
        return triton_kernels.silu_mul(gate, up)
    return F.silu(gate) * up


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight.T without bias: on CUDA up to `gemv_max_rows` (EngineOptions) rows (one by default) go to the
    weight-streaming GEMV kernel chained by PDL (`triton_kernels.gemv`: the LMs' one-row decode chain), the rest to
    cuBLAS."""
    if kernels(x) and triton_kernels.gemv_supported(x, weight):
        return triton_kernels.gemv(x, weight)
    return F.linear(x, weight)


def silu_gate_linear(x: torch.Tensor, gate_up_weight: torch.Tensor) -> torch.Tensor:
    """silu(x @ gate.T) * (x @ up.T) for the fused [gate; up] weight (2I, K): for a few rows on CUDA one
    weight-streaming kernel with the gated product in its epilogue (H100, B=1 step: DiT 10.3 -> 8.6 us, LM
    21.2 -> 20.0 us against cuBLAS + silu_mul; the other projections stay on cuBLAS, which the same kernel did
    not beat there), else the GEMM and `silu_mul`."""
    if kernels(x) and triton_kernels.gemv_supported(x, gate_up_weight, silu_gate=True):
        return triton_kernels.gemv(x, gate_up_weight, silu_gate=True)
    if kernels(x) and triton_kernels.skinny_supported(x, gate_up_weight, silu_gate=True):
        return triton_kernels.skinny_matmul(x, gate_up_weight, silu_gate=True)
    gate, up = F.linear(x, gate_up_weight).chunk(2, dim=-1)
    return silu_mul(gate, up)


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    rope: torch.Tensor | None) -> torch.Tensor | None:
    """The local modules' attention with rotary applied on load, as one kernel; None where the kernel
    does not apply (the caller then rotates and uses SDPA)."""
    if kernels(q) and triton_kernels.dense_attention_supported(q, k):
        cos, sin = (rope[:, 0, :], rope[:, 1, :]) if rope is not None else (None, None)
        return triton_kernels.dense_attention(q, k, v, cos, sin)
    return None


def snake(x: torch.Tensor, alpha: torch.Tensor, scale: torch.Tensor | None = None,
          shift: torch.Tensor | None = None) -> torch.Tensor:
    """The VAE's Snake activation x + sin^2(alpha x) / alpha (the official op order): five passes over
    the largest activations of the step when unfused. With per-channel `scale` / `shift` ((C,)), of
    x * scale + shift (in the same kernel on CUDA)."""
    if kernels(x) and x.dim() == 3:
        return triton_kernels.snake(x, alpha, scale, shift)
    if scale is not None:
        x = x * scale[:, None]
    if shift is not None:
        x = x + shift[:, None]
    return x + (alpha + 1e-9).reciprocal() * torch.sin(alpha * x).pow(2)


def _context_fits(state: torch.Tensor | None, slots: torch.Tensor | None, x: torch.Tensor, width: int) -> bool:
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
    if not (kernels(x) and x.dim() == 3 and weight.dim() == 3):
        return False
    c = x.shape[1]
    pad = (weight.shape[-1] - 1) * dilation
    if weight.shape[:2] != (c, 1) or weight.dtype != x.dtype or (bias is not None and bias.dtype != x.dtype):
        return False
    return _context_fits(state, slots, x, pad)


def causal_depthwise_conv(x: torch.Tensor, state: torch.Tensor | None, weight: torch.Tensor, bias: torch.Tensor | None,
                          dilation: int, out_alpha: torch.Tensor | None = None, slots: torch.Tensor | None = None,
                          in_alpha: torch.Tensor | None = None,
                          in_shift: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A residual unit's [Snake with `in_alpha` of x + `in_shift`] -> cat(carried context, that) -> dilated
    depthwise causal conv (stride 1) [-> Snake with `out_alpha`] as one kernel: (output, new context). state
    (B, C, (K - 1) * dilation) or None for a full-sequence pass; with `slots` (B,), state holds every slot's
    context, rows slots[b] are read and replaced in place (the new context returned is state itself). Only where
    `depthwise_conv_supported` (the caller checks)."""
    return triton_kernels.causal_depthwise_conv(x, state, weight, bias, dilation, out_alpha, slots, in_alpha, in_shift)


def causal_conv_transpose(x: torch.Tensor, state: torch.Tensor | None, weight_taps: torch.Tensor,
                          bias: torch.Tensor | None, stride: int, kernel: int,
                          slots: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """The VAE's streaming upsampler (audio_vae.CausalConvTranspose1d) as one GEMM of every tap over the context
    and the new frames of all streams (cuBLAS, under the matmul TF32 policy that the runner aligns with cuDNN's)
    and one Triton overlap-add writing only the kept outputs, contiguous: no cuDNN algorithm search per batch size
    at start-up, no trimmed view. weight_taps: (kernel * C_out, C_in), rows ordered (tap, channel). state
    (B, C_in, ctx) or None (zeros, no context kept) -> (output, new context (B, C_in, ctx) or None); with `slots`
    (B,), state is every slot's context (slots, C_in, ctx), rows slots[b] are read and replaced in place by the new
    context (returned: state), as `causal_depthwise_conv` does. None where it does not apply (nothing changed; the
    caller then runs cuDNN). Not used with vae_upsampler='cudnn'."""
    if not (kernels(x) and x.dim() == 3 and weight_taps.dtype == x.dtype):
        return None
    b, c, n = x.shape
    ctx = (kernel - 1) // stride
    if not _context_fits(state, slots, x, ctx):
        return None
    # One GEMM over every stream's frames: the input laid out (C_in, B, F), F = ctx + n padded to a multiple of 4
    # (cuBLAS's fast kernels need 16-byte aligned rows). A GEMM per stream (B, C_in, F) was 6.5 of the VAE's
    # 15.5 ms at B=128 on the H100: a handful of frames per stream is far too narrow for a GEMM.
    frames = ctx + n + (-(ctx + n) % 4)
    xin, new_state = triton_kernels.upsampler_input(x, state, ctx, frames, slots)
    g = torch.mm(weight_taps, xin.view(c, b * frames)).view(-1, b, frames).transpose(0, 1)
    return triton_kernels.overlap_add(g, bias, stride, kernel, ctx, n), new_state


def pointwise_conv_residual(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                            residual: torch.Tensor) -> torch.Tensor:
    """residual + conv1d(h, weight (O, C, 1), bias) as one batched GEMM that adds the residual in its
    epilogue (no layout copies around a cuDNN conv, no separate add). Without autograd a contiguous `residual`
    is consumed: the GEMM accumulates into it in place (out of place, the GEMM would first copy it). fp32
    GEMMs follow the process's matmul TF32 setting, which the CUDA model runner aligns with cuDNN's."""
    w = weight[:, :, 0].expand(h.shape[0], -1, -1)  # stride 0 over the batch: no copy
    if residual.is_contiguous() and not torch.is_grad_enabled():
        out = residual.baddbmm_(w, h)
    else:
        out = torch.baddbmm(residual, w, h)
    return out if bias is None else out.add_(bias[:, None])


def dit_input(x: torch.Tensor, leading: torch.Tensor, in_proj: torch.nn.Linear) -> torch.Tensor:
    """A DiT evaluation's input: the leading tokens (2B, T, H), then in_proj of the noisy patch x (B, D, P) for the
    conditional and the unconditional half alike -> (2B, T + P, H). On CUDA one kernel instead of two
    concatenations, a transpose copy and the GEMM."""
    b, d, p = x.shape
    if (kernels(x) and x.is_contiguous() and leading.stride(-1) == 1 and leading.shape[0] == 2 * b
            and x.dtype == leading.dtype == in_proj.weight.dtype and in_proj.bias is not None and d <= 256
            and in_proj.weight.is_contiguous()):
        return triton_kernels.dit_input(x, leading, in_proj.weight, in_proj.bias)
    return torch.cat((leading, in_proj(torch.cat((x, x)).transpose(1, 2))), dim=1)


def dit_output_euler(h: torch.Tensor, lead_len: int, out_proj: torch.nn.Linear, x: torch.Tensor, cfg: torch.Tensor,
                     dt: float) -> torch.Tensor:
    """The Euler step after a DiT evaluation: the velocities out_proj(h[:, lead_len:]) (conditional rows, then
    unconditional) guided into x (`cfg_euler_step`). On CUDA one kernel instead of a copy, the GEMM and the step."""
    b, d, p = x.shape
    if (kernels(x) and x.is_contiguous() and h.stride(-1) == 1 and h.shape[0] == 2 * b and h.dim() == 3
            and x.dtype == h.dtype == cfg.dtype == out_proj.weight.dtype and out_proj.bias is not None
            and out_proj.weight.is_contiguous() and d <= 128 and p <= 16 and cfg.numel() == b
            and h.shape[-1] % 16 == 0):
        return triton_kernels.dit_output_euler(h, lead_len, out_proj.weight, out_proj.bias, x,
                                               cfg.reshape(b).contiguous(), dt)
    return cfg_euler_step(x, out_proj(h[:, lead_len:]).transpose(1, 2), cfg, dt)


def cfg_euler_step(x: torch.Tensor, v: torch.Tensor, cfg: torch.Tensor, dt: float) -> torch.Tensor:
    """One Euler step with CFG-zero* guidance: x (B, D, P); v (2B, D, P) the conditional velocities, then the
    unconditional ones, which are rescaled by their optimal projection on the conditional ones and guided
    with per-row strength cfg (B, 1, 1)."""
    b = x.shape[0]
    if (kernels(x) and x.dim() == 3 and x.dtype == v.dtype == cfg.dtype and x.is_contiguous()
            and v.shape == (2 * b, *x.shape[1:]) and cfg.numel() == b and x.shape[1] * x.shape[2] <= 4096):
        return triton_kernels.cfg_euler_step(x, v, cfg.reshape(b).contiguous(), dt)
    v_cond, v_uncond = v[:b], v[b:]
    dot = (v_cond.reshape(b, -1) * v_uncond.reshape(b, -1)).sum(1, keepdim=True)
    norm = v_uncond.reshape(b, -1).pow(2).sum(1, keepdim=True) + 1e-8
    scale = (dot / norm).view(b, 1, 1)
    return x - dt * (v_uncond * scale + cfg * (v_cond - v_uncond * scale))
