"""The training losses of the concept-bottleneck LM (paper 5.4; ``seeds/NOTES.md`` 1.7 and 1.9).

    L = L_LM + lambda_concept L_concept + lambda_rec L_rec + lambda_indep L_indep

- ``lm_loss``: next-token cross-entropy (AR, Eq. 1) or cross-entropy on the masked positions only, averaged over
  them (masked diffusion, Eq. 2), computed on h_bar.
- ``concept_loss``: chunk-level BCE with OR-aggregation over the chunk's tokens (Eq. 9-10),
  k_chunk = 1 - prod_t (1 - k_t), computed in log space from the known head's logits. Reported per concept (the
  mean over the n concepts): the paper's Eq. 10 is a sum, but its reported values (~0.002) are per-concept means.
- ``reconstruction_loss``: ||u_hat - u_hat_GT||^2 with u_hat_GT = h - k_hat_GT (Eq. 11-12), divided by d so that
  lambda = 1 means the same at every width.
- ``independence_loss``: ||Psi^T Phi||_F^2 / (d^2 (B - 1)) between centred stacks of u_hat and k_hat (Eq. 13-14).

The reconstruction and independence losses reach only the unknown head: they read ``u_hat_aux`` (the unknown head
applied to h.detach()) and detached targets, as the paper's gradient detachment prescribes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


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


def chunk_probabilities(known_logits: torch.Tensor, chunk_rows: torch.Tensor, n_chunks: int) -> torch.Tensor:
    """k_chunk = 1 - prod_t (1 - k_t), [C, n]."""
    return -torch.expm1(-chunk_log_not_active(known_logits, chunk_rows, n_chunks))


def concept_loss(known_logits: torch.Tensor, chunk_rows: torch.Tensor, labels: torch.Tensor,
                 per_concept: bool = False) -> torch.Tensor:
    """OR-aggregated chunk BCE, averaged over chunks and concepts (``per_concept``: the [n] mean over chunks)."""
    s = chunk_log_not_active(known_logits, chunk_rows, labels.shape[0])
    log_active = torch.log(-torch.expm1(-s.clamp_min(1e-6)))  # log(1 - exp(-S)), stable for small S
    bce = -(labels * log_active) + (1 - labels) * s
    return bce.mean(0) if per_concept else bce.mean()


def reconstruction_loss(u_hat_aux: torch.Tensor, h: torch.Tensor, k_hat_target: torch.Tensor,
                        weight: torch.Tensor | None = None) -> torch.Tensor:
    """Mean over positions (where ``weight`` is set) of ||u_hat - (h - k_hat_GT)||^2 / d; the target is detached."""
    target = (h - k_hat_target).detach()
    per_position = (u_hat_aux - target).pow(2).mean(-1)
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


def compute(model, batch, alpha_known: float = 0.0, alpha_unknown: float = 0.0, lambdas=(1.0, 1.0, 1.0),
            generator: torch.Generator | None = None):
    """One forward pass on ``batch`` and every loss. Returns (total, {name: value}, extras) where extras holds what
    the metrics need: the logits, targets, positions scored, bottleneck parts and chunk rows/labels."""
    config = model.config
    T = config.seq_len
    if config.objective == "diffusion":
        targets = batch.tokens[:, :T]
        inputs, scored = mask_blocks(targets, config.block_size, config.mask_id, generator=generator)
    else:
        inputs, targets, scored = batch.tokens[:, :T], batch.tokens[:, 1:T + 1], None
    # Only the chunks that have a token among the inputs take part in the concept loss.
    present, rows = torch.unique(batch.chunk_rows[:, :T], return_inverse=True)
    labels = batch.labels[present]
    known_target = labels[rows] if model.concepts is not None else None
    logits, parts = model(inputs, known_target, alpha_known, alpha_unknown)
    losses = {"lm": lm_loss(logits, targets, scored)}
    total = losses["lm"]
    if parts is not None:
        lambda_concept, lambda_rec, lambda_indep = lambdas
        losses["concept"] = concept_loss(parts.known_logits, rows, labels)
        u_hat = parts.u_hat_aux if parts.u_hat_aux is not None else parts.u_hat
        losses["rec"] = reconstruction_loss(u_hat, parts.h, parts.k_hat_target, scored)
        losses["indep"] = independence_loss(u_hat, parts.k @ model.concepts.known_emb)  # the predicted k_hat
        total = (total + lambda_concept * losses["concept"] + lambda_rec * losses["rec"]
                 + lambda_indep * losses["indep"])
    extras = {"logits": logits, "targets": targets, "scored": scored, "parts": parts, "rows": rows, "labels": labels}
    return total, losses, extras
