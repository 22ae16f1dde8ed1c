"""``atlas export RUN OUT``: the release view of a run, as FineWeb-Atlas publishes it.

    OUT/chunks/part-*.parquet     chunk_id, doc_id, source_doc_id, data_src, domain, text, n_tokens,
                                  doc_end_flag, metadata, concepts, concept_scores, <domain>_global_ids
    OUT/concepts.parquet          concept_id, type (content | tone | demographic | alignment), is_tone,
                                  is_alignment, is_demographic (the type as flags, as Steerling's concept catalog
                                  marks them), name, description, taxonomy_path, chunk_count, prevalence (from the
                                  annotation)
    OUT/field_guide/part-*.parquet  concept_id, chunk_ids: which chunks carry each concept (reverse index), in
                                  corpus order; a concept carried by more than 100,000 chunks continues on the next
                                  rows (so no row grows with the corpus), a concept carried by none has one empty row
    OUT/cooccurrence.npz          scipy.sparse CSR [n_concepts, n_concepts]: chunks carrying both concepts
                                  (the diagonal is chunk_count); load with scipy.sparse.load_npz
    OUT/export.json               counts: chunks, concepts, and per label domain and data domain the chunks
                                  labeled and the labels (atlas.io.annotated.label_counts)
    OUT/README.md                 what each file holds; its YAML front matter (configs chunks, concepts, field_guide)
                                  lets ``datasets.load_dataset(OUT)`` read it, here or as a Hub dataset
                                  (``--push-to-hub``, atlas/tools/publish.py)

The parts are read one at a time. Memory holds the co-occurrence matrix (concepts x concepts, sparse) and one
part; the reverse index is grouped out of core: a second pass over the parts spills the (concept, chunk) pairs to
``OUT/.tmp/``, one file per range of concepts with about ``PAIRS_PER_PASS`` pairs, and each range is then put in
concept order on its own (a range of one concept is already in corpus order and streams through).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import ExitStack
from itertools import groupby
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from atlas.core.files import atomic_write_bytes, atomic_write_json, atomic_write_parquet
from atlas.core.ownership import NotOwned, claim, clear_owned
from atlas.core.rundir import RunDir
from atlas.io import layout
from atlas.io.annotated import count_summary, label_counts
from atlas.io.cards import front_matter
from atlas.io.library import DOMAIN_FLAGS, check_annotated, domain_flags, load_library
from atlas.io.outofcore import LIST_BUDGET, PAIRS_PER_PASS, PartWriter, budget_slices, scratch

CONCEPTS_SCHEMA = pa.schema(
    [("concept_id", pa.int64()), ("type", pa.string()), *((flag, pa.bool_()) for flag in DOMAIN_FLAGS),
     ("name", pa.string()), ("description", pa.string()), ("taxonomy_path", pa.string()), ("chunk_count", pa.int64()),
     ("prevalence", pa.float64())]
)
FIELD_GUIDE_SCHEMA = pa.schema([("concept_id", pa.int64()), ("chunk_ids", pa.list_(pa.string()))])
FIELD_GUIDE_ROWS_PER_PART = 4096  # concepts a part
FIELD_GUIDE_IDS_PER_ROW = 100_000  # a concept carried by more chunks continues on the next row
PAIR_SCHEMA = pa.schema([("concept_id", pa.int64()), ("chunk_id", pa.string())])
# The card's configs: `datasets.load_dataset(OUT)` gives the chunks, `load_dataset(OUT, "concepts")` the concepts.
# What an export writes in OUT: replacing an earlier export deletes these and nothing else.
EXPORT_FILES = ["README.md", "export.json", "concepts.parquet", "cooccurrence.npz", "chunks/part-*.parquet",
                "field_guide/part-*.parquet"]
RELEASE_CONFIGS = [
    {"config_name": "chunks", "default": True, "data_files": [{"split": "train", "path": "chunks/part-*.parquet"}]},
    {"config_name": "concepts", "data_files": [{"split": "train", "path": "concepts.parquet"}]},
    {"config_name": "field_guide", "data_files": [{"split": "train", "path": "field_guide/part-*.parquet"}]},
]
README = """# Atlas release view of run `{name}`

| file | rows | what |
|---|---:|---|
| `chunks/part-*.parquet` | {n_chunks:,} | the annotated chunks: text, metadata, concept ids (global) and scores |
| `concepts.parquet` | {n_concepts:,} | the concepts: id, type, `is_tone`, `is_alignment`, `is_demographic` (the \
type as flags), name, description, taxonomy path, chunk count, prevalence |
| `field_guide/part-*.parquet` | {n_guide_rows:,} | for every concept, the ids of the chunks that carry it \
(in corpus order; more than {ids_per_row:,} continue on the next rows) |
| `cooccurrence.npz` | {n_concepts:,} x {n_concepts:,} | chunks carrying both concepts \
(sparse; `scipy.sparse.load_npz`) |
| `export.json` | | counts; `label_counts`: per label domain and data domain, the chunks with at least one label of \
the domain (`chunks_labeled`) and the labels in all |

Concept ids are global: {offsets}. A chunk's `concepts` and `concept_scores` list its labels
domain by domain, best first; `<domain>_global_ids` split them by domain.

```python
from datasets import load_dataset

where = "ORG/NAME"  # its Hub repository, or the path of this folder
chunks = load_dataset(where, split="train")  # config `chunks`, the default
concepts = load_dataset(where, "concepts", split="train")
field_guide = load_dataset(where, "field_guide", split="train")
```

A label group is left out with its flag (`is_tone`, `is_alignment`, `is_demographic`; content concepts have all
three false): `concepts.filter(lambda c: not c["is_demographic"])`, in pandas `concepts[~concepts.is_demographic]`, in
DuckDB `FROM 'concepts.parquet' WHERE NOT is_demographic`. To drop the group's labels from the chunks as well (each
score goes with its id):

```python
dropped = set(concepts.filter(lambda c: c["is_demographic"])["concept_id"])

def drop(chunk):
    kept = [(g, p) for g, p in zip(chunk["concepts"], chunk["concept_scores"]) if g not in dropped]
    return {{"concepts": [g for g, _ in kept], "concept_scores": [p for _, p in kept]}}

chunks = chunks.map(drop).remove_columns("demographic_global_ids")
```
"""


def export_release(run_dir: str | Path, out: str | Path) -> dict:
    run, out = RunDir(run_dir), Path(out)
    manifest = run.read_manifest()
    annotate = manifest.get("stages", {}).get("annotate")
    if not annotate or not run.is_stage_done(layout.ANNOTATED, annotate.get("hash")):
        raise FileNotFoundError(f"{run.output_dir(layout.ANNOTATED)}: the annotate stage has not finished; "
                                "run it first")
    if out.resolve() == run.root.resolve() or run.root.resolve() in out.resolve().parents:
        raise NotOwned(f"export OUT {out}: inside the run directory {run.root}; choose a folder outside it")
    concepts, library = load_library(run)
    check_annotated(run, len(concepts))  # before OUT is touched: a damaged part must not cost the earlier export
    shard_labels = count_summary(label_counts(run))  # the same: read (and checked) before OUT is touched
    claim(out, "export", "export OUT")  # a folder of the user's is refused here, before anything is written
    clear_owned(out, EXPORT_FILES, "export OUT")  # an earlier export: replaced whole, so no stale part survives
    counts, cooccurrence, total = _chunks_and_counts(run, out, len(concepts))
    with scratch(out / ".tmp") as spill:
        n_guide_rows = _field_guide(run, out, counts, spill)

    n = len(concepts)
    rows = [{"concept_id": c["concept_id"], "type": c["domain"], **domain_flags(c["domain"]), "name": c["name"],
             "description": c["description"],
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
    readme = README.format(name=name, n_chunks=total, n_concepts=n, offsets=offsets, n_guide_rows=n_guide_rows,
                           ids_per_row=FIELD_GUIDE_IDS_PER_ROW)
    atomic_write_bytes(out / "README.md", (front_matter(RELEASE_CONFIGS) + "\n" + readme).encode())
    summary = {"chunks": total, "concepts": n, "concepts_used": int((counts > 0).sum()),
               "cooccurrence_nonzeros": int(cooccurrence.nnz), "label_counts": shard_labels, "out": str(out)}
    atomic_write_json(out / "export.json", summary)
    return summary


def _chunks_and_counts(run: RunDir, out: Path, n: int):
    """Copy the annotated parts one at a time; count each concept's chunks and each pair of concepts."""
    from scipy import sparse

    counts = np.zeros(n, dtype=np.int64)
    cooccurrence = sparse.csr_matrix((n, n), dtype=np.int64)
    total = 0
    for i, part in enumerate(run.parts(layout.ANNOTATED)):
        table = pq.read_table(part)
        atomic_write_parquet(out / "chunks" / f"part-{i:05d}.parquet", table)
        rows, cols = _labels(table, part, n)
        carries = sparse.csr_matrix((np.ones(len(rows), np.int64), (rows, cols)), shape=(table.num_rows, n))
        cooccurrence = cooccurrence + (carries.T @ carries).tocsr()
        counts += np.bincount(cols, minlength=n)
        total += table.num_rows
    return counts, cooccurrence, total


def _labels(table: pa.Table, part: Path, n: int) -> tuple[np.ndarray, np.ndarray]:
    """The (row, concept) pairs of a part's ``concepts`` lists."""
    import pyarrow.compute as pc

    labels = table.column("concepts").combine_chunks()
    rows = pc.list_parent_indices(labels).to_numpy().astype(np.int64)
    cols = pc.list_flatten(labels).to_numpy().astype(np.int64)
    if len(cols) and (cols.max() >= n or cols.min() < 0):
        bad = int(cols.max() if cols.max() >= n else cols.min())
        raise ValueError(f"{part}: concept id {bad} is outside the library (0..{n - 1})")
    return rows, cols


def _field_guide(run: RunDir, out: Path, counts: np.ndarray, spill: Path) -> int:
    """For every concept, the chunks that carry it in corpus order (part, then row), FIELD_GUIDE_ROWS_PER_PART
    concepts a part, at most FIELD_GUIDE_IDS_PER_ROW chunk ids a row. Returns the number of rows."""
    ranges = list(budget_slices(counts, PAIRS_PER_PASS))
    first_of_range = np.array([r.start for r in ranges], dtype=np.int64)
    with ExitStack() as files:
        writers: dict[int, pa.ipc.RecordBatchStreamWriter] = {}
        for part in run.parts(layout.ANNOTATED):
            table = pq.read_table(part, columns=["chunk_id", "concepts"])
            rows, cols = _labels(table, part, len(counts))
            order = np.lexsort((rows, cols))  # by concept, then row: the corpus order within each concept
            rows, cols = rows[order], cols[order]
            chunk_ids = table.column("chunk_id").take(pa.array(rows)).cast(pa.string())
            range_of = np.searchsorted(first_of_range, cols, side="right") - 1
            bounds = np.searchsorted(range_of, np.arange(len(ranges) + 1))
            for i in np.flatnonzero(np.diff(bounds)):
                if i not in writers:
                    writers[i] = files.enter_context(pa.ipc.new_stream(spill / f"range-{i:06d}.arrows", PAIR_SCHEMA))
                a, b = bounds[i], bounds[i + 1]
                writers[i].write_table(pa.table([pa.array(cols[a:b]), chunk_ids.slice(a, b - a)], schema=PAIR_SCHEMA))
    pieces = (piece for i, concepts in enumerate(ranges)
              for piece in _range_rows(spill / f"range-{i:06d}.arrows", concepts))
    n_rows = 0
    for part, part_pieces in groupby(pieces, key=lambda piece: piece[0] // FIELD_GUIDE_ROWS_PER_PART):
        with PartWriter(out / "field_guide" / f"part-{part:05d}.parquet", FIELD_GUIDE_SCHEMA, "chunk_ids") as writer:
            rows, ids = [], 0
            for concept, chunk_ids in part_pieces:
                rows.append(pa.record_batch([pa.array([concept], pa.int64()), pa.ListArray.from_arrays(
                    pa.array([0, len(chunk_ids)], pa.int32()), chunk_ids)], schema=FIELD_GUIDE_SCHEMA))
                ids += len(chunk_ids)
                if ids >= LIST_BUDGET:  # a few concepts' chunk ids at a time
                    writer.write(pa.Table.from_batches(rows))
                    rows, ids = [], 0
            if rows:
                writer.write(pa.Table.from_batches(rows))
        n_rows += writer.rows
    return n_rows


def _range_rows(path: Path, concepts: slice) -> Iterator[tuple[int, pa.Array]]:
    """(concept, chunk ids) for every concept of a range, in order: a concept's ids in corpus order, cut every
    FIELD_GUIDE_IDS_PER_ROW ids; a concept that no chunk carries gives one empty piece."""
    if not path.exists():
        ids_by_concept = {}
    elif concepts.stop - concepts.start == 1:  # one concept: already in corpus order, streamed
        yield from _cut(concepts.start, (batch.column(1) for batch in pa.ipc.open_stream(path)))
        return
    else:
        table = pa.ipc.open_stream(path).read_all()
        concept_of = table.column(0).to_numpy()
        order = np.argsort(concept_of, kind="stable")  # stable: each concept's ids stay in corpus order
        chunk_ids = table.column(1).take(pa.array(order)).combine_chunks()
        bounds = np.searchsorted(concept_of[order], np.arange(concepts.start, concepts.stop + 1))
        ids_by_concept = {c: chunk_ids.slice(bounds[k], bounds[k + 1] - bounds[k])
                          for k, c in enumerate(range(concepts.start, concepts.stop))}
    for concept in range(concepts.start, concepts.stop):
        yield from _cut(concept, [ids_by_concept.get(concept, pa.array([], pa.string()))])


def _cut(concept: int, arrays: Iterable[pa.Array]) -> Iterator[tuple[int, pa.Array]]:
    """Pieces of exactly FIELD_GUIDE_IDS_PER_ROW ids (the last one shorter, or empty when there are none), however
    the arrays arrive."""
    held, have, cut_any = [], 0, False
    for array in arrays:
        held.append(array)
        have += len(array)
        while have >= FIELD_GUIDE_IDS_PER_ROW:
            joined = pa.concat_arrays(held)
            yield concept, joined.slice(0, FIELD_GUIDE_IDS_PER_ROW)
            rest = joined.slice(FIELD_GUIDE_IDS_PER_ROW)
            held, have, cut_any = [rest], len(rest), True
    if have or not cut_any:
        yield concept, pa.concat_arrays(held) if held else pa.array([], pa.string())
