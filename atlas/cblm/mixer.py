"""The prototype mixer of the Prototype Transformer (ProtoT, seeds 002 Eq. 1; ``seeds/NOTES.md`` 2.2), a drop-in
replacement of self-attention (``ModelConfig.mixer = "prototype"``):

    y_i = alpha * U( sum_k read_{i,k} * prefix_{i,k} )
    prefix_{i,k} = sum_{j<i} beta_k^{i-j} write_{j,k} v_j  /  sum_{j<i} beta_k^{i-j} write_{j,k}

- R channels, each with a learned prototype P_k [d]. The write gate write_{j,k} = softmax_k(x_j.P_k / tau_w) routes
  token j into channels; the read gate read_{i,k} = softmax_k(Wr(x_i).P_k / tau_r) picks the channels token i reads.
  Layer 0 shares the routing (no Wr: the read gate is the write gate) and starts its temperatures at 3.
- Strict causality: token i reads only j < i, never itself (the first position reads nothing: y_0 = 0).
- beta_k = sigmoid(gamma_k): a per-channel discount, initialised spread out so channels start with different
  memories; dividing by the discounted write mass makes each channel a prefix *mean*.
- The value path is low rank: v = V(x) has d/2 dimensions and U maps it back (paper: up to 50% less mixer compute);
  at layers 0 and 1 a causal depthwise convolution (kernel 5: 4 past tokens and the current one) mixes v locally.
- alpha, a ReZero-like scalar initialised to 1: a collapsing alpha is a dead mixer (``routing_metrics``).

Two forms compute the same thing: ``forward`` (parallel, for training: a [R, T, T] discount matrix, O(T^2 R), fine at
the sequence lengths this trainer uses) and ``step`` (recurrent, for generation: a state of size R x (d/2 + 1) plus
the convolution's last 4 values per layer, whatever the length, so O(1) memory and time per generated token).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

CONV_KERNEL = 5
MASS_EPS = 1e-6  # keeps the first position's empty prefix at 0 / (0 + eps) = 0


class PrototypeMixer(nn.Module):
    def __init__(self, d_model: int, channels: int, layer: int):
        super().__init__()
        self.channels, self.value_dim = channels, d_model // 2
        self.prototypes = nn.Parameter(torch.randn(channels, d_model) / math.sqrt(d_model))
        self.shared_routing = layer == 0
        self.read = None if self.shared_routing else nn.Linear(d_model, d_model, bias=False)
        tau = 3.0 if layer == 0 else 1.0
        self.log_tau_write = nn.Parameter(torch.tensor(math.log(tau)))
        self.log_tau_read = nn.Parameter(torch.tensor(math.log(tau)))
        # beta from sigmoid(-1) = 0.27 (a memory of ~1 token) to sigmoid(4) = 0.98 (~50 tokens)
        self.decay_logit = nn.Parameter(torch.linspace(-1.0, 4.0, channels))
        self.value = nn.Linear(d_model, self.value_dim, bias=False)
        self.proj = nn.Linear(self.value_dim, d_model, bias=False)
        self.conv = (nn.Conv1d(self.value_dim, self.value_dim, CONV_KERNEL, groups=self.value_dim, bias=False)
                     if layer < 2 else None)
        self.alpha = nn.Parameter(torch.ones(()))

    def gates(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(write, read) routing weights [..., R], each a softmax over the channels."""
        write = F.softmax(x @ self.prototypes.T / self.log_tau_write.exp(), dim=-1)
        if self.shared_routing:
            return write, write
        return write, F.softmax(self.read(x) @ self.prototypes.T / self.log_tau_read.exp(), dim=-1)

    def values(self, x: torch.Tensor) -> torch.Tensor:
        """v [B, T, d/2], after the causal depthwise convolution where the layer has one."""
        v = self.value(x)
        if self.conv is None:
            return v
        return self.conv(F.pad(v.transpose(1, 2), (CONV_KERNEL - 1, 0))).transpose(1, 2)

    def forward(self, x: torch.Tensor, *_) -> torch.Tensor:
        """Parallel form: x [B, T, d] -> [B, T, d]. Extra arguments (RoPE tables, mask) are ignored."""
        T = x.shape[1]
        write, read = self.gates(x)
        v = self.values(x)
        distance = torch.arange(T, device=x.device)[:, None] - torch.arange(T, device=x.device)[None, :]  # i - j
        log_beta = F.logsigmoid(self.decay_logit)  # [R]
        strictly_before = (distance > 0).to(x.dtype)
        discount = torch.exp(log_beta[:, None, None] * distance.clamp_min(0)) * strictly_before  # [R, T, T]
        weighted = discount[None] * write.transpose(1, 2)[:, :, None, :]  # [B, R, i, j]
        mass = weighted.sum(-1)  # [B, R, T]
        prefix = (weighted @ v[:, None]) / (mass[..., None] + MASS_EPS)  # [B, R, T, d/2]
        mixed = torch.einsum("btr,brtd->btd", read, prefix)
        return self.alpha * self.proj(mixed)

    def initial_state(self, batch: int, device, dtype) -> dict:
        return {"sum": torch.zeros(batch, self.channels, self.value_dim, device=device, dtype=dtype),
                "mass": torch.zeros(batch, self.channels, device=device, dtype=dtype),
                "window": torch.zeros(batch, CONV_KERNEL - 1, self.value_dim, device=device, dtype=dtype)}

    def step(self, x: torch.Tensor, state: dict) -> tuple[torch.Tensor, dict]:
        """Recurrent form: one position x [B, d] and the state after the previous positions -> (y [B, d], state)."""
        write, read = self.gates(x)
        raw = self.value(x)
        window = torch.cat([state["window"], raw[:, None]], dim=1)  # the last 5 raw values, oldest first
        v = raw if self.conv is None else torch.einsum("bkd,dk->bd", window, self.conv.weight[:, 0])
        prefix = state["sum"] / (state["mass"][..., None] + MASS_EPS)  # positions j < i only
        y = self.alpha * self.proj(torch.einsum("br,brd->bd", read, prefix))
        beta = torch.sigmoid(self.decay_logit)[None]
        new_state = {"sum": beta[..., None] * (state["sum"] + write[..., None] * v[:, None]),
                     "mass": beta * (state["mass"] + write),
                     "window": window[:, 1:]}
        return y, new_state


@torch.no_grad()
def routing_metrics(mixer: PrototypeMixer, x: torch.Tensor) -> dict:
    """How healthy a mixer's routing is on inputs x [B, T, d] (paper Table 10): alpha; the Gini coefficient of the
    channels' total write mass (0: every channel used equally; a collapsed mixer is near 1); the mean top-1 write
    weight (1/R when routing is uniform, 1 when every token writes to one channel)."""
    write, _ = mixer.gates(x)
    load = write.reshape(-1, write.shape[-1]).sum(0).sort().values
    n = len(load)
    gini = float((2 * torch.arange(1, n + 1, dtype=load.dtype, device=load.device) - n - 1) @ load / (n * load.sum()))
    return {"alpha": float(mixer.alpha), "gini": gini, "top1_mass": float(write.max(-1).values.mean())}
