"""``atlas search RUN "query"``: the training chunks nearest to a text, through the run's IVFPQ index."""

from __future__ import annotations

import json

import pyarrow.dataset as ds
import pyarrow.parquet as pq

from atlas.core.rundir import RunDir
from atlas.io import layout


def search_run(run_dir, queries: list[str], k: int = 10, nprobe: int | None = None) -> list[list[dict]]:
    """The k nearest training chunks of each query text: embedded with the run's annotator encoder, searched in
    the run's index; each hit is {rank, score, row, chunk_id, doc_id, data_src, text}."""
    from atlas.models.annotator import Annotator
    from atlas.models.ivfpq import load_index, search

    run = RunDir(run_dir)
    folder = run.output_dir(layout.INDEX)
    info = json.loads((folder / "_index.json").read_text()) if (folder / "_index.json").exists() else {}
    index = load_index(folder, nprobe=nprobe or info.get("nprobe", 16))
    ids = pq.read_table(run.part_path(layout.INDEX, 0)).to_pydict()
    embedder = Annotator(run.output_dir(layout.ANNOTATOR)).setup().embedder
    scores, rows = search(index, embedder.encode(queries), k)
    wanted = {ids["chunk_id"][r] for row in rows for r in row if r >= 0}
    texts = dict(zip(*ds.dataset([str(p) for p in run.parts(layout.ANNOTATED)], format="parquet").to_table(
        columns=["chunk_id", "text"], filter=ds.field("chunk_id").isin(list(wanted))).to_pydict().values()))
    return [[{"rank": rank + 1, "score": float(s), "row": int(r), "chunk_id": ids["chunk_id"][r],
              "doc_id": ids["doc_id"][r], "data_src": ids["data_src"][r], "text": texts.get(ids["chunk_id"][r], "")}
             for rank, (s, r) in enumerate(zip(score_row, row)) if r >= 0]
            for score_row, row in zip(scores, rows)]
