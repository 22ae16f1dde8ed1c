"""The PRISM output head (seeds 000, "training-data prototypes"; ``seeds/NOTES.md`` 2.1): every next-token logit
splits exactly into a sparse, non-negative mix of K learned prototypes plus a residual.

    c_{t,i}  = cos(z_t, p_i)                                  z_t: the backbone's final hidden state, P = [p_1..p_K]
    a~_{t,i} = ReLU(tau * c_{t,i})                            tau > 0 learned (stored as its log)
    a_{t,i}  = a~_{t,i} if i is among the k largest a~_t, else 0          (top-k routing)
    z^_t     = sum_i a_{t,i} p_i,    r_t = z_t - z^_t,    logits l_t = W (z^_t + r_t) = W z_t

so l_t = W r_t + sum_i a_{t,i} (W p_i) exactly (``decompose``): each prototype has a fixed logit signature W p_i. The
prototypes do not change the logits; the losses pull the hidden-state geometry toward them (the source weighs L_R1,
L_R2 and L_RES by 1; the trainer by ``lambda_prism`` = 0.1 and L_DIV by ``lambda_div`` = 1, see ``train.py``):

    L_R1  = mean_i min_j -cos(p_i, z_j)     every prototype anchors to some token of the batch
    L_R2  = mean_j min_i -cos(p_i, z_j)     every token is close to some prototype
    L_RES = mean over positions and coordinates of r_t^2   ("mean squared residual"; we average over coordinates too,
            so the weight means the same at every width)
    L_DIV = mean_{i != j} cos(p_i, p_j)^2   the source's optional diversity term

The source leaves k open; the default, 16, is the number of active prototypes its group intervention inspects.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class PrototypeParts:
    """What the PRISM head computed for a batch; all [B, T, ...]."""

    z: torch.Tensor  # the backbone's final hidden state
    cos: torch.Tensor  # [B, T, K] cosine to every prototype
    alpha: torch.Tensor  # [B, T, K] top-k routed activations (zero outside the top k)
    z_hat: torch.Tensor  # sparse reconstruction
    residual: torch.Tensor  # z - z_hat


class PrototypeHead(nn.Module):
    def __init__(self, d_model: int, prototypes: int, topk: int):
        super().__init__()
        self.topk = min(topk, prototypes)
        self.prototypes = nn.Parameter(torch.randn(prototypes, d_model) / math.sqrt(d_model))  # [K, d]
        self.log_tau = nn.Parameter(torch.tensor(math.log(math.sqrt(d_model))))  # |z| of an RMS-normed state

    def activations(self, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos [.., K], a [.., K]): cosine to each prototype and the top-k routed activations."""
        cos = F.normalize(z, dim=-1) @ F.normalize(self.prototypes, dim=-1).T
        dense = F.relu(self.log_tau.exp() * cos)
        top = dense.topk(self.topk, dim=-1)
        return cos, torch.zeros_like(dense).scatter_(-1, top.indices, top.values)

    def forward(self, z: torch.Tensor) -> PrototypeParts:
        cos, alpha = self.activations(z)
        z_hat = alpha @ self.prototypes
        return PrototypeParts(z, cos, alpha, z_hat, z - z_hat)


def prism_losses(head: PrototypeHead, parts: PrototypeParts, diversity: bool = False) -> dict[str, torch.Tensor]:
    """The PRISM losses of a batch, unweighted (all positions of the batch are I(B)); L_DIV with ``diversity``."""
    cos = parts.cos.reshape(-1, parts.cos.shape[-1]).float()  # [N, K]
    losses = {"r1": -cos.max(0).values.mean(), "r2": -cos.max(1).values.mean(),
              "res": parts.residual.float().pow(2).mean()}
    if diversity:
        unit = F.normalize(head.prototypes.float(), dim=-1)
        gram = unit @ unit.T
        k = len(gram)
        losses["div"] = (gram.pow(2).sum() - gram.diagonal().pow(2).sum()) / (k * (k - 1))
    return losses


def decompose(token_emb: torch.Tensor, head: PrototypeHead, parts: PrototypeParts,
              targets: torch.Tensor) -> dict[str, torch.Tensor]:
    """The exact split of each position's logit for token ``targets`` [B, T]:
    prototypes [B, T, K] = a_i (W p_i)_y, residual [B, T] = (W r)_y, logit = their sum (= the model's logit)."""
    w_y = token_emb[targets]  # [B, T, d]
    prototypes = parts.alpha * (w_y @ head.prototypes.T)
    residual = (parts.residual * w_y).sum(-1)
    return {"prototypes": prototypes, "residual": residual, "logit": prototypes.sum(-1) + residual}
