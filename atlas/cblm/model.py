"""The concept-bottleneck language model: a small transformer whose last hidden state passes through concepts.

Paper 5.2-5.3 (Steerling-8B), at toy scale. Read top to bottom:

    tokens -> embedding -> n_layer x Block (RMSNorm, attention with RoPE and QK-norm, SwiGLU) -> RMSNorm -> h
    h -> ConceptModule -> h_bar = k_hat + u_hat + eps -> logits = h_bar @ W^T  (W: the tied token embedding)

The concept module (paper 5.3, Eq. 5-8):

    known    k = sigmoid(f(h)) over the n library concepts,   k_hat = k @ K          (K: [n, d] concept embeddings)
    unknown  u = sigmoid(g(h)) over m = 3n free concepts,      u_hat = u @ U, U = A B (rank R)
    residual eps = h - k_hat - u_hat, each coordinate dropped with probability p_eps while training

so at inference h_bar == h, and every logit splits exactly into a term per known concept, a term per unknown
concept and a residual term: l_y = sum_c k_c K_c.W_y + sum_j u_j U_j.W_y + eps.W_y (see ``decompose``). Dropping
the residual while training is what pushes the prediction through the concepts.

``objective`` picks the attention: "ar" is causal; "diffusion" is the paper's causal diffusion, bidirectional inside
blocks of ``block_size`` tokens and causal across blocks. With ``n_concepts = 0`` there is no concept module
(h_bar = h): the baseline trained with the same budget.

The other interpretable models of the seeds are options of the same model (``seeds/NOTES.md`` 2):

- ``prototypes = K`` (without concepts): the PRISM output head (``prism.py``), logits = W r + sum_i a_i W p_i;
- ``mixer = "prototype"``: every attention replaced by the ProtoT prototype mixer (``mixer.py``), which also gives the
  model a recurrent form (``step``): O(1) time and memory per generated token;
- ``rope = "pi"``: signal/noise head pairs (seeds 003 Eq. 10): the first half of each layer's heads rotate with base
  pi * rope_base (slow, long-range "signal"), the second half with rope_base / pi (fast, local "noise").

The mixer and the RoPE variant change the backbone only, so they combine with the concept module or the PRISM head;
the concept module and the PRISM head are two heads for the same hidden state, so a model has one of them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from atlas.cblm.mixer import PrototypeMixer
from atlas.cblm.prism import PrototypeHead, PrototypeParts


@dataclass
class ModelConfig:
    vocab_size: int
    n_concepts: int = 0  # n known concepts; 0 = no concept module (the baseline)
    seq_len: int = 128
    n_layer: int = 2
    n_head: int = 4
    d_model: int = 64
    mlp_ratio: float = 4.0  # SwiGLU hidden size = mlp_ratio * d * 2/3 (same parameters as a 4x GELU MLP)
    rope_base: float = 10000.0
    objective: str = "ar"  # "ar" | "diffusion"
    block_size: int = 32  # diffusion: attention is bidirectional inside a block, causal across blocks
    mask_id: int = 0  # the [MASK] token's id in this model's vocabulary
    unknown_ratio: int = 3  # m = unknown_ratio * n unknown concepts
    unknown_rank: int = 32  # R: U = A B with A [m, R], B [R, d]
    topk_known: int = 0  # keep only the k largest known activations per token (0 = dense)
    topk_unknown: int = 0
    p_eps: float = 0.3  # dropout on the residual eps while training
    p_known_drop: float = 0.1  # paper's p_cfg: probability a position's known part k_hat is dropped while training
    steer_layer: int = -1  # L_inj, the first layer steering injects after (-1: n_layer // 2)
    # the concept loss: "or" (paper Eq. 9-10) or "token" (losses.concept_loss); TrainConfig sets it, and "or" is what
    # checkpoints saved before the setting existed were trained with
    concept_aggregation: str = "or"
    mixer: str = "attention"  # "attention" | "prototype" (ProtoT, mixer.py)
    mixer_channels: int = 32  # R, the ProtoT prototypes per layer (the source's default)
    rope: str = "standard"  # "standard" | "pi" (signal/noise head pairs); attention only
    prototypes: int = 0  # K, the PRISM head's prototypes (prism.py); 0 = no PRISM head
    prototype_topk: int = 16

    def __post_init__(self):
        if self.mixer not in ("attention", "prototype"):
            raise ValueError(f"mixer={self.mixer!r}: expected 'attention' or 'prototype'")
        if self.rope not in ("standard", "pi"):
            raise ValueError(f"rope={self.rope!r}: expected 'standard' or 'pi'")
        if self.rope == "pi" and self.n_head % 2:
            raise ValueError(f"rope='pi' pairs signal and noise heads: n_head must be even, not {self.n_head}")
        if self.prototypes and self.n_concepts:
            raise ValueError("the PRISM head (prototypes > 0) and the concept module are two heads for the same "
                             "hidden state: train one of them")
        if self.mixer == "prototype" and self.objective != "ar":
            raise ValueError("mixer='prototype' is strictly causal: it trains with objective='ar' only")

    def to_dict(self) -> dict:
        return asdict(self)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope_tables(seq_len: int, head_dim: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotary angles, [seq_len, head_dim / 2]."""
    inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def pi_rope_tables(seq_len: int, head_dim: int, base: float, n_head: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head tables [n_head, seq_len, head_dim / 2] for pi-RoPE: the first n_head / 2 heads (signal) use base
    pi * base, the others (noise) base / pi."""
    signal, noise = rope_tables(seq_len, head_dim, base * math.pi), rope_tables(seq_len, head_dim, base / math.pi)
    half = n_head // 2
    return (torch.stack([signal[0]] * half + [noise[0]] * half), torch.stack([signal[1]] * half + [noise[1]] * half))


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x1, x2) of the two halves of each head; x is [B, heads, T, head_dim]."""
    x1, x2 = x.chunk(2, dim=-1)
    cos, sin = cos[..., : x.shape[-2], :], sin[..., : x.shape[-2], :]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


def block_causal_mask(seq_len: int, block_size: int) -> torch.Tensor:
    """Boolean [T, T]: position i may attend to j when j's block is not after i's block."""
    block = torch.arange(seq_len) // block_size
    return block[None, :] <= block[:, None]


class Attention(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.n_head, self.head_dim = config.n_head, config.d_model // config.n_head
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model, bias=False)
        self.proj = nn.Linear(config.d_model, config.d_model, bias=False)
        self.q_norm, self.k_norm = RMSNorm(self.head_dim), RMSNorm(self.head_dim)  # QK-norm

    def _qkv(self, x, cos, sin):
        B, T, _ = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.n_head, self.head_dim).permute(2, 0, 3, 1, 4)
        return apply_rope(self.q_norm(q), cos, sin), apply_rope(self.k_norm(k), cos, sin), v

    def forward(self, x, cos, sin, mask: torch.Tensor | None) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self._qkv(x, cos, sin)
        if mask is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:T, :T])
        return self.proj(y.transpose(1, 2).reshape(B, T, C))

    def weights(self, x, cos, sin, mask: torch.Tensor | None) -> torch.Tensor:
        """The attention probabilities [B, heads, T, T] that ``forward`` uses (for diagnostics)."""
        T = x.shape[1]
        q, k, _ = self._qkv(x, cos, sin)
        allowed = torch.ones(T, T, dtype=torch.bool, device=x.device).tril() if mask is None else mask[:T, :T]
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(self.head_dim)
        return F.softmax(scores.masked_fill(~allowed, -float("inf")), dim=-1)


class SwiGLU(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        hidden = int(config.mlp_ratio * config.d_model * 2 / 3)
        self.gate_up = nn.Linear(config.d_model, 2 * hidden, bias=False)
        self.down = nn.Linear(hidden, config.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        mixer = (PrototypeMixer(config.d_model, config.mixer_channels, layer) if config.mixer == "prototype"
                 else Attention(config))
        self.attn_norm, self.attn = RMSNorm(config.d_model), mixer
        self.mlp_norm, self.mlp = RMSNorm(config.d_model), SwiGLU(config)

    def forward(self, x, cos, sin, mask):
        x = x + self.attn(self.attn_norm(x), cos, sin, mask)
        return x + self.mlp(self.mlp_norm(x))

    def step(self, x: torch.Tensor, state: dict) -> tuple[torch.Tensor, dict]:
        """One position x [B, d] through a prototype-mixer block, recurrently."""
        mixed, state = self.attn.step(self.attn_norm(x), state)
        x = x + mixed
        return x + self.mlp(self.mlp_norm(x)), state


@dataclass
class Bottleneck:
    """Everything the concept module computed for a batch; all [B, T, ...]."""

    h: torch.Tensor  # the backbone's final hidden state
    known_logits: torch.Tensor  # f(h), before the sigmoid: the concept loss is computed from these
    k: torch.Tensor  # known activations used (after top-k and edits)
    u: torch.Tensor  # unknown activations used
    k_hat: torch.Tensor  # the known part that went into h_bar (the ground truth where teacher-forced)
    u_hat: torch.Tensor
    eps: torch.Tensor  # residual, before dropout
    h_bar: torch.Tensor  # what the LM head reads
    u_hat_aux: torch.Tensor | None = None  # unknown head on h.detach(): the reconstruction and independence losses
    k_hat_target: torch.Tensor | None = None  # sum of the true concepts' embeddings (chunk labels), if given


def _topk(x: torch.Tensor, k: int) -> torch.Tensor:
    if not k or k >= x.shape[-1]:
        return x
    values, indices = x.topk(k, dim=-1)
    return torch.zeros_like(x).scatter(-1, indices, values)


class ConceptModule(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        d, n = config.d_model, config.n_concepts
        m, r = config.unknown_ratio * n, config.unknown_rank
        self.config = config
        self.known_head = nn.Linear(d, n)  # f
        self.known_emb = nn.Parameter(torch.randn(n, d) / math.sqrt(d))  # K, rows of norm ~1
        self.unknown_down = nn.Linear(d, r, bias=False)  # g = up(down(h)), rank R
        self.unknown_up = nn.Linear(r, m)
        self.unknown_a = nn.Parameter(torch.randn(m, r) / math.sqrt(r))  # U = A B
        self.unknown_b = nn.Parameter(torch.randn(r, d) / math.sqrt(d))
        nn.init.constant_(self.known_head.bias, -2.0)  # concepts are rare: start with few active
        nn.init.constant_(self.unknown_up.bias, -2.0)

    def unknown_embeddings(self) -> torch.Tensor:
        """U = A B, [m, d]."""
        return self.unknown_a @ self.unknown_b

    def unknown(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(u, u_hat): activations of the unknown concepts and their embedding sum, computed low-rank."""
        u = _topk(torch.sigmoid(self.unknown_up(self.unknown_down(h))), self.config.topk_unknown)
        return u, (u @ self.unknown_a) @ self.unknown_b

    def forward(
        self,
        h: torch.Tensor,
        known_target: torch.Tensor | None = None,
        alpha_known: float = 0.0,
        alpha_unknown: float = 0.0,
        edit: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> Bottleneck:
        """``known_target``: [B, T, n] true concepts of each token's chunk (multi-hot), for the losses and for
        teacher forcing: each position uses the true k_hat with probability ``alpha_known`` and the true u_hat
        (= h - true k_hat) with probability ``alpha_unknown`` (one convention: alpha is the probability of using
        the ground truth; 0 = the model's own predictions, as at inference).

        ``edit`` changes the known activations after eps is computed (eps stays fixed), so a logit moves by
        exactly the edited concepts' terms: this is the intervention that exact attribution promises.
        """
        config = self.config
        known_logits = self.known_head(h)
        k = _topk(torch.sigmoid(known_logits), config.topk_known)
        u, u_hat = self.unknown(h)
        k_hat = k @ self.known_emb
        eps = h - k_hat - u_hat
        if edit is not None:
            k = edit(k)
            k_hat = k @ self.known_emb

        k_hat_target = u_hat_aux = None
        if known_target is not None:
            k_hat_target = known_target.to(h.dtype) @ self.known_emb
        if self.training:
            u_hat_aux = self.unknown(h.detach())[1]
            if k_hat_target is not None and (alpha_known > 0 or alpha_unknown > 0):
                B, T, _ = h.shape
                use_known = torch.rand(B, T, 1, device=h.device) < alpha_known
                use_unknown = torch.rand(B, T, 1, device=h.device) < alpha_unknown
                k_hat = torch.where(use_known, k_hat_target, k_hat)
                u_hat = torch.where(use_unknown, h - k_hat_target, u_hat)
                eps = h - k_hat - u_hat  # zero where both parts are teacher-forced
            if config.p_known_drop > 0:
                keep = (torch.rand(*h.shape[:2], 1, device=h.device) >= config.p_known_drop).to(h.dtype)
                k_hat = k_hat * keep
            # Residual dropout without the usual 1/(1-p) rescaling: where eps is kept, h_bar = h exactly, and where
            # it is dropped the concepts alone must stand in for h. With rescaling, the kept coordinates would read
            # h/(1-p) - p/(1-p) (k_hat + u_hat): k_hat would enter with a negative sign there, and what K learns
            # would no longer point toward the tokens a concept predicts (steering came out reversed that way).
            keep = (torch.rand_like(eps) >= config.p_eps).to(eps.dtype)
            h_bar = k_hat + u_hat + keep * eps
        else:
            h_bar = k_hat + u_hat + eps
        return Bottleneck(h, known_logits, k, u, k_hat, u_hat, eps, h_bar, u_hat_aux, k_hat_target)


@dataclass
class Steering:
    """Paper 6.2: add ``gamma * direction`` to the hidden state after every layer >= ``layer`` (at ``positions``,
    default all), and for suppression subtract ``suppress * relu(W direction)`` from the logits (Eq. 18-21).

    ``direction`` is one vector [d] for generation, or one per position [B, T, d] for steering training, where each
    injected position pushes toward its own concept (``gamma`` then 1.0: the vectors carry their strength)."""

    direction: torch.Tensor  # [d] unit norm, or [B, T, d]: what is added to the residual stream
    gamma: float
    layer: int
    suppress: float = 0.0
    positions: torch.Tensor | None = None  # bool [B, T]: where to inject; None = everywhere
    logit_direction: torch.Tensor | None = None  # e_c for the suppression mask (default: ``direction``)


def injection_layer(config: ModelConfig) -> int:
    """L_inj: steering adds its vector after every layer from this one on (paper 6.2; L_inj is not given)."""
    return config.steer_layer if config.steer_layer >= 0 else config.n_layer // 2


def steering_directions(model: CBLM) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per known concept c: (injected [n, d], e [n, d], peak [n]), differentiable in K, W and the final norm, so that
    steering training (``losses.compute_steering``) and generation (``generate.steering_for``) inject the same thing.

    e_c = normalize(K_c - mean K): relative to the mean concept embedding, since the K_c share a common component
    (what any text's h has in common) along which steering promotes generic tokens. peak_c = max_y e_c.W_y, so
    gamma = tau / peak_c gives one strength tau the same meaning for every concept (Eq. 19). The injection happens
    before the final RMSNorm, which scales coordinate i by its learned weight w_i: injecting normalize(w * e_c)
    moves h along w^2 * e_c, which always has a positive inner product with e_c."""
    known = model.concepts.known_emb
    e = F.normalize(known - known.mean(0), dim=-1)
    peak = (e @ model.tok_emb.weight.T).amax(-1)
    injected = F.normalize(model.norm.weight * e, dim=-1)
    return injected, e, peak


class CBLM(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        assert config.d_model % config.n_head == 0 and (config.d_model // config.n_head) % 2 == 0
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
        self.blocks = nn.ModuleList([Block(config, layer) for layer in range(config.n_layer)])
        self.norm = RMSNorm(config.d_model)
        self.concepts = ConceptModule(config) if config.n_concepts else None
        self.prism = PrototypeHead(config.d_model, config.prototypes, config.prototype_topk) if config.prototypes \
            else None
        head_dim = config.d_model // config.n_head
        if config.rope == "pi":
            cos, sin = pi_rope_tables(config.seq_len, head_dim, config.rope_base, config.n_head)
        else:
            cos, sin = rope_tables(config.seq_len, head_dim, config.rope_base)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        mask = block_causal_mask(config.seq_len, config.block_size) if config.objective == "diffusion" else None
        self.register_buffer("attn_mask", mask, persistent=False)
        self.apply(self._init_weights)
        for name, p in self.named_parameters():  # GPT-2's scaled init of the residual projections
            if "blocks" in name and name.endswith(("proj.weight", "down.weight")):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=0.02)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=0.02)

    def hidden(self, idx: torch.Tensor, steer: Steering | None = None) -> torch.Tensor:
        """The backbone: token ids [B, T] -> final normalized hidden states h [B, T, d]."""
        x = self.tok_emb(idx)
        for layer, block in enumerate(self.blocks):
            x = _steered(block(x, self.rope_cos, self.rope_sin, self.attn_mask), layer, steer)
        return self.norm(x)

    def head(self, h: torch.Tensor, known_target=None, alpha_known: float = 0.0, alpha_unknown: float = 0.0,
             steer: Steering | None = None, edit=None) -> tuple[torch.Tensor, Bottleneck | PrototypeParts | None]:
        """Final hidden states h [..., d] -> logits and the parts of the concept module or PRISM head."""
        parts = None
        if self.concepts is not None:
            parts = self.concepts(h, known_target, alpha_known, alpha_unknown, edit)
            h = parts.h_bar
        elif self.prism is not None:
            parts = self.prism(h)
            h = parts.z_hat + parts.residual
        logits = h @ self.tok_emb.weight.T
        if steer is not None and steer.suppress:
            e_c = steer.direction if steer.logit_direction is None else steer.logit_direction
            logits = logits - steer.suppress * F.relu(self.tok_emb.weight @ e_c)
        return logits, parts

    def forward(
        self,
        idx: torch.Tensor,
        known_target: torch.Tensor | None = None,
        alpha_known: float = 0.0,
        alpha_unknown: float = 0.0,
        steer: Steering | None = None,
        edit: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, Bottleneck | None]:
        """Logits [B, T, vocab] and the head's parts (the concept module's Bottleneck, PRISM's PrototypeParts, or
        None for the plain baseline)."""
        return self.head(self.hidden(idx, steer), known_target, alpha_known, alpha_unknown, steer, edit)

    def initial_state(self, batch: int = 1) -> list[dict]:
        """The recurrent state of a prototype-mixer model before any token: one fixed-size dict per layer."""
        if self.config.mixer != "prototype":
            raise ValueError("only mixer='prototype' models have a recurrent form")
        weight = self.tok_emb.weight
        return [block.attn.initial_state(batch, weight.device, weight.dtype) for block in self.blocks]

    def step(self, idx: torch.Tensor, state: list[dict], steer: Steering | None = None):
        """Recurrent form of ``forward`` for one position: token ids [B] and the state after the previous tokens ->
        (logits [B, vocab], parts, new state). Equal to the parallel forward's last position, at O(1) cost."""
        x, new_state = self.tok_emb(idx), []
        for layer, (block, layer_state) in enumerate(zip(self.blocks, state)):
            x, layer_state = block.step(x, layer_state)
            x = _steered(x, layer, steer)
            new_state.append(layer_state)
        logits, parts = self.head(self.norm(x), steer=steer)
        return logits, parts, new_state

    @torch.no_grad()
    def attention_maps(self, idx: torch.Tensor) -> list[torch.Tensor]:
        """Per layer, the attention probabilities [B, heads, T, T] (attention models only)."""
        if self.config.mixer != "attention":
            raise ValueError("attention_maps: this model has no attention (mixer='prototype')")
        x, maps = self.tok_emb(idx), []
        for block in self.blocks:
            maps.append(block.attn.weights(block.attn_norm(x), self.rope_cos, self.rope_sin, self.attn_mask))
            x = block(x, self.rope_cos, self.rope_sin, self.attn_mask)
        return maps

    def num_params(self) -> dict:
        """Parameter counts: backbone (without the embedding), embedding, head (concept module or PRISM)."""
        embedding = self.tok_emb.weight.numel()
        head = self.concepts if self.concepts is not None else self.prism
        head_params = sum(p.numel() for p in head.parameters()) if head is not None else 0
        total = sum(p.numel() for p in self.parameters())
        return {"backbone": total - embedding - head_params, "embedding": embedding, "concept_module": head_params,
                "total": total}


def _steered(x: torch.Tensor, layer: int, steer: Steering | None) -> torch.Tensor:
    """The residual stream after ``layer``, with the steering vector added from the injection layer on."""
    if steer is None or layer < steer.layer:
        return x
    push = steer.gamma * steer.direction
    return x + (push if steer.positions is None else steer.positions[..., None].to(x.dtype) * push)


def decompose(model: CBLM, parts: Bottleneck, targets: torch.Tensor) -> dict[str, torch.Tensor]:
    """The exact split of each position's logit for token ``targets`` [B, T] (Eq. 8 and 17):

    known [B, T, n] = k_c K_c.W_y,  unknown [B, T, m] = u_j U_j.W_y,  residual [B, T] = eps.W_y,
    logit [B, T] = their sum, equal to the model's logit at inference (no dropout, no teacher forcing).
    """
    concepts = model.concepts
    w_y = model.tok_emb.weight[targets]  # [B, T, d]
    known = parts.k * (w_y @ concepts.known_emb.T)
    unknown = parts.u * (w_y @ concepts.unknown_embeddings().T)
    residual = (parts.eps * w_y).sum(-1)
    return {"known": known, "unknown": unknown, "residual": residual,
            "logit": known.sum(-1) + unknown.sum(-1) + residual}
