"""Ask an engine about many items, check every answer, ask again where the check says so.

The one ask / check / retry loop of the LLM steps that validate their answers (tagging, auxiliary labels). It keeps
``stream.window`` requests submitted across all the items at once (a batch for the offline and vLLM engines, twice
``llm.max_concurrency`` for a server), so there is no barrier: a slow request holds only its own slot, and the retry
of an item is submitted as soon as its answer fails the check, while other requests are still in flight.

Every request goes through the request cache first; every answer from the engine is written to it as it arrives,
so a killed shard asks again only for the requests that were in flight.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable

from atlas.llm.cache import RequestCache
from atlas.llm.engine import LLMEngine, LLMRequest, LLMResult


def ask_until_done(engine: LLMEngine, cache: RequestCache | None, count: int,
                   request: Callable[[int, int, str | None], LLMRequest],
                   check: Callable[[int, int, LLMResult], str | None], batch_size: int = 256) -> Counter:
    """Ask for items ``0 .. count - 1`` until ``check`` is satisfied with each.

    ``request(i, attempt, note)`` builds the request of item ``i`` at attempt 1, 2, ... (``note``: what was wrong
    with the previous answer, None at attempt 1); its key must be unique among the requests in flight.
    ``check(i, attempt, result)`` returns None when item ``i`` is done (a good answer, or the caller gives up on
    it), else the note for the next attempt: the caller decides when to stop. ``batch_size`` is for batch engines.

    Returns counters: ``cache_hits`` and the engine's transport counters (retries, Retry-After waits).
    """
    counters = Counter(cache_hits=0)
    cached: deque[LLMResult] = deque()  # answers from the cache, checked before waiting on the engine
    waiting: dict[str, tuple[int, int, LLMRequest]] = {}  # request key -> (item, attempt, request), not yet checked
    with engine.stream(batch_size) as stream:

        def ask(i: int, attempt: int, note: str | None) -> None:
            r = request(i, attempt, note)
            waiting[r.key] = (i, attempt, r)
            answer = cache.get(r) if cache is not None else None
            if answer is not None:
                counters["cache_hits"] += 1
                cached.append(answer)
            else:
                stream.submit(r)

        next_item = 0
        while next_item < count or waiting:
            while next_item < count and len(waiting) < stream.window:
                ask(next_item, 1, None)
                next_item += 1
            if cached:
                result = cached.popleft()
            else:
                result = stream.next_result()
                if cache is not None:
                    cache.put(waiting[result.key][2], result)
            i, attempt, _ = waiting.pop(result.key)
            note = check(i, attempt, result)
            if note is not None:
                ask(i, attempt + 1, note)
        counters.update(stream.counters)
    return counters
