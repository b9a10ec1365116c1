"""voxcpm-serve inference engine: VoxCPM models (VoxCPM2, VoxCPM1.5, VoxCPM-0.5B) with continuous
batching over a paged KV cache. The official `voxcpm` package is never imported here."""

from engine.checkpoint import CheckpointError, LoadedModel, load_model
from engine.llm_engine import EngineConfig, LLMEngine, StepEvent
from engine.sequence import SamplingParams

__all__ = ["CheckpointError", "EngineConfig", "LLMEngine", "LoadedModel", "SamplingParams", "StepEvent",
           "load_model"]
