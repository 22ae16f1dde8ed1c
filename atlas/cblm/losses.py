"""The training losses of the concept-bottleneck LM (paper 5.4; ``seeds/NOTES.md`` 1.7 and 1.9).

    L = L_LM + lambda_concept L_concept + lambda_rec L_rec + lambda_indep L_indep + lambda_known L_known

- ``lm_loss``: next-token cross-entropy (AR, Eq. 1) or cross-entropy on the masked positions only, averaged over
  them (masked diffusion, Eq. 2), computed on h_bar.
- ``concept_loss``: chunk-level BCE, computed from the known head's logits, either per token against the chunk's
  labels (``aggregation="token"``, the default) or with the paper's OR-aggregation over the chunk's tokens
  (Eq. 9-10), k_chunk = 1 - prod_t (1 - k_t), in log space. Reported per concept (the mean over the n concepts): the
  paper's Eq. 10 is a sum, but its reported values (~0.002) are per-concept means.
- ``reconstruction_loss``: ||u_hat - u_hat_GT||^2 with u_hat_GT = h - k_hat_GT, summed over the d coordinates and
  averaged over positions (Eq. 11-12). (Atlas used to divide it by d; at d = 128 that weakened it 128-fold, and once
  K carries words the unknown head then left a third of h to the residual eps.)
- ``independence_loss``: ||Psi^T Phi||_F^2 / (d^2 (B - 1)) between centred stacks of u_hat and k_hat (Eq. 13-14).
- ``known_readout_loss`` (ours, ``lambda_known``; not in the paper): the true concepts' embeddings, read by the LM
  head over the corpus unigram, predict their chunk's tokens. See its docstring and ``train.py`` for why.

The reconstruction and independence losses reach only the unknown head: they read ``u_hat_aux`` (the unknown head
applied to h.detach()) and detached targets, as the paper's gradient detachment prescribes.

Steering training (paper 10.2.4, Eq. 31-33; ``compute_steering`` below): at the set I of positions attributed to a
concept c (``data.SteeringData``), gamma_c e_c is injected into the residual stream after every layer >= L_inj, and

    L = L_LM + lambda_respond L_respond + lambda_express L_express
    L_respond = -(1/|I|) sum_{t in I} log k_{c,t}                                     (the known head sees c)
    L_express = -(1/|I|) sum_{t in I} log sum_{y in T_c} softmax(l_t)_y                (the logits put mass on T_c)

with the concept, reconstruction and independence losses off, as in the paper's steering phases.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from atlas.cblm.data import SteeringData
from atlas.cblm.model import Steering, injection_layer, steering_directions
from atlas.cblm.prism import PrototypeParts, prism_losses


def lm_loss(logits: torch.Tensor, targets: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
    """Mean cross-entropy of ``logits`` [B, T, V] against ``targets`` [B, T] over the positions where ``weight``
    (bool [B, T]) is set (all when None)."""
    losses = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="none")
    if weight is None:
        return losses.mean()
    weight = weight.flatten().to(losses.dtype)
    return (losses * weight).sum() / weight.sum().clamp_min(1.0)


def chunk_log_not_active(known_logits: torch.Tensor, chunk_rows: torch.Tensor, n_chunks: int) -> torch.Tensor:
    """S [C, n] with log(1 - k_chunk) = -S: the sum over each chunk's tokens of softplus(f(h)), since
    log(1 - sigmoid(x)) = -softplus(x). ``chunk_rows`` [B, T] gives each position's chunk."""
    n = known_logits.shape[-1]
    per_token = F.softplus(known_logits.float()).reshape(-1, n)
    return torch.zeros(n_chunks, n, device=known_logits.device).index_add_(0, chunk_rows.reshape(-1), per_token)


def chunk_probabilities(known_logits: torch.Tensor, chunk_rows: torch.Tensor, n_chunks: int,
                        aggregation: str = "or") -> torch.Tensor:
    """[C, n] chunk-level concept probabilities: "or": k_chunk = 1 - prod_t (1 - k_t) (Eq. 9); "token": the mean of
    k_t over the chunk's tokens."""
    if aggregation == "token":
        n = known_logits.shape[-1]
        rows = chunk_rows.reshape(-1)
        sums = torch.zeros(n_chunks, n, device=known_logits.device).index_add_(
            0, rows, torch.sigmoid(known_logits.float()).reshape(-1, n))
        counts = torch.bincount(rows, minlength=n_chunks).clamp_min(1)[:, None]
        return sums / counts
    return -torch.expm1(-chunk_log_not_active(known_logits, chunk_rows, n_chunks))


def concept_loss(known_logits: torch.Tensor, chunk_rows: torch.Tensor, labels: torch.Tensor,
                 per_concept: bool = False, aggregation: str = "or") -> torch.Tensor:
    """Chunk-level concept BCE, averaged over chunks and concepts (``per_concept``: the [n] mean over chunks).

    "or" (paper Eq. 9-10): one BCE per chunk on its OR-aggregated probability. "token" (ours): every token of a chunk
    carries the chunk's labels, one BCE per token, averaged per chunk and then over chunks. OR-aggregation is
    satisfied by a single active token per chunk, so on chunks of ~100 tokens it trains k_t ~ 1/100 and the known part
    k_hat = k K vanishes at inference, while teacher forcing feeds the chunk's labels (k = 1) at every token."""
    if aggregation == "token":
        n = known_logits.shape[-1]
        rows = chunk_rows.reshape(-1)
        per_token = F.binary_cross_entropy_with_logits(known_logits.float().reshape(-1, n), labels[rows],
                                                       reduction="none")
        counts = torch.bincount(rows, minlength=len(labels)).clamp_min(1)[:, None]
        bce = torch.zeros_like(labels).index_add_(0, rows, per_token) / counts
        present = torch.bincount(rows, minlength=len(labels)) > 0
        bce = bce[present]
    else:
        s = chunk_log_not_active(known_logits, chunk_rows, labels.shape[0])
        log_active = torch.log(-torch.expm1(-s.clamp_min(1e-6)))  # log(1 - exp(-S)), stable for small S
        bce = -(labels * log_active) + (1 - labels) * s
    return bce.mean(0) if per_concept else bce.mean()


def reconstruction_loss(u_hat_aux: torch.Tensor, h: torch.Tensor, k_hat_target: torch.Tensor,
                        weight: torch.Tensor | None = None) -> torch.Tensor:
    """Mean over positions (where ``weight`` is set) of ||u_hat - (h - k_hat_GT)||^2; the target is detached."""
    target = (h - k_hat_target).detach()
    per_position = (u_hat_aux - target).pow(2).sum(-1)
    if weight is None:
        return per_position.mean()
    weight = weight.to(per_position.dtype)
    return (per_position * weight).sum() / weight.sum().clamp_min(1.0)


def independence_loss(other: torch.Tensor, known: torch.Tensor) -> torch.Tensor:
    """HSIC-style linear cross-covariance ||Psi^T Phi||_F^2 / (d^2 (B - 1)) of token stacks [..., d];
    ``known`` (Phi) is a fixed input (detached)."""
    psi = other.reshape(-1, other.shape[-1]).float()
    phi = known.reshape(-1, known.shape[-1]).detach().float()
    b, d = psi.shape
    psi, phi = psi - psi.mean(0), phi - phi.mean(0)
    return (psi.T @ phi).pow(2).sum() / (d * d * max(b - 1, 1))


def mask_blocks(tokens: torch.Tensor, block_size: int, mask_id: int, t_min: float = 0.05, t_max: float = 0.95,
                generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal-diffusion corruption (paper 5.4.2): every block of ``block_size`` tokens draws its own noise level
    t_b ~ U(t_min, t_max) and each of its tokens becomes [MASK] with probability t_b. Returns (input, masked)."""
    B, T = tokens.shape
    n_blocks = -(-T // block_size)
    t = t_min + (t_max - t_min) * torch.rand(B, n_blocks, generator=generator, device=tokens.device)
    t = t.repeat_interleave(block_size, dim=1)[:, :T]
    masked = torch.rand(B, T, generator=generator, device=tokens.device) < t
    return torch.where(masked, torch.full_like(tokens, mask_id), tokens), masked


def respond_loss(known_logits: torch.Tensor, concept_at: torch.Tensor) -> torch.Tensor:
    """Eq. 31: mean over the positions with ``concept_at`` >= 0 of -log k_{c,t} = softplus(-f_c(h_t))."""
    injected = concept_at >= 0
    logit = known_logits[injected].gather(-1, concept_at[injected][:, None])[:, 0]
    return F.softplus(-logit.float()).mean() if len(logit) else known_logits.sum() * 0.0


def express_loss(logits: torch.Tensor, concept_at: torch.Tensor, lifted_ids: torch.Tensor) -> torch.Tensor:
    """Eq. 32: mean over the positions with ``concept_at`` >= 0 of -log (softmax mass of the lifted set T_c);
    ``lifted_ids`` [n, top] lists each T_c, padded with -1."""
    injected = concept_at >= 0
    rows = logits[injected].float()  # [|I|, V]
    if not len(rows):
        return logits.sum() * 0.0
    lifted = lifted_ids[concept_at[injected]]  # [|I|, top]
    mass = rows.gather(-1, lifted.clamp_min(0)).masked_fill(lifted < 0, -float("inf"))
    return (rows.logsumexp(-1) - mass.logsumexp(-1)).mean()


def known_readout_loss(known_emb: torch.Tensor, token_emb: torch.Tensor, labels: torch.Tensor,
                       target_rows: torch.Tensor, targets: torch.Tensor, log_unigram: torch.Tensor) -> torch.Tensor:
    """Each chunk's true concepts, read by the LM head alone, predict the chunk's tokens over the corpus unigram:

        L_known = mean over predicted tokens y_t (of chunks with a concept) of -log softmax(log p + W k_hat_GT)_{y_t}

    with k_hat_GT = sum of the chunk's concept embeddings, W the token embedding (tied LM head) and log p the training
    windows' log unigram. Its minimum has W K_c close to the log-lift log P(y | c) / P(y) of concept c's words, so K_c
    carries c's words (not the words every text has), steering along it raises them, and the known term of a logit is
    large for exactly those words. It trains K and W: with W detached, the embeddings of a concept's rarer words stay
    near their initialization in a small model and no K_c can single them out (alignment at chance). Computed per
    chunk: [C, V], not [B, T, V]."""
    has_concept = labels.sum(-1) > 0  # [C]
    logits = log_unigram + (labels @ known_emb) @ token_emb.T  # [C, V]
    nll = logits.logsumexp(-1)[target_rows] - logits[target_rows, targets]  # [B, T]
    weight = has_concept[target_rows].to(nll.dtype)
    return (nll * weight).sum() / weight.sum().clamp_min(1.0)


def _inputs(model, batch, generator: torch.Generator | None = None):
    """(inputs, targets, scored, target_rows): what the model reads, the tokens it predicts, the positions the LM
    loss scores (None = all) and each predicted token's chunk row. AR predicts the next token; diffusion its own
    masked tokens."""
    config = model.config
    T = config.seq_len
    if config.objective == "diffusion":
        targets = batch.tokens[:, :T]
        inputs, scored = mask_blocks(targets, config.block_size, config.mask_id, generator=generator)
        return inputs, targets, scored, batch.chunk_rows[:, :T]
    return batch.tokens[:, :T], batch.tokens[:, 1:T + 1], None, batch.chunk_rows[:, 1:T + 1]


def compute(model, batch, alpha_known: float = 0.0, alpha_unknown: float = 0.0, lambdas=(1.0, 1.0, 1.0),
            generator: torch.Generator | None = None, lambda_known: float = 0.0,
            log_unigram: torch.Tensor | None = None, lambdas_prism=(1.0, 0.0)):
    """One forward pass on ``batch`` and every loss. Returns (total, {name: value}, extras) where extras holds what
    the metrics need: the logits, targets, positions scored, bottleneck parts and chunk rows/labels.
    ``lambda_known`` > 0 adds ``known_readout_loss`` (``log_unigram``: the training windows' log unigram, [V]).
    A PRISM model adds its losses (``prism.prism_losses``): ``lambdas_prism`` = (weight of L_R1, L_R2 and L_RES,
    weight of L_DIV)."""
    T = model.config.seq_len
    inputs, targets, scored, target_rows = _inputs(model, batch, generator)
    # Only the chunks that have a token among the inputs take part in the concept loss.
    present, rows = torch.unique(batch.chunk_rows[:, :T], return_inverse=True)
    labels = batch.labels[present]
    known_target = labels[rows] if model.concepts is not None else None
    logits, parts = model(inputs, known_target, alpha_known, alpha_unknown)
    losses = {"lm": lm_loss(logits, targets, scored)}
    total = losses["lm"]
    if isinstance(parts, PrototypeParts):
        lambda_prism, lambda_div = lambdas_prism
        prism = prism_losses(model.prism, parts, diversity=lambda_div > 0)
        losses.update(prism)
        total = total + lambda_prism * (prism["r1"] + prism["r2"] + prism["res"]) + lambda_div * prism.get("div", 0.0)
    elif parts is not None:
        lambda_concept, lambda_rec, lambda_indep = lambdas
        losses["concept"] = concept_loss(parts.known_logits, rows, labels,
                                         aggregation=model.config.concept_aggregation)
        u_hat = parts.u_hat_aux if parts.u_hat_aux is not None else parts.u_hat
        losses["rec"] = reconstruction_loss(u_hat, parts.h, parts.k_hat_target, scored)
        losses["indep"] = independence_loss(u_hat, parts.k @ model.concepts.known_emb)  # the predicted k_hat
        total = (total + lambda_concept * losses["concept"] + lambda_rec * losses["rec"]
                 + lambda_indep * losses["indep"])
        if lambda_known > 0:
            losses["known"] = known_readout_loss(model.concepts.known_emb, model.tok_emb.weight, batch.labels,
                                                 target_rows, targets, log_unigram)
            total = total + lambda_known * losses["known"]
    extras = {"logits": logits, "targets": targets, "scored": scored, "parts": parts, "rows": rows, "labels": labels}
    return total, losses, extras


def compute_steering(model, batch, data: SteeringData, tau: float, lambdas=(1.0, 1.0),
                     generator: torch.Generator | None = None):
    """One steering-training step's losses (Eq. 33): inject tau / peak_c * e_c (``model.steering_directions``: the
    vector generation injects at strength tau) at the positions attributed to a concept, with no teacher forcing.
    Returns (total, {name: value}, concept_at)."""
    inputs, targets, scored, target_rows = _inputs(model, batch, generator)
    concept_at = data.concepts_at(targets, batch.labels[target_rows])
    if scored is not None:  # diffusion: only masked positions are predicted, so only they can be steered
        concept_at = concept_at.masked_fill(~scored, -1)
    injected_at = concept_at >= 0
    injected, _, peak = steering_directions(model)
    chosen = concept_at.clamp_min(0)
    # F.embedding, not injected[chosen]: on a CPU with several threads the backward of indexing adds the positions
    # of a concept chosen at many of them with parallel atomic adds, in whatever order the threads run, so two runs
    # of the same steps (a resumed one and an uninterrupted one) differ by ~1e-6; embedding's backward adds in order
    vectors = F.embedding(chosen, (tau / peak.clamp_min(1e-6))[:, None] * injected)  # [B, T, d]
    steer = Steering(direction=vectors, gamma=1.0, layer=injection_layer(model.config), positions=injected_at)
    logits, parts = model(inputs, steer=steer)
    losses = {"lm": lm_loss(logits, targets, scored), "respond": respond_loss(parts.known_logits, concept_at),
              "express": express_loss(logits, concept_at, data.lifted_ids.to(logits.device))}
    total = losses["lm"] + lambdas[0] * losses["respond"] + lambdas[1] * losses["express"]
    return total, losses, concept_at
