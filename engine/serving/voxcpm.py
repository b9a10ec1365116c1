"""`VoxCPM.from_pretrained(...)`, the library's entry point: an `AsyncVoxCPMServerPool` when called inside a running
event loop, a `SyncVoxCPMServerPool` (the same pool driven from a private loop thread) otherwise."""

from __future__ import annotations

import asyncio
from typing import Any

from engine.engine_config import ENGINE_FIELDS, EngineConfig
from engine.serving.devices import device_names
from engine.serving.pool import AsyncVoxCPMServerPool, checked_model_path
from engine.serving.sync_pool import SyncVoxCPMServerPool

# The pool's own keywords of `VoxCPM.from_pretrained`, beside EngineConfig's fields.
POOL_KEYWORDS = frozenset({"warmup", "encoder_threads", "queue_bound", "loras", "transform_threads", "tokenizer"})


class VoxCPM:
    @staticmethod
    def from_pretrained(model: str, devices: list[int | str] | None = None,
                        **options: Any) -> AsyncVoxCPMServerPool | SyncVoxCPMServerPool:
        """Start one worker per device (default: every visible GPU, else the CPU). `model` is a checkpoint
        directory or a hub repo id. Returns at once; `wait_for_ready()` waits for the model to load.

        Keywords: every field of `engine.EngineConfig` (max_num_seqs, max_model_len, inference_timesteps,
        coalesce_ms, lora_path, max_loras, ...: defaults, bounds and docs there), and the pool's own: warmup (a few
        generations in each worker before it reports ready; default False), encoder_threads (threads that run the
        generate calls' transforms; default 4), queue_bound (requests a worker may hold beyond max_num_seqs before
        generate raises OverloadedError; default None, no bound), loras (where the registered runtime adapters are
        kept, name -> path, each (re)started worker given them all; default a dict of this pool's),
        transform_threads (the class running the transforms; default first come first served), tokenizer (the
        checkpoint's `TextTokenizer`, already loaded; default loaded here: requests are tokenized in this process, not
        in the workers). An unknown keyword is a TypeError, a bad value a ValueError naming it."""
        unknown = set(options) - ENGINE_FIELDS - POOL_KEYWORDS
        if unknown:
            raise TypeError(f"from_pretrained() got unexpected keyword arguments: {', '.join(sorted(unknown))}")
        config = engine_config(**{k: v for k, v in options.items() if k in ENGINE_FIELDS})
        kwargs = {k: v for k, v in options.items() if k in POOL_KEYWORDS}
        names = device_names(devices)
        model = checked_model_path(model)
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return SyncVoxCPMServerPool(model, names, config, **kwargs)
        return AsyncVoxCPMServerPool(model, names, config, **kwargs)


def engine_config(**fields: Any) -> EngineConfig:
    """An EngineConfig, validated (a bad value is a ValueError naming it); a dtype name stays a name (no torch)."""
    config = EngineConfig(**fields)
    config.validate()
    return config
