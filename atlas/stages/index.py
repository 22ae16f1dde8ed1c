"""Stage ``index`` (global): FAISS IVFPQ over the chunk embeddings, for training-data attribution (paper 4.6).

Reads ``RUN/embeddings.zarr`` in batches (memory does not grow with the corpus) and builds the index
of ``atlas.index`` (inner product on normalized vectors, ``index.code_bytes`` PQ codes, nlist from
the documented rule, inverted lists on disk above a size threshold)::

    index/index.faiss (+ invlists.ondisk)   the index; row i of the embeddings has id i
    index/part-00000.parquet                the id map: row -> chunk_id, doc_id, data_src
    index/_index.json                       nlist, m, bytes per vector, self-recall@10 at nprobe

Quality is measured as the paper does: 1,000 indexed chunks are queried at ``index.nprobe`` and a
query succeeds when the chunk itself is in the top 10 (the paper: 0.968 at nprobe 16).
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from atlas.core.files import ArtifactError, atomic_write_json, atomic_write_parquet
from atlas.core.rundir import RunDir
from atlas.core.stage import Stage
from atlas.core.stats import Stats
from atlas.embeddings import open_embeddings

INDEX_VERSION = 1
RECALL_QUERIES = 1000
STORE = "embeddings.zarr"
REANNOTATE = "recompute it: atlas run CONFIG --force --stages annotate (then tokenize and index follow)"


class _CheckedRows:
    """The zarr embeddings as ``build_ivfpq`` reads them, with damage named: a storage chunk that is missing (zarr
    would read zeros) is found before the build, one that cannot be decoded when it is read."""

    def __init__(self, array, path):
        self.array, self.path, self.shape, self.dtype = array, path, array.shape, array.dtype
        size = array.chunks[0]
        missing = [f"{key} (rows {i * size}..{min((i + 1) * size, array.shape[0]) - 1})"
                   for i in range(array.cdata_shape[0])
                   if not (path / (key := array.metadata.encode_chunk_key((i, 0)))).is_file()]
        if missing:
            more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
            raise ArtifactError(f"{path}: storage chunk(s) {', '.join(missing[:5])}{more} missing; {REANNOTATE}")

    def _read(self, read, rows: np.ndarray):
        try:
            return read()
        except Exception as e:  # noqa: BLE001 - codecs raise anything (RuntimeError, ValueError...) on damaged bytes
            size = self.array.chunks[0]
            for chunk in np.unique(np.asarray(rows) // size).tolist():  # find the storage chunk that fails
                try:
                    self.array[chunk * size : (chunk + 1) * size]
                except Exception:  # noqa: BLE001
                    key, last = self.array.metadata.encode_chunk_key((chunk, 0)), (chunk + 1) * size - 1
                    raise ArtifactError(f"{self.path}: storage chunk {key} (rows {chunk * size}..{last}) cannot be "
                                        f"decoded ({type(e).__name__}: {e}); {REANNOTATE}") from None
            raise

    def __getitem__(self, key):
        rows = np.arange(*key.indices(self.shape[0])) if isinstance(key, slice) else key
        return self._read(lambda: self.array[key], rows)

    def get_orthogonal_selection(self, selection):
        return self._read(lambda: self.array.get_orthogonal_selection(selection), selection[0])


class IndexStage(Stage):
    name = "index"
    output = "index"
    kind = "global"
    upstream = ("annotate",)

    def identity(self) -> dict:
        return {"version": INDEX_VERSION, "index": self.config.index.model_dump()}

    def run_shard(self, run: RunDir, shard: int) -> Stats:
        from atlas.index import build_ivfpq, load_index, self_recall

        c = self.config.index
        store = open_embeddings(run.root)
        vectors = _CheckedRows(store["embeddings"], run.root / STORE / "embeddings")
        folder = run.output_dir(self.output)
        info = build_ivfpq(vectors, folder, code_bytes=c.code_bytes, nlist=c.nlist, on_disk=c.on_disk, seed=c.seed)
        index = load_index(folder, nprobe=c.nprobe)
        info["recall_at_10"] = self_recall(index, vectors, sample=RECALL_QUERIES, k=10, nprobe=c.nprobe, seed=c.seed)
        info["nprobe"] = c.nprobe
        id_map = pa.table({name: store[name][:].tolist() for name in ("chunk_id", "doc_id", "data_src")})
        atomic_write_parquet(run.part_path(self.output, 0), id_map)
        atomic_write_json(folder / "_index.json", info)
        return Stats({"vectors": int(info["n"]), "nlist": int(info["nlist"]),
                      "recall_at_10_permille": int(round(1000 * info["recall_at_10"]))})


def search_run(run_dir, queries: list[str], k: int = 10, nprobe: int | None = None) -> list[list[dict]]:
    """The k nearest training chunks of each query text: embedded with the run's annotator encoder, searched in
    the run's index; each hit is {rank, score, row, chunk_id, doc_id, data_src, text}."""
    import json

    import pyarrow.dataset as ds
    import pyarrow.parquet as pq

    from atlas.annotator import Annotator
    from atlas.index import load_index, search

    run = RunDir(run_dir)
    folder = run.output_dir(IndexStage.output)
    info = json.loads((folder / "_index.json").read_text()) if (folder / "_index.json").exists() else {}
    index = load_index(folder, nprobe=nprobe or info.get("nprobe", 16))
    ids = pq.read_table(run.part_path(IndexStage.output, 0)).to_pydict()
    embedder = Annotator(run.output_dir("annotator")).setup().embedder
    scores, rows = search(index, embedder.encode(queries), k)
    wanted = {ids["chunk_id"][r] for row in rows for r in row if r >= 0}
    texts = dict(zip(*ds.dataset(run.output_dir("annotated"), format="parquet").to_table(
        columns=["chunk_id", "text"], filter=ds.field("chunk_id").isin(list(wanted))).to_pydict().values()))
    return [[{"rank": rank + 1, "score": float(s), "row": int(r), "chunk_id": ids["chunk_id"][r],
              "doc_id": ids["doc_id"][r], "data_src": ids["data_src"][r], "text": texts.get(ids["chunk_id"][r], "")}
             for rank, (s, r) in enumerate(zip(score_row, row)) if r >= 0]
            for score_row, row in zip(scores, rows)]
