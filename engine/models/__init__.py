"""Model code: one file per family on top of the shared backbone (voxcpm.py) and transformer (minicpm.py)."""

from __future__ import annotations

from engine.config import VoxCPMConfig
from engine.models.voxcpm import VoxCPMBackbone
from engine.models.voxcpm1 import VoxCPM1
from engine.models.voxcpm2 import VoxCPM2

FAMILIES: dict[str, type[VoxCPMBackbone]] = {"voxcpm": VoxCPM1, "voxcpm2": VoxCPM2}


def build_backbone(cfg: VoxCPMConfig) -> VoxCPMBackbone:
    return FAMILIES[cfg.architecture](cfg)


def dit_rows_per_stream(cfg: VoxCPMConfig) -> int:
    """Rows one stream gives the DiT's projections in a decode step: CFG's two halves of [condition tokens, time
    token, previous patch, noisy patch]."""
    return 2 * (FAMILIES[cfg.architecture].condition_tokens + 1 + 2 * cfg.patch_size)
