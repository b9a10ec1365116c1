"""Causal audio VAE of the VoxCPM family (v1: VoxCPM-0.5B / VoxCPM1.5, v2: VoxCPM2).

Architecture facts (layer layout, paddings, snake activation, sample-rate conditioning) follow the
official `voxcpm.modules.audiovae` so that official checkpoints load with identical parameter names.
Differences on purpose:

* weight-normed convolutions hold one fused `weight` (see `fuse_weight_norm`): inference never
  needs the g/v split, and a plain weight is cheaper and friendlier to compilation.
* streaming decode is an explicit stateful forward (`StreamingDecoder`) instead of patching modules.

Version differences: v1's causal conv ignores `output_padding` (so the odd-stride encoder downsampling
convs get one extra left-pad sample); v2 adds a sample-rate condition layer before every decoder block.

Here: the weights' loading (weight norm), the encoder, the VAE and its streaming decoder. The causal layers both
halves share and their stream states are `vae_layers`, the decoder is `vae_decoder`, the config `AudioVAEConfig`.
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine import options
from engine.config import AudioVAEConfig
from engine.models.vae_decoder import Decoder
from engine.models.vae_layers import CausalConv1d, Chain, ResidualUnit, Snake1d, StreamStates

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


class EncoderBlock(nn.Module):
    def __init__(self, out_dim: int, stride: int, groups: int, version: int) -> None:
        super().__init__()
        in_dim = out_dim // 2
        # Official: padding=ceil(s/2), output_padding=s%2, left pad = 2*padding - output_padding;
        # the v1 causal conv has no output_padding.
        left_pad = 2 * math.ceil(stride / 2) - (stride % 2 if version >= 2 else 0)
        self.block = Chain([
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
        self.block = Chain(layers)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc_mu(self.block(x))


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


def probe_audio(sample_rate: int, seconds: float = 1.0) -> Tensor:
    """A loud voiced test signal (1, T): a 140 Hz voice (its fundamental and eleven harmonics) with a vibrato, under
    syllable-rate swells, breath noise between them, peaking near full scale (larger activations test a decoder's
    range harder)."""
    t = torch.arange(int(seconds * sample_rate), dtype=torch.float64) / sample_rate
    phase = 2 * math.pi * (140.0 * t + 0.4 * torch.sin(2 * math.pi * 5.0 * t))  # +-12.6 Hz of vibrato, 5 times a second
    voice = sum(torch.sin(k * phase) / k for k in range(1, 13))
    swell = torch.sin(math.pi * 4.0 * t) ** 2  # four syllables a second
    noise = torch.randn(t.numel(), generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    x = swell * voice + 0.05 * (1 - swell) * noise
    return (0.95 * x / x.abs().max()).to(torch.float32).unsqueeze(0)


# What decoder_snr_db reports for identical audio (JSON, where the result goes, has no infinity).
IDENTICAL_DB = 200.0


@contextlib.contextmanager
def _full_fp32_matmuls() -> Iterator[None]:
    """This process's float32 matmuls without TF32 for the block (cuBLAS runs the convolutions when cuDNN is off; an
    engine built earlier turns TF32 on), as they were after. A process on torch's newer fp32_precision API refuses the
    legacy flag: its own choice then stands."""
    try:
        before = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = False
    except RuntimeError:
        yield
        return
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before


@torch.no_grad()
def decoder_snr_db(vae: AudioVAE, dtype: torch.dtype) -> float:
    """How far the VAE decoder's audio in `dtype` is from float32's, in dB (-inf: not finite; IDENTICAL_DB at most),
    on the latents that the model's own encoder makes of `probe_audio`: what this model's weights do to the dtype's
    range and rounding. On a copy of the float32 decoder; eager torch ops (no Triton kernel to compile: the options
    are this process's, so for the check's ~0.4 s another engine here runs eager too), float32 matmuls without TF32,
    and no cuDNN (H200, full-size VoxCPM2: its float16 convs' first calls took 1.4-1.9 s of start-up, the check
    without it 0.4 s the first time, 0.03 s after). A float32 decode that is silent or not finite raises ValueError."""
    device = next(vae.parameters()).device
    with (options.override(fuse=False, vae_fp16_gemm=False), torch.backends.cudnn.flags(enabled=False),
          _full_fp32_matmuls()):
        z = vae.encode(probe_audio(vae.sample_rate).to(device))
        ref = vae.decode(z).double()
        cast = copy.deepcopy(vae.decoder).to(dtype)
        out = cast(z.to(dtype), vae._sr_idx(None)).double()
    power = float((ref**2).sum())
    if not (math.isfinite(power) and power > 0):
        state = "silent" if power == 0 else "not finite"
        raise ValueError(f"the VAE decoder's float32 audio of the test clip is {state}: no precision to check")
    err = float(((out - ref) ** 2).sum())
    if not math.isfinite(err):
        return -math.inf
    return min(IDENTICAL_DB, 10 * math.log10(power / err)) if err > 0 else IDENTICAL_DB
