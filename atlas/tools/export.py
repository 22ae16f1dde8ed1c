"""``atlas export RUN OUT``: the release view of a run, as FineWeb-Atlas publishes it.

    OUT/chunks/part-*.parquet     chunk_id, doc_id, source_doc_id, data_src, domain, text, n_tokens,
                                  doc_end_flag, metadata, concepts, concept_scores, <domain>_global_ids
    OUT/concepts.parquet          concept_id, type (content | tone | demographic | alignment), name,
                                  description, taxonomy_path, chunk_count, prevalence (from the annotation)
    OUT/field_guide/part-*.parquet  concept_id, chunk_ids: which chunks carry each concept (reverse index)
    OUT/cooccurrence.npz          scipy.sparse CSR [n_concepts, n_concepts]: chunks carrying both concepts
                                  (the diagonal is chunk_count); load with scipy.sparse.load_npz
    OUT/README.md                 what each file holds

The parts are read one at a time. Memory holds the co-occurrence matrix (concepts x concepts,
sparse) and the reverse index as Arrow columns (about 30 bytes per (concept, chunk) pair), so a
corpus of hundreds of millions of chunks wants a machine sized for its reverse index.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from atlas.core.files import atomic_write_bytes, atomic_write_json, atomic_write_parquet
from atlas.core.rundir import RunDir
from atlas.io import layout
from atlas.io.library import load_library

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
    from scipy import sparse

    run, out = RunDir(run_dir), Path(out)
    annotate = run.read_manifest().get("stages", {}).get("annotate")
    if not annotate or not run.is_stage_done(layout.ANNOTATED, annotate.get("hash")):
        raise FileNotFoundError(f"{run.output_dir(layout.ANNOTATED)}: the annotate stage has not finished; "
                                "run it first")
    if out.exists() and any(out.iterdir()):
        if not (out / "export.json").exists():
            raise FileExistsError(f"{out}: not empty and not an earlier export; choose another folder")
        shutil.rmtree(out)  # an earlier export: replace it whole, so no stale part survives
    parts = run.parts(layout.ANNOTATED)
    concepts, library = load_library(run)
    n = len(concepts)
    counts = np.zeros(n, dtype=np.int64)
    cooccurrence = sparse.csr_matrix((n, n), dtype=np.int64)
    pairs = []  # (concept_id, chunk_id) per part, as Arrow tables: compact, grouped at the end
    total = 0
    for i, part in enumerate(parts):
        table = pq.read_table(part)
        atomic_write_parquet(out / "chunks" / f"part-{i:05d}.parquet", table)
        ids, labels = table.column("chunk_id").to_pylist(), table.column("concepts").to_pylist()
        rows = np.repeat(np.arange(len(labels)), [len(x) for x in labels])
        cols = np.fromiter((g for x in labels for g in x), dtype=np.int64, count=len(rows))
        if len(cols) and cols.max() >= n:
            raise ValueError(f"{part}: concept id {int(cols.max())} is outside the library (0..{n - 1})")
        carries = sparse.csr_matrix((np.ones(len(rows), np.int64), (rows, cols)), shape=(len(labels), n))
        cooccurrence = cooccurrence + (carries.T @ carries).tocsr()
        counts += np.asarray(carries.sum(axis=0)).ravel()
        pairs.append(pa.table({"concept_id": cols, "chunk_id": pa.array(ids).take(pa.array(rows))}))
        total += len(labels)

    rows = [{"concept_id": c["concept_id"], "type": c["domain"], "name": c["name"], "description": c["description"],
             "taxonomy_path": c["taxonomy_path"], "chunk_count": int(counts[c["concept_id"]]),
             "prevalence": float(counts[c["concept_id"]] / max(total, 1))} for c in concepts]
    atomic_write_parquet(out / "concepts.parquet", pa.Table.from_pylist(rows, schema=CONCEPTS_SCHEMA))
    grouped = pa.concat_tables(pairs).group_by("concept_id", use_threads=False).aggregate([("chunk_id", "list")])
    guide: list[list[str]] = [[] for _ in range(n)]
    for concept, chunks in zip(grouped.column("concept_id").to_pylist(), grouped.column("chunk_id_list").to_pylist()):
        guide[concept] = chunks
    for start in range(0, n, FIELD_GUIDE_ROWS_PER_PART):
        block = {"concept_id": list(range(start, min(start + FIELD_GUIDE_ROWS_PER_PART, n))),
                 "chunk_ids": guide[start : start + FIELD_GUIDE_ROWS_PER_PART]}
        atomic_write_parquet(out / "field_guide" / f"part-{start // FIELD_GUIDE_ROWS_PER_PART:05d}.parquet",
                             pa.table(block, schema=FIELD_GUIDE_SCHEMA))
    tmp = out / ".cooccurrence.npz.tmp"
    with open(tmp, "wb") as f:
        sparse.save_npz(f, cooccurrence.tocsr(), compressed=True)
    tmp.replace(out / "cooccurrence.npz")
    offsets = ", ".join(f"{d} from {o}" for d, o in library["domain_offsets"].items())
    name = run.read_manifest().get("name", run.root.name)
    atomic_write_bytes(out / "README.md",
                       README.format(name=name, n_chunks=total, n_concepts=n, offsets=offsets).encode())
    summary = {"chunks": total, "concepts": n, "concepts_used": int((counts > 0).sum()),
               "cooccurrence_nonzeros": int(cooccurrence.nnz), "out": str(out)}
    atomic_write_json(out / "export.json", summary)
    return summary
