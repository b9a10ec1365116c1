"""The engine's switches: one typed options object, read from the VOXCPM_* variables in one place, carried by the
engine config into the engine (and the workers), documented in the README."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from engine import options
from engine.engine_config import EngineConfig
from engine.options import EngineOptions

ROOT = Path(__file__).resolve().parent.parent


def test_variables_parse_into_typed_fields():
    o = EngineOptions.from_env({"VOXCPM_FUSE": "0", "VOXCPM_LAYER_KERNEL": "phases", "VOXCPM_LAYER_LAUNCH": "64,3,4,2",
                                "VOXCPM_LAYER_PREFETCH_MB": "2.5", "VOXCPM_SKINNY_ROWS": "128",
                                "VOXCPM_PIPELINE_DECODE": "1", "VOXCPM_LOG_LEVEL": "debug", "VOXCPM_UNRELATED": "x"})
    assert (o.fuse, o.layer_kernel, o.layer_launch, o.layer_prefetch_bytes) == (False, "phases", (64, 3, 4, 2),
                                                                              int(2.5 * 2**20))
    assert o.skinny_rows == 64  # capped: larger tiles do not fit in shared memory
    assert o.pipeline_decode is True and o.log_level == "DEBUG"
    assert EngineOptions.from_env({}) == EngineOptions()  # unset: the defaults
    words = EngineOptions.from_env({"VOXCPM_FUSE": "false", "VOXCPM_SPLIT_K": " Off ", "VOXCPM_FP8_FAST_ACCUM": "yes"})
    assert (words.fuse, words.split_k, words.fp8_fast_accum) == (False, False, True)  # `false` was read as on


@pytest.mark.parametrize("variable,value,rule", [
    ("VOXCPM_LAYER_KERNEL", "fast", "use one of fused, phases, off"),
    ("VOXCPM_ATTN_SPLIT_KEYS", "100", "power of two"),
    ("VOXCPM_GEMV_MAX_ROWS", "-1", "0 (off) or a positive number"),
    ("VOXCPM_LAYER_LAUNCH", "128,4", "four positive integers"),
    ("VOXCPM_VAE_OVERLAP_MIN_BATCH", "many", "invalid literal"),
    ("VOXCPM_BATCH_INVARIANT", "nein", "use 1 or 0 (true/false"),  # was read as on, as was any word but 0
    # each was taken: a silent INFO, a division by zero or a NaN at kernel launch, a negative bound, a warning only
    ("VOXCPM_LOG_LEVEL", "bogus", "use DEBUG, INFO, WARNING, ERROR or CRITICAL"),
    ("VOXCPM_LAYER_BLOCK_N", "0", "use one of 16, 32, 64"),
    ("VOXCPM_LAYER_BLOCK_N", "17", "use one of 16, 32, 64"),
    ("VOXCPM_LAYER_PREFETCH_MB", "nan", "a positive number of MB"),
    ("VOXCPM_LAYER_PREFETCH_MB", "-1", "a positive number of MB"),
    ("VOXCPM_LAYER_MAX_ROWS", "-5", "0 (off) or a positive number"),
    ("VOXCPM_VAE_OVERLAP_MIN_BATCH", "-1", "a positive number"),
    ("VOXCPM_KERNEL_MANIFEST", "/nonexistent/manifest.json", "no such file"),
])
def test_a_bad_value_names_its_variable(variable, value, rule):
    with pytest.raises(ValueError, match=rf"^{variable}='{value}': .*{re.escape(rule)}"):
        EngineOptions.from_env({variable: value})


def test_the_config_carries_them_and_the_engine_installs_them(checkpoint_factory, monkeypatch):
    from engine.io.checkpoint import load_model
    from engine.llm_engine import LLMEngine

    monkeypatch.setenv("VOXCPM_PIPELINE_DECODE", "1")
    carried = EngineConfig(max_num_seqs=2, max_model_len=128)  # the variables are read here, once
    monkeypatch.delenv("VOXCPM_PIPELINE_DECODE")
    assert carried.options.pipeline_decode is True
    model = load_model(checkpoint_factory("tiny-voxcpm2", stop="never"))
    engine = LLMEngine(model, carried)
    assert engine.pipeline and options.current() == carried.options.batch_invariant_kernels()  # the CPU's exact mode
    plain = LLMEngine(model, EngineConfig(max_num_seqs=2, max_model_len=128, options=EngineOptions(fuse=False)))
    assert not plain.pipeline and options.current().fuse is False
    loose = EngineOptions(batch_invariant=False)
    LLMEngine(model, EngineConfig(max_num_seqs=2, max_model_len=128, options=loose))
    assert options.current() is loose  # not exact: the options as they are


def test_override_is_scoped():
    before = options.current()
    with options.override(layer_kernel="off", split_k=False) as inside:
        assert options.current() is inside and (inside.layer_kernel, inside.split_k) == ("off", False)
    assert options.current() is before


def test_every_variable_is_documented_in_the_readme():
    readme = (ROOT / "README.md").read_text()
    missing = [f.metadata["env"] for f in dataclasses.fields(EngineOptions) if f"`{f.metadata['env']}`" not in readme]
    assert missing == []
