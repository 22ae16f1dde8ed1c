"""``atlas eval library RUN``: how well the concept library matches labels a corpus already has.

Each tagged chunk gets its main concept: the concept that most of its tags map to (ties: the
smaller concept id). Against a ground-truth label of the chunk's document (a metadata field,
e.g. the dev corpus' ``label``), we report:

- purity: the share of chunks whose concept's most common label is their own label;
- NMI: normalized mutual information between main concept and label (scikit-learn);
- concepts per label: how many distinct main concepts the chunks of one label spread over;
- relevance of (concept, chunk) pairs, from the LLM judge or its offline proxy (labelled as such),
  scoring "name: description" of every concept a chunk inherits against the chunk.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict

import numpy as np
import pyarrow.parquet as pq

from atlas.config import AtlasConfig
from atlas.core.files import atomic_write_json
from atlas.core.rundir import RunDir


def chunk_concepts(run: RunDir) -> dict[str, list[int]]:
    """Concept ids of every tagged chunk, most frequent (by its tags) first."""
    mapping = pq.read_table(run.output_dir("library") / "tag_to_concept.parquet").to_pydict()
    concept_of_tag = {t: c for t, c in zip(mapping["tag_norm"], mapping["concept_id"]) if c is not None}
    votes: dict[str, Counter] = defaultdict(Counter)
    for row in pq.read_table(run.output_dir("tags"), columns=["chunk_id", "tag_norm"]).to_pylist():
        concept = concept_of_tag.get(row["tag_norm"])
        if concept is not None:
            votes[row["chunk_id"]][concept] += 1
    return {chunk: [c for c, _ in sorted(v.items(), key=lambda kv: (-kv[1], kv[0]))] for chunk, v in votes.items()}


def evaluate_library(config: AtlasConfig, label_field: str = "label", sample: int = 200, seed: int = 0) -> dict:
    from sklearn.metrics import normalized_mutual_info_score

    from atlas.judge import judge_pairs
    from atlas.stages.chunk import read_chunks

    run = RunDir(config.run_dir)
    concepts = {r["concept_id"]: r for r in pq.read_table(run.output_dir("library") / "concepts.parquet").to_pylist()}
    assigned = chunk_concepts(run)
    labels, texts = {}, {}
    for chunk_id, row in read_chunks(run, assigned, ("chunk_text", "metadata")).items():
        texts[chunk_id] = row["chunk_text"]
        value = json.loads(row["metadata"] or "{}").get(label_field)
        if value is not None:
            labels[chunk_id] = str(value)
    labeled = sorted(c for c in assigned if c in labels)
    summary: dict = {"concepts": len(concepts), "chunks_with_concepts": len(assigned),
                     "chunks_with_label": len(labeled), "label_field": label_field}
    if labeled:
        main = [assigned[c][0] for c in labeled]
        truth = [labels[c] for c in labeled]
        by_concept: dict[int, Counter] = defaultdict(Counter)
        for concept, label in zip(main, truth):
            by_concept[concept][label] += 1
        per_label: dict[str, set] = defaultdict(set)
        for concept, label in zip(main, truth):
            per_label[label].add(concept)
        summary |= {
            "labels": len(per_label),
            "purity": sum(c.most_common(1)[0][1] for c in by_concept.values()) / len(labeled),
            "nmi": float(normalized_mutual_info_score(truth, main)),
            "concepts_per_label_mean": float(np.mean([len(v) for v in per_label.values()])),
            "concepts_per_label_median": float(np.median([len(v) for v in per_label.values()])),
        }
    rng = np.random.default_rng(seed)
    chosen = sorted(rng.choice(sorted(assigned), min(sample, len(assigned)), replace=False).tolist()) if assigned else []
    pairs = [(c, texts[c], [f"{concepts[k]['name']}: {concepts[k]['description']}" for k in assigned[c][:26]])
             for c in chosen]
    summary["relevance"] = judge_pairs(config, pairs, what="concept", report=run.root / "report")
    atomic_write_json(run.root / "report" / "library_eval.json", summary)
    return summary
