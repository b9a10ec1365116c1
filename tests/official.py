"""The official voxcpm package as a parity oracle (test-only: the engine never imports it)."""

from __future__ import annotations

import contextlib
import json
import types
from collections.abc import Iterator
from pathlib import Path

import torch


def load_official(path: Path):
    """The official model object (VoxCPMModel / VoxCPM2Model) on CPU, no torch.compile, no warm-up."""
    arch = json.loads((path / "config.json").read_text()).get("architecture", "voxcpm")
    if arch == "voxcpm2":
        from voxcpm.model.voxcpm2 import VoxCPM2Model as cls
    else:
        from voxcpm.model.voxcpm import VoxCPMModel as cls
    return cls.from_local(str(path), optimize=False, device="cpu")


@contextlib.contextmanager
def injected_noise(noises: list[torch.Tensor]) -> Iterator[list[torch.Tensor]]:
    """Make the official CFM sampler's one randn draw per step return our tensors, in order."""
    import voxcpm.modules.locdit.unified_cfm as cfm

    real = cfm.torch
    queue = list(noises)
    used: list[torch.Tensor] = []

    def randn(*shape, device=None, dtype=None, **_kw):
        z = queue.pop(0)
        want = tuple(shape[0]) if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else tuple(shape)
        assert tuple(z.shape) == want[1:] or tuple(z.shape) == want, (z.shape, want)
        used.append(z)
        return z.reshape(want).to(device=device, dtype=dtype)

    cfm.torch = types.SimpleNamespace(**{n: getattr(real, n) for n in dir(real) if not n.startswith("__")})
    cfm.torch.randn = randn
    try:
        yield used
    finally:
        cfm.torch = real


def make_noise(n: int, feat_dim: int, patch: int, seed: int, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    """Noise per step, exactly representable in `dtype` so both sides see the same values."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(feat_dim, patch, generator=g).to(dtype).float() for _ in range(n)]
