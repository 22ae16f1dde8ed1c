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
from atlas.io import layout
from atlas.io.library import chunk_concepts, load_library


def evaluate_library(config: AtlasConfig, label_field: str = "label", sample: int = 200, seed: int = 0) -> dict:
    from sklearn.metrics import normalized_mutual_info_score

    from atlas.io.chunks import read_chunks
    from atlas.models.judge import judge_pairs

    run = RunDir(config.run_dir)
    concepts = {r["concept_id"]: r for r in load_library(run)[0]}
    assigned = chunk_concepts(run)
    labels, texts, fields = {}, {}, Counter()
    for chunk_id, row in read_chunks(run, assigned, ("chunk_text", "metadata")).items():
        texts[chunk_id] = row["chunk_text"]
        metadata = json.loads(row["metadata"] or "{}")
        fields.update(metadata.keys())
        value = metadata.get(label_field)
        if value is not None:
            labels[chunk_id] = str(value)
    labeled = sorted(c for c in assigned if c in labels)
    summary: dict = {"concepts": len(concepts), "chunks_with_concepts": len(assigned), "label_field": label_field}
    if not labeled:  # no purity, NMI or counts that read as results: say why there are none
        summary["label_metrics"] = no_labels(label_field, fields)
    else:
        summary["chunks_with_label"] = len(labeled)
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
    chosen = (sorted(rng.choice(sorted(assigned), min(sample, len(assigned)), replace=False).tolist())
              if assigned else [])
    pairs = [(c, texts[c], [f"{concepts[k]['name']}: {concepts[k]['description']}" for k in assigned[c][:26]])
             for c in chosen]
    summary["relevance"] = judge_pairs(config, pairs, what="concept", report=run.root / layout.REPORT)
    atomic_write_json(run.root / layout.REPORT / "library_eval.json", summary)
    return summary


def no_labels(label_field: str, fields: Counter) -> str:
    """Why there are no label metrics: no chunk has the field; the metadata fields the chunks do have."""
    found = ", ".join(f"{k!r} ({n:,} chunks)" for k, n in fields.most_common(6)) or "none"
    return (f"not computed: no chunk has a {label_field!r} metadata field (fields found: {found}); "
            "pass --label-field FIELD")


def evaluate_annotator(config: AtlasConfig, label_field: str = "label", folds: int = 5) -> dict:
    """Linear probes on the held-out chunks: how well a known label (e.g. the dev corpus' ``label``)
    can be read off (a) the annotator's predicted concept vectors, (b) the same vectors after the
    decision rule (multi-hot), (c) the raw encoder embeddings. Logistic regression, cross-validated
    with folds grouped by document (chunks of one document never sit on both sides)."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.model_selection import GroupKFold, cross_val_score

    from atlas.io.chunks import read_chunks
    from atlas.models.annotator import Annotator
    from atlas.models.embedder import encode_cached

    run = RunDir(config.run_dir)
    predictions = pq.read_table(run.output_dir(layout.ANNOTATOR) / "heldout_predictions.parquet").to_pylist()
    rows = read_chunks(run, {p["chunk_id"] for p in predictions}, ("chunk_text", "metadata", "doc_id"))
    metadata = {p["chunk_id"]: json.loads(rows[p["chunk_id"]]["metadata"] or "{}") for p in predictions}
    kept = [p for p in predictions if metadata[p["chunk_id"]].get(label_field) is not None]
    summary: dict = {"label_field": label_field, "heldout_chunks": len(predictions)}
    path = run.root / layout.REPORT / "annotator_probe.json"
    if not kept:
        summary["label_metrics"] = no_labels(label_field, Counter(k for m in metadata.values() for k in m))
        atomic_write_json(path, summary)
        return summary
    summary["chunks_with_label"] = len(kept)
    if len(kept) < 2 * folds:
        summary["error"] = (f"too few held-out chunks with a {label_field!r} label ({len(kept)}; the probes need "
                            f"{2 * folds})")
        atomic_write_json(path, summary)
        return summary
    labels = [str(json.loads(rows[p["chunk_id"]]["metadata"])[label_field]) for p in kept]
    groups = [rows[p["chunk_id"]]["doc_id"] for p in kept]
    annotator = Annotator(run.output_dir(layout.ANNOTATOR)).setup()
    texts = [rows[p["chunk_id"]]["chunk_text"] for p in kept]
    if annotator.spec.encoder == "encoder":  # fine-tuned: its own weights, never the cache of a shared name
        embeddings = annotator.embedder.encode(texts)
    else:
        embeddings, _ = encode_cached(annotator.embedder, texts, run.root / layout.CACHE / "embeddings",
                                      config.annotator.embed_batch_size)
    embeddings = embeddings.astype(np.float32)
    probs = annotator.probabilities(embeddings)
    content = annotator.spec.domains["content"]
    multi_hot = np.zeros((len(kept), content["size"]), dtype=np.float32)
    for i, p in enumerate(kept):
        for g in p["concepts"]:
            if content["offset"] <= g < content["offset"] + content["size"]:
                multi_hot[i, g - content["offset"]] = 1
    probe = LogisticRegression(max_iter=3000)
    cv = GroupKFold(n_splits=min(folds, len(set(groups))))
    majority = Counter(labels).most_common(1)[0][1] / len(labels)
    summary |= {"labels": len(set(labels)), "majority_baseline": majority, "folds": cv.n_splits}
    for name, features in (("predicted_concept_probabilities", probs["content"]),
                           ("predicted_concepts_multi_hot", multi_hot),
                           ("raw_embeddings", embeddings)):
        scores = cross_val_score(probe, features, labels, groups=groups, cv=cv)
        summary[name] = {"dim": int(features.shape[1]), "accuracy": float(scores.mean()), "std": float(scores.std())}
    atomic_write_json(path, summary)
    return summary
