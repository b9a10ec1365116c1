"""Shared fixtures: tiny random checkpoints made at test time (never committed), the official
package as the parity oracle, and a report of measured parity errors printed after the run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import is_dataclass, replace
from pathlib import Path

import pytest

# OpenMP threads wait at a barrier asleep, not spinning (before torch loads its OpenMP runtime, here and in every
# process started from here): with two test processes on CI's two cores, a module on two torch threads (the
# determinism promise's) spun at each op's barrier for a thread descheduled by the other process. Its in-process tests
# beside a busy core took 81.7 s (112 s of CPU) spinning, 23.2 s (33 s of CPU) asleep (2026-11-30).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch

from engine import options
from engine.io.random_checkpoint import make_random_checkpoint

TINY_PRESETS = ("tiny-voxcpm2", "tiny-voxcpm1.5", "tiny-voxcpm0.5b")
PARITY_FIGURES: list[tuple[str, float, float]] = []  # (what, measured max relative error, bound)

# Under pytest-xdist two test processes share the cores: a thread pool per process, each as wide as the machine,
# would wait at every op's barrier for a thread the other process holds, so each takes one.
XDIST_WORKER = os.environ.get("PYTEST_XDIST_WORKER")
torch.set_num_threads(1 if XDIST_WORKER else max(1, min(2, os.cpu_count() or 1)))


def relative_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """max |ours - ref| / max |ref| (a scale-aware max error; robust to near-zero entries); a NaN or an
    infinity in `ours` counts as an infinite error."""
    ours, ref = ours.detach().double().cpu(), ref.detach().double().cpu()
    assert ours.shape == ref.shape, f"shape {tuple(ours.shape)} != reference {tuple(ref.shape)}"
    if not torch.isfinite(ours).all():
        return float("inf")
    return float((ours - ref).abs().max() / ref.abs().max().clamp_min(1e-12))


def check_parity(what: str, ours: torch.Tensor, ref: torch.Tensor, bound: float) -> float:
    err = relative_error(ours, ref)
    PARITY_FIGURES.append((what, err, bound))
    assert err <= bound, f"{what}: max relative error {err:.3e} > {bound:.0e}"
    return err


def pytest_sessionfinish(session: pytest.Session) -> None:
    """An xdist worker hands its parity figures to the controller, which prints them all."""
    if XDIST_WORKER and hasattr(session.config, "workeroutput"):
        session.config.workeroutput["parity_figures"] = json.dumps(PARITY_FIGURES)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error) -> None:
    PARITY_FIGURES.extend(tuple(f) for f in json.loads(getattr(node, "workeroutput", {}).get("parity_figures", "[]")))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not PARITY_FIGURES:
        return
    terminalreporter.section("parity with voxcpm==2.0.3 (max relative error, measured / bound)")
    for what, err, bound in PARITY_FIGURES:
        terminalreporter.write_line(f"{what:<60} {err:.2e} / {bound:.0e}")


def clip_latents(model, patches: int, seed: int) -> torch.Tensor:
    """A seeded noise clip of `patches` patches through the model's VAE encoder (on the model's device), as the
    float32 CPU latents (frames, feat_dim) a request carries."""
    g = torch.Generator().manual_seed(seed)
    n = model.vae.chunk_size * model.config.patch_size * patches
    device = next(model.vae.parameters()).device
    with torch.inference_mode():
        audio = (0.2 * torch.randn(1, n, generator=g)).to(device)
        return model.vae.encode(audio, model.vae.sample_rate)[0].T.float().cpu().contiguous()


_made: dict[tuple, Path] = {}


@pytest.fixture(autouse=True)
def _restore_tf32_flags():
    """A CUDA model runner sets the process's TF32 flags (a worker owns its process); in the test process they would
    leak into later tests' fp32 references, so every test gets them back as it found them."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


@pytest.fixture(autouse=True)
def _restore_engine_options():
    """An engine installs its options as the process's (a worker owns its process; on CUDA in exact mode without the
    kernels that choose by the batch, e.g. the attention's key splits): every test gets back the ones it found."""
    with options.override():
        yield


@pytest.fixture(scope="session")
def checkpoint_factory(tmp_path_factory: pytest.TempPathFactory):
    """make(preset, dtype="float32", stop="random", vae_format="pth", seed=0) -> checkpoint dir (cached)."""

    def make(preset: str, dtype: str = "float32", stop: str = "random", vae_format: str = "pth",
             seed: int = 0) -> Path:
        key = (preset, dtype, stop, vae_format, seed)
        if key not in _made:
            out = tmp_path_factory.mktemp(f"{preset}-{dtype}-{stop}-{vae_format}-{seed}")
            _made[key] = make_random_checkpoint(out, preset, seed=seed, stop=stop, vae_format=vae_format,
                                                config_overrides={"dtype": dtype})
        return _made[key]

    return make


# Seconds of CPU the costliest modules took on CI's two cores (2026-11-30; every other module under 50). xdist hands
# each worker whole modules in collection order (`--no-loadscope-reorder`; its default deals the modules with the most
# tests first, which left the few-test heavy ones, fuzzing and the soak, to the end and a worker idle for a minute):
# these are collected first, the costliest first.
MODULE_CPU_SECONDS = {"test_ops_kernels": 210, "test_bench_tools": 135, "test_reliability": 130, "test_fuzz": 100,
                      "test_server_pool": 85, "test_service_longform": 85, "test_service_lora": 70,
                      "test_ops_paged_attention": 55, "test_determinism": 55, "test_service_overload": 50}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every test that skips without CUDA is marked `gpu`, so that the GPU routine (`pytest -m gpu`,
    tools/gpu_host/bench.sh PARTS=test) runs each of them and none is forgotten by a hand-kept selection. The costliest
    modules go first (`MODULE_CPU_SECONDS`), each module's tests in their order."""
    for item in items:
        if any("CUDA" in str(m.kwargs.get("reason", "")) for m in item.iter_markers("skipif")):
            item.add_marker(pytest.mark.gpu)
    items.sort(key=lambda item: -MODULE_CPU_SECONDS.get(item.path.stem, 0))


def interpreter_rows(module: str, timeout_s: float = 900) -> list[dict]:
    """Run `module._interpreter_main(shard, shards)` under TRITON_INTERPRET=1 in one subprocess per core (the
    interpreter is slow and single-threaded), and collect the JSON lines they print."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    shards = max(1, min(4, len(os.sched_getaffinity(0))))
    root = Path(__file__).resolve().parent.parent
    procs = [subprocess.Popen([sys.executable, "-c", f"from {module} import _interpreter_main; "
                               f"_interpreter_main({i}, {shards})"], cwd=root, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in range(shards)]
    rows = []
    for proc in procs:
        out, err = proc.communicate(timeout=timeout_s)
        assert proc.returncode == 0, f"interpreter subprocess failed:\n{out[-2000:]}\n{err[-4000:]}"
        rows += [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return rows


def patch_triton_interpreter() -> None:
    """Work around two bugs of the triton 3.6 interpreter (not of compiled kernels), and take out two of its costs
    that compiled kernels do not have; no-ops where absent.

    1. With numpy >= 2.4, `range(..., tensor, ...)` fails: it calls int() on a 1-element array
       (triton-lang/triton#9171, fixed upstream after 3.6).
    2. `tl.dot` on bf16 multiplies the raw uint16 storage of bf16 values; upcast them to fp32 first.
    3. Each call of a `@triton.jit` helper re-patches triton.language (`_patch_lang`: a walk over the members of
       its modules), though the running kernel has patched those same modules until it returns. Inside a kernel, a
       helper whose language modules the kernel has patched skips it (about a quarter of the VAE cases' CPU).
    4. Integer overflow checks on every integer add, sub and mul (`sanitize_overflow`), an assert that compiled
       kernels run only in debug builds and that cannot trip at these tests' sizes (about a fifth).
    The kernel cases' errors are bitwise the same with 3 and 4 (all of them, 2026-11-30).
    """
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    if hasattr(interpreter, "_patch_lang_tensor"):
        patch_lang_tensor = interpreter._patch_lang_tensor

        def patched_lang_tensor(tensor: type, scope: object) -> None:
            patch_lang_tensor(tensor, scope)
            scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

        interpreter._patch_lang_tensor = patched_lang_tensor

    builder = getattr(interpreter, "InterpreterBuilder", None)
    if builder is not None and hasattr(builder, "create_dot"):
        create_dot = builder.create_dot

        def upcast(h: object) -> object:
            if h.dtype != tl.bfloat16:
                return h
            return interpreter.TensorHandle((h.data.astype(np.uint32) << 16).view(np.float32), tl.float32)

        def patched_dot(self: object, a: object, b: object, *args: object) -> object:
            return create_dot(self, upcast(a), upcast(b), *args)

        builder.create_dot = patched_dot

    if all(hasattr(interpreter, name) for name in ("_patch_lang", "_LangPatchScope", "GridExecutor")):
        patch_lang, grid_call = interpreter._patch_lang, interpreter.GridExecutor.__call__
        running: list[tuple[object, frozenset[int]]] = []  # (kernel, ids of the language modules it patched)

        def languages(fn: Callable) -> frozenset[int]:
            return frozenset(id(v) for v in fn.__globals__.values() if v is tl or v is tl.core)

        def helper_patch_lang(fn: Callable) -> object:
            if running and fn is not running[-1][0] and languages(fn) <= running[-1][1]:
                return interpreter._LangPatchScope()  # nothing to patch: the kernel's patches hold until it returns
            return patch_lang(fn)

        def kernel_call(self: object, *args: object, **kwargs: object) -> object:
            running.append((self.fn, languages(self.fn)))
            try:
                return grid_call(self, *args, **kwargs)
            finally:
                running.pop()

        interpreter._patch_lang = helper_patch_lang
        interpreter.GridExecutor.__call__ = kernel_call

    built_with = getattr(getattr(interpreter, "interpreter_builder", None), "options", None)
    if is_dataclass(built_with) and hasattr(built_with, "sanitize_overflow"):
        interpreter.interpreter_builder.options = replace(built_with, sanitize_overflow=False)
