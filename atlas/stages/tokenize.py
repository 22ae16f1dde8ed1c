"""Stage ``tokenize`` (map): annotated chunks -> training token shards (paper 4.5.1, Figure 15).

Every chunk becomes ``[BOS] + cl100k_base tokens + [EOC]``; the last chunk of a document is
followed by ``<|endoftext|>``. Chunks follow each other in shard order, so a shard is one stream::

    tokens/_stream/part-00000.u32   the token ids, little-endian uint32 (np.memmap(..., dtype="<u4"))
    tokens/part-00000.parquet       one row per chunk: chunk_id, doc_id, token_start, token_end
                                    (its span in the stream, [BOS .. EOC or <|endoftext|>]), n_tokens
                                    (text tokens only), doc_end_flag, concepts (global ids)

``atlas.io.tokens.TokenShards`` reads them back for a trainer.
"""

from __future__ import annotations

from array import array

import numpy as np
import pyarrow as pa

from atlas.core.files import atomic_write_parquet, open_parquet
from atlas.core.rundir import RunDir
from atlas.core.stage import Stage
from atlas.core.stats import Stats
from atlas.io import layout
from atlas.io.tokens import INDEX_SCHEMA, STREAM
from atlas.models.tokenizer import BOS, ENDOFTEXT, EOC, cl100k

TOKENIZE_VERSION = 1


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
    output = layout.TOKENS
    upstream = ("annotate",)

    def identity(self) -> dict:
        return {"version": TOKENIZE_VERSION, "tokenizer": "cl100k_base+atlas", "bos": BOS, "eoc": EOC,
                "eot": ENDOFTEXT}

    def plan(self, run: RunDir, stage_hash: str) -> int:
        return run.read_manifest()["stages"]["annotate"]["num_shards"]

    def setup(self) -> None:
        self.encoding = cl100k()

    def run_shard(self, run: RunDir, shard: int) -> Stats:
        columns = ["chunk_id", "doc_id", "text", "doc_end_flag", "concepts"]
        source = open_parquet(run.part_path(layout.ANNOTATED, shard), columns)
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


