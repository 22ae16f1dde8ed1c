"""Stage ``tokenize`` (map): annotated chunks -> training token shards (paper 4.5.1, Figure 15).

Every chunk becomes ``[BOS] + cl100k_base tokens + [EOC]``; the last chunk of a document is
followed by ``<|endoftext|>``. Chunks follow each other in shard order, so a shard is one stream::

    tokens/_stream/part-00000.u32   the token ids, little-endian uint32 (np.memmap(..., dtype="<u4"))
    tokens/part-00000.parquet       one row per chunk: chunk_id, doc_id, token_start, token_end
                                    (its span in the stream, [BOS .. EOC or <|endoftext|>]), n_tokens
                                    (text tokens only), doc_end_flag, concepts (global ids)

``TokenShards`` reads them back for a trainer as fixed-length windows of tokens, with the chunk
each token belongs to and the chunks' multi-hot concept vectors.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from atlas.core.files import ArtifactError, atomic_write_parquet, open_parquet, read_json, read_parquet
from atlas.core.rundir import RunDir
from atlas.core.stage import Stage
from atlas.core.stats import Stats
from atlas.tokenizer import BOS, ENDOFTEXT, EOC, cl100k

TOKENIZE_VERSION = 1
STREAM = "_stream"
RETOKENIZE = "rerun the tokenize stage (atlas run CONFIG --force --stages tokenize)"
INDEX_SCHEMA = pa.schema(
    [("chunk_id", pa.string()), ("doc_id", pa.string()), ("token_start", pa.int64()), ("token_end", pa.int64()),
     ("n_tokens", pa.int32()), ("doc_end_flag", pa.bool_()), ("concepts", pa.list_(pa.int64()))]
)


def chunk_stream(tokens: list[list[int]], doc_end: list[bool]) -> tuple[np.ndarray, np.ndarray]:
    """The uint32 stream of a block of chunks and each chunk's [start, end) in it."""
    stream = array("I")  # appending whole lists to an array.array runs in C
    bounds = np.empty((len(tokens), 2), dtype=np.int64)
    for i, (ids, last) in enumerate(zip(tokens, doc_end)):
        bounds[i, 0] = len(stream)
        stream.append(BOS)
        stream.extend(ids)
        stream.append(EOC)
        if last:
            stream.append(ENDOFTEXT)
        bounds[i, 1] = len(stream)
    return np.frombuffer(stream, dtype=np.uint32), bounds


class TokenizeStage(Stage):
    name = "tokenize"
    output = "tokens"
    kind = "map"
    upstream = ("annotate",)

    def identity(self) -> dict:
        return {"version": TOKENIZE_VERSION, "tokenizer": "cl100k_base+atlas", "bos": BOS, "eoc": EOC, "eot": ENDOFTEXT}

    def plan(self, run: RunDir, stage_hash: str) -> int:
        return run.read_manifest()["stages"]["annotate"]["num_shards"]

    def setup(self) -> None:
        self.encoding = cl100k()

    def run_shard(self, run: RunDir, shard: int) -> Stats:
        columns = ["chunk_id", "doc_id", "text", "doc_end_flag", "concepts"]
        source = open_parquet(run.part_path("annotated", shard), columns)
        stream_path = run.output_dir(self.output) / STREAM / f"part-{shard:05d}.u32"
        stream_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = stream_path.with_name(f".{stream_path.name}.tmp")
        stats, offset, index = Stats(), 0, []
        with open(tmp, "wb") as out:
            for batch in source.iter_batches(batch_size=self.config.tokenize.block_rows, columns=columns):
                rows = batch.to_pydict()
                tokens = self.encoding.encode_ordinary_batch(rows["text"], num_threads=self.config.tokenize.threads)
                stream, spans = chunk_stream(tokens, rows["doc_end_flag"])
                out.write(stream.astype("<u4", copy=False).tobytes())
                index.append(pa.table({
                    "chunk_id": rows["chunk_id"], "doc_id": rows["doc_id"], "token_start": spans[:, 0] + offset,
                    "token_end": spans[:, 1] + offset, "n_tokens": [len(t) for t in tokens],
                    "doc_end_flag": rows["doc_end_flag"], "concepts": rows["concepts"],
                }, schema=INDEX_SCHEMA))
                offset += len(stream)
                stats.inc("chunks", len(tokens))
                stats.inc("text_tokens", sum(len(t) for t in tokens))
                stats.inc("documents", sum(rows["doc_end_flag"]))
        tmp.replace(stream_path)
        table = pa.concat_tables(index) if index else INDEX_SCHEMA.empty_table()
        atomic_write_parquet(run.part_path(self.output, shard), table)
        stats.inc("stream_tokens", offset)
        return stats


@dataclass
class TokenWindow:
    """``seq_len`` consecutive tokens of one shard, for a trainer."""

    tokens: np.ndarray  # int64 [seq_len]
    chunk_of_token: np.ndarray  # int32 [seq_len]: index into chunk_ids / concepts
    chunk_ids: list[str]  # the chunks the window touches, in order
    concepts: np.ndarray  # uint8 [len(chunk_ids), n_concepts], multi-hot


class TokenShards:
    """The token shards of a run, read back as windows: ``for w in TokenShards(run).windows(256): ...``."""

    def __init__(self, run_dir: str | Path, n_concepts: int | None = None):
        self.run = RunDir(run_dir)
        folder = self.run.output_dir(TokenizeStage.output)
        self.parts = sorted(folder.glob("part-*.parquet"))
        if not self.parts:
            raise FileNotFoundError(f"{folder}: no token shards; run the tokenize stage")
        n_shards = max(len(self.parts), len(list((folder / STREAM).glob("part-*.u32"))))
        expected = [self.run.part_path(TokenizeStage.output, i) for i in range(n_shards)]
        if self.parts != expected:  # shard i is parts[i]: a gap would pair a stream with another shard's index
            missing = sorted(set(expected) - set(self.parts))
            raise ArtifactError(f"{missing[0]}: missing (found {len(self.parts)} token shards, numbered "
                                f"{', '.join(p.stem.removeprefix('part-') for p in self.parts)}); {RETOKENIZE}")
        if n_concepts is None:
            n_concepts = read_json(self.run.output_dir("library") / "config.json")["n_concepts"]
        self.n_concepts = n_concepts

    def stream(self, shard: int) -> np.ndarray:
        """Shard ``shard``'s token stream, checked against the length its index part gives it."""
        path = self.run.output_dir(TokenizeStage.output) / STREAM / f"part-{shard:05d}.u32"
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

    def windows(self, seq_len: int, shards: list[int] | None = None) -> Iterator[TokenWindow]:
        """Non-overlapping windows over each shard's stream, in order; a shard's last partial window is dropped."""
        for shard in shards if shards is not None else range(len(self.parts)):
            stream, index = self.stream(shard), self.index(shard)
            starts = np.asarray(index["token_start"], dtype=np.int64)
            for begin in range(0, len(stream) - seq_len + 1, seq_len):
                first = int(np.searchsorted(starts, begin, side="right")) - 1
                last = int(np.searchsorted(starts, begin + seq_len, side="left"))
                local = np.searchsorted(starts[first:last], np.arange(begin, begin + seq_len), side="right") - 1
                concepts = np.zeros((last - first, self.n_concepts), dtype=np.uint8)
                for row, ids in enumerate(index["concepts"][first:last]):
                    concepts[row, ids] = 1
                yield TokenWindow(np.asarray(stream[begin : begin + seq_len], dtype=np.int64), local.astype(np.int32),
                                  index["chunk_id"][first:last], concepts)
