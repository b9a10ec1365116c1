"""The CUDA paths (Triton attention, graphed prefill and decode) against the eager torch path, on a tiny
fp32 checkpoint. Skipped without CUDA; `tools/gpu_check.py` runs the same comparison (and a full-size
one) on the GPU machine."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.io.checkpoint import load_model
from engine.llm_engine import EngineConfig, LLMEngine
from engine.options import EngineOptions
from engine.runner.cuda_graphs import driver_loads_in_capture
from engine.sequence import SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _run(engine: LLMEngine, reqs: list[dict]) -> list[np.ndarray]:
    audio = engine.generate_all([dict(target_text=r["text"], params=r["params"], **r.get("kw", {})) for r in reqs])
    assert engine.blocks.num_free == len(engine.blocks.blocks)
    return audio


def test_graphs_and_triton_match_eager_torch(checkpoint_factory, monkeypatch):
    # Exact fp32: no TF32 in matmuls or convolutions (restored after the test).
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    model = load_model(checkpoint_factory("tiny-voxcpm2", stop="never"), "cuda")
    prompt = torch.randn(12, model.config.feat_dim, generator=torch.Generator().manual_seed(3))
    reqs = [
        dict(text="Graphs on the GPU.", params=SamplingParams(seed=1, max_generate_length=6)),
        dict(text="Continue.", params=SamplingParams(seed=2, max_generate_length=5, cfg_value=1.5),
             kw=dict(prompt_text="A prompt.", prompt_latents=prompt)),
        dict(text="Reference.", params=SamplingParams(seed=3, max_generate_length=4, temperature=0.7),
             kw=dict(ref_latents=prompt)),
    ]
    config = dict(max_num_seqs=4, max_model_len=256, num_kv_blocks=128)
    eager = _run(LLMEngine(model, EngineConfig(**config, enforce_eager=True, attention_backend="torch"), "cuda"),
                 reqs)
    graphed_engine = LLMEngine(model, EngineConfig(**config, attention_backend="triton"), "cuda")
    runner = graphed_engine.runner
    assert runner.graphs and runner.prefill_graphs
    if driver_loads_in_capture():  # one eager run per kind of graph (decode with its VAE, prefill, its LocEnc)
        warmed = sorted(name for name, (warm_s, _) in runner.capture_times.items() if warm_s > 0)
        top = max(runner.prefill_graphs)
        assert warmed == ["decode+vae B=4", f"encode A={top}", f"prefill T={top}"], warmed
    graphed = _run(graphed_engine, reqs)
    alone = [_run(graphed_engine, [r])[0] for r in reqs]
    for g, e, a in zip(graphed, eager, alone, strict=True):
        assert g.shape == e.shape == a.shape
        np.testing.assert_allclose(g, e, rtol=0, atol=1e-4 * np.abs(e).max())
        np.testing.assert_allclose(a, g, rtol=0, atol=1e-4 * np.abs(g).max())


def test_vae_inside_and_behind_the_step_agree_across_the_threshold(checkpoint_factory, monkeypatch):
    """Buckets below vae_overlap_min_batch decode their VAE inside the step graph, the others behind it. With
    the threshold at 4 and requests of different lengths, the pipelined batch shrinks from bucket 4 (behind) to 2
    and 1 (inside): the audio must equal the all-inside run's, bit for bit (the same kernels on the same inputs)."""
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    model = load_model(checkpoint_factory("tiny-voxcpm2", stop="never"), "cuda")
    reqs = [dict(text=f"Request {i}.", params=SamplingParams(seed=i, max_generate_length=9 - 3 * i)) for i in range(3)]
    config = dict(max_num_seqs=4, max_model_len=256, num_kv_blocks=128, attention_backend="triton",
                  pipeline_decode=True)
    audio = {}
    for threshold in (32, 4):
        engine = LLMEngine(model, EngineConfig(**config, options=EngineOptions(vae_overlap_min_batch=threshold)),
                           "cuda")
        assert bool(engine.runner.vae_stream.graphs) == (threshold == 4)
        audio[threshold] = _run(engine, reqs)
    for inside, mixed in zip(audio[32], audio[4], strict=True):
        np.testing.assert_array_equal(mixed, inside)


def test_early_outputs_equal_the_step_end_copies(checkpoint_factory, monkeypatch):
    """With EngineOptions.early_outputs a step whose VAE runs inside its graph has its audio, patches and stop flags
    copied to the host once an event recorded in the graph fires (before the LMs' advance ends): pipelined or not,
    graphed or eager, the audio equals the copies made after the whole step, bit for bit, and nothing leaks."""
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    model = load_model(checkpoint_factory("tiny-voxcpm2", stop="never"), "cuda")
    reqs = [dict(text=f"Early {i}.", params=SamplingParams(seed=i, max_generate_length=8 - 2 * i)) for i in range(3)]
    for pipeline, eager in ((True, False), (False, False), (True, True)):
        config = dict(max_num_seqs=4, max_model_len=256, num_kv_blocks=128, attention_backend="triton",
                      pipeline_decode=pipeline, enforce_eager=eager)
        audio = {}
        for early in (False, True):
            engine = LLMEngine(model, EngineConfig(**config, options=EngineOptions(early_outputs=early)), "cuda")
            audio[early] = _run(engine, reqs)
            # an event per batch the steps ran at, recorded only when on (every bucket keeps its VAE inside)
            assert bool(engine.runner.decode_step.outputs_ready) == early
        for late, early_audio in zip(audio[False], audio[True], strict=True):
            np.testing.assert_array_equal(early_audio, late)


def test_kv_sizing_dry_steps_then_generation(checkpoint_factory, monkeypatch):
    """Without num_kv_blocks the engine sizes its KV cache from dry steps of its largest bucket and, when that bucket's
    VAE runs behind the step, of its largest bucket with the VAE inside; each dry step runs on its own layout of the
    step inputs (layouts of different sizes share bytes). The engine then generates what a sized-by-hand one does."""
    model = load_model(checkpoint_factory("tiny-voxcpm2", stop="never"), "cuda")
    reqs = [dict(text=f"Sized {i}.", params=SamplingParams(seed=i, max_generate_length=4)) for i in range(2)]
    # buckets 4 and 8 behind, 1 and 2 inside
    config = dict(max_num_seqs=8, max_model_len=256, attention_backend="triton",
                  options=EngineOptions(vae_overlap_min_batch=4))
    sized = LLMEngine(model, EngineConfig(**config, gpu_memory_utilization=0.5), "cuda")
    assert sized.runner.vae_stream.graphs and len(sized.blocks.blocks) > 16
    by_hand = LLMEngine(model, EngineConfig(**config, num_kv_blocks=64), "cuda")
    for a, b in zip(_run(sized, reqs), _run(by_hand, reqs), strict=True):
        np.testing.assert_array_equal(a, b)


def test_runtime_lora_in_graphs_matches_eager(checkpoint_factory, monkeypatch, tmp_path):
    """Runtime LoRA adapters on the CUDA paths (graphed prefill and decode, Triton attention, the fused projections
    and their split-K / GEMV partials, the one-kernel LoRA term of a few rows; the stack kernel steps aside): a batch
    of two adapters of different ranks and none equals the eager torch path (no fused kernel at all), and the
    adapters change the audio."""
    from engine.io.lora import LoRAConfig, random_adapter
    from engine.ops import lora as lora_ops

    monkeypatch.setattr(lora_ops, "KERNEL_MAX_LEAD", 8)  # the DiT's rows of three requests (CFG: 6) take it too
    calls: dict[str, int] = {"add_lora_kernel": 0, "add_lora_expand": 0}
    for name in calls:
        def counted(*args: object, _original=getattr(lora_ops, name), _name=name, **kwargs: object) -> torch.Tensor:
            calls[_name] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(lora_ops, name, counted)

    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    ckpt = checkpoint_factory("tiny-voxcpm2", stop="never")
    every = dict(enable_lm=True, enable_dit=True, enable_proj=True)
    adapters = {name: random_adapter(load_model(ckpt).backbone, tmp_path / name, LoRAConfig(**every, r=r, alpha=8),
                                     seed=seed) for name, r, seed in (("a", 4, 1), ("b", 8, 2))}
    reqs = [dict(text="Adapted on the GPU, and long enough for a few blocks.", params=SamplingParams(seed=i,
                 max_generate_length=5), kw=dict(lora_name=name)) for i, name in enumerate(("a", None, "b"))]
    config = dict(max_num_seqs=4, max_model_len=256, num_kv_blocks=128, max_loras=2, max_lora_rank=8)

    def run(**extra: object) -> tuple[LLMEngine, list[np.ndarray]]:
        engine = LLMEngine(load_model(ckpt, "cuda"), EngineConfig(**config, **extra), "cuda")
        for name, path in adapters.items():
            engine.register_lora(name, str(path))
        return engine, _run(engine, reqs)

    _, eager = run(enforce_eager=True, attention_backend="torch", options=EngineOptions(fuse=False))
    assert not any(calls.values())
    graphed_engine, graphed = run(attention_backend="triton")
    # Graph replays call no Python: these count what the term graphs were captured with (the few-row kernel in the
    # decode buckets, the expand kernel in the prefill buckets), which the replays then ran.
    assert all(calls.values()), calls
    assert graphed_engine.runner.graphs and graphed_engine.runner.prefill_graphs
    for g, e in zip(graphed, eager, strict=True):
        np.testing.assert_allclose(g, e, rtol=0, atol=1e-4 * np.abs(e).max())
    assert np.abs(graphed[0] - graphed[1]).max() > 1e-3 and np.abs(graphed[2] - graphed[1]).max() > 1e-3
    # Alone, each request runs the plain graphs (stack kernel, GEMV chain) on the weights with its adapter merged.
    lora = graphed_engine.runner.lora
    for req, e in zip(reqs, eager, strict=True):
        rewrites = lora.rewrites
        [alone] = _run(graphed_engine, [req])
        assert lora.rewrites == rewrites + 1 and (lora.merged == -1) == (req["kw"]["lora_name"] is None)
        np.testing.assert_allclose(alone, e, rtol=0, atol=1e-4 * np.abs(e).max())
