"""``atlas export-tokens RUN OUT --format megatron``: the token shards as Megatron-LM / NeMo indexed datasets.

Per token shard i (``tokens/part-0000i.parquet`` + ``tokens/_stream/part-0000i.u32``)::

    OUT/part-0000i.bin              the token ids, int32 little-endian (the bytes of the .u32 stream, copied)
    OUT/part-0000i.idx              Megatron's "MMIDIDX" index: one sequence per chunk, documents marked
    OUT/part-0000i.concepts.parquet sequence, chunk_id, doc_id, concepts (global ids): row i = sequence i
    OUT/README.md                   the --data-path line (weights = token counts), the tokenizer, the sidecar
    OUT/export_tokens.json          counts per shard; marks OUT as an export that a rerun may replace

The .idx layout is that of ``_IndexWriter`` in megatron/core/datasets/indexed_dataset.py (all little-endian)::

    b"MMIDIDX\\x00\\x00"  version uint64 = 1  dtype code uint8 (4 = int32)
    sequence count uint64   document count uint64 (= documents + 1)
    sequence lengths int32[sequences]   sequence pointers int64[sequences] (byte offsets in the .bin)
    document indices int64[documents + 1]: 0, then the sequence index that ends each document

(Sequence modes, int8 per sequence, follow only in multimodal datasets: not written.) As Megatron's
preprocess_data.py does with --split-sentences, a document is several sequences: here its chunks, each one
its span [token_start, token_end) in the stream, [BOS] .. [EOC] (and <|endoftext|> after a document's last).

Memory holds one shard's index; the .bin is copied through a buffer of ``COPY_TOKENS`` tokens.
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from atlas.core.files import (
    ArtifactError,
    atomic_write_bytes,
    atomic_write_json,
    atomic_write_parquet,
    atomic_writer,
    read_parquet,
)
from atlas.core.ownership import NotOwned, claim, clear_owned
from atlas.core.rundir import RunDir
from atlas.io import layout
from atlas.io.tokens import RETOKENIZE, TokenShards
from atlas.models.tokenizer import SPECIAL_TOKENS, VOCAB_SIZE

FORMATS = ("megatron",)
MMIDIDX_HEADER = b"MMIDIDX\x00\x00"
MMIDIDX_VERSION = 1
MEGATRON_INT32 = 4  # megatron.core.datasets.indexed_dataset.DType.int32; Megatron has no uint32 code
INT32_LIMIT = 2**31
COPY_TOKENS = 4 << 20  # tokens per copy step (16 MiB)
MARKER = "export_tokens.json"
EXPORT_FILES = [MARKER, "README.md", "part-*.bin", "part-*.idx", "part-*.concepts.parquet"]  # all it writes
SIDECAR_SCHEMA = pa.schema([("sequence", pa.int64()), ("chunk_id", pa.string()), ("doc_id", pa.string()),
                            ("concepts", pa.list_(pa.int64()))])
README = """# Megatron token shards of run `{name}`

{n_shards} shard(s), {n_sequences:,} sequences (one per chunk), {n_documents:,} documents, {n_tokens:,} tokens,
written by `atlas export-tokens RUN OUT --format megatron`.

| file | what |
|---|---|
| `part-NNNNN.bin` + `part-NNNNN.idx` | one Megatron-LM / NeMo indexed dataset ("MMIDIDX", int32 tokens) per shard |
| `part-NNNNN.concepts.parquet` | row *i* = sequence *i* of that shard: `sequence`, `chunk_id`, `doc_id`, \
`concepts` (global concept ids, as in the run's `library/concepts.parquet`) |
| `export_tokens.json` | tokens, sequences and documents per shard |

Each sequence is one chunk: `[BOS]` + its text's tokens + `[EOC]`, and the last chunk of a document ends
with `<|endoftext|>` as well. The document indices of each `.idx` group a document's chunks, as
`tools/preprocess_data.py --split-sentences` groups sentences. Megatron's GPT dataset takes each sequence
(chunk) as its unit: it shuffles chunks, then packs them into training samples.

## Training on them

Point `--data-path` at the prefixes (the paths without `.bin`/`.idx`), each weighted by its tokens, with
`OUT` this folder:

```
--data-path {data_path}
```

For many shards, put the same words in a file and pass `--data-args-path FILE` instead.

The tokenizer is cl100k_base (tiktoken) plus Atlas's special tokens, {vocab_size:,} ids in all. The special ones:

{specials}

Megatron reads the ids as they are and never re-tokenizes, so any tokenizer option with a vocabulary of at
least {vocab_size:,} ids will train on them (e.g. `--tokenizer-type NullTokenizer --vocab-size {vocab_size}`).
Decode with `atlas.models.tokenizer.cl100k()`.

## The concepts sidecar

`part-NNNNN.concepts.parquet` gives the concepts of every sequence, for concept-conditioned training or to
pick sequences by concept. It lines up with the `.idx`: row *i* is `IndexedDataset(prefix)[i]`.
"""


def export_tokens(run_dir: str | Path, out: str | Path, fmt: str = "megatron") -> dict:
    """Write the run's token shards to ``out`` in format ``fmt``; return the counts (also in OUT/export_tokens.json).

    Rerunning over an earlier export replaces it and gives the same bytes."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown token format {fmt!r}; choose one of {', '.join(FORMATS)}")
    run, out = RunDir(run_dir), Path(out)
    manifest = run.read_manifest()
    tokenize = manifest.get("stages", {}).get("tokenize")
    if not tokenize or not run.is_stage_done(layout.TOKENS, tokenize.get("hash")):
        raise FileNotFoundError(f"{run.output_dir(layout.TOKENS)}: the tokenize stage has not finished; run it first")
    shards = TokenShards(run.root)
    if out.resolve() == run.root.resolve() or run.root.resolve() in out.resolve().parents:
        raise NotOwned(f"export-tokens OUT {out}: inside the run directory {run.root}; choose a folder outside it")
    claim(out, "export-tokens", "export-tokens OUT")  # a folder of the user's is refused before anything is written
    clear_owned(out, EXPORT_FILES, "export-tokens OUT")  # an earlier export goes whole: no part of a larger run stays
    atomic_write_json(out / MARKER, {"format": fmt, "status": "writing"})  # an interrupted export is replaced too

    per_shard = [_export_shard(shards, shard, out) for shard in range(len(shards.parts))]
    written = [s for s in per_shard if s["sequences"]]
    name = manifest.get("name", run.root.name)
    data_path = " ".join(f"{s['tokens']} OUT/{s['prefix']}" for s in written)
    specials = "\n".join(f"- `{token}` = {token_id}" for token, token_id in SPECIAL_TOKENS.items())
    totals = {key: sum(s[key] for s in per_shard) for key in ("tokens", "sequences", "documents")}
    atomic_write_bytes(out / "README.md", README.format(
        name=name, n_shards=len(written), n_sequences=totals["sequences"], n_documents=totals["documents"],
        n_tokens=totals["tokens"], data_path=data_path, vocab_size=VOCAB_SIZE, specials=specials).encode())
    summary = {"format": fmt, "shards": len(written), "empty_shards_skipped": len(per_shard) - len(written),
               **totals, "per_shard": written, "out": str(out)}
    atomic_write_json(out / MARKER, summary)
    return summary


def _export_shard(shards: TokenShards, shard: int, out: Path) -> dict:
    """Write shard ``shard`` as OUT/part-NNNNN.{bin,idx,concepts.parquet}; an empty shard writes nothing (Megatron
    cannot memory-map an empty .bin)."""
    prefix = f"part-{shard:05d}"
    stream = shards.stream(shard)  # checked against the index: its length is the last chunk's end
    index = read_parquet(shards.parts[shard], ["chunk_id", "doc_id", "token_start", "token_end", "doc_end_flag",
                                               "concepts"], hint=RETOKENIZE)
    n = index.num_rows
    counts = {"prefix": prefix, "tokens": len(stream), "sequences": n, "documents": 0}
    if n == 0:
        return counts
    starts = index.column("token_start").to_numpy()
    lengths = index.column("token_end").to_numpy() - starts
    # A document ends at its last chunk (doc_end_flag), where the doc_id changes, and at the end of the shard.
    doc_ids = index.column("doc_id")
    ends_document = index.column("doc_end_flag").fill_null(False).to_numpy(zero_copy_only=False).copy()
    ends_document[:-1] |= pc.not_equal(doc_ids.slice(0, n - 1), doc_ids.slice(1)).fill_null(True).to_numpy(
        zero_copy_only=False)
    ends_document[-1] = True
    document_indices = np.concatenate([[0], np.flatnonzero(ends_document) + 1]).astype("<i8")

    _copy_as_int32(stream, out / f"{prefix}.bin", shards.parts[shard])
    idx = b"".join([
        MMIDIDX_HEADER, struct.pack("<Q", MMIDIDX_VERSION), struct.pack("<B", MEGATRON_INT32),
        struct.pack("<Q", n), struct.pack("<Q", len(document_indices)),
        lengths.astype("<i4").tobytes(),
        (starts * 4).astype("<i8").tobytes(),  # byte offset of each chunk: its span's start, 4 bytes a token
        document_indices.tobytes(),
    ])
    atomic_write_bytes(out / f"{prefix}.idx", idx)
    atomic_write_parquet(out / f"{prefix}.concepts.parquet", pa.table(
        [pa.array(np.arange(n, dtype=np.int64)), index.column("chunk_id"), doc_ids, index.column("concepts")],
        schema=SIDECAR_SCHEMA))
    counts["documents"] = len(document_indices) - 1
    return counts


def _copy_as_int32(stream: np.ndarray, path: Path, part: Path) -> None:
    """Write the uint32 stream as Megatron's int32: ids below 2**31 have the same bytes in both, so it is a copy,
    checked id by id, a buffer at a time; written to a temporary name, then renamed."""
    with atomic_writer(path) as f:
        for start in range(0, len(stream), COPY_TOKENS):
            block = np.asarray(stream[start : start + COPY_TOKENS])
            if block.max() >= INT32_LIMIT:
                at = start + int(np.argmax(block >= INT32_LIMIT))
                raise ArtifactError(f"{part}: token {at} of its stream is {int(stream[at])}, beyond int32, the "
                                    f"widest token type Megatron reads; the stream is damaged; {RETOKENIZE}")
            f.write(block.tobytes())
