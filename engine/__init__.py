"""voxcpm-serve inference engine: VoxCPM models (VoxCPM2, VoxCPM1.5, VoxCPM-0.5B) with continuous
batching over a paged KV cache, CUDA graphs and a multi-process server pool. The official `voxcpm`
package is never imported here.

The public names load on first use (PEP 562): importing one submodule, as the start-up's kernel-compiling child
processes do (`engine.startup.kernel_compiler`), does not import the whole engine and torch with it."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "CheckpointError": "engine.errors", "LoadedModel": "engine.io.checkpoint", "load_model": "engine.io.checkpoint",
    "EngineError": "engine.errors", "OverloadedError": "engine.errors", "PoolError": "engine.errors",
    "PoolStoppedError": "engine.errors",
    "PromptNotFoundError": "engine.errors", "RequestError": "engine.errors", "WorkerDiedError": "engine.errors",
    "LoRANotFoundError": "engine.errors",
    "EngineConfig": "engine.engine_config", "LLMEngine": "engine.llm_engine", "StepEvent": "engine.sequence",
    "SamplingParams": "engine.serving.protocol", "SynthesisRequest": "engine.serving.protocol",
    "GenerationStream": "engine.serving.stream",
    "AsyncVoxCPMServerPool": "engine.serving.pool", "SyncVoxCPMServerPool": "engine.serving.sync_pool",
    "VoxCPM": "engine.serving.voxcpm",
}
__all__ = ["AsyncVoxCPMServerPool", "CheckpointError", "EngineConfig", "EngineError", "GenerationStream",
           "LLMEngine", "LoRANotFoundError", "LoadedModel", "OverloadedError", "PoolError", "PoolStoppedError",
           "PromptNotFoundError", "RequestError", "SamplingParams", "StepEvent", "SyncVoxCPMServerPool",
           "SynthesisRequest", "VoxCPM", "WorkerDiedError", "load_model"]

if TYPE_CHECKING:
    from engine.engine_config import EngineConfig
    from engine.errors import (
        EngineError,
        LoRANotFoundError,
        OverloadedError,
        PoolError,
        PoolStoppedError,
        PromptNotFoundError,
        RequestError,
        WorkerDiedError,
    )
    from engine.io.checkpoint import CheckpointError, LoadedModel, load_model
    from engine.llm_engine import LLMEngine
    from engine.sequence import StepEvent
    from engine.serving.pool import AsyncVoxCPMServerPool
    from engine.serving.protocol import SynthesisRequest
    from engine.serving.stream import GenerationStream
    from engine.serving.sync_pool import SyncVoxCPMServerPool
    from engine.serving.voxcpm import VoxCPM
    from engine.vocabulary import SamplingParams


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value  # once
        return value
    raise AttributeError(f"module 'engine' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
