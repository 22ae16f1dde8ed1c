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


# --- annotator metrics (positive-unlabeled: unlabeled is not negative) -------------------------

RECALL_KS = (1, 5, 10, 20)
MAX_PAIRS_FOR_PR_AUC = 20_000_000


def ranking_metrics(scores: np.ndarray, truth, decided: list | None = None, bins: int = 10) -> dict:
    """Held-out metrics of one label domain. ``scores`` [N, L]; ``truth`` [N, L] (sparse or dense) holds
    the known positives; ``decided`` the labels the decision rule keeps per row (optional).

    recall@k: the share of known positives among each chunk's k best-scored labels (chunks with a
    positive). PR-AUC: average precision over all (chunk, label) pairs. Precision counts an unlabeled
    prediction as wrong, so it is a lower bound; the reliability bins compare mean probability with
    the observed positive rate, which is a lower bound too.
    """
    from sklearn.metrics import average_precision_score

    truth = np.asarray(truth.toarray() if hasattr(truth, "toarray") else truth, dtype=np.float32)
    scores = np.asarray(scores, dtype=np.float32)
    has = truth.sum(axis=1) > 0
    out: dict = {"labels": int(truth.shape[1]), "chunks_with_positives": int(has.sum()), "positives": int(truth.sum())}
    if not has.any():
        return out | {"recall_at": {str(k): None for k in RECALL_KS}, "pr_auc": None}
    order = np.argsort(-scores[has], axis=1, kind="stable")
    ranked = np.take_along_axis(truth[has], order, axis=1)
    out["recall_at"] = {str(k): float(ranked[:, :k].sum() / truth[has].sum()) for k in RECALL_KS}
    rows = np.arange(len(scores))
    if scores.size > MAX_PAIRS_FOR_PR_AUC:  # a fixed subsample of chunks keeps this in memory
        rows = np.random.default_rng(0).choice(len(scores), MAX_PAIRS_FOR_PR_AUC // scores.shape[1], replace=False)
    out["pr_auc"] = float(average_precision_score(truth[rows].ravel(), scores[rows].ravel()))
    out["prevalence"] = float(truth.mean())  # PR-AUC of a random scorer
    if decided is not None:
        predicted = np.zeros_like(truth)
        for i, labels in enumerate(decided):
            for j, _ in labels:
                predicted[i, j] = 1
        hits = float((predicted * truth).sum())
        precision = hits / max(float(predicted.sum()), 1.0)
        recall = hits / max(float(truth.sum()), 1.0)
        out |= {"precision_lower_bound": precision, "recall": recall,
                "f1_lower_bound": 2 * precision * recall / max(precision + recall, 1e-12),
                "mean_predicted_per_chunk": float(predicted.sum(axis=1).mean()),
                "share_with_prediction": float((predicted.sum(axis=1) > 0).mean())}
    edges = np.linspace(0, 1, bins + 1)
    which = np.clip(np.digitize(scores.ravel(), edges) - 1, 0, bins - 1)
    count = np.bincount(which, minlength=bins)
    mean_p = np.bincount(which, weights=scores.ravel(), minlength=bins) / np.maximum(count, 1)
    observed = np.bincount(which, weights=truth.ravel(), minlength=bins) / np.maximum(count, 1)
    used = count > 0
    out["reliability"] = {"bin_mean_probability": mean_p[used].tolist(), "bin_observed_rate": observed[used].tolist(),
                          "bin_pairs": count[used].tolist(),
                          "ece": float((count * np.abs(mean_p - observed)).sum() / max(count.sum(), 1))}
    return out


def calibration_table(probs: dict, truth: dict, decided: dict, domains: dict, concepts: list[dict]):
    """Per label of every domain, on held-out chunks: known positives, observed rate (a lower bound),
    mean predicted probability, and the rate at which the decision rule predicts it."""
    import pyarrow as pa

    rows = []
    for d, v in domains.items():
        y = np.asarray(truth[d].toarray() if hasattr(truth[d], "toarray") else truth[d])
        predicted = np.zeros(v["size"])
        for labels in decided[d]:
            for j, _ in labels:
                predicted[j] += 1
        n = max(len(y), 1)
        for j in range(v["size"]):
            g = v["offset"] + j
            rows.append({"concept_id": g, "domain": d, "name": concepts[g]["name"], "heldout_positives": int(y[:, j].sum()),
                         "observed_rate": float(y[:, j].mean()) if len(y) else 0.0,
                         "mean_probability": float(probs[d][:, j].mean()) if len(y) else 0.0,
                         "predicted_rate": float(predicted[j] / n)})
    return pa.Table.from_pylist(rows)


def evaluate_annotator(config: AtlasConfig, label_field: str = "label", folds: int = 5) -> dict:
    """Linear probes on the held-out chunks: how well a known label (e.g. the dev corpus' ``label``)
    can be read off (a) the annotator's predicted concept vectors, (b) the same vectors after the
    decision rule (multi-hot), (c) the raw encoder embeddings. Logistic regression, cross-validated
    with folds grouped by document (chunks of one document never sit on both sides)."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.model_selection import GroupKFold, cross_val_score

    from atlas.annotator import Annotator
    from atlas.embed import encode_cached
    from atlas.stages.chunk import read_chunks

    run = RunDir(config.run_dir)
    predictions = pq.read_table(run.output_dir("annotator") / "heldout_predictions.parquet").to_pylist()
    rows = read_chunks(run, {p["chunk_id"] for p in predictions}, ("chunk_text", "metadata", "doc_id"))
    kept = [p for p in predictions if json.loads(rows[p["chunk_id"]]["metadata"] or "{}").get(label_field) is not None]
    summary: dict = {"label_field": label_field, "heldout_chunks": len(predictions), "chunks_with_label": len(kept)}
    if len(kept) < 2 * folds:
        return summary | {"error": f"too few held-out chunks with a {label_field!r} label"}
    labels = [str(json.loads(rows[p["chunk_id"]]["metadata"])[label_field]) for p in kept]
    groups = [rows[p["chunk_id"]]["doc_id"] for p in kept]
    annotator = Annotator(run.output_dir("annotator")).setup()
    texts = [rows[p["chunk_id"]]["chunk_text"] for p in kept]
    if annotator.spec.encoder == "encoder":  # fine-tuned: its own weights, never the cache of a shared name
        embeddings = annotator.embedder.encode(texts)
    else:
        embeddings, _ = encode_cached(annotator.embedder, texts, run.root / "_cache" / "embeddings",
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
    for name, features in (("predicted_concept_probabilities", probs["content"]), ("predicted_concepts_multi_hot", multi_hot),
                           ("raw_embeddings", embeddings)):
        scores = cross_val_score(probe, features, labels, groups=groups, cv=cv)
        summary[name] = {"dim": int(features.shape[1]), "accuracy": float(scores.mean()), "std": float(scores.std())}
    atomic_write_json(run.root / "report" / "annotator_probe.json", summary)
    return summary
