"""OpenAIEngine against a real local HTTP server that injects faults (tests/fault_server.py)."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
import time

import jsonschema
import pytest
from fault_server import FaultServer, prompt_words

from atlas.config import LLMConfig
from atlas.llm.engine import LLMRequest, make_engine, strip_extensions
from atlas.llm.openai_engine import OpenAIEngine

SCHEMA = {
    "type": "object",
    "x-atlas-version": 2,
    "properties": {
        "tags": {"type": "array", "items": {"type": "string", "x-atlas-normalize": "lower"},
                 "minItems": 1, "maxItems": 5, "x-atlas-role": "concepts"},
        "topic": {"type": "string"},
        "quality": {"type": "integer", "minimum": 1, "maximum": 5},
    },
    "required": ["tags", "topic", "quality"],
    "additionalProperties": False,
}
SECRET = "sk-test-0123456789-do-not-leak"


def config(server: FaultServer | None = None, **overrides) -> LLMConfig:
    """Fast settings: sub-second timeouts and 10 ms backoff keep every fault test short."""
    values = {"engine": "openai", "model": "test-model", "base_url": server.base_url if server else "",
              "api_key_env": "ATLAS_TEST_OPENAI_KEY", "timeout_s": 0.5, "max_retries": 2, "backoff_s": 0.01,
              "max_concurrency": 4}
    return LLMConfig(**(values | overrides))


def requests(n: int, prefix: str = "req") -> list[LLMRequest]:
    """Requests whose prompts have distinct words, so each answer can be traced back to its request."""
    return [LLMRequest(key=f"{prefix}{i}", system="Tag the text with concepts.",
                       user=f"Text {i}: river{chr(97 + i % 26)} bridge{i} granite{i} harbor",
                       schema=SCHEMA, schema_name="tags") for i in range(n)]


def generate(cfg: LLMConfig, reqs: list[LLMRequest]):
    engine = make_engine(cfg)
    engine.setup()
    try:
        return engine.generate(reqs)
    finally:
        engine.close()


@pytest.fixture(autouse=True)
def no_key(monkeypatch):
    monkeypatch.delenv("ATLAS_TEST_OPENAI_KEY", raising=False)


def test_ok_answers_follow_the_schema_and_the_request():
    reqs = requests(3)
    with FaultServer() as server:
        results = generate(config(server), reqs)
    assert isinstance(make_engine(config(server)), OpenAIEngine)
    for request, result in zip(reqs, results, strict=True):
        assert result.key == request.key and result.error is None and result.finish_reason == "stop"
        answer = json.loads(result.text)
        jsonschema.validate(answer, SCHEMA)
        assert 2 <= len(answer["tags"]) <= 4 and set(answer["tags"]) <= set(prompt_words(request.user))
        assert result.tokens_in > 0 and result.tokens_out > 0
    assert server.served == ["ok"] * 3


def test_request_body_strips_extension_keys():
    with FaultServer() as server:
        generate(config(server, temperature=0.3, top_p=0.9, max_tokens=77, seed=5), requests(1))
    body = server.requests[0]
    assert body["model"] == "test-model"
    assert (body["temperature"], body["top_p"], body["max_tokens"], body["seed"]) == (0.3, 0.9, 77, 5)
    assert [m["role"] for m in body["messages"]] == ["system", "user"]
    sent = body["response_format"]
    assert sent["type"] == "json_schema"
    assert sent["json_schema"]["name"] == "tags" and sent["json_schema"]["strict"] is True
    assert "x-atlas" not in json.dumps(sent) and "x-atlas" in json.dumps(SCHEMA)  # the caller's schema is intact
    assert sent["json_schema"]["schema"]["properties"]["tags"] == {
        "type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 5}


def test_strip_extensions_keeps_property_names():
    schema = {"x-note": 1, "properties": {"x-ray": {"type": "string", "x-hint": "a"}}, "anyOf": [{"x-y": 2}]}
    assert strip_extensions(schema) == {"properties": {"x-ray": {"type": "string"}}, "anyOf": [{}]}


def test_api_key_is_sent_but_never_shown(monkeypatch, caplog):
    monkeypatch.setenv("ATLAS_TEST_OPENAI_KEY", SECRET)
    engine = make_engine(config())
    with caplog.at_level(logging.WARNING, logger="atlas.llm.openai"):
        with FaultServer(mode="http_500", fail_attempts=1) as server:  # one retry, so something is logged
            engine.config.base_url = server.base_url
            engine.setup()
            results = engine.generate(requests(1))
    assert server.headers[0]["authorization"] == f"Bearer {SECRET}"
    assert results[0].error is None and caplog.records
    assert SECRET not in caplog.text + repr(results) + json.dumps(engine.identity()) + repr(engine.config)


def test_no_authorization_header_without_a_key():
    with FaultServer() as server:
        generate(config(server), requests(1))
    assert "authorization" not in server.headers[0]


def test_results_keep_request_order_under_concurrency():
    reqs = requests(12)
    with FaultServer(mode="slow", slow_s=0.15) as server:
        start = time.monotonic()
        results = generate(config(server, max_concurrency=4), reqs)
        elapsed = time.monotonic() - start
    assert [r.key for r in results] == [r.key for r in reqs]
    for request, result in zip(reqs, results, strict=True):
        assert set(json.loads(result.text)["tags"]) <= set(prompt_words(request.user))
    assert server.max_in_flight == 4  # bounded by max_concurrency, and really concurrent
    assert elapsed < 12 * 0.15


def test_generate_works_from_a_thread_and_inside_a_running_loop():
    with FaultServer() as server:
        cfg = config(server)
        box = []
        thread = threading.Thread(target=lambda: box.append(generate(cfg, requests(2))))
        thread.start()
        thread.join()

        async def inside_loop():
            return generate(cfg, requests(2, prefix="loop"))

        in_loop = asyncio.run(inside_loop())
    assert [r.error for r in box[0] + in_loop] == [None] * 4


@pytest.mark.parametrize("fault", ["http_500", "http_429", "timeout"])
def test_transient_faults_are_retried_into_successes(fault):
    reqs = requests(3)
    with FaultServer(mode=fault, fail_attempts=2, hang_s=2) as server:
        results = generate(config(server, max_retries=2), reqs)
    assert [r.error for r in results] == [None] * 3
    assert all(json.loads(r.text)["tags"] for r in results)
    assert server.served.count(fault) == 6 and server.served.count("ok") == 3  # two failures, then ok, each


@pytest.mark.parametrize("fault", ["http_500", "timeout", "bad_body"])
def test_persistent_faults_give_an_error_after_all_attempts(fault):
    with FaultServer(mode=fault, hang_s=2) as server:
        # only the timeout fault needs the short deadline: on a loaded machine a 0.5 s deadline can also expire
        # before a quick fault's answer, and that attempt then ends as a timeout
        results = generate(config(server, max_retries=2, timeout_s=0.5 if fault == "timeout" else 5), requests(2))
    expected = {"bad_body": "bad_response"}.get(fault, fault)
    assert [(r.error, r.text) for r in results] == [(expected, None)] * 2
    assert len(server.requests) == 2 * 3  # max_retries + 1 attempts each


def test_client_errors_are_not_retried():
    with FaultServer(mode="http_400") as server:
        results = generate(config(server, max_retries=3), requests(2))
    assert [r.error for r in results] == ["http_400"] * 2
    assert len(server.requests) == 2


@pytest.mark.parametrize("fault, finish_reason", [
    ("invalid_json", "stop"), ("truncated", "length"), ("missing_field", "stop"), ("extra_field", "stop")])
def test_bad_content_is_returned_raw(fault, finish_reason):
    with FaultServer(mode=fault) as server:
        [result] = generate(config(server), requests(1))
    assert result.error is None and result.finish_reason == finish_reason and result.text
    assert len(server.requests) == 1  # the engine does not judge content, so it does not retry
    if fault in ("invalid_json", "truncated"):
        with pytest.raises(json.JSONDecodeError):
            json.loads(result.text)
    else:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(json.loads(result.text), SCHEMA)


def test_dead_port_gives_connection_error():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = generate(config(base_url=f"http://127.0.0.1:{port}/v1", max_retries=1), requests(2))
    assert [r.error for r in results] == ["connection"] * 2


def test_mixed_faults_give_exactly_one_result_per_request():
    reqs = requests(100)
    with FaultServer(mode="mixed", fault_rate=0.3, seed=7, slow_s=0.05, hang_s=2) as server:
        results = generate(config(server, max_concurrency=16, max_retries=3), reqs)
    assert [r.key for r in results] == [r.key for r in reqs]
    assert {r.error for r in results} <= {None, "http_500", "http_429", "timeout"}
    assert all((r.text is None) == (r.error is not None) for r in results)
    assert len(server.requests) > 100  # transient faults were retried
    assert {"http_500", "http_429", "timeout", "truncated"} <= set(server.served)
    # content faults reach the caller as text: the engine does not retry them
    assert sum(r.finish_reason == "length" for r in results) == server.served.count("truncated")


def test_fault_decisions_are_deterministic():
    def served(**kwargs):
        with FaultServer(mode="mixed", fault_rate=0.5, seed=3, **kwargs) as server:
            # no fault here waits: a 0.5 s deadline only expires on a loaded machine, and a request the client gave
            # up on before the server logged it made the two runs differ (seen once in the full suite)
            generate(config(server, max_retries=0, max_concurrency=8, timeout_s=5), requests(40))
        return sorted(zip((r["messages"][1]["content"] for r in server.requests), server.served))

    assert served(faults=("http_500", "invalid_json")) == served(faults=("http_500", "invalid_json"))
