"""``atlas search RUN "query"``: the training chunks nearest to a text, through the run's IVFPQ index."""

from __future__ import annotations

from atlas.core.files import ArtifactError, read_json, read_parquet
from atlas.core.rundir import RunDir
from atlas.io import layout

ID_COLUMNS = ["chunk_id", "doc_id", "data_src"]
REINDEX = "recompute it: atlas run CONFIG --force --stages index"


def search_run(run_dir, queries: list[str], k: int = 10, nprobe: int | None = None) -> list[list[dict]]:
    """The k nearest training chunks of each query text: embedded with the run's annotator encoder, searched in
    the run's index; each hit is {rank, score, row, chunk_id, doc_id, data_src, text}."""
    from atlas.io.chunks import filtered_rows
    from atlas.io.embedding_store import REANNOTATE
    from atlas.models.annotator import Annotator
    from atlas.models.ivfpq import load_index, search

    run = RunDir(run_dir)
    folder = run.output_dir(layout.INDEX)
    info = read_json(folder / "_index.json") if (folder / "_index.json").exists() else {}
    index = load_index(folder, nprobe=nprobe or info.get("nprobe", 16))
    id_map = run.part_path(layout.INDEX, 0)  # one id map, however many shards built the index
    ids = read_parquet(id_map, ID_COLUMNS, hint=REINDEX).to_pydict()
    if len(ids["chunk_id"]) != index.ntotal:
        raise ArtifactError(f"{id_map}: {len(ids['chunk_id'])} rows, but {folder / 'index.faiss'} holds "
                            f"{index.ntotal} vectors (row i names vector i); {REINDEX}")
    embedder = Annotator(run.output_dir(layout.ANNOTATOR)).setup().embedder
    scores, rows = search(index, embedder.encode(queries), k)
    found = sorted({int(r) for row in rows for r in row if r >= 0})
    if nameless := [r for r in found if not ids["chunk_id"][r]]:
        _no_chunk_id(run, id_map, nameless)
    wanted = {ids["chunk_id"][r] for r in found}
    texts = {row["chunk_id"]: row["text"]
             for row in filtered_rows(run.parts(layout.ANNOTATED), wanted, ("text",), hint=REANNOTATE)}
    if lost := sorted(wanted - set(texts)):
        raise ArtifactError(f"{id_map}: chunk {lost[0]!r} ({len(lost)} of the hits) is in no part of "
                            f"{run.output_dir(layout.ANNOTATED)}: the index is not of this annotation; {REINDEX}")
    return [[{"rank": rank + 1, "score": float(s), "row": int(r), "chunk_id": ids["chunk_id"][r],
              "doc_id": ids["doc_id"][r], "data_src": ids["data_src"][r], "text": texts[ids["chunk_id"][r]]}
             for rank, (s, r) in enumerate(zip(score_row, row)) if r >= 0]
            for score_row, row in zip(scores, rows)]


def _no_chunk_id(run: RunDir, id_map, rows: list[int]) -> None:
    """Hits without a chunk id: the id map was written from a store that had lost its ids (then the store is what
    must be rebuilt), or the id map itself was damaged."""
    from atlas.io.embedding_store import stored_ids

    stored_ids(run.root)  # an ArtifactError naming RUN/embeddings.zarr/chunk_id when the store lost them
    raise ArtifactError(f"{id_map}: row {rows[0]} has no chunk_id ({len(rows)} of the hits), though "
                        f"{run.root / layout.EMBEDDINGS} has every id; {REINDEX}")
