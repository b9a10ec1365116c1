"""MiniCPM4 transformer blocks shared by every VoxCPM family and every stack in it.

The same stack serves four roles: the causal base LM and residual LM (paged KV cache, attention
through `engine.runner.attention`), and the non-causal local encoder and local DiT (short dense sequences).
Numerics follow the official package: RMSNorm variance in fp32, rotary embedding applied in fp32,
LongRoPE factors, optional muP residual scaling.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from engine.config import TransformerConfig
from engine.ops import fp8, fp8_gemm, gated_gemm, layer_stack, linear, platform
from engine.ops.dense_attention import dense_attention as dense_attention_op
from engine.ops.linear import residual_linear
from engine.ops.lora import LoRAContext, add_lora, add_lora_qkv
from engine.ops.norm import add_rms_norm, rms_norm
from engine.ops.silu_mul import silu_mul
from engine.options import current

# attend(layer_index, q, k, v, rope) -> output with q's leading shape and heads*head_dim last; rope: rotary rows
# (L, 2, head_dim) that the attention applies to q and k first (inside its kernels where it can), or None.
AttendFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


def embedding(num: int, dim: int) -> nn.Embedding:
    """nn.Embedding whose random init is skipped on the meta device (the loader's build): there `normal_` runs
    through torch's reference ops, whose first use imports torch._dynamo (~2.7 s of every start-up)."""
    if torch.empty(0).is_meta:
        return nn.Embedding(num, dim, _weight=torch.empty(num, dim))
    return nn.Embedding(num, dim)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rotary_table(cfg: TransformerConfig, rows: int, device: torch.device | None = None) -> torch.Tensor:
    """(rows, 2, head_dim) fp32 cos/sin of MiniCPM's LongRoPE.

    Computed over all `max_position_embeddings` positions and then cut, exactly as the official
    cache is built, so that every row is bit-identical to it.
    """
    dim, base = cfg.head_dim, cfg.rope_theta
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, device=device).float() / dim))
    n = cfg.max_position_embeddings
    scaling = cfg.rope_scaling or {}
    original = int(scaling.get("original_max_position_embeddings", n))
    factors = scaling.get("long_factor") if n > original else scaling.get("short_factor")
    ext = torch.tensor(factors if factors else [1.0] * (dim // 2), dtype=torch.float32, device=device)
    if ext.numel() != dim // 2:
        raise ValueError(f"rope_scaling factors have {ext.numel()} entries, head_dim {dim} needs {dim // 2}")
    attention_factor = math.sqrt(1 + math.log(n / original) / math.log(original)) if original > 1 else 1.0
    t = torch.arange(n, device=device, dtype=torch.float32)
    freqs = torch.outer(t, 1.0 / ext) * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    table = torch.stack((emb.cos() * attention_factor, emb.sin() * attention_factor), dim=1)
    return table[:rows].contiguous()


def _fuse_rows(*linears: nn.Linear) -> torch.Tensor:
    """Concatenate the linears' weights into one matrix and make each weight a view of its rows, so
    the fused GEMM costs no extra memory and the named parameters (checkpoints, adapters) stay valid."""
    fused = torch.cat([lin.weight.detach() for lin in linears])
    _alias_rows(fused, *linears)
    return fused


def _alias_rows(fused: torch.Tensor, *linears: nn.Linear) -> None:
    """Each linear's weight as a view of its rows of `fused` (in order)."""
    start = 0
    for lin in linears:
        n = lin.weight.shape[0]
        lin.weight.data = fused[start:start + n]
        start += n


class Attention(nn.Module):
    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (cfg.num_attention_heads, cfg.num_key_value_heads,
                                                            cfg.head_dim)
        self.q_proj = nn.Linear(cfg.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=False)
        self.qkv_weight: torch.Tensor | None = None  # set by fuse_projections()

    def fuse_projections(self) -> None:
        """One GEMM for q, k and v instead of three (fewer launches per step on a GPU)."""
        if self.qkv_weight is None:
            self.qkv_weight = _fuse_rows(self.q_proj, self.k_proj, self.v_proj)

    def forward(self, x: torch.Tensor, rope: torch.Tensor | None, attend: AttendFn, layer: int,
                keep: slice | None = None) -> torch.Tensor:
        """The attention branch's output, or its split-K partials (`linear.residual_linear`) for `add_rms_norm`.
        keep: the sequence positions (dim -2) whose output is wanted; every position is still attended to."""
        lead = x.shape[:-1]
        widths = [self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim, self.num_kv_heads * self.head_dim]
        if self.qkv_weight is not None:
            q, k, v = add_lora_qkv(self, x, linear.linear(x, self.qkv_weight)).split(widths, dim=-1)
        else:
            qkv = torch.cat((self.q_proj(x), self.k_proj(x), self.v_proj(x)), dim=-1) \
                if getattr(self, "qkv_lora", None) is not None else None
            if qkv is not None:  # runtime LoRA without the fused weight (CPU): its q/k/v term as on CUDA
                q, k, v = add_lora_qkv(self, x, qkv).split(widths, dim=-1)
            else:
                q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.view(*lead, self.num_heads, self.head_dim)
        k = k.view(*lead, self.num_kv_heads, self.head_dim)
        v = v.view(*lead, self.num_kv_heads, self.head_dim)
        attended = attend(layer, q, k, v, rope)
        if keep is not None:  # contiguous: the LoRA kernel takes only such rows (the GEMM would copy them anyway)
            attended = attended[..., keep, :].contiguous()
        return add_lora(self.o_proj, attended, residual_linear(attended, self.o_proj.weight))


class MLP(nn.Module):
    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.gate_up_weight: torch.Tensor | None = None  # set by fuse_projections()

    def fuse_projections(self) -> None:
        if self.gate_up_weight is None:
            self.gate_up_weight = _fuse_rows(self.gate_proj, self.up_proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The MLP branch's output, or its split-K partials (`linear.residual_linear`) for `add_rms_norm`."""
        if self.gate_up_weight is not None:
            if (quantized := fp8.mlp_companions(x, self.gate_up_weight, self.down_proj.weight)) is not None:
                return fp8.fp8_mlp(x, *quantized)  # the gate in the gate/up GEMM or in the quantiser after it
            if (few_rows := fp8.gated_few_rows(x, self.gate_up_weight)) is not None:
                gated = fp8.gated_linear(x, few_rows)  # the down projection stays bf16 (no quantiser before it)
            else:
                gated = linear.silu_gate_linear(x, self.gate_up_weight)
        else:
            gated = silu_mul(self.gate_proj(x), self.up_proj(x))
        return residual_linear(gated, self.down_proj.weight)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.residual_scale: float | None = cfg.residual_scale if cfg.use_mup else None

    def forward(self, x: torch.Tensor, normed: torch.Tensor, rope: torch.Tensor | None, attend: AttendFn, layer: int,
                next_norm: RMSNorm, next_weight: torch.Tensor | None = None,
                keep: slice | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the residual stream; normed: input_layernorm(x), already computed by whoever updated x
        last. Returns the updated stream and `next_norm` of it (the next layer's input norm, or the
        stack's final norm), each residual add fused with the norm that follows it. next_weight: the projection
        that reads `next_norm`'s output (the next layer's q/k/v), its FP8 GEMM then reads rows the norm quantised.
        keep: in a stack's last layer, the sequence positions (dim -2) the caller reads: after the attention, which
        reads every position, only these rows go on (the o projection, the MLP and the norms)."""
        # Each branch's output may come back as split-K partials, which the add + norm sums.
        h = self.self_attn(normed, rope, attend, layer, keep)
        if keep is not None:
            x = x[..., keep, :]
        norm = self.post_attention_layernorm
        x, normed = add_rms_norm(x, h, self.residual_scale, norm.weight, norm.eps,
                                 quantize=fp8.reads_quantized(x, self.mlp.gate_up_weight))
        h = self.mlp(normed)
        return add_rms_norm(x, h, self.residual_scale, next_norm.weight, next_norm.eps,
                            quantize=fp8.companion(x, next_weight) is not None)


def fuse_projections(module: nn.Module) -> None:
    """Fuse q/k/v and gate/up projections of every layer under `module`, and stack each kind of layer weight of every
    stack into one tensor (`MiniCPM.stack_layer_weights`). Idempotent, no extra memory."""
    for m in module.modules():
        if isinstance(m, Attention | MLP):
            m.fuse_projections()
    for m in module.modules():
        if isinstance(m, MiniCPM):
            m.stack_layer_weights()


def attach_gated_companions(backbone: nn.Module, dit: nn.Module, dit_rows: int, fp8_weights: bool) -> int:
    """Which MLPs get their gated GEMM's companion (`attach_gated_gemm`): the DiT's where its rows at max_num_seqs
    (`dit_rows`) reach the gated GEMM's (`fp8_min_rows` on FP8 weights, `gated_gemm_min_rows` in bf16), for any row
    count; with FP8 weights and `fp8_gated_min_rows` every other one's too (and the DiT's where it has none), for
    calls below fp8_min_rows only (their decode rows). None where `gated_gemm_min_rows` is 0. Returns how many."""
    opts = current()
    if not opts.gated_gemm_min_rows:
        return 0
    count = attach_gated_gemm(dit) if dit_rows >= (
        opts.fp8_min_rows if fp8_weights else opts.gated_gemm_min_rows) else 0
    if fp8_weights and opts.fp8_gated_min_rows:  # the others' (and a DiT's without one) for few rows only
        count += attach_gated_gemm(backbone, few_rows_only=True)
    return count


def attach_gated_gemm(module: nn.Module, few_rows_only: bool = False) -> int:
    """Give the fused gate/up weight of every MLP under `module` (after `fuse_projections`, and after
    `quantize_projections`) the interleaved companion its gated GEMM reads: on FP8 weights the gated FP8 GEMM's
    (`fp8.attach_gated`, where `fp8_gemm.gated_supported`), else (unless `few_rows_only`) the bf16 one
    (`engine.ops.gated_gemm`, where its tiles divide the weight); `few_rows_only`: the FP8 one for calls below
    fp8_min_rows, where the weight has no gated companion yet. Idempotent. Returns how many weights got or have one."""
    count = 0
    for m in module.modules():
        if not isinstance(m, MLP) or (w := m.gate_up_weight) is None:
            continue
        if fp8.companion_of(w) is not None:
            if fp8_gemm.gated_supported(w.device, w.shape[1], w.shape[0]):
                if few_rows_only and fp8.gated_companion_of(w) is not None:
                    continue  # its companion for any row count serves few rows too
                if fp8.few_rows_gated_companion_of(w) is None:
                    fp8.attach_gated(w, few_rows_only)
                count += 1
        elif not few_rows_only and gated_gemm.shape_ok(w):
            if gated_gemm.companion_of(w) is None:
                gated_gemm.attach(w)
            count += 1
    return count


_NOT_YET = object()  # a model no engine has served yet (its `quantization` attribute unset)


def quantize_projections(module: nn.Module, quantization: str | None, device: torch.device) -> dict[str, int]:
    """Quantise the projections (q/k/v, o, gate/up, down) of every stack under `module` (EngineConfig.quantization),
    once per loaded model: after a merged LoRA adapter, fusing and stacking. Where the FP8 GEMM runs
    (`fp8.gemm_supported`) each fused weight gets its FP8 companion (the weights are fused here if they are not yet);
    elsewhere the weights are replaced by their dequantised values. A model quantised one way serves no engine
    configured another (its weights are no longer the checkpoint's): load it again. Returns how many weights took
    each way."""
    done = getattr(module, "quantization", _NOT_YET)
    if done is not _NOT_YET and done != quantization:
        raise ValueError(f"quantization: another engine serves this model's weights with quantization={done!r}: load "
                         f"it again for quantization={quantization!r}")
    counts = {"fp8_gemm": 0, "dequantized": 0}
    if done is not _NOT_YET:
        return counts
    module.quantization = quantization  # unquantised too: no later engine may quantise weights this one reads
    if quantization is None:
        return counts
    stacks = [m for m in module.modules() if isinstance(m, MiniCPM)]
    gemm = bool(stacks) and fp8.gemm_supported(device, next(stacks[0].parameters()).dtype)
    if gemm:
        fuse_projections(module)
    with torch.no_grad():
        for layer in (layer for stack in stacks for layer in stack.layers):
            a, m = layer.self_attn, layer.mlp
            fused = (a.qkv_weight, a.o_proj.weight, m.gate_up_weight, m.down_proj.weight)
            for weight in fused if gemm else (lin.weight for lin in (a.q_proj, a.k_proj, a.v_proj, a.o_proj,
                                                                      m.gate_proj, m.up_proj, m.down_proj)):
                if gemm and fp8.gemm_shape_ok(weight):
                    fp8.attach(weight)
                    counts["fp8_gemm"] += 1
                else:
                    fp8.dequantize_in_place(weight)
                    counts["dequantized"] += 1
    module.quantization = quantization
    return counts


class MiniCPM(nn.Module):
    """A stack of decoder layers plus final norm (and token embedding for the base LM)."""

    lora_context: LoRAContext | None = None  # set where runtime LoRA adapters may adapt its layers

    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.cfg = cfg
        if cfg.vocab_size > 0:
            self.embed_tokens = embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.uses_rope = not cfg.no_rope

    def _layer_weights(self) -> dict[str, list[torch.Tensor]] | None:
        """Each kind of layer weight, layer by layer ("input_norm" with the final norm last); None before
        `fuse_projections` (or without layers)."""
        attns, mlps = [layer.self_attn for layer in self.layers], [layer.mlp for layer in self.layers]
        if not attns or any(a.qkv_weight is None for a in attns) or any(m.gate_up_weight is None for m in mlps):
            return None
        return {"qkv": [a.qkv_weight for a in attns], "o": [a.o_proj.weight for a in attns],
                "gate_up": [m.gate_up_weight for m in mlps], "down": [m.down_proj.weight for m in mlps],
                "post_norm": [layer.post_attention_layernorm.weight for layer in self.layers],
                "input_norm": [layer.input_layernorm.weight for layer in self.layers] + [self.norm.weight]}

    def stack_layer_weights(self) -> None:
        """Each kind of layer weight (fused q/k/v, o, fused gate/up, down, the post-attention norms, and the input
        norms followed by the final norm) as one contiguous (layers, ...) tensor whose rows the layers' weights are
        views of: the layer kernel (`engine.ops.layer_stack`) then runs the whole stack in one launch, addressing a
        layer's weights at a fixed stride. No extra memory; the named parameters stay valid. After
        `fuse_projections`; idempotent."""
        weights = self._layer_weights()
        if weights is None or self.layer_weight_stacks() is not None:
            return
        for tensors in weights.values():
            for tensor, row in zip(tensors, torch.stack([t.detach() for t in tensors]), strict=True):
                tensor.data = row  # the same tensor (parameter or fused weight), now a row of the stack
        for layer in self.layers:  # q/k/v and gate/up stay row views of their fused weight, which moved
            a, m = layer.self_attn, layer.mlp
            _alias_rows(a.qkv_weight, a.q_proj, a.k_proj, a.v_proj)
            _alias_rows(m.gate_up_weight, m.gate_proj, m.up_proj)

    def layer_weight_stacks(self) -> dict[str, torch.Tensor] | None:
        """The stacks `stack_layer_weights` made, as (layers, ...) views ("input_norm" has one row more: the final
        norm), or None where the layers' weights are not (or no longer) rows of one tensor each at a fixed stride."""
        weights = self._layer_weights()
        if weights is None:
            return None
        out = {}
        for kind, tensors in weights.items():
            first = tensors[0]
            step, storage = first.numel() * first.element_size(), first.untyped_storage().data_ptr()
            if not first.is_contiguous() or any(t.shape != first.shape or t.dtype != first.dtype
                                                or t.untyped_storage().data_ptr() != storage
                                                or t.data_ptr() != first.data_ptr() + i * step
                                                for i, t in enumerate(tensors)):
                return None
            out[kind] = first.as_strided((len(tensors), *first.shape), (first.numel(), *first.stride()))
        return out

    def forward(self, x: torch.Tensor, rope: torch.Tensor | None, attend: AttendFn,
                keep: slice | None = None) -> torch.Tensor:
        """x: (..., L, hidden); rope: (L, 2, head_dim) rows for the positions of x, or None. keep: the positions
        (dim -2) whose output the caller reads (None: all); the last layer computes only those after its attention."""
        rope = rope if self.uses_rope else None
        if not len(self.layers):
            return self.norm(x if keep is None else x[..., keep, :])
        normed = self.layers[0].input_layernorm(x)
        for i, layer in enumerate(self.layers):
            after = self.layers[i + 1] if i + 1 < len(self.layers) else None
            x, normed = layer(x, normed, rope, attend, i, after.input_layernorm if after else self.norm,
                              after.self_attn.qkv_weight if after else None, None if after else keep)
        return normed

    def forward_local(self, x: torch.Tensor, rope: torch.Tensor | None, keep: slice | None = None) -> torch.Tensor:
        """A local module's stack (LocEnc, DiT): bidirectional attention within each short sequence of x; where the
        layer kernel takes these few rows, the whole stack is one kernel launch. keep: the positions whose output
        the caller reads (`forward`); the layer kernel computes every row and returns a view of these."""
        lora = self.lora_context is not None and self.lora_context.mask is not None  # the kernel reads base weights
        # Rows the FP8 GEMM takes (EngineOptions.fp8_min_rows) go the per-layer way, which runs it.
        takes_fp8_gemm = len(self.layers) > 0 and fp8.companion(x, self.layers[0].self_attn.qkv_weight) is not None
        if (len(self.layers) and not lora and not takes_fp8_gemm and platform.kernels(x)
                and layer_stack.supported(self, x)):
            out = layer_stack.dense_stack(self, x, rope if self.uses_rope else None)
            return out if keep is None else out[..., keep, :]
        return self.forward(x, rope, dense_attention, keep)


class DenseAttention:
    """The local modules' `AttendFn`: bidirectional attention within each short sequence (`engine.ops.dense_attention`;
    the layer index is not used, there is no cache)."""

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 rope: torch.Tensor | None = None) -> torch.Tensor:
        del layer
        return dense_attention_op(q, k, v, rope)


dense_attention = DenseAttention()
