"""The embedded demo checkpoint: with no NANOVLLM_MODEL_PATH the service makes a tiny random-weight
VoxCPM2 checkpoint under the cache dir on first start, so `uv run voxcpm-serve` works on a fresh machine.
Its audio is noise-like: it exercises the whole service, it does not speak."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

from engine.io.random_checkpoint import make_random_checkpoint

log = logging.getLogger(__name__)
PRESET = "tiny-voxcpm2"

BANNER = """
##########################################################################################
#  NANOVLLM_MODEL_PATH is not set: serving the embedded DEMO checkpoint ({path})
#  Its weights are RANDOM: the audio is noise, not speech. It runs on the CPU.
#  Set NANOVLLM_MODEL_PATH to a VoxCPM checkpoint (directory or hub id) for real speech.
##########################################################################################"""


def demo_checkpoint(cache_dir: Path) -> Path:
    out = cache_dir / f"demo-{PRESET}"
    if not (out / "config.json").is_file():
        tmp = cache_dir / f".demo-{PRESET}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        # fixed-length output (6 x text tokens + 10 patches): a random stop head would end at random
        make_random_checkpoint(tmp, PRESET, seed=0, stop="never", config_overrides={"dtype": "float32"})
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)
    log.warning(BANNER.format(path=out))
    return out
