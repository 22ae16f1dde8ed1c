"""Reading what the annotated shards hold, ``RUN/annotated/part-*.parquet`` (columns: DESIGN.md's contract).

``label_counts`` counts the labels the parts carry, per label domain (content, tone, demographic, alignment: the
``<domain>_global_ids`` columns) and per chunk data domain (the ``domain`` column: web, code, ...). ``sample_chunks``
draws a seeded sample of the chunks that carry given labels, for a person to read. These are the labels a trainer
reads from the shards, not the annotator's held-out estimate (``annotator/metrics.json``), which can differ: the
held-out chunks are few, and are not the corpus.

Both read a part at a time and only the columns they need, so memory is bounded by one part (plus the counts, one
number per label and data domain), whatever the size of the corpus. Every part is read through the checked readers
(``atlas.core.files``): a damaged part, or one without a column, is an ArtifactError that names it.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from atlas.core.files import ArtifactError, open_parquet, read_json, read_parquet
from atlas.core.rundir import RunDir
from atlas.io import layout
from atlas.io.embedding_store import REANNOTATE

ALL = "all"  # the key of the total over every data domain
IDS_SUFFIX = "_global_ids"  # a label domain's column: f"{domain}{IDS_SUFFIX}"
UNKNOWN_DOMAIN = "unknown"  # a chunk without a data domain (null), counted apart


def annotated_parts(run: RunDir) -> list[Path]:
    """The parts of a finished annotate stage; before it has finished, FileNotFoundError (counts of half a corpus
    would pass for the whole)."""
    annotate = run.read_manifest().get("stages", {}).get("annotate")
    if not annotate or not run.is_stage_done(layout.ANNOTATED, annotate.get("hash")):
        raise FileNotFoundError(f"{run.output_dir(layout.ANNOTATED)}: the annotate stage has not finished; run it "
                                "first")
    return run.parts(layout.ANNOTATED)


def label_counts(run: RunDir) -> dict[str, dict[str, dict]]:
    """What the annotated parts hold: ``{label domain: {data domain: cell}}``, the data domains sorted and ``"all"``
    (their total) last, each cell::

        {"chunks": chunks of that data domain, "chunks_labeled": those with at least one label of the label domain,
         "labels": labels of the label domain in all, "per_label": {global id: chunks carrying it}}

    The label domains are the ``<domain>_global_ids`` columns of the first part, in its order; every part must have
    them. An id outside its domain's range in the library (``library/config.json``) is an ArtifactError that names
    the part and the row."""
    parts = annotated_parts(run)
    if not parts:
        return {}
    with open_parquet(parts[0], hint=REANNOTATE) as pf:
        domains = [name.removesuffix(IDS_SUFFIX) for name in pf.schema_arrow.names if name.endswith(IDS_SUFFIX)]
        # parts written without the chunk's data domain (an annotator applied to bare chunks) count as one unknown
        has_domain = "domain" in pf.schema_arrow.names
    columns = [f"{d}{IDS_SUFFIX}" for d in domains]
    ranges = _domain_ranges(run)
    chunks: Counter = Counter()
    labeled = {d: Counter() for d in domains}
    labels = {d: Counter() for d in domains}
    per_label: dict[str, dict[str, Counter]] = {d: {} for d in domains}
    for part in parts:
        table = read_parquet(part, ["domain", *columns] if has_domain else columns, hint=REANNOTATE)
        data_domain = (pc.fill_null(table.column("domain").combine_chunks(), UNKNOWN_DOMAIN).to_numpy(
            zero_copy_only=False) if has_domain else np.full(table.num_rows, UNKNOWN_DOMAIN, dtype=object))
        names, of_row = np.unique(data_domain, return_inverse=True)  # of_row: each row's data domain, as an index
        chunks.update(dict(zip(names.tolist(), np.bincount(of_row, minlength=len(names)).tolist())))
        for domain, column in zip(domains, columns):
            lists = table.column(column).combine_chunks()
            ids = pc.list_flatten(lists).to_numpy().astype(np.int64)
            rows = pc.list_parent_indices(lists).to_numpy().astype(np.int64)
            _check_range(part, column, ids, rows, ranges.get(domain))
            lengths = pc.fill_null(pc.list_value_length(lists), 0).to_numpy()
            labeled[domain].update(dict(zip(names.tolist(), np.bincount(
                of_row[lengths > 0], minlength=len(names)).tolist())))
            labels[domain].update(dict(zip(names.tolist(), np.bincount(
                of_row, weights=lengths, minlength=len(names)).astype(np.int64).tolist())))
            # a chunk counts once for a label, even where its list repeats it
            pairs = np.unique(np.stack([rows, ids], axis=1), axis=0) if len(ids) else np.empty((0, 2), np.int64)
            for index, name in enumerate(names.tolist()):
                carried, counts = np.unique(pairs[of_row[pairs[:, 0]] == index, 1], return_counts=True)
                per_label[domain].setdefault(name, Counter()).update(dict(zip(carried.tolist(), counts.tolist())))
    out: dict[str, dict[str, dict]] = {}
    for domain in domains:
        cells = {name: {"chunks": chunks[name], "chunks_labeled": labeled[domain][name],
                        "labels": labels[domain][name],
                        "per_label": dict(sorted(per_label[domain].get(name, Counter()).items()))}
                 for name in sorted(chunks)}
        total = Counter()
        for cell in cells.values():
            total.update(cell["per_label"])
        cells[ALL] = {"chunks": sum(chunks.values()), "chunks_labeled": sum(labeled[domain].values()),
                      "labels": sum(labels[domain].values()), "per_label": dict(sorted(total.items()))}
        out[domain] = cells
    return out


def count_summary(counts: dict[str, dict[str, dict]]) -> dict[str, dict[str, dict]]:
    """``label_counts`` without the per-label counts (short enough for a JSON summary: the counts per concept are
    ``chunk_count`` in the release's concepts.parquet)."""
    return {domain: {name: {k: v for k, v in cell.items() if k != "per_label"} for name, cell in cells.items()}
            for domain, cells in counts.items()}


def sample_chunks(run: RunDir, concept_ids, per_label: int = 3, seed: int = 0,
                  chars: int = 300) -> dict[int, list[dict]]:
    """Up to ``per_label`` chunks drawn at random (seeded: the same seed, the same chunks) among those whose
    ``concepts`` carry each of ``concept_ids``: ``{id: [{"chunk_id", "domain", "data_src", "text", "score"}, ...]}``
    in corpus order, ``text`` cut to ``chars`` characters, ``score`` the label's probability in the chunk. An id no
    chunk carries gets an empty list.

    One pass over the parts draws a random key for every chunk carrying a wanted label and keeps, per label, the
    chunks with the ``per_label`` smallest keys (a reservoir: a uniform sample without replacement, in memory bounded
    by ``per_label`` per label); only then are the kept chunks' text and ids read, from the parts that hold them."""
    wanted = np.array(sorted({int(c) for c in concept_ids}), dtype=np.int64)
    rng = np.random.default_rng(seed)
    # per label: (key, part, row, score) of the chunks kept so far
    kept: dict[int, list[tuple[float, int, int, float]]] = {int(c): [] for c in wanted}
    parts = annotated_parts(run)
    for number, part in enumerate(parts):
        if not len(wanted):
            break
        table = read_parquet(part, ["concepts", "concept_scores"], hint=REANNOTATE)
        lists, scores = table.column("concepts").combine_chunks(), table.column("concept_scores").combine_chunks()
        _check_aligned(part, lists, scores)
        ids = pc.list_flatten(lists).to_numpy().astype(np.int64)
        hits = np.flatnonzero(np.isin(ids, wanted))
        if not len(hits):
            continue
        keys = rng.random(len(hits))
        order = np.lexsort((keys, ids[hits]))  # by label, smallest key first
        hits, keys = hits[order], keys[order]
        labels = ids[hits]
        rank = np.arange(len(hits)) - np.searchsorted(labels, labels, side="left")  # place within its label
        rows = pc.list_parent_indices(lists).to_numpy()
        flat_scores = pc.list_flatten(scores).to_numpy()
        for hit, key, label in zip(hits[rank < per_label], keys[rank < per_label], labels[rank < per_label]):
            kept[int(label)].append((float(key), number, int(rows[hit]), float(flat_scores[hit])))
        for label in np.unique(labels).tolist():
            kept[label] = sorted(kept[label])[:per_label]
    return _with_text(parts, kept, chars)


def _with_text(parts: list[Path], kept: dict[int, list[tuple]], chars: int) -> dict[int, list[dict]]:
    """The kept chunks' ids, domains, sources and text, read from the parts that hold them (a part at a time)."""
    rows_of_part: dict[int, set[int]] = {}
    for entries in kept.values():
        for _, part, row, _ in entries:
            rows_of_part.setdefault(part, set()).add(row)
    found: dict[tuple[int, int], dict] = {}
    for part, rows in sorted(rows_of_part.items()):
        rows = sorted(rows)
        with open_parquet(parts[part], hint=REANNOTATE) as pf:
            present = [c for c in ("chunk_id", "domain", "data_src", "text") if c in pf.schema_arrow.names]
        table = read_parquet(parts[part], present, hint=REANNOTATE)
        for row, chunk in zip(rows, table.take(pa.array(rows, pa.int64())).to_pylist()):
            chunk = {"chunk_id": None, "domain": UNKNOWN_DOMAIN, "data_src": None, "text": None} | chunk
            text = chunk["text"] or ""
            chunk["text"] = text if len(text) <= chars else text[:chars] + " [...]"
            found[part, row] = chunk
    in_corpus_order = {label: sorted(entries, key=lambda e: (e[1], e[2])) for label, entries in kept.items()}
    return {label: [found[part, row] | {"score": score} for _, part, row, score in entries]
            for label, entries in in_corpus_order.items()}


def _domain_ranges(run: RunDir) -> dict[str, range]:
    """Each label domain's global ids, from the library's config.json (none when the library records none)."""
    path = run.output_dir(layout.LIBRARY) / "config.json"
    config = read_json(path) if path.exists() else {}
    sizes = config.get("domain_sizes", {})
    return {d: range(offset, offset + sizes.get(d, 0)) for d, offset in config.get("domain_offsets", {}).items()}


def _check_range(part: Path, column: str, ids: np.ndarray, rows: np.ndarray, ids_of_domain: range | None) -> None:
    if ids_of_domain is None or not len(ids):
        return
    outside = (ids < ids_of_domain.start) | (ids >= ids_of_domain.stop)
    if outside.any():
        first = int(np.argmax(outside))
        raise ArtifactError(f"{part}: row {int(rows[first])}: {column} holds concept id {int(ids[first])}, which is "
                            f"not a {column.removesuffix(IDS_SUFFIX)} label of the library (ids "
                            f"{ids_of_domain.start}..{ids_of_domain.stop - 1}); {REANNOTATE}")


def _check_aligned(part: Path, lists: pa.Array, scores: pa.Array) -> None:
    """``concept_scores`` has one score for every id of ``concepts``, row by row."""
    same = pc.equal(pc.fill_null(pc.list_value_length(lists), 0), pc.fill_null(pc.list_value_length(scores), 0))
    if len(same) and not pc.all(same).as_py():
        row = pc.index(same, False).as_py()
        raise ArtifactError(f"{part}: row {row}: concept_scores and concepts have different lengths; {REANNOTATE}")
