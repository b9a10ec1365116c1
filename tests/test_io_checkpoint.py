"""Checkpoint layout: what tools write loads in the official package, every official layout variant
loads here, and a broken checkpoint is a clear error, never random weights."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch
from safetensors.torch import load_file, save_file

from engine.config import AudioVAEConfig, VoxCPMConfig
from engine.io import checkpoint
from engine.io.audio import AudioError, decode_audio, encode_latents
from engine.io.checkpoint import CheckpointError, load_model, read_safetensors_chunked
from tests.conftest import TINY_PRESETS, check_parity
from tests.official import load_official


def _saved_keys(path: Path) -> set[str]:
    keys = set(load_file(path / "model.safetensors"))
    vae = torch.load(path / "audiovae.pth", weights_only=True)["state_dict"]
    return keys | {f"audio_vae.{k}" for k in vae}


@pytest.mark.parametrize("preset", TINY_PRESETS)
def test_official_package_loads_random_checkpoint_exactly(preset, checkpoint_factory):
    path = checkpoint_factory(preset)
    official = load_official(path)
    expected = set(official.state_dict())
    saved = _saved_keys(path)
    assert saved == expected, (f"missing for official: {sorted(expected - saved)[:5]}, "
                               f"unexpected: {sorted(saved - expected)[:5]}")


def _weights(model) -> dict[str, torch.Tensor]:
    return {**model.backbone.state_dict(), **{f"vae.{k}": v for k, v in model.vae.state_dict().items()}}


def _variant(src: Path, dst: Path, kind: str) -> Path:
    shutil.copytree(src, dst)
    state = load_file(dst / "model.safetensors")
    if kind in ("sharded-index", "sharded-glob"):
        (dst / "model.safetensors").unlink()
        names = sorted(state)
        half = len(names) // 2
        shards = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
        for fname, keys in shards.items():
            save_file({k: state[k] for k in keys}, dst / fname)
        if kind == "sharded-index":
            weight_map = {k: f for f, keys in shards.items() for k in keys}
            (dst / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    elif kind == "pytorch-bin":
        (dst / "model.safetensors").unlink()
        torch.save({"state_dict": state}, dst / "pytorch_model.bin")
    elif kind == "vae-safetensors-unwrapped":
        vae = torch.load(dst / "audiovae.pth", weights_only=True)["state_dict"]
        (dst / "audiovae.pth").unlink()
        save_file(vae, dst / "audiovae.safetensors")
    elif kind == "vae-pth-parametrizations":
        vae = torch.load(dst / "audiovae.pth", weights_only=True)["state_dict"]
        renamed = {k.replace("weight_g", "parametrizations.weight.original0")
                    .replace("weight_v", "parametrizations.weight.original1"): v for k, v in vae.items()}
        torch.save(renamed, dst / "audiovae.pth")
    return dst


@pytest.mark.parametrize("kind", ["sharded-index", "sharded-glob", "pytorch-bin", "vae-safetensors-unwrapped",
                                  "vae-pth-parametrizations"])
def test_layout_variants_load_identically(kind, checkpoint_factory, tmp_path):
    src = checkpoint_factory("tiny-voxcpm2")
    reference = _weights(load_model(src))
    loaded = _weights(load_model(_variant(src, tmp_path / kind, kind)))
    assert loaded.keys() == reference.keys()
    for k, v in reference.items():
        assert torch.equal(loaded[k], v), k


def _write_packed_safetensors(tensors: dict[str, torch.Tensor], file: Path) -> None:
    """A safetensors file with the tensors packed back to back in the given order (safetensors' own writer sorts
    them so that every offset is aligned; real files need not be)."""
    names = {v: k for k, v in checkpoint._SAFETENSORS_DTYPES.items()}
    header, blobs, offset = {}, [], 0
    for name, t in tensors.items():
        raw = t.contiguous().view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        header[name] = {"dtype": names[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    file.write_bytes(len(head).to_bytes(8, "little") + head + b"".join(blobs))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA"))])
def test_chunked_safetensors_reader_reads_every_tensor(device, checkpoint_factory, tmp_path, monkeypatch):
    """The GPU loader's reader (on the CPU, and on a GPU through its pinned double buffers): every tensor equal to
    what was written, across chunk borders and at offsets that are not a multiple of the dtype's size (a 3-byte
    tensor first), on the requested device; a truncated file is an error."""
    state = {"odd.u8": torch.arange(3, dtype=torch.uint8), "odd.f32": torch.randn(5, 3),
             "odd.bf16": torch.randn(7).to(torch.bfloat16), "odd.scalar": torch.tensor(2.5)}
    state |= load_file(checkpoint_factory("tiny-voxcpm2") / "model.safetensors")
    file = tmp_path / "w.safetensors"
    _write_packed_safetensors(state, file)
    monkeypatch.setattr(checkpoint, "_CHUNK", 4093)  # many chunks, borders inside tensors
    loaded = read_safetensors_chunked(file, device)
    assert loaded.keys() == state.keys()
    for k, v in state.items():
        assert loaded[k].device.type == device and loaded[k].dtype == v.dtype and torch.equal(loaded[k].cpu(), v), k
    file.write_bytes(file.read_bytes()[:-10])
    with pytest.raises(CheckpointError, match="truncated"):
        read_safetensors_chunked(file, device)


def test_missing_and_unexpected_weights_are_listed(checkpoint_factory, tmp_path):
    dst = tmp_path / "broken"
    shutil.copytree(checkpoint_factory("tiny-voxcpm2"), dst)
    state = load_file(dst / "model.safetensors")
    del state["stop_head.weight"]
    state["extra.weight"] = torch.zeros(2)
    save_file(state, dst / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"1 missing: stop_head\.weight.*1 unexpected: extra\.weight"):
        load_model(dst)


def test_wrong_shape_is_an_error(checkpoint_factory, tmp_path):
    dst = tmp_path / "shape"
    shutil.copytree(checkpoint_factory("tiny-voxcpm2"), dst)
    state = load_file(dst / "model.safetensors")
    state["stop_head.weight"] = torch.zeros(3, 64)
    save_file(state, dst / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"stop_head\.weight: checkpoint \(3, 64\)"):
        load_model(dst)


def test_not_a_checkpoint_directory(tmp_path):
    with pytest.raises(CheckpointError, match="no config.json"):
        load_model(tmp_path)
    with pytest.raises(CheckpointError, match="neither a checkpoint directory"):
        load_model(tmp_path / "does-not-exist")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        load_model(tmp_path)


def test_missing_vae_file_is_an_error(checkpoint_factory, tmp_path):
    dst = tmp_path / "novae"
    shutil.copytree(checkpoint_factory("tiny-voxcpm0.5b"), dst)
    (dst / "audiovae.pth").unlink()
    with pytest.raises(CheckpointError, match="no VAE weights"):
        load_model(dst)


def test_config_without_vae_section_uses_family_defaults():
    """VoxCPM-0.5B ships no audio_vae_config: the v1 defaults (16 kHz, decoder 1536, rates 8,8,5,2) apply."""
    raw = {"architecture": "voxcpm", "lm_config": {
        "hidden_size": 1024, "intermediate_size": 4096, "num_attention_heads": 16, "num_key_value_heads": 2,
        "num_hidden_layers": 24, "rms_norm_eps": 1e-5, "vocab_size": 73448}}
    cfg = VoxCPMConfig.from_dict(raw)
    assert (cfg.patch_size, cfg.residual_lm.num_hidden_layers, cfg.fsq_latent_dim) == (2, 6, 256)
    vae = AudioVAEConfig.from_dict(cfg.audio_vae, version=cfg.version)
    assert (vae.sample_rate, vae.decoder_dim, list(vae.decoder_rates)) == (16000, 1536, [8, 8, 5, 2])


@pytest.mark.parametrize("sr", [16000, 22050, 44100])
def test_wav_to_latents_matches_official_encoder(sr, checkpoint_factory, tmp_path):
    """VoxCPM2: bytes of a wav at any rate -> latents equal to the official _encode_wav (librosa + VAE),
    left padding for prompts, right padding for references."""
    path = checkpoint_factory("tiny-voxcpm2")
    ours, off = load_model(path), load_official(path)
    t = np.arange(int(sr * 0.77)) / sr
    clip = (0.3 * np.sin(2 * np.pi * 220 * t) * (1 + 0.5 * np.sin(2 * np.pi * 3 * t))).astype(np.float32)
    buf = io.BytesIO()
    sf.write(buf, clip, sr, format="WAV", subtype="FLOAT")
    (tmp_path / "clip.wav").write_bytes(buf.getvalue())
    samples, got_sr = decode_audio(buf.getvalue(), "wav")
    assert got_sr == sr
    p, d = ours.config.patch_size, ours.config.feat_dim
    for padding in ("left", "right"):
        lat = encode_latents(ours.vae, samples, sr, p, padding)
        ref = off._encode_wav(str(tmp_path / "clip.wav"), padding_mode=padding)
        assert lat.shape[0] % p == 0
        check_parity(f"tiny-voxcpm2 wav@{sr} -> latents ({padding} pad)", lat.reshape(-1, p, d), ref, 1e-4)


def test_undecodable_audio_is_a_clear_error():
    with pytest.raises(AudioError, match="could not decode audio"):
        decode_audio(b"this is not audio", "wav")
