"""Checkpoint configuration: `config.json` of an official VoxCPM checkpoint, parsed into dataclasses.

Field names and defaults follow the released configs of each family. Unknown keys are ignored (real
checkpoints carry extras such as `device`), missing required ones raise a `ConfigError` naming them.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.engine_config import DTYPE_NAMES

if TYPE_CHECKING:
    import torch


class ConfigError(ValueError):
    """config.json is missing, unreadable or lacks a required field."""


# Family defaults where config.json may omit a field (values of the official package).
FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "voxcpm": {"patch_size": 2, "residual_lm_num_layers": 6, "scalar_quantization_latent_dim": 256,
               "max_length": 4096, "decode_context_patches": 2},
    "voxcpm2": {"patch_size": 4, "residual_lm_num_layers": 8, "scalar_quantization_latent_dim": 512,
                "max_length": 8192, "decode_context_patches": 3},
}

def dtype_name(name: str) -> str:
    """The torch attribute a dtype name of DTYPE_NAMES stands for ("bf16" -> "bfloat16"); no torch needed (the
    service's supervisor parses configs before it ever imports torch)."""
    if name not in DTYPE_NAMES:
        raise ConfigError(f"dtype {name!r} is not one of {sorted(DTYPE_NAMES)}")
    return DTYPE_NAMES[name]


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    import torch

    if isinstance(name, torch.dtype):
        return name
    return getattr(torch, dtype_name(name))


@dataclass
class TransformerConfig:
    """One MiniCPM4 stack (base LM, residual LM, local encoder or local DiT)."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    num_hidden_layers: int
    rms_norm_eps: float
    vocab_size: int = 0
    rope_theta: float = 10000.0
    max_position_embeddings: int = 32768
    rope_scaling: dict[str, Any] | None = None
    kv_channels: int | None = None
    use_mup: bool = True
    scale_emb: float = 1.0
    scale_depth: float = 1.0
    no_rope: bool = False

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def residual_scale(self) -> float:
        """muP scales each residual branch by scale_depth / sqrt(layers)."""
        return self.scale_depth / math.sqrt(self.num_hidden_layers) if self.use_mup else 1.0


@dataclass
class VoxCPMConfig:
    architecture: str  # "voxcpm" (0.5B, 1.5) or "voxcpm2"
    lm: TransformerConfig
    residual_lm: TransformerConfig
    encoder: TransformerConfig
    dit: TransformerConfig
    patch_size: int
    feat_dim: int
    fsq_latent_dim: int
    fsq_scale: int
    dit_mean_mode: bool
    max_length: int
    dtype: str  # the torch attribute of the weights' dtype ("bfloat16"); parse_dtype makes it a torch dtype
    decode_context_patches: int  # prompt patches decoded as VAE left context in continuation mode
    audio_vae: dict[str, Any] | None = None
    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def version(self) -> int:
        return 2 if self.architecture == "voxcpm2" else 1

    @property
    def scale_emb(self) -> float:
        return self.lm.scale_emb if self.lm.use_mup else 1.0

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> VoxCPMConfig:
        arch = str(d.get("architecture", "voxcpm")).lower()
        if arch not in FAMILY_DEFAULTS:
            raise ConfigError(f"config.json architecture {arch!r} is not one of {sorted(FAMILY_DEFAULTS)}")
        defaults = FAMILY_DEFAULTS[arch]
        get = lambda k: d.get(k, defaults.get(k))  # noqa: E731
        if "lm_config" not in d:
            raise ConfigError("config.json has no 'lm_config'")
        lm = _transformer(d["lm_config"], "lm_config")
        residual = replace(lm, num_hidden_layers=int(get("residual_lm_num_layers")), vocab_size=0,
                           no_rope=bool(d.get("residual_lm_no_rope", False)))
        enc_d, dit_d = d.get("encoder_config", {}), d.get("dit_config", {})
        if arch == "voxcpm2":
            mean_mode = bool(dit_d.get("dit_mean_mode", False))
        else:
            mean_mode = bool(d.get("dit_mean_mode", False))
        return cls(
            architecture=arch,
            lm=lm,
            residual_lm=residual,
            encoder=_local(lm, enc_d),
            dit=_local(lm, dit_d),
            patch_size=int(get("patch_size")),
            feat_dim=int(d.get("feat_dim", 64)),
            fsq_latent_dim=int(get("scalar_quantization_latent_dim")),
            fsq_scale=int(d.get("scalar_quantization_scale", 9)),
            dit_mean_mode=mean_mode,
            max_length=int(get("max_length")),
            dtype=dtype_name(str(d.get("dtype", "bfloat16"))),
            decode_context_patches=int(defaults["decode_context_patches"]),
            audio_vae=d.get("audio_vae_config"),
            raw=d,
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> VoxCPMConfig:
        p = Path(path) / "config.json"
        if not p.is_file():
            raise ConfigError(f"{path} is not a VoxCPM checkpoint directory: no config.json")
        try:
            d = json.loads(p.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as e:
            raise ConfigError(f"{p} is not valid JSON: {e}") from e
        return cls.from_dict(d)


# The audio VAE's official defaults per version (v1: VoxCPM-0.5B / VoxCPM1.5, v2: VoxCPM2).
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
    """The audio VAE's `audio_vae_config` (`VoxCPMConfig.audio_vae`), with the official defaults of its version."""

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


_REQUIRED_LM = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                "num_hidden_layers", "rms_norm_eps", "vocab_size")


def _transformer(d: dict[str, Any], where: str) -> TransformerConfig:
    missing = [k for k in _REQUIRED_LM if k not in d]
    if missing:
        raise ConfigError(f"config.json {where} lacks {missing}")
    names = TransformerConfig.__dataclass_fields__
    return TransformerConfig(**{k: v for k, v in d.items() if k in names})


def _local(lm: TransformerConfig, d: dict[str, Any]) -> TransformerConfig:
    """LocEnc / LocDiT: the LM config with the sizes of the local module (official defaults 1024/4096/16/4)."""
    return replace(
        lm,
        hidden_size=int(d.get("hidden_dim", 1024)),
        intermediate_size=int(d.get("ffn_dim", 4096)),
        num_attention_heads=int(d.get("num_heads", 16)),
        num_hidden_layers=int(d.get("num_layers", 4)),
        kv_channels=d.get("kv_channels"),
        vocab_size=0,
    )
