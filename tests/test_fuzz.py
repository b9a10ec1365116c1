"""Fuzz every route of the OpenAPI schema with schemathesis against the real service (real worker, real HTTP): no
answer is a 5xx, and every 4xx says which field it is about (FastAPI's `loc`, our messages' "field: ..." prefix,
or OpenAI's `param` under /v1/). Examples are drawn from the schema (valid and invalid bodies, boundary values)."""

from __future__ import annotations

import re
from collections import Counter

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

from tests.service_harness import live_server

EXAMPLES = 40  # per route and mode: enough to reach each field's boundaries, few enough for CI on two cores
# A field named at the start of a message ("voice: unknown voice ..."), or the body as a whole ("request body: ...").
NAMES_A_FIELD = re.compile(r"^(request body|[A-Za-z_][A-Za-z0-9_.\[\]]*): ")


@pytest.fixture(scope="module")
def server(checkpoint_factory, tmp_path_factory):
    # max_model_len 64: a valid random request without max_generate_length generates up to 64 patches (~10 s of audio;
    # the three generation routes' valid examples are most of this module's time), and about as many of the drawn
    # bodies are valid as with a longer one; max_text_chars 1000: a long random text is a few segments (longer ones
    # are a 422 naming the field), not hundreds
    with live_server(checkpoint_factory, tmp_path_factory.mktemp("svc-fuzz"), voice_store="memory",
                     serverpool_max_model_len=64, serverpool_max_num_batched_tokens=2048,
                     max_request_bytes=256 * 1024, max_text_chars=1000) as s:
        yield s


def field_named(status: int, body: object, path: str) -> bool:
    """Whether an error body names the field (or the part of the request) it concerns."""
    if not isinstance(body, dict):
        return False
    if path.startswith("/v1/"):
        err = body.get("error") or {}
        return bool(err.get("param")) or bool(NAMES_A_FIELD.match(str(err.get("message", ""))))
    detail = body.get("detail")
    if isinstance(detail, list):  # validation errors: each one names its field
        return bool(detail) and all(len(e.get("loc", ())) >= 1 and e.get("msg") for e in detail)
    return bool(NAMES_A_FIELD.match(str(detail)))


def operations(server) -> list:
    schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
    return [result.ok() for result in schema.get_all_operations()]


@pytest.mark.parametrize("mode", list(GenerationMode), ids=lambda m: m.value)
def test_no_server_errors_and_4xx_name_the_field(server, mode):
    """Per route, bodies valid by the schema (positive) and bodies breaking it (negative)."""
    failures: list[str] = []
    calls: list[int] = []

    for op in operations(server):
        @given(case=op.as_strategy(generation_mode=mode))
        @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        def call(case) -> None:
            response = case.call(base_url=server.url, timeout=120)
            calls.append(response.status_code)
            if response.status_code >= 500:
                failures.append(f"{case.method} {case.path} -> {response.status_code}: {response.text[:300]}")
            elif response.status_code >= 400:
                body = response.json()
                if not field_named(response.status_code, body, case.path):
                    failures.append(f"{case.method} {case.path} -> {response.status_code} without the field "
                                    f"named: {body}")

        try:
            call()
        except Unsatisfiable:  # nothing to break in a route without parameters or body (GET /health)
            assert mode is GenerationMode.NEGATIVE
    print(f"fuzz ({mode.value}): {len(calls)} requests, statuses {sorted(Counter(calls).items())}")
    assert calls and not failures, "\n".join(failures[:20])
