"""The VAE decoder in a 16-bit dtype (`vae_dtype`): the same patches as in float32 (the VAE does not feed back), audio
within that dtype's rounding of float32's, and not the same audio (the option acts)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.io.checkpoint import load_model
from engine.llm_engine import EngineConfig, LLMEngine
from engine.models.audio_vae import IDENTICAL_DB, decoder_snr_db, probe_audio
from engine.sequence import SamplingParams
from engine.serving.reports import describe
from tests.conftest import TINY_PRESETS, clip_latents


def _run(model, vae_dtype: str | None) -> tuple[np.ndarray, list[torch.Tensor]]:
    engine = LLMEngine(model, EngineConfig(max_num_seqs=2, max_model_len=256, vae_dtype=vae_dtype))
    clip = clip_latents(engine.model, 3, seed=2)  # a continuation: its VAE stream is primed with the prompt's patches
    engine.add_request("The decoder in another dtype.", SamplingParams(seed=5, max_generate_length=8),
                       prompt_text="A prompt.", prompt_latents=clip)
    audio, patches = [], []
    while engine.has_unfinished():
        for ev in engine.step():
            audio.append(ev.audio)
            patches.append(ev.patch)
    assert engine.blocks.num_free == len(engine.blocks.blocks)
    return np.concatenate(audio), patches


# The least SNR from float32's audio: bf16 keeps 8 significant bits (a rounding is at most 2^-9 relative, about -54 dB),
# fp16 11 (about -72 dB); a few dozen conv layers adding independent roundings land ~14 dB above one rounding (H200,
# full-size VoxCPM2: 43.2 and 62.6 dB); these bounds leave room for another CPU's kernels.
MIN_SNR_DB = {"bfloat16": 30.0, "float16": 45.0}


@pytest.mark.parametrize("vae_dtype", sorted(MIN_SNR_DB))
def test_a_16_bit_vae_decoder_keeps_the_patches_and_rounds_the_audio(checkpoint_factory, vae_dtype: str):
    path = checkpoint_factory("tiny-voxcpm2", stop="never")
    ref_audio, ref_patches = _run(load_model(path), None)
    model = load_model(path)
    audio, patches = _run(model, vae_dtype)
    assert next(model.vae.decoder.parameters()).dtype == getattr(torch, vae_dtype)
    assert next(model.vae.encoder.parameters()).dtype == torch.float32  # prompt latents stay float32
    assert audio.dtype == np.float32 and audio.shape == ref_audio.shape
    for a, b in zip(patches, ref_patches, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)  # bitwise: the VAE's output never feeds back
    err = audio - ref_audio
    assert np.abs(err).max() > 0  # the option acts
    snr_db = 10 * np.log10(np.sum(ref_audio.astype(np.float64) ** 2) / np.sum(err.astype(np.float64) ** 2))
    assert snr_db > MIN_SNR_DB[vae_dtype], snr_db


def test_bad_vae_dtype_names_the_field():
    with pytest.raises(ValueError, match="vae_dtype"):
        EngineConfig(vae_dtype="int8").validate()


def test_a_loaded_model_decodes_in_one_dtype_only(checkpoint_factory):
    """A second engine on the same loaded model may not cast the VAE decoder the first one runs (its weights would
    change under the first engine's steps and graphs)."""
    model = load_model(checkpoint_factory("tiny-voxcpm2", stop="never"))
    LLMEngine(model, EngineConfig(max_num_seqs=1, max_model_len=128))
    with pytest.raises(ValueError, match="vae_dtype: this loaded model's VAE decoder runs in torch.float32"):
        LLMEngine(model, EngineConfig(max_num_seqs=1, max_model_len=128, vae_dtype="bfloat16"))
    LLMEngine(model, EngineConfig(max_num_seqs=1, max_model_len=128, vae_dtype="float32"))  # the same dtype: fine


@pytest.mark.parametrize("preset", TINY_PRESETS)
def test_every_family_s_float16_decoder_passes_its_check_as_made(checkpoint_factory, preset: str):
    """v1 (no sample-rate condition) and v2 VAEs: the check's float16 audio lies within its rounding of float32's."""
    vae = load_model(checkpoint_factory(preset, stop="never")).vae
    assert MIN_SNR_DB["float16"] < decoder_snr_db(vae, torch.float16) < IDENTICAL_DB  # cast: not the same audio
    assert next(vae.decoder.parameters()).dtype == torch.float32  # the check casts a copy


def test_a_float16_decoder_that_leaves_its_range_is_refused_at_start_up(checkpoint_factory, monkeypatch):
    """float16 is checked against float32 on the model's own latents of a test clip before the decoder is cast: a
    decoder whose activations pass 65504 (its first conv's weight scaled up; float32 stays finite) is refused, naming
    the field; the start's precompiler is closed, and the loaded model keeps its float32 decoder for an engine that
    asks for no narrower dtype."""
    from engine.startup import kernel_cache
    model = load_model(checkpoint_factory("tiny-voxcpm2", stop="never"))
    first_conv = next(p for p in model.vae.decoder.parameters() if p.dim() == 3)
    with torch.no_grad():
        first_conv.mul_(1e6)
        assert model.vae.decode(model.vae.encode(probe_audio(model.vae.sample_rate))).isfinite().all()
    closed = []
    close = kernel_cache.Precompiler.close
    monkeypatch.setattr(kernel_cache.Precompiler, "close", lambda self: (closed.append(self), close(self)))
    with pytest.raises(ValueError, match=r"vae_dtype: this model's VAE decoder in torch.float16 is -inf dB"):
        LLMEngine(model, EngineConfig(max_num_seqs=1, max_model_len=128, vae_dtype="float16"))
    assert len(closed) == 1
    assert next(model.vae.decoder.parameters()).dtype == torch.float32
    engine = LLMEngine(model, EngineConfig(max_num_seqs=1, max_model_len=128, vae_dtype="bfloat16"))  # float32's range
    info = describe(engine)
    assert (info.vae_dtype, info.vae_check_db) == ("bfloat16", None)


def test_a_silent_float32_decoder_cannot_be_checked(checkpoint_factory):
    model = load_model(checkpoint_factory("tiny-voxcpm2", stop="never"))
    with torch.no_grad():
        for p in model.vae.decoder.parameters():
            p.zero_()
    with pytest.raises(ValueError, match="vae_dtype: the VAE decoder's float32 audio of the test clip is silent"):
        LLMEngine(model, EngineConfig(max_num_seqs=1, max_model_len=128, vae_dtype="float16"))


def test_the_float16_checks_result_is_in_the_workers_info_once_per_loaded_model(checkpoint_factory, monkeypatch):
    import engine.llm_engine as llm_engine
    calls = []
    monkeypatch.setattr(llm_engine, "decoder_snr_db", lambda *a: calls.append(a) or decoder_snr_db(*a))
    model = load_model(checkpoint_factory("tiny-voxcpm2", stop="never"))
    info = describe(LLMEngine(model, EngineConfig(max_num_seqs=1, max_model_len=128, vae_dtype="fp16"))).as_dict()
    assert info["vae_dtype"] == "float16" and info["vae_check_db"] > MIN_SNR_DB["float16"]
    again = describe(LLMEngine(model, EngineConfig(max_num_seqs=1, max_model_len=128, vae_dtype="float16")))
    assert again.vae_check_db == info["vae_check_db"] and len(calls) == 1  # the loaded model's, checked once
