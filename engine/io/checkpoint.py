"""Loading a checkpoint directory in the official layout.

Layout: config.json; main weights in model.safetensors, sharded *.safetensors (with or without an
index) or pytorch_model.bin; VAE weights in audiovae.safetensors or audiovae.pth (optionally wrapped
in {"state_dict": ...}, weight-norm stored as weight_g/weight_v); tokenizer files. Unlike the
official loader (strict=False), every missing, unexpected or mis-shaped weight is an error that
lists them: a model silently running on random weights is the worst failure a TTS service can have.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from engine.config import AudioVAEConfig, ConfigError, VoxCPMConfig, parse_dtype
from engine.errors import CheckpointError  # noqa: F401  (raised here; imported from here by callers)
from engine.io.model_path import resolve_model_path
from engine.io.tokenizer import TextTokenizer
from engine.models import build_backbone
from engine.models.audio_vae import AudioVAE, fuse_weight_norm
from engine.models.voxcpm import VoxCPMBackbone

log = logging.getLogger(__name__)

VAE_PREFIX = "audio_vae."



@dataclass
class LoadedModel:
    path: Path
    config: VoxCPMConfig
    backbone: VoxCPMBackbone
    vae: AudioVAE
    tokenizer: TextTokenizer


def _torch_load(path: Path, device: str = "cpu") -> dict[str, torch.Tensor]:
    obj = torch.load(path, map_location=device, weights_only=True)
    if isinstance(obj, dict) and isinstance(obj.get("state_dict"), dict):
        obj = obj["state_dict"]
    if not isinstance(obj, dict):
        raise CheckpointError(f"{path} does not hold a state dict")
    return obj


# safetensors dtype names -> torch dtypes (the ones `read_safetensors` copies itself; others go to safetensors).
_SAFETENSORS_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
                       "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                       "BOOL": torch.bool}
_CHUNK = 64 << 20  # bytes per read / host-to-device copy


def read_safetensors(file: Path, device: str = "cpu") -> dict[str, torch.Tensor]:
    """A .safetensors file's tensors on `device`: to a GPU through `read_safetensors_chunked`, on the CPU with
    safetensors' own loader (a memory map)."""
    if torch.device(device).type != "cuda":
        return load_file(file, device=device)
    return read_safetensors_chunked(file, device)


def read_safetensors_chunked(file: Path, device: str) -> dict[str, torch.Tensor]:
    """The file in large sequential reads (to a GPU through two pinned buffers, each copy to the device overlapping
    the next read) into one buffer on `device` that is then cut into tensors, each with its own storage (a converted
    or fused weight frees its original), on the device of `device` whatever device is current. Peak device memory
    while cutting: twice the file. safetensors' loader copies tensor by tensor out of a memory map (page faults,
    pageable copies), several times slower for a multi-GB file."""
    cuda = torch.device(device).type == "cuda"
    with open(file, "rb") as f, torch.cuda.device(device) if cuda else contextlib.nullcontext():
        header_len = int.from_bytes(f.read(8), "little")
        try:
            header = json.loads(f.read(header_len))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{file}: not a safetensors file (header: {e})") from e
        header.pop("__metadata__", None)
        if any(info["dtype"] not in _SAFETENSORS_DTYPES for info in header.values()):
            return load_file(file, device=device)
        size = max((info["data_offsets"][1] for info in header.values()), default=0)
        if os.fstat(f.fileno()).st_size - 8 - header_len < size:
            raise CheckpointError(f"{file}: truncated (its header lists {size} data bytes)")
        blob = torch.empty(size, dtype=torch.uint8, device=device)
        chunk = min(_CHUNK, max(size, 1))
        staging = [torch.empty(chunk, dtype=torch.uint8, pin_memory=True) for _ in range(2)] if cuda else [blob]
        copied: list[torch.cuda.Event | None] = [None, None]
        offset, turn = 0, 0
        while offset < size:
            n = min(_CHUNK, size - offset)
            if cuda:
                buf, done = staging[turn], copied[turn]
                if done is not None:
                    done.synchronize()  # its previous copy to the device has read it
                view = memoryview(buf.numpy())[:n]
            else:
                view = memoryview(blob.numpy())[offset:offset + n]
            got = 0
            while got < n:
                r = f.readinto(view[got:])
                if not r:
                    raise CheckpointError(f"{file}: truncated while reading ({offset + got} of {size} data bytes)")
                got += r
            if cuda:
                blob[offset:offset + n].copy_(staging[turn][:n], non_blocking=True)
                copied[turn] = torch.cuda.Event()
                copied[turn].record()
                turn ^= 1
            offset += n
    if cuda:
        torch.cuda.synchronize(device)
    tensors = {}
    for name, info in header.items():
        dtype = _SAFETENSORS_DTYPES[info["dtype"]]
        start, end = info["data_offsets"]
        if end - start != math.prod(info["shape"]) * dtype.itemsize:
            raise CheckpointError(f"{file}: tensor {name!r} has {end - start} bytes for shape {info['shape']}")
        raw = blob[start:end] if start % dtype.itemsize == 0 else blob[start:end].clone()
        tensors[name] = raw.view(dtype).view(info["shape"]).clone()
    return tensors


def read_main_weights(path: Path, device: str = "cpu") -> dict[str, torch.Tensor]:
    """The main state dict, read onto `device` (to a GPU through `read_safetensors_chunked`)."""
    single = path / "model.safetensors"
    if single.is_file():
        return read_safetensors(single, device)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        shards = sorted(p.name for p in path.glob("*.safetensors") if not p.name.startswith("audiovae"))
    if shards:
        state: dict[str, torch.Tensor] = {}
        for name in shards:
            state.update(read_safetensors(path / name, device))
        return state
    if (path / "pytorch_model.bin").is_file():
        return _torch_load(path / "pytorch_model.bin", device)
    raise CheckpointError(f"{path} has no model weights (model.safetensors, *.safetensors or pytorch_model.bin)")


def read_vae_weights(path: Path, main: dict[str, torch.Tensor], device: str = "cpu") -> dict[str, torch.Tensor]:
    if (path / "audiovae.safetensors").is_file():
        state = read_safetensors(path / "audiovae.safetensors", device)
    elif (path / "audiovae.pth").is_file():
        state = _torch_load(path / "audiovae.pth", device)
    else:
        # A checkpoint saved as one state dict keeps the VAE under the audio_vae. prefix.
        state = {k[len(VAE_PREFIX):]: v for k, v in main.items() if k.startswith(VAE_PREFIX)}
        if not state:
            raise CheckpointError(f"{path} has no VAE weights (audiovae.safetensors or audiovae.pth)")
    return fuse_weight_norm(state)


def assign_weights(module: nn.Module, state: dict[str, torch.Tensor], what: str, dtype: torch.dtype) -> None:
    """Strictly load `state` into `module` (built on the meta device), converting to `dtype`."""
    expected = module.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    mis_shaped = sorted(f"{k}: checkpoint {tuple(state[k].shape)} vs model {tuple(expected[k].shape)}"
                        for k in set(expected) & set(state) if state[k].shape != expected[k].shape)
    if missing or unexpected or mis_shaped:
        parts = [f"{len(missing)} missing: {_short(missing)}" if missing else "",
                 f"{len(unexpected)} unexpected: {_short(unexpected)}" if unexpected else "",
                 f"{len(mis_shaped)} with wrong shape: {_short(mis_shaped)}" if mis_shaped else ""]
        raise CheckpointError(f"{what} weights do not match the model config: " + "; ".join(p for p in parts if p))
    converted = {k: v.to(dtype) if v.is_floating_point() and expected[k].is_floating_point() else v
                 for k, v in state.items()}
    module.load_state_dict(converted, strict=True, assign=True)


def _short(items: list[str], n: int = 12) -> str:
    return ", ".join(items[:n]) + (f", ... ({len(items) - n} more)" if len(items) > n else "")


def build_vae(cfg: VoxCPMConfig) -> AudioVAE:
    return AudioVAE(AudioVAEConfig.from_dict(cfg.audio_vae, version=cfg.version), version=cfg.version)


def load_model(model: str | os.PathLike, device: torch.device | str = "cpu", dtype: torch.dtype | None = None,
               max_positions: int | None = None) -> LoadedModel:
    """Load config, tokenizer, backbone (runtime dtype: config's unless `dtype`) and VAE (fp32; an engine may
    cast its decoder: `EngineConfig.vae_dtype`)."""
    path = resolve_model_path(model)
    try:
        cfg = VoxCPMConfig.from_dir(path)
    except ConfigError as e:
        raise CheckpointError(str(e)) from e
    tokenizer = TextTokenizer.from_dir(path)
    dtype = dtype or parse_dtype(cfg.dtype)
    where = str(torch.device(device))
    t0 = time.perf_counter()
    main = read_main_weights(path, where)
    vae_state = read_vae_weights(path, main, where)
    read_s = time.perf_counter() - t0
    main = {k: v for k, v in main.items() if not k.startswith(VAE_PREFIX)}
    with torch.device("meta"):
        backbone = build_backbone(cfg)
        vae = build_vae(cfg)
    assign_weights(backbone, main, "model", dtype)
    assign_weights(vae, vae_state, "audio VAE", torch.float32)
    backbone.to(device).eval()
    vae.to(device).eval()
    backbone.setup_rope(max_positions or cfg.max_length, device)
    del main, vae_state
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()  # originals of converted (e.g. fp32 -> bf16) weights: back to the device
    log.info("loaded %s (%s, %s) on %s in %.1f s (%.1f s reading weights)", path, cfg.architecture, dtype, device,
             time.perf_counter() - t0, read_s)
    return LoadedModel(path=path, config=cfg, backbone=backbone, vae=vae, tokenizer=tokenizer)
