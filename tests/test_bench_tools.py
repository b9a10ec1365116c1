"""The benchmarks (the subcommands of tools/bench.py, over tools/benchmarks/harness.py), run in process on a tiny CPU
checkpoint: each workload through the entry point against the engine pool, three of them over HTTP against a live
service. Assertions are
on the JSON's structure and on values that do not depend on speed (request counts, audio seconds = patches x
patch duration, no failures, ordered percentiles), never on timings."""

from __future__ import annotations

import gc
import json
import math
import shutil
import statistics
from pathlib import Path
from typing import Any

import lameenc
import numpy as np
import pytest

from tests.service_harness import SAMPLE_RATE, SAMPLES_PER_PATCH, free_port, live_server
from tools import bench
from tools.benchmarks import encode, harness, serving_report, tune_coalesce
from tools.profiling import pyspy, step, timeline

PATCH_S = SAMPLES_PER_PATCH / SAMPLE_RATE  # 0.16 s
PATCHES = 3
POOL = ["--max-model-len", "512", "--max-num-batched-tokens", "2048", "--devices", "cpu", "--clip-seconds", "1.5"]
RESULT_KEYS = {"label", "concurrency", "requests", "failed", "errors", "ttfb_p50", "ttfb_p95", "ttfb_p99",
               "rtf_mean", "rtf_p95", "wall_mean", "audio_s_mean", "chunks_mean", "streams_with_underrun",
               "underrun_gaps_total", "underrun_s_total", "throughput_audio_s_per_s", "gpu_mem_used_mib_max"}
DOC_KEYS = {"tool", "target", "command", "argv", "date_utc", "engine_version", "patches", "torch", "gpu_name",
            "complete", "results", "startup_s", "sample_rate", "channels", "gpu_mem_used_mib_after_startup"}


def check_doc(doc: dict[str, Any], out: Path, command: str, target: str, rows: int) -> None:
    assert json.loads(out.read_text()) == json.loads(json.dumps(doc))  # the file is the returned document
    assert doc.keys() >= DOC_KEYS, DOC_KEYS - doc.keys()
    assert doc["tool"] == command.replace("-", "_") and doc["target"] == target and doc["complete"] is True
    assert doc["command"].startswith(f"python tools/bench.py {command} ") and doc["date_utc"]
    assert doc["torch"] and doc["sample_rate"] == SAMPLE_RATE and doc["channels"] == 1 and doc["startup_s"] > 0
    assert doc["patches"] == PATCHES and len(doc["results"]) == rows
    for r in doc["results"]:
        assert r.keys() >= RESULT_KEYS, RESULT_KEYS - r.keys()
        assert r["failed"] == 0 and r["errors"] == [], r["errors"]
        assert r["requests"] >= 1
        assert 0 < r["ttfb_p50"] <= r["ttfb_p95"] <= r["ttfb_p99"]
        assert r["rtf_mean"] > 0 and r["wall_mean"] > 0
        if "duration_s" in r:  # a timed window's throughput counts the audio that arrived inside it: at most all
            # of its requests' audio, and none when the machine is slow enough that it all arrived after the window
            assert 0 <= r["throughput_audio_s_per_s"] * r["duration_s"] <= r["requests"] * r["audio_s_mean"] + 1e-9
        else:
            assert r["throughput_audio_s_per_s"] > 0
        assert 0 <= r["streams_with_underrun"] <= r["requests"] and r["underrun_s_total"] >= 0
        if shutil.which("nvidia-smi") is None:
            assert r["gpu_mem_used_mib_max"] is None  # no GPU to read: nothing invented


def exact_audio(doc: dict[str, Any]) -> None:
    for r in doc["results"]:
        assert r["audio_s_mean"] == pytest.approx(PATCHES * PATCH_S, abs=1e-9)  # never-stop: exactly N patches


def run_pool(checkpoint_factory, out: Path, command: str, args: list[str], rows: int) -> dict[str, Any]:
    """Run `tools/bench.py COMMAND` against the engine pool on the never-stopping tiny checkpoint; check the
    document's structure and that every request produced exactly PATCHES patches."""
    ckpt = checkpoint_factory("tiny-voxcpm2", stop="never")
    doc = bench.main([command, "--model", str(ckpt), *POOL, *args, "--patches", str(PATCHES), "--out", str(out)])
    check_doc(doc, out, command, "pool", rows=rows)
    exact_audio(doc)
    return doc


def test_stream_protocol_rows_and_the_workers_send_waits(checkpoint_factory, tmp_path):
    """`bench.py stream` (the anchors' protocol) on our pool: a row per concurrency with the anchor files' keys, and how
    long the workers' messages waited from queued to written (ours only). --pool-kwargs twice: merged, the later
    object's keys winning (a wrapper script adds its window beside the caller's settings)."""
    ckpt = checkpoint_factory("tiny-voxcpm2", stop="never")
    out = tmp_path / "stream.json"
    bench.main(["stream", "--engine", "voxcpm-serve", "--model", str(ckpt), "--conc", "1,2", "--iters", "1",
                "--patches", "3", "--devices", "cpu", "--out", str(out),
                "--pool-kwargs", '{"vae_dtype": "float32", "coalesce_ms": 0}', "--pool-kwargs", '{"coalesce_ms": 2}'])
    doc = json.loads(out.read_text())
    assert doc["pool"]["vae_dtype"] == "float32" and doc["pool"]["coalesce_ms"] == 2
    assert doc["complete"] and [r["concurrency"] for r in doc["results"]] == [1, 2]
    for row in doc["results"]:
        assert row["failed"] == 0 and row["throughput_audio_s_per_s"] > 0 and row["ttfb_p50"] > 0
        assert 0 < row["worker_send_ms_mean"] < 1000
        assert isinstance(row["worker_gc_passes"], int) and 0 <= row["worker_gc_longest_ms"] < 10_000


@pytest.mark.parametrize("value", ["{bad", "[1]"])
def test_pool_kwargs_must_be_json_objects(value, capsys):
    with pytest.raises(SystemExit):
        bench.main(["stream", "--engine", "voxcpm-serve", "--model", "m", "--devices", "cpu", "--pool-kwargs", value])
    assert "--pool-kwargs" in capsys.readouterr().err


def test_latents_pool(checkpoint_factory, tmp_path):
    doc = run_pool(checkpoint_factory, tmp_path / "latents.json", "latents", ["--conc", "1,2", "--iters", "1"], rows=2)
    assert [r["concurrency"] for r in doc["results"]] == [1, 2] and [r["requests"] for r in doc["results"]] == [1, 2]
    assert doc["voice"] == "latents" and doc["pool"]["devices"] == ["cpu"] and doc["pool"]["max_num_seqs"] == 2
    r = doc["results"][1]
    assert r["chunks_mean"] == PATCHES and len(r["burst_walls"]) == 1  # one chunk per patch in process


def test_prompt_vs_reference_pool(checkpoint_factory, tmp_path):
    doc = run_pool(checkpoint_factory, tmp_path / "pvr.json", "prompt-vs-reference",
                   ["--conc", "1,2", "--iters", "1", "--modes", "zeroshot,prompt,reference,hifi"], rows=8)
    assert [(r["mode"], r["concurrency"]) for r in doc["results"]] == [
        (m, c) for c in (1, 2) for m in ("zeroshot", "prompt", "reference", "hifi")]


def test_prompt_family_pool(checkpoint_factory, tmp_path):
    doc = run_pool(checkpoint_factory, tmp_path / "family.json", "prompt-family", ["--conc", "2", "--iters", "1"],
                   rows=3)
    assert [r["mode"] for r in doc["results"]] == ["shared-same", "shared-varied", "distinct"]
    assert all(r["requests"] == 2 for r in doc["results"])


def test_hifi_stream_pool(checkpoint_factory, tmp_path):
    doc = run_pool(checkpoint_factory, tmp_path / "hifi_stream.json", "hifi-stream", ["--conc", "2", "--iters", "2"],
                   rows=1)
    assert doc["results"][0]["requests"] == 4 and len(doc["results"][0]["burst_walls"]) == 2


def test_hifi_blocking_pool(checkpoint_factory, tmp_path):
    doc = run_pool(checkpoint_factory, tmp_path / "hifi_blocking.json", "hifi-blocking",
                   ["--conc", "1,2", "--iters", "1"], rows=2)
    assert [r["requests"] for r in doc["results"]] == [1, 2]
    for r in doc["results"]:  # one piece per request: the whole utterance, available at the end
        assert r["chunks_mean"] == 1 and r["streams_with_underrun"] == 0
        # ttfb == wall for every request, and the median of one or two values is their mean
        assert r["ttfb_p50"] == pytest.approx(r["wall_mean"])


def test_closed_loop_pool(checkpoint_factory, tmp_path):
    doc = run_pool(checkpoint_factory, tmp_path / "closed.json", "closed-loop",
                   ["--conc", "2", "--duration", "4", "--warmup", "0"], rows=1)  # from 0: the first ones count
    r = doc["results"][0]
    assert r["concurrency"] == 2 and r["started"] == r["requests"] and r["duration_s"] == 4
    assert r["achieved_rps"] == pytest.approx(r["requests"] / 4)
    # a user's next request starts only when its previous one ended: never more than `users` in flight
    assert 1 <= r["in_flight_max"] <= 2 and r["queue_depth_max"] is not None and r["queue_depth_max"] >= 0


def test_open_loop_pool(checkpoint_factory, tmp_path):
    rate, duration, seed = 4.0, 1.5, 3
    doc = run_pool(checkpoint_factory, tmp_path / "open.json", "open-loop",
                   ["--rate", str(rate), "--duration", str(duration), "--seed", str(seed)], rows=1)
    # the arrival times are a seeded Poisson process: the same count as the generator gives
    rng, t, expected = np.random.default_rng(seed), 0.0, 0
    while (t := t + float(rng.exponential(1 / rate))) < duration:
        expected += 1
    r = doc["results"][0]
    assert r["arrivals"] == expected == r["requests"] and r["offered_rps"] == rate
    assert r["achieved_rps"] == pytest.approx(expected / duration) and r["completed_rps"] > 0
    assert r["idle_ttfb"] > 0 and r["queue_wait_est_p50"] >= 0 and r["queue_wait_est_p95"] >= 0
    assert r["client_lag_max_s"] >= 0 and r["in_flight_max"] >= 1


# ---------------------------------------------------------------- over HTTP


@pytest.fixture(scope="module")
def server(checkpoint_factory, tmp_path_factory):
    # segment_chars 1000: the protocol's paragraph (~480 characters) is one generation, as the pool benchmarks send it
    with live_server(checkpoint_factory, tmp_path_factory.mktemp("svc-bench"), voice_store="memory",
                     segment_chars=1000) as s:
        yield s


def test_prompt_vs_reference_http(server, tmp_path):
    out = tmp_path / "pvr_http.json"
    doc = bench.main(["prompt-vs-reference", "--target", "http", "--url", server.url, "--conc", "1,2", "--iters",
                                            "1", "--patches", str(PATCHES), "--modes", "latents,prompt,reference,hifi",
                                            "--clip-seconds", "1.5", "--out", str(out)])
    check_doc(doc, out, "prompt-vs-reference", "http", rows=8)
    exact_audio(doc)  # raw PCM: whole samples counted across network pieces
    assert doc["url"] == server.url and doc["format"] == "pcm" and doc["engine_version"] is None
    assert doc["model_info"]["sample_rate"] == SAMPLE_RATE
    # the voices the tool registered are deleted at its end
    assert not server.call(server.state.store.list("hifi")) and not server.call(server.state.store.list("prompt"))


def test_hifi_stream_http_mp3(server, tmp_path):
    out = tmp_path / "hifi_http.json"
    doc = bench.main(["hifi-stream", "--target", "http", "--url", server.url, "--format", "mp3", "--conc", "2",
                                    "--iters", "1", "--patches", str(PATCHES), "--clip-seconds", "1.5", "--out",
                                    str(out)])
    check_doc(doc, out, "hifi-stream", "http", rows=1)
    # MP3 durations come from the frame headers: whole 1152-sample frames, the encoder's delay and padding
    r = doc["results"][0]
    assert r["requests"] == 2 and abs(r["audio_s_mean"] - PATCHES * PATCH_S) <= 3 * 1152 / SAMPLE_RATE


def test_hifi_blocking_http(server, tmp_path):
    out = tmp_path / "hifi_blocking_http.json"
    doc = bench.main(["hifi-blocking", "--target", "http", "--url", server.url, "--conc", "1,2", "--iters", "1",
                                      "--patches", str(PATCHES), "--clip-seconds", "1.5", "--out", str(out)])
    check_doc(doc, out, "hifi-blocking", "http", rows=2)
    exact_audio(doc)
    for r in doc["results"]:
        assert r["ttfb_p50"] <= r["wall_mean"] * 1.000001 and r["streams_with_underrun"] == 0


@pytest.mark.parametrize("client", ["httpx", "raw"])
def test_http_bursts_over_client_processes(server, tmp_path, client):
    """`bench.py http` with either client: every request's audio counted exactly, its send timed."""
    out = tmp_path / f"http_{client}.json"
    bench.main(["http", server.url, "--conc", "3", "--iters", "2", "--patches", str(PATCHES), "--procs", "2",
                       "--format", "pcm", "--client", client, "--label", client, "--out", str(out)])
    doc = json.loads(out.read_text())
    assert doc["client"] == client and doc["format"] == "pcm" and len(doc["results"]) == 1
    r = doc["results"][0]
    assert r["failed"] == 0 and r["errors"] == [] and r["requests"] == 6 and r["client_procs"] == 2
    assert r["audio_s_mean"] == pytest.approx(PATCHES * PATCH_S, abs=1e-9) and r["chunks_mean"] >= 1
    assert 0 <= r["sent_p50"] <= r["sent_p95"] <= r["ttfb_p95"]
    assert 0 < r["ttfb_after_send_p50"] <= r["ttfb_after_send_p95"] and r["throughput_audio_s_per_s"] > 0


def test_ws_sessions(server, tmp_path):
    """`bench.py ws`: sessions fed a word at a time, each with its segments, its first audio after the first boundary
    (never before it) and its underruns counted."""
    from service.segmenter import LiveSegmenter

    out = tmp_path / "ws.json"
    doc = bench.main(["ws", server.url, "--conc", "1,2", "--word-ms", "5", "--patches", str(PATCHES), "--seed",
                      "1", "--label", "cpu", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(doc))
    assert doc["tool"] == "bench_ws" and doc["route"] == "/v1/audio/speech/stream" and doc["label"] == "cpu"
    assert doc["argv"][:2] == ["tools/bench.py", "ws"] and doc["words"] == len(harness.TEXT.split())
    live = LiveSegmenter()
    segments = sum(len(live.feed(w + " ")) for w in harness.TEXT.split()) + len(live.done())
    assert [r["sessions"] for r in doc["results"]] == [1, 2]
    for r in doc["results"]:
        assert r["failed"] == 0 and r["errors"] == [] and len(r["per_session"]) == r["sessions"]
        assert r["segments_mean"] == segments > 1 and r["audio_s_mean"] > 0 and r["rtf_mean"] > 0
        assert 0 <= r["first_audio_after_boundary_p50"] <= r["first_audio_after_boundary_p95"] \
            <= r["first_audio_after_boundary_max"]
        assert 0 <= r["sessions_with_underrun"] <= r["sessions"] and r["underrun_s_total"] >= 0
        for s in r["per_session"]:
            assert 0 < s["first_boundary_s"] <= s["first_audio_s"] <= s["wall"]


def test_encode_costs_and_the_client_path(tmp_path):
    """`bench.py encode`: every format's cost, MP3 on threads, the engine client's own path, whose streams
    carry exactly what the service's encoders make of the played worker's chunks, and a burst of first chunks."""
    out = tmp_path / "encode.json"
    doc = bench.main(["encode", "--seconds", "1", "--threads", "1,2", "--client-path", "3", "--step-ms", "5",
                               "--encoder-threads", "2", "--burst", "4", "--burst-threads", "1,2",
                               "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(doc))
    assert {r["format"] for r in doc["formats"]} >= {"mp3 192 kbps q2", "pcm s16le", "wav", "flac", "opus"}
    assert all(r["core_s_per_audio_s"] > 0 and r["bytes"] > 0 for r in doc["formats"])
    # every LAME quality the service accepts decodes to its input (SNR well above a misaligned or broken stream's ~0 dB)
    mp3 = {r["format"]: r["snr_db"] for r in doc["formats"] if r["format"].startswith("mp3")}
    assert {"mp3 192 kbps q0", "mp3 192 kbps q7"} <= set(mp3) and min(mp3.values()) > 15, mp3
    assert [r["threads"] for r in doc["mp3_threads"]] == [1, 2]
    steps, chunk = round(SAMPLE_RATE / 7680), 7680
    audio = encode.speech_like(8.0, SAMPLE_RATE)
    chunks = [audio[i * chunk:(i + 1) * chunk] for i in range(steps)]
    for row in doc["client_path"]:
        enc = encode.make_encoder(row["format"], SAMPLE_RATE)
        one = b"".join(enc(c, i == steps - 1) or b"" for i, c in enumerate(chunks))
        assert row["bytes"] == 3 * len(one) and row["core_s_per_audio_s"] > 0
    assert [r["format"] for r in doc["client_path"]] == ["pcm", "mp3"]
    assert [(r["streams"], r["threads"]) for r in doc["burst"]] == [(4, 1), (4, 2)]
    assert all(r["last_ms"] >= r["median_ms"] > 0 for r in doc["burst"])
    # each stream's first chunk was really encoded: at least one whole 192 kbps frame (576 bytes at 48 kHz) each
    assert all(r["bytes"] >= 4 * 576 for r in doc["burst"])
    # `bench.py serving-report`'s line on the host's LAME reads this file
    line = serving_report.host_lame(tmp_path)
    assert f"at most {max(r['audio_s_per_s'] for r in doc['mp3_threads']):.1f} audio-s/s" in line
    assert "the client path, mp3" in line and "4 first chunks at once on 2 threads" in line



def test_tokenize_times_one_request_a_burst_and_its_parts(checkpoint_factory, tmp_path):
    """`bench.py tokenize`: the client's tokenization of one request and of a burst, each after an idle pause."""
    from engine.io.tokenizer import TextTokenizer, text_tokens_many

    ckpt = checkpoint_factory("tiny-voxcpm2", stop="never")
    out = tmp_path / "tokenize.json"
    doc = bench.main(["tokenize", "--model", str(ckpt), "--burst", "4", "--rounds", "2", "--pause-ms", "1",
                      "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(doc))
    assert doc["burst"] == 4 and doc["text_chars"] == len(harness.TEXT)
    ids = text_tokens_many(TextTokenizer.from_dir(ckpt), [(f"Request 0. {harness.TEXT}", "", False)])[0][0]
    assert doc["tokens_per_request"] == len(ids)
    assert all(doc[k] > 0 for k in ("one_request_us", "burst_us", "burst_normalise_us", "burst_encode_us"))


def test_normalize_stall_times_both_ways_for_each_kind(tmp_path):
    """`bench.py normalize-stall`: the loop's gaps while segments are normalised on a thread and in the process."""
    out = tmp_path / "normalize.json"
    doc = bench.main(["normalize-stall", "--texts", "1", "--chars", "60", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(doc))
    for kind in ("prose", "amounts"):
        for way in ("thread", "process"):
            row = doc[kind][way]
            assert 0 < row["median_gap_ms"] <= row["p99_gap_ms"] <= row["max_gap_ms"] and row["wall_s"] > 0, row

# ---------------------------------------------------------------- measurement helpers


def test_underruns_and_pcm_pieces():
    # chunks of 1 s: the second arrives in time, the third 0.5 s after the buffer ran out
    assert harness.count_underruns([0.0, 0.9, 2.5], [1.0, 1.0, 1.0]) == (1, pytest.approx(0.5))
    assert harness.count_underruns([], []) == (0, 0.0)
    rec = harness.request_record([1.2, 1.4], [0.16, 0.16], start=1.0)
    assert rec["ttfb"] == pytest.approx(0.2) and rec["wall"] == pytest.approx(0.4)
    assert rec["rtf"] == pytest.approx(0.4 / 0.32)
    with pytest.raises(RuntimeError):
        harness.request_record([], [])


def test_mp3_counter_reads_frame_headers():
    sr, n = 48000, 48000  # 1 s
    enc = lameenc.Encoder()
    enc.set_bit_rate(192)
    enc.set_in_sample_rate(sr)
    enc.set_channels(1)
    enc.set_quality(2)
    pcm = (0.2 * np.sin(2 * np.pi * 220 * np.arange(n) / sr) * 32767).astype("<i2").tobytes()
    data = bytes(enc.encode(pcm)) + bytes(enc.flush())
    whole = harness.Mp3Counter().feed(data)
    counter = harness.Mp3Counter()  # fed in odd-sized pieces: frames split across pieces still count once
    pieces = sum(counter.feed(data[i:i + 777]) for i in range(0, len(data), 777))
    assert whole == pytest.approx(pieces)
    assert 1.0 <= whole <= 1.0 + 3 * 1152 / sr
    assert math.isclose(whole * sr / 1152, round(whole * sr / 1152))  # whole MPEG-1 layer III frames
    assert harness.mp3_frame(b"\x00\x00\x00\x00") is None


def test_tune_coalesce_runs_each_window_against_its_own_service(checkpoint_factory, tmp_path, monkeypatch):
    """`bench.py tune-coalesce` starts the real service per window (a subprocess on the tiny checkpoint, CPU)
    and runs the open-loop benchmark against it over HTTP; each window's service really used its window."""
    ckpt = checkpoint_factory("tiny-voxcpm2", stop="never")
    monkeypatch.setenv("NANOVLLM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("NANOVLLM_SERVERPOOL_DEVICES", "cpu")
    monkeypatch.setenv("NANOVLLM_API_PROCESSES", "1")
    out = tmp_path / "tune.json"
    doc = tune_coalesce.tune(["--model", str(ckpt), "--windows", "0,7", "--rate", "3", "--duration", "1", "--patches",
                              "2", "--max-num-seqs", "4", "--port", str(free_port()), "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(doc))
    assert [w["window_ms"] for w in doc["windows"]] == [0.0, 7.0]
    for w in doc["windows"]:
        assert "error" not in w, w.get("error")
        rows = w["open_loop"]["results"]
        assert len(rows) == 1 and rows[0]["failed"] == 0 and rows[0]["requests"] == rows[0]["arrivals"] >= 1
        log = (tmp_path / w["service_log"]).read_text()
        assert w["open_loop"]["service"]["queue_coalesce_ms"] == w["window_ms"], log[-2000:]


def test_serving_reports_rounds_table_has_a_row_per_variant_format_and_concurrency(tmp_path):
    """`bench.py serving-report`'s rounds table: MP3 rows named by their variant, PCM rows by variant and format, each
    the mean of its rounds against the pool at the same concurrency."""
    def result(c: int, rate: float, p95: float, underran: int = 0) -> dict[str, Any]:
        return {"concurrency": c, "throughput_audio_s_per_s": rate, "ttfb_p95": p95, "streams_with_underrun": underran,
                "service_cores_mean": 2.0}

    for name, rate, p95 in (("r1_env0_mp3", 90.0, 0.13), ("r2_env0_mp3", 100.0, 0.11),
                            ("r1_env0_pcm", 100.0, 0.10), ("r2_env0_pcm", 98.0, 0.12)):
        (tmp_path / f"http_{name}_a.json").write_text(json.dumps({"results": [result(128, rate, p95, 1)]}))
    lines = serving_report.rounds_table(tmp_path, {128: result(128, 100.0, 0.10)})
    assert lines[2] == "| env0 | 128 | 2 | 100.0 | 95.0% (90.0, 100.0) | +20 ms (+30, +10) | 1, 1 | 2.0 |"
    assert lines[3] == "| env0 pcm | 128 | 2 | 100.0 | 99.0% (100.0, 98.0) | +10 ms (+0, +20) | 1, 1 | 2.0 |"


def test_burst_timeline_begins_a_burst_after_requests_refused_before_any_step():
    """`profiler.py timeline`: a burst ends when its worker is idle again; requests refused at intake log no step,
    so an arrival more than a second after them begins the next burst instead of stretching theirs."""

    def line(t: str, msg: str) -> str:
        return f"2026-11-27 10:00:{t} worker[cuda:0] DEBUG engine.serving.worker: {msg}"

    lines = [line("00,000", "generate a-0 received"),  # refused at intake: no step follows
             line("05,000", "generate b-0 received"), line("05,002", "generate b-1 received"),
             line("05,039", "step: prefill 2 seqs 3.0 ms (host), decode 2 seqs 1.0 ms"),
             line("05,040", "step 1: 30.0 ms, 0 events, 0 waiting, 2 running"),
             line("05,200", "step 2: 30.0 ms, 2 events, 0 waiting, 0 running"),
             line("05,300", "generate c-0 received")]
    bursts = timeline.timeline(lines)
    assert [(b["requests"], len(b["rounds"])) for b in bursts] == [(1, 0), (2, 1), (1, 0)]
    assert bursts[1]["spread_ms"] == pytest.approx(2.0) and bursts[1]["rounds"][0]["seqs"] == 2


def test_burst_timeline_spaces_the_steady_steps_leaving_out_admission_and_the_last():
    """`profiler.py timeline`: a burst's decode period is its step lines' mean spacing after the two admission steps
    and before the last; too few steps give none."""

    def line(ms: int, msg: str) -> str:
        return f"2026-11-27 10:00:{ms // 1000:02d},{ms % 1000:03d} worker[cuda:0] DEBUG engine.serving.worker: {msg}"

    stamps = [10, 40, *range(70, 70 + 24 * 12, 24), 400]  # admission, twelve steps 24 ms apart, a late last one
    lines = [line(0, "generate a-0 received")]
    lines += [line(t, f"step {i + 1}: 5.0 ms, 1 events, 0 waiting, {int(i + 1 < len(stamps))} running")
              for i, t in enumerate(stamps)]
    (burst,) = timeline.timeline(lines)
    assert burst["steps"] == len(stamps) and burst["step_period_ms_mean"] == pytest.approx(24.0)
    assert burst["step_period_ms_p50"] == pytest.approx(24.0)
    assert "15 steps, 24.00 ms apart (mean)" in timeline.describe(burst)
    (short,) = timeline.timeline(lines[:6] + [line(500, "step 9: 5.0 ms, 1 events, 0 waiting, 0 running")])
    assert "step_period_ms_mean" not in short


def test_burst_timeline_reads_the_bench_clients_handoffs_as_an_api_processes(capfd):
    """`bench.py stream` at VOXCPM_LOG_LEVEL=DEBUG: its engine client logs each request's hand-off and send, labelled
    `client`, once however many pools it starts; `profiler.py timeline` reads them as it reads an API process's."""
    import logging

    from engine import options

    logger = logging.getLogger("engine.serving")
    level, handlers = logger.level, list(logger.handlers)
    try:
        harness.log_client_handoffs()  # not at DEBUG: nothing
        assert logger.handlers == handlers
        with options.override(log_level="DEBUG"):
            harness.log_client_handoffs()
            harness.log_client_handoffs()
        assert len(logger.handlers) == len(handlers) + 1
        logging.getLogger("engine.serving.stream").debug("generate b-0 to worker 0")
        logging.getLogger("engine.serving.client").debug("generate b-0 sent")
    finally:
        logger.handlers[:] = handlers
        logger.setLevel(level)
    client = capfd.readouterr().err.splitlines()
    assert [line.split(" client DEBUG ")[1] for line in client] == [
        "engine.serving.stream: generate b-0 to worker 0", "engine.serving.client: generate b-0 sent"]
    stamp = client[-1][:23]  # the worker reads it in the same millisecond
    worker = [f"{stamp} worker[cuda:0] DEBUG engine.serving.worker: generate b-0 received",
              f"{stamp} worker[cuda:0] DEBUG engine.serving.worker: step 1: 9.0 ms, 0 events, 0 waiting, 1 running"]
    (burst,) = timeline.timeline(client + worker)
    assert burst["api"]["requests"] == 1 and burst["api"]["worker_read_max_ms"] == 0.0
    assert "first step ended 0 ms after the first arrival" in timeline.describe(burst)


def test_pyspy_start_phases_attribute_the_worker_main_thread_by_its_outermost_phase(tmp_path):
    """`profiler.py pyspy --phases`: only stacks under the worker's entry point count; a stack is in the first
    phase whose function it holds (graph capture inside the engine's constructor is "graphs", not "engine_other");
    one under the entry point but not yet in worker_main is the imports."""
    head = 'process 7:"python -m service.main";thread (0x1);_run_worker (engine/serving/processes.py:36)'
    engine = f"{head};worker_main (engine/serving/worker_startup.py:99);__init__ (engine/llm_engine.py:60)"
    raw = tmp_path / "start.txt"
    raw.write_text("\n".join([
        f"{head};_find_and_load (<frozen importlib._bootstrap>:1360) 40",
        f"{engine};capture_graphs (engine/runner/model_runner.py:450);synchronize (torch/cuda/__init__.py:1) 25",
        f"{engine};profile_num_blocks (engine/runner/model_runner.py:160);forward (x.py:1) 20",
        f"{engine};_build (engine/llm_engine.py:70) 5",
        'process 8:"voxcpm-api0";thread (0x2);run (uvicorn/server.py:1) 99',
    ]) + "\n")
    doc = pyspy.start_phases(str(raw), 5)
    assert doc["worker_samples"] == 90
    by_phase = {row["phase"]: row for row in doc["phases"]}
    assert {name: row["samples"] for name, row in by_phase.items()} == {"imports": 40, "graphs": 25, "kv_sizing": 20,
                                                                        "engine_other": 5}
    assert by_phase["graphs"]["top"] == [{"function": "synchronize (torch/cuda/__init__.py:1)", "samples": 25}]
    assert math.isclose(by_phase["imports"]["share"], 40 / 90)


def test_drift(checkpoint_factory, tmp_path):
    """`bench.py drift`: every rule's drift per segment, the first segment's own drift 0 (it is the reference)."""
    ckpt = checkpoint_factory("tiny-voxcpm2", stop="never")
    out = tmp_path / "drift.json"
    doc = bench.main(["drift", "--model", str(ckpt), "--device", "cpu", "--segments", "3", "--patches", "3",
                      "--max-model-len", "1024", "--out", str(out)])
    assert json.loads(out.read_text()) == doc
    assert [r["rule"] for r in doc["results"]] == ["first", "previous", "none"]
    for r in doc["results"]:
        assert len(r["drift"]) == 3 and r["drift"][0] == 0.0 and all(d >= 0 for d in r["drift"])
    # the first two segments are made alike by both prompt rules (segment 1 continues from segment 0 in each)
    assert doc["results"][0]["drift"][1] == doc["results"][1]["drift"][1]


def test_fp8_accuracy(checkpoint_factory, tmp_path):
    """`bench.py fp8-accuracy` on a checkpoint whose stop head decides: every stack's four projections observed (the
    CPU's FP8 GEMM is its dequantised reference), each request's first patch moved by the FP8 weights, and where each
    request stopped under both; the floor (the unquantised run batched otherwise) beside it."""
    ckpt = checkpoint_factory("tiny-voxcpm2")  # the random stop head: requests stop where it fires
    out = tmp_path / "fp8.json"
    doc = bench.main(["fp8-accuracy", "--model", str(ckpt), "--device", "cpu", "--requests", "2", "--patches", "3",
                      "--decode-steps", "1", "--min-rows", "1", "--max-num-seqs", "1", "--max-model-len", "256",
                      "--out", str(out)])
    assert json.loads(out.read_text()) == doc
    assert doc["command"].startswith("python tools/bench.py fp8-accuracy ") and doc["torch"] and doc["date_utc"]
    assert doc["fp8_gemm"] is False and "gpu_name" in doc  # the CPU: the reference
    assert doc["max_num_seqs"] == 1  # end to end, each request decoded alone
    assert {(r["stack"], r["kind"]) for r in doc["layers"]} == {
        (s, k) for s in ("base_lm", "residual_lm", "locenc", "dit") for k in ("qkv", "o", "gate_up", "down")}
    for r in doc["layers"]:  # e4m3's rounding of both operands: a few percent, never nothing
        assert r["calls"] >= 1 and 1 <= r["rows_min"] <= r["rows_max"] and 0 < r["fp8_rel_err_vs_bf16"] < 0.2
    e2e = doc["end_to_end"]
    assert len(e2e["per_request"]) == 2 and 0 <= e2e["stop_agree_share"] <= 1
    for r in e2e["per_request"]:
        assert 0 < r["first_patch_rel_err"] < 1 and 1 <= r["patches_compared"] <= 3
        for stop in (r["stop_patch_bf16"], r["stop_patch_fp8"]):
            assert stop is None or 1 <= stop <= 3
    assert e2e["first_patch_rel_err"]["max"] == max(r["first_patch_rel_err"] for r in e2e["per_request"])
    # the floor: unquantised, both requests together against each alone; the CPU's steps are batch-invariant, so
    # the batching alone moves nothing
    floor = doc["reference_floor"]
    assert floor["max_num_seqs"] == {"first": 1, "other": 2} and len(floor["per_request"]) == 2
    assert floor["mean_patch_rel_err"]["max"] == 0.0 and floor["stop_agree_share"] == 1.0


def test_the_http_benchmarks_long_text_is_whole_sentences_within_its_length():
    from tools.benchmarks.http_bursts import long_text

    text = long_text(20000)
    assert 19000 < len(text) <= 20000 and text.endswith(".") and text.count("\n\n") >= 40
    assert long_text(len(text)) == text


def test_arrival_burst_pool(checkpoint_factory, tmp_path):
    """Running streams, then a burst: the burst's requests are the row's requests; the running streams' gaps are
    counted inside the burst window and compared with their chunk's length."""
    doc = run_pool(checkpoint_factory, tmp_path / "burst.json", "arrival-burst",
                   ["--running", "2", "--burst", "2", "--burst-patches", str(PATCHES), "--settle", "0.05",
                    "--iters", "1"], rows=1)
    r = doc["results"][0]
    assert r["requests"] == 2 and r["running_streams"] == 2 and r["concurrency"] == 4
    assert doc["running"] == 2 and doc["burst"] == 2 and doc["pool"]["max_num_seqs"] == 4
    assert 0 <= r["running_gaps_over_chunk"] <= r["running_gaps_in_window"]
    assert r["chunk_s"] in (None, pytest.approx(PATCH_S))  # None: the running streams ended before the burst started
    assert r["burst_admit_s"] == pytest.approx(r["burst_admit_s_each"][0]) and r["burst_admit_s"] > 0


def test_vae_dtype(checkpoint_factory, tmp_path):
    """The bfloat16 decoder against float32 on the CPU: the same patches, the audio within bf16's rounding."""
    out = tmp_path / "vae_dtype.json"
    doc = bench.main(["vae-dtype", "--model", str(checkpoint_factory("tiny-voxcpm2", stop="never")), "--requests",
                      "2", "--patches", str(PATCHES), "--batch", "2", "--repeats", "1", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(doc))
    assert doc["patches_equal"] is True and doc["device"] == "cpu" and len(doc["snr_db"]) == 2
    assert 30 < doc["snr_db_min"] <= doc["snr_db_mean"] < 200 and 0 < doc["max_abs_diff"] < doc["audio_peak"]
    assert doc["vae_ms"]["2"]["float32"] > 0 and doc["vae_ms"]["2"]["bfloat16"] > 0


def test_gc_pauses_before_and_after_freezing_the_start_up_heap(checkpoint_factory, tmp_path):
    """`bench.py gc`: a warmed engine's heap, a forced full collection of it, then the same with it frozen (the
    collector then walks a few objects), and an API process's heap; the benchmark's own process is left unfrozen."""
    out = tmp_path / "gc.json"
    doc = bench.main(["gc", "--model", str(checkpoint_factory("tiny-voxcpm2", stop="never")), "--requests", "2",
                      "--patches", str(PATCHES), "--rounds", "1", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(doc))
    before, after = doc["as_started"], doc["frozen"]
    assert doc["frozen_at_start"] > 50_000 and before["frozen_objects"] == 0
    assert after["tracked_objects"] < before["tracked_objects"] / 10 and after["frozen_objects"] > 50_000
    assert doc["api_process"]["tracked_objects"] > 10_000
    assert gc.get_freeze_count() == 0


@pytest.mark.parametrize(("euler_us", "between_us"), [(310.0, 1900.0), (2000.0, 9500.0), (3850.0, 18000.0)])
def test_trace_finds_each_step_by_its_cluster_of_euler_updates(euler_us: float, between_us: float):
    # 9 Euler updates a step, an update's solve apart, then the rest of the step: B=1, 128 and 256 on an H200
    marks, starts, t = [], [], 100.0
    for _ in range(6):
        starts.append(t)
        for _ in range(9):
            marks.append(t)
            t += euler_us
        t += between_us - euler_us
    assert step.step_starts(marks) == starts
    assert step.step_starts(marks[:1]) == marks[:1] and step.step_starts([]) == []


def test_intake_times_a_workers_burst_from_its_messages_to_its_first_steps(checkpoint_factory, tmp_path):
    """`bench.py intake` (here on the CPU): a real Worker handed one pickled batch of Generate messages, each round's
    intake, admission step and the step after it, their medians without the warm-up round; every request admitted
    (the worker took the whole burst) and run to its end between rounds."""
    ckpt = checkpoint_factory("tiny-voxcpm2", stop="never")
    out = tmp_path / "intake.json"
    doc = bench.main(["intake", "--model", str(ckpt), "--burst", "3", "--rounds", "2", "--distinct",
                      "--out", str(out)])
    assert json.loads(out.read_text()) == doc and doc["device"] == "cpu" and doc["distinct"] is True
    assert len(doc["rounds"]) == 3 and all(v > 0 for r in doc["rounds"] for v in r.values())
    for key in ("intake_ms", "admission_step_ms", "next_step_ms"):
        assert doc[f"{key}_median"] == pytest.approx(statistics.median(r[key] for r in doc["rounds"][1:]), abs=0.01)


def test_a_whole_burst_in_process_reports_what_it_costs_beyond_its_steps(checkpoint_factory):
    """`profiler.py step --burst-patches N`'s burst (here on the CPU): the adds, each step until every request has its
    first audio, and for a whole burst its wall, its audio-s/s (the audio it made over that wall), the step count
    (a prefill step, then one a patch, pipelined or not) and its last steps."""
    from engine import EngineConfig, LLMEngine
    engine = LLMEngine(checkpoint_factory("tiny-voxcpm2", stop="never"),
                       EngineConfig(max_num_seqs=4, max_model_len=512), device="cpu")
    first = step.burst_first_audio(engine, 4, patches=3)
    assert "wall_s" not in first and first["add_ms"] > 0 and first["step_ms"]
    whole = step.burst_first_audio(engine, 4, first=4, patches=6)
    assert whole["patches"] == 6 and 1 <= len(whole["step_ms"]) <= whole["steps"]
    assert whole["steps"] in (6, 7) and len(whole["last_step_ms"]) == 4
    # The steady steps: after every first audio, less the last; they end with the last four steps' first three, and
    # with the first-audio steps and the last they fit in the wall.
    steady = whole["steps"] - len(whole["step_ms"]) - 1
    assert steady >= 3
    total = whole["steady_step_ms_mean"] * steady
    assert sum(whole["last_step_ms"][:3]) - 0.01 <= total <= (1000 * whole["wall_s"] - sum(whole["step_ms"])
                                                              - whole["last_step_ms"][-1])
    assert 0 < whole["ttfb_ms_p50"] <= whole["ttfb_ms_max"] <= 1000 * whole["wall_s"]
    audio_s = 4 * 6 * SAMPLES_PER_PATCH / SAMPLE_RATE
    # rounded to 0.1, from the wall before its rounding to 0.1 ms (which moves the quotient by up to ~0.005 here)
    assert whole["audio_s_per_s"] == pytest.approx(audio_s / whole["wall_s"], abs=0.06)
    assert not engine.has_unfinished()
