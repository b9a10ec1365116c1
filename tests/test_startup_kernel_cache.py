"""Kernel manifests (engine/startup/kernel_cache.py): a record as Triton's JIT writes it is reduced to a portable
manifest, found again by model shape and architecture, and compiled for sm_90 in a child process (no GPU needed: Triton
compiles for a named target) into the kernel cache, where the cache lookup then finds it. On CUDA: a start-up on an
empty cache with the manifest of an earlier start-up compiles nothing itself."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from engine.ops.platform import HAVE_TRITON

pytestmark = pytest.mark.skipif(not HAVE_TRITON, reason="needs triton")
REPO_ROOT = Path(__file__).resolve().parent.parent


def _jit_record() -> str:
    """The specialization record Triton's JIT passes its cache hook for `_silu_mul_kernel` on bf16 rows of 1024
    (16-byte aligned pointers, row strides divisible by 16), 4 warps."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend
    from triton.runtime.jit import serialize_specialization_data

    from engine.ops import silu_mul
    options = make_backend(GPUTarget("cuda", 90, 32)).parse_options({"num_warps": 4, "debug": False})
    signature = {"g_ptr": "*bf16", "u_ptr": "*bf16", "o_ptr": "*bf16", "n_cols": "i32", "stride_g": "i32",
                 "stride_u": "i32", "BLOCK": "constexpr"}
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(6)}
    fn = silu_mul._silu_mul_kernel
    return serialize_specialization_data(f"{fn.__module__}.{fn.__qualname__}", signature, {(6,): 1024}, attrs,
                                         options, "jit-key")


def _use_manifest_option(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """This process's engine options with `kernel_manifest` set (restored after the test)."""
    import dataclasses

    from engine import options
    monkeypatch.setattr(options, "_current", dataclasses.replace(options.current(), kernel_manifest=str(path)))


def _use_only_manifest(path: Path, digest: str, entries: list[dict], monkeypatch: pytest.MonkeyPatch,
                       triton: str | None = None) -> None:
    """Write a manifest for `digest` on sm_90 and make it the only one the precompiler reads."""
    from engine.startup import kernel_cache
    path.write_text(json.dumps({"model": digest, "arch": 90, "triton": triton or kernel_cache.triton_version(),
                                "entries": entries}))
    monkeypatch.setattr(kernel_cache, "MANIFEST_DIR", path.parent / "shipped")
    _use_manifest_option(path, monkeypatch)


def _run_fresh(code: str, cache: Path, timeout_s: float) -> str:
    """Run `code` in a fresh interpreter (this one has torch imported) on the kernel cache `cache`: its stdout."""
    env = {**os.environ, "TRITON_CACHE_DIR": str(cache)}
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout_s)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_manifest_round_trip_and_compile(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from engine.config import VoxCPMConfig
    from engine.startup import kernel_cache

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache"))
    recorder = kernel_cache.Recorder()
    data = _jit_record()
    assert recorder._on_jit_miss(compile={"specialization_data": data}) is False  # the JIT goes on compiling
    recorder._on_jit_miss(compile={"specialization_data": data})  # a second miss of the same variant: one record
    recorder._on_compile(cache_hit=False)
    recorder._on_compile(cache_hit=True)
    assert recorder.since((0, 0)) == {"jit_compiled": 1, "jit_compiled_names": ["?"], "jit_from_cache": 1}

    cfg = VoxCPMConfig.from_dict(json.loads((REPO_ROOT / "engine/io/presets/voxcpm2.json").read_text()))
    digest = kernel_cache.model_digest(cfg, torch.bfloat16)
    assert digest != kernel_cache.model_digest(cfg, torch.float16)
    manifest = recorder.manifest(digest, 90)
    (entry,) = manifest["entries"]
    # launch options reduced to the non-defaults: none here (4 warps is Triton's default); no library paths
    assert entry["options"] == {} and "key" not in entry
    assert entry["name"] == "engine.ops.silu_mul._silu_mul_kernel"

    path = tmp_path / "m.json"
    path.write_text(json.dumps(manifest))
    monkeypatch.setattr(kernel_cache, "MANIFEST_DIR", tmp_path / "shipped")  # only this one (the shipped match)
    _use_manifest_option(path, monkeypatch)
    assert kernel_cache.load_manifests(digest, 90) == [entry]
    assert kernel_cache.load_manifests(digest, 80) == []  # another architecture
    assert kernel_cache.load_manifests("0" * 16, 90) == []  # another model shape

    assert not kernel_cache.is_cached(entry, 90)
    # compiled in a child process, as the engine's precompiler does (no GPU needed); a broken record fails alone
    broken = {**entry, "name": "engine.ops.silu_mul._no_such_kernel"}
    result = kernel_cache.CompilerProcesses([entry, broken, entry], 90, workers=2).collect()
    assert (result["precompiled"], result["precompile_failed"]) == (2, 1)  # each record compiled once, by one child
    assert kernel_cache.is_cached(entry, 90)
    assert not kernel_cache.is_cached({**entry, "options": {"num_warps": 8}}, 90)  # another variant


def test_a_variant_manifest_holds_what_its_settings_add_and_only_they_read_it(tmp_path: Path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A manifest recorded with FP8 weights (or another `manifest_variant` setting) keeps only the records the
    model's own manifests lack, one of FP8 with the fast accumulation only those the FP8 one lacks too (not the FP8
    one's again), and an engine reads each only when its settings include that variant."""
    from engine.engine_config import EngineConfig
    from engine.options import EngineOptions
    from engine.startup import kernel_cache

    assert kernel_cache.manifest_variant(EngineConfig()) == {}
    assert kernel_cache.manifest_variant(EngineConfig(vae_dtype="fp32")) == {}  # the default, spelled out
    both = kernel_cache.manifest_variant(EngineConfig(quantization="fp8", vae_dtype="bf16"))
    assert both == {"quantization": "fp8", "vae_dtype": "bfloat16"}
    fast = EngineOptions(fp8_fast_accum=True)  # the gated FP8 GEMM's kernels, on Hopper only with it
    assert kernel_cache.manifest_variant(EngineConfig(options=fast)) == {}
    assert kernel_cache.manifest_variant(EngineConfig(quantization="fp8", options=fast)) == {"quantization": "fp8",
                                                                                            "fp8_fast_accum": "True"}
    # runtime LoRA slots: their rank is a constexpr of the LoRA kernels, their count a runtime value, which changes
    # the compiled variants (Triton's divisibility by 16 of the slot columns) only for ranks no multiple of 16
    assert kernel_cache.manifest_variant(EngineConfig(max_loras=4, max_lora_rank=16)) == {"lora": "r16"}
    assert kernel_cache.manifest_variant(EngineConfig(max_loras=7, max_lora_rank=32)) == {"lora": "r32"}
    assert kernel_cache.manifest_variant(EngineConfig(max_loras=3, max_lora_rank=8)) == {"lora": "r8x3"}

    model_recorder = kernel_cache.Recorder()
    model_recorder._on_jit_miss(compile={"specialization_data": _jit_record()})
    _use_only_manifest(tmp_path / "base.json", "d" * 16, model_recorder.manifest("d" * 16, 90)["entries"], monkeypatch)
    recorder = kernel_cache.Recorder()
    recorder._on_jit_miss(compile={"specialization_data": _jit_record()})  # in the model's manifest already
    extra = {**json.loads(_jit_record()), "name": "engine.ops.fp8._quantize_rows_kernel"}
    recorder._on_jit_miss(compile={"specialization_data": json.dumps(extra)})
    fp8_manifest = recorder.manifest("d" * 16, 90, {"quantization": "fp8"})
    assert fp8_manifest["variant"] == {"quantization": "fp8"}
    assert [e["name"] for e in fp8_manifest["entries"]] == ["engine.ops.fp8._quantize_rows_kernel"]

    shipped = tmp_path / "shipped"
    shipped.mkdir()
    (shipped / "fp8.json").write_text(json.dumps(fp8_manifest))
    names = {key: sorted(e["name"] for e in kernel_cache.load_manifests("d" * 16, 90, variant))
             for key, variant in (("plain", {}), ("bf16 vae", {"vae_dtype": "bfloat16"}),
                                  ("fp8", {"quantization": "fp8"}), ("both", both))}
    assert names["plain"] == names["bf16 vae"] == ["engine.ops.silu_mul._silu_mul_kernel"]
    assert names["fp8"] == names["both"] == ["engine.ops.fp8._quantize_rows_kernel",
                                             "engine.ops.silu_mul._silu_mul_kernel"]

    gated = {**json.loads(_jit_record()), "name": "engine.ops.fp8_gemm._fp8_gemm_persistent_kernel"}
    recorder._on_jit_miss(compile={"specialization_data": json.dumps(gated)})
    fast_variant = {"quantization": "fp8", "fp8_fast_accum": "True"}
    fast_manifest = recorder.manifest("d" * 16, 90, fast_variant)
    assert [e["name"] for e in fast_manifest["entries"]] == ["engine.ops.fp8_gemm._fp8_gemm_persistent_kernel"]
    (shipped / "fp8_fast.json").write_text(json.dumps(fast_manifest))
    # Recorded again, a variant keeps its records: neither its own manifest nor a wider variant's is subtracted.
    assert (recorder.manifest("d" * 16, 90, {"quantization": "fp8"})["entries"]
            == fp8_manifest["entries"] + fast_manifest["entries"])
    assert len(kernel_cache.load_manifests("d" * 16, 90, {"quantization": "fp8"})) == 2
    assert len(kernel_cache.load_manifests("d" * 16, 90, fast_variant)) == 3


def test_a_compiler_child_never_imports_torch(tmp_path: Path) -> None:
    """The precompile's children import the kernel modules for their Triton functions only: torch (seconds of each
    child's start, fifteen at once) stays unimported through the compile, for sm_90, of the shipped manifest's
    largest record (the layer kernel with its grid barriers) and of a small one."""
    manifest = json.loads((REPO_ROOT / "engine/startup/kernel_manifests/voxcpm2-sm90.json").read_text())
    layer = max((e for e in manifest["entries"] if e["name"].endswith("._dense_layer_kernel")),
                key=lambda e: e["compile_s"])
    records = [layer, json.loads(_jit_record())]
    code = ("import json, sys\n"
            "from engine.startup.kernel_compiler import compile_record\n"
            f"for record in json.loads({json.dumps(json.dumps(records))}):\n"
            "    compile_record(record, 90)\n"
            "print('torch imported:', 'torch' in sys.modules)\n")
    out = _run_fresh(code, tmp_path / "cache", timeout_s=300)
    assert out.strip().endswith("torch imported: False"), out


def test_every_shipped_record_names_its_kernels_parameters() -> None:
    """A kernel whose parameters change (an argument or a constexpr added, renamed or removed) leaves its shipped
    records stale: start-up skips them and the JIT compiles that kernel inside a cold start. Such a change re-records
    the manifests on a GPU (tools/record_kernel_manifest.py, per settings variant) in the same commit. A variant that
    changes without its parameters (a pointer's dtype, a constexpr's value) passes here: the tool's --check, on a GPU,
    finds it."""
    import importlib

    from engine.startup import kernel_cache

    stale = []
    for path in sorted(kernel_cache.MANIFEST_DIR.glob("*.json")):
        for entry in json.loads(path.read_text())["entries"]:
            module, name = entry["name"].rsplit(".", 1)
            kernel = getattr(importlib.import_module(module), name)
            if list(entry["signature"]) != list(kernel.arg_names):
                stale.append(f"{path.name}: {name}")
    assert stale == [], f"records whose kernel's parameters changed since they were recorded: {sorted(set(stale))}"


def test_the_shipped_manifests_match_the_presets_digests() -> None:
    """Each shipped manifest is found by the digest of its model's configuration: a change of the digest's formula
    or of the parsed configuration's fields (which would silently turn the shipped manifests off) fails here."""
    from engine.config import VoxCPMConfig
    from engine.startup import kernel_cache

    for preset, manifest in (("voxcpm2", "voxcpm2-sm90"), ("voxcpm0.5b", "voxcpm0.5b-sm90")):
        cfg = VoxCPMConfig.from_dict(json.loads((REPO_ROOT / f"engine/io/presets/{preset}.json").read_text()))
        shipped = json.loads((REPO_ROOT / f"engine/startup/kernel_manifests/{manifest}.json").read_text())
        assert kernel_cache.model_digest(cfg, cfg.dtype) == shipped["model"], preset
        assert kernel_cache.model_digest(cfg, torch.bfloat16) == shipped["model"], preset  # a dtype or its name


def test_every_shipped_variant_manifest_is_read_by_the_settings_it_names() -> None:
    """A variant manifest is read only by engines whose `manifest_variant` includes its variant: each shipped one's
    variant is what the settings it names give, and an engine of those settings reads all its records (a renamed
    key or value spelling would turn it off silently)."""
    from engine.engine_config import EngineConfig
    from engine.options import EngineOptions
    from engine.startup import kernel_cache

    manifests = [m for m in (json.loads(path.read_text()) for path in kernel_cache.MANIFEST_DIR.glob("*.json"))
                 if m.get("variant")]
    assert {key for m in manifests for key in m["variant"]} == {"quantization", "vae_dtype", "fp8_fast_accum", "lora"}
    for m in manifests:
        variant = m["variant"]
        rank, _, count = variant.get("lora", "r32x0").removeprefix("r").partition("x")
        config = EngineConfig(quantization=variant.get("quantization"), vae_dtype=variant.get("vae_dtype"),
                              max_loras=int(count or 4) if "lora" in variant else 0, max_lora_rank=int(rank),
                              options=EngineOptions(fp8_fast_accum=variant.get("fp8_fast_accum") == "True"))
        assert kernel_cache.manifest_variant(config) == variant
        read = kernel_cache.load_manifests(m["model"], m["arch"], kernel_cache.manifest_variant(config))
        assert {kernel_cache._identity(e) for e in m["entries"]} <= {kernel_cache._identity(e) for e in read}, variant


def test_the_precompile_starts_without_torch(tmp_path: Path) -> None:
    """The service's supervisor starts the precompile of the shipped VoxCPM2 manifest (sm_90, empty kernel cache)
    from the checkpoint's config alone, with no torch imported (a fresh interpreter: this one has torch): it then
    starts at once beside the workers instead of after torch's import."""
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt/config.json").write_text((REPO_ROOT / "engine/io/presets/voxcpm2.json").read_text())
    code = ("import sys\n"
            "from engine.startup import kernel_cache\n"
            f"p = kernel_cache.Precompiler({str(tmp_path / 'ckpt')!r}, 'bfloat16', None, arch=90)\n"
            "print(p.stats['manifest_records'], p.stats['missing'])\n"
            "p.close()\n"
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n")
    counts, imported = _run_fresh(code, tmp_path / "cache", timeout_s=120).strip().splitlines()
    shipped = json.loads((REPO_ROOT / "engine/startup/kernel_manifests/voxcpm2-sm90.json").read_text())
    assert counts == f"{len(shipped['entries'])} {len(shipped['entries'])}"
    assert imported == "[]", f"torch imported: {imported[:300]}"


def test_a_record_that_no_longer_fits_its_kernel_is_skipped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            checkpoint_factory) -> None:
    """A record naming a kernel that is gone counts as failed; the others still compile."""
    from engine.config import VoxCPMConfig
    from engine.startup import kernel_cache
    ckpt = checkpoint_factory("tiny-voxcpm2")
    cfg = VoxCPMConfig.from_dir(ckpt)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache"))
    entry = json.loads(_jit_record())
    broken = {**entry, "name": "engine.ops.silu_mul._no_such_kernel"}
    _use_only_manifest(tmp_path / "m.json", kernel_cache.model_digest(cfg, cfg.dtype), [broken, entry], monkeypatch)
    stats = kernel_cache.Precompiler(ckpt, None, None, arch=90).wait()
    assert (stats["missing"], stats["precompiled"], stats["precompile_failed"]) == (1, 1, 1)


def test_the_service_starts_its_api_processes_after_the_background_precompile(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, checkpoint_factory) -> None:
    """The supervisor holds its API processes back while the pool's background precompile compiles (a real one: a
    manifest of one record, sm_90, an empty cache), not past a worker's start-up ending, nor past a stop."""
    import asyncio
    import concurrent.futures
    from types import SimpleNamespace

    from engine.config import VoxCPMConfig
    from engine.startup import kernel_cache
    from service import supervisor as supervisor_module
    from service.settings import Settings
    from service.supervisor import Supervisor
    ckpt = checkpoint_factory("tiny-voxcpm2")
    cfg = VoxCPMConfig.from_dir(ckpt)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache"))
    _use_only_manifest(tmp_path / "m.json", kernel_cache.model_digest(cfg, cfg.dtype), [json.loads(_jit_record())],
                       monkeypatch)

    async def held_back(workers: SimpleNamespace, stop: bool = False) -> tuple[bool, bool]:
        supervisor = Supervisor(Settings())
        if stop:
            supervisor.stopping.set()
        go_on = await supervisor._after_precompile(workers)  # type: ignore[arg-type]
        return go_on, workers.precompile_thread is not None and workers.precompile_thread.is_alive()

    precompile = kernel_cache.Precompiler(ckpt, None, None, arch=90, background=True)
    assert precompile.background is not None and precompile.background.is_alive()
    worker = SimpleNamespace(started=concurrent.futures.Future())
    workers = SimpleNamespace(precompile_thread=precompile.background, processes=[worker])
    assert asyncio.run(held_back(workers)) == (True, False)
    assert precompile.stats["precompiled"] == 1  # what it compiled was in the cache before the API processes started
    assert kernel_cache.Precompiler(ckpt, None, None, arch=90, background=True).background is None  # nothing left

    # a worker's start-up that ended (here: failed) lets them start at once, as does the hold's limit; a stop
    # returns False at once
    shutil.rmtree(tmp_path / "cache")
    precompile = kernel_cache.Precompiler(ckpt, None, None, arch=90, background=True)
    try:
        worker.started.set_exception(RuntimeError("the worker died while starting"))
        running = SimpleNamespace(precompile_thread=precompile.background, processes=[])
        workers = SimpleNamespace(precompile_thread=precompile.background, processes=[worker])
        assert asyncio.run(held_back(workers)) == (True, True)
        assert asyncio.run(held_back(running, stop=True)) == (False, True)
        monkeypatch.setattr(supervisor_module, "API_HOLD_MAX_S", 0.0)
        assert asyncio.run(held_back(running)) == (True, True)
    finally:
        if precompile.background is not None:
            precompile.background.join(timeout=120)
        precompile.close()


def test_a_stop_during_the_background_precompile_kills_its_children(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                    checkpoint_factory) -> None:
    """`close()` from another thread while the background waiter collects (the service stopped during its start,
    `WorkerSet.stop`): the compiling children are killed at once, the waiter ends and cleans up (work folder gone,
    lock released: the next precompile compiles), and the killed record counts as failed."""
    from engine.config import VoxCPMConfig
    from engine.startup import kernel_cache
    ckpt = checkpoint_factory("tiny-voxcpm2")
    cfg = VoxCPMConfig.from_dir(ckpt)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache"))
    _use_only_manifest(tmp_path / "m.json", kernel_cache.model_digest(cfg, cfg.dtype), [json.loads(_jit_record())],
                       monkeypatch)
    precompile = kernel_cache.Precompiler(ckpt, None, None, arch=90, background=True)
    compilers, waiter = precompile._compilers, precompile.background
    assert compilers is not None and waiter is not None and waiter.is_alive()
    t0 = time.monotonic()
    precompile.close()  # the children are still importing: none has compiled the record
    waiter.join(timeout=30)
    assert not waiter.is_alive() and time.monotonic() - t0 < 10
    assert all(proc.returncode is not None and proc.returncode < 0 for proc in compilers.procs)  # killed
    assert not compilers.workdir.exists()
    assert (precompile.stats["precompiled"], precompile.stats["precompile_failed"]) == (0, 1)
    again = kernel_cache.Precompiler(ckpt, None, None, arch=90)  # the lock was released
    assert again.wait()["precompiled"] == 1

    # the pool's and the supervisor's stop does that to the early precompile of their WorkerSet: a real one, its
    # worker still loading; only its precompile's architecture is given (a CPU device starts none: no CUDA here)
    from engine.serving.processes import WorkerSet
    from engine.serving.voxcpm import engine_config
    shutil.rmtree(tmp_path / "cache")
    monkeypatch.setattr(WorkerSet, "_precompile_early",
                        lambda self: kernel_cache.Precompiler(ckpt, None, None, arch=90, background=True))
    workers = WorkerSet(str(ckpt), ["cpu"], engine_config(max_num_seqs=2, max_model_len=256))
    try:
        assert workers.precompiler is not None
        compilers, waiter = workers.precompiler._compilers, workers.precompile_thread
        assert compilers is not None and waiter is not None and waiter.is_alive()
        assert not workers.processes[0].started.done()  # its engine not ready
    finally:
        t0 = time.monotonic()
        workers.stop()
    waiter.join(timeout=30)
    assert not waiter.is_alive()
    assert all(proc.returncode is not None and proc.returncode < 0 for proc in compilers.procs)  # killed
    assert workers.processes[0].exitcode == 0 and not os.path.exists(workers.directory)  # it stopped when told
    assert time.monotonic() - t0 < 10  # the precompile's children killed, not waited for


def test_one_precompile_per_cache_at_a_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                            checkpoint_factory) -> None:
    """Two precompilers of one cache (the pool's parent and a worker's engine): the first takes the lock and
    compiles; the second defers to `wait()`, blocks until the first is done, then finds nothing missing."""
    from engine.config import VoxCPMConfig
    from engine.startup import kernel_cache
    ckpt = checkpoint_factory("tiny-voxcpm2")
    cfg = VoxCPMConfig.from_dir(ckpt)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache"))
    entry = json.loads(_jit_record())
    digest = kernel_cache.model_digest(cfg, cfg.dtype)
    _use_only_manifest(tmp_path / "m.json", digest, [entry], monkeypatch)

    first = kernel_cache.Precompiler(ckpt, None, None, arch=90)  # no CUDA here: the architecture is given
    second = kernel_cache.Precompiler(ckpt, None, None, arch=90)
    assert first.stats["missing"] == 1 and first.stats["workers"] == 1
    assert "missing" not in second.stats  # the lock was taken: nothing checked or started yet
    waiter = threading.Thread(target=second.wait)
    waiter.start()
    time.sleep(0.5)  # the first holds the lock until its wait(), however fast its child: the second is blocked
    assert waiter.is_alive()
    done = first.wait()
    assert (done["precompiled"], done["precompile_failed"]) == (1, 0)
    waiter.join(timeout=60)
    after = second.stats
    assert not waiter.is_alive() and after["missing"] == 0 and after["precompiled"] == 0
    assert after["waited_for_other_s"] > 0.4
    # lock released: a third one checks at once and finds the cache complete
    assert kernel_cache.Precompiler(ckpt, None, None, arch=90).stats["missing"] == 0

    # a manifest of another Triton release line is not used
    _use_only_manifest(tmp_path / "m.json", digest, [entry], monkeypatch, triton="2.0.0")
    assert kernel_cache.Precompiler(ckpt, None, None, arch=90).stats["manifest_records"] == 0


def test_precompile_trouble_never_fails_a_start(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 checkpoint_factory) -> None:
    """An unusable cache dir turns the precompile off (the engine's JIT compiles as before); close() kills the
    children and removes their work folder."""
    from engine.config import VoxCPMConfig
    from engine.startup import kernel_cache
    ckpt = checkpoint_factory("tiny-voxcpm2")
    cfg = VoxCPMConfig.from_dir(ckpt)
    entry = json.loads(_jit_record())
    _use_only_manifest(tmp_path / "m.json", kernel_cache.model_digest(cfg, cfg.dtype), [entry], monkeypatch)
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "a-file" / "cache"))  # cannot be created
    p = kernel_cache.Precompiler(ckpt, None, None, arch=90)
    assert p.stats["manifest_records"] == 1 and "missing" not in p.stats
    assert p.wait()["precompiled"] == 0

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache"))
    compilers = kernel_cache.CompilerProcesses([entry], 90, workers=1)
    compilers.close()
    assert all(proc.poll() is not None for proc in compilers.procs) and not compilers.workdir.exists()


def test_prebuilt_kernels_fill_a_cache_that_a_start_then_finds_complete(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                       checkpoint_factory) -> None:
    """The image's build step (`python -m engine.startup.prebuild`, no GPU) compiles the shipped manifests' records,
    their launchers and Triton's driver module, linking the C modules against a libcuda stub that they still name; the
    service seeds its empty kernel cache from there (NANOVLLM_PREBUILT_KERNELS_DIR), and the start-up's precompile then
    finds nothing missing, also once the prebuilt folder is gone. A manifest with an unusable record, or none of this
    Triton release line, fails the build."""
    import shutil

    from engine.config import VoxCPMConfig
    from engine.startup import kernel_cache, prebuilt
    from engine.startup.prebuild import main as build
    from service.engine_setup import prepare_kernel_cache
    from service.settings import Settings

    ckpt = checkpoint_factory("tiny-voxcpm2")
    cfg = VoxCPMConfig.from_dir(ckpt)
    shipped = tmp_path / "shipped"
    shipped.mkdir()
    jit_record = json.loads(_jit_record())
    shipped_manifest = REPO_ROOT / "engine/startup/kernel_manifests/voxcpm2-sm90.json"
    shipped_entries = json.loads(shipped_manifest.read_text())["entries"]
    # The quickest shipped record of another signature (so a second launcher).
    entries = [jit_record, min((e for e in shipped_entries if e["signature"] != jit_record["signature"]),
                               key=lambda e: e["compile_s"])]
    manifest = {"model": kernel_cache.model_digest(cfg, cfg.dtype), "arch": 90, "triton": kernel_cache.triton_version(),
                "entries": entries}
    (shipped / "m.json").write_text(json.dumps(manifest))
    monkeypatch.setattr(kernel_cache, "MANIFEST_DIR", shipped)
    out = tmp_path / "prebuilt"
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "elsewhere"))  # the tool points this process at --out
    assert build(["--out", str(out), "--workers", "2", "--link-stub"]) == 0
    assert os.environ["TRITON_CACHE_DIR"] == str(out.resolve())
    assert all(kernel_cache.is_cached(e, 90) for e in entries)
    modules = sorted(p.name.split(".")[0] for p in out.glob("*/*.so"))
    assert modules == ["__triton_launcher", "__triton_launcher", "cuda_utils"]  # one launcher per signature
    for so in out.glob("*/*.so"):  # linked against the stub, they name the driver that supplies their symbols
        needed = subprocess.run(["readelf", "-d", str(so)], capture_output=True, text=True, check=True).stdout
        assert "[libcuda.so.1]" in needed, so
    assert build(["--out", str(out)]) == 0  # again: nothing missing, nothing to do
    again = prebuilt.prebuild(dict(os.environ), 2)["sm_90"]
    assert (again["records"], again["missing"], again["unusable"]) == (2, 0, 0)

    settings = Settings(cache_dir=tmp_path / "volume", prebuilt_kernels_dir=out)
    monkeypatch.delenv("TRITON_CACHE_DIR")
    monkeypatch.setenv("CUDA_CACHE_PATH", "restored-after-the-test")
    monkeypatch.delenv("CUDA_CACHE_PATH")
    cache = tmp_path / "volume" / "kernels" / "triton"
    (cache / next(out.iterdir()).name).mkdir(parents=True)  # an empty folder, as a cache lookup leaves: seeded too
    prepare_kernel_cache(settings)
    assert os.environ["TRITON_CACHE_DIR"] == str(cache)
    assert sorted(p.name for p in cache.iterdir()) == sorted(p.name for p in out.iterdir())
    assert prebuilt.seed(out, cache) == 0  # what the cache has is kept
    shutil.rmtree(out)  # the copies stand alone (Triton's group files name their members by path)
    start = kernel_cache.Precompiler(ckpt, None, None, arch=90)
    assert (start.stats["manifest_records"], start.stats["missing"]) == (2, 0)
    start.close()

    broken = {**entries[0], "name": "engine.ops.silu_mul._no_such_kernel"}
    (shipped / "m.json").write_text(json.dumps({**manifest, "entries": [broken]}))
    assert build(["--out", str(tmp_path / "broken")]) == 1
    (shipped / "m.json").write_text(json.dumps({**manifest, "triton": "2.0.0"}))  # another release line: no records
    assert build(["--out", str(tmp_path / "none")]) == 1


def test_a_kernel_compiled_at_start_is_a_warning_naming_it(checkpoint_factory, monkeypatch: pytest.MonkeyPatch,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    """A variant the JIT compiles in a start-up or warm-up of an engine whose precompile read kernel manifests is one
    they lack (the stale-manifest case that cost every cold start 1.6-2.1 s): a warning naming the kernel and the
    settings. Without manifests for the engine (another GPU, the precompile off), compiling is expected: info only."""
    from engine.engine_config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.startup import kernel_cache

    recorder = kernel_cache.Recorder()
    monkeypatch.setattr(kernel_cache, "RECORDER", recorder)
    engine = LLMEngine(str(checkpoint_factory("tiny-voxcpm2")), EngineConfig(max_loras=2, max_lora_rank=8))
    assert engine.startup_phases["kernels"]["jit_compiled"] == 0  # nothing listens on the CPU
    assert "manifest_records" not in engine.startup_phases["kernels"]  # and no precompile runs there
    mark = recorder.mark()
    recorder._on_jit_miss(compile={"specialization_data": _jit_record()})
    recorder._on_compile(cache_hit=False, src=type("Src", (), {"name": "_silu_mul_kernel"})())

    def logged(level: int) -> list[str]:
        return [r.getMessage() for r in caplog.records if r.name == "engine.llm_engine" and r.levelno == level]

    with caplog.at_level(logging.INFO, logger="engine.llm_engine"):
        assert engine.kernel_compiles_since(mark, "warm-up")["jit_compiled_names"] == ["_silu_mul_kernel"]
        assert logged(logging.WARNING) == [] and "no kernel manifest read" in logged(logging.INFO)[-1]
        engine.startup_phases["kernels"]["manifest_records"] = 116  # as a CUDA start that read the shipped ones
        engine.kernel_compiles_since(mark, "warm-up")
    (warning,) = logged(logging.WARNING)
    assert "warm-up compiled 1 Triton kernel variants" in warning and warning.endswith(": _silu_mul_kernel")
    assert "'lora': 'r8x2'" in warning  # the settings whose manifests lack it


def test_precompiler_is_off_without_cuda() -> None:
    from engine.startup import kernel_cache
    stats = kernel_cache.Precompiler("/nonexistent", None, torch.device("cpu")).wait()
    assert stats["precompiled"] == 0 and "manifest_records" not in stats


def test_kernel_resources_reads_a_shipped_records_registers_compiled_without_a_gpu(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """`tools/kernel_resources.py` compiles the shipped records for sm_90 here and reads their resources from the
    cubin: the dense-attention records (the stacked one the default at every graphed batch) state their warps and
    registers, and a filter that matches no kernel fails."""
    from tools import kernel_resources

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    out = tmp_path / "resources.json"
    assert kernel_resources.main(["--only", "_dense_attention_kernel", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    stacked = [r for r in rows if r["constexprs"]["STACKED"]]
    # VoxCPM2's, 0.5B's and the runtime-LoRA variant's (with LoRA terms the DiT's small batches leave the layer kernel)
    assert len(stacked) == 3 and {r["kernel"] for r in rows} == {"_dense_attention_kernel"}
    for r in rows:
        assert r["num_warps"] == 4 and 0 < r["registers"] <= 255, r
        assert r["programs_per_sm_by_registers"] == 65536 // (r["registers"] * 32 * 4)
    assert "_dense_attention_kernel" in capsys.readouterr().out
    assert kernel_resources.main(["--only", "no_such_kernel"]) == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_start_on_empty_cache_with_manifest_compiles_nothing_itself(tmp_path: Path) -> None:
    """Start-up 1 (cache A) records a manifest; start-up 2 on an empty cache B with that manifest precompiles it
    in the pool, and its JIT then finds every kernel in the cache (0 compiled in-process)."""
    from engine.io.random_checkpoint import make_random_checkpoint
    ckpt = tmp_path / "ckpt"
    make_random_checkpoint(ckpt, "tiny-voxcpm2", seed=0)
    script = (
        "import json, sys\n"
        "from engine.startup import kernel_cache\n"
        "from engine.llm_engine import EngineConfig, LLMEngine\n"
        "e = LLMEngine(sys.argv[1], EngineConfig(max_num_seqs=4), device='cuda')\n"
        "m = kernel_cache.RECORDER.manifest_of(e.model)\n"
        "open(sys.argv[2], 'w').write(json.dumps(m))\n"
        "print(json.dumps(e.startup_phases['kernels']))\n")

    def start(cache: str, manifest_out: Path, manifest_in: Path | None) -> dict:
        path = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p)
        env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path / cache), "PYTHONPATH": path}
        env.pop("VOXCPM_KERNEL_MANIFEST", None)
        if manifest_in is not None:
            env["VOXCPM_KERNEL_MANIFEST"] = str(manifest_in)
        out = subprocess.run([sys.executable, "-c", script, str(ckpt), str(manifest_out)], env=env, cwd=REPO_ROOT,
                             capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    first = start("a", tmp_path / "m1.json", None)
    assert first["jit_compiled"] > 0
    second = start("b", tmp_path / "m2.json", tmp_path / "m1.json")
    assert second["missing"] == second["manifest_records"] > 0 and second["precompiled"] == second["missing"]
    assert second["jit_compiled"] == 0, second
    assert second["launchers_ready"] == second["precompiled"]  # a GPU machine has libcuda and a C compiler
    assert second["jit_from_cache"] >= first["jit_compiled"]
