"""Causal audio VAE of the VoxCPM family (v1: VoxCPM-0.5B / VoxCPM1.5, v2: VoxCPM2).

Architecture facts (layer layout, paddings, snake activation, sample-rate conditioning) follow the
official `voxcpm.modules.audiovae` so that official checkpoints load with identical parameter names.
Differences on purpose:

* weight-normed convolutions hold one fused `weight` (see `fuse_weight_norm`): inference never
  needs the g/v split, and a plain weight is cheaper and friendlier to compilation.
* streaming decode is an explicit stateful forward (`StreamingDecoder`) instead of patching modules.

Version differences: v1's causal conv ignores `output_padding` (so the odd-stride encoder downsampling
convs get one extra left-pad sample); v2 adds a sample-rate condition layer before every decoder block.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from dataclasses import dataclass, field, fields
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine.models.minicpm import embedding
from engine.ops import platform, upsampler, vae_conv
from engine.ops.snake import snake
from engine.options import batch_invariant


class SlotStates:
    """A batch's stream states kept in per-slot buffers: buffers[i] is (slots, channels, context) for stateful layer
    i, and batch row b's stream is slot index[b]. Layers read and replace a layer's states as with a list (a gather,
    then a scatter of the new context); the fused depthwise conv reads and writes its buffer in place instead."""

    def __init__(self, buffers: list[Tensor], index: Tensor) -> None:
        self.buffers, self.index = buffers, index

    def __getitem__(self, i: int) -> Tensor:
        return self.buffers[i][self.index]

    def __setitem__(self, i: int, value: Tensor) -> None:
        self.buffers[i][self.index] = value


# Stream state: one tensor per stateful decoder layer, indexed by that layer's `state_slot`. Every
# tensor is [batch, channels, context] with batch first, so several streams can later be decoded
# together by concatenating / indexing the per-slot tensors along dim 0 (or `SlotStates`: the same, read from and
# written to per-slot buffers).
StreamStates = list[Tensor] | SlotStates


def layer_context(states: StreamStates | None, slot: int | None) -> tuple[Tensor | None, Tensor | None]:
    """A stateful layer's (context, slots) for a kernel: with per-slot buffers the layer's whole buffer and the
    batch's slots (the kernel reads and replaces those rows in place), else the batch's contexts and None; (None,
    None) when not streaming."""
    if states is None or slot is None:
        return None, None
    if isinstance(states, SlotStates):
        return states.buffers[slot], states.index
    return states[slot], None


# --------------------------------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------------------------------

_V1_DEFAULTS: dict[str, Any] = {
    "encoder_dim": 128,
    "encoder_rates": [2, 5, 8, 8],
    "latent_dim": 64,
    "decoder_dim": 1536,
    "decoder_rates": [8, 8, 5, 2],
    "depthwise": True,
    "sample_rate": 16000,
    "out_sample_rate": None,
    "use_noise_block": False,
    "sr_bin_boundaries": None,
    "cond_type": "scale_bias",
    "cond_dim": 128,
    "cond_out_layer": False,
}
_V2_DEFAULTS: dict[str, Any] = {
    **_V1_DEFAULTS,
    "decoder_dim": 2048,
    "decoder_rates": [8, 6, 5, 2, 2, 2],
    "out_sample_rate": 48000,
    "sr_bin_boundaries": [20000, 30000, 40000],
}
# The official v1 config has no such fields, so a v1 config.json carrying them is ignored there too.
_V2_ONLY = ("out_sample_rate", "sr_bin_boundaries", "cond_type", "cond_dim", "cond_out_layer")


@dataclass
class AudioVAEConfig:
    encoder_dim: int = 128
    encoder_rates: list[int] = field(default_factory=lambda: [2, 5, 8, 8])
    latent_dim: int | None = 64  # None -> encoder_dim * 2**len(encoder_rates), as officially
    decoder_dim: int = 1536
    decoder_rates: list[int] = field(default_factory=lambda: [8, 8, 5, 2])
    depthwise: bool = True
    sample_rate: int = 16000
    out_sample_rate: int | None = None
    use_noise_block: bool = False
    sr_bin_boundaries: list[int] | None = None
    cond_type: str = "scale_bias"
    cond_dim: int = 128
    cond_out_layer: bool = False

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None, version: int) -> AudioVAEConfig:
        """Official defaults of `version` (1 or 2), overridden by the known keys of `d`."""
        if version not in (1, 2):
            raise ValueError(f"unknown audio VAE version {version}")
        values = dict(_V1_DEFAULTS if version == 1 else _V2_DEFAULTS)
        known = {f.name for f in fields(cls)}
        for key, val in (d or {}).items():
            if key in known and not (version == 1 and key in _V2_ONLY):
                values[key] = val
        for key in ("encoder_rates", "decoder_rates"):
            values[key] = [int(r) for r in values[key]]
        if values["sr_bin_boundaries"] is not None:
            values["sr_bin_boundaries"] = [int(b) for b in values["sr_bin_boundaries"]]
        return cls(**values)


# --------------------------------------------------------------------------------------------------
# Weight norm
# --------------------------------------------------------------------------------------------------

# (g, v) name pairs without the module prefix: legacy hook names and parametrization names.
_WN_PAIRS = (
    ("weight_g", "weight_v"),
    ("parametrizations.weight.original0", "parametrizations.weight.original1"),
)


def _wn_prefix(key: str, suffix: str) -> str | None:
    """Module prefix (with trailing dot, '' at top level) if `key` is `<prefix><suffix>`."""
    if key == suffix:
        return ""
    return key[: -len(suffix)] if key.endswith("." + suffix) else None


def fuse_weight_norm(state_dict: dict[str, Tensor]) -> dict[str, Tensor]:
    """Replace weight-norm (g, v) pairs by the fused `weight`, exactly as torch computes it.

    Handles the legacy hook names (`X.weight_g`/`X.weight_v`) and the parametrization names
    (`X.parametrizations.weight.original0`/`original1`); other entries pass through unchanged.
    The official modules apply weight norm with the default dim=0 for both Conv1d and
    ConvTranspose1d, and torch computes `torch._weight_norm(v, g, dim)` in both APIs, so calling the
    same kernel here gives bitwise identical weights.
    """
    out: dict[str, Tensor] = {}
    for key, val in state_dict.items():
        for g_name, v_name in _WN_PAIRS:
            g_prefix, v_prefix = _wn_prefix(key, g_name), _wn_prefix(key, v_name)
            if v_prefix is not None:
                if v_prefix + g_name not in state_dict:
                    raise KeyError(f"{key} has no matching {v_prefix + g_name}")
                break  # fused together with its g
            if g_prefix is not None:
                v = state_dict.get(g_prefix + v_name)
                if v is None:
                    raise KeyError(f"{key} has no matching {g_prefix + v_name}")
                out[g_prefix + "weight"] = torch._weight_norm(v, val, 0)
                break
        else:
            out[key] = val
    return out


# --------------------------------------------------------------------------------------------------
# Layers. Every layer takes `(x, states=None)`: with states=None it is the plain full-sequence
# forward; with a StreamStates list, stateful layers read and replace their slot (causal context).
# --------------------------------------------------------------------------------------------------


class CausalConv1d(nn.Conv1d):
    """Conv1d left-padded by `left_pad` zeros; in streaming the zeros are replaced by the carried tail
    of the previous input, which makes chunked output identical to the full-sequence output."""

    def __init__(self, in_ch: int, out_ch: int, kernel_size: int, *, left_pad: int, stride: int = 1,
                 dilation: int = 1, groups: int = 1, bias: bool = True) -> None:
        super().__init__(in_ch, out_ch, kernel_size, stride=stride, dilation=dilation, groups=groups,
                         bias=bias)
        self.left_pad = left_pad
        self.state_slot: int | None = None  # assigned by the decoder for stateful layers

    def state_shape(self) -> tuple[int, int] | None:
        return (self.in_channels, self.left_pad) if self.left_pad > 0 else None

    def forward(self, x: Tensor, states: StreamStates | None = None) -> Tensor:
        if states is None or self.state_slot is None:
            x = F.pad(x, (self.left_pad, 0))
        else:
            assert self.stride[0] == 1, "streaming assumes stride-1 convs (true for every decoder conv)"
            x = torch.cat([states[self.state_slot], x], dim=-1)
            states[self.state_slot] = x[..., x.shape[-1] - self.left_pad:]
        return F.conv1d(x, self.weight, self.bias, self.stride, 0, self.dilation, self.groups)


class CausalConvTranspose1d(nn.ConvTranspose1d):
    """Upsampling transposed conv whose right `right_trim` outputs are cut so output = T * stride.

    Output frame t depends on input frames t - ctx .. t with ctx = (kernel - 1) // stride, so the
    streaming state is the last `ctx` input frames (zeros at start, which equals no contribution).
    """

    def __init__(self, in_ch: int, out_ch: int, kernel_size: int, stride: int, right_trim: int) -> None:
        super().__init__(in_ch, out_ch, kernel_size, stride=stride)
        # Streaming slices [ctx*s, ctx*s + T*s); that equals the trimmed full output only if the trim
        # removes exactly the kernel overhang. Holds for the official kernel=2*stride layout.
        assert right_trim == kernel_size - stride, "unsupported transposed-conv geometry"
        self.right_trim = right_trim
        self.context = (kernel_size - 1) // stride
        self.state_slot: int | None = None

    def state_shape(self) -> tuple[int, int] | None:
        return (self.in_channels, self.context) if self.context > 0 else None

    def tap_weight(self) -> Tensor:
        """The weight as (K * C_out, C_in), rows ordered (tap, channel), for `upsampler.causal_conv_transpose`; made
        once per weight version (VoxCPM2's fp32 upsamplers: ~165 MB beside their own ~165 MB)."""
        key = (self.weight.data_ptr(), self.weight._version)
        cached = getattr(self, "_tap_weight", None)
        if cached is None or cached[0] != key:
            k, c_out = self.kernel_size[0], self.out_channels
            cached = (key, self.weight.detach().permute(2, 1, 0).reshape(k * c_out, self.in_channels).contiguous())
            self._tap_weight = cached
        return cached[1]

    def forward(self, x: Tensor, states: StreamStates | None = None) -> Tensor:  # type: ignore[override]
        stride = self.stride[0]
        streaming = states is not None and self.state_slot is not None
        # The kernel path's GEMM carries the batch in its columns: in CUDA's batch-invariant mode the conv runs per
        # sample instead.
        if platform.kernels(x) and not (x.is_cuda and batch_invariant("cuda")):
            state, slots = layer_context(states, self.state_slot)
            out = upsampler.causal_conv_transpose(x, state, self.tap_weight(), self.bias, stride, self.kernel_size[0],
                                              slots)
            if out is not None:
                y, new_state = out
                if streaming and slots is None:  # (per-slot buffers: the kernel replaced the context in place)
                    states[self.state_slot] = new_state
                return y
        if not streaming:
            y = F.conv_transpose1d(x, self.weight, self.bias, stride)
            return y[..., : y.shape[-1] - self.right_trim]
        n_new = x.shape[-1]
        x = torch.cat([states[self.state_slot], x], dim=-1)
        states[self.state_slot] = x[..., x.shape[-1] - self.context:]
        y = F.conv_transpose1d(x, self.weight, self.bias, stride)
        start = self.context * stride
        return y[..., start: start + n_new * stride]


class Snake1d(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(1, channels, 1))

    def forward(self, x: Tensor, states: StreamStates | None = None) -> Tensor:
        return snake(x, self.alpha)


class _Tanh(nn.Module):
    def forward(self, x: Tensor, states: StreamStates | None = None) -> Tensor:
        return torch.tanh(x)


class _Chain(nn.ModuleList):
    """Sequential that forwards the stream states; names children 0..n like nn.Sequential."""

    def forward(self, x: Tensor, states: StreamStates | None = None) -> Tensor:
        for layer in self:
            x = layer(x, states)
        return x


class ResidualUnit(nn.Module):
    def __init__(self, dim: int, dilation: int, groups: int) -> None:
        super().__init__()
        self.block = _Chain([
            Snake1d(dim),
            CausalConv1d(dim, dim, 7, left_pad=6 * dilation, dilation=dilation, groups=groups),
            Snake1d(dim),
            CausalConv1d(dim, dim, 1, left_pad=0),
        ])
        snake1, conv, snake2, pointwise = self.block
        # On CUDA the block runs as two kernels: the depthwise conv with both Snakes, the GEMM + residual.
        self.fusable = (isinstance(snake1, Snake1d) and isinstance(conv, CausalConv1d) and isinstance(snake2, Snake1d)
                        and conv.groups == conv.in_channels == conv.out_channels and conv.stride == (1,)
                        and conv.padding == (0,) and conv.left_pad == (conv.kernel_size[0] - 1) * conv.dilation[0])

    def forward(self, x: Tensor, states: StreamStates | None = None) -> Tensor:
        if self.fusable and platform.kernels(x):
            y = self.forward_deferred(x, states)
            if y is not None:
                out, bias = y
                return out if bias is None else out.add_(bias[:, None])
        return x + self.block(x, states)

    def forward_deferred(self, x: Tensor, states: StreamStates | None,
                         pending: Tensor | None = None) -> tuple[Tensor, Tensor | None] | None:
        """The block in two kernels (see `fusable`) with its output bias left out: for the input x + pending
        (pending: a per-channel bias (C,) not yet added to x, or None), (y, bias) with output = y + bias. None where
        the conv kernel does not apply (nothing consumed). Consumes x (the GEMM adds into it in place): a residual
        unit's input is always an intermediate of the VAE."""
        snake1, conv, snake2, pointwise = self.block
        streaming = states is not None and conv.state_slot is not None
        state, slots = layer_context(states, conv.state_slot)
        if not vae_conv.depthwise_conv_supported(x, state, conv.weight, conv.bias, conv.dilation[0], slots):
            return None
        h, new_state = vae_conv.causal_depthwise_conv(x, state, conv.weight, conv.bias, conv.dilation[0], snake2.alpha,
                                                   slots, in_alpha=snake1.alpha, in_shift=pending)
        if streaming and slots is None:
            states[conv.state_slot] = new_state
        out = vae_conv.pointwise_conv_residual(h, pointwise.weight, None, x)
        bias = pointwise.bias
        return out, (bias if pending is None else pending if bias is None else pending + bias)


class EncoderBlock(nn.Module):
    def __init__(self, out_dim: int, stride: int, groups: int, version: int) -> None:
        super().__init__()
        in_dim = out_dim // 2
        # Official: padding=ceil(s/2), output_padding=s%2, left pad = 2*padding - output_padding;
        # the v1 causal conv has no output_padding.
        left_pad = 2 * math.ceil(stride / 2) - (stride % 2 if version >= 2 else 0)
        self.block = _Chain([
            ResidualUnit(in_dim, 1, groups),
            ResidualUnit(in_dim, 3, groups),
            ResidualUnit(in_dim, 9, groups),
            Snake1d(in_dim),
            CausalConv1d(in_dim, out_dim, 2 * stride, left_pad=left_pad, stride=stride),
        ])

    def forward(self, x: Tensor, states: StreamStates | None = None) -> Tensor:
        return self.block(x, states)


class Encoder(nn.Module):
    def __init__(self, d_model: int, latent_dim: int, rates: list[int], depthwise: bool,
                 version: int) -> None:
        super().__init__()
        layers: list[nn.Module] = [CausalConv1d(1, d_model, 7, left_pad=6)]
        for stride in rates:
            d_model *= 2
            layers.append(EncoderBlock(d_model, stride, d_model // 2 if depthwise else 1, version))
        # Registered before `block` to mirror the official state_dict order.
        self.fc_mu = CausalConv1d(d_model, latent_dim, 3, left_pad=2)
        self.fc_logvar = CausalConv1d(d_model, latent_dim, 3, left_pad=2)  # unused, kept for loading
        self.block = _Chain(layers)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc_mu(self.block(x))


class NoiseBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.linear = CausalConv1d(dim, dim, 1, left_pad=0, bias=False)

    def forward(self, x: Tensor, states: StreamStates | None = None) -> Tensor:
        noise = torch.randn((x.shape[0], 1, x.shape[-1]), device=x.device, dtype=x.dtype)
        return x + noise * self.linear(x)


class DecoderBlock(nn.Module):
    def __init__(self, in_dim: int, out_dim: int, stride: int, groups: int, use_noise_block: bool) -> None:
        super().__init__()
        layers: list[nn.Module] = [
            Snake1d(in_dim),
            # padding=ceil(s/2), output_padding=s%2 -> right trim 2*ceil(s/2) - s%2 (= s)
            CausalConvTranspose1d(in_dim, out_dim, 2 * stride, stride,
                                  2 * math.ceil(stride / 2) - stride % 2),
        ]
        if use_noise_block:
            layers.append(NoiseBlock(out_dim))
        layers += [ResidualUnit(out_dim, 1, groups), ResidualUnit(out_dim, 3, groups),
                   ResidualUnit(out_dim, 9, groups)]
        self.block = _Chain(layers)
        self.input_channels = in_dim
        self.deferrable = not use_noise_block and all(unit.fusable for unit in layers[2:])

    def forward(self, x: Tensor, states: StreamStates | None = None) -> Tensor:
        return self.block(x, states)

    def forward_deferred(self, x: Tensor, states: StreamStates | None, scale: Tensor | None,
                         shift: Tensor | None) -> tuple[Tensor, Tensor | None]:
        """The block of the input x * scale + shift (per-channel, each optional, applied inside the Snake kernel)
        with the residual units' biases left out: (y, bias) with output = y + bias (see ResidualUnit)."""
        activation, upsample, *units = self.block
        x = upsample(snake(x, activation.alpha, scale, shift), states)
        pending = None
        for unit in units:
            y = unit.forward_deferred(x, states, pending)
            if y is None:  # the conv kernel does not apply: this unit the plain way, its input made whole
                x, pending = unit(x if pending is None else x + pending[:, None], states), None
            else:
                x, pending = y
        return x, pending


class SampleRateConditionLayer(nn.Module):
    """v2: per-channel conditioning on the output sample-rate bucket (time-invariant, so stateless)."""

    def __init__(self, dim: int, buckets: int, cond_type: str, cond_dim: int, out_layer: bool) -> None:
        super().__init__()
        self.cond_type = cond_type
        out_in_dim = dim
        if cond_type in ("scale_bias", "scale_bias_init"):
            self.scale_embed = embedding(buckets, dim)
            self.bias_embed = embedding(buckets, dim)
        elif cond_type == "add":
            self.cond_embed = embedding(buckets, dim)
        elif cond_type == "concat":
            if not out_layer:
                raise ValueError("cond_type 'concat' needs cond_out_layer=True")
            self.cond_embed = embedding(buckets, cond_dim)
            out_in_dim = dim + cond_dim
        else:
            raise ValueError(f"invalid cond_type {cond_type!r}")
        self.out_layer = (_Chain([Snake1d(out_in_dim), CausalConv1d(out_in_dim, dim, 1, left_pad=0)])
                          if out_layer else None)

    @property
    def is_affine(self) -> bool:
        """Whether the layer is a per-channel x * scale + shift (what `affine` returns)."""
        return self.out_layer is None and self.cond_type in ("scale_bias", "scale_bias_init", "add")

    def affine(self, sr_idx: int) -> tuple[Tensor | None, Tensor]:
        """(scale or None, shift), each (C,), of an `is_affine` layer for one bucket."""
        if self.cond_type == "add":
            return None, self.cond_embed.weight[sr_idx]
        return self.scale_embed.weight[sr_idx], self.bias_embed.weight[sr_idx]

    @staticmethod
    def _lookup(emb: nn.Embedding, sr_idx: int | Tensor) -> Tensor:
        # int index -> [1, C, 1] (broadcasts over batch); LongTensor [B] -> [B, C, 1]
        w = emb.weight[sr_idx]
        return (w if w.dim() == 2 else w[None]).unsqueeze(-1)

    def forward(self, x: Tensor, sr_idx: int | Tensor, states: StreamStates | None = None) -> Tensor:
        if self.cond_type in ("scale_bias", "scale_bias_init"):
            x = x * self._lookup(self.scale_embed, sr_idx) + self._lookup(self.bias_embed, sr_idx)
        elif self.cond_type == "add":
            x = x + self._lookup(self.cond_embed, sr_idx)
        else:
            c = self._lookup(self.cond_embed, sr_idx)
            x = torch.cat([x, c.expand(x.shape[0], -1, x.shape[-1])], dim=1)
        return x if self.out_layer is None else self.out_layer(x, states)


class Decoder(nn.Module):
    def __init__(self, cfg: AudioVAEConfig, latent_dim: int) -> None:
        super().__init__()
        ch = cfg.decoder_dim
        if cfg.depthwise:
            layers: list[nn.Module] = [
                CausalConv1d(latent_dim, latent_dim, 7, left_pad=6, groups=latent_dim),
                CausalConv1d(latent_dim, ch, 1, left_pad=0),
            ]
        else:
            layers = [CausalConv1d(latent_dim, ch, 7, left_pad=6)]
        out_dim = ch
        for i, stride in enumerate(cfg.decoder_rates):
            in_dim, out_dim = ch // 2**i, ch // 2 ** (i + 1)
            layers.append(DecoderBlock(in_dim, out_dim, stride, out_dim if cfg.depthwise else 1,
                                       cfg.use_noise_block))
        layers += [Snake1d(out_dim), CausalConv1d(out_dim, 1, 7, left_pad=6), _Tanh()]

        self.model = _Chain(layers)
        self.sr_boundaries: list[int] | None = cfg.sr_bin_boundaries
        if cfg.sr_bin_boundaries is None:
            self.sr_bin_boundaries = None
            self.sr_cond_model = None
        else:
            # Persistent like the official buffer (it is in the official state_dict). Bucketing itself
            # uses the Python copy `sr_boundaries` (no host/device traffic per decode call); it is
            # refreshed from the buffer after a checkpoint load, as the official bucketizes on the buffer.
            self.register_buffer("sr_bin_boundaries", torch.tensor(cfg.sr_bin_boundaries, dtype=torch.int32))
            self.register_load_state_dict_post_hook(Decoder._sync_sr_boundaries)
            buckets = len(cfg.sr_bin_boundaries) + 1
            self.sr_cond_model = nn.ModuleList([
                SampleRateConditionLayer(layer.input_channels, buckets, cfg.cond_type, cfg.cond_dim,
                                         cfg.cond_out_layer)
                if isinstance(layer, DecoderBlock) else None
                for layer in layers
            ])

        # Whether the CUDA kernel path (`_forward_deferred`) fits this layout: fixed by the config, so decided once.
        self.deferrable = (all(layer.deferrable for layer in layers if isinstance(layer, DecoderBlock))
                           and all(cond.is_affine for cond in self.sr_cond_model or [] if cond is not None))

        # Fixed slot per stateful layer (module order); shapes let a stream allocate its states.
        self.state_shapes: list[tuple[int, int]] = []
        for m in self.modules():
            if isinstance(m, (CausalConv1d, CausalConvTranspose1d)) and m.state_shape() is not None:
                m.state_slot = len(self.state_shapes)
                self.state_shapes.append(m.state_shape())

    @staticmethod
    def _sync_sr_boundaries(module: nn.Module, incompatible_keys: Any) -> None:
        module.sr_boundaries = [int(b) for b in module.sr_bin_boundaries.tolist()]

    def sr_index(self, sample_rate: int) -> int:
        """Bucket of `sample_rate`; equals torch.bucketize(sr, boundaries) (right=False)."""
        assert self.sr_boundaries is not None
        return bisect_left(self.sr_boundaries, sample_rate)

    def forward(self, x: Tensor, sr_idx: int | Tensor | None = None,
                states: StreamStates | None = None) -> Tensor:
        if self.sr_cond_model is not None and sr_idx is None:
            raise ValueError("sample-rate conditioned decoder needs sr_idx")
        conds = list(self.sr_cond_model) if self.sr_cond_model is not None else [None] * len(self.model)
        if self.deferrable and not isinstance(sr_idx, Tensor) and platform.kernels(x):
            return self._forward_deferred(x, sr_idx, states, conds)
        for layer, cond in zip(self.model, conds, strict=True):
            if cond is not None:
                x = cond(x, sr_idx, states)
            x = layer(x, states)
        return x

    def _forward_deferred(self, x: Tensor, sr_idx: int | None, states: StreamStates | None,
                          conds: list[SampleRateConditionLayer | None]) -> Tensor:
        """The CUDA kernel path: each residual unit's output bias and each block's sample-rate condition are
        applied inside the next Snake kernel (a per-channel shift / scale) instead of as passes of their own
        over the activations (~30 full-size passes per step)."""
        pending: Tensor | None = None  # per-channel bias not yet added to x
        for layer, cond in zip(self.model, conds, strict=True):
            if isinstance(layer, DecoderBlock):
                scale, shift = cond.affine(sr_idx) if cond is not None and sr_idx is not None else (None, None)
                if pending is not None:  # (x + pending) * scale + shift
                    shift = (pending if scale is None else pending * scale) + (0 if shift is None else shift)
                x, pending = layer.forward_deferred(x, states, scale, shift)
            elif isinstance(layer, Snake1d) and pending is not None:
                x, pending = snake(x, layer.alpha, shift=pending), None
            else:
                if pending is not None:
                    x, pending = x + pending[:, None], None
                x = layer(x, states)
        return x if pending is None else x + pending[:, None]


# --------------------------------------------------------------------------------------------------
# VAE
# --------------------------------------------------------------------------------------------------


class AudioVAE(nn.Module):
    def __init__(self, config: AudioVAEConfig, version: int) -> None:
        super().__init__()
        if version not in (1, 2):
            raise ValueError(f"unknown audio VAE version {version}")
        if version == 1 and config.sr_bin_boundaries is not None:
            raise ValueError("v1 VAE has no sample-rate conditioning")
        self.config = config
        self.version = version
        self.latent_dim: int = config.latent_dim or config.encoder_dim * 2 ** len(config.encoder_rates)
        self.sample_rate: int = config.sample_rate
        self.out_sample_rate: int = config.out_sample_rate or config.sample_rate
        self.chunk_size: int = math.prod(config.encoder_rates)  # samples per latent frame (encode rate)
        self.decode_chunk_size: int = math.prod(config.decoder_rates)  # samples per frame (output rate)
        self.encoder = Encoder(config.encoder_dim, self.latent_dim, config.encoder_rates, config.depthwise,
                               version)
        self.decoder = Decoder(config, self.latent_dim)

    def encode(self, audio: Tensor, sample_rate: int | None = None) -> Tensor:
        """[B, T] or [B, 1, T] audio at `sample_rate` -> mu [B, latent_dim, ceil(T / chunk_size)]."""
        if sample_rate is not None and sample_rate != self.sample_rate:
            raise ValueError(f"VAE encodes {self.sample_rate} Hz audio, got {sample_rate} Hz")
        if audio.dim() == 2:
            audio = audio.unsqueeze(1)
        # Right-pad to whole frames like the official preprocess.
        audio = F.pad(audio, (0, -audio.shape[-1] % self.chunk_size))
        return self.encoder(audio)

    def _sr_idx(self, out_sample_rate: int | None) -> int | None:
        if self.decoder.sr_cond_model is None:
            return None
        return self.decoder.sr_index(out_sample_rate or self.out_sample_rate)

    def decode(self, z: Tensor, out_sample_rate: int | None = None) -> Tensor:
        """Latents [B, latent_dim, T] -> audio [B, 1, T * decode_chunk_size] at `out_sample_rate`.

        `out_sample_rate` only selects the v2 condition bucket (default: the config's output rate).
        """
        return self.decoder(z, self._sr_idx(out_sample_rate))

    def streaming_decoder(self, batch_size: int = 1, out_sample_rate: int | None = None) -> StreamingDecoder:
        return StreamingDecoder(self, batch_size, out_sample_rate)


class StreamingDecoder:
    """Exact chunk-wise decode: carries each causal layer's left context between calls.

    Each `decode_chunk` runs the decoder only on the new latent frames plus the carried context
    (O(chunk) work) and the concatenated outputs equal `AudioVAE.decode` of the concatenated latents.
    `states` is a plain list of [batch, channels, context] tensors (one per stateful layer), so a
    batched scheduler can stack/select streams along dim 0 and reuse `Decoder.forward` directly.
    """

    def __init__(self, vae: AudioVAE, batch_size: int = 1, out_sample_rate: int | None = None) -> None:
        self.vae = vae
        self.batch_size = batch_size
        self.sr_idx = vae._sr_idx(out_sample_rate)
        self.states: StreamStates = []
        self.reset()

    def reset(self) -> None:
        p = next(self.vae.decoder.parameters())
        self.states = [torch.zeros(self.batch_size, c, n, device=p.device, dtype=p.dtype)
                       for c, n in self.vae.decoder.state_shapes]

    @torch.no_grad()
    def decode_chunk(self, z: Tensor, discard: bool = False) -> Tensor:
        """Latents [B, latent_dim, t] -> audio [B, 1, t * decode_chunk_size] (empty if `discard`)."""
        if z.shape[0] != self.batch_size:
            raise ValueError(f"stream batch is {self.batch_size}, got latents for {z.shape[0]}")
        if z.shape[-1] == 0:  # nothing new: keep the state untouched (convs cannot run on it anyway)
            return z.new_zeros(z.shape[0], 1, 0)
        audio = self.vae.decoder(z, self.sr_idx, self.states)
        return audio[..., :0] if discard else audio

    def prime(self, z: Tensor) -> None:
        """Feed context latents (e.g. the last prompt patches in continuation mode); audio is dropped."""
        self.decode_chunk(z, discard=True)
