"""Counters that every stage keeps per shard: rows in and out, drops by reason, failures."""

from __future__ import annotations

from collections import Counter


class Stats:
    """Named integer counters; ``dropped.<reason>`` counters say why rows left the pipeline."""

    def __init__(self, counters: dict[str, int] | None = None):
        self.counters: Counter[str] = Counter(counters or {})

    def inc(self, key: str, n: int = 1) -> None:
        self.counters[key] += n

    def drop(self, reason: str, n: int = 1) -> None:
        self.counters[f"dropped.{reason}"] += n

    def merge(self, other: Stats | dict) -> Stats:
        self.counters.update(other.counters if isinstance(other, Stats) else other)
        return self

    def to_dict(self) -> dict[str, int]:
        return dict(sorted(self.counters.items()))

    def __getitem__(self, key: str) -> int:
        return self.counters[key]
