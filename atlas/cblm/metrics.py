"""Validation metrics of the concept-bottleneck LM (paper section 7; ``seeds/NOTES.md`` 1.7), always computed with
teacher forcing off and dropout off, on the held-out windows:

- ``val_loss``: the LM loss (AR: next-token cross-entropy; diffusion: cross-entropy on the masked positions of a
  per-block masking drawn with a fixed seed, so two models are scored on the same masks);
- ``concept_loss``: the concept BCE the model was trained with (token-level or OR-aggregated), mean per concept
  (lower is better);
- ``independence``: the HSIC-style cross-covariance of u_hat and k_hat (Eq. 13-14; lower is better);
- ``contribution``: (|k_hat.W_y| + |u_hat.W_y|) / (|k_hat.W_y| + |u_hat.W_y| + |eps.W_y|) for the true next token y,
  averaged over positions (Eq. 22; higher is better, Steerling-8B 0.876); ``contribution_known``: the known
  term's share alone;
- ``detection_auc``: ROC AUC of the chunk-level concept probabilities against the chunks' annotated concepts,
  macro-averaged over the concepts with positives and negatives among the held-out chunks;
- ``norm_*``: mean L2 norms of the known concept embeddings K_c and, per position, of h, k_hat, u_hat and eps: how
  large each part of h_bar is (the known share cannot be large while k_hat is small next to h);
- ``alignment_overlap`` (``alignment=True``): an offline proxy for Known Concept Alignment: the share of the 20 tokens
  with the largest W K_c that are among the concept's 20 most lifted tokens (lift = P(token | chunk has c) /
  P(token), from the training windows), next to the same overlap with a random other concept's lifted tokens; and
  the same for W (K_c - mean K) (``_centered``), the direction steering uses.

A PRISM model reports ``prototype_*`` instead of the concept metrics (``prism_batch_metrics``).
"""

from __future__ import annotations

import numpy as np
import torch

from atlas.cblm.data import SPECIAL_IDS, TokenData, lifted_tokens
from atlas.cblm.losses import chunk_probabilities, compute, concept_loss
from atlas.cblm.prism import PrototypeParts
from atlas.cblm.prism import decompose as prism_decompose


@torch.no_grad()
def evaluate(model, data: TokenData, batches: int | None = 8, batch_size: int = 8, device: str = "cpu",
             seed: int = 0, alignment: bool = False) -> dict:
    model.eval()
    generator = torch.Generator(device=device).manual_seed(seed)
    windows = data.val_windows if len(data.val_windows) else data.train_windows
    starts = list(range(0, len(windows), batch_size))[: batches if batches else None]
    lm_sum = lm_count = 0.0
    concept_sum = indep_sum = contribution_sum = known_sum = contribution_count = 0.0
    probabilities, labels, norms, positions, prism_sums = [], [], {}, 0, {}
    for start in starts:
        batch = data.batch(windows[start:start + batch_size]).to(device)
        _, losses, extras = compute(model, batch, generator=generator)
        scored = extras["scored"]
        count = float(scored.sum()) if scored is not None else float(extras["targets"].numel())
        lm_sum += float(losses["lm"]) * count
        lm_count += count
        parts = extras["parts"]
        if parts is None:
            continue
        if isinstance(parts, PrototypeParts):
            prism_sums = _add(prism_sums, prism_batch_metrics(model, parts, extras["targets"], scored))
            continue
        aggregation = model.config.concept_aggregation
        concept_sum += float(concept_loss(parts.known_logits, extras["rows"], extras["labels"],
                                          aggregation=aggregation))
        indep_sum += float(losses["indep"])
        w_y = model.tok_emb.weight[extras["targets"]]
        known, unknown, residual = ((x * w_y).sum(-1).abs() for x in (parts.k_hat, parts.u_hat, parts.eps))
        total = (known + unknown + residual).clamp_min(1e-12)
        share, known_share = (known + unknown) / total, known / total
        if scored is not None:
            share, known_share = share[scored], known_share[scored]
        for name, x in (("h", parts.h), ("k_hat", parts.k_hat), ("u_hat", parts.u_hat), ("eps", parts.eps)):
            norms[name] = norms.get(name, 0.0) + float(x.norm(dim=-1).sum())
        contribution_sum += float(share.sum())
        known_sum += float(known_share.sum())
        contribution_count += share.numel()
        positions += parts.h.shape[0] * parts.h.shape[1]
        probabilities.append(chunk_probabilities(parts.known_logits, extras["rows"], len(extras["labels"]),
                                                 aggregation).cpu())
        labels.append(extras["labels"].cpu())

    metrics = {"val_loss": lm_sum / max(lm_count, 1.0), "val_tokens": int(lm_count)}
    if prism_sums:
        count = prism_sums.pop("positions")
        metrics.update({name: total / count for name, total in prism_sums.items()})
    if probabilities:
        n_batches = len(probabilities)
        metrics.update(concept_loss=concept_sum / n_batches, independence=indep_sum / n_batches,
                       contribution=contribution_sum / max(contribution_count, 1.0),
                       contribution_known=known_sum / max(contribution_count, 1.0),
                       detection_auc=detection_auc(torch.cat(probabilities).numpy(), torch.cat(labels).numpy()),
                       norm_known_emb=float(model.concepts.known_emb.norm(dim=-1).mean()),
                       **{f"norm_{name}": total / positions for name, total in norms.items()})
        if alignment:
            metrics.update(alignment_proxy(model, data))
    return metrics


def _add(sums: dict, values: dict) -> dict:
    return {k: sums.get(k, 0.0) + v for k, v in values.items()}


def prism_batch_metrics(model, parts: PrototypeParts, targets: torch.Tensor, scored: torch.Tensor | None) -> dict:
    """Sums over a batch's scored positions (divided by ``positions`` in ``evaluate``): ``prototype_share``, the
    prototypes' part of the true token's logit, |sum_i a_i (W p_i)_y| / (that + |(W r)_y|), the PRISM analogue of the
    contribution; ``prototype_active``, how many prototypes are active (a > 0, at most top-k); ``prototype_cos``, the
    cosine of h to its nearest prototype (what L_R2 raises); ``prototype_residual``, |r| / |z|."""
    parts_y = prism_decompose(model.tok_emb.weight, model.prism, parts, targets)
    prototypes, residual = parts_y["prototypes"].sum(-1).abs(), parts_y["residual"].abs()
    values = {"prototype_share": prototypes / (prototypes + residual).clamp_min(1e-12),
              "prototype_active": (parts.alpha > 0).sum(-1).to(prototypes.dtype),
              "prototype_cos": parts.cos.max(-1).values,
              "prototype_residual": parts.residual.norm(dim=-1) / parts.z.norm(dim=-1).clamp_min(1e-12)}
    mask = scored if scored is not None else torch.ones_like(prototypes, dtype=torch.bool)
    return {"positions": float(mask.sum()), **{k: float(v[mask].sum()) for k, v in values.items()}}


def detection_auc(probabilities: np.ndarray, labels: np.ndarray) -> float:
    """Macro ROC AUC over the concepts (columns) that have both positive and negative chunks."""
    from sklearn.metrics import roc_auc_score

    positives = labels.sum(0)
    usable = np.flatnonzero((positives > 0) & (positives < len(labels)))
    if len(usable) == 0:
        return float("nan")
    return float(np.mean([roc_auc_score(labels[:, c], probabilities[:, c]) for c in usable]))


@torch.no_grad()
def concept_top_tokens(model, data: TokenData, top: int = 20, centered: bool = False) -> np.ndarray:
    """[n, top]: the model-vocabulary ids with the largest W K_c per known concept (special tokens left out);
    ``centered``: of W (K_c - mean K), the direction steering uses."""
    known = model.concepts.known_emb
    if centered:
        known = known - known.mean(0)
    scores = known @ model.tok_emb.weight.T  # [n, vocab]
    scores[:, np.searchsorted(data.vocab, np.asarray(SPECIAL_IDS))] = -float("inf")
    return scores.topk(top, dim=-1).indices.cpu().numpy()


def alignment_proxy(model, data: TokenData, top: int = 20, seed: int = 0) -> dict:
    lifted = lifted_tokens(data, top)
    scored = [c for c in range(data.n_concepts) if len(lifted[c])]
    if not scored:
        return {}
    other = np.random.default_rng(seed).permutation(scored)
    result = {"alignment_concepts": len(scored)}
    for suffix, centered in (("", False), ("_centered", True)):
        predicted = concept_top_tokens(model, data, top, centered)

        def overlap(c: int, d: int, predicted=predicted) -> float:
            return len(np.intersect1d(predicted[c], lifted[d])) / top

        result[f"alignment_overlap{suffix}"] = float(np.mean([overlap(c, c) for c in scored]))
        result[f"alignment_overlap{suffix}_random_concept"] = float(np.mean([overlap(c, d)
                                                                             for c, d in zip(scored, other)]))
    return result
