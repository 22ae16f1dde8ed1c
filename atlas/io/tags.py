"""Reading the tags (``RUN/tags/``) and the tag vocabulary (``RUN/tag_vocab/``)."""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from atlas.core.files import ArtifactError, read_parquet, read_parts
from atlas.core.rundir import RunDir
from atlas.io import layout
from atlas.io.outofcore import checked_parts

# One row per (chunk, field, tag).
TAG_SCHEMA = pa.schema(
    [("chunk_id", pa.string()), ("field", pa.string()), ("tag", pa.string()), ("tag_norm", pa.string()),
     ("rank", pa.int16())]
)
# One row per normalized tag, most frequent first; row i of _embeddings.npy embeds tag i.
VOCAB_SCHEMA = pa.schema(
    [("tag_norm", pa.string()), ("count", pa.int64()), ("n_chunks", pa.int64()), ("fields", pa.list_(pa.string())),
     ("variants", pa.list_(pa.string())), ("chunk_ids", pa.list_(pa.string()))]
)


def read_tags(run: RunDir, columns: list[str]) -> pa.Table:
    """The given columns of every tag part, checked against the tag schema."""
    return read_parts(run.parts(layout.TAGS), columns, required=TAG_SCHEMA)


def tag_parts(run: RunDir) -> list[Path]:
    """Every tag part, for a reader that queries the files directly (DuckDB): each is checked to have the tag
    schema, from its footer alone, so a damaged or foreign part is an ArtifactError that names it."""
    return checked_parts(run, layout.TAGS, TAG_SCHEMA)


def vocab_fields(run: RunDir) -> list[str]:
    """The tag fields the vocabulary was built from (the union of its ``fields`` lists), sorted; read a batch of
    tags at a time."""
    found: set[str] = set()
    for batch in pq.ParquetFile(run.output_dir(layout.TAG_VOCAB) / "part-00000.parquet").iter_batches(
            batch_size=65_536, columns=["fields"]):
        found.update(pc.unique(pc.list_flatten(batch.column("fields"))).to_pylist())
    return sorted(found)


def load_vocab(run: RunDir, columns: list[str] | None = None) -> tuple[pa.Table, np.ndarray]:
    """The vocabulary table (``columns`` of it; None: all, with every tag's chunk ids, which grow with the corpus)
    and its aligned float16 embeddings, memory-mapped: read a block at a time, they cost no memory up front."""
    folder = run.output_dir(layout.TAG_VOCAB)
    part = folder / "part-00000.parquet"
    table = read_parquet(part, columns, required=VOCAB_SCHEMA)
    try:
        # never unpickle from a run directory
        vectors = np.load(folder / "_embeddings.npy", mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError) as e:
        raise ValueError(f"{folder / '_embeddings.npy'}: unreadable ({e}); "
                         "rerun the vocab stage with --force") from None
    if vectors.ndim != 2 or len(vectors) != table.num_rows:
        raise ArtifactError(f"{folder / '_embeddings.npy'}: shape {vectors.shape}, but {part} has {table.num_rows} "
                            "tags (row i embeds tag i); rerun the vocab stage with --force")
    return table, vectors


def float_rows(x: np.ndarray, rows) -> np.ndarray:
    """Rows of ``x`` (an array, or the memory map of a whole .npy file, as ``load_vocab`` gives) in float32.

    A memory map's rows are read from its file: a page read through the map would stay in RSS, with its neighbours
    (the kernel maps those too), so scattered rows would soon map the whole file."""
    if not (isinstance(x, np.memmap) and isinstance(x.base, mmap.mmap)):  # an array, or a view of a map
        return np.asarray(x[rows], dtype=np.float32)
    width = x.dtype.itemsize * x.shape[1]
    out = np.empty((len(rows), x.shape[1]), dtype=np.float32)
    with open(x.filename, "rb") as f:
        for i, row in enumerate(rows):
            out[i] = np.frombuffer(os.pread(f.fileno(), width, x.offset + int(row) * width), dtype=x.dtype)
    return out
