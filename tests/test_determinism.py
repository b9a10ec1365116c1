"""The README's determinism promise, exactly: on the CPU, the same request with the same seed gives the same audio
bytes whatever else is batched with it, whatever the prefix cache holds for its prompt, whether it was preempted
and recomputed, and however many threads torch runs on. The whole module runs again under each lower CPU capability
torch, oneDNN and MKL can be forced to (`test_exact_under_each_cpu_capability`), so one machine shows what another
CPU's kernels would do."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from engine.io.checkpoint import load_model
from engine.llm_engine import EngineConfig, LLMEngine
from engine.ops import batch_invariant
from engine.ops.batch_invariant import BatchInvariantMode
from engine.sequence import SamplingParams
from tests.conftest import clip_latents

ROOT = Path(__file__).resolve().parents[1]
FORCED = "VOXCPM_TEST_FORCED_CAPABILITY"  # set in the child runs: the capability they must be running under
# Each capability as the three libraries spell it: torch's own kernels, oneDNN (convolutions), MKL (GEMMs).
CAPABILITIES = {
    "default": {"ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "SSE41", "MKL_ENABLE_INSTRUCTIONS": "SSE4_2"},
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    "avx512": {"ATEN_CPU_CAPABILITY": "avx512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE",
               "MKL_ENABLE_INSTRUCTIONS": "AVX512"},
}
ORDER = list(CAPABILITIES)


@pytest.fixture(scope="module", autouse=True)
def _two_threads():
    """Torch on two threads in this module (conftest gives a pytest-xdist worker one): the promise is about a
    thread pool splitting the work, which one thread would never show."""
    threads = torch.get_num_threads()
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model(checkpoint_factory):
    return load_model(checkpoint_factory("tiny-voxcpm2", stop="never"))


def _requests(model) -> list[dict]:
    """One request per conditioning mode, with prompts long enough to span several 4-token blocks."""
    clip = clip_latents(model, 3, seed=1)
    return [
        dict(target_text="Zero shot, the same words again and again.", params=SamplingParams(seed=1,
                                                                                              max_generate_length=5)),
        dict(target_text="Continue this sentence.", prompt_text="A prompt.", prompt_latents=clip,
             params=SamplingParams(seed=3, max_generate_length=6, cfg_value=1.5)),
        dict(target_text="Reference voice.", ref_latents=clip,
             params=SamplingParams(seed=4, max_generate_length=4, temperature=0.7)),
        dict(target_text="Both, the HiFi way.", prompt_text="A prompt.", prompt_latents=clip, ref_latents=clip,
             params=SamplingParams(seed=5, max_generate_length=5)),
    ]


def _engine(model, **config) -> LLMEngine:
    return LLMEngine(model, EngineConfig(**{"max_num_seqs": 4, "max_model_len": 256, "block_size": 4, **config}))


def _alone(model, request: dict) -> np.ndarray:
    return _engine(model, max_num_seqs=1).generate_all([request])[0]


def _equal_bytes(a: np.ndarray, b: np.ndarray, what: str) -> None:
    assert a.shape == b.shape, what
    assert a.tobytes() == b.tobytes(), f"{what}: differs by up to {np.abs(a - b).max():.3e}"


def test_running_under_the_forced_capability():
    forced = os.environ.get(FORCED)
    if forced is None:
        pytest.skip("only in the forced-capability runs")
    assert torch.backends.cpu.get_cpu_capability().lower() == ("default" if forced == "default" else forced)


@pytest.mark.parametrize(("k_dim", "n"), [(32, 96), (256, 64), (1024, 1024)])
def test_a_projection_row_has_the_same_bytes_at_every_position_of_every_batch(k_dim, n):
    """The CPU projection's contract under this capability: a row's output bytes do not depend on where it sits in
    its tile, how many tiles the call has, or how many threads torch runs on (what the engine-level tests rely on; on
    a CPU whose GEMM computes some rows of a tile apart, this names the cause)."""
    g = torch.Generator().manual_seed(k_dim + n)
    weight, row = torch.randn(n, k_dim, generator=g), torch.randn(1, k_dim, generator=g)
    tile = batch_invariant.TILE_ROWS["cpu"]
    alone = batch_invariant.tiled_linear(row, weight)[0]
    threads = torch.get_num_threads()
    try:
        for count in (1, 2, 4):
            torch.set_num_threads(count)
            for rows in (tile, 2 * tile + 3):
                for position in range(rows):
                    batch = torch.randn(rows, k_dim, generator=g)
                    batch[position] = row[0]
                    out = batch_invariant.tiled_linear(batch, weight)[position]
                    assert torch.equal(out, alone), f"row {position} of {rows} on {count} threads"
    finally:
        torch.set_num_threads(threads)


def test_batched_requests_are_the_bytes_of_each_alone(model):
    reqs = _requests(model)
    together = _engine(model).generate_all(reqs)
    for n, r in enumerate(reqs):
        _equal_bytes(together[n], _alone(model, r), f"request {n} batched")


def test_prefix_cached_prompt_is_the_bytes_of_a_fresh_one(model):
    """The same request again on one engine: its prompt's full blocks come from the prefix cache (all but the block
    holding its last token, which is computed: also when the prompt is a whole number of blocks)."""
    engine = _engine(model)
    whole_blocks = 0
    for n, r in enumerate(_requests(model)):
        first = engine.generate_all([r])[0]
        seq_id = engine.add_request(**r)
        seq = engine.sequences[seq_id]
        engine.step()  # admits and prefills it from the cache
        assert 0 < seq.num_cached_tokens < seq.num_prompt_tokens
        assert seq.num_cached_tokens >= seq.num_prompt_tokens - engine.config.block_size
        whole_blocks += seq.num_prompt_tokens % engine.config.block_size == 0
        while engine.has_unfinished():
            engine.step()
        again = engine.generate_all([r])[0]
        _equal_bytes(again, first, f"request {n} from the prefix cache")
    # A prompt of a whole number of blocks too: the cache must leave its last block (its last token) computed.
    text = next(t for t in (f"Whole blocks {'x' * i}." for i in range(12))
                if _prompt_tokens(engine, t) % engine.config.block_size == 0)
    request = dict(target_text=text, params=SamplingParams(seed=9, max_generate_length=4))
    first = engine.generate_all([request])[0]
    seq_id = engine.add_request(**request)
    seq = engine.sequences[seq_id]
    engine.step()
    assert seq.num_cached_tokens == seq.num_prompt_tokens - engine.config.block_size
    while engine.has_unfinished():
        engine.step()
    _equal_bytes(engine.generate_all([request])[0], first, "a whole-blocks prompt from the prefix cache")
    assert engine.blocks.num_free == len(engine.blocks.blocks)


def _prompt_tokens(engine: LLMEngine, text: str) -> int:
    seq_id = engine.add_request(text, SamplingParams(max_generate_length=1))
    n = engine.sequences[seq_id].num_prompt_tokens
    engine.abort(seq_id)
    return n


def test_preempted_and_recomputed_requests_are_the_bytes_of_each_alone(model):
    reqs = [dict(target_text=f"Stream number {i} speaks.", params=SamplingParams(seed=10 + i, max_generate_length=12))
            for i in range(3)]
    small = _engine(model, max_num_seqs=3, max_model_len=64, num_kv_blocks=12)
    together = small.generate_all(reqs)
    assert small.scheduler.num_preemptions > 0
    for n, r in enumerate(reqs):
        _equal_bytes(together[n], _alone(model, r), f"request {n} preempted")


def test_the_thread_count_does_not_change_the_bytes(model):
    """A worker runs torch on its cores less one, a test process on two: the bytes are the same on one thread."""
    reqs = _requests(model)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _engine(model).generate_all(reqs)
    finally:
        torch.set_num_threads(threads)
    assert threads > 1 or os.cpu_count() == 1
    for n, audio in enumerate(_engine(model).generate_all(reqs)):
        _equal_bytes(one[n], audio, f"request {n} on one thread")


class _RowMixingOutsideTheHandlers(TorchDispatchMode):
    """Counts the aten ops of `batch_invariant.HANDLERS` run outside its handlers (a step's projections, GEMMs,
    convolutions and attention that the engine's function mode let through as they are)."""

    def __init__(self) -> None:
        super().__init__()
        self.escaped: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in batch_invariant.HANDLERS and not _HANDLING:
            self.escaped[str(func)] += 1
        return func(*args, **(kwargs or {}))


_HANDLING: list[int] = []  # non-empty while a batch-invariant handler runs


def _handling(fn):
    def wrapped(*args, **kwargs):
        _HANDLING.append(1)
        try:
            return fn(*args, **kwargs)
        finally:
            _HANDLING.pop()
    return wrapped


def test_every_row_mixing_op_of_a_step_runs_batch_invariantly(model, monkeypatch):
    """The engine's function mode (`BatchInvariantCalls`) gives some calls their handlers and sends others to the
    dispatch mode: no aten op that mixes rows may reach the kernels outside a handler, and the bytes are those of the
    dispatch mode around every op. The check fails where nothing is invariant (the last run)."""
    monkeypatch.setattr(BatchInvariantMode, "__torch_dispatch__", _handling(BatchInvariantMode.__torch_dispatch__))
    for call, handler in list(batch_invariant.CALL_HANDLERS.items()):
        monkeypatch.setitem(batch_invariant.CALL_HANDLERS, call, _handling(handler))
    reqs = _requests(model)
    runs = {}
    for name, invariance in [("calls", None), ("every op", BatchInvariantMode), ("none", contextlib.nullcontext)]:
        engine = _engine(model)
        if invariance is not None:
            engine.invariance = invariance
        with _RowMixingOutsideTheHandlers() as seen:
            runs[name] = (engine.generate_all(reqs), seen.escaped)
    assert not runs["calls"][1], f"row-mixing ops outside the batch-invariant handlers: {dict(runs['calls'][1])}"
    assert not runs["every op"][1] and runs["none"][1]["aten.linear.default"] > 0
    for n, (a, b) in enumerate(zip(runs["calls"][0], runs["every op"][0], strict=True)):
        _equal_bytes(a, b, f"request {n}, function mode against the dispatch mode around every op")


@pytest.mark.parametrize("capability", ORDER)
def test_exact_under_each_cpu_capability(capability):
    """This module again in a child process whose torch, oneDNN and MKL kernels are forced down to `capability`
    (a CPU is forced only down from what it has: higher ones are skipped). The check that every row-mixing op runs
    in a handler is about the engine's code paths, not the kernels: it runs once, here."""
    if os.environ.get(FORCED) is not None:
        pytest.skip("already a forced run")
    have = torch.backends.cpu.get_cpu_capability().lower()
    have = "avx512" if have.startswith("avx512") else have
    if have not in ORDER or ORDER.index(capability) > ORDER.index(have):
        pytest.skip(f"this CPU's capability is {have}")
    if capability == have:
        pytest.skip("this process runs under it: the tests above")
    env = {**os.environ, **CAPABILITIES[capability], FORCED: capability}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0", __file__,
                          "-k", "not test_exact_under_each_cpu_capability and not on_cuda and not row_mixing"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and "skipped" not in run.stdout.splitlines()[-1], run.stdout[-2000:]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_exact_mode_on_cuda_gives_the_same_bytes(checkpoint_factory):
    """VOXCPM_BATCH_INVARIANT=1 on a GPU (bf16, CUDA graphs, pipelined decode): the same request alone, from the
    prefix cache and batched with others in a larger graph bucket gives the same bytes."""
    from engine.options import EngineOptions

    model = load_model(checkpoint_factory("tiny-voxcpm2", dtype="bfloat16", stop="never"), "cuda")
    reqs = _requests(model)
    config = EngineConfig(max_num_seqs=8, max_model_len=256, block_size=4, num_kv_blocks=512,
                          options=EngineOptions(batch_invariant=True))
    engine = LLMEngine(model, config, "cuda")
    assert engine.runner.graphs and engine.pipeline
    for n, r in enumerate(reqs):
        alone = engine.generate_all([r])[0]
        _equal_bytes(engine.generate_all([r])[0], alone, f"request {n} from the prefix cache")
        others = [dict(target_text=f"Another one, number {i}.", params=SamplingParams(seed=50 + i,
                                                                                      max_generate_length=8))
                  for i in range(4)]
        _equal_bytes(engine.generate_all([*others[:2], r, *others[2:]])[2], alone, f"request {n} batched")
    assert engine.blocks.num_free == len(engine.blocks.blocks)
