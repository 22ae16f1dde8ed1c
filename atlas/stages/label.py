"""Stage ``label`` (global): each kept cluster -> a concept name and description (paper 4.2.2).

The labeler sees the cluster's ``library.label_tags`` most frequent tags (50-100 in the paper)
with their counts, and its ``EXAMPLES`` most representative chunks (those carrying the most of its
tags). With an LLM engine it answers ``{"name", "description"}`` under a JSON schema
(``prompts/label_cluster.yaml``); an answer that fails is replaced by the offline label and
counted. Offline (``atlas.models.labeler``), the name is the cluster's most representative and
distinctive tag (preferring a Library of Congress subject heading with ``library.name_headings: lcsh``),
and the description lists its other evidence tags with a sentence of its most representative chunk. No
two concepts share a name: a repeated name gets the cluster's next most representative tag.

Memory does not grow with the corpus: the tag vectors stay memory-mapped (only the kept clusters' top tags are
read), DuckDB chooses the example chunks from the top tags' (tag, chunk) pairs a bounded pass at a time
(``PAIRS_PER_PASS``), and only the chosen chunks' texts are read.
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
from atlas.io.chunks import read_chunks
from atlas.io.outofcore import PAIRS_PER_PASS, budget_slices, duckdb_session, scratch, sql_list
from atlas.io.tags import float_rows, load_vocab
from atlas.llm.engine import make_engine, setup_engine
from atlas.llm.offline import singular_name
from atlas.models.auxiliary import configured_domains, list_hashes
from atlas.models.headings import lcsh_file, load_headings
from atlas.models.labeler import (
    example_sentence,
    label_prompt,
    llm_labels,
    make_unique,
    offline_description,
    offline_name,
    valid_name,
)

LABEL_VERSION = 9  # 9: a tag that other tags name kinds of can name the cluster ("river"); 8: examples are statements
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
        # the auxiliary lists' names are reserved: a content concept never takes one
        identity = {"version": LABEL_VERSION, "label_tags": self.config.library.label_tags,
                    "aux_files": list_hashes(configured_domains(self.config))}
        if self.config.library.name_headings != "none":  # absent when off: runs made before it keep their identity
            identity["name_headings"] = lcsh_file().name
        if self.config.llm.engine == "offline":
            return identity
        return identity | {"engine": make_engine(self.config.llm).identity(), "prompt_sha256": label_prompt().sha256}

    def setup(self) -> None:
        self.engine = setup_engine(self.config.llm)  # None offline: the labels come from the evidence tags
        # compared as the tagger writes tags: the last word in the singular ("armies" -> "army")
        self.headings = {singular_name(h) for h in load_headings(self.config.library.name_headings)}

    def teardown(self) -> None:
        if self.engine is not None:
            self.engine.close()

    def run_shard(self, run: RunDir, shard: int) -> Stats:
        from atlas.models.kmeans import members_of_clusters  # faiss and scikit-learn: the library extra

        vocab, vectors = load_vocab(run, ["n_chunks"])  # float16, memory-mapped: only the top tags' rows are read
        clusters = pq.read_table(run.part_path(layout.CLUSTERS, 0), columns=["cluster_id", "count"])
        centroids = np.load(run.output_dir(layout.CLUSTERS) / layout.CLUSTER_CENTROIDS, allow_pickle=False)
        coherence = pq.read_table(run.part_path(layout.COHERENCE, 0), columns=["cluster_id", "kept"]).to_pylist()
        kept = [r["cluster_id"] for r in coherence if r["kept"]]
        labels, counts = clusters.column("cluster_id").to_numpy(), clusters.column("count").to_numpy()
        n_chunks = vocab.column("n_chunks").to_numpy()
        stats = Stats({"clusters_in": len(kept)})

        members_of = members_of_clusters(labels)
        tmp = run.output_dir(layout.TMP) / self.name  # spill files, removed after
        with scratch(tmp), duckdb_session(tmp, self.config.execution.memory_gb) as con:
            tops = self._top_tags(con, run, kept)
            chosen = self._examples(con, run, tops, np.array([n_chunks[top].sum() for top, _ in tops.values()]))
        found = read_chunks(run, {chunk for chunks in chosen.values() for chunk in chunks})
        examples = {cluster: [found[c]["chunk_text"] for c in chunks] for cluster, chunks in chosen.items()}
        rows, evidence = [], []
        for cluster in kept:
            top, names = tops[cluster]
            others = centroids[np.arange(len(centroids)) != cluster]
            is_heading = np.array([singular_name(t) in self.headings for t in names]) if self.headings else None
            name = offline_name(names, counts[top], float_rows(vectors, top), others, is_heading)
            evidence_tags = names[:EVIDENCE_KEPT]
            texts = examples.get(cluster, [])
            description = offline_description(name, evidence_tags, example_sentence(texts, evidence_tags))
            rows.append({"cluster_id": cluster, "name": name, "description": description,
                         "evidence_tags": evidence_tags, "n_tags": len(members_of[cluster]),
                         "count": int(counts[members_of[cluster]].sum())})
            evidence.append([(t, int(n)) for t, n in zip(names, counts[top])])
        if self.engine is not None:
            for row, answer in zip(rows, llm_labels(self.engine, evidence, [examples.get(c, []) for c in kept])):
                if answer is None:
                    stats.inc("labels_offline_fallback")
                else:
                    row["name"], row["description"] = answer
        rows.sort(key=lambda r: (-r["count"], r["cluster_id"]))  # the most used concept keeps a contested name
        aux_names = [n for d in configured_domains(self.config) for n in d.names]
        unique = make_unique([r["name"] for r in rows], [r["evidence_tags"] for r in rows], aux_names)
        stats.inc("names_disambiguated", sum(a != b for a, b in zip(unique, (r["name"] for r in rows))))
        for row, name in zip(rows, unique):
            row["name"] = name
        rows.sort(key=lambda r: r["cluster_id"])
        stats.inc("concepts_out", len(rows))
        stats.inc("names_invalid", sum(not valid_name(r["name"]) for r in rows))
        atomic_write_parquet(run.part_path(self.output, 0), pa.Table.from_pylist(rows, schema=LABEL_SCHEMA))
        return stats

    def _top_tags(self, con, run: RunDir, kept: list[int]) -> dict[int, tuple[np.ndarray, list[str]]]:
        """Per kept cluster: its ``library.label_tags`` most frequent tags (ties: by name), as their rows of the
        vocabulary and their names. DuckDB ranks them: the vocabulary's names are never all held here."""
        con.register("kept", pa.table({"cluster_id": pa.array(kept, pa.int64())}))
        rows, names = {}, {}
        for cluster, row, name in con.execute(f"""
                SELECT cluster_id, tag_row, tag_norm FROM (
                    SELECT cluster_id, file_row_number AS tag_row, tag_norm,
                           row_number() OVER (PARTITION BY cluster_id ORDER BY "count" DESC, tag_norm) AS r
                    FROM read_parquet({sql_list([run.part_path(layout.CLUSTERS, 0)])}, file_row_number = true)
                    WHERE cluster_id IN (SELECT cluster_id FROM kept))
                WHERE r <= {int(self.config.library.label_tags)} ORDER BY cluster_id, r""").fetchall():
            rows.setdefault(cluster, []).append(row)
            names.setdefault(cluster, []).append(name)
        return {cluster: (np.array(rows[cluster], dtype=np.int64), names[cluster]) for cluster in rows}

    def _examples(self, con, run: RunDir, tops: dict, pairs: np.ndarray) -> dict[int, list[str]]:
        """Per cluster of ``tops``: the ids of its EXAMPLES chunks that carry the most of its top tags (ties: chunk
        id). DuckDB counts the hits of the clusters whose top tags have about PAIRS_PER_PASS (tag, chunk) pairs at a
        time (``pairs``: per cluster)."""
        clusters, chosen = list(tops), {}
        # a chunk's hits: how many of its cluster's top tags it carries; only the top tags' chunk lists are unnested
        query = f"""SELECT cluster_id, chunk_id FROM (
                        SELECT t.cluster_id, v.chunk_id,
                               row_number() OVER (PARTITION BY t.cluster_id ORDER BY count(*) DESC, v.chunk_id) AS r
                        FROM top_tags t JOIN (SELECT tag_norm, unnest(chunk_ids) AS chunk_id
                                              FROM read_parquet({sql_list([run.part_path(layout.TAG_VOCAB, 0)])})
                                              WHERE tag_norm IN (SELECT tag_norm FROM top_tags)) v USING (tag_norm)
                        GROUP BY t.cluster_id, v.chunk_id)
                    WHERE r <= {EXAMPLES} ORDER BY cluster_id, r"""
        for part in budget_slices(pairs, PAIRS_PER_PASS):
            mine = [(cluster, tag) for cluster in clusters[part] for tag in tops[cluster][1]]
            con.register("top_tags", pa.table({"cluster_id": pa.array([c for c, _ in mine], pa.int64()),
                                               "tag_norm": pa.array([t for _, t in mine], pa.string())}))
            for cluster, chunk in con.execute(query).fetchall():
                chosen.setdefault(cluster, []).append(chunk)
            con.unregister("top_tags")
        return chosen
