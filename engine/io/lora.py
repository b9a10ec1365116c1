"""LoRA adapters in the official VoxCPM training format, checked against a loaded model and merged into its weights.

The format (OpenBMB/VoxCPM training): a directory with `lora_weights.safetensors` (or `lora_weights.ckpt`, a torch
file holding a `state_dict`) and `lora_config.json` = {"base_model": ..., "lora_config": {...}}; or the weights file
itself, its config beside it. Keys are `<module path>.lora_A` ([r, in]) and `.lora_B` ([out, r]); the adapted layer
computes x W^T + (x A^T B^T) * alpha / r. Prefixes that training wrappers add (`_orig_mod.`, `base_model.model.`,
`model.`, `module.`) are stripped, and PEFT-style `.lora_A.weight` keys are accepted.

Merging (W += B A * alpha / r, once, at load) costs nothing per step and leaves every fused kernel, stacked layer
weight and CUDA graph as they are: they read the merged weights.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch import nn
else:
    from engine.lazy_torch import torch  # the supervisor fetches and hashes adapters before it spawns the workers

log = logging.getLogger(__name__)

WEIGHT_FILES = ("lora_weights.safetensors", "lora_weights.ckpt")
CONFIG_FILE = "lora_config.json"
CONFIG_MAX_BYTES = 1 << 20  # an adapter's config is a few hundred bytes: a larger file is no config (and is not read)
WRAPPER_PREFIXES = ("_orig_mod.", "base_model.model.", "model.", "module.")


class LoRAError(ValueError):
    """An adapter that cannot be used with this model; the message names the file or key."""


@dataclass(frozen=True)
class LoRAConfig:
    """The official training's LoRAConfig (the fields that matter for inference; dropout is training-only)."""

    enable_lm: bool = True  # the official loader's default when an adapter comes without a config
    enable_dit: bool = True
    enable_proj: bool = False
    r: int = 8
    alpha: float = 16
    target_modules_lm: tuple[str, ...] = ("q_proj", "v_proj", "k_proj", "o_proj")
    target_modules_dit: tuple[str, ...] = ("q_proj", "v_proj", "k_proj", "o_proj")
    target_proj_modules: tuple[str, ...] = ("enc_to_lm_proj", "lm_to_dit_proj", "res_to_dit_proj",
                                            "fusion_concat_proj")

    @classmethod
    def from_dict(cls, data: Any) -> LoRAConfig:
        """The official config's fields, each checked for its type (a rank 4.0 or "4" would fail a step, not this)."""
        if not isinstance(data, dict):
            raise LoRAError(f"lora_config: must be an object, got {type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        values = {k: tuple(v) if isinstance(v, list) else v for k, v in data.items() if k in known}
        r, alpha = values.get("r", cls.r), values.get("alpha", cls.alpha)
        if isinstance(r, bool) or not isinstance(r, int) or r < 1:
            raise LoRAError(f"lora_config: r must be an integer >= 1, got {r!r}")
        if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not math.isfinite(alpha):
            raise LoRAError(f"lora_config: alpha must be a finite number, got {alpha!r}")
        for name in ("enable_lm", "enable_dit", "enable_proj"):
            if not isinstance(values.get(name, True), bool):
                raise LoRAError(f"lora_config: {name} must be true or false, got {values[name]!r}")
        for name in ("target_modules_lm", "target_modules_dit", "target_proj_modules"):
            if name in values and not (isinstance(values[name], tuple)
                                       and all(isinstance(m, str) for m in values[name])):
                raise LoRAError(f"lora_config: {name} must be a list of module names, got {values[name]!r}")
        return cls(**values)

    @property
    def scale(self) -> float:
        return self.alpha / self.r


@dataclass
class LoRAAdapter:
    config: LoRAConfig
    pairs: dict[str, tuple[torch.Tensor, torch.Tensor]]  # module path -> (A [r, in], B [out, r]), float32
    source: str = ""


def _normalise(key: str) -> str:
    stripped = True
    while stripped:
        stripped = False
        for prefix in WRAPPER_PREFIXES:
            if key.startswith(prefix):
                key, stripped = key[len(prefix):], True
    for part in ("lora_A", "lora_B"):  # PEFT: `.lora_A.weight` (and `.lora_A.default.weight`)
        for suffix in (f".{part}.weight", f".{part}.default.weight"):
            if key.endswith(suffix):
                return key[: -len(suffix)] + f".{part}"
    return key


def _read_state(file: Path) -> dict[str, torch.Tensor]:
    try:
        if file.suffix == ".safetensors":
            from safetensors.torch import load_file

            return load_file(str(file), device="cpu")
        obj = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as e:  # a truncated or foreign file: several exception types
        raise LoRAError(f"{file}: not a readable adapter file ({type(e).__name__}: {e})") from e
    if isinstance(obj, dict) and isinstance(obj.get("state_dict"), dict):
        obj = obj["state_dict"]
    if not isinstance(obj, dict):
        raise LoRAError(f"{file}: holds a {type(obj).__name__}, not a state dict")
    return obj


def weights_file(path: str | Path) -> Path:
    """The weights file of an adapter directory (safetensors first), or `path` itself."""
    p = Path(path).expanduser()
    if p.is_dir():
        for name in WEIGHT_FILES:
            if (p / name).is_file():
                return p / name
        raise LoRAError(f"{p}: no {' or '.join(WEIGHT_FILES)} in this directory")
    if not p.is_file():
        raise LoRAError(f"{p}: no such adapter file or directory")
    return p


def read_adapter(path: str | Path) -> LoRAAdapter:
    """Read and check an adapter on its own terms (keys, pairs, ranks, finite values)."""
    file = weights_file(path)
    config_path = file.parent / CONFIG_FILE
    if config_path.is_file():
        if config_path.stat().st_size > CONFIG_MAX_BYTES:
            raise LoRAError(f"{CONFIG_FILE} is {config_path.stat().st_size} bytes: more than an adapter's config "
                            f"({CONFIG_MAX_BYTES})")
        try:
            raw = json.loads(config_path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise LoRAError(f"{config_path}: not valid JSON ({e})") from e
        config = LoRAConfig.from_dict(raw.get("lora_config", raw) if isinstance(raw, dict) else {})
    else:
        config = LoRAConfig()
        log.warning("%s: no %s beside it; using the official default (r=%d, alpha=%g, LM and DiT)", file,
                    CONFIG_FILE, config.r, config.alpha)
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in _read_state(file).items():
        name = _normalise(key)
        module, _, kind = name.rpartition(".")
        if kind not in ("lora_A", "lora_B") or not module:
            raise LoRAError(f"{key}: not a LoRA tensor (expected <module>.lora_A / <module>.lora_B)")
        if not torch.is_floating_point(tensor) or tensor.dim() != 2:
            raise LoRAError(f"{key}: expected a 2-D float tensor, got {tuple(tensor.shape)} {tensor.dtype}")
        if not torch.isfinite(tensor).all():
            raise LoRAError(f"{key}: contains NaN or infinity")
        parts.setdefault(module, {})[kind] = tensor.float()
    if not parts:
        raise LoRAError(f"{file}: holds no LoRA tensors")
    pairs = {}
    for module, got in sorted(parts.items()):
        if set(got) != {"lora_A", "lora_B"}:
            missing = ({"lora_A", "lora_B"} - set(got)).pop()
            raise LoRAError(f"{module}.{missing}: missing (every adapted module needs lora_A and lora_B)")
        a, b = got["lora_A"], got["lora_B"]
        if a.shape[0] != config.r or b.shape[1] != config.r:
            raise LoRAError(f"{module}.lora_A / lora_B: rank {a.shape[0]} / {b.shape[1]}, but lora_config says "
                            f"r={config.r}")
        pairs[module] = (a, b)
    return LoRAAdapter(config, pairs, str(file))


def targets(adapter: LoRAAdapter, backbone: nn.Module, family: str) -> dict[str, nn.Linear]:
    """The model's layer for each adapted module, its shapes checked; a module this model does not have is named."""
    out = {}
    for module, (a, b) in adapter.pairs.items():
        try:
            layer = backbone.get_submodule(module)
        except AttributeError:
            raise LoRAError(f"{module}.lora_A: this {family} model has no layer {module!r} (an adapter for another "
                            f"model family or size?)") from None
        if not isinstance(layer, torch.nn.Linear):
            raise LoRAError(f"{module}.lora_A: {module!r} is a {type(layer).__name__}, not a linear layer")
        if a.shape[1] != layer.in_features or b.shape[0] != layer.out_features:
            raise LoRAError(f"{module}.lora_A / lora_B: shapes {tuple(a.shape)} / {tuple(b.shape)} do not fit the "
                            f"layer's {layer.in_features} inputs and {layer.out_features} outputs")
        out[module] = layer
    return out


def merge_adapter(backbone: nn.Module, adapter: LoRAAdapter, family: str) -> int:
    """W += B A * alpha / r in every adapted layer (computed in fp32, stored in the layer's dtype); the layers
    merged. Call before the runner fuses projections (their fused weights are views of these)."""
    layers = targets(adapter, backbone, family)
    with torch.no_grad():
        for module, layer in layers.items():
            a, b = adapter.pairs[module]
            w = layer.weight
            w.copy_((w.float() + (b.to(w.device) @ a.to(w.device)) * adapter.config.scale).to(w.dtype))
    log.info("merged LoRA adapter %s into %d layers (r=%d, alpha=%g)", adapter.source, len(layers),
             adapter.config.r, adapter.config.alpha)
    return len(layers)


def sha256_of(file: Path) -> str:
    h = hashlib.sha256()
    with open(file, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def random_adapter(backbone: nn.Module, out: Path, config: LoRAConfig, seed: int = 0, std: float = 0.05) -> Path:
    """A random adapter in the official format for `backbone` (tests and demos): every layer the config targets,
    as the official training would adapt it (LM: base_lm and residual_lm; DiT: the LocDiT's layers; projections)."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    state = {}
    for name, module in backbone.named_modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        short = name.rsplit(".", 1)[-1]
        lm = config.enable_lm and name.startswith(("base_lm.", "residual_lm.")) and short in config.target_modules_lm
        dit = (config.enable_dit and name.startswith("feat_decoder.estimator.")
               and short in config.target_modules_dit)
        proj = config.enable_proj and "." not in name and name in config.target_proj_modules
        if lm or dit or proj:
            bound = 1 / math.sqrt(module.in_features)
            state[f"{name}.lora_A"] = (torch.rand(config.r, module.in_features, generator=g) * 2 - 1) * bound
            state[f"{name}.lora_B"] = torch.randn(module.out_features, config.r, generator=g) * std
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out / WEIGHT_FILES[0]))
    (out / CONFIG_FILE).write_text(json.dumps({"base_model": "random", "lora_config": dataclasses.asdict(config)}))
    return out
