"""`voxcpm-serve` on the command line: --help and --version exit 0, every setting is a flag that wins over its
NANOVLLM_* variable, an unknown flag or a bad value exits 2 naming it, a path that is no checkpoint exits 1;
`voxcpm-serve check` loads the model and generates one patch (exit 0) or says what failed (exit 1)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from service.main import load_settings
from service.settings import Settings, unknown_variables

REPO = Path(__file__).resolve().parents[1]


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "service.main", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=120, env=env)


def test_help_lists_every_setting_with_its_variable_and_default():
    r = cli("--help")
    assert r.returncode == 0, r.stderr
    text = " ".join(r.stdout.split())  # argparse wraps lines
    for name in Settings.model_fields:
        assert f"--{name.replace('_', '-')}" in text
        assert f"env NANOVLLM_{name.upper()};" in text
    assert "env NANOVLLM_PORT; default 8000]" in text and "--model VALUE" in text and "--devices VALUE" in text


def test_version():
    r = cli("--version")
    assert r.returncode == 0 and r.stdout.startswith("voxcpm-serve ")


@pytest.mark.parametrize("args, message", [(("--bogus",), "unrecognized arguments: --bogus"),
                                           (("--port", "x"), "--port: Input should be a valid integer"),
                                           (("--mp3-quality", "8"), "--mp3-quality: Input should be less than or "
                                                                    "equal to 7")])
def test_bad_flags_exit_2_naming_them(args, message):
    r = cli(*args)
    assert r.returncode == 2 and message in r.stderr, r.stderr


def test_bad_variable_exits_2_naming_it():
    r = cli(env={"NANOVLLM_PORT": "0", "PATH": "/usr/bin:/bin"})
    assert r.returncode == 2 and "NANOVLLM_PORT: Input should be greater than or equal to 1" in r.stderr, r.stderr
    r = cli(env={"VOXCPM_LAYER_KERNEL": "fast", "PATH": "/usr/bin:/bin"})  # an engine switch
    assert r.returncode == 2 and "VOXCPM_LAYER_KERNEL='fast': use one of fused, phases, off" in r.stderr, r.stderr
    r = cli(env={"NANOVLLM_SERVERPOOL_DEVICES": "tpu", "PATH": "/usr/bin:/bin"})  # a worker was spawned, then died
    assert r.returncode == 2 and "NANOVLLM_SERVERPOOL_DEVICES: Value error, use GPU indices or device names" \
        in r.stderr, r.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="asks for a GPU the host lacks")
def test_gpus_the_host_lacks_exit_2_naming_the_variable(checkpoint_factory, tmp_path):
    """--devices 0 on a host without CUDA: exit 2 naming the setting (a traceback and exit 1 before)."""
    ckpt = checkpoint_factory("tiny-voxcpm2", stop="never")
    r = cli("--model", str(ckpt), "--devices", "0", "--port", "18998", "--cache-dir", str(tmp_path / "cache"))
    assert r.returncode == 2 and "NANOVLLM_SERVERPOOL_DEVICES: devices [0] requested but CUDA is not available" \
        in r.stderr, r.stderr[-2000:]


def test_flag_over_variable_over_default(monkeypatch):
    monkeypatch.delenv("NANOVLLM_PORT", raising=False)
    assert load_settings([]).port == 8000
    monkeypatch.setenv("NANOVLLM_PORT", "9000")
    assert load_settings([]).port == 9000
    assert load_settings(["--port", "9001"]).port == 9001
    assert load_settings(["--model", "/x", "--devices", "0,1"]).device_list() == [0, 1]
    assert load_settings(["--model", "/x"]).model_path == "/x"


def test_a_path_that_is_no_checkpoint_exits_1(tmp_path):
    """...after warning of a NANOVLLM_* variable that names no setting (pydantic-settings ignores it silently)."""
    env = {**os.environ, "NANOVLLM_DEVICES": "0"}  # a misspelling of NANOVLLM_SERVERPOOL_DEVICES
    r = cli("--model", str(tmp_path), "--port", "18999", "--cache-dir", str(tmp_path / "cache"), env=env)
    assert r.returncode == 1 and "no config.json" in r.stderr, r.stderr
    assert "NANOVLLM_DEVICES names no setting and is ignored" in r.stderr, r.stderr
    assert unknown_variables({"NANOVLLM_PORT": "1", "NANOVLLM_DEVICES": "0", "OTHER": "1"}) == ["NANOVLLM_DEVICES"]
    # any case, as pydantic-settings reads them (a variable it honoured was called ignored)
    assert unknown_variables({"NANOVLLM_Mp3_Quality": "1", "nanovllm_devices": "0"}) == ["nanovllm_devices"]


def test_an_empty_variable_is_unset(monkeypatch):
    """NANOVLLM_X= (a template's blank) is the default, not an empty value: the lora dir was the current directory,
    the model path a checkpoint at '.'."""
    for name in ("NANOVLLM_LORA_DIR", "NANOVLLM_MODEL_PATH", "NANOVLLM_API_KEYS", "NANOVLLM_CACHE_DIR"):
        monkeypatch.setenv(name, "")
    settings, default = load_settings([]), Settings()
    monkeypatch.undo()
    assert settings.lora_dir is None and settings.model_path is None and settings.api_key_list() == []
    assert settings.cache_dir == Settings().cache_dir and default.lora_dir is None


def test_check_loads_the_model_and_generates_one_patch(checkpoint_factory, tmp_path):
    ckpt = checkpoint_factory("tiny-voxcpm2", stop="never")
    r = cli("check", "--model", str(ckpt), "--devices", "cpu", "--cache-dir", str(tmp_path / "cache"),
            "--serverpool-max-num-seqs", "2", "--serverpool-max-model-len", "256")
    assert r.returncode == 0, r.stdout + r.stderr
    report = json.loads(r.stdout.strip().splitlines()[-1])
    assert report["status"] == "ok" and report["devices"] == ["cpu"] and report["model_path"] == str(ckpt)
    assert report["samples"] == 7680  # one patch of tiny-voxcpm2: 4 latent frames x 1920 samples


def test_check_says_why_it_failed_and_exits_1(tmp_path):
    r = cli("check", "--model", str(tmp_path), "--cache-dir", str(tmp_path / "cache"))
    assert r.returncode == 1, r.stdout + r.stderr
    report = json.loads(r.stdout.strip().splitlines()[-1])
    assert report["status"] == "failed" and "no config.json" in report["detail"], report
    assert cli("check", "--port", "x").returncode == 2  # a bad setting: as the service


def test_check_warns_of_a_variable_that_names_no_setting(tmp_path):
    """`check` warns as the service does (it left before the warning: a misspelt variable passed its check)."""
    r = cli("check", "--model", str(tmp_path), "--cache-dir", str(tmp_path / "cache"),
            env={**os.environ, "NANOVLLM_SERVERPOOL_ATTENTION_BACKEND": "flash"})
    assert r.returncode == 1 and "NANOVLLM_SERVERPOOL_ATTENTION_BACKEND names no setting and is ignored" in r.stderr
