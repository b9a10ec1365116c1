"""LoRA adapters in the official format: read, checked against the model (each mistake named), merged into the
weights at load, and equal to the official package running the same adapter (its LoRALinear layers, unmerged)."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.io.checkpoint import load_model
from engine.io.lora import LoRAConfig, LoRAError, merge_adapter, random_adapter, read_adapter
from engine.llm_engine import EngineConfig, LLMEngine
from engine.sequence import SamplingParams
from tests.conftest import check_parity
from tests.official import injected_noise, make_noise

PATCHES = 6
EVERY_GROUP = {"enable_lm": True, "enable_dit": True, "enable_proj": True, "r": 4, "alpha": 8}


def official_with_adapter(ckpt: Path, adapter_dir: Path, arch: str):
    """The official model with its own LoRA layers and the adapter loaded by its own loader."""
    raw = json.loads((adapter_dir / "lora_config.json").read_text())["lora_config"]
    if arch == "voxcpm2":
        from voxcpm.model.voxcpm2 import LoRAConfig as OfficialConfig
        from voxcpm.model.voxcpm2 import VoxCPM2Model as cls
    else:
        from voxcpm.model.voxcpm import LoRAConfig as OfficialConfig
        from voxcpm.model.voxcpm import VoxCPMModel as cls
        raw["target_proj_modules"] = [m for m in raw["target_proj_modules"] if m != "fusion_concat_proj"]
    off = cls.from_local(str(ckpt), optimize=False, device="cpu", lora_config=OfficialConfig(**raw))
    loaded, skipped = off.load_lora_weights(str(adapter_dir), device="cpu")
    assert loaded and not skipped, skipped
    return off


@pytest.mark.parametrize("preset", ["tiny-voxcpm2", "tiny-voxcpm1.5", "tiny-voxcpm0.5b"])
def test_merged_adapter_equals_the_official_lora(preset, checkpoint_factory, tmp_path):
    ckpt = checkpoint_factory(preset, stop="never")
    model = load_model(ckpt)
    arch = model.config.architecture
    targets = LoRAConfig(**EVERY_GROUP)
    if arch != "voxcpm2":  # VoxCPM1 has no fusion projection (the official default lists it; its loader skips it)
        targets = dataclasses.replace(targets, target_proj_modules=targets.target_proj_modules[:3])
    adapter_dir = random_adapter(model.backbone, tmp_path / "adapter", targets, seed=3)
    keys = load_file(str(adapter_dir / "lora_weights.safetensors"))
    assert any(k.startswith("base_lm.") for k in keys) and any(k.startswith("residual_lm.") for k in keys)
    assert any(k.startswith("feat_decoder.estimator.") for k in keys) and "enc_to_lm_proj.lora_A" in keys

    params = SamplingParams(max_generate_length=PATCHES, min_len=2, seed=0)
    engine = LLMEngine(model, EngineConfig(max_num_seqs=2, max_model_len=256, lora_path=str(adapter_dir)))
    noises = make_noise(PATCHES, model.config.feat_dim, model.config.patch_size, seed=5)
    seq_id = engine.add_request("An adapted voice speaks.", params, injected_noise=noises)
    ours = []
    while engine.has_unfinished():
        ours += [e.patch for e in engine.step() if e.seq_id == seq_id]
    off = official_with_adapter(ckpt, adapter_dir, arch)
    with injected_noise(noises):
        _, _, ref = off.generate_with_prompt_cache(target_text="An adapted voice speaks.", prompt_cache=None,
                                                   min_len=2, max_len=PATCHES, inference_timesteps=10,
                                                   cfg_value=2.0, retry_badcase=False)
    check_parity(f"{preset} merged LoRA (every target group) latents", torch.stack(ours), ref[-len(ours):], 1e-4)

    # the adapter matters: without it the same request sounds different
    plain = LLMEngine(load_model(ckpt), EngineConfig(max_num_seqs=2, max_model_len=256))
    seq_id = plain.add_request("An adapted voice speaks.", params, injected_noise=noises)
    base = []
    while plain.has_unfinished():
        base += [e.patch for e in plain.step() if e.seq_id == seq_id]
    assert (torch.stack(base) - torch.stack(ours)).abs().max() > 1e-3


def test_key_styles_and_wrappers_read_alike(checkpoint_factory, tmp_path):
    model = load_model(checkpoint_factory("tiny-voxcpm2"))
    adapter_dir = random_adapter(model.backbone, tmp_path / "a", LoRAConfig(r=2, alpha=4), seed=1)
    plain = read_adapter(adapter_dir)
    state = load_file(str(adapter_dir / "lora_weights.safetensors"))
    peft = tmp_path / "peft"
    peft.mkdir()
    (peft / "lora_config.json").write_text((adapter_dir / "lora_config.json").read_text())
    save_file({f"base_model.model._orig_mod.{k}.weight": v for k, v in state.items()},
              str(peft / "lora_weights.safetensors"))
    ckpt_style = tmp_path / "ckpt"
    ckpt_style.mkdir()
    (ckpt_style / "lora_config.json").write_text((adapter_dir / "lora_config.json").read_text())
    torch.save({"state_dict": {f"module.{k}": v for k, v in state.items()}}, ckpt_style / "lora_weights.ckpt")
    for other in (read_adapter(peft), read_adapter(ckpt_style / "lora_weights.ckpt")):
        assert other.pairs.keys() == plain.pairs.keys() and other.config == plain.config
        assert all(torch.equal(other.pairs[k][0], plain.pairs[k][0]) for k in plain.pairs)


def _broken(tmp_path: Path, adapter_dir: Path, change) -> Path:
    state = load_file(str(adapter_dir / "lora_weights.safetensors"))
    config = json.loads((adapter_dir / "lora_config.json").read_text())
    state, config = change(state, config)
    state = {k: v.clone() for k, v in state.items()}  # safetensors refuses tensors sharing memory
    out = tmp_path / "broken"
    out.mkdir(exist_ok=True)
    save_file(state, str(out / "lora_weights.safetensors"))
    (out / "lora_config.json").write_text(json.dumps(config))
    return out


Q = "base_lm.layers.0.self_attn.q_proj"


@pytest.mark.parametrize("change,message", [
    (lambda s, c: ({**s, "base_lm.layers.99.self_attn.q_proj.lora_A": s[f"{Q}.lora_A"],
                    "base_lm.layers.99.self_attn.q_proj.lora_B": s[f"{Q}.lora_B"]}, c),
     "base_lm.layers.99.self_attn.q_proj.lora_A: this voxcpm2 model has no layer"),
    (lambda s, c: ({**s, f"{Q}.lora_A": torch.zeros(2, 7)}, c), f"{Q}.lora_A / lora_B: shapes (2, 7)"),
    (lambda s, c: (s, {**c, "lora_config": {**c["lora_config"], "r": 3}}),
     "self_attn.k_proj.lora_A / lora_B: rank 2 / 2, but lora_config says r=3"),
    (lambda s, c: ({**s, f"{Q}.lora_B": s[f"{Q}.lora_B"] * float("nan")}, c), f"{Q}.lora_B: contains NaN"),
    (lambda s, c: ({k: v for k, v in s.items() if k != f"{Q}.lora_B"}, c), f"{Q}.lora_B: missing"),
    (lambda s, c: ({**s, "base_lm.layers.0.self_attn.q_proj.weight": s[f"{Q}.lora_A"]}, c), "not a LoRA tensor"),
    (lambda s, c: (s, {**c, "lora_config": {**c["lora_config"], "r": 2.0}}),
     "lora_config: r must be an integer >= 1, got 2.0"),
    (lambda s, c: (s, {**c, "lora_config": {**c["lora_config"], "r": "2"}}),
     "lora_config: r must be an integer >= 1, got '2'"),
    (lambda s, c: (s, {**c, "lora_config": {**c["lora_config"], "r": True}}),
     "lora_config: r must be an integer >= 1, got True"),
    (lambda s, c: (s, {**c, "lora_config": {**c["lora_config"], "alpha": float("nan")}}),
     "lora_config: alpha must be a finite number, got nan"),
    (lambda s, c: (s, {**c, "lora_config": {**c["lora_config"], "alpha": "4"}}),
     "lora_config: alpha must be a finite number, got '4'"),
    (lambda s, c: (s, {**c, "lora_config": {**c["lora_config"], "enable_lm": "yes"}}),
     "lora_config: enable_lm must be true or false, got 'yes'"),
    (lambda s, c: (s, {**c, "lora_config": None}), "lora_config: must be an object, got NoneType"),
])
def test_a_bad_adapter_is_refused_naming_the_key(change, message, checkpoint_factory, tmp_path):
    model = load_model(checkpoint_factory("tiny-voxcpm2"))
    adapter_dir = random_adapter(model.backbone, tmp_path / "a", LoRAConfig(r=2, alpha=4), seed=1)
    with pytest.raises(LoRAError, match=re.escape(message)):
        merge_adapter(model.backbone, read_adapter(_broken(tmp_path, adapter_dir, change)), "voxcpm2")


def test_an_adapter_for_another_family_is_refused(checkpoint_factory, tmp_path):
    v2 = load_model(checkpoint_factory("tiny-voxcpm2"))
    adapter_dir = random_adapter(v2.backbone, tmp_path / "a", LoRAConfig(enable_proj=True, r=2, alpha=4), seed=1)
    v1 = load_model(checkpoint_factory("tiny-voxcpm1.5"))
    with pytest.raises(LoRAError, match="this voxcpm model has no layer 'fusion_concat_proj'"):
        merge_adapter(v1.backbone, read_adapter(adapter_dir), "voxcpm")
