"""The benchmarks, one entry point: `python tools/bench.py SUBCOMMAND [flags]`; `SUBCOMMAND --help` lists its flags.

    python tools/bench.py stream --engine voxcpm-serve --model CKPT --conc 1,8,32,64 --out ours.json
    python tools/bench.py http http://127.0.0.1:8000 --conc 1,8,32 --format mp3 --out http.json
    python tools/bench.py ws ws://127.0.0.1:8000 --conc 1,16 --word-ms 50 --out ws.json
    python tools/bench.py compare ours.json nano.json

Each benchmark writes its results as JSON (--out); the code is in tools/benchmarks/, one module per benchmark.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

# `python tools/bench.py` puts tools/ first on the path; the benchmarks import the engine, the service and each other
# from the repository root.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tools import subcommands  # noqa: E402

# subcommand -> (its function in tools.benchmarks, "module:function", imported only when it runs: some import torch;
# what it measures)
SUBCOMMANDS: subcommands.Table = {
    "stream": ("stream:main", "in-process bursts, voxcpm-serve or nano-vllm-voxcpm: the anchors' protocol"),
    "http": ("http_bursts:main", "bursts over HTTP against a running service from client processes; its CPU per role"),
    "latents": ("workloads:latents", "bursts whose requests carry the voice prompt inline as latents"),
    "prompt-vs-reference": ("workloads:prompt_vs_reference", "each conditioning mode, the voice cached beforehand"),
    "prompt-family": ("workloads:prompt_family", "one cached prompt shared by a burst against a prompt per request"),
    "hifi-stream": ("workloads:hifi_stream", "bursts of streamed requests cloning one cached HiFi voice"),
    "hifi-blocking": ("workloads:hifi_blocking", "bursts of whole-utterance requests cloning one cached HiFi voice"),
    "closed-loop": ("workloads:closed_loop", "N users, each sending its next request when the previous one ends"),
    "open-loop": ("workloads:open_loop", "Poisson arrivals at fixed rates, whatever the load"),
    "arrival-burst": ("arrival_burst:main", "a burst arriving onto running streams: their chunk gaps, its TTFB"),
    "ws": ("ws_sessions:main", "live-text WebSocket sessions fed a word at a time: first audio, underruns"),
    "overload": ("overload:main", "bursts beyond a running service's room: how fast the excess is refused"),
    "tune-coalesce": ("tune_coalesce:main", "the queue-coalescing window: a service per window, open-loop over HTTP"),
    "encode": ("encode:main", "what encoding each response format costs the host"),
    "retime": ("retime:main", "what speed (time-stretch) and sample_rate (resampling) cost the host"),
    "normalize-stall": ("normalize_stall:main", "the event loop's stalls while texts are normalised (thread, process)"),
    "tokenize": ("tokenize:main", "what the client's tokenization of a request and of a burst costs the host"),
    "intake": ("intake:main", "what a burst costs a worker's host before its first audio: reading, admitting it"),
    "kernels": ("kernels:main", "the decode step's kernels over their launch parameters (GPU)"),
    "pdl-chain": ("pdl_chain:main", "decode chains of layers, each way the engine can run them (GPU)"),
    "lora-step": ("lora_step:main", "what runtime LoRA adapters cost a decode step (GPU)"),
    "vae-dtype": ("vae_dtype:main", "the VAE decoder in bfloat16 or float16: audio SNR against float32, VAE ms"),
    "fp8-accuracy": ("fp8_accuracy:main", "how far FP8 weights move each projection and the generated patches"),
    "drift": ("drift:main", "voice drift over a long text's segments for each continuation-prompt rule"),
    "gc": ("gc_pauses:main", "the garbage collector's pauses in a worker, its start-up heap frozen or not"),
    "compare": ("compare:main", "two stream results side by side, with ratios"),
    "serving-report": ("serving_report:main", "the serving-path table of a tools/gpu_host/bench.sh output folder"),
}


def main(argv: list[str] | None = None) -> Any:
    """Run one subcommand; returns what it returns."""
    return subcommands.run("bench.py", __doc__, "tools.benchmarks", SUBCOMMANDS,
                           sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    main()
