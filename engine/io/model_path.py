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
READ_AHEAD_CHUNK = 16 << 20


def weight_files(path: Path) -> list[Path]:
    """The checkpoint directory's weight files (not its config or tokenizer)."""
    return sorted(p for p in Path(path).iterdir() if p.suffix in WEIGHT_SUFFIXES and p.is_file())


def read_into_page_cache(files: list[Path]) -> int:
    """Read the files through once and drop the bytes: the kernel keeps them in its page cache. (posix_fadvise's
    WILLNEED reads only a readahead window, a few MB, of each file.) Returns the bytes read; an unreadable file is
    skipped (the worker reports it when it loads)."""
    total = 0
    buffer = bytearray(READ_AHEAD_CHUNK)
    for file in files:
        with contextlib.suppress(OSError), open(file, "rb", buffering=0) as f:
            while n := f.readinto(buffer):
                total += n
    return total


def prefetch_weights(path: Path) -> threading.Thread | None:
    """Read the checkpoint's weight files into the page cache on a thread of its own: on a fresh node the disk then
    reads them while a worker imports torch (seconds), not after. Files already cached cost a copy (~0.5 s of one
    core for 4.6 GB); files larger than a quarter of the memory are left alone (they would not stay cached)."""
    files = weight_files(path)
    memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if not files or sum(p.stat().st_size for p in files) > memory // 4:
        return None
    thread = threading.Thread(target=read_into_page_cache, args=(files,), name="voxcpm-prefetch-weights",
                              daemon=True)
    thread.start()
    return thread
