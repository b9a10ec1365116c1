"""Where the workers run: the device names `VoxCPM.from_pretrained` and the service's supervisor give them, and the
GPUs this process may use, counted without importing torch where it can."""

from __future__ import annotations

import re
import subprocess

from engine.options import cuda_visible_devices

DEVICE_NAME = re.compile(r"cpu|cuda(:\d+)?")


def device_names(devices: list[int | str] | None) -> list[str]:
    """The worker devices: those given (GPU indices or device names), or every visible GPU, else the CPU."""
    if devices is None:
        n = visible_gpu_count()
        return [f"cuda:{i}" for i in range(n)] if n else ["cpu"]
    if isinstance(devices, str) or not isinstance(devices, list | tuple):  # "cpu" would be three workers c, p, u
        raise TypeError(f"devices: a list of GPU indices or device names, got {devices!r}")
    if not devices:
        raise ValueError("devices must not be empty")
    names = [f"cuda:{d}" if isinstance(d, int) and not isinstance(d, bool) else str(d) for d in devices]
    bad = [n for n in names if not DEVICE_NAME.fullmatch(n)]
    if bad:
        raise ValueError(f"devices: {bad!r} are no devices (GPU indices, 'cuda', 'cuda:N' or 'cpu')")
    wants_gpu = any(name.startswith("cuda") for name in names)
    gpus = visible_gpu_count() if wants_gpu else 0
    if wants_gpu and not gpus:
        raise ValueError(f"devices {devices!r} requested but CUDA is not available")
    missing = [n for n in names if n.startswith("cuda:") and int(n[5:]) >= gpus]
    if missing:
        raise ValueError(f"devices: {missing!r} requested, but {gpus} GPU(s) are visible")
    return names


def visible_gpu_count() -> int:
    """GPUs this process may use, counted without importing torch where nvidia-smi answers (the service starts its
    workers before it would have imported torch); CUDA_VISIBLE_DEVICES narrows them as it does for CUDA."""
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        out = None
    if out is None or out.returncode:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    n = sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))
    visible = cuda_visible_devices()
    if visible is not None:
        n = min(n, len([d for d in visible.split(",") if d.strip() and not d.strip().startswith("-")]))
    return n
