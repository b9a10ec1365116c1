"""The audio VAE's decoder: its blocks, the v2 sample-rate condition, and the decode over stream states (chunk-wise,
exact), with its CUDA kernel path that folds each residual unit's output bias and each block's condition into the
next Snake kernel."""

from __future__ import annotations

import math
from bisect import bisect_left
from typing import Any

import torch
from torch import Tensor, nn

from engine.config import AudioVAEConfig
from engine.models.minicpm import embedding
from engine.models.vae_layers import CausalConv1d, CausalConvTranspose1d, Chain, ResidualUnit, Snake1d, StreamStates
from engine.ops import platform
from engine.ops.snake import snake


class _Tanh(nn.Module):
    def forward(self, x: Tensor, states: StreamStates | None = None) -> Tensor:
        return torch.tanh(x)


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
        layers += [ResidualUnit(out_dim, dilation, groups, fp16_gemm=True) for dilation in (1, 3, 9)]
        self.block = Chain(layers)
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
        self.out_layer = (Chain([Snake1d(out_in_dim), CausalConv1d(out_in_dim, dim, 1, left_pad=0)])
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

        self.model = Chain(layers)
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
