"""Engine for any OpenAI-compatible chat-completions server (vllm serve, SGLang, llama.cpp server, Ollama, TGI).

Each request is one ``POST {base_url}/chat/completions`` with a ``json_schema`` response format, so the
server constrains decoding to the answer schema. The engine only moves text: it retries what the
transport got wrong (HTTP 429/5xx, timeouts, lost connections, a 200 without a usable body) and
returns whatever answer the model gave, leaving parsing and validation to the caller.

The API key is read from the environment variable named by ``config.api_key_env`` and only ever
placed in the ``Authorization`` header: never in logs, errors, results or ``identity()``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import random

import httpx

from atlas.llm.engine import LLMEngine, LLMRequest, LLMResult, strip_extensions

log = logging.getLogger("atlas.llm.openai")

class _Retry(Exception):
    """A transport failure worth another attempt; ``error`` is what the result says if none succeeds."""

    def __init__(self, error: str):
        super().__init__(error)
        self.error = error


class OpenAIEngine(LLMEngine):
    name = "openai"

    _headers: dict[str, str] | None = None

    def setup(self) -> None:
        """Read the API key; nothing else is opened here (each batch gets its own client and event loop)."""
        headers = {"Content-Type": "application/json"}
        key = os.environ.get(self.config.api_key_env) if self.config.api_key_env else None
        if key:
            headers["Authorization"] = f"Bearer {key}"
        self._headers = headers

    def generate(self, requests: list[LLMRequest]) -> list[LLMResult]:
        """One result per request, in order; safe to call from any thread, with or without a running loop."""
        if not requests:
            return []
        if self._headers is None:
            self.setup()
        try:
            asyncio.get_running_loop()
        except RuntimeError:  # the usual case: no loop in this thread
            return asyncio.run(self._generate(requests))
        # Called from inside a running event loop (a notebook, an async task): that loop cannot be
        # re-entered, so the batch runs on its own loop in a helper thread.
        with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
            return pool.submit(asyncio.run, self._generate(requests)).result()

    async def _generate(self, requests: list[LLMRequest]) -> list[LLMResult]:
        # The client lives and dies with the loop of this batch: httpx connections cannot cross loops.
        c = self.config
        limits = httpx.Limits(max_connections=c.max_concurrency, max_keepalive_connections=c.max_concurrency)
        semaphore = asyncio.Semaphore(c.max_concurrency)
        async with httpx.AsyncClient(base_url=c.base_url.rstrip("/"), headers=self._headers,
                                     timeout=httpx.Timeout(c.timeout_s), limits=limits) as client:
            return list(await asyncio.gather(*(self._one(client, semaphore, r) for r in requests)))

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

    async def _one(self, client: httpx.AsyncClient, semaphore: asyncio.Semaphore, request: LLMRequest) -> LLMResult:
        """Up to ``max_retries + 1`` attempts; the slot is held while backing off, which eases an overloaded server."""
        c = self.config
        body = self._body(request)
        async with semaphore:
            for attempt in range(c.max_retries + 1):
                try:
                    return await self._attempt(client, request.key, body)
                except _Retry as failure:
                    error = failure.error
                if attempt == c.max_retries:
                    break
                delay = c.backoff_s * 2**attempt * random.uniform(1.0, 1.1)  # jitter de-synchronises retries
                log.warning("openai: %s for request %s (attempt %d of %d), retrying in %.2f s",
                            error, request.key, attempt + 1, c.max_retries + 1, delay)
                await asyncio.sleep(delay)
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
            raise _Retry(f"http_{response.status_code}")
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
