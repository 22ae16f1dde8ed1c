"""The request cache: a killed shard resumes without asking the engine again for answers it already had.

An answer is stored under the request's key (chunk id and attempt) plus a hash of everything the
engine sees (system and user prompt, schema, structured context) and the engine's identity
(engine, model, sampling). Change the chunk text, the prompt, the schema, the model or the
sampling and the old answer is simply not found.

**Safe on shared file systems (NFS, Lustre, GPFS)**, where the run directory of a cluster lives. The cache of a
shard is one append-only JSON Lines file, one answer a line, written only by the process running that shard (a
shard runs in one process at a time), so it needs no locks, no shared memory and no WAL, none of which these file
systems do reliably (SQLite's WAL mode needs shared memory between the processes that open the database, which NFS
cannot give). Each answer is appended with one ``write`` as it arrives, so a killed process (SIGKILL included)
loses nothing it had received: the kernel already holds the bytes and writes them back when the file is closed,
which it does for a dead process too. The file is also ``fsync``-ed every second and on close, so a crashed node
loses at most the last second. A line cut short by a crash during a write is the only possible damage: reading
skips it and truncates the file back to its last complete line before appending, which only the one writer does.
"""

from __future__ import annotations

import json
import logging
import os
import sqlite3
import time
from pathlib import Path

from atlas.core.files import sha256_bytes, stable_hash
from atlas.llm.engine import LLMRequest, LLMResult

log = logging.getLogger("atlas.llm.cache")
SYNC_EVERY_S = 1.0
FIELDS = ("text", "finish_reason", "tokens_in", "tokens_out")


class RequestCache:
    """Answers by request, in ``path`` (``RUN/_cache/<step>/<name>.jsonl``); read whole on open."""

    def __init__(self, path: str | Path, engine_identity: dict):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.engine = stable_hash(engine_identity)
        self.answers = _read_sqlite(self.path.with_suffix(".sqlite")) | self._read()
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._synced = time.monotonic()

    def _read(self) -> dict[str, dict]:
        """The answers in the file; a last line cut short by a crash is dropped from the file."""
        if not self.path.exists():
            return {}
        data = self.path.read_bytes()
        end = data.rfind(b"\n") + 1
        if end < len(data):
            os.truncate(self.path, end)
        answers = {}
        for line in data[:end].splitlines():
            try:
                row = json.loads(line)
                answers[row.pop("key")] = row
            except (ValueError, KeyError, TypeError, AttributeError):
                log.warning("%s: skipping an unreadable line", self.path)
        return answers

    def _key(self, request: LLMRequest) -> str:
        seen = json.dumps([request.system, request.user, request.schema, request.context], sort_keys=True)
        return f"{request.key}:{sha256_bytes(seen.encode())[:24]}:{self.engine[:24]}"

    def get(self, request: LLMRequest) -> LLMResult | None:
        """The cached answer to ``request``, or None."""
        row = self.answers.get(self._key(request))
        return None if row is None else LLMResult(request.key, *(row[f] for f in FIELDS))

    def put(self, request: LLMRequest, result: LLMResult) -> None:
        """Store an answer (not a transport error: that is worth asking again after a restart)."""
        if result.error is not None:
            return
        key, row = self._key(request), {f: getattr(result, f) for f in FIELDS}
        self.answers[key] = row
        data = memoryview((json.dumps({"key": key} | row) + "\n").encode())  # ASCII: lone surrogates too
        while data:  # one write for a regular file; a loop in case the kernel takes less
            data = data[os.write(self._fd, data):]
        if time.monotonic() - self._synced >= SYNC_EVERY_S:
            os.fsync(self._fd)
            self._synced = time.monotonic()

    def close(self) -> None:
        if self._fd >= 0:
            os.fsync(self._fd)
            os.close(self._fd)
            self._fd = -1


def _read_sqlite(path: Path) -> dict[str, dict]:
    """The answers of a cache that an earlier Atlas wrote beside (SQLite, same keys), read once and never written,
    so that a shard killed under that version resumes with its answers."""
    if not path.exists():
        return {}
    try:
        db = sqlite3.connect(path)
        try:
            rows = db.execute(f"SELECT key, {', '.join(FIELDS)} FROM answers").fetchall()
        finally:
            db.close()
    except sqlite3.Error as e:
        log.warning("%s: cannot read the old SQLite cache (%s); its answers are asked again", path, e)
        return {}
    return {key: dict(zip(FIELDS, values)) for key, *values in rows}
