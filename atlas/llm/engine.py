"""The interface every LLM-backed step talks to, and the factory that picks an engine.

A step builds ``LLMRequest`` objects (a system and a user prompt, plus the JSON schema the answer
must follow) and hands a batch to ``engine.generate``. It gets back one ``LLMResult`` per request,
in the same order: the raw text with its ``finish_reason`` and token counts, or an ``error`` when
the engine could not get an answer at all (after its own transport retries). Engines never raise
for one bad request; parsing, validating, repairing and quarantining answers is the step's job,
so every engine's output goes through the same checks.

A step with many requests opens ``engine.stream()`` instead: it submits requests one by one and
takes results as they finish, so a retry can be submitted while other requests are still being
answered (``atlas.llm.ask`` runs that loop). The default stream hands what was submitted to
``generate`` a batch at a time; the ``openai`` engine keeps ``llm.max_concurrency`` requests in flight.

Engines:

- ``offline`` (``atlas.llm.offline``): no LLM. Real algorithms on a small embedding model
  (keyphrase extraction, similarity to candidate lists); it reads ``request.context``.
- ``openai`` (``atlas.llm.openai_engine``): any OpenAI-compatible server (vllm serve, SGLang,
  llama.cpp server, Ollama, TGI).
- ``vllm`` (``atlas.llm.vllm_engine``): offline batched ``vllm.LLM`` on local GPUs.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import ClassVar

from atlas.config import AtlasConfig, LLMConfig


@dataclass(slots=True)
class LLMRequest:
    key: str  # unique within a batch, e.g. "<chunk_id>#<attempt>"
    system: str
    user: str
    schema: dict  # JSON Schema of the answer, used for constrained decoding
    schema_name: str = "answer"
    context: dict = field(default_factory=dict)  # structured inputs for engines that do not read prompts


@dataclass(slots=True)
class LLMResult:
    key: str
    text: str | None = None  # the raw answer
    finish_reason: str | None = None  # "stop", "length", ...
    tokens_in: int = 0
    tokens_out: int = 0
    error: str | None = None  # e.g. "http_500", "timeout", "connection": no answer after retries


class LLMEngine(ABC):
    name: ClassVar[str]

    def __init__(self, config: LLMConfig):
        self.config = config  # cheap: models, clients and servers are opened in setup()

    def identity(self) -> dict:
        """What determines the answers: part of the stage hash and of the request-cache key."""
        c = self.config
        return {"engine": self.name, "model": c.model, "temperature": c.temperature, "top_p": c.top_p,
                "max_tokens": c.max_tokens, "seed": c.seed}

    def setup(self) -> None:
        """Load the model or open the client; check that constrained decoding really works."""

    @abstractmethod
    def generate(self, requests: list[LLMRequest]) -> list[LLMResult]:
        """One result per request, in the same order."""

    def stream(self, batch_size: int = 256) -> RequestStream:
        """Submit requests one by one, take results as they finish (used as a context manager)."""
        return BatchStream(self, batch_size)

    def close(self) -> None:
        """Release the model, client or event loop."""


class RequestStream:
    """Requests go in one at a time; ``next_result`` gives back the result of one of them as soon as one is finished,
    in any order. A caller keeps about ``window`` requests submitted and not yet taken back, so that the engine
    always has work. ``counters`` holds what the transport went through (retries, waits a server asked for)."""

    window: int
    counters: Counter

    def submit(self, request: LLMRequest) -> None:
        raise NotImplementedError

    def next_result(self) -> LLMResult:
        """The result of a submitted request; blocks until one is finished."""
        raise NotImplementedError

    def close(self) -> None:
        pass

    def __enter__(self) -> RequestStream:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class BatchStream(RequestStream):
    """The stream of an engine that works in batches (offline, vLLM): when a result is wanted and none is ready, the
    requests submitted so far go to ``generate`` together, ``batch_size`` at most."""

    def __init__(self, engine: LLMEngine, batch_size: int):
        self.engine, self.window, self.counters = engine, batch_size, Counter()
        self._submitted: deque[LLMRequest] = deque()
        self._ready: deque[LLMResult] = deque()

    def submit(self, request: LLMRequest) -> None:
        self._submitted.append(request)

    def next_result(self) -> LLMResult:
        if not self._ready:
            if not self._submitted:
                raise RuntimeError("next_result() with no request submitted")
            batch = [self._submitted.popleft() for _ in range(min(self.window, len(self._submitted)))]
            self._ready.extend(self.engine.generate(batch))
        return self._ready.popleft()


# JSON Schema keywords whose keys are names chosen by the schema's author, not keywords.
_NAME_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})


def strip_extensions(schema, _names: bool = False):
    """A copy of ``schema`` without ``x-...`` keys (the project's annotations), which servers must not see.

    Keys of name maps such as ``properties`` are property names, not keywords, so they are kept.
    """
    if isinstance(schema, list):
        return [strip_extensions(v) for v in schema]
    if not isinstance(schema, dict):
        return schema
    return {k: strip_extensions(v, _names=k in _NAME_MAPS and not _names) for k, v in schema.items()
            if _names or not (isinstance(k, str) and k.startswith("x-"))}


ENGINES = {
    "offline": "atlas.llm.offline:OfflineEngine",
    "openai": "atlas.llm.openai_engine:OpenAIEngine",
    "vllm": "atlas.llm.vllm_engine:VLLMEngine",
}


def make_engine(config: LLMConfig, **options) -> LLMEngine:
    """The engine named in ``config.engine``, imported lazily (vllm is only needed where it runs)."""
    module_name, _, class_name = ENGINES[config.engine].partition(":")
    return getattr(importlib.import_module(module_name), class_name)(config, **options)


def make_tag_engine(config: AtlasConfig) -> LLMEngine:
    """The engine of the tag stage, also used to judge relevance and to give auxiliary labels: the offline
    engine embeds with ``tag.embedding_model``."""
    if config.llm.engine == "offline":
        return make_engine(config.llm, embedding_model=config.tag.embedding_model)
    return make_engine(config.llm)


def setup_engine(config: LLMConfig) -> LLMEngine | None:
    """The configured engine, set up (loaded, connected), for a stage's ``setup``; None for the offline engine,
    whose stages compute their offline answer themselves (cohesion, medoid labels)."""
    if config.engine == "offline":
        return None
    engine = make_engine(config)
    engine.setup()
    return engine
