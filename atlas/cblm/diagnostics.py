"""Diagnostics of a trained model of this trainer (``atlas cblm eval MODEL --diagnostics``): how its attention or
prototype mixer behaves, and whether it can leave a repetition loop. All of them read held-out windows
(``TokenData.val_windows``, the training windows if there are none), each the first ``seq_len`` tokens of a window.

Attention models (``mixer="attention"``), per layer and head type (``head_groups``: for ``rope="pi"`` the first
n_head / 2 heads are "signal" heads and the others "noise" heads, seeds 003 Eq. 10; with standard RoPE all heads are
"all"), from ``CBLM.attention_maps``:

- entropy: H_i = -sum_j p_ij ln p_ij of each query row i (nats), averaged over the rows that see at least two
  positions (row 0 of a causal map sees only itself, and its entropy is 0 by construction). ``entropy_normalized``
  divides each row's H_i by ln(visible positions of row i) first, so 1 is uniform attention over what the row may
  see and 0 is one-hot, whatever the row's length. Seeds 003 reports the raw last-layer entropy: GPT-2 ~0.6,
  Prism signal ~0.2 / noise ~0.1 (at context 512-1024; raw entropy grows with the context).
- sink: the attention mass on position 0, the first token of the window, averaged over the query rows i >= SINK_FROM
  (the first rows see only a few positions, so their mass on position 0 is large without any sink).
  ``sink_uniform`` is what uniform attention would put there over the same rows (mean of 1 / visible positions).

ProtoT models (``mixer="prototype"``), per layer, on each block's mixer input (the normalized ``block.attn_norm(x)``,
``mixer_inputs``):

- routing: ``mixer.routing_metrics``: alpha (a collapsing alpha is a dead mixer), the Gini coefficient of the
  channels' write load (0: all channels used equally) and the mean top-1 write weight (1/R uniform, 1 one channel);
- disruption (seeds 002): on a copy of the model, prototype P_k of one layer is drawn again at its init scale,
  randn(d) / sqrt(d); over the held-out positions where the original model gives the true next token p >= 1%, the
  relative change (p' - p) / p: its mean, the mean of its absolute value, and the share of positions with
  |(p' - p) / p| > 10%. Per layer, the most and the least written prototype (by write load) are disrupted.

Both kinds, repetition escape (seeds 003): a sentence s is repeated N times as text, "s. s. ... s." (``[BOS]`` first);
the cycle is the tokens of " s." (the prompt ends where a cycle ends). From the prompt, ``generate`` samples
``new_tokens`` = 20 tokens at each temperature 0.1, 0.2, ..., 1.2 with ``seeds`` seeds (top-k off: the temperature
alone shapes the distribution). A sample *escapes* when its 20 tokens are not exactly the next 20 tokens of the
cycle, i.e. it differs from the continued repetition anywhere within the 20. T_c(N) is the smallest temperature
whose escape rate is >= 0.5 (None when none is): GPT-2 ~0.8-1.0, Prism ~0.1. Also reported: the mean number of
tokens a sample repeats before it first leaves the cycle (``repeated_prefix``): a model that never copies the loop
(small toy models often do not) "escapes" at every temperature, and only this count tells it from one that repeats
for a while. The seeds' sentence is
"A little alarm clock"; when the model's vocabulary lacks some of its tokens, the first complete sentence of
``SENTENCES`` is used instead (and what was used, or dropped, is reported).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F

from atlas.cblm.data import TokenData
from atlas.cblm.generate import Codec, generate
from atlas.cblm.mixer import routing_metrics
from atlas.cblm.model import CBLM

SINK_FROM = 4  # sink share: query rows before this see <= 4 positions, so their mass on position 0 means little
SENTENCES = ("A little alarm clock", "A little black cat")  # the seeds' sentence, then a fallback of the same shape
REPEATS = (2, 5, 10)
TEMPERATURES = tuple(round(0.1 * t, 1) for t in range(1, 13))
P_MIN = 0.01  # disruption: positions where the baseline p(target) is below this are left out (seeds 002)
CHANGED = 0.1  # disruption: a position "changed" when |relative change| exceeds this


def _quiet(message: str) -> None:
    pass


# --- attention -------------------------------------------------------------------------------------------------------

def head_groups(model: CBLM) -> dict[str, list[int]]:
    """Head type -> head indices: signal / noise halves for pi-RoPE (in the order of model.pi_rope_tables), else
    one group."""
    n = model.config.n_head
    if model.config.rope == "pi":
        return {"signal": list(range(n // 2)), "noise": list(range(n // 2, n))}
    return {"all": list(range(n))}


def allowed_positions(model: CBLM, T: int) -> torch.Tensor:
    """Boolean [T, T]: which keys each query may see, as ``Attention.weights`` masks them."""
    if model.attn_mask is None:
        return torch.ones(T, T, dtype=torch.bool).tril()
    return model.attn_mask[:T, :T].cpu()


def row_entropy(weights: torch.Tensor) -> torch.Tensor:
    """Entropy (nats) of each attention row: [..., T, T] -> [..., T]; 0 * ln 0 counts as 0."""
    return torch.special.entr(weights).sum(-1)


def attention_stats(maps: list[torch.Tensor], allowed: torch.Tensor, sink_from: int = SINK_FROM) -> list[dict]:
    """Per layer, per head: sums over a batch of maps [B, heads, T, T] (``combine_heads`` turns them into means):
    raw and normalized row entropy over rows with >= 2 visible positions, and mass on position 0 over rows >=
    ``sink_from``."""
    visible = allowed.sum(-1).to(maps[0].dtype)  # [T]
    entropy_rows = visible >= 2
    sink_rows = torch.arange(len(visible)) >= sink_from
    out = []
    for weights in maps:
        weights = weights.cpu()
        entropy = row_entropy(weights)[..., entropy_rows]  # [B, heads, rows]
        normalized = entropy / visible[entropy_rows].log()
        sink = weights[..., sink_rows, 0]
        out.append({"entropy": entropy.sum((0, 2)), "entropy_normalized": normalized.sum((0, 2)),
                    "entropy_rows": entropy.shape[0] * entropy.shape[2],
                    "sink": sink.sum((0, 2)), "sink_rows": sink.shape[0] * sink.shape[2]})
    return out


def _add_stats(total: list[dict] | None, batch: list[dict]) -> list[dict]:
    if total is None:
        return batch
    return [{k: a[k] + b[k] for k in a} for a, b in zip(total, batch)]


def combine_heads(stats: list[dict], groups: dict[str, list[int]]) -> list[dict]:
    """Sums from ``attention_stats`` -> per layer: per-head means and their mean over each head type."""
    layers = []
    for layer, s in enumerate(stats):
        per_head = {"entropy": s["entropy"] / max(s["entropy_rows"], 1),
                    "entropy_normalized": s["entropy_normalized"] / max(s["entropy_rows"], 1),
                    "sink": s["sink"] / max(s["sink_rows"], 1)}
        layers.append({
            "layer": layer,
            "groups": {name: {k: float(v[heads].mean()) for k, v in per_head.items()}
                       for name, heads in groups.items()},
            "heads": [{k: float(v[h]) for k, v in per_head.items()} for h in range(len(per_head["sink"]))],
        })
    return layers


@torch.no_grad()
def attention_diagnostics(model: CBLM, windows: torch.Tensor, batch_size: int = 16,
                          sink_from: int = SINK_FROM) -> dict:
    """Entropy and sink share per layer and head type on ``windows`` [N, T] (model ids)."""
    device = model.tok_emb.weight.device
    T = windows.shape[1]
    allowed = allowed_positions(model, T)
    total = None
    for start in range(0, len(windows), batch_size):
        maps = model.attention_maps(windows[start:start + batch_size].to(device))
        total = _add_stats(total, attention_stats(maps, allowed, sink_from))
    groups = head_groups(model)
    layers = combine_heads(total, groups)
    visible = allowed.sum(-1).float()
    return {"head_groups": groups, "layers": layers, "last_layer": layers[-1]["groups"], "sink_from": sink_from,
            "sink_uniform": float((1 / visible[sink_from:]).mean()) if T > sink_from else float("nan")}


# --- ProtoT ----------------------------------------------------------------------------------------------------------

@torch.no_grad()
def mixer_inputs(model: CBLM, idx: torch.Tensor) -> list[torch.Tensor]:
    """Each block's mixer input block.attn_norm(x) [B, T, d], running the blocks as ``CBLM.hidden`` does."""
    x, inputs = model.tok_emb(idx), []
    for block in model.blocks:
        inputs.append(block.attn_norm(x))
        x = block(x, model.rope_cos, model.rope_sin, model.attn_mask)
    return inputs


@torch.no_grad()
def routing_diagnostics(model: CBLM, windows: torch.Tensor) -> list[dict]:
    """Per layer: ``routing_metrics`` on the mixer inputs of ``windows``, and each channel's write load (the summed
    write weight: which prototypes the layer actually uses)."""
    inputs = mixer_inputs(model, windows.to(model.tok_emb.weight.device))
    out = []
    for layer, (block, x) in enumerate(zip(model.blocks, inputs)):
        write, _ = block.attn.gates(x)
        load = write.reshape(-1, write.shape[-1]).sum(0)
        out.append({"layer": layer, **routing_metrics(block.attn, x), "load": (load / load.sum()).tolist()})
    return out


@torch.no_grad()
def target_probabilities(model: CBLM, windows: torch.Tensor) -> torch.Tensor:
    """p(true next token) [N, T - 1] at every position of ``windows`` [N, T] (AR)."""
    windows = windows.to(model.tok_emb.weight.device)
    logits, _ = model(windows[:, :-1])
    return F.softmax(logits.float(), dim=-1).gather(-1, windows[:, 1:, None])[..., 0].cpu()


def disrupted(model: CBLM, layer: int, prototype: int, seed: int = 0) -> CBLM:
    """A copy of ``model`` with prototype ``prototype`` of layer ``layer`` drawn again at its init scale, randn(d) /
    sqrt(d) (``PrototypeMixer.__init__``); the model itself is left as it is."""
    clone = copy.deepcopy(model)
    prototypes = clone.blocks[layer].attn.prototypes
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        noise = torch.randn(prototypes.shape[1], generator=generator) / math.sqrt(prototypes.shape[1])
        prototypes[prototype] = noise.to(prototypes.device, prototypes.dtype)
    return clone.eval()


def relative_change(before: torch.Tensor, after: torch.Tensor, p_min: float = P_MIN,
                    changed: float = CHANGED) -> dict:
    """Relative change of p(target) over the positions with ``before`` >= ``p_min``."""
    keep = before >= p_min
    rel = (after[keep] - before[keep]) / before[keep]
    if rel.numel() == 0:
        return {"positions": 0, "mean_change": float("nan"), "mean_abs_change": float("nan"),
                "share_changed": float("nan")}
    return {"positions": int(rel.numel()), "mean_change": float(rel.mean()),
            "mean_abs_change": float(rel.abs().mean()), "share_changed": float((rel.abs() > changed).float().mean())}


def disruption_diagnostics(model: CBLM, windows: torch.Tensor, routing: list[dict], seed: int = 0,
                           log: Callable[[str], None] = _quiet) -> list[dict]:
    """Per layer, disrupt its most and its least written prototype (``routing`` gives the loads) and measure the
    relative change of p(target) on ``windows`` (each [seq_len + 1] tokens)."""
    before = target_probabilities(model, windows)
    out = []
    for r in routing:
        load = np.asarray(r["load"])
        for which, prototype in (("most used", int(load.argmax())), ("least used", int(load.argmin()))):
            log(f"  disrupting layer {r['layer']} prototype {prototype} ({which})")
            after = target_probabilities(disrupted(model, r["layer"], prototype, seed), windows)
            out.append({"layer": r["layer"], "prototype": prototype, "which": which, "load": float(load[prototype]),
                        **relative_change(before, after)})
    return out


# --- repetition escape -----------------------------------------------------------------------------------------------

def repetition_prompt(codec: Codec, sentence: str, repeats: int) -> tuple[list[int], list[int], int]:
    """([BOS] + the tokens of "s. s. ... s." (``repeats`` times), the cycle = the tokens of " s.", how many tokens
    the vocabulary lacks in one cycle). The prompt is built from the first sentence and ``repeats - 1`` cycles, so it
    ends exactly where a cycle ends."""
    first, dropped_first = codec.encode(sentence + ".")
    cycle, dropped = codec.encode(" " + sentence + ".")
    cycle = cycle[1:]  # without its [BOS]
    return first + cycle * (repeats - 1), cycle, max(dropped, dropped_first)


def pick_sentence(codec: Codec, sentences: tuple[str, ...] = SENTENCES) -> str:
    """The first sentence all of whose tokens are in the model's vocabulary, else the first one."""
    for sentence in sentences:
        if repetition_prompt(codec, sentence, 2)[2] == 0:
            return sentence
    return sentences[0]


def cycle_continuation(cycle: list[int], length: int, phase: int = 0) -> list[int]:
    """The ``length`` tokens that continue the repetition of ``cycle``, from position ``phase`` inside it."""
    return [cycle[(phase + t) % len(cycle)] for t in range(length)]


def escaped(continuation: list[int], cycle: list[int], phase: int = 0) -> bool:
    """Whether a continuation leaves the loop: it differs anywhere from the continued repetition of ``cycle``."""
    return list(continuation) != cycle_continuation(cycle, len(continuation), phase)


def repeated_prefix(continuation: list[int], cycle: list[int], phase: int = 0) -> int:
    """How many tokens a continuation follows the cycle before it first leaves it (all of them if it never does):
    where every sample escapes, this still tells a model that repeats for a while from one that never repeats."""
    expected = cycle_continuation(cycle, len(continuation), phase)
    return next((t for t, (a, b) in enumerate(zip(continuation, expected)) if a != b), len(continuation))


def critical_temperature(rates: dict[float, float], threshold: float = 0.5) -> float | None:
    """T_c: the smallest temperature whose escape rate is >= ``threshold``; None if none is."""
    return next((t for t in sorted(rates) if rates[t] >= threshold), None)


def repetition_escape(model: CBLM, codec: Codec, sentence: str | None = None, repeats: tuple[int, ...] = REPEATS,
                      temperatures: tuple[float, ...] = TEMPERATURES, seeds: int = 10, new_tokens: int = 20,
                      log: Callable[[str], None] = _quiet) -> dict:
    """Escape rate per (N, temperature) and T_c per N; ``sentence`` None picks one (``pick_sentence``)."""
    chosen = sentence or pick_sentence(codec)
    result = {"sentence": chosen, "seeds": seeds, "new_tokens": new_tokens, "temperatures": list(temperatures),
              "top_k": 0, "repeats": []}
    if chosen != SENTENCES[0] and sentence is None:
        result["note"] = f"the seeds' sentence {SENTENCES[0]!r} has tokens this vocabulary lacks"
    for n in repeats:
        prompt, cycle, dropped = repetition_prompt(codec, chosen, n)
        result["dropped"] = dropped
        if not cycle:
            result["error"] = f"no token of {chosen!r} is in the model's vocabulary"
            return result
        log(f"  repetition escape: N={n} ({len(prompt)} prompt tokens), {len(temperatures)} temperatures x "
            f"{seeds} seeds")
        rates, prefixes = {}, []
        for temperature in temperatures:
            continuations = [generate(model, prompt, new_tokens, temperature, top_k=0, seed=seed)[len(prompt):]
                             for seed in range(seeds)]
            rates[temperature] = sum(escaped(c, cycle) for c in continuations) / seeds
            prefixes.append(sum(repeated_prefix(c, cycle) for c in continuations) / seeds)
        result["repeats"].append({"n": n, "prompt_tokens": len(prompt), "escape_rate": list(rates.values()),
                                  "repeated_tokens": prefixes, "t_c": critical_temperature(rates)})
    result["cycle"], result["cycle_tokens"] = codec.decode(cycle), len(cycle)
    return result


# --- everything ------------------------------------------------------------------------------------------------------

def held_out(data: TokenData, count: int) -> torch.Tensor:
    """The first ``count`` held-out windows [count, seq_len + 1] (model ids)."""
    ids = data.val_windows if len(data.val_windows) else data.train_windows
    return data.windows[torch.as_tensor(ids[:count])]


def diagnose(model: CBLM, data: TokenData, codec: Codec, windows: int = 64, sentence: str | None = None,
             seeds: int = 10, repeats: tuple[int, ...] = REPEATS, log: Callable[[str], None] = _quiet) -> dict:
    """All the diagnostics that apply to ``model`` (see the module docstring), as one JSON-ready dict."""
    model.eval()
    tokens = held_out(data, windows)
    inputs = tokens[:, :-1]
    result = {"mixer": model.config.mixer, "rope": model.config.rope, "windows": len(tokens),
              "seq_len": inputs.shape[1]}
    if model.config.mixer == "attention":
        log(f"attention entropy and sink on {len(tokens)} held-out windows of {inputs.shape[1]} tokens")
        result["attention"] = attention_diagnostics(model, inputs)
    else:
        log(f"routing metrics on {len(tokens)} held-out windows of {inputs.shape[1]} tokens")
        with torch.no_grad():
            result["routing"] = routing_diagnostics(model, inputs)
            log("prototype disruption")
            result["disruption"] = disruption_diagnostics(model, tokens, result["routing"], log=log)
    log("repetition escape (generation; the slow part)")
    result["repetition"] = repetition_escape(model, codec, sentence, repeats, seeds=seeds, log=log)
    return result


def format_diagnostics(result: dict) -> str:
    """The compact table ``atlas cblm eval --diagnostics`` prints."""
    lines = [f"diagnostics on {result['windows']} held-out windows of {result['seq_len']} tokens "
             f"(mixer={result['mixer']}, rope={result['rope']})"]
    if "attention" in result:
        att = result["attention"]
        lines += [f"attention: entropy in nats over query rows seeing >= 2 positions (norm = H / ln(visible): "
                  f"1 uniform, 0 one-hot); sink = mass on position 0 over query rows >= {att['sink_from']} "
                  f"(uniform attention would give {att['sink_uniform']:.3f})",
                  f"  {'layer':>5}  {'heads':<7} {'entropy':>8} {'norm':>6} {'sink':>6}"]
        for layer in att["layers"]:
            for name, g in layer["groups"].items():
                lines.append(f"  {layer['layer']:>5}  {name:<7} {g['entropy']:>8.3f} {g['entropy_normalized']:>6.3f} "
                             f"{g['sink']:>6.3f}")
        last = ", ".join(f"{name} {g['entropy']:.3f} (norm {g['entropy_normalized']:.3f})"
                         for name, g in att["last_layer"].items())
        lines.append(f"  last layer entropy: {last}   [seeds 003, context 512+: GPT-2 ~0.6; Prism signal ~0.2, "
                     f"noise ~0.1]")
    if "routing" in result:
        lines += ["ProtoT routing per layer (seeds 002 Table 10, all mitigations: alpha_0 0.67, Gini 0.034, "
                  "top-1 0.079)", f"  {'layer':>5} {'alpha':>7} {'gini':>7} {'top1':>7}"]
        for r in result["routing"]:
            lines.append(f"  {r['layer']:>5} {r['alpha']:>7.3f} {r['gini']:>7.3f} {r['top1_mass']:>7.3f}")
        lines += [f"prototype disruption: relative change of p(target) where p >= {P_MIN:.0%}; changed = |change| > "
                  f"{CHANGED:.0%}", f"  {'layer':>5} {'proto':>5} {'(load)':<19} {'mean':>8} {'mean|.|':>8} "
                                    f"{'changed':>8} {'positions':>9}"]
        for d in result["disruption"]:
            which = f"{d['which']} {d['load']:.3f}"
            lines.append(f"  {d['layer']:>5} {d['prototype']:>5} {which:<19} "
                         f"{d['mean_change']:>+8.3f} {d['mean_abs_change']:>8.3f} {d['share_changed']:>8.3f} "
                         f"{d['positions']:>9}")
    rep = result["repetition"]
    if "error" in rep:
        lines.append(f"repetition escape: {rep['error']}")
        return "\n".join(lines)
    dropped = f"; {rep['dropped']} token(s) of it not in the vocabulary, left out" if rep["dropped"] else ""
    if "note" in rep:
        dropped += f" ({rep['note']})"
    lines += [f"repetition escape: prompt \"{rep['sentence']}.\" x N, cycle {rep['cycle']!r}{dropped}; "
              f"{rep['new_tokens']} new tokens, {rep['seeds']} seeds, top-k off; escape = differs from the cycle "
              f"anywhere; T_c = lowest T with escape rate >= 0.5 (seeds 003: GPT-2 0.8-1.0, Prism 0.1)",
              f"  {'N':>3}  " + " ".join(f"{t:>4.1f}" for t in rep["temperatures"]) + "   T_c"]
    for r in rep["repeats"]:
        t_c = "none" if r["t_c"] is None else f"{r['t_c']:.1f}"
        lines.append(f"  {r['n']:>3}  " + " ".join(f"{x:>4.2f}" for x in r["escape_rate"]) + f"   {t_c}")
    lines.append("  mean tokens repeated before leaving the cycle (of " + str(rep["new_tokens"]) + "):")
    for r in rep["repeats"]:
        lines.append(f"  {r['n']:>3}  " + " ".join(f"{x:>4.1f}" for x in r["repeated_tokens"]))
    if all(r["repeated_tokens"][0] < rep["cycle_tokens"] for r in rep["repeats"]):
        lines.append(f"  (even at T={rep['temperatures'][0]:g} the samples do not repeat one whole cycle: this model "
                     "does not copy the loop, so its T_c says it never enters the loop, not that it escapes one)")
    return "\n".join(lines)
