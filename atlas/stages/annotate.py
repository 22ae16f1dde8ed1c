"""Stage ``annotate`` (map): every chunk shard -> annotated Parquet + FP16 embeddings (paper 4.5).

Shard i of ``chunks/`` becomes ``annotated/part-i.parquet``: the chunk columns (``chunk_text``
is named ``text``, as in the release view) plus the trained annotator's labels::

    concepts                 list<int>   global ids, domain by domain (content, tone, demographic,
                                         alignment), best first within a domain
    concept_scores           list<float> probabilities, same order
    content_global_ids, tone_global_ids, demographic_global_ids, alignment_global_ids

The pooled embedding that the annotator's heads read is the chunk's embedding: one forward pass
gives both, and it goes to ``RUN/embeddings.zarr`` (float16, L2-normalized; see
``atlas.io.embedding_store``) at the chunk's global row, so row i of the annotated parts read in shard order
is row i of the embeddings. Chunks are read, encoded and written in blocks of
``annotate.block_rows``, so memory does not grow with the shard or the corpus.

**An annotator built elsewhere** (``annotate.annotator_from``: a finished run, or an annotator folder with its
library): the run chunks, annotates, tokenizes and indexes without tagging. The plan copies that annotator and
library into this run's ``annotator/`` and ``library/`` (so every reader of the run finds them where it always
does), checks the library against the annotator's recorded sha256, and writes where they came from to
``annotator/_source.json``. Their digests are part of this stage's identity: a retrained annotator reruns it.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from atlas.core.files import atomic_write_json, open_parquet, read_json
from atlas.core.rundir import RunDir
from atlas.core.stage import Stage
from atlas.core.stats import Stats
from atlas.io import layout
from atlas.io.embedding_store import ID_ARRAYS, create_store, finish, write_rows

ANNOTATE_VERSION = 2
SOURCE_FILE = "_source.json"  # in RUN/annotator/ of a run with annotate.annotator_from
CHUNK_COLUMNS = ("chunk_text", *ID_ARRAYS)  # what a chunk part must hold for this stage (all of it is copied)


def annotated_schema(chunk_schema: pa.Schema, domains: list[str]) -> pa.Schema:
    fields = [pa.field("text", pa.string()) if f.name == "chunk_text" else f for f in chunk_schema]
    ids = pa.list_(pa.int64())
    return pa.schema(fields + [pa.field("concepts", ids), pa.field("concept_scores", pa.list_(pa.float32()))]
                     + [pa.field(f"{d}_global_ids", ids) for d in domains])


class AnnotateStage(Stage):
    name = "annotate"
    output = layout.ANNOTATED
    upstream = ("chunk", "train_annotator")
    needs = ("embed",)
    extra_outputs = (layout.EMBEDDINGS,)

    def __init__(self, config):
        super().__init__(config)
        if config.annotate.annotator_from:  # no library stages in this run: its annotator comes from elsewhere
            self.upstream = ("chunk",)
            self.extra_outputs = (layout.EMBEDDINGS, layout.LIBRARY, layout.ANNOTATOR)

    def identity(self) -> dict:
        c = self.config.annotate
        identity = {"version": ANNOTATE_VERSION, "block_rows": c.block_rows, "chunk_rows": c.zarr_chunk_rows,
                    "encode_batch_size": c.batch_size}
        if c.annotator_from:
            from atlas.io.library import annotator_source, folder_digest

            annotator, library = annotator_source(c.annotator_from)
            identity["annotator_from"] = {"annotator": folder_digest(annotator), "library": folder_digest(library)}
        return identity

    def _import_annotator(self, run: RunDir) -> None:
        """Copy the annotator and library of ``annotate.annotator_from`` into this run (once; see the docstring)."""
        from atlas.io.library import annotator_source, import_folder

        annotator, library = annotator_source(self.config.annotate.annotator_from)
        import_folder(library, run.output_dir(layout.LIBRARY))
        import_folder(annotator, run.output_dir(layout.ANNOTATOR))
        self._checked_annotator(run)  # the copied library is the file the annotator was trained on
        trained_on = read_json(annotator / "config.json").get("library_sha256")
        source = {"annotator_from": str(self.config.annotate.annotator_from), "annotator": str(annotator),
                  "library": str(library), "library_sha256": trained_on}
        atomic_write_json(run.output_dir(layout.ANNOTATOR) / SOURCE_FILE, source)

    def plan(self, run: RunDir, stage_hash: str) -> int:
        """Row offsets of every shard in the embedding store, and the store itself (once per hash)."""
        if self.config.annotate.annotator_from:
            self._import_annotator(run)
        n_shards = run.read_manifest()["stages"]["chunk"]["num_shards"]
        if not (run.success_path(layout.CHUNKS).exists()
                and (run.output_dir(layout.ANNOTATOR) / "config.json").exists()):
            return n_shards  # planned ahead (atlas plan, or before the flow starts): the store comes later
        spec = self._checked_annotator(run).spec  # before anything is written: a bad input stops here, once
        counts = []
        for shard in range(n_shards):
            with open_parquet(run.part_path(layout.CHUNKS, shard), CHUNK_COLUMNS) as part:
                counts.append(part.metadata.num_rows)
        offsets = np.concatenate([[0], np.cumsum(counts)]).astype(int).tolist()
        plan_path = run.output_dir(self.output) / "_plan.json"
        plan = {"stage_hash": stage_hash, "shard_rows": counts, "shard_offsets": offsets[:-1], "n_rows": offsets[-1]}
        store = run.root / layout.EMBEDDINGS
        existing = read_json(plan_path) if plan_path.exists() else None
        if existing != plan or not (store / "zarr.json").exists():
            create_store(store, offsets[-1], spec.dim, self.config.annotate.zarr_chunk_rows,
                         {"stage_hash": stage_hash, "encoder": spec.encoder, "shard_offsets": offsets[:-1]})
            for marker in run.output_dir(self.output).glob("_shards/*.json"):  # a new store: redo every shard
                marker.unlink()
            atomic_write_json(plan_path, plan)
        return n_shards

    def _checked_annotator(self, run: RunDir):
        """The trained annotator, checked against the library it labels with: the same concept counts, and the
        very file it was trained on (cheap: the weights are checked, the encoder is not loaded)."""
        from atlas.io.library import load_library
        from atlas.models.annotator import Annotator

        annotator = Annotator(run.output_dir(layout.ANNOTATOR), device=self.config.annotate.device,
                              batch_size=self.config.annotate.batch_size)
        concepts, _ = load_library(run)
        annotator.check_library(concepts)
        annotator.check_library_file(run.output_dir(layout.LIBRARY) / "concepts.parquet")
        annotator.heads = annotator.load_heads()
        return annotator

    def setup(self) -> None:
        self.annotator = self._checked_annotator(RunDir(self.config.run_dir)).setup()

    def run_shard(self, run: RunDir, shard: int) -> Stats:
        plan = read_json(run.output_dir(self.output) / "_plan.json")
        start, n = plan["shard_offsets"][shard], plan["shard_rows"][shard]
        source = open_parquet(run.part_path(layout.CHUNKS, shard), CHUNK_COLUMNS)
        domains = list(self.annotator.spec.domains)
        schema = annotated_schema(source.schema_arrow, domains)
        target = run.part_path(self.output, shard)
        tmp = target.with_name(f".{target.name}.tmp")
        stats = Stats({"chunks": n})
        vectors, ids = [], {name: [] for name in ID_ARRAYS}
        with pq.ParquetWriter(tmp, schema, compression="zstd") as writer:
            for batch in source.iter_batches(batch_size=self.config.annotate.block_rows):
                table = pa.Table.from_batches([batch])
                embeddings = self.annotator.embedder.encode(table.column("chunk_text").to_pylist())
                decided = self.annotator.decide(self.annotator.probabilities(embeddings), embeddings)
                writer.write_table(self._annotated(table, decided, domains, schema, stats))
                vectors.append(embeddings.astype(np.float16))
                for name in ID_ARRAYS:
                    ids[name].append(np.asarray(table.column(name).to_pylist(), dtype=np.str_))
        tmp.replace(target)
        dim = self.annotator.spec.dim
        arrays = {"embeddings": np.concatenate(vectors) if vectors else np.zeros((0, dim), np.float16)}
        arrays |= {name: np.concatenate(v) if v else np.zeros(0, np.str_) for name, v in ids.items()}
        write_rows(run.root / layout.EMBEDDINGS, shard, start, start + n, arrays)
        return stats

    @staticmethod
    def _annotated(table: pa.Table, decided: list[dict], domains: list[str], schema: pa.Schema,
                   stats: Stats) -> pa.Table:
        columns = {("text" if name == "chunk_text" else name): table.column(name) for name in table.column_names}
        columns["concepts"] = [[g for d in domains for g, _ in row[d]] for row in decided]
        columns["concept_scores"] = [[p for d in domains for _, p in row[d]] for row in decided]
        for d in domains:
            columns[f"{d}_global_ids"] = [[g for g, _ in row[d]] for row in decided]
            stats.inc(f"labels_{d}", sum(len(row[d]) for row in decided))
        stats.inc("chunks_without_content", sum(not row["content"] for row in decided))
        return pa.table({name: columns[name] for name in schema.names}, schema=schema)

    def finalize(self, run: RunDir, stats: Stats) -> None:
        plan = read_json(run.output_dir(self.output) / "_plan.json")
        if (run.root / layout.EMBEDDINGS / "_staging").exists():
            stats.inc("embedding_rows_from_staging", finish(run.root / layout.EMBEDDINGS, len(plan["shard_rows"])))
