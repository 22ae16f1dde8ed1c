"""Held-out metrics of the concept annotator, positive-unlabeled aware: an unlabeled pair is not a negative.

Ranking (recall@k, PR-AUC), reliability and ECE, the cross-fitted calibration report, the F1-optimal
threshold of known positives and the labels-per-chunk distribution of a decision rule. Used by the
``train_annotator`` stage (``annotator/metrics.json``, ``calibration.parquet``) and read by the report.
"""

from __future__ import annotations

import numpy as np

RECALL_KS = (1, 5, 10, 20)
MAX_PAIRS_FOR_PR_AUC = 20_000_000


def ranking_metrics(scores: np.ndarray, truth, decided: list | None = None, bins: int | None = 10) -> dict:
    """Held-out metrics of one label domain. ``scores`` [N, L]; ``truth`` [N, L] (sparse or dense) holds
    the known positives; ``decided`` the labels the decision rule keeps per row (optional).

    recall@k: the share of known positives among each chunk's k best-scored labels (chunks with a
    positive). PR-AUC: average precision over all (chunk, label) pairs. Precision counts an unlabeled
    prediction as wrong, so it is a lower bound; the reliability bins compare mean probability with
    the observed positive rate, which is a lower bound too (``bins`` None: no reliability, for scores
    that are not probabilities).
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
    if bins:
        out["reliability"] = reliability(scores, truth, bins)
    return out


def _dense(truth) -> np.ndarray:
    return np.asarray(truth.toarray() if hasattr(truth, "toarray") else truth, dtype=np.float32)


def reliability(probs: np.ndarray, truth, bins: int = 10) -> dict:
    """Reliability bins of probabilities against known positives: ``bins`` equal-width bins of [0, 1], each
    with its mean probability, observed known-positive rate and pair count (empty bins left out), and the
    expected calibration error (ECE: the pair-weighted mean of |mean probability - observed rate|)."""
    probs = np.asarray(probs, dtype=np.float64).ravel()
    truth = _dense(truth).ravel()
    edges = np.linspace(0, 1, bins + 1)
    which = np.clip(np.digitize(probs, edges) - 1, 0, bins - 1)
    count = np.bincount(which, minlength=bins)
    mean_p = np.bincount(which, weights=probs, minlength=bins) / np.maximum(count, 1)
    observed = np.bincount(which, weights=truth, minlength=bins) / np.maximum(count, 1)
    used = count > 0
    return {"bin_mean_probability": mean_p[used].tolist(), "bin_observed_rate": observed[used].tolist(),
            "bin_pairs": count[used].tolist(),
            "ece": float((count * np.abs(mean_p - observed)).sum() / max(count.sum(), 1)),
            # the same without the first bin (p < 0.1 with 10 bins), where a label may be given: the first bin
            # holds nearly every pair of a large label space and would make any model look calibrated
            "ece_above_first_bin": float((count[1:] * np.abs(mean_p - observed)[1:]).sum() / max(count[1:].sum(), 1))}


def calibration_report(logits: np.ndarray, truth, seed: int = 0, bins: int = 10) -> dict:
    """Honest calibration figures of one domain by two-fold cross-fitting over held-out chunks.

    The chunks are split in two halves by a seeded permutation; a Platt map fit on one half calibrates
    the other (and vice versa), so every chunk's probabilities come from a map that never saw it. Returns
    the ECE per half and their mean ("ece"), the same for the uncalibrated sigmoid of the logits
    ("ece_uncalibrated"), and the reliability bins of the pooled out-of-fold probabilities ("reliability",
    whose "ece" is the mean over halves) and of the uncalibrated ones ("reliability_uncalibrated").
    Fewer than two chunks: nothing to cross-fit, the ECEs are None. Over ``MAX_PAIRS_FOR_PR_AUC`` pairs, a
    fixed sample of chunks (as for PR-AUC) keeps this in memory; "chunks" says how many were used.
    """
    from atlas.models.annotator import calibrate, fit_platt

    logits = np.asarray(logits, dtype=np.float32)
    if logits.size > MAX_PAIRS_FOR_PR_AUC:
        rows = np.sort(np.random.default_rng(seed).choice(len(logits), MAX_PAIRS_FOR_PR_AUC // logits.shape[1],
                                                          replace=False))
        logits, truth = logits[rows], truth[rows]
    truth = _dense(truth)
    raw = calibrate(logits, {"a": 1.0, "b": 0.0})
    out = {"folds": 2, "seed": seed, "chunks": len(logits), "reliability_uncalibrated": reliability(raw, truth, bins)}
    if len(logits) < 2:
        return out | {"ece": None, "ece_halves": None, "ece_uncalibrated": None, "ece_uncalibrated_halves": None,
                      "reliability": None}
    order = np.random.default_rng(seed).permutation(len(logits))
    halves = [np.sort(order[: len(order) // 2]), np.sort(order[len(order) // 2 :])]
    crossed = np.zeros_like(raw)
    ece, ece_raw = [], []
    for fit_on, measure_on in (halves, halves[::-1]):
        fitted = fit_platt(logits[fit_on], truth[fit_on], seed=seed)
        crossed[measure_on] = calibrate(logits[measure_on], fitted)
        ece.append(reliability(crossed[measure_on], truth[measure_on], bins)["ece"])
        ece_raw.append(reliability(raw[measure_on], truth[measure_on], bins)["ece"])
    pooled = reliability(crossed, truth, bins) | {"ece": float(np.mean(ece)), "ece_halves": ece, "cross_fitted": True}
    out["reliability_uncalibrated"]["ece"] = float(np.mean(ece_raw))
    return out | {"ece": float(np.mean(ece)), "ece_halves": ece, "ece_uncalibrated": float(np.mean(ece_raw)),
                  "ece_uncalibrated_halves": ece_raw, "reliability": pooled}


THRESHOLD_GRID = np.unique(np.round(np.concatenate([np.geomspace(0.001, 0.1, 41), np.arange(0.1, 1.0, 0.005)]), 5))


def best_f1_threshold(probs: np.ndarray, truth, grid: np.ndarray = THRESHOLD_GRID, block_rows: int = 4096,
                      floor: float | None = None) -> dict:
    """The probability threshold (from ``grid``) that maximizes F1 of the known positives over all pairs.

    Precision counts unlabeled pairs as wrong, so F1 is a lower bound; with calibrated probabilities the
    optimal threshold is about half the best F1 (Lipton et al. 2014). No cap applies. Only thresholds at or
    above ``floor`` compete; None: the domain's known-positive rate, so a label is never given with a
    probability below that of a label drawn at random (lift < 1), which a model without skill would
    otherwise do to a small domain (F1 of "everything" is 2 * rate / (1 + rate)). Returns {"threshold",
    "f1_lower_bound", "precision_lower_bound", "recall", "floor"}; without known positives the threshold is
    0.5 and the figures None.
    """
    if floor is None:
        floor = float(truth.sum()) / max(int(np.prod(truth.shape)), 1)
    grid = np.sort(np.asarray(grid, dtype=np.float64))
    grid = grid[grid >= floor] if (grid >= floor).any() else np.array([floor])
    predicted = np.zeros(len(grid) + 1)
    hits = np.zeros(len(grid) + 1)
    n_pos = 0.0
    for start in range(0, len(probs), block_rows):
        p = np.asarray(probs[start : start + block_rows], dtype=np.float64).ravel()
        y = _dense(truth[start : start + block_rows]).ravel()
        passed = np.searchsorted(grid, p, side="right")  # how many grid thresholds each pair reaches
        predicted += np.bincount(passed, minlength=len(grid) + 1)
        hits += np.bincount(passed, weights=y, minlength=len(grid) + 1)
        n_pos += y.sum()
    if n_pos == 0:
        return {"threshold": 0.5, "f1_lower_bound": None, "precision_lower_bound": None, "recall": None,
                "floor": floor}
    # pairs at or above grid[k]: those that reach more than k thresholds
    above = np.cumsum(predicted[::-1])[::-1][1:]
    hit_above = np.cumsum(hits[::-1])[::-1][1:]
    precision = hit_above / np.maximum(above, 1)
    recall = hit_above / n_pos
    f1 = 2 * precision * recall / np.maximum(precision + recall, 1e-12)
    k = int(np.argmax(f1))  # the lowest threshold among ties
    return {"threshold": float(grid[k]), "f1_lower_bound": float(f1[k]), "precision_lower_bound": float(precision[k]),
            "recall": float(recall[k]), "floor": floor}


def labels_per_chunk(decided: list, cap: int) -> dict:
    """The distribution of the number of labels a decision rule gives a chunk: min, median, mean, p90, max,
    the share of chunks at the cap and with none, and a histogram (``histogram[k]``: chunks with k labels)."""
    counts = np.array([len(row) for row in decided], dtype=np.int64)
    if not len(counts):
        return {"chunks": 0, "min": None, "median": None, "mean": None, "p90": None, "max": None,
                "share_at_cap": None, "share_zero": None, "cap": int(cap), "histogram": [0] * (cap + 1)}
    return {"chunks": int(len(counts)), "min": int(counts.min()), "median": float(np.median(counts)),
            "mean": float(counts.mean()), "p90": float(np.percentile(counts, 90)), "max": int(counts.max()),
            "share_at_cap": float((counts >= cap).mean()), "share_zero": float((counts == 0).mean()), "cap": int(cap),
            "histogram": np.bincount(counts, minlength=max(cap, int(counts.max())) + 1).tolist()}


def median_predicted_score(decided: list) -> float | None:
    """The median probability of the labels a decision rule gives (None: it gives none)."""
    scores = [p for row in decided for _, p in row]
    return float(np.median(scores)) if scores else None


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
