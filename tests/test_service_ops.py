"""Operations over real HTTP: /health, /info, /metrics (route templates, TTFB, engine and cache gauges),
/ready flipping to 503 when a worker dies (and back once it is restarted), settings validation."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys

import httpx
import psutil
import pytest
from pydantic import ValidationError

from service.settings import Settings, describe_error
from tests.service_harness import TLS, LiveServer, live_server, send_post


@pytest.fixture(scope="module")
def server(checkpoint_factory, tmp_path_factory):
    # a worker silent for 10 s is killed (120 by default): far beyond a tiny CPU worker's longest turn of its loop
    # a body's next bytes within 2 s: every test here sends its body at once
    with live_server(checkpoint_factory, tmp_path_factory.mktemp("svc-ops"), worker_stuck_timeout_s=10,
                     body_timeout_s=2) as s:
        yield s


def test_health_info(server):
    with httpx.Client(verify=TLS, base_url=server.url) as c:
        assert c.get("/health").json() == {"status": "ok"}
        info = c.get("/info").json()
    assert info["model"]["sample_rate"] == 48000 and info["model"]["feat_dim"] == 64
    assert info["model"]["model_path"] and info["mp3"] == {"bitrate_kbps": 192, "quality": 3}
    assert info["ready"] is True and info["model"]["random_weights"] is False


def test_metrics(server):
    with httpx.Client(verify=TLS, base_url=server.url, timeout=60) as c:
        assert c.post("/generate", json={"target_text": "Metrics.", "max_generate_length": 2}).status_code == 200
        assert c.delete("/prompts/some-id").status_code == 404
        text = c.get("/metrics").text
        # sent whole: its first byte comes after all of its audio, which is no time to first audio (the alert on it
        # fired on plain blocking traffic)
        for route, body in (("/generate_blocking", {"target_text": "Whole."}),
                            ("/v1/audio/speech", {"model": "tts-1", "input": "Whole.", "response_format": "wav"})):
            assert c.post(route, json={**body, "max_generate_length": 2}).status_code == 200
        assert not re.search(r'voxcpm_time_to_first_audio_byte_seconds_count\{route="/(generate_blocking|v1)',
                             c.get("/metrics").text)
    assert 'voxcpm_http_requests_total{method="DELETE",route="/prompts/{prompt_id}",status="404"} 1.0' in text
    assert "some-id" not in text  # route templates, never raw paths
    assert 'voxcpm_time_to_first_audio_byte_seconds_count{route="/generate"} 1.0' in text
    assert 'voxcpm_audio_generated_seconds_total{route="/generate"} 0.32' in text  # 2 patches x 160 ms
    # the MP3 stream's chunks through the encoder pool: its first chunk and the later one(s), and the time they took
    assert 'voxcpm_encoder_wait_seconds_count{chunk="first"} 1.0' in text
    later = re.search(r'^voxcpm_encoder_wait_seconds_count\{chunk="next"\} (\S+)$', text, re.M)
    busy = re.search(r"^voxcpm_encoder_busy_seconds_total (\S+)$", text, re.M)
    assert later is not None and float(later[1]) >= 1 and busy is not None and float(busy[1]) > 0
    for name in ("voxcpm_queue_depth", "voxcpm_running_sequences", 'voxcpm_kv_cache_usage_ratio{worker="0"}',
                 'voxcpm_engine_step_seconds{worker="0"}', 'voxcpm_worker_send_seconds{worker="0"}',
                 'voxcpm_worker_gc_longest_seconds{worker="0"}',
                 'voxcpm_voice_cache_entries{kind="hifi"}',
                 "voxcpm_voice_cache_bytes", "voxcpm_ready 1.0"):
        assert name in text, name


def test_ready_flips_when_a_worker_dies(server):
    """Killing the worker makes /ready 503 (and generation 503 + Retry-After); the supervisor restarts it."""
    server.state.pool.kill_worker(0)
    with httpx.Client(verify=TLS, base_url=server.url, timeout=60) as c:
        LiveServer.wait(lambda: c.get("/ready").status_code == 503, "/ready stayed 200 after the worker died")
        assert c.get("/health").status_code == 200  # the process itself is fine
        r = c.post("/generate", json={"target_text": "x", "max_generate_length": 1})
        if r.status_code != 200:  # the restart may already be done
            assert r.status_code == 503 and "Retry-After" in r.headers
    server.wait_ready()
    with httpx.Client(verify=TLS, base_url=server.url, timeout=60) as c:
        assert c.post("/generate", json={"target_text": "Back.", "max_generate_length": 1}).status_code == 200


def test_a_stuck_worker_is_killed_and_restarted(server):
    """The app owning its worker: a worker whose loop stops (SIGSTOP: a GPU call that never returns) is killed
    after NANOVLLM_WORKER_STUCK_TIMEOUT_S and restarted (it was only reported not ready, for good)."""
    worker = psutil.Process(server.state.pool.workers.processes[0].process.pid)
    worker.suspend()
    LiveServer.wait(lambda: server.state.pool.workers.processes[0].process.pid != worker.pid,
                    "the stuck worker was never killed and restarted", 60)
    server.wait_ready()
    with httpx.Client(verify=TLS, base_url=server.url, timeout=60) as c:
        assert c.post("/generate", json={"target_text": "Back.", "max_generate_length": 1}).status_code == 200


def test_settings_validation(monkeypatch):
    monkeypatch.setenv("NANOVLLM_MP3_QUALITY", "8")
    monkeypatch.setenv("NANOVLLM_SERVERPOOL_GPU_MEMORY_UTILIZATION", "1.5")
    monkeypatch.setenv("NANOVLLM_SERVERPOOL_ENFORCE_EAGER", "on")
    with pytest.raises(ValidationError) as e:
        Settings()
    msg = describe_error(e.value)
    assert "NANOVLLM_MP3_QUALITY" in msg and "NANOVLLM_SERVERPOOL_GPU_MEMORY_UTILIZATION" in msg
    monkeypatch.delenv("NANOVLLM_MP3_QUALITY")
    monkeypatch.delenv("NANOVLLM_SERVERPOOL_GPU_MEMORY_UTILIZATION")
    monkeypatch.setenv("NANOVLLM_SERVERPOOL_DEVICES", "0,1")
    s = Settings()
    assert s.serverpool_enforce_eager is True and s.device_list() == [0, 1]
    monkeypatch.setenv("NANOVLLM_MP3_BITRATE_KBPS", "100")
    with pytest.raises(ValidationError, match="mp3_bitrate_kbps"):
        Settings()


def test_encoder_threads_follow_the_seats_each_api_process_serves():
    """Auto: one thread per two seats an API process serves on average, 4..16 (one GPU of 128 seats over 14
    processes: 4, the old fixed default; two such GPUs over 16 processes: 8, as measured on two H100s; fewer seats
    still 4, measured against 2)."""
    s = Settings(serverpool_max_num_seqs=128)
    assert s.encoder_thread_count(14, 1) == 4 and s.encoder_thread_count(16, 2) == 8
    assert s.encoder_thread_count(1, 1) == 16 and Settings().encoder_thread_count(16, 1) == 4
    assert Settings(encoder_threads=3, serverpool_max_num_seqs=128).encoder_thread_count(16, 2) == 3


def test_console_command_rejects_bad_config():
    env = {**os.environ, "NANOVLLM_MP3_QUALITY": "9"}
    p = subprocess.run([sys.executable, "-c", "from service.main import main; main()"], env=env,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "NANOVLLM_MP3_QUALITY" in p.stderr


def test_request_body_over_the_limit_is_413_while_reading(server):
    """A declared length over NANOVLLM_MAX_REQUEST_BYTES is refused before the body is sent; a chunked body as
    soon as it passes the limit. The service stays healthy (no 500, nothing held)."""
    import socket

    limit = server.settings.max_request_bytes
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:  # headers only, no body follows
        sock.sendall(f"POST /generate HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {limit + 1}\r\n\r\n".encode())
        reply = b""
        while data := sock.recv(65536):  # the service closes the connection after its answer
            reply += data
        reply = reply.decode()
    assert reply.startswith("HTTP/1.1 413") and "exceeds the limit" in reply and "NANOVLLM_MAX_REQUEST_BYTES" in reply

    def chunks():
        yield b'{"target_text": "'
        for _ in range(limit // 2**20 + 1):
            yield b"x" * 2**20

    r = httpx.post(server.url + "/generate", content=chunks(), headers={"content-type": "application/json"},
                   timeout=60, verify=TLS)
    assert r.status_code == 413 and "request body" in r.json()["detail"]
    assert httpx.get(server.url + "/ready", verify=TLS).status_code == 200


def test_request_body_of_exactly_the_limit_is_accepted(server):
    """NANOVLLM_MAX_REQUEST_BYTES is the largest body accepted: one of exactly that size is served, declared by its
    Content-Length or sent chunked (JSON padded with trailing white space)."""
    limit = server.settings.max_request_bytes
    head = b'{"target_text": "Exactly at the limit.", "max_generate_length": 1, "response_format": "pcm"}'
    body = head + b" " * (limit - len(head))
    assert len(body) == limit
    r = httpx.post(server.url + "/generate", content=body, headers={"content-type": "application/json"}, timeout=120,
                   verify=TLS)
    assert r.status_code == 200, r.text[:300]

    def chunks():
        for i in range(0, limit, 2**20):
            yield body[i:i + 2**20]

    r = httpx.post(server.url + "/generate", content=chunks(), headers={"content-type": "application/json"},
                   timeout=120, verify=TLS)
    assert r.status_code == 200, r.text[:300]



def test_the_encoder_pool_serves_the_listener_who_runs_out_first():
    """The service's encoders take streams earliest deadline first: a stream with nothing sent yet at once, then the
    one whose listener has the least audio in hand (first output + audio made), whatever order they came in; the
    library's transform threads take them as they came."""
    import asyncio
    import threading
    from types import SimpleNamespace

    from engine.serving.transforms import TransformThreads
    from service.encoder_pool import EncoderPool

    def stream(first_output_at: float | None, seconds: float) -> SimpleNamespace:
        return SimpleNamespace(lock=threading.Lock(), pending=[], scheduled=False, first_output_at=first_output_at,
                               transformed_samples=int(seconds * 48000))

    loop = asyncio.new_event_loop()
    try:
        ahead, behind, new = stream(100.0, 5.0), stream(100.0, 1.0), stream(None, 0.0)
        for runner, expected in ((EncoderPool(0, loop), [new, behind, ahead]),
                                 (TransformThreads(0, loop), [ahead, behind, new])):
            for s in (ahead, behind, new):
                s.scheduled, s.pending = False, []
                runner.submit(s, object())
            assert [runner.queue.get_nowait()[2] for _ in range(3)] == expected
    finally:
        loop.close()


def test_the_pool_gauges_count_a_stuck_workers_load_and_no_free_seat_of_a_dead_one():
    """Three workers' stats at a scrape: one answered, one is stuck (connected, no answer), one is dead (restarting).
    The demand counts what the stuck one last reported (it read 0: the autoscaler saw no demand from that pod), and
    the dead one offers no free seat or block (its last values stayed: the seats summed to twice the truth)."""
    from engine.serving.reports import WorkerStats
    from service.metrics import Metrics

    metrics = Metrics()
    answered = WorkerStats(running=2, waiting=1, free_blocks=10, total_blocks=20, free_slots=2, total_slots=4)
    idle = WorkerStats(free_blocks=20, total_blocks=20, free_slots=4, total_slots=4)
    metrics.observe_pool([answered, idle, idle], [{"alive": 1}] * 3)  # all three answered once
    last = [{"alive": 1, "running": 2, "waiting": 1}, {"alive": 1, "running": 4, "waiting": 3},
            {"alive": 0, "running": 0, "waiting": 0}]
    metrics.observe_pool([answered, None, None], last)

    def value(name: str, worker: str | None = None) -> float:
        labels = {"worker": worker} if worker is not None else {}
        return metrics.registry.get_sample_value(name, labels)

    assert value("voxcpm_running_sequences") == 2 + 4 and value("voxcpm_queue_depth") == 1 + 3
    assert value("voxcpm_workers_up") == 1
    assert value("voxcpm_sequence_slots_free", "2") == 0 and value("voxcpm_kv_blocks_free", "2") == 0
    assert value("voxcpm_sequence_slots_free", "0") == 2


def test_a_whole_file_generation_cut_short_counts_its_audio_and_its_end(server):
    """A WAV generation whose client leaves before its file is made: the audio it made and its end ("aborted") count,
    as a streamed one's do (a whole-file format's first bytes are its last: neither counted)."""
    def counted() -> tuple[float, float]:
        text = httpx.get(server.url + "/metrics", verify=TLS).text
        audio = re.search(r'^voxcpm_audio_generated_seconds_total\{route="/generate_blocking_wav"\} (\S+)$', text, re.M)
        aborted = re.search(r'^voxcpm_generations_finished_total\{reason="aborted",route="/generate_blocking_wav"\} '
                            r'(\S+)$', text, re.M)
        return float(audio[1]) if audio else 0.0, float(aborted[1]) if aborted else 0.0

    before = counted()
    steps = server.pool_stats().steps
    body = json.dumps({"target_text": "A long enough text for a whole file that takes a good while to make. " * 3,
                       "max_generate_length": 300})
    with socket.create_connection(("127.0.0.1", server.port)) as client:
        send_post(client, "/generate_blocking_wav", body)
        LiveServer.wait(lambda: server.pool_stats().steps > steps + 2, "the generation never started")
    LiveServer.wait(lambda: counted()[1] == before[1] + 1, "the cut generation's end was not counted")
    assert counted()[0] > before[0]


def test_a_body_that_stops_arriving_is_refused(server):
    """A request whose body stops arriving midway gets 408 naming the setting once its next bytes are
    NANOVLLM_BODY_TIMEOUT_S late (uvicorn has no such timeout: 300 slow uploads held their connections for good)."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=60) as client:
        client.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                       b"Content-Length: 100\r\n\r\n{\"target_text\": ")
        answer = b""
        while b"NANOVLLM_BODY_TIMEOUT_S" not in answer and (data := client.recv(1 << 16)):  # head and body may part
            answer += data
    assert answer.startswith(b"HTTP/1.1 408") and b"NANOVLLM_BODY_TIMEOUT_S" in answer, answer
