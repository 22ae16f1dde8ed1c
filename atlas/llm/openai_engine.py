"""Engine for any OpenAI-compatible chat-completions server (vllm serve, SGLang, llama.cpp server, Ollama, TGI).

Each request is one ``POST {base_url}/chat/completions`` with a ``json_schema`` response format, so the
server constrains decoding to the answer schema. The engine only moves text: it retries what the
transport got wrong (HTTP 429/5xx, timeouts, lost connections, a 200 without a usable body) and
returns whatever answer the model gave, leaving parsing and validation to the caller.

Requests go through a stream (``stream()``): ``llm.max_concurrency`` workers on an event loop in a helper thread,
each taking the next submitted request as soon as its previous one is answered. So the server always has
``max_concurrency`` requests of this stream to work on, and a slow one holds only its own slot: there is no batch
to wait for. Before each attempt a request waits for a pause the server asked for (``Retry-After`` on HTTP 429 or
503, seconds or an HTTP date, at most ``llm.retry_after_max_s``; it pauses every worker of the stream) and for the
optional rate limits (``llm.requests_per_minute``, ``llm.tokens_per_minute``: token buckets). Other transient
failures wait ``backoff_s * 2**retry`` with jitter, holding their slot. ``generate`` is one stream for one batch.

The API key is read from the environment variable named by ``config.api_key_env`` and only ever
placed in the ``Authorization`` header: never in logs, errors, results or ``identity()``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import random
import threading
import time
from collections import Counter
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime

import httpx

from atlas.llm.engine import LLMEngine, LLMRequest, LLMResult, RequestStream, strip_extensions

log = logging.getLogger("atlas.llm.openai")


class _Retry(Exception):
    """A transport failure worth another attempt; ``error`` is what the result says if none succeeds, ``wait`` the
    seconds the server asked for in ``Retry-After`` (None: it did not say)."""

    def __init__(self, error: str, wait: float | None = None):
        super().__init__(error)
        self.error, self.wait = error, wait


def retry_after_seconds(value: str | None) -> float | None:
    """The wait a ``Retry-After`` header asks for (delay-seconds or an HTTP date); None when absent or unreadable."""
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    when = when if when.tzinfo else when.replace(tzinfo=UTC)
    return max(0.0, (when - datetime.now(UTC)).total_seconds())


class TokenBucket:
    """At most ``per_minute`` units a minute, in bursts of at most one second's worth (or one unit).

    ``take`` waits until the bucket holds the amount (or is full, for an amount larger than the bucket) and takes
    it, going into debt if needed, so the long-run rate is exact; ``refund`` settles an estimate afterwards. For
    one event loop: nothing awaits between the check and the take.
    """

    def __init__(self, per_minute: float):
        self.rate = per_minute / 60
        self.size = max(self.rate, 1.0)
        self.level, self.filled_at = self.size, time.monotonic()

    def _fill(self) -> None:
        now = time.monotonic()
        self.level = min(self.size, self.level + (now - self.filled_at) * self.rate)
        self.filled_at = now

    async def take(self, amount: float) -> None:
        need = min(amount, self.size)
        self._fill()
        while self.level < need:
            await asyncio.sleep((need - self.level) / self.rate)
            self._fill()
        self.level -= amount

    def refund(self, amount: float) -> None:
        self._fill()
        self.level = min(self.size, self.level + amount)


class _Pacer:
    """What every attempt of a stream waits for before it is sent: a pause the server asked for, the rate limits."""

    def __init__(self, config):
        self.resume_at = 0.0  # time.monotonic() before which nothing is sent
        self.requests = TokenBucket(config.requests_per_minute) if config.requests_per_minute else None
        self.tokens = TokenBucket(config.tokens_per_minute) if config.tokens_per_minute else None

    async def wait(self, tokens: int) -> None:
        while (pause := self.resume_at - time.monotonic()) > 0:
            await asyncio.sleep(pause)
        if self.requests:
            await self.requests.take(1)
        if self.tokens:
            await self.tokens.take(tokens)

    def used(self, estimate: int, result: LLMResult) -> None:
        """Settle a token estimate with the usage the server reported (if it did)."""
        if self.tokens and result.tokens_in + result.tokens_out:
            self.tokens.refund(estimate - result.tokens_in - result.tokens_out)


class OpenAIEngine(LLMEngine):
    name = "openai"

    _headers: dict[str, str] | None = None

    def setup(self) -> None:
        """Read the API key; nothing else is opened here (each stream gets its own client and event loop)."""
        headers = {"Content-Type": "application/json"}
        key = os.environ.get(self.config.api_key_env) if self.config.api_key_env else None
        if key:
            headers["Authorization"] = f"Bearer {key}"
        self._headers = headers

    def stream(self, batch_size: int = 256) -> RequestStream:
        """A stream with ``max_concurrency`` requests in flight (``batch_size`` is for batch engines)."""
        if self._headers is None:
            self.setup()
        return _Stream(self)

    def generate(self, requests: list[LLMRequest]) -> list[LLMResult]:
        """One result per request, in order; safe to call from any thread, with or without a running loop."""
        if not requests:
            return []
        keys = [r.key for r in requests]
        if len(set(keys)) != len(keys):
            raise ValueError("the keys of the requests of one batch must be unique")
        results = {}
        with self.stream() as stream:
            for r in requests:
                stream.submit(r)
            for _ in requests:
                result = stream.next_result()
                results[result.key] = result
        return [results[key] for key in keys]

    def _client(self) -> httpx.AsyncClient:
        c = self.config
        limits = httpx.Limits(max_connections=c.max_concurrency, max_keepalive_connections=c.max_concurrency)
        return httpx.AsyncClient(base_url=c.base_url.rstrip("/"), headers=self._headers,
                                 timeout=httpx.Timeout(c.timeout_s), limits=limits)

    def _body(self, request: LLMRequest) -> dict:
        c = self.config
        schema = {"name": request.schema_name, "schema": strip_extensions(request.schema), "strict": True}
        return {
            "model": c.model,
            "messages": [{"role": "system", "content": request.system}, {"role": "user", "content": request.user}],
            "temperature": c.temperature,
            "top_p": c.top_p,
            "max_tokens": c.max_tokens,
            "seed": c.seed,
            "response_format": {"type": "json_schema", "json_schema": schema},
        }

    async def _one(self, client: httpx.AsyncClient, pacer: _Pacer, counters: Counter,
                   request: LLMRequest) -> LLMResult:
        """Up to ``max_retries + 1`` attempts. The slot is held while waiting, which eases an overloaded server."""
        c = self.config
        body = self._body(request)
        tokens = (len(request.system) + len(request.user)) // 4 + c.max_tokens  # an estimate, settled on the answer
        for attempt in range(c.max_retries + 1):
            await pacer.wait(tokens)
            try:
                result = await self._attempt(client, request.key, body)
            except _Retry as failure:
                error, wait = failure.error, failure.wait
            else:
                pacer.used(tokens, result)
                return result
            if attempt == c.max_retries:
                break
            counters[f"transport_retries.{error}"] += 1
            if wait is None:
                wait = c.backoff_s * 2**attempt * random.uniform(1.0, 1.1)  # jitter de-synchronises retries
            else:  # the server said how long: no request of this stream goes before then
                wait = min(wait, c.retry_after_max_s)
                pacer.resume_at = max(pacer.resume_at, time.monotonic() + wait)
                counters["retry_after_waits"] += 1
            log.warning("openai: %s for request %s (attempt %d of %d), retrying in %.2f s",
                        error, request.key, attempt + 1, c.max_retries + 1, wait)
            await asyncio.sleep(wait)
        log.warning("openai: %s for request %s, giving up after %d attempts", error, request.key, c.max_retries + 1)
        return LLMResult(request.key, error=error)

    async def _attempt(self, client: httpx.AsyncClient, key: str, body: dict) -> LLMResult:
        """One POST. Raises ``_Retry`` for transient failures; other HTTP errors come back as results."""
        try:
            async with asyncio.timeout(self.config.timeout_s):  # a total deadline; httpx's is per read
                response = await client.post("/chat/completions", json=body)
        except (TimeoutError, httpx.TimeoutException):
            raise _Retry("timeout") from None
        except httpx.HTTPError:  # refused, reset, protocol errors; exception texts are not kept
            raise _Retry("connection") from None
        if response.status_code == 429 or response.status_code >= 500:
            asked = response.headers.get("retry-after") if response.status_code in (429, 503) else None
            raise _Retry(f"http_{response.status_code}", retry_after_seconds(asked))
        if not response.is_success:
            return LLMResult(key, error=f"http_{response.status_code}")
        try:
            data = response.json()
            choice = data["choices"][0]
            text = choice["message"]["content"]
            finish_reason = choice.get("finish_reason")
            usage = data.get("usage") or {}
            tokens_in, tokens_out = int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0)
        except (ValueError, KeyError, IndexError, TypeError, AttributeError):
            raise _Retry("bad_response") from None
        # A null content (e.g. a reasoning model that spent max_tokens thinking) is an empty answer, not a
        # transport failure: the caller's checks reject it like any other unusable text.
        return LLMResult(key, text=text if isinstance(text, str) else "", finish_reason=finish_reason,
                         tokens_in=tokens_in, tokens_out=tokens_out)


class _Stream(RequestStream):
    """``max_concurrency`` workers on an event loop in a helper thread, which keeps answers and requests moving while
    the caller checks answers or writes them to the cache; results come back through a thread-safe queue in the order
    they finish. The httpx client lives and dies with the loop (connections cannot cross loops)."""

    def __init__(self, engine: OpenAIEngine):
        self.engine = engine
        self.window = 2 * engine.config.max_concurrency  # a queue as deep again, so no worker waits for the caller
        self.counters: Counter = Counter()
        self._inbox: asyncio.Queue[LLMRequest] = asyncio.Queue()
        self._stop = asyncio.Event()
        self._results: queue.SimpleQueue[LLMResult | BaseException] = queue.SimpleQueue()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_until_complete, args=(self._serve(),),
                                        name="atlas-openai-stream", daemon=True)
        self._thread.start()

    def submit(self, request: LLMRequest) -> None:
        self._loop.call_soon_threadsafe(self._inbox.put_nowait, request)

    def next_result(self) -> LLMResult:
        result = self._results.get()
        if isinstance(result, BaseException):
            raise result
        return result

    def close(self) -> None:
        """Stop the workers (requests still in flight are dropped), close the client, end the thread."""
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
            self._thread.join()
        self._loop.close()

    async def _serve(self) -> None:
        try:
            async with self.engine._client() as client:
                pacer = _Pacer(self.engine.config)
                workers = [asyncio.create_task(self._work(client, pacer))
                           for _ in range(self.engine.config.max_concurrency)]
                await self._stop.wait()
                for worker in workers:
                    worker.cancel()
                await asyncio.gather(*workers, return_exceptions=True)
        except Exception as e:  # noqa: BLE001 -- the caller waiting in next_result sees it, rather than hanging
            self._results.put(e)

    async def _work(self, client: httpx.AsyncClient, pacer: _Pacer) -> None:
        while True:
            request = await self._inbox.get()
            try:
                self._results.put(await self.engine._one(client, pacer, self.counters, request))
            except Exception as e:  # noqa: BLE001 -- a bug rather than a transport failure: hand it to the caller
                self._results.put(e)
