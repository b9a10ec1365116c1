"""Where a model's checkpoint directory is: a local directory as is, a hub repo id downloaded once.

Free of torch: the service's supervisor resolves the checkpoint (and starts the kernel precompile from its config)
before it imports torch, so that its workers and the precompile start at once.
"""

from __future__ import annotations

import os
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
