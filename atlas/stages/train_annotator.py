"""Stage ``train_annotator`` (global): train the concept annotator on the targets (paper 4.2.3).

Reads ``targets/`` (reservoir, split, positives) and the library, and trains ``atlas.models.annotator``:

- ``annotator.mode = "frozen"`` (default, CPU): chunk embeddings are computed once (cached in
  ``RUN/_cache/embeddings``) and only the heads train, in seconds to minutes;
- ``"finetune"``: the encoder trains end to end with the heads (a GPU; ``annotator.encoder_lr``).

Batches are drawn with rarity weights (a chunk's weight is the mean over its content concepts of
count^-``rarity_power``), the loss is BCE on positives + the non-negative PU risk with a prior
per label (``annotator.label_frequency``). Then, on the held-out split:

- **calibration**: each label domain gets a Platt map ``sigmoid(a * logit + b)`` fit on all held-out
  (chunk, label) pairs to "a known positive" (``atlas.models.annotator.fit_platt``; why Platt: that
  module's docstring). It is stored in ``config.json`` and ``Annotator.probabilities`` applies it. Its
  honest ECE is cross-fitted (``atlas.models.pu_metrics.calibration_report``): two halves of the
  held-out chunks by a seeded permutation, each calibrated by a map fit on the other, the mean of the
  two ECEs; the stored map is then fit on all held-out chunks;
- **decision rule**: a label is given when its calibrated probability reaches the domain's threshold:
  for content concepts the threshold that maximizes F1 of the known positives on held-out pairs
  (``best_f1_threshold``; about half the best F1 for calibrated probabilities, so it follows how well
  the domain can be predicted; never below the domain's known-positive rate); for the auxiliary
  domains ``annotator.aux_min_probability`` (0.5: a tone, demographic or alignment label only when it
  is more likely than not, so many chunks get none) and, for every label but the expository tones, the
  probability the null's neutral texts reach (``atlas.io.neutral_text``; ``annotator.aux_null_quantile``): a
  label that fires on API documentation or a licence would fire on the corpus' technical text too; and, as in
  the targets stage, a chunk whose nearest null text is at ``annotator.aux_null_nearest`` or more gets none of
  those labels (the null's embeddings are saved beside the model). The cap
  (``annotator.max_caps``) only bounds the labels per chunk; ``annotator.thresholds`` and ``annotator.caps`` fix
  either per domain;
- **metrics**: the model is measured next to two baselines that need no training: kNN over concept
  embeddings (cosine of the chunk with each concept's "name: description") and kNN over training
  chunks (similarity-weighted vote of the 20 nearest). Metrics are PU-aware: recall@k and PR-AUC on
  held-out positives (identical before and after calibration: the map is increasing); precision is a
  lower bound (an unlabeled prediction may be right); per domain, the cross-fitted ECE before and after
  calibration with reliability bins, and the labels-per-chunk distribution of the rule.

    annotator/model.safetensors, config.json     the model (see atlas.models.annotator); encoder/ when fine-tuned
    annotator/null_embeddings.npy                the null's texts as the encoder embeds them (float16)
    annotator/metrics.json                       held-out metrics, baselines, rule, training history
    annotator/calibration.parquet                per label: held-out positives, observed rate, mean probability
    annotator/heldout_predictions.parquet        chunk_id, domain, targets, concepts, concept_scores
    report/annotator_*.png                       training curve, reliability (calibrated, cross-fitted), relevance
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa

from atlas.core.extras import llm_extras
from atlas.core.files import (
    atomic_write_json,
    atomic_write_npy,
    atomic_write_parquet,
    read_parquet,
    sha256_bytes,
    stable_hash,
)
from atlas.core.rundir import RunDir
from atlas.core.stage import Stage
from atlas.core.stats import Stats
from atlas.io import layout
from atlas.io.chunks import read_chunks
from atlas.io.library import load_library
from atlas.io.neutral_text import neutral_texts
from atlas.models.auxiliary import configured_domains, list_hashes, null_thresholds, reads_like_null
from atlas.models.embedder import Embedder, encode_cached, use_stage_threads
from atlas.models.pu_metrics import (
    best_f1_threshold,
    calibration_report,
    calibration_table,
    labels_per_chunk,
    median_predicted_score,
    ranking_metrics,
)

if TYPE_CHECKING:  # scipy comes with the library extra: imported where it is used
    from scipy import sparse

TRAIN_VERSION = 4
DEFAULT_CAP = 10  # the cap of a domain missing from annotator.max_caps
KNN_NEIGHBOURS = 20
PREDICTIONS_SCHEMA = pa.schema(
    [("chunk_id", pa.string()), ("domain", pa.string()), ("targets", pa.list_(pa.int64())),
     ("concepts", pa.list_(pa.int64())), ("concept_scores", pa.list_(pa.float32()))]
)


def rarity_weights(content: sparse.csr_matrix, power: float) -> np.ndarray:
    """Sampling weight per chunk: mean over its concepts of count^-power (chunks without any: the median)."""
    counts = np.asarray(content.sum(axis=0)).ravel()
    inverse = np.where(counts > 0, np.maximum(counts, 1) ** -power, 0.0)
    n_labels = np.asarray(content.sum(axis=1)).ravel()
    weights = np.asarray(content @ inverse).ravel() / np.maximum(n_labels, 1)
    fallback = np.median(weights[n_labels > 0]) if (n_labels > 0).any() else 1.0
    weights[n_labels == 0] = fallback
    return weights / weights.sum()


class TrainAnnotatorStage(Stage):
    name = "train_annotator"
    output = layout.ANNOTATOR
    upstream = ("targets",)
    needs = ("embed", "library")

    def extras(self) -> tuple[str, ...]:
        return self.needs + llm_extras(self.config.llm.engine)

    def identity(self) -> dict:
        a = self.config.annotator
        return {"version": TRAIN_VERSION, "annotator": a.model_dump(exclude={"reservoir_size", "min_per_concept",
                                                                             "heldout_fraction", "device"}),
                "aux_files": list_hashes(configured_domains(self.config)),
                "null_sha256": stable_hash(list(neutral_texts()))}

    def setup(self) -> None:
        import torch

        self.device = self.config.annotator.device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.embedder = Embedder(self.config.annotator.encoder, device=self.device,
                                 batch_size=min(self.config.annotator.embed_batch_size, 64))

    # --- data ------------------------------------------------------------------------------------

    def _load(self, run: RunDir):
        from scipy import sparse

        concepts, library = load_library(run)
        offsets, sizes = library["domain_offsets"], library["domain_sizes"]
        table = read_parquet(run.part_path(layout.TARGETS, 0), required=["chunk_id", "domain", "split", "concepts"],
                             hint="rerun the targets stage (--force --stages targets)").to_pydict()
        n = len(table["chunk_id"])
        labels = {}
        for domain in offsets:
            column = f"{domain}_global_ids"
            if column not in table:
                raise ValueError(f"{run.part_path(layout.TARGETS, 0)}: no column {column!r} "
                                 f"for library domain {domain!r}; "
                                 "rerun the targets stage (--force --stages targets)")
            rows = np.repeat(np.arange(n), [len(ids) for ids in table[column]])
            cols = np.array([g - offsets[domain] for ids in table[column] for g in ids], dtype=np.int64)
            if len(cols) and (cols.min() < 0 or cols.max() >= sizes[domain]):
                raise ValueError(f"{run.part_path(layout.TARGETS, 0)}: column {column!r} holds ids outside domain "
                                 f"{domain!r} (offset {offsets[domain]}, size {sizes[domain]})")
            labels[domain] = sparse.csr_matrix((np.ones(len(cols), np.float32), (rows, cols)),
                                               shape=(n, sizes[domain]))
        return concepts, library, table, labels

    def _embed(self, run: RunDir, texts: list[str], stats: Stats, what: str) -> np.ndarray:
        from tqdm.auto import tqdm

        a = self.config.annotator
        with tqdm(total=len(texts), desc=f"embed {what}", unit="text",
                  disable=not self.config.execution.progress) as bar:
            vectors, computed = encode_cached(self.embedder, texts, run.root / layout.CACHE / "embeddings",
                                              a.embed_batch_size, progress=bar.update)
        stats.inc(f"{what}_embedded", computed)
        stats.inc(f"{what}_from_cache", len(texts) - computed)
        return vectors.astype(np.float32)

    # --- the stage -------------------------------------------------------------------------------

    def run_shard(self, run: RunDir, shard: int) -> Stats:
        import torch

        from atlas.models.annotator import (
            NULL_FILE,
            AnnotatorHeads,
            AnnotatorSpec,
            calibrate,
            fit_platt,
            pu_priors,
            save_annotator,
        )

        a = self.config.annotator
        concepts, library, table, labels = self._load(run)
        offsets, sizes = library["domain_offsets"], library["domain_sizes"]
        chunk_ids = table["chunk_id"]
        chunks = read_chunks(run, set(chunk_ids))
        texts = [chunks[c]["chunk_text"] for c in chunk_ids]
        train = np.array([s == "train" for s in table["split"]])
        heldout = ~train
        stats = Stats({"chunks": len(chunk_ids), "train": int(train.sum()), "heldout": int(heldout.sum())})
        if train.sum() == 0 or heldout.sum() == 0:
            raise ValueError(f"{run.part_path(layout.TARGETS, 0)}: need chunks in both splits, got {int(train.sum())} "
                             f"train and {int(heldout.sum())} held-out; change annotator.heldout_fraction")

        n_content = sizes["content"]
        concept_texts = [f"{c['name']}: {c['description']}" for c in concepts[:n_content]]
        concept_init = self._embed(run, concept_texts, stats, "concepts")
        embeddings = self._embed(run, texts, stats, "chunks")
        use_stage_threads()  # the same model whether earlier stages ran in this process or not
        torch.manual_seed(a.seed)
        heads = AnnotatorHeads(embeddings.shape[1], n_content, {d: sizes[d] for d in offsets if d != "content"},
                               a.hidden, a.dropout, torch.from_numpy(concept_init))
        priors = {d: torch.tensor(pu_priors(np.asarray(y[train].mean(axis=0)).ravel(), a.label_frequency),
                                  dtype=torch.float32) for d, y in labels.items()}
        started = time.perf_counter()
        encoder, history = self._train(heads, embeddings, texts, labels, train, heldout, priors)
        stats.inc("train_seconds", int(time.perf_counter() - started))
        held = embeddings[heldout]
        if encoder is not None:  # fine-tuned: the held-out chunks need the new encoder's embeddings
            encoder.eval()
            held = encoder.encode([t for t, h in zip(texts, heldout) if h], normalize_embeddings=True,
                                  convert_to_numpy=True, batch_size=64).astype(np.float32)

        heads.eval()
        with torch.no_grad():
            logits = {d: z.numpy() for d, z in heads(torch.from_numpy(held)).items()}
        truth = {d: y[heldout] for d, y in labels.items()}
        calibration = {d: fit_platt(logits[d], truth[d], seed=a.seed) for d in offsets}  # stored: all held-out
        crossed = {d: calibration_report(logits[d], truth[d], seed=a.seed) for d in offsets}  # reported: cross-fit
        stored = {d: {k: calibration[d][k] for k in ("method", "a", "b")} for d in offsets}
        probs = {d: calibrate(logits[d], stored[d]) for d in offsets}  # what Annotator.probabilities gives
        rules = {d: self._rule(d, probs[d], truth[d]) for d in offsets}
        null, null_vectors = self._null_thresholds(run, heads, encoder, stored, stats)
        spec = AnnotatorSpec(
            encoder="encoder" if encoder is not None else a.encoder, dim=int(embeddings.shape[1]), hidden=a.hidden,
            dropout=a.dropout,
            library_sha256=sha256_bytes((run.output_dir(layout.LIBRARY) / "concepts.parquet").read_bytes()),
            domains={d: {"offset": offsets[d], "size": sizes[d], "threshold": rules[d]["threshold"],
                         "cap": rules[d]["cap"], "calibration": stored[d]}
                     | ({"label_thresholds": null[d]} if d in null else {}) for d in offsets},
            null_nearest=a.aux_null_nearest,
        )
        # held-out chunks that read like the null get no null-checked label, as in the annotate stage (the decision
        # only: the ranking metrics read the probabilities)
        like_null = reads_like_null(held, null_vectors, a.aux_null_nearest)
        stats.inc("heldout_like_null", int(like_null.sum()))
        folder = run.output_dir(self.output)
        metrics = self._evaluate(run, spec, probs, truth, embeddings, labels, train, heldout, concept_init, table,
                                 concepts, stats, like_null)
        for d, m in metrics["domains"].items():
            self._add_calibration(m, logits[d], truth[d], calibration[d], crossed[d], probs[d])
        metrics |= {"rules": rules, "history": history, "priors_mean": {d: float(p.mean()) for d, p in priors.items()},
                    "mode": a.mode, "encoder": a.encoder, "device": self.device}
        atomic_write_json(folder / "metrics.json", metrics)
        save_annotator(folder, heads, spec, encoder)
        atomic_write_npy(folder / NULL_FILE, null_vectors.astype(np.float16))
        self._plot(run, history, metrics)
        return stats

    def _null_thresholds(self, run: RunDir, heads, encoder, calibration: dict, stats: Stats
                         ) -> tuple[dict[str, list], np.ndarray]:
        """Per auxiliary domain, per label, the probability a chunk must reach to beat the null: just above what
        the null's texts reach (``null_thresholds``), 0 for an expository label (the domain's threshold decides);
        and the null's embeddings (what the annotate stage compares each chunk with)."""
        import torch

        from atlas.models.annotator import calibrate

        a, texts = self.config.annotator, list(neutral_texts())
        if encoder is None:
            vectors = self._embed(run, texts, stats, "null")
        else:  # fine-tuned: the null seen through the new encoder, as the corpus will be
            vectors = encoder.encode(texts, normalize_embeddings=True, convert_to_numpy=True,
                                     batch_size=64).astype(np.float32)
        with torch.no_grad():
            logits = {d: z.numpy() for d, z in heads(torch.from_numpy(vectors)).items()}
        out = {}
        for domain in configured_domains(self.config):
            reached = null_thresholds(calibrate(logits[domain.name], calibration[domain.name]), domain,
                                      a.aux_null_quantile, 0.0)
            # decide keeps a probability >= its threshold: the next float up, so a score equal to the null's is out
            above = np.where(domain.null_checked, np.nextafter(reached.astype(np.float64), np.inf), 0.0)
            out[domain.name] = [float(t) for t in above]
        return out, vectors

    def _rule(self, domain: str, probs: np.ndarray, truth) -> dict:
        """A domain's threshold and safety cap on calibrated held-out probabilities (see the module docstring)."""
        a = self.config.annotator
        best = best_f1_threshold(probs, truth)
        if domain in a.thresholds:
            threshold, source = a.thresholds[domain], "annotator.thresholds"
        elif domain == "content":
            threshold, source = best["threshold"], "max F1 of known positives (held-out)"
        else:
            threshold, source = a.aux_min_probability, "annotator.aux_min_probability"
        return {"threshold": float(threshold), "cap": int(a.caps.get(domain, a.max_caps.get(domain, DEFAULT_CAP))),
                "criterion": best["f1_lower_bound"], "threshold_from": source, "best_f1": best}

    @staticmethod
    def _add_calibration(m: dict, logits: np.ndarray, truth, fitted: dict, crossed: dict, probs: np.ndarray) -> None:
        """Calibration figures of one domain into its metrics: the reliability bins become the cross-fitted ones."""
        raw = ranking_metrics(logits, truth, bins=None)  # ranking of the logits: calibration must not change it
        m["ranking_uncalibrated"] = {"recall_at": raw["recall_at"], "pr_auc": raw.get("pr_auc")}
        m["reliability_in_sample"] = m.get("reliability")
        if crossed["reliability"] is not None:
            m["reliability"] = crossed["reliability"]
        m["calibration"] = {"method": fitted["method"], "a": fitted["a"], "b": fitted["b"],
                            "fit_pairs": fitted["fit_pairs"], "pairs": fitted["pairs"],
                            "known_positives": fitted["known_positives"],
                            "ece": crossed["ece"], "ece_halves": crossed["ece_halves"],
                            "ece_uncalibrated": crossed["ece_uncalibrated"],
                            "ece_uncalibrated_halves": crossed["ece_uncalibrated_halves"],
                            "reliability_uncalibrated": crossed["reliability_uncalibrated"],
                            "mean_probability": float(np.mean(probs)) if probs.size else None,
                            "known_positive_rate": fitted["known_positives"] / max(fitted["pairs"], 1)}

    # --- training --------------------------------------------------------------------------------

    def _train(self, heads, embeddings: np.ndarray, texts: list[str], labels: dict, train: np.ndarray,
               heldout: np.ndarray, priors: dict):
        """The training loop; returns (the fine-tuned encoder or None, per-epoch history)."""
        import torch
        from tqdm.auto import tqdm

        from atlas.models.annotator import annotator_loss

        a = self.config.annotator
        train_idx, heldout_idx = np.flatnonzero(train), np.flatnonzero(heldout)
        weights = rarity_weights(labels["content"][train_idx], a.rarity_power)
        rng = np.random.default_rng(a.seed)  # numpy: torch.multinomial stops at 2^24 categories
        encoder = None
        params = [{"params": heads.parameters(), "lr": a.lr}]
        if a.mode == "finetune":  # a fresh copy: self.embedder keeps the original weights for the cache
            encoder = Embedder(a.encoder, device=self.device).setup().model
            params.append({"params": encoder.parameters(), "lr": a.encoder_lr})
        heads.to(self.device)
        optimizer = torch.optim.AdamW(params, weight_decay=a.weight_decay)
        features = torch.from_numpy(embeddings)
        history = []
        bar = tqdm(range(a.epochs), desc="train annotator", unit="epoch", disable=not self.config.execution.progress)
        for epoch in bar:
            heads.train()
            if encoder is not None:
                encoder.train()
            order = train_idx[rng.choice(len(train_idx), size=len(train_idx), replace=True, p=weights)]
            losses = []
            for start in range(0, len(order), a.batch_size):
                batch = order[start : start + a.batch_size]
                z = self._encode_batch(encoder, [texts[i] for i in batch]) if encoder is not None else features[batch]
                targets = {d: torch.from_numpy(y[batch].toarray()).to(self.device) for d, y in labels.items()}
                loss, _ = annotator_loss(heads(z.to(self.device)), targets,
                                         {d: p.to(self.device) for d, p in priors.items()},
                                         a.pu_weight, a.pu_beta, a.pu_gamma)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                losses.append(loss.item())
            heldout_parts = self._heldout_loss(heads, encoder, features, texts, labels, heldout_idx, priors)
            history.append({"epoch": epoch + 1, "train_objective": float(np.mean(losses)), **heldout_parts})
            bar.set_postfix(train=f"{np.mean(losses):.3f}",
                            recall10=f"{heldout_parts['heldout_content_recall_at_10']:.3f}")
        heads.cpu()
        return encoder, history

    def _encode_batch(self, encoder, texts: list[str]):
        """Pooled, L2-normalized embeddings with gradients (fine-tuning)."""
        import torch.nn.functional as F
        from sentence_transformers.util import batch_to_device

        prepare = getattr(encoder, "preprocess", None) or encoder.tokenize  # sentence-transformers 6 renamed it
        features = batch_to_device(prepare(texts), self.device)
        return F.normalize(encoder(features)["sentence_embedding"], dim=-1)

    def _heldout_loss(self, heads, encoder, features, texts, labels, heldout_idx, priors) -> dict:
        import torch

        from atlas.models.annotator import annotator_loss

        a = self.config.annotator
        sample = heldout_idx[:2048]  # enough for a curve, cheap when fine-tuning
        heads.eval()
        with torch.no_grad():
            if encoder is not None:
                encoder.eval()
                z = self._encode_batch(encoder, [texts[i] for i in sample])
            else:
                z = features[sample]
            targets = {d: torch.from_numpy(y[sample].toarray()).to(self.device) for d, y in labels.items()}
            logits = heads(z.to(self.device))
            loss, parts = annotator_loss(logits, targets, {d: p.to(self.device) for d, p in priors.items()},
                                         a.pu_weight, a.pu_beta, a.pu_gamma)
        # PU-aware monitoring: the loss on held-out positives rises as the model grows conservative about
        # unlabeled pairs, while ranking improves; recall@10 of known positives is the curve to watch.
        content = logits["content"].cpu().numpy()
        truth = targets["content"].cpu().numpy()
        top = np.argsort(-content, axis=1, kind="stable")[:, :10]
        recall = np.take_along_axis(truth, top, axis=1).sum() / max(truth.sum(), 1)
        return {"heldout_loss": float(loss), "heldout_content_recall_at_10": float(recall),
                **{f"heldout_{k}": v for k, v in parts.items()}}

    # --- evaluation ------------------------------------------------------------------------------

    def _evaluate(self, run, spec, probs, truth, embeddings, labels, train, heldout, concept_init, table, concepts,
                  stats, like_null) -> dict:
        from atlas.models.annotator import decide, label_thresholds, withhold_like_null

        a = self.config.annotator
        metrics: dict = {"heldout_chunks": int(heldout.sum()), "train_chunks": int(train.sum()), "domains": {}}
        decided = {}
        for d, v in spec.domains.items():
            decided[d] = decide(withhold_like_null(probs[d], v, like_null), label_thresholds(v), v["cap"])
            metrics["domains"][d] = ranking_metrics(probs[d], truth[d], decided[d])
            metrics["domains"][d] |= {"labels_per_chunk": labels_per_chunk(decided[d], v["cap"]),
                                      "median_predicted_score": median_predicted_score(decided[d])}
        # Baselines for the content domain, on the same held-out chunks (paper: kNN "performs surprisingly well")
        held = embeddings[heldout]
        zero_shot = held @ concept_init.T
        metrics["baselines"] = {"knn_concept_embeddings": ranking_metrics(zero_shot, truth["content"])}
        neighbour_scores = self._knn_chunks(embeddings[train], labels["content"][train], held)
        metrics["baselines"]["knn_training_chunks"] = ranking_metrics(neighbour_scores, truth["content"])

        held_rows = np.flatnonzero(heldout)
        corpus_domain = [table["domain"][i] for i in held_rows]
        per_domain = {}
        for name in sorted(set(corpus_domain)):
            rows = [j for j, dom in enumerate(corpus_domain) if dom == name]
            per_domain[name] = {"chunks": len(rows),
                                **{f"mean_{d}": float(np.mean([len(decided[d][j]) for j in rows])) for d in decided},
                                "share_with_content": float(np.mean([bool(decided["content"][j]) for j in rows]))}
        metrics["per_corpus_domain"] = per_domain

        folder = run.output_dir(self.output)
        atomic_write_parquet(folder / "calibration.parquet",
                             calibration_table(probs, truth, decided, spec.domains, concepts))
        rows = []
        for j, i in enumerate(held_rows):
            predicted = [(spec.domains[d]["offset"] + k, p) for d in spec.domains for k, p in decided[d][j]]
            rows.append({"chunk_id": table["chunk_id"][i], "domain": table["domain"][i],
                         "targets": table["concepts"][i],
                         "concepts": [g for g, _ in predicted], "concept_scores": [p for _, p in predicted]})
        atomic_write_parquet(folder / "heldout_predictions.parquet",
                             pa.Table.from_pylist(rows, schema=PREDICTIONS_SCHEMA))
        metrics["judge"] = self._judge(run, rows, concepts, a.judge_sample)
        content = metrics["domains"]["content"]
        if content["pr_auc"] is not None:  # None: no held-out chunk has a known content concept
            stats.inc("heldout_recall_at_10_permille", int(1000 * content["recall_at"]["10"]))
            stats.inc("heldout_pr_auc_permille", int(1000 * content["pr_auc"]))
        return metrics

    @staticmethod
    def _knn_chunks(train_vectors: np.ndarray, train_labels: sparse.csr_matrix, queries: np.ndarray) -> np.ndarray:
        """Scores of the kNN-over-chunks baseline: similarity-weighted vote of the nearest training chunks."""
        import faiss
        from scipy import sparse

        index = faiss.IndexFlatIP(train_vectors.shape[1])
        index.add(np.ascontiguousarray(train_vectors, dtype=np.float32))
        k = min(KNN_NEIGHBOURS, len(train_vectors))
        sims, ids = index.search(np.ascontiguousarray(queries, dtype=np.float32), k)
        weights = np.clip(sims, 0, None)
        votes = sparse.csr_matrix((weights.ravel(), (np.repeat(np.arange(len(queries)), k), ids.ravel())),
                                  shape=(len(queries), len(train_vectors)))
        return np.asarray((votes @ train_labels).todense()) / np.maximum(weights.sum(axis=1, keepdims=True), 1e-9)

    def _judge(self, run: RunDir, rows: list[dict], concepts: list[dict], sample: int) -> dict | None:
        """Relevance of the predicted content concepts of ``sample`` held-out chunks (LLM judge or proxy)."""
        from atlas.models.judge import MAX_CONCEPTS_PER_REQUEST, judge_pairs

        content = [r for r in rows if any(concepts[g]["domain"] == "content" for g in r["concepts"])]
        if not sample or not content:
            return None
        chosen = sorted(np.random.default_rng(self.config.annotator.seed)
                        .choice(len(content), min(sample, len(content)), replace=False).tolist())
        texts = read_chunks(run, {content[i]["chunk_id"] for i in chosen})
        pairs = [(content[i]["chunk_id"], texts[content[i]["chunk_id"]]["chunk_text"],
                  [f"{concepts[g]['name']}: {concepts[g]['description']}" for g in content[i]["concepts"]
                   if concepts[g]["domain"] == "content"][:MAX_CONCEPTS_PER_REQUEST]) for i in chosen]
        return judge_pairs(self.config, pairs, what="annotator", report=run.root / layout.REPORT)

    def _plot(self, run: RunDir, history: list[dict], metrics: dict) -> None:
        from atlas.core.plots import lines

        report = run.root / layout.REPORT
        epochs = [h["epoch"] for h in history]
        lines(epochs, {"train objective": [h["train_objective"] for h in history],
                       "held-out loss\n(all domains)": [h["heldout_loss"] for h in history],
                       "held-out content\nloss (BCE + nnPU)": [h["heldout_content_bce"] + h["heldout_content_pu"]
                                                               for h in history],
                       "held-out recall@10": [h["heldout_content_recall_at_10"] for h in history]},
              report / "annotator_training.png", "annotator training (BCE on positives + nnPU)", "epoch", log_x=False)
        self._plot_reliability(metrics["domains"], report / "annotator_reliability.png")

    @staticmethod
    def _plot_reliability(domains: dict, path) -> None:
        """Calibrated (cross-fitted) probability vs observed known-positive rate per domain, with the diagonal;
        the uncalibrated content curve in grey for comparison."""
        from atlas.core.plots import reliability

        def label(name: str, ece) -> str:
            return f"{name} (ECE {ece:.3f})" if ece is not None else name

        curves = {label(d, m["reliability"].get("ece")): (m["reliability"]["bin_mean_probability"],
                                                          m["reliability"]["bin_observed_rate"])
                  for d, m in domains.items() if (m.get("reliability") or {}).get("bin_pairs")}
        calibration = domains.get("content", {}).get("calibration") or {}
        before = calibration.get("reliability_uncalibrated") or {}
        if before.get("bin_pairs"):
            curves = {label("content, uncalibrated", calibration.get("ece_uncalibrated")):
                      (before["bin_mean_probability"], before["bin_observed_rate"]), **curves}
        if curves:
            reliability(curves, path, "annotator reliability on held-out chunks",
                        "calibrated probability (cross-fitted, mean in bin)",
                        "observed known-positive rate (lower bound)",
                        grey={next(iter(curves))} if before.get("bin_pairs") else set())
