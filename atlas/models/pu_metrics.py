"""Held-out metrics of the concept annotator, positive-unlabeled aware: an unlabeled pair is not a negative.

Used by the ``train_annotator`` stage (``annotator/metrics.json``, ``calibration.parquet``) and read by the report.
"""

from __future__ import annotations

import numpy as np

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
            rows.append({"concept_id": g, "domain": d, "name": concepts[g]["name"],
                         "heldout_positives": int(y[:, j].sum()),
                         "observed_rate": float(y[:, j].mean()) if len(y) else 0.0,
                         "mean_probability": float(probs[d][:, j].mean()) if len(y) else 0.0,
                         "predicted_rate": float(predicted[j] / n)})
    return pa.Table.from_pylist(rows)
