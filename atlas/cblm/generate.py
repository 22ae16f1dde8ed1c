"""Text generation from a concept-bottleneck LM, with concept steering (paper 6.2).

- AR models sample the next token repeatedly (temperature, top-k), recomputing the whole context each step (toy
  models: no KV cache). A ProtoT model (``mixer="prototype"``) runs its recurrent form instead: a fixed-size state
  per layer, O(1) per token, and a context that is not cut at seq_len (its channels are discounted prefix means).
- Diffusion models generate block by block, as causal diffusion decodes: the positions up to the next block boundary
  start as [MASK]; each denoising step predicts every masked position and keeps the most confident ones, until the
  block is full; then the next block. Earlier blocks are context (recomputed, not cached).

Steering (Eq. 18-21): the direction of concepts C is e = normalize(sum_c K'_c / |K'_c|), with K'_c = K_c minus the
mean concept embedding (a toy model's K_c share a large common component); it is added as gamma * e to the
hidden state after every layer >= L_inj (at the masked positions for diffusion, everywhere for AR), with
gamma = tau / peak(e) and peak(e) = max_y e.W_y, so one strength tau means the same for every concept. A negative
tau suppresses: the injection is negative and the logits get the ReLU-gated mask l_v -= (|tau| / peak) ReLU(W_v.e),
which lowers the tokens aligned with the concept without raising the anti-aligned ones.

Logit edits (AR models): ``generate(..., logit_edit=f)`` calls f(logits [1, V], parts) at every generated token, with
the head's parts at that position (e.g. PRISM's prototype activations), and samples from what it returns. The PRISM
prototype interventions (``prototypes.py``) are such edits.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F

from atlas.cblm.model import CBLM, Steering, injection_layer, steering_directions
from atlas.models.tokenizer import BOS, cl100k


def steering_for(model: CBLM, concepts: list[int], strength: float, layer: int | None = None) -> Steering:
    """The steering of ``concepts`` (known-concept indices) at strength tau = ``strength``, injected from ``layer``
    (default: the model's trained injection layer). For one concept this is exactly what steering training injects
    (``steering_directions`` in model.py); several concepts steer along the normalized sum of their directions."""
    if model.concepts is None:
        raise ValueError("this model has no concept module (a baseline): it cannot be steered by concept")
    with torch.no_grad():
        _, e, _ = steering_directions(model)
        direction = F.normalize(e[concepts].sum(0), dim=0)  # e_c, in the space of h
        peak = float((model.tok_emb.weight @ direction).max())
        injected = F.normalize(model.norm.weight * direction, dim=0)
    layer = injection_layer(model.config) if layer is None else layer
    return Steering(direction=injected, gamma=strength / peak, layer=layer,
                    suppress=abs(strength) / peak if strength < 0 else 0.0, logit_direction=direction)


class Codec:
    """Text <-> model ids: cl100k_base, then the model's (compact) vocabulary."""

    def __init__(self, vocab: list[int] | np.ndarray):
        self.vocab = np.asarray(vocab, dtype=np.int64)
        self.encoding = cl100k()

    def encode(self, text: str) -> tuple[list[int], int]:
        """[BOS] + the text's tokens, as model ids, and how many tokens were dropped (not in the vocabulary)."""
        ids = np.asarray([BOS] + self.encoding.encode_ordinary(text), dtype=np.int64)
        positions = np.minimum(np.searchsorted(self.vocab, ids), len(self.vocab) - 1)
        known = self.vocab[positions] == ids
        return positions[known].tolist(), int((~known).sum())

    def decode(self, model_ids) -> str:
        return self.encoding.decode([int(self.vocab[i]) for i in model_ids])


def _sample(logits: torch.Tensor, temperature: float, top_k: int, generator: torch.Generator) -> torch.Tensor:
    """One token per row of ``logits`` [N, V], and its probability."""
    if temperature <= 0:
        probs = F.softmax(logits, dim=-1)
        token = logits.argmax(-1)
        return token, probs.gather(-1, token[:, None])[:, 0]
    logits = logits / temperature
    if top_k:
        cutoff = logits.topk(min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < cutoff, -float("inf"))
    probs = F.softmax(logits, dim=-1)
    token = torch.multinomial(probs, 1, generator=generator)[:, 0]
    return token, probs.gather(-1, token[:, None])[:, 0]


def _last(parts):
    """The head's parts (a dataclass of [B, T, ...] tensors, or None) at the last position: [B, ...]."""
    if parts is None:
        return None
    return dataclasses.replace(parts, **{f.name: getattr(parts, f.name)[:, -1] for f in dataclasses.fields(parts)
                                         if isinstance(getattr(parts, f.name), torch.Tensor)})


@torch.no_grad()
def generate(model: CBLM, prompt: list[int], max_new_tokens: int = 48, temperature: float = 1.0, top_k: int = 50,
             steer: Steering | None = None, seed: int = 0, steps_per_block: int | None = None,
             logit_edit: Callable | None = None) -> list[int]:
    """``prompt`` (model ids) followed by ``max_new_tokens`` generated ones. ``logit_edit(logits [1, V], parts)``
    (AR models): the logits each token is sampled from, given those of the model and the head's parts there."""
    if logit_edit is not None and model.config.objective == "diffusion":
        raise ValueError("logit_edit: AR models only (a diffusion model predicts many positions per step)")
    model.eval()
    device = model.tok_emb.weight.device
    generator = torch.Generator(device=device).manual_seed(seed)
    tokens = torch.tensor([prompt], dtype=torch.int64, device=device)
    if model.config.objective != "diffusion":
        recurrent = model.config.mixer == "prototype"  # ProtoT's recurrent form: O(1) per token, no window limit
        if recurrent:
            state = model.initial_state(1)
            for t in range(tokens.shape[1] - 1):
                _, _, state = model.step(tokens[:, t], state, steer=steer)
        for _ in range(max_new_tokens):
            if recurrent:
                logits, parts, state = model.step(tokens[:, -1], state, steer=steer)
            else:
                logits, parts = model(tokens[:, -model.config.seq_len:], steer=steer)
                logits, parts = logits[:, -1], _last(parts)
            if logit_edit is not None:
                logits = logit_edit(logits, parts)
            logits[..., model.config.mask_id] = -float("inf")  # [MASK] is never text
            token, _ = _sample(logits, temperature, top_k, generator)
            tokens = torch.cat([tokens, token[None]], dim=1)
        return tokens[0].tolist()

    config = model.config
    target = len(prompt) + max_new_tokens
    while len(prompt) < target:
        # mask up to the next block boundary, so the new positions share a block (and bidirectional attention)
        size = min(config.block_size - tokens.shape[1] % config.block_size, target - len(prompt))
        tokens = torch.cat([tokens, torch.full((1, size), config.mask_id, device=device)], dim=1)
        excess = tokens.shape[1] - config.seq_len
        if excess > 0:  # drop whole blocks from the left, keeping positions aligned with the block mask
            tokens = tokens[:, -(-excess // config.block_size) * config.block_size:]
        steps = steps_per_block or max(1, size // 2)
        for step in range(steps):
            masked = tokens[0] == config.mask_id
            remaining = int(masked.sum())
            if remaining == 0:
                break
            block_steer = None
            if steer is not None:
                block_steer = dataclasses.replace(steer, positions=masked[None])
            logits, _ = model(tokens, steer=block_steer)
            logits[..., config.mask_id] = -float("inf")
            candidates, confidence = _sample(logits[0, masked], temperature, top_k, generator)
            keep = confidence.topk(-(-remaining // (steps - step))).indices  # the most confident share of the rest
            positions = masked.nonzero()[:, 0]
            tokens[0, positions[keep]] = candidates[keep]
        prompt = prompt + tokens[0, -size:].tolist()  # the full history, beyond the model's window
    return prompt[:target]


def lifted_frequency(generated: list[list[int]], prompt_lengths: list[int], lifted: np.ndarray) -> float:
    """Share of the generated tokens (after each prompt) that are among the concept's lifted tokens."""
    new = [tokens[n:] for tokens, n in zip(generated, prompt_lengths)]
    total = sum(len(t) for t in new)
    return sum(int(np.isin(t, lifted).sum()) for t in new) / max(total, 1)


def steering_effect(model: CBLM, codec: Codec, concept: int, strength: float, prompts: list[str],
                    lifted: np.ndarray, max_new_tokens: int = 48, samples: int = 4, temperature: float = 1.0,
                    layer: int | None = None) -> dict:
    """Generate from each prompt with and without steering ``concept`` (same seeds) and compare how often the
    concept's lifted tokens appear. Returns the frequencies and the first prompt's texts."""
    steer = steering_for(model, [concept], strength, layer)
    runs: dict[str, list[list[int]]] = {"before": [], "after": []}
    lengths = []
    for p, prompt in enumerate(prompts):
        ids, _ = codec.encode(prompt)
        for s in range(samples):
            lengths.append(len(ids))
            for key, steering in (("before", None), ("after", steer)):
                runs[key].append(generate(model, ids, max_new_tokens, temperature, steer=steering,
                                          seed=1000 * p + s))
    return {
        "concept": concept, "strength": strength, "gamma": steer.gamma, "layer": steer.layer,
        "lifted_frequency_before": lifted_frequency(runs["before"], lengths, lifted),
        "lifted_frequency_after": lifted_frequency(runs["after"], lengths, lifted),
        "text_before": codec.decode(runs["before"][0]), "text_after": codec.decode(runs["after"][0]),
        "lifted_tokens": [codec.decode([int(t)]) for t in lifted],
    }
