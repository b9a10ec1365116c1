"""`VoxCPM.from_pretrained(...)`, the library's entry point: an `AsyncVoxCPMServerPool` when called inside a running
event loop, a `SyncVoxCPMServerPool` (the same pool driven from a private loop thread) otherwise."""

from __future__ import annotations

import asyncio
from collections.abc import MutableMapping
from types import NoneType
from typing import Any

from engine.engine_config import ENGINE_FIELDS, EngineConfig, check_type
from engine.io.tokenizer import TextTokenizer
from engine.serving.devices import device_names
from engine.serving.pool import AsyncVoxCPMServerPool, checked_model_path
from engine.serving.sync_pool import SyncVoxCPMServerPool
from engine.serving.transforms import TransformThreads

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
        in the workers). An unknown keyword or a value of the wrong type is a TypeError, a value out of bounds a
        ValueError, each naming it; all are checked before any worker starts."""
        unknown = set(options) - ENGINE_FIELDS - POOL_KEYWORDS
        if unknown:
            raise TypeError(f"from_pretrained() got unexpected keyword arguments: {', '.join(sorted(unknown))}")
        config = engine_config(**{k: v for k, v in options.items() if k in ENGINE_FIELDS})
        kwargs = {k: v for k, v in options.items() if k in POOL_KEYWORDS}
        check_pool_keywords(kwargs)
        names = device_names(devices)
        model = checked_model_path(model)
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return SyncVoxCPMServerPool(model, names, config, **kwargs)
        return AsyncVoxCPMServerPool(model, names, config, **kwargs)


def check_pool_keywords(kwargs: dict[str, Any]) -> None:
    """The pool's own keywords, typed and bounded (a worker was spawned, then left running, when one was not)."""
    kinds: dict[str, tuple[type, ...]] = {"warmup": (bool,), "encoder_threads": (int,), "queue_bound": (int, NoneType),
                                          "loras": (MutableMapping, NoneType), "tokenizer": (TextTokenizer, NoneType)}
    for name, value in kwargs.items():
        if name in kinds:
            check_type(name, value, kinds[name])
    threads = kwargs.get("transform_threads")
    if threads is not None and not (isinstance(threads, type) and issubclass(threads, TransformThreads)):
        raise TypeError(f"transform_threads: a TransformThreads class expected, got {threads!r}")
    if kwargs.get("encoder_threads", 1) < 1 or (kwargs.get("queue_bound") or 0) < 0:
        raise ValueError(f"encoder_threads must be >= 1 and queue_bound >= 0, got {kwargs.get('encoder_threads')} "
                         f"and {kwargs.get('queue_bound')}")


def engine_config(**fields: Any) -> EngineConfig:
    """An EngineConfig, validated (a bad value is a ValueError naming it); a dtype name stays a name (no torch)."""
    config = EngineConfig(**fields)
    config.validate()
    return config
