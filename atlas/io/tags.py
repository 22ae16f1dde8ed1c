"""Reading the tags (``RUN/tags/``) and the tag vocabulary (``RUN/tag_vocab/``)."""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from atlas.core.files import ArtifactError, open_parquet, read_parquet, read_parts
from atlas.core.rundir import RunDir
from atlas.io import layout
from atlas.io.chunks import filtered_rows
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


RETAG = "recompute it: atlas run CONFIG --force --stages tag (the stages after it follow)"
REVOCAB = "rerun the vocab stage with --force"


def read_tags(run: RunDir, columns: list[str]) -> pa.Table:
    """The given columns of every tag part, checked against the tag schema."""
    return read_parts(run.parts(layout.TAGS), columns, required=TAG_SCHEMA, hint=RETAG)


def read_tags_of(run: RunDir, chunk_ids, columns: tuple[str, ...] = ("field", "tag_norm")) -> list[dict]:
    """The tag rows (chunk_id and ``columns``) of the given chunks, in file order, read a batch at a time."""
    return list(filtered_rows(run.parts(layout.TAGS), chunk_ids, columns, required=TAG_SCHEMA, hint=RETAG))


def tag_parts(run: RunDir) -> list[Path]:
    """Every tag part, for a reader that queries the files directly (DuckDB): each is checked to have the tag
    schema, from its footer alone, so a damaged or foreign part is an ArtifactError that names it."""
    return checked_parts(run, layout.TAGS, TAG_SCHEMA)


def vocab_fields(run: RunDir) -> list[str]:
    """The tag fields the vocabulary was built from (the union of its ``fields`` lists), sorted; read a batch of
    tags at a time."""
    found: set[str] = set()
    part = run.output_dir(layout.TAG_VOCAB) / "part-00000.parquet"
    with open_parquet(part, required=["fields"], hint=REVOCAB) as pf:
        try:
            for batch in pf.iter_batches(batch_size=65_536, columns=["fields"]):
                found.update(pc.unique(pc.list_flatten(batch.column("fields"))).to_pylist())
        except (pa.ArrowException, OSError) as e:
            raise ArtifactError(f"{part}: cannot be decoded ({e}): truncated or damaged; {REVOCAB}") from None
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
        raise ArtifactError(f"{folder / '_embeddings.npy'}: unreadable ({e}); {REVOCAB}") from None
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
