"""Parity of engine.models.audio_vae against the official voxcpm AudioVAE (v1 and v2), on tiny configs.

Channel widths are tiny so the tests run in seconds on CPU; strides keep the real hop sizes.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from engine.config import AudioVAEConfig
from engine.models.audio_vae import AudioVAE, fuse_weight_norm

official = pytest.importorskip("voxcpm.modules.audiovae")

TOL = 1e-5

# name -> (version, config dict, patch size)
CASES = {
    "v1_0.5b": (1, {"encoder_dim": 4, "encoder_rates": [2, 5, 8, 8], "latent_dim": 16, "decoder_dim": 32,
                    "decoder_rates": [8, 8, 5, 2], "sample_rate": 16000}, 2),
    "v1_1.5": (1, {"encoder_dim": 4, "encoder_rates": [2, 3, 6, 7, 7], "latent_dim": 16, "decoder_dim": 32,
                   "decoder_rates": [7, 7, 6, 3, 2], "sample_rate": 44100}, 4),
    "v2": (2, {"encoder_dim": 4, "encoder_rates": [2, 5, 8, 8], "latent_dim": 16, "decoder_dim": 64,
               "decoder_rates": [8, 6, 5, 2, 2, 2], "sample_rate": 16000, "out_sample_rate": 48000}, 4),
    "v2_dense_outlayer": (2, {"encoder_dim": 4, "encoder_rates": [2, 5, 8, 8], "latent_dim": 16,
                              "decoder_dim": 64, "decoder_rates": [8, 6, 5, 2, 2, 2], "depthwise": False,
                              "cond_type": "scale_bias_init", "cond_out_layer": True}, 4),
}


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def _max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a - b).abs().max().item()


def _build_official(version: int, cfg: dict, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # legacy torch weight_norm
        if version == 1:
            model = official.AudioVAE(official.AudioVAEConfig(**cfg))
        else:
            model = official.AudioVAEV2(official.AudioVAEConfigV2(**cfg))
    # Non-trivial random weights everywhere: g/v, biases, snake alphas, sr scale/bias embeddings.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("weight_g"):
                p.uniform_(0.4, 0.8)  # larger saturates the final tanh
            elif name.endswith("weight_v"):
                p.normal_()
            elif name.endswith("alpha"):
                p.uniform_(0.5, 2.0)
            elif "scale_embed" in name:
                p.normal_(1.0, 0.2)
            elif "embed" in name:
                p.normal_(0.0, 0.2)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.05)
            else:
                raise AssertionError(f"unhandled official parameter {name}")
    return model.eval()


def _build_pair(case: str) -> tuple[torch.nn.Module, AudioVAE, int]:
    version, cfg, patch = CASES[case]
    ref = _build_official(version, cfg)
    ours = AudioVAE(AudioVAEConfig.from_dict(cfg, version), version).eval()
    ours.load_state_dict(fuse_weight_norm(ref.state_dict()), strict=True)
    return ref, ours, patch


def _latents(vae: AudioVAE, frames: int, batch: int = 1, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, vae.latent_dim, frames, generator=g)


def test_config_defaults() -> None:
    v1 = AudioVAEConfig.from_dict(None, 1)
    assert (v1.encoder_dim, v1.encoder_rates, v1.latent_dim) == (128, [2, 5, 8, 8], 64)
    assert (v1.decoder_dim, v1.decoder_rates, v1.depthwise) == (1536, [8, 8, 5, 2], True)
    assert v1.sample_rate == 16000
    assert v1.out_sample_rate is None and v1.sr_bin_boundaries is None
    # v2-only keys are ignored for v1 (the official v1 config has no such fields); unknown keys too.
    v15 = AudioVAEConfig.from_dict({"sample_rate": 44100, "encoder_rates": [2, 3, 6, 7, 7],
                                    "sr_bin_boundaries": [1], "bogus": 3}, 1)
    assert v15.sample_rate == 44100 and v15.encoder_rates == [2, 3, 6, 7, 7] and v15.sr_bin_boundaries is None
    v2 = AudioVAEConfig.from_dict({"unknown": 1}, 2)
    ref = official.AudioVAEConfigV2()
    for key, val in ref.model_dump().items():
        assert getattr(v2, key) == val, key
    ref1 = official.AudioVAEConfig()
    for key, val in ref1.model_dump().items():
        assert getattr(v1, key) == val, key


@pytest.mark.parametrize("case", list(CASES))
def test_attributes(case: str) -> None:
    ref, ours, _ = _build_pair(case)
    assert ours.sample_rate == ref.sample_rate
    assert ours.out_sample_rate == getattr(ref, "out_sample_rate", ref.sample_rate)
    assert ours.latent_dim == ref.latent_dim
    assert ours.chunk_size == ref.chunk_size
    assert ours.decode_chunk_size == getattr(ref, "decode_chunk_size", ref.chunk_size)
    # Buffers: v2's sr_bin_boundaries is a persistent buffer officially; strict load above proved the
    # key sets match, check the values too.
    for key, val in ref.state_dict().items():
        if not key.endswith(("weight_g", "weight_v")):
            assert torch.equal(ours.state_dict()[key], val), key


@pytest.mark.parametrize("case", list(CASES))
def test_fused_weights_bitwise(case: str) -> None:
    ref, ours, _ = _build_pair(case)
    with torch.no_grad():
        ref.decode(_latents(ours, 2))  # legacy weight_norm recomputes `.weight` in a forward pre-hook
        ref.encode(torch.zeros(1, ours.chunk_size), ref.sample_rate)
    ours_sd = ours.state_dict()
    n = 0
    for name, mod in ref.named_modules():
        if hasattr(mod, "weight_g"):
            assert torch.equal(ours_sd[f"{name}.weight"], mod.weight), name
            n += 1
    assert n > 10


@pytest.mark.parametrize("case", list(CASES))
def test_encode_parity(case: str) -> None:
    ref, ours, _ = _build_pair(case)
    g = torch.Generator().manual_seed(2)
    audio = 0.3 * torch.randn(2, 5 * ours.chunk_size + 123, generator=g)  # not a whole number of frames
    with torch.no_grad():
        want = ref.encode(audio, ref.sample_rate)
        got = ours.encode(audio, ours.sample_rate)
        got3 = ours.encode(audio.unsqueeze(1))
    assert got.shape == (2, ours.latent_dim, 6)
    err = _rel_err(got, want)
    print(f"[{case}] encode max rel err {err:.3e}")
    assert err <= TOL, f"{case}: encode rel err {err:.3e}"
    assert torch.equal(got, got3)
    with pytest.raises(ValueError):
        ours.encode(audio, ours.sample_rate + 1)


@pytest.mark.parametrize("case", list(CASES))
def test_decode_parity(case: str) -> None:
    ref, ours, _ = _build_pair(case)
    z = _latents(ours, 7, batch=2)
    with torch.no_grad():
        want = ref.decode(z)
        got = ours.decode(z)
    assert got.shape == (2, 1, 7 * ours.decode_chunk_size)
    # Meaningful signal: neither vanishing nor stuck in the saturated tails of the final tanh.
    peak = want.abs().max().item()
    assert want.std() > 1e-3 and peak < 0.99, f"degenerate test output (peak {peak:.3f})"
    err = _rel_err(got, want)
    print(f"[{case}] decode max rel err {err:.3e} (out peak {peak:.3f})")
    assert err <= TOL, f"{case}: decode rel err {err:.3e}"


def test_decode_sr_condition_matters() -> None:
    ref, ours, _ = _build_pair("v2")
    z = _latents(ours, 3)
    with torch.no_grad():
        a, b = ours.decode(z), ours.decode(z, out_sample_rate=16000)
        want_b = ref.decode(z, torch.tensor([16000], dtype=torch.int32))
    assert _max_err(a, b) > 1e-3
    # Bucketing follows a loaded boundaries buffer (the official bucketizes on the buffer).
    sd = ours.state_dict()
    sd["decoder.sr_bin_boundaries"] = torch.tensor([10000, 20000, 30000], dtype=torch.int32)
    ours.load_state_dict(sd)
    assert ours.decoder.sr_boundaries == [10000, 20000, 30000]
    assert ours.decoder.sr_index(16000) == 1 and ours.decoder.sr_index(48000) == 3
    err = _rel_err(b, want_b)
    assert err <= TOL, f"decode @16k rel err {err:.3e}"


@pytest.mark.parametrize("case", list(CASES))
def test_streaming_decode(case: str) -> None:
    ref, ours, patch = _build_pair(case)
    n_patches = 6
    z = _latents(ours, n_patches * patch, batch=1, seed=3)
    hop = ours.decode_chunk_size
    with torch.no_grad():
        full = ours.decode(z)
        stream = ours.streaming_decoder(batch_size=1)
        chunks = [stream.decode_chunk(z[..., i * patch:(i + 1) * patch]) for i in range(n_patches)]
    assert all(c.shape == (1, 1, patch * hop) for c in chunks)
    err = _max_err(torch.cat(chunks, dim=-1), full)
    print(f"[{case}] streaming vs full decode max abs err {err:.3e}")
    assert err <= TOL, f"{case}: streaming max abs err {err:.3e}"

    # Uneven chunk sizes (single frames shorter than conv contexts, a trailing empty chunk) match too.
    with torch.no_grad():
        stream.reset()
        sizes, parts, pos = [1, 3, 1, 2, 5], [], 0
        for s in sizes + [z.shape[-1] - sum(sizes)]:
            parts.append(stream.decode_chunk(z[..., pos:pos + s]))
            pos += s
    err2 = _max_err(torch.cat(parts, dim=-1), full)
    assert err2 <= TOL, f"{case}: uneven streaming max abs err {err2:.3e}"

    if hasattr(ref, "streaming_decode"):  # v2 only: official stateful streaming, chunk by chunk
        with torch.no_grad(), ref.streaming_decode() as dec:
            ref_chunks = [dec.decode_chunk(z[..., i * patch:(i + 1) * patch]) for i in range(n_patches)]
        errs = [_max_err(a, b) for a, b in zip(chunks, ref_chunks, strict=True)]
        print(f"[{case}] streaming vs official streaming_decode max abs err {max(errs):.3e}")
        assert max(errs) <= TOL, f"{case}: vs official streaming max abs err {max(errs):.3e}"


@pytest.mark.parametrize("case", list(CASES))
def test_streaming_prime(case: str) -> None:
    _, ours, patch = _build_pair(case)
    z = _latents(ours, 3 + 4 * patch, seed=4)
    hop = ours.decode_chunk_size
    with torch.no_grad():
        full = ours.decode(z)
        stream = ours.streaming_decoder()
        stream.prime(z[..., :3])
        assert stream.decode_chunk(z[..., 3:4], discard=True).shape[-1] == 0
        tail = [stream.decode_chunk(z[..., i:i + patch]) for i in range(4, z.shape[-1], patch)]
    err = _max_err(torch.cat(tail, dim=-1), full[..., 4 * hop:])
    print(f"[{case}] primed streaming max abs err {err:.3e}")
    assert err <= TOL, f"{case}: primed streaming max abs err {err:.3e}"


def test_streaming_batch() -> None:
    _, ours, patch = _build_pair("v2")
    z = _latents(ours, 3 * patch, batch=3, seed=5)
    with torch.no_grad():
        full = ours.decode(z)
        stream = ours.streaming_decoder(batch_size=3)
        out = torch.cat([stream.decode_chunk(z[..., i:i + patch]) for i in range(0, z.shape[-1], patch)], -1)
    err = _max_err(out, full)
    assert err <= TOL, f"batched streaming max abs err {err:.3e}"
    assert all(s.shape[0] == 3 for s in stream.states)


def test_parametrization_names() -> None:
    # Single layers: fused weight is bitwise what torch's parametrized weight norm computes.
    torch.manual_seed(0)
    for layer in (torch.nn.Conv1d(6, 4, 3, groups=2), torch.nn.ConvTranspose1d(6, 4, 4, stride=2)):
        wn = torch.nn.utils.parametrizations.weight_norm(layer)
        with torch.no_grad():
            wn.parametrizations.weight.original0.uniform_(0.5, 1.5)
            wn.parametrizations.weight.original1.normal_()
        fused = fuse_weight_norm(wn.state_dict())
        assert set(fused) == {"weight", "bias"}
        assert torch.equal(fused["weight"], wn.weight)

    # Whole model: official state_dict renamed to the parametrization convention loads identically.
    ref, ours, _ = _build_pair("v2")
    renamed = {}
    for key, val in ref.state_dict().items():
        if key.endswith(".weight_g"):
            key = key[: -len("weight_g")] + "parametrizations.weight.original0"
        elif key.endswith(".weight_v"):
            key = key[: -len("weight_v")] + "parametrizations.weight.original1"
        renamed[key] = val
    other = AudioVAE(ours.config, 2)
    other.load_state_dict(fuse_weight_norm(renamed), strict=True)
    for key, val in ours.state_dict().items():
        assert torch.equal(other.state_dict()[key], val), key


def test_fuse_rejects_unpaired() -> None:
    with pytest.raises(KeyError):
        fuse_weight_norm({"a.weight_g": torch.ones(2, 1, 1)})
    with pytest.raises(KeyError):
        fuse_weight_norm({"a.weight_v": torch.ones(2, 1, 1)})
    plain = {"a.weight": torch.ones(2), "a.bias": torch.zeros(2)}
    assert fuse_weight_norm(plain) == plain
