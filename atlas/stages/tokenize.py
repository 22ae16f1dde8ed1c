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

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pyarrow as pa

from atlas.core.files import atomic_write_parquet, open_parquet
from atlas.core.rundir import RunDir
from atlas.core.stage import Stage
from atlas.core.stats import Stats
from atlas.io import layout
from atlas.io.tokens import INDEX_SCHEMA, STREAM
from atlas.models.tokenizer import BOS, ENDOFTEXT, EOC, encode_ordinary_batch, ordinary_to_numpy

TOKENIZE_VERSION = 1

_BOS = np.array([BOS], dtype=np.uint32)
_EOC = np.array([EOC], dtype=np.uint32)
_EOC_EOT = np.array([EOC, ENDOFTEXT], dtype=np.uint32)


def chunk_stream(tokens: list, doc_end) -> tuple[np.ndarray, np.ndarray]:
    """The uint32 stream of a block of chunks and each chunk's [start, end) in it.

    ``tokens``: each chunk's ids (uint32 arrays, or lists); ``doc_end``: whether each chunk ends its document.
    """
    pieces = []
    for ids, last in zip(tokens, doc_end):
        pieces += (_BOS, ids, _EOC_EOT if last else _EOC)
    stream = np.concatenate(pieces).astype(np.uint32, copy=False) if pieces else np.zeros(0, dtype=np.uint32)
    sizes = np.fromiter(map(len, tokens), dtype=np.int64, count=len(tokens)) + 2 + np.asarray(doc_end, dtype=bool)
    ends = sizes.cumsum()
    return stream, np.stack([ends - sizes, ends], axis=1)


class TokenizeStage(Stage):
    name = "tokenize"
    output = layout.TOKENS
    upstream = ("annotate",)
    pool: ThreadPoolExecutor | None = None  # the encoding threads besides the calling one, kept from shard to shard

    def identity(self) -> dict:
        return {"version": TOKENIZE_VERSION, "tokenizer": "cl100k_base+atlas", "bos": BOS, "eoc": EOC,
                "eot": ENDOFTEXT}

    def plan(self, run: RunDir, stage_hash: str) -> int:
        return run.read_manifest()["stages"]["annotate"]["num_shards"]

    def setup(self) -> None:
        ordinary_to_numpy()  # loads cl100k_base
        if self.config.tokenize.threads > 1:
            self.pool = ThreadPoolExecutor(self.config.tokenize.threads - 1)

    def teardown(self) -> None:
        if self.pool is not None:
            self.pool.shutdown()
            self.pool = None

    def run_shard(self, run: RunDir, shard: int) -> Stats:
        columns = ["chunk_id", "doc_id", "text", "doc_end_flag", "concepts"]
        source = open_parquet(run.part_path(layout.ANNOTATED, shard), columns)
        stream_path = run.output_dir(self.output) / STREAM / f"part-{shard:05d}.u32"
        stream_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = stream_path.with_name(f".{stream_path.name}.tmp")
        stats, offset, index = Stats(), 0, []
        with open(tmp, "wb") as out:
            # use_threads=False: Arrow's decoding threads would only compete with the encoding ones (measured)
            for batch in source.iter_batches(batch_size=self.config.tokenize.block_rows, columns=columns,
                                             use_threads=False):
                texts = batch.column("text").to_pylist()
                tokens = encode_ordinary_batch(texts, self.config.tokenize.threads, self.pool)
                doc_end = batch.column("doc_end_flag").fill_null(False).to_numpy(zero_copy_only=False)
                stream, spans = chunk_stream(tokens, doc_end)
                out.write(stream.astype("<u4", copy=False))
                n_tokens = spans[:, 1] - spans[:, 0] - 2 - doc_end  # less [BOS], [EOC] and <|endoftext|>
                index.append(pa.table({  # the other columns pass through as Arrow arrays, never as Python objects
                    "chunk_id": batch.column("chunk_id"), "doc_id": batch.column("doc_id"),
                    "token_start": spans[:, 0] + offset, "token_end": spans[:, 1] + offset, "n_tokens": n_tokens,
                    "doc_end_flag": batch.column("doc_end_flag"), "concepts": batch.column("concepts"),
                }, schema=INDEX_SCHEMA))
                offset += len(stream)
                stats.inc("chunks", len(tokens))
                stats.inc("text_tokens", int(n_tokens.sum()))
                stats.inc("documents", int(doc_end.sum()))
        tmp.replace(stream_path)
        table = pa.concat_tables(index) if index else INDEX_SCHEMA.empty_table()
        atomic_write_parquet(run.part_path(self.output, shard), table)
        stats.inc("stream_tokens", offset)
        return stats


