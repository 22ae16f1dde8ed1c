"""Stage ``label`` (global): each kept cluster -> a concept name and description (paper 4.2.2).

The labeler sees the cluster's ``library.label_tags`` most frequent tags (50-100 in the paper)
with their counts. With an LLM engine it answers ``{"name", "description"}`` under a JSON schema
(``prompts/label_cluster.yaml``); an answer that fails is replaced by the offline label and
counted. Offline, the name is the cluster's medoid tag (the one closest, weighted by frequency, to
the other representative tags) and the description is a sentence built from the evidence tags.
No two concepts share a name: a repeated name gets the cluster's next most representative tag.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from atlas.core.extras import llm_extras
from atlas.core.files import atomic_write_parquet
from atlas.core.rundir import RunDir
from atlas.core.stage import Stage
from atlas.core.stats import Stats
from atlas.io import layout
from atlas.io.tags import load_vocab
from atlas.llm.engine import make_engine, setup_engine
from atlas.models.labeler import label_prompt, llm_labels, make_unique, offline_label

LABEL_VERSION = 1
EVIDENCE_KEPT = 20
LABEL_SCHEMA = pa.schema(
    [("cluster_id", pa.int64()), ("name", pa.string()), ("description", pa.string()),
     ("evidence_tags", pa.list_(pa.string())), ("n_tags", pa.int64()), ("count", pa.int64())]
)



class LabelStage(Stage):
    name = "label"
    output = layout.LABELS
    upstream = ("coherence",)

    def extras(self) -> tuple[str, ...]:
        return self.needs + llm_extras(self.config.llm.engine)

    def identity(self) -> dict:
        identity = {"version": LABEL_VERSION, "label_tags": self.config.library.label_tags}
        if self.config.llm.engine == "offline":
            return identity
        return identity | {"engine": make_engine(self.config.llm).identity(), "prompt_sha256": label_prompt().sha256}

    def setup(self) -> None:
        self.engine = setup_engine(self.config.llm)  # None offline: the labels come from the evidence tags

    def teardown(self) -> None:
        if self.engine is not None:
            self.engine.close()

    def run_shard(self, run: RunDir, shard: int) -> Stats:
        _, vectors = load_vocab(run)
        clusters = pq.read_table(run.part_path(layout.CLUSTERS, 0)).to_pydict()
        kept = [r["cluster_id"] for r in pq.read_table(run.part_path(layout.COHERENCE, 0)).to_pylist() if r["kept"]]
        labels, tags, counts = np.asarray(clusters["cluster_id"]), clusters["tag_norm"], np.asarray(clusters["count"])
        x = vectors.astype(np.float32)
        stats = Stats({"clusters_in": len(kept)})

        rows, evidence = [], []
        for cluster in kept:
            members = np.flatnonzero(labels == cluster)
            order = members[np.lexsort((np.array(tags, dtype=object)[members], -counts[members]))]
            top = order[: self.config.library.label_tags]
            name, description = offline_label([tags[i] for i in top], counts[top].astype(float), x[top])
            rows.append({"cluster_id": cluster, "name": name, "description": description,
                         "evidence_tags": [tags[i] for i in top[:EVIDENCE_KEPT]], "n_tags": len(members),
                         "count": int(counts[members].sum())})
            evidence.append([(tags[i], int(counts[i])) for i in top])
        if self.engine is not None:
            for row, answer in zip(rows, llm_labels(self.engine, evidence)):
                if answer is None:
                    stats.inc("labels_offline_fallback")
                else:
                    row["name"], row["description"] = answer
        rows.sort(key=lambda r: (-r["count"], r["cluster_id"]))  # the most used concept keeps a contested name
        unique = make_unique([r["name"] for r in rows], [r["evidence_tags"] for r in rows])
        stats.inc("names_disambiguated", sum(a != b for a, b in zip(unique, (r["name"] for r in rows))))
        for row, name in zip(rows, unique):
            row["name"] = name
        rows.sort(key=lambda r: r["cluster_id"])
        stats.inc("concepts_out", len(rows))
        atomic_write_parquet(run.part_path(self.output, 0), pa.Table.from_pylist(rows, schema=LABEL_SCHEMA))
        return stats
