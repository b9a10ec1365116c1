"""Per-module parity with the official package on the same random checkpoint, float32, CPU."""

from __future__ import annotations

import pytest
import torch

from engine.io.checkpoint import load_model
from engine.runner.attention import AttentionMetadata, PagedKVCache
from tests.conftest import TINY_PRESETS, check_parity
from tests.official import injected_noise, load_official, make_noise

BOUND = 1e-5  # same math, same dtype: only summation order may differ


@pytest.fixture(scope="module", params=TINY_PRESETS)
def models(request, checkpoint_factory):
    path = checkpoint_factory(request.param)
    return request.param, load_model(path), load_official(path)


def _paged(stack_cfg, block_size: int = 4, blocks: int = 6) -> PagedKVCache:
    return PagedKVCache(stack_cfg.num_hidden_layers, blocks, block_size, stack_cfg.num_key_value_heads,
                        stack_cfg.head_dim, torch.float32, "cpu")


@pytest.mark.parametrize("stack", ["base_lm", "residual_lm"])
def test_causal_lm_prefill_and_decode(models, stack):
    name, ours, off = models
    cfg = ours.config.lm if stack == "base_lm" else ours.config.residual_lm
    ours_lm, off_lm = getattr(ours.backbone, stack), getattr(off, stack)
    torch.manual_seed(1)
    t = 9
    x = torch.randn(1, t, cfg.hidden_size)
    y = torch.randn(1, cfg.hidden_size)
    ref_h, kv = off_lm(x, is_causal=True)
    off_lm.kv_cache.fill_caches(kv)
    ref_step = off_lm.forward_step(y, torch.tensor([t]))

    # A scrambled block table: the paged path must follow it.
    cache, table = _paged(cfg), [4, 1, 5, 0]
    rope = ours.backbone.rope_tables["lm"]
    slots = torch.tensor([table[i // 4] * 4 + i % 4 for i in range(t)])
    meta = AttentionMetadata(True, slots, torch.tensor([table], dtype=torch.int32), torch.zeros(t, dtype=torch.int32),
                             torch.arange(1, t + 1, dtype=torch.int32), query_lens=[t], key_lens=[t])
    h = ours_lm(x[0], rope[torch.arange(t)], cache.attend_fn(meta))
    check_parity(f"{name} {stack} prefill", h, ref_h[0], BOUND)
    meta = AttentionMetadata(False, torch.tensor([table[t // 4] * 4 + t % 4]), torch.tensor([table], dtype=torch.int32),
                             torch.zeros(1, dtype=torch.int32), torch.tensor([t + 1], dtype=torch.int32))
    step = ours_lm(y, rope[torch.tensor([t])], cache.attend_fn(meta))
    check_parity(f"{name} {stack} decode step", step, ref_step, BOUND)


def test_local_encoder(models):
    name, ours, off = models
    cfg = ours.config
    torch.manual_seed(2)
    feats = torch.randn(1, 5, cfg.patch_size, cfg.feat_dim)
    ref = off.feat_encoder(feats)[0]
    got = ours.backbone.feat_encoder(feats[0], ours.backbone.rope_tables["enc"])
    check_parity(f"{name} LocEnc", got, ref, BOUND)
    check_parity(f"{name} LocEnc + enc_to_lm_proj", ours.backbone.encode_patches(feats[0]),
                 off.enc_to_lm_proj(off.feat_encoder(feats))[0], BOUND)


def test_dit_velocity(models):
    name, ours, off = models
    cfg = ours.config
    b, c = 3, ours.backbone.condition_tokens * cfg.dit.hidden_size
    torch.manual_seed(3)
    x, cond = torch.randn(b, cfg.feat_dim, cfg.patch_size), torch.randn(b, cfg.feat_dim, cfg.patch_size)
    mu, t, dt = torch.randn(b, c), torch.rand(b), torch.rand(b) * 0.1
    ref = off.feat_decoder.estimator(x, mu, t, cond, dt)
    got = ours.backbone.feat_decoder.estimator(x, mu, t, cond, dt, ours.backbone.rope_tables["dit"])
    check_parity(f"{name} LocDiT velocity", got, ref, BOUND)


def test_the_dit_last_layer_computes_only_the_noisy_patch(models):
    """The DiT reads the noisy patch's positions of its stack's output: its last layer computes the others only as
    keys and values. The kept rows must be what the whole stack gives there, in shape and value."""
    name, ours, _ = models
    module = ours.backbone.feat_decoder.estimator.decoder
    rope = ours.backbone.rope_tables["dit"]
    keep = slice(-ours.config.patch_size, None)
    torch.manual_seed(6)
    x = torch.randn(3, rope.shape[0], module.layers[0].self_attn.o_proj.out_features)
    whole = module.forward_local(x, rope)
    kept = module.forward_local(x, rope, keep=keep)
    assert kept.shape == whole[:, keep].shape
    check_parity(f"{name} DiT noisy patch", kept, whole[:, keep], BOUND)


@pytest.mark.parametrize("cfg_value", [2.0, 1.3])
def test_cfm_solve_with_cfg(models, cfg_value):
    name, ours, off = models
    cfg = ours.config
    b, c = 2, ours.backbone.condition_tokens * cfg.dit.hidden_size
    torch.manual_seed(4)
    mu, cond = torch.randn(b, c), torch.randn(b, cfg.feat_dim, cfg.patch_size)
    noise = torch.stack(make_noise(b, cfg.feat_dim, cfg.patch_size, seed=5))
    with injected_noise([noise]):
        ref = off.feat_decoder(mu=mu, n_timesteps=10, patch_size=cfg.patch_size, cond=cond, cfg_value=cfg_value)
    got = ours.backbone.feat_decoder(mu, cond, noise, torch.full((b,), cfg_value), 10,
                                     ours.backbone.rope_tables["dit"])
    check_parity(f"{name} CFM solve (10 steps, cfg {cfg_value})", got, ref, BOUND)


def test_time_tokens_cached_until_weights_change(models):
    """The sampler's time tokens are computed once per schedule and again only when a time MLP weight changes."""
    _, ours, _ = models
    sampler = ours.backbone.feat_decoder
    first = sampler.time_tokens(10, torch.float32, torch.device("cpu"))
    assert sampler.time_tokens(10, torch.float32, torch.device("cpu")) is first
    assert sampler.time_tokens(5, torch.float32, torch.device("cpu")).shape[0] < first.shape[0]
    bias = sampler.estimator.time_mlp.linear_2.bias
    saved = bias.detach().clone()
    with torch.no_grad():
        bias.add_(1.0)  # in place: the same tensor, a new version
    try:
        changed = sampler.time_tokens(10, torch.float32, torch.device("cpu"))
        assert changed is not first
        torch.testing.assert_close(changed - first, torch.ones_like(first), atol=1e-4, rtol=0)
    finally:
        with torch.no_grad():
            bias.copy_(saved)
    torch.testing.assert_close(sampler.time_tokens(10, torch.float32, torch.device("cpu")), first, atol=0, rtol=0)


def test_stop_fsq_and_projections(models):
    name, ours, off = models
    h = ours.config.lm.hidden_size
    torch.manual_seed(6)
    x = torch.randn(4, h)
    check_parity(f"{name} stop logits", ours.backbone.stop_logits(x),
                 off.stop_head(off.stop_actn(off.stop_proj(x))), BOUND)
    check_parity(f"{name} FSQ", ours.backbone.fsq_layer(x), off.fsq_layer(x), BOUND)
    r = torch.randn(4, h)
    if ours.config.version == 2:
        ref = torch.cat((off.lm_to_dit_proj(x), off.res_to_dit_proj(r)), -1)
    else:
        ref = off.lm_to_dit_proj(x) + off.res_to_dit_proj(r)
    check_parity(f"{name} DiT condition", ours.backbone.dit_condition(x, r), ref, BOUND)


def test_vae_encode_decode_against_official(models):
    name, ours, off = models
    torch.manual_seed(7)
    vae, ovae = ours.vae, off.audio_vae
    audio = torch.randn(1, vae.chunk_size * ours.config.patch_size * 3) * 0.3
    z_ref = ovae.encode(audio.unsqueeze(1), ovae.sample_rate)
    check_parity(f"{name} VAE encode", vae.encode(audio, vae.sample_rate), z_ref, BOUND)
    check_parity(f"{name} VAE decode", vae.decode(z_ref), ovae.decode(z_ref), BOUND)
