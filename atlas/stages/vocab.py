"""Stage ``vocab`` (global): tags -> the tag vocabulary and its embeddings (paper 4.2.2, first step).

Reads every tag shard and writes one row per normalized tag, most frequent first:

    tag_vocab/part-00000.parquet   tag_norm, count (occurrences), n_chunks, fields (where it was used),
                                   variants (up to 5 spellings as produced), chunk_ids (the chunks it came from)
    tag_vocab/_embeddings.npy       float16 [n_tags, d], L2-normalized, row i = tag i

Only the tags of the fields whose schema role is in ``vocab.roles`` enter (default: the topic fields,
so "how it is written" never becomes a content concept). Tags seen fewer than ``vocab.min_count``
times, generic tags (on more than ``vocab.max_chunk_share`` of the tagged chunks, and more than
``vocab.generic_min_chunks``: document frequency, the corpus statistic behind IDF and c-TF-IDF),
and single words outside the English lexicon seen in one chunk only (typos, code fragments, stray
strings) are left out and counted.
Embeddings are cached in
``RUN/_cache/embeddings/`` (FP16, keyed by model and tag), so a rerun, or a vocabulary that gained
tags, only embeds what is new. The vocabulary is embedded in fixed batches of its sorted order and
a batch is computed whole or taken whole from the cache, so a resumed run gives the same bytes as
an uninterrupted one.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from atlas.core.files import atomic_write_npy, atomic_write_parquet
from atlas.core.rundir import RunDir
from atlas.core.stage import Stage
from atlas.core.stats import Stats
from atlas.io import layout
from atlas.io.tags import VOCAB_SCHEMA, read_tags
from atlas.llm.answers import field_roles, load_schemas
from atlas.llm.offline import in_lexicon
from atlas.models.embedder import Embedder, encode_cached

VOCAB_VERSION = 2
MAX_VARIANTS = 5


class VocabStage(Stage):
    name = "vocab"
    output = layout.TAG_VOCAB
    upstream = ("tag",)
    needs = ("embed",)

    def identity(self) -> dict:
        return {"version": VOCAB_VERSION, "vocab": self.config.vocab.model_dump()}

    def setup(self) -> None:
        self.embedder = Embedder(self.config.vocab.embedding_model)

    def run_shard(self, run: RunDir, shard: int) -> Stats:
        import pyarrow.compute as pc

        v = self.config.vocab
        tags = read_tags(run, ["chunk_id", "field", "tag", "tag_norm"])
        stats = Stats({"tags_in": tags.num_rows})
        tagged_chunks = len(pc.unique(tags.column("chunk_id")))
        roles = field_roles(load_schemas(self.config.tag)[0])
        fields = [f for f in pc.unique(tags.column("field")).to_pylist() if roles.get(f, "topic") in v.roles]
        kept_rows = tags.filter(pc.is_in(tags.column("field"), pa.array(fields, pa.string())))
        stats.drop("style_field_tags", tags.num_rows - kept_rows.num_rows)
        tags = kept_rows
        grouped = tags.group_by("tag_norm").aggregate(
            [("chunk_id", "count"), ("chunk_id", "distinct"), ("field", "distinct"), ("tag", "distinct")]
        )
        rows = [
            {"tag_norm": r["tag_norm"], "count": r["chunk_id_count"], "n_chunks": len(r["chunk_id_distinct"]),
             "fields": sorted(r["field_distinct"]), "variants": sorted(r["tag_distinct"])[:MAX_VARIANTS],
             "chunk_ids": sorted(r["chunk_id_distinct"])}
            for r in grouped.to_pylist()
        ]
        stats.inc("unique_tags", len(rows))
        kept = [r for r in rows if r["count"] >= v.min_count]
        stats.drop("below_min_count", len(rows) - len(kept))
        specific = [r for r in kept if r["n_chunks"] <= max(v.max_chunk_share * tagged_chunks, v.generic_min_chunks)]
        stats.drop("generic_tags", len(kept) - len(specific))
        # one word outside the English lexicon, in one chunk: mostly typos, code fragments and stray strings
        # ("cabracadabrarrarrad", "segt"), which k-means gathers into junk clusters by their subwords
        kept = [r for r in specific if r["n_chunks"] > 1 or " " in r["tag_norm"] or in_lexicon(r["tag_norm"])]
        stats.drop("rare_unknown_words", len(specific) - len(kept))
        kept.sort(key=lambda r: (-r["count"], r["tag_norm"]))  # a deterministic order, most frequent first
        stats.inc("tags_out", len(kept))

        vectors = self._embed([r["tag_norm"] for r in kept], run, stats)
        atomic_write_parquet(run.part_path(self.output, 0), pa.Table.from_pylist(kept, schema=VOCAB_SCHEMA))
        atomic_write_npy(run.output_dir(self.output) / "_embeddings.npy", vectors)
        return stats

    def _embed(self, texts: list[str], run: RunDir, stats: Stats) -> np.ndarray:
        vectors, computed = encode_cached(self.embedder, texts, run.root / layout.CACHE / "embeddings",
                                          self.config.vocab.batch_size)
        if computed:
            stats.inc("tags_embedded", computed)
        if computed < len(texts):
            stats.inc("tags_from_cache", len(texts) - computed)
        return vectors


