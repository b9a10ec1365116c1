"""Triton kernels compiled ahead, in parallel, for a start-up on an empty kernel cache.

A fresh machine or pod has no compiled kernels: its first start-up JIT-compiles ~50 kernel variants one after
another inside warm-up and graph capture, the longest part of such a start. A *manifest* lists the
variants one start-up compiled, as Triton's own specialization records (kernel, signature, constexprs, alignment
attributes, launch options), for one model shape on one GPU architecture. `Precompiler` compiles those not yet in
the cache (and each signature's launcher stub) in child processes — started by the server pool's parent while its
workers spawn, one precompile per cache at a time — and the engine waits for it before its first kernel; the JIT
then finds every variant in the cache (docs/benchmarks.md, `VOXCPM_PRECOMPILE`). The children run
`engine.startup.kernel_compiler`, which imports no torch, so that they start at once. A record names its kernel by
module and name, so it survives edits of the kernel's code; a record that no longer fits the kernel is skipped,
and the JIT compiles whatever a manifest missed, as before.

Manifests ship in engine/startup/kernel_manifests/ (recorded on the GPU by tools/record_kernel_manifest.py), or come
from VOXCPM_KERNEL_MANIFEST. Settings that add kernels (`manifest_variant`: FP8 weights, their fast accumulation, the
VAE's dtype, runtime LoRA slots) have manifests of only what they add, read only by engines with those settings. Every
engine records what it compiles (`Recorder`): a manifest for another GPU or model is one run of that tool.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import logging
import os
import subprocess
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.config import DTYPE_NAMES, VoxCPMConfig, dtype_name
from engine.io.model_path import resolve_model_path
from engine.ops.platform import HAVE_TRITON
from engine.options import current
from engine.startup.kernel_compiler import CompilerProcesses, source_and_options

if TYPE_CHECKING:
    import torch

    from engine.io.checkpoint import LoadedModel

log = logging.getLogger(__name__)

MANIFEST_DIR = Path(__file__).parent / "kernel_manifests"


def model_digest(cfg: VoxCPMConfig, dtype: str | torch.dtype) -> str:
    """What a kernel's shapes depend on: the parsed model configuration (not the raw file, whose extra keys vary
    between copies of one model) and the activation dtype. No torch (the supervisor precompiles before its import)."""
    def spelled(d: str | torch.dtype) -> str:  # as torch prints a dtype: the shipped manifests were digested so
        return f"torch.{dtype_name(d)}" if isinstance(d, str) else str(d)

    fields = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name != "raw"}
    fields["dtype"] = spelled(cfg.dtype)
    text = json.dumps({"config": fields, "dtype": spelled(dtype)}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def manifest_variant(config: Any) -> dict[str, str]:
    """The settings that make an engine compile kernels beyond the model shape's, as manifests name them (`variant`):
    the EngineConfig's away from their default (no torch needed); with FP8 weights, its options' fp8_fast_accum; with
    runtime LoRA slots, their rank ("r32": a constexpr of the LoRA kernels; the count only where the rank is no multiple
    of 16, "r8x3": the kernels' slot columns then vary in Triton's divisibility by 16, `engine.ops.lora`)."""
    vae_dtype = DTYPE_NAMES.get(str(config.vae_dtype), str(config.vae_dtype)) if config.vae_dtype else "float32"
    rank, count = config.max_lora_rank, config.max_loras
    settings = {"quantization": config.quantization, "vae_dtype": None if vae_dtype == "float32" else vae_dtype,
                "fp8_fast_accum": config.quantization == "fp8" and config.options.fp8_fast_accum,
                "lora": count > 0 and (f"r{rank}" if rank % 16 == 0 else f"r{rank}x{count}")}
    return {name: str(value) for name, value in settings.items() if value}


def loaded_model_digest(model: LoadedModel) -> str:
    """`model_digest` of a loaded model (its backbone's dtype is the one it runs in)."""
    return model_digest(model.config, next(model.backbone.parameters()).dtype)


def cuda_arch(device: torch.device | str | None = None) -> int:
    """The compute capability of a CUDA device as Triton names architectures (H100: 90)."""
    import torch

    major, minor = torch.cuda.get_device_capability(device)
    return major * 10 + minor


def _default_options(arch: int) -> dict[str, Any]:
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend
    return dict(make_backend(GPUTarget("cuda", arch, 32)).parse_options({}).__dict__)


class Recorder:
    """Collects the specialization record of every kernel the JIT compiles in this process (Triton's
    `jit_cache_hook`, called on each in-memory miss whether or not the file cache has the binary), and counts file-
    cache hits and real compiles (its compilation listener)."""

    def __init__(self) -> None:
        self.records: dict[str, dict[str, Any]] = {}
        self._last: dict[str, Any] | None = None  # the record of the JIT miss being compiled, and when it began
        self._t0, self.cached = 0.0, 0  # the miss's start; binaries found in the file cache
        self.compiled_names: list[str] = []  # of the real compiles, in order
        self.compiled_records: list[dict[str, Any]] = []  # the records of those compiles that came from a JIT miss
        self._installed = False

    def install(self) -> Recorder:
        """Hook into Triton's JIT (idempotent; nothing to do without Triton)."""
        if HAVE_TRITON and not self._installed:
            from triton import knobs
            knobs.runtime.jit_cache_hook = self._on_jit_miss
            knobs.compilation.listener = self._on_compile
            self._installed = True
        return self

    def mark(self) -> tuple[int, int]:  # a point to count from (`since`)
        return len(self.compiled_names), self.cached

    def since(self, mark: tuple[int, int]) -> dict[str, Any]:
        """What the JIT did after `mark`: real compiles (and their kernels), binaries found in the file cache."""
        return {"jit_compiled": len(self.compiled_names) - mark[0], "jit_compiled_names": self.compiled_names[mark[0]:],
                "jit_from_cache": self.cached - mark[1]}

    def _on_jit_miss(self, **kwargs: Any) -> bool:
        record = json.loads(kwargs["compile"]["specialization_data"])
        record.pop("key", None)  # the in-memory key: not needed to compile
        self._last = self.records.setdefault(json.dumps(record, sort_keys=True), record)
        self._t0 = time.perf_counter()
        return False  # go on compiling

    def _on_compile(self, *, cache_hit: bool, **kwargs: Any) -> None:
        if cache_hit:
            self.cached += 1
        else:
            self.compiled_names.append(getattr(kwargs.get("src"), "name", "?"))
            if self._last is not None:  # the JIT compiles right after its miss, in the same thread
                self._last["compile_s"] = round(time.perf_counter() - self._t0, 3)
                self.compiled_records.append(self._last)
        self._last = None

    def manifest_of(self, model: LoadedModel, variant: dict[str, str] | None = None) -> dict[str, Any]:
        """The manifest of what this process compiled for a loaded model on the current CUDA device (`manifest`)."""
        return self.manifest(loaded_model_digest(model), cuda_arch(), variant)

    def manifest(self, digest: str, arch: int, variant: dict[str, str] | None = None) -> dict[str, Any]:
        """The records as a manifest (`manifest_of`: a loaded model's, on the current CUDA device); launch options only
        where not Triton's defaults (the rest, such as library paths, are the compiling installation's). With a
        `variant` (`manifest_variant`), only the records the manifests of its variants (the model's own too) lack."""
        import triton
        defaults = _default_options(arch)
        entries = []
        for record in self.records.values():
            options = {k: v for k, v in record["options"].items()
                       if k != "extern_libs" and json.loads(json.dumps(defaults.get(k))) != v}
            entries.append({**record, "options": options})
        if variant:
            known = {_identity(e) for e in load_manifests(digest, arch, variant, strictly=True)}
            entries = [e for e in entries if _identity(e) not in known]
        entries.sort(key=lambda r: (r["name"], json.dumps(r, sort_keys=True)))
        return {"model": digest, "arch": arch, "triton": triton.__version__, "variant": dict(variant or {}),
                "entries": entries}


def triton_version() -> str:
    import triton
    return triton.__version__


def _same_minor_version(a: str, b: str) -> bool:
    """Records name Triton's options and specialization as one release line writes them."""
    return a.split(".")[:2] == b.split(".")[:2]


def _manifests(paths: list[Path]) -> list[dict[str, Any]]:
    """The readable manifests among `paths` that were recorded with this Triton release line."""
    manifests = []
    for path in paths:
        try:
            m = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as e:
            log.warning("kernel manifest %s unreadable: %s", path, e)
            continue
        if not _same_minor_version(m.get("triton", ""), this := triton_version()):
            log.info("kernel manifest %s is for triton %s, this is %s: not used", path, m.get("triton"), this)
            continue
        manifests.append(m)
    return manifests


def _identity(entry: dict[str, Any]) -> str:
    """A record's kernel variant (records differing only in their compile time are one)."""
    return json.dumps({k: v for k, v in entry.items() if k != "compile_s"}, sort_keys=True)


def _entries(manifests: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return list({_identity(e): e for m in manifests for e in m.get("entries", [])}.values())  # each variant once


def load_manifests(digest: str, arch: int, variant: dict[str, str] | None = None,
                   strictly: bool = False) -> list[dict[str, Any]]:
    """The records of every manifest for this model shape, architecture and Triton release line (shipped ones,
    VOXCPM_KERNEL_MANIFEST) whose variant the engine's settings include (`manifest_variant`; none: the model's own;
    `strictly`: only those of fewer settings)."""
    paths = sorted(MANIFEST_DIR.glob("*.json"))
    if current().kernel_manifest:
        paths.append(Path(current().kernel_manifest))
    settings = (variant or {}).items()
    return _entries([m for m in _manifests(paths) if m.get("model") == digest and m.get("arch") == arch
                     and ((have := m.get("variant", {}).items()) < settings or (have == settings and not strictly))])


def shipped_records() -> dict[int, list[dict[str, Any]]]:
    """The records of every shipped manifest of this Triton release line, whatever the model, by architecture."""
    by_arch: dict[int, list[dict[str, Any]]] = {}
    for m in _manifests(sorted(MANIFEST_DIR.glob("*.json"))):
        by_arch.setdefault(int(m["arch"]), []).append(m)
    return {arch: _entries(manifests) for arch, manifests in sorted(by_arch.items())}


def is_cached(record: dict[str, Any], arch: int) -> bool:
    """Whether the kernel cache already holds this record's binary (the lookup `triton.compile` starts with)."""
    from triton._C.libtriton import get_cache_invalidating_env_vars
    from triton.compiler.compiler import make_backend
    from triton.runtime.cache import get_cache_key, get_cache_manager

    src, target, options = source_and_options(record, arch)
    key = get_cache_key(src, make_backend(target), options, env_vars=get_cache_invalidating_env_vars())
    manager = get_cache_manager(hashlib.sha256(key.encode("utf-8")).hexdigest())
    name = f"{src.name[:150]}.json"
    return (manager.get_group(name) or {}).get(name) is not None


def missing_records(records: list[dict[str, Any]], arch: int) -> tuple[list[dict[str, Any]], int]:
    """The records not in the kernel cache, the longest to compile first (the last to finish are then short), and how
    many no longer fit their kernel (the JIT compiles what is needed)."""
    missing, unusable = [], 0
    for record in records:
        try:
            if not is_cached(record, arch):
                missing.append(record)
        except Exception as e:
            log.info("kernel manifest record for %s skipped: %s", record.get("name"), e)
            unusable += 1
    missing.sort(key=lambda r: -r.get("compile_s", 0.0))
    return missing, unusable


def compiler_count(records: int) -> int:
    """Compiler processes for this many records: one per core but one, at most 16 (each holds a compiler's memory)."""
    return max(1, min(records, len(os.sched_getaffinity(0)) - 1, 16))


RECORDER = Recorder()  # one per process: Triton's hooks are global


def gpu_arch_from_nvidia_smi() -> int | None:
    """The GPUs' compute capability per nvidia-smi (the pool's parent never initialises CUDA); None: unknown, mixed."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=10, check=True).stdout.split()
        caps = {round(float(c) * 10) for c in out}
    except (OSError, subprocess.SubprocessError, ValueError):
        return None
    return caps.pop() if len(caps) == 1 else None


def _is_nvidia(device: torch.device) -> bool:
    import torch

    return device.type == "cuda" and torch.version.hip is None


class Precompiler:
    """Compiles a manifest's records missing from the kernel cache in child processes, started before the model
    loads; `wait()` before the first kernel launch (or `close()` when start-up fails). One precompile per cache at a
    time: whoever compiles holds an exclusive lock on a file in the cache dir, and an engine that finds it taken (the
    pool's parent compiling while the workers start, or another GPU's worker) waits for it in `wait()` and then
    compiles only what is still missing. `background` (the pool's parent): a thread waits and releases the lock.
    Any trouble here (no Triton, an unwritable cache dir) only turns the precompile off: the JIT compiles as before."""

    def __init__(self, model: LoadedModel | str | os.PathLike, dtype: str | torch.dtype | None,
                 device: torch.device | None, arch: int | None = None, background: bool = False,
                 variant: dict[str, str] | None = None) -> None:
        """model: the engine's (loaded, or the checkpoint to load); dtype: the engine's runtime dtype when set;
        device: the engine's, or None in a process that must not initialise CUDA (the pool's parent): then `arch`,
        or the GPUs' architecture as nvidia-smi reports it; variant: the engine's `manifest_variant`."""
        self.variant = dict(variant or {})
        self.t0 = time.perf_counter()
        self.stats: dict[str, Any] = {"precompiled": 0, "precompile_failed": 0}
        self._compilers: CompilerProcesses | None = None
        self._records: list[dict[str, Any]] = []
        self._lock: int | None = None
        self.background: threading.Thread | None = None  # `background`'s waiter, alive while the children compile
        if not (current().precompile and HAVE_TRITON and (device is None or _is_nvidia(device))):
            return
        try:
            self._records = self._manifest_records(model, dtype, device, arch)
            self.stats["manifest_records"] = len(self._records)
            if self._records and self._try_lock(block=False):
                self._start()
                if self._compilers is None:  # the cache is complete
                    self._unlock()
                    self._records = []
                elif background:
                    self.background = threading.Thread(target=self._wait_and_log, name="voxcpm-precompile", daemon=True)
                    self.background.start()
        except Exception as e:  # never fail a start-up over an optimisation
            log.warning("kernel precompile off: %s: %s", type(e).__name__, e)
            self.close()

    def _manifest_records(self, model: LoadedModel | str | os.PathLike, dtype: str | torch.dtype | None,
                          device: torch.device | None, arch: int | None) -> list[dict[str, Any]]:
        if not isinstance(model, (str, os.PathLike)):
            digest = loaded_model_digest(model)
        else:
            try:
                cfg = VoxCPMConfig.from_dir(resolve_model_path(model))
            except Exception as e:  # the loader reports a bad checkpoint properly, right after
                log.info("no kernel precompile: %s", e)
                return []
            digest = model_digest(cfg, dtype if dtype is not None else cfg.dtype)
        if arch is None:
            arch = cuda_arch(device) if device is not None else gpu_arch_from_nvidia_smi()
            if arch is None:
                return []
        self.arch = arch
        return load_manifests(digest, arch, self.variant)

    def _try_lock(self, block: bool, timeout_s: float = 600.0) -> bool:
        from triton import knobs
        path = Path(knobs.cache.dir)
        path.mkdir(parents=True, exist_ok=True)
        fd = os.open(path / "voxcpm-precompile.lock", os.O_CREAT | os.O_RDWR)
        deadline = time.monotonic() + (timeout_s if block else 0.0)
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                self._lock = fd
                return True
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    os.close(fd)
                    return False
                time.sleep(0.05)

    def _start(self) -> None:
        missing, unusable = missing_records(self._records, self.arch)
        self.stats["precompile_failed"] += unusable
        self.stats["missing"] = len(missing)
        if missing:
            workers = compiler_count(len(missing))
            self._compilers = CompilerProcesses(missing, self.arch, workers)
            self.stats["workers"] = workers

    def wait(self) -> dict[str, Any]:
        try:
            if self._records and self._compilers is None:
                t = time.perf_counter()
                if self._try_lock(block=True):
                    self.stats["waited_for_other_s"] = round(time.perf_counter() - t, 2)
                    self._start()  # what the other precompile left (normally nothing)
            if self._compilers is not None:
                result = self._compilers.collect()
                self._compilers = None
                for key in ("precompiled", "precompile_failed"):
                    self.stats[key] += result.pop(key)
                self.stats.update(result)
                # from the children's start (beside the model load) to the last compile
                self.stats["precompile_s"] = round(time.perf_counter() - self.t0, 2)
        except Exception as e:
            log.warning("kernel precompile stopped: %s: %s", type(e).__name__, e)
        finally:
            self.close()
        return self.stats

    def _wait_and_log(self) -> None:
        log.info("kernel precompile: %s", self.wait())

    def close(self) -> None:
        """Stop compiling (children killed) and release the lock; idempotent. From another thread while the background
        waiter collects (a stop during start-up): only the children are killed, and the waiter, done then, cleans up."""
        waiter = self.background
        if waiter is not None and waiter.is_alive() and waiter is not threading.current_thread():
            if (compilers := self._compilers) is not None:
                compilers.kill()
            return
        if self._compilers is not None:
            self._compilers.close()
            self._compilers = None
        self._unlock()
        self._records = []

    def _unlock(self) -> None:
        if self._lock is not None:
            fcntl.flock(self._lock, fcntl.LOCK_UN)
            os.close(self._lock)
            self._lock = None
