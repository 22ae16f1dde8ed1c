"""``atlas export RUN OUT``: the release view of a run, as FineWeb-Atlas publishes it.

    OUT/chunks/part-*.parquet     chunk_id, doc_id, source_doc_id, data_src, domain, text, n_tokens,
                                  doc_end_flag, metadata, concepts, concept_scores, <domain>_global_ids
    OUT/concepts.parquet          concept_id, type (content | tone | demographic | alignment), name,
                                  description, taxonomy_path, chunk_count, prevalence (from the annotation)
    OUT/field_guide/part-*.parquet  concept_id, chunk_ids: which chunks carry each concept (reverse index)
    OUT/cooccurrence.npz          scipy.sparse CSR [n_concepts, n_concepts]: chunks carrying both concepts
                                  (the diagonal is chunk_count); load with scipy.sparse.load_npz
    OUT/README.md                 what each file holds

The parts are read one at a time. Memory holds the co-occurrence matrix (concepts x concepts, sparse) and one
part; the reverse index is grouped out of core (DuckDB, at most ``execution.memory_gb`` of the run's config, spilling
to ``OUT/.tmp/``) and written a few concepts at a time (a field-guide row group also ends before it passes 500k
chunk ids).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from atlas.config import config_from_dict
from atlas.core.files import atomic_write_bytes, atomic_write_json, atomic_write_parquet
from atlas.core.rundir import RunDir
from atlas.io import layout
from atlas.io.library import load_library
from atlas.io.outofcore import PartWriter, SortedLists, budget_slices, duckdb_session, record_batches, scratch

CONCEPTS_SCHEMA = pa.schema(
    [("concept_id", pa.int64()), ("type", pa.string()), ("name", pa.string()), ("description", pa.string()),
     ("taxonomy_path", pa.string()), ("chunk_count", pa.int64()), ("prevalence", pa.float64())]
)
FIELD_GUIDE_SCHEMA = pa.schema([("concept_id", pa.int64()), ("chunk_ids", pa.list_(pa.string()))])
FIELD_GUIDE_ROWS_PER_PART = 4096
README = """# Atlas release view of run `{name}`

| file | rows | what |
|---|---:|---|
| `chunks/part-*.parquet` | {n_chunks:,} | the annotated chunks: text, metadata, concept ids (global) and scores |
| `concepts.parquet` | {n_concepts:,} | the concepts: id, type, name, description, taxonomy path, chunk count, \
prevalence |
| `field_guide/part-*.parquet` | {n_concepts:,} | for every concept, the ids of the chunks that carry it |
| `cooccurrence.npz` | {n_concepts:,} x {n_concepts:,} | chunks carrying both concepts \
(sparse; `scipy.sparse.load_npz`) |

Concept ids are global: {offsets}. A chunk's `concepts` and `concept_scores` list its labels
domain by domain, best first; `<domain>_global_ids` split them by domain.
"""


def export_release(run_dir: str | Path, out: str | Path) -> dict:
    run, out = RunDir(run_dir), Path(out)
    manifest = run.read_manifest()
    annotate = manifest.get("stages", {}).get("annotate")
    if not annotate or not run.is_stage_done(layout.ANNOTATED, annotate.get("hash")):
        raise FileNotFoundError(f"{run.output_dir(layout.ANNOTATED)}: the annotate stage has not finished; "
                                "run it first")
    if out.exists() and any(out.iterdir()):
        if not (out / "export.json").exists():
            raise FileExistsError(f"{out}: not empty and not an earlier export; choose another folder")
        shutil.rmtree(out)  # an earlier export: replace it whole, so no stale part survives
    concepts, library = load_library(run)
    memory_gb = config_from_dict(manifest["config"]).execution.memory_gb
    with scratch(out / ".tmp"), duckdb_session(out / ".tmp", memory_gb) as con:
        con.execute("CREATE TABLE pairs (concept_id BIGINT, part INTEGER, row BIGINT, chunk_id VARCHAR)")
        counts, cooccurrence, total = _chunks_and_pairs(run, out, con, len(concepts))
        _field_guide(con, out, counts)

    n = len(concepts)
    rows = [{"concept_id": c["concept_id"], "type": c["domain"], "name": c["name"], "description": c["description"],
             "taxonomy_path": c["taxonomy_path"], "chunk_count": int(counts[c["concept_id"]]),
             "prevalence": float(counts[c["concept_id"]] / max(total, 1))} for c in concepts]
    atomic_write_parquet(out / "concepts.parquet", pa.Table.from_pylist(rows, schema=CONCEPTS_SCHEMA))
    tmp = out / ".cooccurrence.npz.tmp"
    with open(tmp, "wb") as f:
        from scipy import sparse

        sparse.save_npz(f, cooccurrence.tocsr(), compressed=True)
    tmp.replace(out / "cooccurrence.npz")
    offsets = ", ".join(f"{d} from {o}" for d, o in library["domain_offsets"].items())
    name = manifest.get("name", run.root.name)
    atomic_write_bytes(out / "README.md",
                       README.format(name=name, n_chunks=total, n_concepts=n, offsets=offsets).encode())
    summary = {"chunks": total, "concepts": n, "concepts_used": int((counts > 0).sum()),
               "cooccurrence_nonzeros": int(cooccurrence.nnz), "out": str(out)}
    atomic_write_json(out / "export.json", summary)
    return summary


def _chunks_and_pairs(run: RunDir, out: Path, con, n: int):
    """Copy the annotated parts one at a time; count each concept's chunks and each pair of concepts; and put every
    (concept, chunk) in the ``pairs`` table, with where the chunk came from (part, row) for the field guide's order."""
    import pyarrow.compute as pc
    from scipy import sparse

    counts = np.zeros(n, dtype=np.int64)
    cooccurrence = sparse.csr_matrix((n, n), dtype=np.int64)
    total = 0
    for i, part in enumerate(run.parts(layout.ANNOTATED)):
        table = pq.read_table(part)
        atomic_write_parquet(out / "chunks" / f"part-{i:05d}.parquet", table)
        labels = table.column("concepts").combine_chunks()
        rows = pc.list_parent_indices(labels).to_numpy().astype(np.int64)
        cols = pc.list_flatten(labels).to_numpy().astype(np.int64)
        if len(cols) and cols.max() >= n:
            raise ValueError(f"{part}: concept id {int(cols.max())} is outside the library (0..{n - 1})")
        carries = sparse.csr_matrix((np.ones(len(rows), np.int64), (rows, cols)), shape=(table.num_rows, n))
        cooccurrence = cooccurrence + (carries.T @ carries).tocsr()
        counts += np.asarray(carries.sum(axis=0)).ravel()
        con.register("part_pairs", pa.table({"concept_id": cols, "part": np.full(len(rows), i, np.int32), "row": rows,
                                             "chunk_id": table.column("chunk_id").take(pa.array(rows))}))
        con.execute("INSERT INTO pairs SELECT * FROM part_pairs")
        con.unregister("part_pairs")
        total += table.num_rows
    return counts, cooccurrence, total


def _field_guide(con, out: Path, counts: np.ndarray) -> None:
    """For every concept, the chunks that carry it in corpus order (part, then row), FIELD_GUIDE_ROWS_PER_PART
    concepts a part."""
    n = len(counts)
    lists = SortedLists(record_batches(con, "SELECT concept_id, chunk_id FROM pairs ORDER BY concept_id, part, row"),
                        "concept_id", "chunk_id")
    for start in range(0, n, FIELD_GUIDE_ROWS_PER_PART):
        ids = np.arange(start, min(start + FIELD_GUIDE_ROWS_PER_PART, n), dtype=np.int64)
        path = out / "field_guide" / f"part-{start // FIELD_GUIDE_ROWS_PER_PART:05d}.parquet"
        with PartWriter(path, FIELD_GUIDE_SCHEMA, "chunk_ids") as writer:
            for rows in budget_slices(counts[ids]):  # a few concepts' chunk ids at a time
                writer.write(pa.table([pa.array(ids[rows]), lists.take(ids[rows], pa.string())],
                                      schema=FIELD_GUIDE_SCHEMA))
