"""Random-weight checkpoints in the official layout, for tests, benchmarks and the demo service.

The tensor names and shapes come from the project's own model code (built on the meta device); the
VAE is written the way released checkpoints store it (audiovae.pth wrapping a state dict, weight norm
as weight_g / weight_v) unless safetensors is asked for. The official package loads what this writes
with no missing or unexpected keys (tests/test_io_checkpoint.py checks it).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from engine.config import AudioVAEConfig, VoxCPMConfig, parse_dtype
from engine.io.tokenizer_builder import build_tokenizer
from engine.models import build_backbone
from engine.models.audio_vae import AudioVAE

PRESET_DIR = Path(__file__).parent / "presets"


def _tiny_lm(vocab: int, layers: int, use_mup: bool) -> dict[str, Any]:
    head_dim = 16
    factors = [1.0 + 0.05 * i for i in range(head_dim // 2)]
    return {
        "bos_token_id": 1, "eos_token_id": 2, "hidden_size": 64, "intermediate_size": 128,
        "max_position_embeddings": 4096, "num_attention_heads": 4, "num_hidden_layers": layers,
        "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "rope_theta": 10000, "kv_channels": head_dim,
        "rope_scaling": {"type": "longrope", "long_factor": factors, "short_factor": factors,
                         "original_max_position_embeddings": 4096},
        "vocab_size": vocab, "use_mup": use_mup, "scale_emb": 12, "dim_model_base": 256, "scale_depth": 1.4,
    }


def _tiny_local(layers: int) -> dict[str, Any]:
    return {"hidden_dim": 32, "ffn_dim": 64, "num_heads": 2, "num_layers": layers, "kv_channels": 16}


def _cfm() -> dict[str, Any]:
    return {"sigma_min": 1e-6, "solver": "euler", "t_scheduler": "log-norm", "inference_cfg_rate": 2.0}


def _tiny(arch: str, patch: int, vae: dict[str, Any]) -> dict[str, Any]:
    v2 = arch == "voxcpm2"
    dit = {**_tiny_local(2), "cfm_config": _cfm(), **({"mean_mode": False} if v2 else {})}
    return {
        "architecture": arch, "lm_config": _tiny_lm(2048, 2, use_mup=not v2), "patch_size": patch,
        "feat_dim": 64, "scalar_quantization_latent_dim": 16, "scalar_quantization_scale": 9,
        "residual_lm_num_layers": 2, **({"residual_lm_no_rope": True} if v2 else {}),
        "encoder_config": _tiny_local(1), "dit_config": dit,
        "audio_vae_config": {"encoder_dim": 8, "latent_dim": 64, **vae},
        "max_length": 2048, "device": "cuda", "dtype": "bfloat16",
    }


# Tiny presets keep each family's real sample rates, patch sizes and VAE strides; only widths shrink.
TINY = {
    "tiny-voxcpm2": lambda: _tiny("voxcpm2", 4, {
        "encoder_rates": [2, 5, 8, 8], "decoder_dim": 128, "decoder_rates": [8, 6, 5, 2, 2, 2],
        "sr_bin_boundaries": [20000, 30000, 40000], "sample_rate": 16000, "out_sample_rate": 48000}),
    "tiny-voxcpm1.5": lambda: _tiny("voxcpm", 4, {
        "encoder_rates": [2, 3, 6, 7, 7], "decoder_dim": 64, "decoder_rates": [7, 7, 6, 3, 2], "sample_rate": 44100}),
    "tiny-voxcpm0.5b": lambda: _tiny("voxcpm", 2, {
        "encoder_rates": [2, 5, 8, 8], "decoder_dim": 64, "decoder_rates": [8, 8, 5, 2], "sample_rate": 16000}),
}


# Full-size presets: shapes of the released models, for benchmarks. voxcpm2.json is the released VoxCPM2
# config; voxcpm0.5b.json has VoxCPM-0.5B's published sizes (LM 1024/4096/24 layers, 16/2 heads, patch 2,
# FSQ 256, residual 6 layers, 4-layer LocEnc/DiT, default v1 VAE) with local-module widths and RoPE
# factors assumed (1024 wide, head_dim 64): speed depends on the shapes, not on these values.
FULL = {"full-voxcpm2": "voxcpm2.json", "full-voxcpm0.5b": "voxcpm0.5b.json"}
PRESETS = (*TINY, *FULL)


def preset_config(name: str) -> dict[str, Any]:
    if name in FULL:
        return json.loads((PRESET_DIR / FULL[name]).read_text())
    if name in TINY:
        return TINY[name]()
    raise ValueError(f"unknown preset {name!r}; choose from {', '.join(PRESETS)}")


def _init(name: str, shape: torch.Size, gen: torch.Generator) -> torch.Tensor:
    """Unit-gain random weights, so that every input (text, prompt audio, reference) visibly shapes the
    output: with the usual 0.02 init a tiny model's latents are little more than its noise."""
    if name.endswith("norm.weight"):
        return torch.ones(shape)
    if name.endswith(".alpha") or name.endswith("scale_embed.weight"):
        return 1.0 + 0.1 * torch.randn(shape, generator=gen)
    if len(shape) == 2 and not name.endswith("embed_tokens.weight"):
        return torch.randn(shape, generator=gen) * shape[1] ** -0.5
    if name.endswith("embed_tokens.weight") or name.endswith("special_token"):
        return torch.randn(shape, generator=gen)
    return torch.randn(shape, generator=gen) * 0.02


def random_backbone_state(cfg: VoxCPMConfig, seed: int, stop: str, dtype: torch.dtype,
                          progress: bool = False) -> dict[str, torch.Tensor]:
    with torch.device("meta"):
        model = build_backbone(cfg)
    gen = torch.Generator().manual_seed(seed)
    shapes = {k: v.shape for k, v in model.state_dict().items()}
    state: dict[str, torch.Tensor] = {}
    for name, shape in _progress(shapes.items(), progress, "model weights"):
        state[name] = _init(name, shape, gen).to(dtype)
    h = cfg.lm.hidden_size
    if stop != "random":
        # The stop head reads silu(stop_proj(h)); a constant positive input and opposite rows make
        # one class win at every step whatever h is.
        state["stop_proj.weight"] = torch.zeros(h, h, dtype=dtype)
        state["stop_proj.bias"] = torch.full((h,), 2.0, dtype=dtype)
        sign = 1.0 if stop == "never" else -1.0
        state["stop_head.weight"] = torch.stack((torch.full((h,), sign), torch.full((h,), -sign))).to(dtype)
    return state


def random_vae_state(vae_cfg: AudioVAEConfig, version: int, seed: int) -> dict[str, torch.Tensor]:
    """Official naming: every conv weight is weight-normed (weight_g, weight_v)."""
    with torch.device("meta"):
        vae = AudioVAE(vae_cfg, version=version)
    gen = torch.Generator().manual_seed(seed + 1)
    state: dict[str, torch.Tensor] = {}
    for name, t in vae.state_dict().items():
        if name.endswith(".weight") and t.dim() == 3:
            # Each output filter gets norm g in [0.4, 0.8]: signals neither vanish nor saturate the final tanh.
            stem = name[: -len("weight")]
            state[stem + "weight_g"] = 0.4 + 0.4 * torch.rand((t.shape[0], 1, 1), generator=gen)
            state[stem + "weight_v"] = torch.randn(t.shape, generator=gen)
        elif t.is_floating_point():
            state[name] = _init(name, t.shape, gen)
        else:
            state[name] = torch.empty(t.shape, dtype=t.dtype).copy_(_known_buffer(vae, name))
    return state


def _known_buffer(vae: AudioVAE, name: str) -> torch.Tensor:
    cfg = vae.config
    if name.endswith("sr_bin_boundaries") and cfg.sr_bin_boundaries is not None:
        return torch.tensor(cfg.sr_bin_boundaries, dtype=torch.int32)
    raise ValueError(f"no value for VAE buffer {name}")


def _progress(items: Iterable, enabled: bool, desc: str) -> Iterable:
    if not enabled:
        return items
    from tqdm import tqdm

    items = list(items)
    return tqdm(items, desc=desc, unit="tensor")


def make_random_checkpoint(out_dir: str | Path, preset: str = "tiny-voxcpm2", seed: int = 0,
                           stop: str = "random", vae_format: str = "pth", progress: bool = False,
                           config_overrides: dict[str, Any] | None = None) -> Path:
    """Write a random-weight checkpoint; returns its directory.

    stop: "random" (the random stop head decides), "never" (fixed-length generation, benchmarks) or
    "always" (stops as soon as min_len allows). vae_format: "pth" (as released) or "safetensors".
    """
    if stop not in ("random", "never", "always"):
        raise ValueError(f"stop must be random, never or always, not {stop!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    raw = copy.deepcopy(preset_config(preset))
    for key, value in (config_overrides or {}).items():
        raw[key] = value
    cfg = VoxCPMConfig.from_dict(raw)
    build_tokenizer(out, vocab_size=min(cfg.lm.vocab_size, 4096), seed=seed)
    state = random_backbone_state(cfg, seed, stop, parse_dtype(cfg.dtype), progress)
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    vae_cfg = AudioVAEConfig.from_dict(cfg.audio_vae, version=cfg.version)
    vae_state = random_vae_state(vae_cfg, cfg.version, seed)
    if vae_format == "pth":
        torch.save({"state_dict": vae_state}, out / "audiovae.pth")
    elif vae_format == "safetensors":
        save_file(vae_state, out / "audiovae.safetensors")
    else:
        raise ValueError(f"vae_format must be pth or safetensors, not {vae_format!r}")
    (out / "config.json").write_text(json.dumps(raw, indent=2))
    return out
