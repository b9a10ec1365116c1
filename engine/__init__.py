"""voxcpm-serve inference engine: VoxCPM models (VoxCPM2, VoxCPM1.5, VoxCPM-0.5B) with continuous
batching over a paged KV cache, CUDA graphs and a multi-process server pool. The official `voxcpm`
package is never imported here."""

from engine.checkpoint import CheckpointError, LoadedModel, load_model
from engine.errors import EngineError, PoolError, PoolStoppedError, PromptNotFoundError, RequestError, WorkerDiedError
from engine.llm_engine import EngineConfig, LLMEngine, StepEvent
from engine.sequence import SamplingParams
from engine.server_pool import AsyncVoxCPMServerPool, SyncVoxCPMServerPool, VoxCPM

__all__ = ["AsyncVoxCPMServerPool", "CheckpointError", "EngineConfig", "EngineError", "LLMEngine", "LoadedModel",
           "PoolError", "PoolStoppedError", "PromptNotFoundError", "RequestError", "SamplingParams", "StepEvent",
           "SyncVoxCPMServerPool", "VoxCPM", "WorkerDiedError", "load_model"]
