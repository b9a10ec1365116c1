"""Tune the queue-coalescing window (NANOVLLM_QUEUE_COALESCE_MS) on this machine: for each window, start the
service (`python -m service.main`, a fresh process) on the checkpoint, run the open-loop arrival benchmark
(`bench.py open-loop`) against it over HTTP, stop it; then print one table over all windows and write
one JSON (each window's full open-loop document included).

    python tools/bench.py tune-coalesce --model CKPT --windows 0,2,5,10 --rate 10,30 --duration 20 --out tune.json

The window holds the first request of a quiet period for up to that long, so that requests arriving
together are prefilled in one engine step: it costs up to the window in TTFB and can save prefill steps
that would each delay every running stream's next patch. The best window is the one with the lowest TTFB
p95 at the rates that matter, without underruns.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from tools.benchmarks import harness as bl
from tools.benchmarks.workloads import open_loop

METRICS = ("ttfb_p50", "ttfb_p95", "rtf_mean", "throughput_audio_s_per_s", "streams_with_underrun", "failed")


def windows_ms(text: str) -> list[float]:
    out = [float(x) for x in text.split(",") if x.strip()]
    if not out or min(out) < 0:
        raise argparse.ArgumentTypeError("needs comma-separated windows >= 0 (milliseconds)")
    return out


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = bl.subcommand_parser("tune-coalesce", __doc__)
    ap.add_argument("--model", required=True, help="checkpoint directory")
    ap.add_argument("--windows", type=windows_ms, default=windows_ms("0,2,5,10"),
                    help="comma-separated windows to try, milliseconds (0: off)")
    ap.add_argument("--rate", default="10,30", help="open-loop arrival rates, requests per second")
    ap.add_argument("--duration", type=float, default=20.0, help="measured seconds per rate")
    ap.add_argument("--patches", type=int, default=50, help="patches per request")
    ap.add_argument("--max-num-seqs", type=int, default=128)
    ap.add_argument("--port", type=int, default=8765)
    ap.add_argument("--devices", default=None, help="NANOVLLM_SERVERPOOL_DEVICES for the service (default: its own)")
    ap.add_argument("--ready-timeout", type=float, default=600)
    ap.add_argument("--out", help="write the JSON here")
    return ap.parse_args(argv)


def port_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def start_service(a: argparse.Namespace, window_ms: float, log_path: Path) -> subprocess.Popen:
    if not port_free(a.port):  # else /ready could be answered by some other (e.g. a leftover) service
        raise RuntimeError(f"port {a.port} is in use")
    env = {**os.environ, "NANOVLLM_MODEL_PATH": a.model, "NANOVLLM_QUEUE_COALESCE_MS": str(window_ms),
           "NANOVLLM_PORT": str(a.port), "NANOVLLM_HOST": "127.0.0.1",
           "NANOVLLM_SERVERPOOL_MAX_NUM_SEQS": str(a.max_num_seqs),
           "NANOVLLM_SEGMENT_CHARS": "1000"}  # the protocol's paragraph is one generation, as the pool sends it
    if a.devices:
        env["NANOVLLM_SERVERPOOL_DEVICES"] = a.devices
    with log_path.open("w") as log:
        # Its own process group, so that stopping it takes the engine's worker processes along.
        return subprocess.Popen([sys.executable, "-m", "service.main"], cwd=bl.REPO, env=env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)


def wait_ready(url: str, proc: subprocess.Popen, timeout: float) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"the service exited with code {proc.returncode} before it was ready")
        try:
            if httpx.get(url + "/ready", timeout=5).status_code == 200:
                return time.monotonic() - t0
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"the service was not ready after {timeout:.0f} s")


def stop_service(proc: subprocess.Popen) -> None:
    """SIGTERM the service's whole process group (its workers too, even if the service itself died), then
    SIGKILL what is left after 60 s."""
    for sig, wait_s in ((signal.SIGTERM, 60.0), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break  # the group is gone
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=0.2)
            try:
                os.killpg(proc.pid, 0)  # anyone left in the group?
            except ProcessLookupError:
                return
            time.sleep(0.2)


def tune(argv: list[str]) -> dict[str, Any]:
    """Each window's service and open-loop run, then the summary table; returns the results document."""
    a = parse_args(argv)
    url = f"http://127.0.0.1:{a.port}"
    out_dir = Path(a.out).resolve().parent if a.out else Path.cwd()
    out_dir.mkdir(parents=True, exist_ok=True)
    doc: dict[str, Any] = {"tool": "tune_coalesce", "argv": bl.command_line("tune-coalesce", argv),
                           "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                           "engine_version": bl.engine_version("voxcpm-serve"), "windows": []}
    for window in a.windows:
        log_path = out_dir / f"tune_coalesce_service_{window:g}ms.log"
        proc = start_service(a, window, log_path)
        entry: dict[str, Any] = {"window_ms": window, "service_log": log_path.name}
        try:
            entry["ready_s"] = wait_ready(url, proc, a.ready_timeout)
            entry["open_loop"] = doc_window = open_loop([
                "--target", "http", "--url", url, "--rate", a.rate, "--duration", str(a.duration),
                "--patches", str(a.patches)])
            served = (doc_window.get("service") or {}).get("queue_coalesce_ms")
            if proc.poll() is not None or served != window:
                raise RuntimeError(f"measured a service with window {served} ms, not this one ({window} ms)")
        except Exception as e:  # noqa: BLE001 - one window failing must not lose the others
            entry["error"] = f"{type(e).__name__}: {e}"
        finally:
            stop_service(proc)
        doc["windows"].append(entry)
        bl.write_json(a.out, doc)
    print_summary(doc)
    return doc


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def print_summary(doc: dict[str, Any]) -> None:
    print(f"\n{'window':>7} {'arrivals':>12} " + " ".join(f"{m[:12]:>12}" for m in METRICS))
    for entry in doc["windows"]:
        if "error" in entry:
            print(f"{entry['window_ms']:>5g}ms  {entry['error']}")
            continue
        for row in entry["open_loop"]["results"]:
            cells = " ".join(f"{bl._f(row.get(m), '12.3f' if isinstance(row.get(m), float) else '12d'):>12}"
                             for m in METRICS)
            print(f"{entry['window_ms']:>5g}ms {row.get('label', ''):>12} {cells}")


def main(argv: list[str]) -> None:
    # A SIGTERM (e.g. from `timeout`) must still stop the running service: turn it into an exception.
    signal.signal(signal.SIGTERM, _raise_interrupt)
    print(json.dumps({"windows_tried": len(tune(argv)["windows"])}))
