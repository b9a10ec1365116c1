"""Where a model's checkpoint directory is: a local directory as is, a hub repo id downloaded once.

Free of torch: the service's supervisor resolves the checkpoint (and starts the kernel precompile from its config)
before it imports torch, so that its workers and the precompile start at once.
"""

from __future__ import annotations

import contextlib
import os
import threading
from pathlib import Path

from engine.errors import CheckpointError


def resolve_model_path(model: str | os.PathLike) -> Path:
    """A local directory as is; otherwise a hub repo id, downloaded with huggingface_hub."""
    p = Path(model).expanduser()
    if p.is_dir():
        return p
    text = str(model)
    if p.exists() or text.startswith((".", "/", "~")) or text.count("/") != 1:
        raise CheckpointError(f"model {text!r} is neither a checkpoint directory nor a hub repo id (org/name)")
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id=text))
    except Exception as e:  # network, auth, missing repo: all mean the same to the caller
        raise CheckpointError(f"could not download {text!r} from the Hugging Face hub ({type(e).__name__}: {e}); "
                              "pass a local checkpoint directory instead") from e


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pth")


def prefetch_weights(path: Path) -> threading.Thread | None:
    """Ask the kernel to read the checkpoint's weight files into the page cache, on a thread of its own: on a fresh
    node the disk then reads them while a worker imports torch (seconds), not after. Warm files cost nothing; a
    platform without posix_fadvise, or an unreadable file, is skipped (the worker reads them anyway)."""
    if not hasattr(os, "posix_fadvise"):
        return None
    files = sorted(p for p in Path(path).iterdir() if p.suffix in WEIGHT_SUFFIXES and p.is_file())
    memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if not files or sum(p.stat().st_size for p in files) > memory // 4:  # what would not stay cached: not worth it
        return None

    def advise() -> None:
        for file in files:
            with contextlib.suppress(OSError):
                fd = os.open(file, os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
                finally:
                    os.close(fd)

    thread = threading.Thread(target=advise, name="voxcpm-prefetch-weights", daemon=True)
    thread.start()
    return thread
