"""Admission control over real HTTP: beyond what the workers run plus their queue, a generation request
is refused at once with 503 + Retry-After (counted in a metric), before any audio; a request that waits for a seat
past the queue timeout gets 503 too; the admitted ones complete and nothing is left in flight."""

from __future__ import annotations

import asyncio
import base64
import json
import logging

import httpx
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.serving.reports import WorkerStats
from tests.service_harness import TLS, LiveServer, live_server, send_post, small_window_socket, wav_bytes

BURST = 40  # ten times what the workers hold (running + queued)
LONG = "A long enough sentence for a stream of about a hundred patches. " * 2
HOLD = "Held seats: a text long enough for a stream of a few hundred patches, while the burst comes. " * 3
HOLD_PATCHES = 240  # the holders keep every seat far longer than the burst takes to be answered


def _overloads(server: LiveServer) -> float:
    text = httpx.get(server.url + "/metrics", verify=TLS).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("voxcpm_requests_overloaded_total{"))


def _requests(server: LiveServer, route: str, status: str) -> float:
    text = httpx.get(server.url + "/metrics", verify=TLS).text
    return sum(s.value for f in text_string_to_metric_families(text) if f.name == "voxcpm_http_requests"
               for s in f.samples if s.name.endswith("_total") and s.labels.get("route") == route
               and s.labels.get("status") == status)


def test_excess_requests_are_503_at_once_and_the_admitted_complete(checkpoint_factory, tmp_path):
    """Four requests take every seat (2 running + 2 queued); only then does the burst come, so every one of it is
    refused whatever the machine's speed; the four complete."""
    # segment_chars 1000: each holder's text is one generation (the holders of split texts: test_service_longform);
    # queue_timeout_s 600 (past the hang guard): the queued holders wait for the running ones however slow the machine
    # (a wait past the queue timeout is the next test's)
    with live_server(checkpoint_factory, tmp_path, serverpool_max_num_seqs=2, max_queued_requests=2,
                     queue_coalesce_ms=0, segment_chars=1000, queue_timeout_s=600) as server:

        async def one(client: httpx.AsyncClient, i: int, text: str, patches: int) -> tuple[int, str | None, int]:
            async with client.stream("POST", "/generate", json={"target_text": text, "max_generate_length": patches,
                                                                 "response_format": "pcm", "seed": i}) as r:
                data = b"".join([c async for c in r.aiter_raw()])
                return r.status_code, r.headers.get("retry-after"), len(data)

        async def scenario() -> tuple[list, list]:
            limits = httpx.Limits(max_connections=BURST + 4)
            async with httpx.AsyncClient(verify=TLS, base_url=server.url, timeout=120, limits=limits) as client:
                holders = [asyncio.create_task(one(client, i, HOLD, HOLD_PATCHES)) for i in range(4)]
                while (s := await server_stats()).running + s.waiting < 4:
                    assert not any(h.done() for h in holders), [h.result() for h in holders if h.done()]
                    await asyncio.sleep(0.05)
                burst = await asyncio.gather(*(one(client, 100 + i, LONG, 40) for i in range(BURST - 4)))
                assert not any(h.done() for h in holders), "a holder ended before the burst was answered"
                return list(await asyncio.gather(*holders)), list(burst)

        async def server_stats() -> WorkerStats:
            stats = asyncio.run_coroutine_threadsafe(server.state.pool.stats(), server.loop)
            return (await asyncio.wrap_future(stats))[0]

        held, burst = asyncio.run(asyncio.wait_for(scenario(), 300))  # a hang guard
        assert all(status == 503 and retry is not None for status, retry, _ in burst), burst
        assert all(status == 200 and n == HOLD_PATCHES * 7680 * 2 for status, _, n in held), held
        assert _overloads(server) == BURST - 4
        LiveServer.wait(lambda: (s := server.pool_stats()).running == s.waiting == 0
                        and s.free_blocks == s.total_blocks, "requests left in flight")


def test_a_long_texts_next_segment_outwaits_the_queue_timeout(checkpoint_factory, tmp_path):
    """With a prompt voice a long text's next segment is queued while the one before it decodes in the only seat: it
    waits past the queue timeout (0.2 s; a segment takes seconds on a CPU) without failing (it was failed
    "overloaded", cutting the text there)."""
    with live_server(checkpoint_factory, tmp_path, serverpool_max_num_seqs=1, queue_timeout_s=0.2,
                     queue_coalesce_ms=0, voice_store="memory") as server, \
            httpx.Client(verify=TLS, base_url=server.url, timeout=120) as client:
        info = server.state.model
        prompt = np.random.default_rng(1).standard_normal((3 * info.patch_size, info.feat_dim)).astype(np.float32)
        body = {"target_text": LONG + "\n\n" + LONG, "max_generate_length": 100, "seed": 1, "retry_badcase": False,
                "response_format": "pcm", "timings": True, "prompt_text": "Hi.",
                "prompt_latents_base64": base64.b64encode(prompt.tobytes()).decode()}
        r = client.post("/generate_blocking", json=body)
        assert r.status_code == 200, r.text
        timings = json.loads(r.headers["X-Segment-Timings"])
        assert [t["finish_reason"] for t in timings] == ["length"] * 2, timings
        assert _overloads(server) == 0


def test_a_request_waiting_past_the_queue_timeout_is_503(checkpoint_factory, tmp_path):
    with live_server(checkpoint_factory, tmp_path, serverpool_max_num_seqs=1, queue_timeout_s=0.5,
                     queue_coalesce_ms=0) as server, \
            httpx.Client(verify=TLS, base_url=server.url, timeout=120) as client:
        body = {"target_text": LONG, "max_generate_length": 300, "response_format": "pcm", "seed": 1}
        with client.stream("POST", "/generate", json=body) as first:  # holds the only seat for seconds
            assert first.status_code == 200
            chunks = first.iter_raw()
            next(chunks)
            r = client.post("/generate", json={**body, "seed": 2})
            assert r.status_code == 503 and "queue timeout" in r.json()["detail"], r.text
            assert r.headers.get("retry-after")
        assert _overloads(server) == 1


@pytest.mark.parametrize("route", ["/generate", "/v1/audio/speech"])
def test_a_streamed_request_left_while_it_waits_for_a_seat_frees_its_place_in_the_queue(checkpoint_factory, tmp_path,
                                                                                        route):
    """A client that gives up on a streamed request still waiting for a seat: the request leaves the queue at once
    (499), instead of holding its place until the queue timeout and then counting as refused for overload."""
    with live_server(checkpoint_factory, tmp_path, serverpool_max_num_seqs=1, queue_timeout_s=600,
                     queue_coalesce_ms=0, segment_chars=1000) as server, \
            httpx.Client(verify=TLS, base_url=server.url, timeout=120) as client:
        body = {"target_text": HOLD, "max_generate_length": HOLD_PATCHES, "response_format": "pcm", "seed": 1}
        with client.stream("POST", "/generate", json=body) as held:  # holds the only seat
            chunks = held.iter_raw()
            next(chunks)
            waiting = {"model": "tts-1", "input": LONG} if route.startswith("/v1") else {"target_text": LONG}
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(server.url + route, json={**waiting, "response_format": "pcm"}, verify=TLS, timeout=1.0)
            server.wait(lambda: server.pool_stats().waiting == 0, "the left request still waits for a seat",
                        limit_s=30)
            assert server.pool_stats().running == 1  # the holder goes on
        assert _requests(server, route, "499") == 1 and _overloads(server) == 0


def test_a_full_queue_refuses_generations_only(checkpoint_factory, tmp_path):
    """Every seat and queue place taken: a new generation is a 503, but encoding a clip and listing the adapters are
    not generations and are answered (they were refused as overloaded too)."""
    with live_server(checkpoint_factory, tmp_path, serverpool_max_num_seqs=1, max_queued_requests=0,
                     queue_coalesce_ms=0, segment_chars=1000, max_loras=1, max_lora_rank=4) as server, \
            httpx.Client(verify=TLS, base_url=server.url, timeout=120) as client:
        body = {"target_text": HOLD, "max_generate_length": HOLD_PATCHES, "response_format": "pcm", "seed": 1}
        with client.stream("POST", "/generate", json=body) as held:
            chunks = held.iter_raw()
            next(chunks)
            assert client.post("/generate", json={"target_text": LONG}).status_code == 503
            clip = base64.b64encode(wav_bytes(0.5, seed=1)).decode()
            r = client.post("/encode_latents", json={"wav_base64": clip})
            assert r.status_code == 200, r.text
            r = client.get("/loras")
            assert r.status_code == 200 and r.json() == {"loras": []}, r.text


def test_a_client_that_never_reads_holds_no_admission_place(checkpoint_factory, tmp_path):
    """A client that sends a request and never reads its audio: once the engine has made it all, the request leaves
    the admission count, so the next one is served (the count was released only when the response had been written:
    eight such sockets held every place of an idle service, for as long as they stayed open)."""
    with live_server(checkpoint_factory, tmp_path, serverpool_max_num_seqs=1, max_queued_requests=0,
                     queue_coalesce_ms=0, segment_chars=1000) as server:
        body = json.dumps({"target_text": HOLD, "max_generate_length": HOLD_PATCHES, "response_format": "pcm"})
        with small_window_socket(server.port) as stalled:
            send_post(stalled, "/generate", body)
            LiveServer.wait(lambda: server.pool_stats().running == 1, "the stalled request never started")
            LiveServer.wait(lambda: (s := server.pool_stats()).running == s.waiting == 0,
                            "the engine never finished the stalled request")
            with httpx.Client(verify=TLS, base_url=server.url, timeout=120) as client:
                r = client.post("/generate", json={"target_text": "Next.", "max_generate_length": 2,
                                                   "response_format": "pcm"})
            assert r.status_code == 200, r.text
            assert len(stalled.recv(1 << 16)) > 0  # the stalled response is still there to be read


def test_a_client_that_reads_nothing_for_the_send_timeout_is_dropped(checkpoint_factory, tmp_path, caplog):
    """A streamed response whose client takes none of its audio for NANOVLLM_SEND_TIMEOUT_S is dropped: the connection
    closes before the whole audio (it held its socket and the audio made for it for as long as the client liked).
    The drop is a warning naming the stream, not uvicorn's nameless ERROR for a response left unterminated."""
    server_log = logging.getLogger("uvicorn.error")  # does not reach the root logger that caplog watches
    try:
        with live_server(checkpoint_factory, tmp_path, serverpool_max_num_seqs=1, queue_coalesce_ms=0,
                         segment_chars=1000, send_timeout_s=2) as server:
            server_log.addHandler(caplog.handler)  # after uvicorn's logging set-up, which drops the logger's handlers
            body = json.dumps({"target_text": HOLD, "max_generate_length": HOLD_PATCHES, "response_format": "pcm"})
            with small_window_socket(server.port) as stalled:
                send_post(stalled, "/generate", body)
                # taking nothing: once the sockets hold all they can, a write waits on the client past the timeout
                LiveServer.wait(lambda: "took no audio" in caplog.text, "the stream never gave up on its client")
                received = 0
                while data := stalled.recv(1 << 16):  # what the sockets held, then the end: the server closed it
                    received += len(data)
            assert 0 < received < HOLD_PATCHES * 7680 * 2
    finally:
        server_log.removeHandler(caplog.handler)
    assert "without completing response" not in caplog.text and "took no audio" in caplog.text


def test_a_live_session_refused_for_a_full_queue_is_counted(checkpoint_factory, tmp_path):
    """A WebSocket session refused because every seat and queue place is taken (close 1013) counts in
    voxcpm_requests_overloaded_total as the HTTP routes' refusals do (it counted nothing: the saturation alert
    never fired for live-text traffic)."""
    import psutil
    from websockets.exceptions import ConnectionClosed
    from websockets.sync.client import connect

    with live_server(checkpoint_factory, tmp_path, serverpool_max_num_seqs=1, max_queued_requests=0,
                     queue_coalesce_ms=0, segment_chars=1000) as server, \
            httpx.Client(verify=TLS, base_url=server.url, timeout=120) as client:
        body = {"target_text": HOLD, "max_generate_length": HOLD_PATCHES, "response_format": "pcm", "seed": 1}
        with client.stream("POST", "/generate", json=body) as held:
            chunks = held.iter_raw()  # held: a generator collected would close the response
            next(chunks)
            worker = psutil.Process(server.state.pool.workers.processes[0].process.pid)
            worker.suspend()  # the holder keeps its seat however fast the machine (admission is the client's)
            try:
                url = server.url.replace("http://", "ws://") + "/v1/audio/speech/stream"
                with connect(url, open_timeout=60) as ws:
                    ws.send(json.dumps({"type": "session.config", "response_format": "pcm"}))
                    ws.send(json.dumps({"type": "input.text", "text": "Refused, for every seat is taken."}))
                    ws.send(json.dumps({"type": "input.done"}))
                    with pytest.raises(ConnectionClosed) as closed:
                        while True:
                            ws.recv(timeout=60)
            finally:
                worker.resume()
        assert closed.value.rcvd.code == 1013
        assert _overloads(server) == 1
