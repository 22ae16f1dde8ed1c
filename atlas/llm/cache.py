"""A request cache in SQLite, so that a killed shard resumes without redoing finished requests.

An answer is stored under the request's key (chunk id and attempt) plus a hash of everything the
engine sees (system and user prompt, schema, structured context) and the engine's identity
(engine, model, sampling). Change the chunk text, the prompt, the schema, the model or the
sampling and the old answer is simply not found. One file per shard, written only by the worker
running that shard, so there is no locking between workers.
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

from atlas.core.files import sha256_bytes, stable_hash
from atlas.llm.engine import LLMRequest, LLMResult


class RequestCache:
    def __init__(self, path: str | Path, engine_identity: dict):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.engine = stable_hash(engine_identity)
        self.db = sqlite3.connect(self.path)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute(
            "CREATE TABLE IF NOT EXISTS answers (key TEXT PRIMARY KEY, text TEXT, finish_reason TEXT,"
            " tokens_in INTEGER, tokens_out INTEGER)"
        )

    def _key(self, request: LLMRequest) -> str:
        seen = json.dumps([request.system, request.user, request.schema, request.context], sort_keys=True)
        return f"{request.key}:{sha256_bytes(seen.encode())[:24]}:{self.engine[:24]}"

    def get_many(self, requests: list[LLMRequest]) -> dict[str, LLMResult]:
        """Cached answers by request key."""
        found = {}
        for request in requests:
            row = self.db.execute("SELECT text, finish_reason, tokens_in, tokens_out FROM answers WHERE key = ?",
                                  (self._key(request),)).fetchone()
            if row:
                found[request.key] = LLMResult(request.key, *row)
        return found

    def put_many(self, requests: list[LLMRequest], results: list[LLMResult]) -> None:
        """Store answers (not transport errors: those are worth asking again after a restart)."""
        rows = [(self._key(q), r.text, r.finish_reason, r.tokens_in, r.tokens_out)
                for q, r in zip(requests, results) if r.error is None]
        with self.db:
            self.db.executemany("INSERT OR REPLACE INTO answers VALUES (?, ?, ?, ?, ?)", rows)

    def close(self) -> None:
        self.db.close()


def ask_cached(engine, cache: RequestCache, requests: list[LLMRequest]) -> tuple[list[LLMResult], int]:
    """Answers in request order: from the cache where present, else from the engine (then cached).
    Returns (results, how many came from the cache)."""
    cached = cache.get_many(requests)
    missing = [r for r in requests if r.key not in cached]
    fresh = engine.generate(missing) if missing else []
    cache.put_many(missing, fresh)
    by_key = cached | {r.key: r for r in fresh}
    return [by_key[r.key] for r in requests], len(cached)
