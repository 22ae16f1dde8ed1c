"""The LLM client at cluster speed, against a real loopback server (tests/fault_server.py): the rolling window of
``llm.max_concurrency`` requests across a whole shard, Retry-After, rate limits, and the request cache that a killed
shard resumes from (a JSON Lines file, safe on NFS)."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from email.utils import formatdate
from pathlib import Path

import pytest
from fault_server import FaultServer

from atlas.config import LLMConfig
from atlas.llm.ask import ask_until_done
from atlas.llm.cache import RequestCache
from atlas.llm.engine import LLMEngine, LLMRequest, LLMResult, make_engine
from atlas.llm.openai_engine import retry_after_seconds

SCHEMA = {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string"}}},
          "required": ["tags"]}
REPO = Path(__file__).resolve().parent.parent


def engine(server: FaultServer, **overrides) -> LLMEngine:
    values = {"engine": "openai", "model": "m", "base_url": server.base_url, "api_key_env": "ATLAS_TEST_NO_KEY",
              "timeout_s": 5.0, "max_retries": 2, "backoff_s": 0.01, "max_concurrency": 4}
    e = make_engine(LLMConfig(**(values | overrides)))
    e.setup()
    return e


def request(i: int, attempt: int = 1, note: str | None = None) -> LLMRequest:
    user = f"Text {i}: river{i} bridge{i} granite" + (f"\n\nThe last answer was wrong: {note}" if note else "")
    return LLMRequest(key=f"item{i}#{attempt}", system="Tag the text.", user=user, schema=SCHEMA)


def ask(e: LLMEngine, n: int, check=None, cache: RequestCache | None = None):
    """ask_until_done over n items; returns (order in which items were checked, counters, seconds)."""
    order = []

    def record(i, attempt, result):
        assert result.error is None, result.error
        order.append((i, attempt))
        return check(i, attempt, result) if check else None

    start = time.monotonic()
    counters = ask_until_done(e, cache, n, request, record)
    return order, counters, time.monotonic() - start


def latency_of(seconds: dict[str, float], default: float):
    """A latency function: ``seconds[word]`` when the word is in the user message, else ``default``."""
    def latency(body):
        user = body["messages"][-1]["content"]
        return next((s for word, s in seconds.items() if word in user.split()), default)
    return latency


# -- the window -------------------------------------------------------------------------------------------------


def test_the_window_keeps_max_concurrency_requests_in_flight_across_the_shard():
    n, c, latency = 40, 4, 0.2
    with FaultServer(latency=lambda body: latency) as server:
        order, counters, elapsed = ask(engine(server, max_concurrency=c), n)
    assert sorted(order) == [(i, 1) for i in range(n)] and len(server.requests) == n
    assert server.max_in_flight == c
    # C in flight all the time takes n * latency / C (2 s); one at a time takes n * latency (8 s). The bound between
    # them is loose on purpose: a loaded CI machine adds client time between answers, but never halves the overlap
    # (a tighter bound, 1.5x the ideal, failed once at 2.15 s against 2.1). That the window refills slot by slot,
    # not batch by batch, the next test reads from the order of the answers.
    assert n * latency / c <= elapsed < n * latency / 2, elapsed


def test_a_slow_request_holds_only_its_own_slot():
    n, slow = 41, 2.0
    with FaultServer(latency=latency_of({"river0": slow}, 0.05)) as server:
        order, _, elapsed = ask(engine(server, max_concurrency=4), n)
    assert order[-1] == (0, 1)  # asked first, answered last: the 40 others went by on the 3 other slots
    assert slow <= elapsed < slow + 1.0, elapsed


def test_a_retry_joins_the_window_while_other_requests_are_in_flight():
    """Item 0's first answer fails the check; its second attempt goes out long before the shard's last first attempt
    (a batch barrier would send it only after every first attempt of the batch was answered)."""
    n = 40
    with FaultServer(latency=lambda body: 0.05) as server:
        order, _, _ = ask(engine(server, max_concurrency=4), n,
                          check=lambda i, attempt, result: "too few tags" if (i, attempt) == (0, 1) else None)
        users = [body["messages"][-1]["content"] for body in server.requests]
    assert (0, 2) in order and len(users) == n + 1
    retry = next(k for k, u in enumerate(users) if "The last answer was wrong" in u)
    last_first_attempt = max(k for k, u in enumerate(users) if "wrong" not in u)
    assert retry < n // 2 < last_first_attempt


class RecordingBatchEngine(LLMEngine):
    """A batch engine (the default stream: batches through generate), answering every request at once."""

    name = "recording"

    def __init__(self):
        super().__init__(LLMConfig())
        self.batches: list[list[str]] = []

    def generate(self, requests):
        self.batches.append([r.key for r in requests])
        return [LLMResult(r.key, text='{"tags": ["a"]}', finish_reason="stop") for r in requests]


def test_batch_engines_get_full_batches_with_retries_joining_the_next_one():
    e = RecordingBatchEngine()
    counters = ask_until_done(e, None, 10, request, lambda i, attempt, r: "again" if attempt == 1 and i < 2 else None,
                              batch_size=4)
    assert counters == {"cache_hits": 0}
    assert [len(b) for b in e.batches] == [4, 4, 4]  # 10 first attempts + 2 retries, never more than 4 at once
    asked = sorted(k for b in e.batches for k in b)
    assert asked == sorted([f"item{i}#1" for i in range(10)] + ["item0#2", "item1#2"])
    assert e.batches[0] == ["item0#1", "item1#1", "item2#1", "item3#1"]


def test_generate_is_a_stream_of_one_batch_and_keeps_the_order():
    with FaultServer(latency=latency_of({"river0": 0.3}, 0.01)) as server:
        results = engine(server).generate([request(i) for i in range(6)])
    assert [r.key for r in results] == [f"item{i}#1" for i in range(6)]
    with pytest.raises(ValueError, match="unique"):
        engine(server).generate([request(1), request(1)])


# -- Retry-After and rate limits --------------------------------------------------------------------------------


@pytest.mark.parametrize("status, header, low, high", [
    (429, "1", 1.0, 1.5),
    (503, "1", 1.0, 1.5),
    (429, "date", 0.9, 2.5),  # an HTTP date 2 s ahead, to the second
    (429, "30", 0.3, 0.8),  # capped by llm.retry_after_max_s = 0.3
])
def test_retry_after_is_waited(status, header, low, high):
    value = formatdate(time.time() + 2, usegmt=True) if header == "date" else header
    with FaultServer(mode=f"http_{status}", fail_attempts=1, retry_after=value) as server:
        e = engine(server, max_concurrency=2, retry_after_max_s=0.3 if header == "30" else 60)
        order, counters, _ = ask(e, 2)
    assert sorted(order) == [(0, 1), (1, 1)] and server.served.count("ok") == 2
    first, retried = server.arrivals[:2], server.arrivals[2:]
    assert low <= min(retried) - max(first) and max(retried) - min(first) < high
    assert counters["retry_after_waits"] == 2 and counters[f"transport_retries.http_{status}"] == 2


def test_retry_after_header_values():
    assert retry_after_seconds("7") == 7 and retry_after_seconds("0.5") == 0.5 and retry_after_seconds("-3") == 0
    assert retry_after_seconds(None) is None and retry_after_seconds("soon") is None
    assert 28 < retry_after_seconds(formatdate(time.time() + 30, usegmt=True)) <= 30
    assert retry_after_seconds("Wed, 21 Oct 2015 07:28:00 GMT") == 0  # in the past: go now


def test_requests_per_minute_holds():
    rate, n = 10.0, 30  # 600 a minute: a bucket of one second's worth (10), refilled at 10 a second
    with FaultServer() as server:
        _, _, elapsed = ask(engine(server, max_concurrency=8, requests_per_minute=rate * 60), n)
        arrivals = list(server.arrivals)
    assert elapsed >= (n - rate) / rate - 0.1
    for i in range(n):  # in any stretch of time: at most a bucket plus what the rate refills
        for j in range(i, n):
            assert j - i + 1 <= rate + rate * (arrivals[j] - arrivals[i]) + 1, (i, j)


def test_tokens_per_minute_holds():
    rate = 100.0  # tokens a second; a request is charged (prompt chars / 4 + max_tokens) until its usage is known
    results = []
    with FaultServer() as server:
        e = engine(server, max_concurrency=8, max_tokens=10, tokens_per_minute=rate * 60)
        _, _, elapsed = ask(e, 20, check=lambda i, attempt, result: results.append(result))
    used = sum(r.tokens_in + r.tokens_out for r in results)
    assert used > 3 * rate  # the limit has something to hold
    assert elapsed >= (used - rate) / rate - 0.1, (used, elapsed)  # a bucket (one second's worth), then the rate


# -- the request cache: kill, resume, shared file systems -------------------------------------------------------

KILLED_CLIENT = """
import sys
from atlas.config import LLMConfig
from atlas.llm.ask import ask_until_done
from atlas.llm.cache import RequestCache
from atlas.llm.engine import make_engine
from test_llm_client import request
e = make_engine(LLMConfig(engine="openai", model="m", base_url=sys.argv[1], max_concurrency=4, api_key_env="NONE"))
e.setup()
ask_until_done(e, RequestCache(sys.argv[2], e.identity()), int(sys.argv[3]), request, lambda i, a, r: None)
"""


def test_a_killed_shard_resumes_from_the_cache_without_asking_again(tmp_path):
    n, path = 60, tmp_path / "_cache" / "tag" / "00000.jsonl"
    with FaultServer(latency=lambda body: 0.05) as server:
        env = os.environ | {"PYTHONPATH": os.pathsep.join([str(REPO / "tests"), os.environ.get("PYTHONPATH", "")])}
        process = subprocess.Popen([sys.executable, "-c", KILLED_CLIENT, server.base_url, str(path), str(n)], env=env,
                                   start_new_session=True)
        deadline = time.time() + 60
        while time.time() < deadline and len(server.requests) < 25 and process.poll() is None:
            time.sleep(0.01)
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        time.sleep(0.3)  # the server records what reached it just before the kill
        asked_before_kill = len(server.requests)
        assert 25 <= asked_before_kill < n
        e = engine(server)
        cache = RequestCache(path, e.identity())
        order, counters, _ = ask(e, n, cache=cache)
        cache.close()
        asked_after = len(server.requests) - asked_before_kill
    assert sorted(order) == [(i, 1) for i in range(n)]
    # Every answer the killed client had taken was on disk; only those in flight (at most 2 x 4) are asked again.
    assert counters["cache_hits"] >= asked_before_kill - 8 and asked_after == n - counters["cache_hits"]
    assert sorted(p.name for p in path.parent.iterdir()) == ["00000.jsonl"]  # no -wal, -shm or journal beside it
    assert all(json.loads(line)["key"].startswith("item") for line in path.read_text().splitlines())


def test_a_line_cut_short_by_a_crash_is_dropped_and_the_file_stays_appendable(tmp_path):
    path, identity = tmp_path / "c.jsonl", {"engine": "openai", "model": "m"}
    cache = RequestCache(path, identity)
    for i in range(3):
        cache.put(request(i), LLMResult(f"item{i}#1", text=f'{{"tags": ["t{i}"]}}', finish_reason="stop"))
    cache.close()
    with path.open("ab") as f:
        f.write(b'{"key": "item3#1:abc", "text": "{\\"ta')  # the crash
    cache = RequestCache(path, identity)
    assert [cache.get(request(i)).text for i in range(3)] == [f'{{"tags": ["t{i}"]}}' for i in range(3)]
    assert path.read_bytes().endswith(b"\n") and path.read_bytes().count(b"\n") == 3
    cache.put(request(3), LLMResult("item3#1", text='{"tags": []}', finish_reason="length", tokens_out=4))
    cache.close()
    again = RequestCache(path, identity)
    assert again.get(request(3)) == LLMResult("item3#1", text='{"tags": []}', finish_reason="length", tokens_out=4)
    again.close()


def test_answers_of_an_old_sqlite_cache_are_still_used(tmp_path):
    """A shard killed under the SQLite cache of earlier versions resumes with its answers (same keys)."""
    identity = {"engine": "openai", "model": "m"}
    cache = RequestCache(tmp_path / "00000.jsonl", identity)
    db = sqlite3.connect(tmp_path / "00000.sqlite")
    db.execute("CREATE TABLE answers (key TEXT PRIMARY KEY, text TEXT, finish_reason TEXT, tokens_in INTEGER,"
               " tokens_out INTEGER)")
    db.execute("INSERT INTO answers VALUES (?, ?, ?, ?, ?)", (cache._key(request(1)), '{"tags": ["x"]}', "stop", 3, 2))
    db.commit()
    db.close()
    cache.close()
    resumed = RequestCache(tmp_path / "00000.jsonl", identity)
    assert resumed.get(request(1)) == LLMResult("item1#1", '{"tags": ["x"]}', "stop", 3, 2)
    assert resumed.get(request(2)) is None
    resumed.close()
