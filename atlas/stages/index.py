"""Stage ``index`` (map + merge): FAISS IVFPQ over the chunk embeddings, for training-data attribution (paper 4.6).

The index of ``atlas.models.ivfpq`` (inner product on normalized vectors, ``index.code_bytes`` PQ codes, nlist from
the documented rule, inverted lists on disk above a size threshold), built in three steps over ``RUN/embeddings.zarr``:

1. ``plan`` (the driver, once): train the quantizer on a seeded sample of all the embeddings, read in batches, and
   save the trained, empty index. The shards are the annotate stage's: shard i adds the embedding rows that
   annotated part i wrote (the store's ``shard_offsets``).
2. ``run_shard`` (any worker: inline, Prefect, Ray, a SLURM array task): encode shard i's rows, a batch at a time,
   with ids = their global row numbers, into a part file of inverted lists.
3. ``finalize`` (the driver): merge the parts in shard order into the index, write the id map and measure recall.

Training, encoding and the merge are those of the one-process ``build_ivfpq``, and shard order is row order, so the
index is the one it builds (the tests compare them), and a rerun after a kill writes the same bytes. Memory holds one
batch, plus the training sample in ``plan``, one shard's codes in ``run_shard`` (72 bytes a chunk) and one part at a
time in an on-disk merge; never the whole corpus, except the lists of an in-memory index (below 2M vectors).

    index/index.faiss (+ invlists.ondisk)   the index; row i of the embeddings has id i
    index/part-00000.parquet                the id map: row -> chunk_id, doc_id, data_src
    index/_index.json                       nlist, m, bytes per vector, self-recall@10 at nprobe
    index/trained.faiss                     the trained, empty index the shards encoded with
    index/_plan.json                        the shards' row ranges and the training summary
    index/_parts/shard-00000.npz            shard i's inverted lists, until they are merged

Quality is measured as the paper does: 1,000 indexed chunks are queried at ``index.nprobe`` and a query succeeds when
the chunk itself is in the top 10 (the paper: 0.968 at nprobe 16).
"""

from __future__ import annotations

import os
import shutil

import pyarrow as pa
import pyarrow.parquet as pq

from atlas.core.files import ArtifactError, atomic_write_json, read_json
from atlas.core.rundir import RunDir
from atlas.core.stage import Stage
from atlas.core.stats import Stats
from atlas.io import layout
from atlas.io.embedding_store import CheckedRows, open_embeddings

INDEX_VERSION = 2  # 2: map + merge (trained.faiss, one part per annotate shard)
RECALL_QUERIES = 1000
TRAINED = "trained.faiss"
PARTS = "_parts"
ID_COLUMNS = ("chunk_id", "doc_id", "data_src")
ID_MAP_BATCH = 64_000  # rows of the id map read and written at a time (one Parquet row group)


class IndexStage(Stage):
    name = "index"
    output = layout.INDEX
    upstream = ("annotate",)
    needs = ("library",)

    def identity(self) -> dict:
        return {"version": INDEX_VERSION, "index": self.config.index.model_dump()}

    def plan(self, run: RunDir, stage_hash: str) -> int:
        """Train the index once per stage hash; the shards are the annotate stage's."""
        from atlas.models.ivfpq import train_ivfpq

        annotate = run.read_manifest()["stages"]["annotate"]
        folder = run.output_dir(self.output)
        plan_path = folder / "_plan.json"
        if not run.is_stage_done(layout.ANNOTATED, annotate["hash"]):
            # Planned ahead (atlas plan, before the annotate array ran): training waits for the embeddings, and a
            # plan of an earlier run must not be mistaken for this one's by a shard.
            plan_path.unlink(missing_ok=True)
            return annotate["num_shards"]
        store = open_embeddings(run.root)
        plan = {"stage_hash": stage_hash, "n_rows": int(store.attrs["n_rows"]),
                "shard_offsets": [int(offset) for offset in store.attrs["shard_offsets"]]}
        existing = read_json(plan_path) if plan_path.exists() else {}
        if {key: existing.get(key) for key in plan} == plan and (folder / TRAINED).exists():
            return len(plan["shard_offsets"])  # trained already (a resumed run)
        c = self.config.index
        trained = train_ivfpq(self._vectors(run, store), folder / TRAINED, code_bytes=c.code_bytes, nlist=c.nlist,
                              seed=c.seed)
        # Parts encoded with an earlier training are stale: their shards run again.
        for marker in folder.glob("_shards/*.json"):
            marker.unlink()
        shutil.rmtree(folder / PARTS, ignore_errors=True)
        atomic_write_json(plan_path, plan | {"trained": trained})
        return len(plan["shard_offsets"])

    def run_shard(self, run: RunDir, shard: int) -> Stats:
        from atlas.models.ivfpq import add_part

        folder = run.output_dir(self.output)
        plan = self._plan(run)
        store = open_embeddings(run.root)
        bounds = plan["shard_offsets"] + [plan["n_rows"]]
        added = add_part(folder / TRAINED, self._vectors(run, store), bounds[shard], bounds[shard + 1],
                         self._part(run, shard))
        return Stats({"vectors": added})

    def finalize(self, run: RunDir, stats: Stats) -> None:
        """Merge the parts, then write the id map and ``_index.json``; the parts go last, once all that is written.

        A kill before that leaves the parts, and the rerun merges them again; a kill after it leaves no parts, and
        the rerun (its shards are done) finds the finished index.
        """
        from atlas.models.ivfpq import load_index, merge_parts, self_recall

        c = self.config.index
        folder = run.output_dir(self.output)
        plan = self._plan(run)
        merged = folder / f"{PARTS}.merged"
        if (folder / PARTS).exists():
            parts = [self._part(run, shard) for shard in range(len(plan["shard_offsets"]))]
            info = merge_parts(folder / TRAINED, parts, folder, on_disk=c.on_disk)
            if info["n"] != plan["n_rows"]:
                raise ArtifactError(f"{folder / PARTS}: the parts hold {info['n']} vectors, the embeddings "
                                    f"{plan['n_rows']}; recompute the index: atlas run CONFIG --force --stages index")
            store = open_embeddings(run.root)
            self._write_id_map(run, store)
            vectors = self._vectors(run, store)
            index = load_index(folder, nprobe=c.nprobe)
            info["recall_at_10"] = self_recall(index, vectors, sample=RECALL_QUERIES, k=10, nprobe=c.nprobe,
                                               seed=c.seed)
            del index
            trained = plan["trained"]
            info |= {"nprobe": c.nprobe, "train_size": trained["train_size"],
                     "train_seconds": trained["train_seconds"]}
            atomic_write_json(folder / "_index.json", info)
            (folder / PARTS).rename(merged)  # one rename: a kill while deleting leaves no half set of parts
        shutil.rmtree(merged, ignore_errors=True)
        if not (folder / "_index.json").exists():
            raise ArtifactError(f"{folder}: neither the index parts nor a merged index; recompute the index: "
                                "atlas run CONFIG --force --stages index")
        info = read_json(folder / "_index.json")
        stats.inc("nlist", int(info["nlist"]))
        stats.inc("recall_at_10_permille", int(round(1000 * info["recall_at_10"])))

    # ---------------------------------------------------------------------------------------------------------------

    @staticmethod
    def _vectors(run: RunDir, store) -> CheckedRows:
        return CheckedRows(store["embeddings"], run.root / layout.EMBEDDINGS / "embeddings")

    def _part(self, run: RunDir, shard: int):
        return run.output_dir(self.output) / PARTS / f"shard-{shard:05d}.npz"

    def _plan(self, run: RunDir) -> dict:
        path = run.output_dir(self.output) / "_plan.json"
        if not path.exists():
            raise ArtifactError(f"{path}: missing: the index is trained when it is planned after the annotate stage "
                                "finished; run `atlas plan CONFIG --stages index` (or `atlas run`) again")
        return read_json(path)

    def _write_id_map(self, run: RunDir, store) -> None:
        """``part-00000.parquet``: row i of the embeddings -> its ids, written ID_MAP_BATCH rows at a time."""
        path = run.part_path(self.output, 0)
        tmp = path.with_name(f".{path.name}.tmp")
        schema = pa.schema([(name, pa.string()) for name in ID_COLUMNS])
        n = int(store.attrs["n_rows"])
        with pq.ParquetWriter(tmp, schema, compression="zstd") as writer:
            for start in range(0, n, ID_MAP_BATCH):
                end = min(n, start + ID_MAP_BATCH)
                writer.write_table(pa.table({name: store[name][start:end].tolist() for name in ID_COLUMNS},
                                            schema=schema))
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
