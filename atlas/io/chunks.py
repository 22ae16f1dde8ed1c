"""Reading the chunk stage's output, ``RUN/chunks/part-*.parquet`` (columns: DESIGN.md's chunk contract)."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc

from atlas.core.files import ArtifactError, open_parquet, read_json, sha256_bytes
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


READ_BATCH_ROWS = 8192  # chunk rows decoded at a time by read_chunks
SAMPLE_FILE = "_sample.json"  # in RUN/tags/: the library sample's rule (see sample_threshold)


def sample_position(doc_id: str) -> float:
    """A document's place in [0, 1) for the library sample: a hash of its id alone, so a document is in or out
    whatever the input's order or sharding, and every source is sampled in proportion. Independent of the
    annotator's held-out split, which hashes the id with a seed."""
    return int(sha256_bytes(f"atlas-library-sample:{doc_id}".encode())[:13], 16) / 16**13


def sample_threshold(run: RunDir, fraction: float, max_docs: int | None = None) -> float:
    """The library sample is the documents whose position is below this: ``tag.sample_fraction``, lowered by the
    tag stage's plan when ``tag.sample_max_docs`` caps it (``RUN/tags/_sample.json``, which must match both)."""
    path = run.output_dir(layout.TAGS) / SAMPLE_FILE
    if not path.exists():
        if max_docs is None:
            return fraction
        raise ArtifactError(f"{path}: missing; tag.sample_max_docs needs the tag stage's plan, made once the chunk "
                            f"stage is done (atlas run does it; for SLURM: atlas plan CONFIG --stages tag)")
    rule = read_json(path)
    if (rule.get("fraction"), rule.get("max_docs")) != (fraction, max_docs):
        raise ArtifactError(f"{path}: planned for sample_fraction {rule.get('fraction')}, sample_max_docs "
                            f"{rule.get('max_docs')}, not the config's {fraction}, {max_docs}; plan the tag stage "
                            f"again (atlas run, or atlas plan CONFIG --stages tag)")
    return rule["threshold"]


RECHUNK = "recompute it: atlas run CONFIG --force --stages chunk (the stages after it follow)"


def read_chunks(run: RunDir, wanted, columns: tuple[str, ...] = ("chunk_text",)) -> dict[str, dict]:
    """The given columns of the chunks whose id is in ``wanted``, by chunk id (a later part's row wins).

    The parts are decoded ``READ_BATCH_ROWS`` rows at a time and filtered in Arrow, on this thread (the decoder's
    threads would each keep memory): memory holds one batch and the wanted rows, whatever the corpus."""
    return {row["chunk_id"]: row for row in filtered_rows(run.parts(layout.CHUNKS), wanted, columns, hint=RECHUNK)}


def filtered_rows(parts, wanted, columns: tuple[str, ...], key: str = "chunk_id", required=(), hint: str = ""):
    """The rows (dicts of ``key`` and ``columns``) of ``parts`` whose ``key`` is in ``wanted``, in file order, read
    as ``read_chunks`` reads them; a damaged part or a missing column (of those read, or of ``required``: names or a
    schema) is an ArtifactError that names the part."""
    names = list(dict.fromkeys([key, *columns]))
    ids = pa.array(list(wanted), pa.string())
    tail = f"; {hint}" if hint else ""
    for part in parts:
        with open_parquet(part, required or names, hint) as pf:
            try:
                for batch in pf.iter_batches(batch_size=READ_BATCH_ROWS, columns=names, use_threads=False):
                    yield from batch.filter(pc.is_in(batch.column(key), value_set=ids)).to_pylist()
            except (pa.ArrowException, OSError) as e:
                raise ArtifactError(f"{part}: cannot be decoded ({e}): truncated or damaged{tail}") from None
