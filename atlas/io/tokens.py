"""Reading the token shards of the ``tokenize`` stage: the one reader every trainer uses.

Per shard::

    tokens/_stream/part-00000.u32   the token ids, little-endian uint32
    tokens/part-00000.parquet       one row per chunk: chunk_id, doc_id, token_start, token_end (its span in the
                                    stream), n_tokens, doc_end_flag, concepts (global ids)

Spans tile the stream, so every token belongs to exactly one chunk. ``TokenShards.windows`` cuts a shard's
stream into windows of ``length`` tokens every ``stride`` tokens (default: ``length``, no overlap), with
the chunk each token belongs to.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from atlas.core.files import ArtifactError, read_json, read_parquet
from atlas.core.rundir import RunDir
from atlas.io import layout

STREAM = "_stream"
RETOKENIZE = "rerun the tokenize stage (atlas run CONFIG --force --stages tokenize)"
INDEX_SCHEMA = pa.schema(
    [("chunk_id", pa.string()), ("doc_id", pa.string()), ("token_start", pa.int64()), ("token_end", pa.int64()),
     ("n_tokens", pa.int32()), ("doc_end_flag", pa.bool_()), ("concepts", pa.list_(pa.int64()))]
)


@dataclass
class TokenWindow:
    """``length`` consecutive tokens of one shard, for a trainer."""

    tokens: np.ndarray  # int64 [length]
    chunk_of_token: np.ndarray  # int32 [length]: index into chunk_ids / concepts
    chunk_ids: list[str]  # the chunks the window touches, in order
    concepts: np.ndarray  # uint8 [len(chunk_ids), n_concepts], multi-hot


class TokenShards:
    """The token shards of a run, read back as windows: ``for w in TokenShards(run).windows(256): ...``."""

    def __init__(self, run_dir: str | Path, n_concepts: int | None = None):
        self.run = RunDir(run_dir)
        self.parts = self.run.parts(layout.TOKENS)  # shard i is parts[i]; each one's stream is checked in stream()
        if n_concepts is None:
            n_concepts = read_json(self.run.output_dir(layout.LIBRARY) / "config.json")["n_concepts"]
        self.n_concepts = n_concepts

    def stream(self, shard: int) -> np.ndarray:
        """Shard ``shard``'s token stream, checked against the length its index part gives it."""
        path = self.run.output_dir(layout.TOKENS) / STREAM / f"part-{shard:05d}.u32"
        if not path.is_file():
            raise ArtifactError(f"{path}: missing; {RETOKENIZE}")
        size = path.stat().st_size
        ends = read_parquet(self.parts[shard], ["token_end"]).column(0)
        expected = ends[-1].as_py() if len(ends) else 0
        if size != 4 * expected:
            raise ArtifactError(f"{path}: {size} bytes ({size / 4:g} tokens), but {self.parts[shard]} ends its last "
                                f"chunk at token {expected}: the stream is truncated or belongs to another index; "
                                f"{RETOKENIZE}")
        return np.memmap(path, dtype="<u4", mode="r") if size else np.zeros(0, dtype=np.uint32)

    def index(self, shard: int) -> dict:
        return read_parquet(self.parts[shard], required=["chunk_id", "token_start", "token_end", "concepts"],
                            hint=RETOKENIZE).to_pydict()

    def shard_windows(self, shard: int, length: int, stride: int | None = None) -> tuple[np.ndarray, np.ndarray, dict]:
        """Every window of ``length`` tokens that starts at a multiple of ``stride`` (default ``length``) in shard
        ``shard``: its tokens [W, length] (uint32), the row in the shard's index of each token's chunk [W, length],
        and that index. A shard's last partial window is dropped."""
        stream, index = np.asarray(self.stream(shard)), self.index(shard)
        starts, ends = np.asarray(index["token_start"]), np.asarray(index["token_end"])
        if len(starts) and (starts[0] != 0 or ends[-1] != len(stream) or np.any(starts[1:] != ends[:-1])):
            raise ValueError(f"{self.parts[shard]}: chunk spans do not tile the shard's token stream "
                             f"({len(stream)} tokens)")
        rows = np.repeat(np.arange(len(starts)), ends - starts)
        take = np.arange(0, len(stream) - length + 1, stride or length)[:, None] + np.arange(length)[None, :]
        return stream[take], rows[take], index

    def windows(self, length: int, stride: int | None = None,
                shards: list[int] | None = None) -> Iterator[TokenWindow]:
        """``shard_windows`` of each shard in order, one window at a time, with its chunks' multi-hot concepts."""
        for shard in shards if shards is not None else range(len(self.parts)):
            tokens, rows, index = self.shard_windows(shard, length, stride)
            for window, window_rows in zip(tokens, rows):
                first, last = int(window_rows[0]), int(window_rows[-1]) + 1
                concepts = np.zeros((last - first, self.n_concepts), dtype=np.uint8)
                for row, ids in enumerate(index["concepts"][first:last]):
                    concepts[row, ids] = 1
                yield TokenWindow(window.astype(np.int64), (window_rows - first).astype(np.int32),
                                  index["chunk_id"][first:last], concepts)
