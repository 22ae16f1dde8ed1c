"""A request cache in SQLite, so that a killed shard resumes without redoing finished requests.

Answers are keyed by (item id, attempt, prompt hash, engine identity): change the prompt, the
model or the sampling and old answers are simply not found. One file per shard, written only by
the worker running that shard, so there is no locking between workers.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

from atlas.core.files import stable_hash
from atlas.llm.engine import LLMResult


class RequestCache:
    def __init__(self, path: str | Path, namespace: dict):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.namespace = stable_hash(namespace)  # prompt hash + engine identity
        self.db = sqlite3.connect(self.path)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute(
            "CREATE TABLE IF NOT EXISTS answers (key TEXT PRIMARY KEY, text TEXT, finish_reason TEXT,"
            " tokens_in INTEGER, tokens_out INTEGER)"
        )

    def _key(self, item: str) -> str:
        return f"{self.namespace}:{item}"

    def get_many(self, items: list[str]) -> dict[str, LLMResult]:
        found = {}
        for item in items:
            row = self.db.execute("SELECT text, finish_reason, tokens_in, tokens_out FROM answers WHERE key = ?",
                                  (self._key(item),)).fetchone()
            if row:
                found[item] = LLMResult(item, *row)
        return found

    def put_many(self, results: list[LLMResult]) -> None:
        """Store answers (not transport errors: those are worth asking again after a restart)."""
        rows = [(self._key(r.key), r.text, r.finish_reason, r.tokens_in, r.tokens_out) for r in results if r.error is None]
        with self.db:
            self.db.executemany("INSERT OR REPLACE INTO answers VALUES (?, ?, ?, ?, ?)", rows)

    def close(self) -> None:
        self.db.close()
