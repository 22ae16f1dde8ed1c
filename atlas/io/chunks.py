"""Reading the chunk stage's output, ``RUN/chunks/part-*.parquet`` (columns: DESIGN.md's chunk contract)."""

from __future__ import annotations

import pyarrow as pa

from atlas.core.files import read_parquet
from atlas.core.rundir import RunDir
from atlas.io import layout

CHUNK_SCHEMA = pa.schema(
    [
        ("chunk_id", pa.string()),
        ("doc_id", pa.string()),
        ("source_doc_id", pa.string()),
        ("data_src", pa.string()),
        ("domain", pa.string()),
        ("chunk_text", pa.string()),
        ("n_tokens", pa.int32()),
        ("char_start", pa.int64()),
        ("char_end", pa.int64()),
        ("doc_end_flag", pa.bool_()),
        ("metadata", pa.string()),
    ]
)


def read_chunks(run: RunDir, wanted, columns: tuple[str, ...] = ("chunk_text",)) -> dict[str, dict]:
    """The given columns of the chunks whose id is in ``wanted``, by chunk id (read part by part)."""
    found = {}
    for part in run.parts(layout.CHUNKS):
        for row in read_parquet(part, ["chunk_id", *columns]).to_pylist():
            if row["chunk_id"] in wanted:
                found[row["chunk_id"]] = row
    return found
