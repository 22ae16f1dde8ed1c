"""Stage ``label`` (global): each kept cluster -> a concept name and description (paper 4.2.2).

The labeler sees the cluster's ``library.label_tags`` most frequent tags (50-100 in the paper)
with their counts, and its ``EXAMPLES`` most representative chunks (those carrying the most of its
tags). With an LLM engine it answers ``{"name", "description"}`` under a JSON schema
(``prompts/label_cluster.yaml``); an answer that fails is replaced by the offline label and
counted. Offline (``atlas.models.labeler``), the name is the cluster's most representative and
distinctive tag, and the description lists its other evidence tags with a sentence of its most
representative chunk. No two concepts share a name: a repeated name gets the cluster's next most
representative tag.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from atlas.core.extras import llm_extras
from atlas.core.files import atomic_write_parquet
from atlas.core.rundir import RunDir
from atlas.core.stage import Stage
from atlas.core.stats import Stats
from atlas.io import layout
from atlas.io.chunks import read_chunks
from atlas.io.tags import load_vocab
from atlas.llm.engine import make_engine, setup_engine
from atlas.models.labeler import (
    example_sentence,
    label_prompt,
    llm_labels,
    make_unique,
    offline_description,
    offline_name,
    valid_name,
)

LABEL_VERSION = 2
EVIDENCE_KEPT = 20
EXAMPLES = 3  # representative chunks per cluster
LABEL_SCHEMA = pa.schema(
    [("cluster_id", pa.int64()), ("name", pa.string()), ("description", pa.string()),
     ("evidence_tags", pa.list_(pa.string())), ("n_tags", pa.int64()), ("count", pa.int64())]
)



class LabelStage(Stage):
    name = "label"
    output = layout.LABELS
    upstream = ("coherence",)
    needs = ("library",)

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
        from atlas.models.kmeans import members_of_clusters  # faiss and scikit-learn: the library extra

        _, vectors = load_vocab(run)
        clusters = pq.read_table(run.part_path(layout.CLUSTERS, 0)).to_pydict()
        centroids = np.load(run.output_dir(layout.CLUSTERS) / "_centroids.npy", allow_pickle=False)
        kept = [r["cluster_id"] for r in pq.read_table(run.part_path(layout.COHERENCE, 0)).to_pylist() if r["kept"]]
        labels, tags, counts = np.asarray(clusters["cluster_id"]), clusters["tag_norm"], np.asarray(clusters["count"])
        x = vectors.astype(np.float32)
        stats = Stats({"clusters_in": len(kept)})

        members_of = members_of_clusters(labels)
        tops = {}
        for cluster in kept:
            members = members_of[cluster]
            order = members[np.lexsort((np.array(tags, dtype=object)[members], -counts[members]))]
            tops[cluster] = order[: self.config.library.label_tags]
        examples = self._examples(run, {c: [tags[i] for i in top] for c, top in tops.items()})
        rows, evidence = [], []
        for cluster in kept:
            top = tops[cluster]
            others = centroids[np.arange(len(centroids)) != cluster]
            name = offline_name([tags[i] for i in top], counts[top], x[top], others)
            evidence_tags = [tags[i] for i in top[:EVIDENCE_KEPT]]
            texts = examples.get(cluster, [])
            description = offline_description(name, evidence_tags,
                                              example_sentence(texts[0], evidence_tags) if texts else None)
            rows.append({"cluster_id": cluster, "name": name, "description": description,
                         "evidence_tags": evidence_tags, "n_tags": len(members_of[cluster]),
                         "count": int(counts[members_of[cluster]].sum())})
            evidence.append([(tags[i], int(counts[i])) for i in top])
        if self.engine is not None:
            for row, answer in zip(rows, llm_labels(self.engine, evidence, [examples.get(c, []) for c in kept])):
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
        stats.inc("names_invalid", sum(not valid_name(r["name"]) for r in rows))
        atomic_write_parquet(run.part_path(self.output, 0), pa.Table.from_pylist(rows, schema=LABEL_SCHEMA))
        return stats

    @staticmethod
    def _examples(run: RunDir, top_tags: dict[int, list[str]]) -> dict[int, list[str]]:
        """Per cluster, the texts of its EXAMPLES chunks that carry the most of its top tags (ties: chunk id)."""
        vocab = pq.read_table(run.part_path(layout.TAG_VOCAB, 0), columns=["tag_norm", "chunk_ids"]).to_pydict()
        chunks_of_tag = dict(zip(vocab["tag_norm"], vocab["chunk_ids"]))
        chosen = {}
        for cluster, names in top_tags.items():
            hits = Counter(chunk for tag in names for chunk in chunks_of_tag.get(tag, ()))
            chosen[cluster] = sorted(hits, key=lambda c: (-hits[c], c))[:EXAMPLES]
        texts = read_chunks(run, {c for ids in chosen.values() for c in ids})
        return {cluster: [texts[c]["chunk_text"] for c in ids] for cluster, ids in chosen.items()}
