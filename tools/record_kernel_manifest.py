"""Record the Triton kernel variants an engine compiles for a model on this GPU, as a kernel manifest
(engine/startup/kernel_cache.py): start-up and the service worker's own warm-up, then requests of the kinds a service
sees (zero-shot at one and at full concurrency, a long text, reference clips of several lengths through the VAE
encoder), so that a later start-up
on an empty kernel cache compiles all of them ahead, in parallel, and the first requests meet no JIT compile.

    TRITON_CACHE_DIR=$(mktemp -d) python tools/record_kernel_manifest.py --model /tmp/full --max-num-seqs 128 \
        --out engine/startup/kernel_manifests/voxcpm2-sm90.json

With --check it records nothing: the same exercise on an empty kernel cache of its own with the shipped manifests
precompiled (as a start-up does) counts the kernels the JIT still compiles itself, prints their records and fails
unless there are none (a manifest edited, or a kernel whose variants changed since its recording):

    python tools/record_kernel_manifest.py --model /tmp/full --max-num-seqs 128 --check

The manifest is valid for every checkpoint of the same shape (real weights included) on GPUs of the same
architecture; the file name is free (all manifests in engine/startup/kernel_manifests/ are read, matched by content).
With --engine-kwargs naming settings that add kernels (`kernel_cache.manifest_variant`: quantization, vae_dtype,
max_loras with max_lora_rank; with FP8 also VOXCPM_FP8_FAST_ACCUM), the manifest holds only the variants that the
manifests of fewer of those settings (the model's own included) lack, and only engines with those settings read it
(runtime LoRA slots: the exercise's requests use random adapters in every slot, and the base weights):

    python tools/record_kernel_manifest.py --model /tmp/full --max-num-seqs 256 \
        --engine-kwargs '{"quantization": "fp8"}' --out engine/startup/kernel_manifests/voxcpm2-sm90-fp8.json
"""

from __future__ import annotations

import argparse
import atexit
import collections
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
# Recording, the JIT itself compiles every variant (no manifest precompile), which times each compile for the manifest:
# the precompiler starts the longest first. Run on an empty TRITON_CACHE_DIR for those times. Read before argparse
# because the engine's options are read when it is imported.
CHECK = "--check" in sys.argv[1:]
if CHECK:  # on a warm kernel cache a stale manifest would pass: the check always starts on an empty one of its own
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="manifest-check-")  # as engine.startup.prebuild names one
    atexit.register(shutil.rmtree, os.environ["TRITON_CACHE_DIR"], ignore_errors=True)
else:
    os.environ["VOXCPM_PRECOMPILE"] = "0"

import numpy as np  # noqa: E402
import torch  # noqa: E402

from engine.io.audio import encode_latents  # noqa: E402
from engine.llm_engine import EngineConfig, LLMEngine  # noqa: E402
from engine.sequence import SamplingParams  # noqa: E402
from engine.serving.worker_startup import warm_up  # noqa: E402
from engine.startup import kernel_cache  # noqa: E402
from tools.benchmarks.stream import random_adapters  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--max-num-seqs", type=int, default=128, help="the largest batch the manifest covers")
    ap.add_argument("--patches", type=int, default=4, help="patches per request while exercising")
    ap.add_argument("--engine-kwargs", default="{}", help="JSON of other EngineConfig fields, e.g. "
                    "'{\"vae_dtype\": \"bfloat16\"}'")
    ap.add_argument("--out", help="the manifest to write (not with --check)")
    ap.add_argument("--check", action="store_true", help="record nothing: count what the JIT compiles itself beside "
                    "the shipped manifests' precompile; exit 1 unless none")
    a = ap.parse_args()
    if a.check == bool(a.out):
        ap.error("give exactly one of --out and --check")
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU: a manifest is per GPU architecture")
    t0 = time.perf_counter()
    config = EngineConfig(max_num_seqs=a.max_num_seqs, **json.loads(a.engine_kwargs))
    mark = kernel_cache.RECORDER.install().mark()
    records_mark = len(kernel_cache.RECORDER.compiled_records)
    engine = LLMEngine(a.model, config, device="cuda")
    print(f"engine ready in {engine.startup_s:.1f} s; kernels: {engine.startup_phases['kernels']}", flush=True)
    print(f"warm-up: {warm_up(engine)}", flush=True)  # what a worker runs before it reports ready
    params = SamplingParams(max_generate_length=a.patches, min_len=a.patches, seed=0)
    vae, patch = engine.model.vae, engine.model.config.patch_size
    rng = np.random.default_rng(0)
    for seconds in (0.5, 1.3, 3.0, 7.7, 20.0):  # reference clips: the encoder's kernels per length class
        encode_latents(vae, rng.standard_normal(int(seconds * vae.sample_rate)).astype(np.float32) * 0.1,
                       vae.sample_rate, patch, "right")
    prompt = encode_latents(vae, rng.standard_normal(3 * vae.sample_rate).astype(np.float32) * 0.1,
                            vae.sample_rate, patch, "left")
    texts = ["Hello.", "A sentence of ordinary length for a voice to speak aloud. " * 3,
             "A long paragraph, so that the prefill runs well beyond the captured token buckets. " * 40]
    # Runtime LoRA slots: random adapters in every slot, each request naming one in turn or none (the base weights, or
    # a start-up adapter served at run time), so that steps of one adapter (merged) and of several (their terms per
    # layer) both run, in the prefill and the decode.
    adapter_dir = Path(tempfile.mkdtemp(prefix="manifest-loras-"))
    atexit.register(shutil.rmtree, adapter_dir, ignore_errors=True)
    names = [engine.register_lora(f"exercise{i}", str(path)).name for i, path in enumerate(
        random_adapters(engine.model.backbone, config.max_loras, config.max_lora_rank, adapter_dir))]
    adapters = [None, *names]
    for conc in (1, 8, a.max_num_seqs):
        engine.generate_all([dict(target_text=texts[i % len(texts)], params=params,
                                  lora_name=adapters[i % len(adapters)]) for i in range(conc)])
    for name in names[:1]:  # one request alone on an adapter: a merged step
        engine.generate_all([dict(target_text=texts[1], params=params, lora_name=name)])
    engine.generate_all([dict(target_text=t, params=params, prompt_text="A prompt.", prompt_latents=prompt)
                         for t in texts])
    if a.check:
        jit = kernel_cache.RECORDER.since(mark)
        missing = kernel_cache.RECORDER.compiled_records[records_mark:]  # what the manifests lack, in full
        print(json.dumps({"check": "kernel manifests", "model": a.model, "engine_kwargs": json.loads(a.engine_kwargs),
                          "max_num_seqs": a.max_num_seqs, "startup_kernels": engine.startup_phases["kernels"],
                          **jit, "s": round(time.perf_counter() - t0, 1), "missing_records": missing}), flush=True)
        sys.exit(1 if jit["jit_compiled"] else 0)
    manifest = kernel_cache.RECORDER.manifest_of(engine.model, variant=kernel_cache.manifest_variant(config))
    manifest.update(device=torch.cuda.get_device_name(), command=" ".join(sys.argv),
                    date=time.strftime("%Y-%m-%d", time.gmtime()))
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(manifest, indent=1) + "\n")
    names = collections.Counter(e["name"].rsplit(".", 1)[1] for e in manifest["entries"])
    print(f"{len(manifest['entries'])} kernel variants in {time.perf_counter() - t0:.0f} s -> {a.out}: {dict(names)}")


if __name__ == "__main__":
    main()
