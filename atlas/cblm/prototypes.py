"""Tools around a trained PRISM model (``prism.py``; seeds 000, ``seeds/NOTES.md`` 2.1): each prototype's nearest
training tokens, training-data attribution in one forward pass, a measurement of that attribution, prototype cards,
and prototype interventions while generating.

Notation of prism.py: z_t is the final hidden state at input position t (it predicts token t + 1), p_1..p_K the
prototypes, c_{t,i} = cos(z_t, p_i), a~_{t,i} = ReLU(tau c_{t,i}), a_{t,i} the top-k routed activation and W the
(tied) token embedding, so that l_t = W r_t + sum_i a_{t,i} W p_i exactly.

Nearest neighbours (``mine``). One streaming pass over the training windows keeps, per prototype, the L = ``top``
positions j with the largest c_{j,i}: running buffers [K, L] merged with each batch's per-prototype top L by
``torch.topk``, O(N K) time and O(K L) memory. The ranking is by the cosine, not by the routed a (a prototype seldom
in any top-k still has nearest tokens) nor by ReLU(tau c): the same order wherever it is positive, but an order also
where every cosine is negative (the ReLU would tie them all at 0). Positions are distinct by construction: input
position t < seq_len of window w is stream position w * seq_len + t; windows overlap by one token, but that token is
the target (t = seq_len) of window w and the input t = 0 of window w + 1, and only inputs are scored; a window given
twice is scanned once.

Training-data attribution (``attribute``), the source's A_t = sum_{i in K_t} a_{t,i} mu_{S_i} with mu_{S_i} uniform
over prototype i's mined neighbours S_i, summed per training chunk and normalized:

    A_t(chunk) = sum_i a_{t,i} |S_i in chunk| / |S_i|   /   sum_i a_{t,i} [S_i not empty]

It explains the prototype part sum_i a_{t,i} W p_i of the logits; the residual W r_t has no training tokens.

Measurement (``measure_attribution``). For held-out positions, the top-10 chunks of three attributions: PRISM's, random
training chunks, and the transducer into the run's IVFPQ index (``attribution.py``; its query is the mean state of the
position's chunk up to the position, so it does not see the token to predict). Per method, the share of attributed
chunks that share a concept with the position's chunk, that contain the true next token, and that contain it or have
it among their concepts' lifted tokens T_c (``data.lifted_tokens``).

Cards (``cards``): per prototype the top tokens of its tau-folded logit signature tau W p_i, the contexts of its
nearest neighbours, a short name (offline: the words lifted in its contexts; with an LLM engine in the run's config,
``llm_names`` asks the label stage's prompt for a name and a description), a coarse rule-based category of its tokens,
the most frequent Atlas concept of its neighbours' chunks, and its usage: the share of held-out positions where it is
routed (a_{t,i} > 0).

Interventions (logit edits for ``generate.generate(..., logit_edit=...)``). Single prototype (``prototype_edit``): at
every token, clamp a_i to the value whose contribution a_i (W p_i)_y peaks, over y, at f |top-1 logit|: the source asks
that "its contribution to the sampled token's logit" equal that fraction, but the sampled token is known only after the
edit, so we use the token where the contribution is largest. With r fixed this moves the logits by (a_i* - a_i) W p_i;
f = 0 removes the prototype, f < 0 subtracts its signature (which also raises the tokens anti-aligned with it).
Category (``category_edit``): of the 16 most active prototypes, sum the signatures S = sum W p_i of those whose card
has the category, and add f |top-1 logit| S / max_y S_y.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from scipy import sparse

from atlas.cblm.attribution import checkpoint_digest, chunk_documents, nearest_training_chunks
from atlas.cblm.data import TokenData, lifted_tokens
from atlas.cblm.generate import Codec
from atlas.cblm.model import CBLM
from atlas.cblm.prism import decompose

FOLDER, NEIGHBOURS, CARDS = "prototypes", "neighbours.parquet", "cards.json"
CATEGORIES = ("numbers & time", "punctuation & formatting", "function words", "word pieces", "names & capitalized",
              "content words")
FUNCTION_WORDS = set("""a an the and or but nor so yet if then than that this these those there here of in on at to
for from by with without about into onto over under between through during before after above below up down out off
as is are was were be been being am do does did have has had having will would shall should can could may might must
not no i me my we us our you your he him his she her it its they them their who whom whose which what when where why
how all any each every some such both either neither other another one also only just very too""".split())
SPECIAL = re.compile(r"\[[A-Z]+\]")  # [BOS], [EOC], ...: formatting
TIME_WORDS = set("""january february march april may june july august september october november december monday
tuesday wednesday thursday friday saturday sunday today yesterday tomorrow year years month months week weeks day days
hour hours minute minutes second seconds time times date dates century decade am pm""".split())


def _check_prism(model: CBLM) -> None:
    if model.prism is None:
        raise ValueError("this model has no PRISM head (train one with --set head=prism): it has no prototypes")


# --- nearest neighbours ---------------------------------------------------------------------------------------------


@dataclass
class Neighbours:
    """Per prototype its L nearest training positions, best first, as [K, L] arrays (window -1 where fewer than L
    positions were scanned)."""

    score: np.ndarray  # float32: the cosine c_{j,i}
    window: np.ndarray  # int64: row of data.windows
    position: np.ndarray  # int64: input position t in the window (its state predicts token t + 1)
    chunk_row: np.ndarray  # int64: data.chunk_rows[window, position]
    chunk_id: np.ndarray  # object: data.chunk_ids[chunk_row]
    meta: dict = field(default_factory=dict)  # what they were mined from (checkpoint digest, step, windows, ...)

    @property
    def valid(self) -> np.ndarray:
        return self.window >= 0

    def chunk_names(self) -> dict[int, str]:
        """chunk row -> chunk id, for the chunks the neighbours fall in."""
        return dict(zip(self.chunk_row[self.valid].tolist(), self.chunk_id[self.valid].tolist()))

    def save(self, path: str | Path) -> None:
        """One row per neighbour (prototype, rank, ...); the shape and ``meta`` go in the schema metadata."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        prototype, rank = np.nonzero(self.valid)
        table = pa.table({"prototype": prototype.astype(np.int32), "rank": rank.astype(np.int32),
                          "score": self.score[prototype, rank], "window": self.window[prototype, rank],
                          "position": self.position[prototype, rank], "chunk_row": self.chunk_row[prototype, rank],
                          "chunk_id": pa.array(self.chunk_id[prototype, rank].tolist(), pa.string())})
        meta = self.meta | {"shape": list(self.score.shape)}
        table = table.replace_schema_metadata({"atlas": json.dumps(meta)})
        tmp = path.with_suffix(".tmp")
        pq.write_table(table, tmp)
        tmp.rename(path)  # a killed save leaves no half file that a resume would trust

    @classmethod
    def load(cls, path: str | Path) -> Neighbours:
        table = pq.read_table(path)
        meta = json.loads(table.schema.metadata[b"atlas"])
        shape = tuple(meta.pop("shape"))
        columns = table.to_pydict()
        p, r = np.asarray(columns["prototype"]), np.asarray(columns["rank"])

        def grid(name: str, fill, dtype) -> np.ndarray:
            out = np.full(shape, fill, dtype=dtype)
            out[p, r] = columns[name]
            return out

        return cls(grid("score", -np.inf, np.float32), grid("window", -1, np.int64), grid("position", -1, np.int64),
                   grid("chunk_row", -1, np.int64), grid("chunk_id", "", object), meta)


@torch.no_grad()
def mine(model: CBLM, data: TokenData, top: int = 16, windows=None, batch_size: int = 16,
         progress: Callable[[int, int], None] | None = None, every: int = 20) -> Neighbours:
    """Each prototype's ``top`` nearest (largest cosine) input positions among ``windows`` (default: all training
    windows), in one pass. ``progress(done, total)`` (windows) is called every ``every`` batches and at the end."""
    _check_prism(model)
    T, K = data.seq_len, model.config.prototypes
    windows = np.unique(np.asarray(data.train_windows if windows is None else windows, dtype=np.int64))
    device = model.tok_emb.weight.device
    best = torch.full((K, top), -float("inf"))
    where = torch.full((K, top), -1, dtype=torch.int64)  # stream position w * T + t of each kept score
    batches = range(0, len(windows), batch_size)
    for b, start in enumerate(batches):
        ids = torch.from_numpy(windows[start:start + batch_size])
        cos, _ = model.prism.activations(model.hidden(data.windows[ids, :T].to(device)))
        cos = cos.reshape(-1, K).T.float().cpu()  # [K, B T]
        stream = (ids[:, None] * T + torch.arange(T)).reshape(-1)
        # the batch's top L per prototype, then the top L of those and the buffer: the buffer never sees a position
        # twice, since every position is in exactly one batch
        batch_top = cos.topk(min(top, cos.shape[1]), dim=1)
        scores = torch.cat([best, batch_top.values], 1)
        positions = torch.cat([where, stream[batch_top.indices]], 1)
        keep = scores.topk(top, dim=1).indices
        best, where = scores.gather(1, keep), positions.gather(1, keep)
        if progress is not None and ((b + 1) % every == 0 or b + 1 == len(batches)):
            progress(min(start + batch_size, len(windows)), len(windows))
    valid = where >= 0
    window = torch.where(valid, where // T, -1).numpy()
    position = torch.where(valid, where % T, -1).numpy()
    chunk_row = np.where(valid.numpy(), data.chunk_rows[np.maximum(window, 0), np.maximum(position, 0)].numpy(), -1)
    chunk_id = np.asarray([[data.chunk_ids[r] if r >= 0 else "" for r in row] for row in chunk_row], dtype=object)
    return Neighbours(best.numpy(), window, position, chunk_row, chunk_id,
                      {"seq_len": T, "top": top, "windows": len(windows)})


# --- attribution ----------------------------------------------------------------------------------------------------


def _chunk_weights(neighbours: Neighbours) -> tuple[np.ndarray, sparse.csr_matrix]:
    """(rows [C], M [K, C]): the chunk rows the neighbours fall in, and M_{i,c} = mu_{S_i}(chunk c) = |S_i in c| /
    |S_i|, so that a [K] @ M is the unnormalized A over chunks."""
    valid = neighbours.valid
    prototype = np.nonzero(valid)[0]
    rows, column = np.unique(neighbours.chunk_row[valid], return_inverse=True)
    size = valid.sum(1)
    weights = sparse.csr_matrix((1.0 / size[prototype], (prototype, column)),  # repeated (i, c) pairs add up
                                shape=(len(valid), len(rows)))
    return rows, weights


def attribution_weights(alpha, neighbours: Neighbours, top: int | None = 10) -> list[list[tuple[int, float]]]:
    """Per row of ``alpha`` [P, K] (routed activations), the training chunks A_t puts weight on, [(chunk row,
    weight)] ranked, the ``top`` first (None: all, and then the weights sum to 1); [] where no prototype with
    neighbours is active."""
    alpha = np.asarray(torch.as_tensor(alpha).float().cpu(), dtype=np.float64).reshape(-1, neighbours.window.shape[0])
    rows, weights = _chunk_weights(neighbours)
    mass = np.asarray((weights.T @ alpha.T).T)  # [P, C]
    ranked = []
    for a in mass:
        total = a.sum()
        order = np.argsort(-a, kind="stable")[:top] if total > 0 else []
        ranked.append([(int(rows[j]), float(a[j] / total)) for j in order if a[j] > 0])
    return ranked


@torch.no_grad()
def attribute(model: CBLM, neighbours: Neighbours, idx, positions=None, top: int | None = 10,
              ) -> list[list[tuple[str, float]]]:
    """Training-data attribution of the predictions at ``positions`` (default all) of ``idx`` (one sequence of model
    ids, [T] or [1, T]) in one forward pass: per position [(chunk_id, weight)], ranked."""
    _check_prism(model)
    idx = torch.as_tensor(idx).reshape(1, -1).to(model.tok_emb.weight.device)
    _, parts = model(idx)
    alpha = parts.alpha[0]
    positions = list(range(idx.shape[1])) if positions is None else list(positions)
    names = neighbours.chunk_names()
    ranked = attribution_weights(alpha[positions], neighbours, top)
    return [[(names[row], w) for row, w in hits] for hits in ranked]


# --- measurement ----------------------------------------------------------------------------------------------------


def _chunk_tokens(data: TokenData) -> sparse.csr_matrix:
    """[chunks, vocab], 1 where the chunk holds the token (each window's tokens with their chunks)."""
    rows, tokens = data.chunk_rows.reshape(-1).numpy(), data.windows.reshape(-1).numpy()
    matrix = sparse.csr_matrix((np.ones(len(rows), dtype=np.float32), (rows, tokens)),
                               shape=(len(data.chunk_ids), data.vocab_size))
    matrix.data[:] = 1.0
    return matrix


@torch.no_grad()
def measure_attribution(model: CBLM, data: TokenData, neighbours: Neighbours, positions: int = 200, k: int = 10,
                        seed: int = 0, run_dir: str | Path | None = None, transducer=None, lifted_top: int = 20,
                        batch_size: int = 16) -> dict:
    """How often the top ``k`` chunks of each attribution of ``positions`` random held-out positions are related to
    the prediction, per criterion {method: share of attributed chunks}: "concepts" (shares an annotated concept with
    the position's chunk), "next_token" (holds the true next token), "next_token_or_lifted" (holds it, or it is among
    the lifted tokens of the chunk's concepts). Methods: "prism", "random" (training chunks drawn uniformly) and,
    given the ``transducer`` and the ``run_dir`` of its index, "ivfpq"."""
    _check_prism(model)
    T, device = data.seq_len, model.tok_emb.weight.device
    rng = np.random.default_rng(seed)
    stream = np.unique(rng.choice(data.val_windows, positions) * T + rng.integers(0, T, positions))
    window, position = stream // T, stream % T
    alpha = torch.zeros(len(stream), model.config.prototypes)
    pooled = torch.zeros(len(stream), model.config.d_model)
    unique = np.unique(window)
    for start in range(0, len(unique), batch_size):
        ids = unique[start:start + batch_size]
        h = model.hidden(data.windows[ids, :T].to(device))
        routed = model.prism(h).alpha
        for b, w in enumerate(ids):
            for p in np.nonzero(window == w)[0]:
                t = position[p]
                alpha[p] = routed[b, t].cpu()
                # the transducer reads a chunk's mean state: here its positions up to t, so not the token to predict
                same = (data.chunk_rows[w, :t + 1] == data.chunk_rows[w, t]).to(device)
                pooled[p] = h[b, :t + 1][same].mean(0).cpu()

    train_chunks = np.unique(data.chunk_rows[data.train_windows, :T].numpy())
    attributed = {"prism": [[row for row, _ in ranked] for ranked in attribution_weights(alpha, neighbours, k)],
                  "random": [rng.choice(train_chunks, min(k, len(train_chunks)), replace=False).tolist()
                             for _ in stream]}
    if transducer is not None and run_dir is not None:
        row_of = {cid: r for r, cid in enumerate(data.chunk_ids)}
        found = nearest_training_chunks(run_dir, transducer, pooled.numpy(), k)
        attributed["ivfpq"] = [[row_of[cid] for cid, _ in hits if cid in row_of] for hits in found]

    concepts = data.chunk_concepts()
    tokens = _chunk_tokens(data)
    lifted = lifted_tokens(data, top=lifted_top)
    lifted_matrix = sparse.csr_matrix(
        (np.ones(sum(len(t) for t in lifted), dtype=np.float32),
         (np.repeat(np.arange(len(lifted)), [len(t) for t in lifted]),
          np.concatenate(lifted or [np.zeros(0, dtype=np.int64)]))),
        shape=(data.n_concepts, data.vocab_size))
    chunk_lifted = (concepts @ lifted_matrix).tocsr()  # [chunks, vocab]: > 0 where a concept of the chunk lifts it
    own = data.chunk_rows[window, position].numpy()
    target = data.windows[window, position + 1].numpy()

    result: dict = {"positions": len(stream), "k": k}
    for criterion in ("concepts", "next_token", "next_token_or_lifted"):
        result[criterion] = {}
    for method, rows_per_position in attributed.items():
        hits = {"concepts": 0, "next_token": 0, "next_token_or_lifted": 0}
        total = 0
        for rows, chunk, y in zip(rows_per_position, own, target):
            if not rows:
                continue
            rows = np.asarray(rows)
            shared = np.asarray((concepts[rows] @ concepts[chunk].T).todense()).ravel() > 0
            holds = np.asarray(tokens[rows, y].todense()).ravel() > 0
            lifts = np.asarray(chunk_lifted[rows, y].todense()).ravel() > 0
            hits["concepts"] += int(shared.sum())
            hits["next_token"] += int(holds.sum())
            hits["next_token_or_lifted"] += int((holds | lifts).sum())
            total += len(rows)
        for criterion, count in hits.items():
            result[criterion][method] = count / total if total else float("nan")
    return result


def format_measurement(result: dict) -> str:
    methods = list(result["concepts"])
    lines = [f"top-{result['k']} attributed training chunks of {result['positions']} held-out positions: share "
             f"that ...", f"  {'':<36}" + "".join(f"{m:>9}" for m in methods)]
    labels = {"concepts": "share a concept with the position", "next_token": "hold the true next token",
              "next_token_or_lifted": "hold it or lift it (T_c)"}
    for criterion, label in labels.items():
        lines.append(f"  {label:<36}" + "".join(f"{result[criterion][m]:>9.3f}" for m in methods))
    return "\n".join(lines)


# --- cards ----------------------------------------------------------------------------------------------------------


def token_category(text: str) -> str:
    """The coarse category of one decoded token (rule-based)."""
    word = text.strip()
    if not word or not any(ch.isalnum() for ch in word) or SPECIAL.fullmatch(word):
        return "punctuation & formatting"
    if any(ch.isdigit() for ch in word) or word.lower() in TIME_WORDS:
        return "numbers & time"
    if word.lower() in FUNCTION_WORDS:
        return "function words"
    if not text[0].isspace() and word.isalpha() and word.islower():
        return "word pieces"  # glued to the token before it
    if word[0].isupper():
        return "names & capitalized"
    return "content words"


def _shown(text: str) -> str:
    """A token as a word of a name: stripped; "newline" or "spaces" when it is only whitespace."""
    return text.strip() or ("newline" if "\n" in text else "spaces")


def _name(contexts: list[np.ndarray], firing: list[int], p_token: np.ndarray, codec: Codec) -> str:
    """1-3 words for a prototype: the tokens most lifted in its neighbours' contexts (the firing token and the 3
    before it) that occur in at least a quarter of them, ranked by count x log lift; when none is, its two most
    common firing tokens. (Its top logit tokens are in the card; on a toy model they are the same few frequent
    tokens for most prototypes, so they do not tell prototypes apart.)"""
    counts = Counter(token for context in contexts for token in set(context.tolist()))
    size = sum(len(c) for c in contexts)
    scored = []
    for token, count in counts.items():
        lift = count / size / p_token[token]
        if count >= max(2, len(contexts) / 4) and lift > 1:
            scored.append((count * np.log(lift), token))
    best = [token for _, token in sorted(scored, reverse=True)[:3]] or \
        [token for token, _ in Counter(firing).most_common(2)]
    return " / ".join(dict.fromkeys(_shown(codec.decode([t])) for t in best)) or "?"


@torch.no_grad()
def usage(model: CBLM, data: TokenData, windows=None, batch_size: int = 16) -> np.ndarray:
    """[K] share of the input positions of ``windows`` (default: the held-out ones) where each prototype is routed."""
    _check_prism(model)
    windows = data.val_windows if windows is None else np.asarray(windows)
    counts, total = torch.zeros(model.config.prototypes), 0
    for start in range(0, len(windows), batch_size):
        ids = torch.as_tensor(windows[start:start + batch_size])
        tokens = data.windows[ids, :data.seq_len].to(model.tok_emb.weight.device)
        alpha = model.prism(model.hidden(tokens)).alpha
        counts += (alpha > 0).reshape(-1, alpha.shape[-1]).sum(0).float().cpu()
        total += tokens.numel()
    return (counts / max(total, 1)).numpy()


@torch.no_grad()
def cards(model: CBLM, data: TokenData, neighbours: Neighbours, concept_names: list[str] | None = None,
          n_top_tokens: int = 10, contexts: int = 5, before: int = 8, usage_windows: int = 64) -> list[dict]:
    """One card per prototype (see the module docstring). ``concept_names``: the run's library, by concept id."""
    _check_prism(model)
    codec = Codec(data.vocab)
    head = model.prism
    signature = head.log_tau.exp() * (head.prototypes @ model.tok_emb.weight.T)  # tau W p_i: a_i at cos = 1
    top_values, top_ids = signature.float().cpu().topk(n_top_tokens, dim=-1)
    used = usage(model, data, data.val_windows[:usage_windows])
    p_token = data.log_unigram().exp().numpy()
    concepts = data.chunk_concepts()
    base_rate = np.asarray(concepts.mean(0)).ravel()
    result = []
    for i in range(len(signature)):
        valid = neighbours.valid[i]
        windows, positions = neighbours.window[i][valid], neighbours.position[i][valid]
        top_tokens = [(codec.decode([int(t)]), round(float(v), 3)) for v, t in zip(top_values[i], top_ids[i])]
        firing_ids = [int(data.windows[w, t]) for w, t in zip(windows, positions)]
        firing = [codec.decode([t]) for t in firing_ids]
        shown = []
        for w, t, score, token in list(zip(windows, positions, neighbours.score[i][valid], firing))[:contexts]:
            left = codec.decode(data.windows[w, max(0, t - before):t].tolist())
            shown.append({"text": f"{left}«{token}»", "token": token,
                          "next": codec.decode([int(data.windows[w, t + 1])]), "cos": round(float(score), 3)})
        name = _name([data.windows[w, max(0, t - 3):t + 1].numpy() for w, t in zip(windows, positions)], firing_ids,
                     p_token, codec)
        # category: a vote of its firing tokens, and of its top logit tokens with one vote in all (on a toy model
        # these are the same frequent tokens for most prototypes, so they only break ties)
        votes = Counter(token_category(t) for t in firing)
        for token, _ in top_tokens:
            votes[token_category(token)] += 1 / len(top_tokens)
        category = max(CATEGORIES, key=lambda c: (votes[c], -CATEGORIES.index(c)))
        card = {"prototype": i, "name": name, "category": category, "usage": round(float(used[i]), 4),
                "top_tokens": top_tokens, "contexts": shown, "concept": None}
        if valid.any() and data.n_concepts:
            share = np.asarray(concepts[neighbours.chunk_row[i][valid]].mean(0)).ravel()
            c = int(np.argmax(share))  # the most frequent; ties go to the lower id
            if share[c] > 0:
                card["concept"] = {"id": c, "name": concept_names[c] if concept_names else str(c),
                                   "share": round(float(share[c]), 3),
                                   "lift": round(float(share[c] / max(base_rate[c], 1e-12)), 2)}
        result.append(card)
    return result


def llm_names(card_list: list[dict], llm_config) -> int | None:
    """Name the cards with the LLM engine of ``llm_config`` (the run's ``llm`` section; the label stage's prompt and
    schema, ``models.labeler``): the "tags" are the prototype's firing tokens with their counts and its top logit
    tokens, the examples its contexts. Where the answer is usable the card's ``name`` and a ``description`` are
    replaced and ``named_by`` is "llm"; elsewhere the offline name stays. Returns how many cards the LLM named, or
    None for the offline engine (the cards keep their offline names)."""
    from atlas.models.labeler import configured_llm_labels

    evidence, examples = [], []
    for card in card_list:
        firing = Counter(c["token"] for c in card["contexts"])
        evidence.append([(f"fires on {t!r}", n) for t, n in firing.most_common()]
                        + [(f"promotes {t!r}", 1) for t, _ in card["top_tokens"]])
        examples.append([c["text"].replace("«", "[").replace("»", "]") + c["next"] for c in card["contexts"]])
    answers = configured_llm_labels(llm_config, evidence, examples)
    if answers is None:
        return None
    named = 0
    for card, answer in zip(card_list, answers):
        card["named_by"] = "offline"
        if answer is not None:
            card["name"], card["description"], card["named_by"] = answer[0], answer[1], "llm"
            named += 1
    return named


def format_card(card: dict) -> str:
    concept = card["concept"]
    lines = [f"prototype {card['prototype']}: {card['name']}   [{card['category']}]   routed at "
             f"{100 * card['usage']:.1f}% of held-out positions"]
    if card.get("description"):
        lines.append(f"  {card['description']}")
    lines.append("  promotes: " + ", ".join(f"{t!r} {v:+.2f}" for t, v in card["top_tokens"]))
    if concept:
        lines.append(f"  concept: {concept['name']} (id {concept['id']}; {100 * concept['share']:.0f}% of its "
                     f"neighbours' chunks, lift {concept['lift']:.1f})")
    lines += [f"  {c['cos']:.3f}  {c['text']!r} -> {c['next']!r}" for c in card["contexts"]]
    return "\n".join(lines)


def find_category(query: str) -> str:
    """The category that ``query`` names (any case): the whole name, or the start of one of its words ("numbers",
    "time" -> "numbers & time"; "pieces" -> "word pieces")."""
    query = query.strip().lower()
    found = [c for c in CATEGORIES if c == query] or \
        [c for c in CATEGORIES if c.startswith(query) or any(w.startswith(query) for w in c.split())]
    if len(found) != 1:
        raise ValueError(f"category {query!r}: expected one of {', '.join(CATEGORIES)} "
                         "(or the start of a word of one)")
    return found[0]


# --- interventions --------------------------------------------------------------------------------------------------


def prototype_edit(model: CBLM, prototype: int, strength: float) -> Callable:
    """The logit edit clamping prototype ``prototype``'s activation so that its contribution a_i (W p_i)_y peaks at
    ``strength`` * |top-1 logit| (see the module docstring)."""
    _check_prism(model)
    if not 0 <= prototype < model.config.prototypes:
        raise ValueError(f"prototype {prototype}: this model has prototypes 0-{model.config.prototypes - 1}")
    with torch.no_grad():
        signature = model.prism.prototypes[prototype] @ model.tok_emb.weight.T  # W p_i, [V]
    peak = float(signature.max())
    if peak <= 0:
        raise ValueError(f"prototype {prototype} raises no token's logit (max W p_i = {peak:.3g}): nothing to clamp")

    def edit(logits: torch.Tensor, parts) -> torch.Tensor:
        alpha = parts.alpha[..., prototype, None]
        clamped = strength * logits.amax(-1, keepdim=True).abs() / peak
        return logits + (clamped - alpha) * signature

    return edit


def category_edit(model: CBLM, members, strength: float, top: int = 16) -> Callable:
    """The logit edit adding ``strength`` * |top-1 logit| * S / max_y S_y, with S the sum of the signatures W p_i of
    the prototypes in ``members`` (ids) among the ``top`` most active at the position (none there: no change)."""
    _check_prism(model)
    with torch.no_grad():
        signatures = model.prism.prototypes @ model.tok_emb.weight.T  # [K, V]
    member = torch.zeros(model.config.prototypes, dtype=torch.bool, device=signatures.device)
    member[torch.as_tensor(list(members), dtype=torch.int64)] = True

    def edit(logits: torch.Tensor, parts) -> torch.Tensor:
        alpha = parts.alpha
        values, ids = alpha.topk(min(top, alpha.shape[-1]), dim=-1)
        active = torch.zeros_like(alpha, dtype=torch.bool).scatter_(-1, ids, values > 0)
        total = (active & member).to(signatures.dtype) @ signatures  # [B, V]
        peak = total.amax(-1, keepdim=True)
        scale = torch.where(peak > 0, strength * logits.amax(-1, keepdim=True).abs() / peak.clamp_min(1e-12), 0.0)
        return logits + scale * total

    return edit


# --- the model folder: RUN/cblm/<name>/prototypes/ ------------------------------------------------------------------


def mine_or_load(model_folder: str | Path, model: CBLM, data: TokenData, top: int = 16, windows: int | None = None,
                 batch_size: int = 16, seed: int = 0, progress=None, force: bool = False,
                 step: int | None = None) -> tuple[Neighbours, bool]:
    """(neighbours, reused): the neighbours saved in MODEL/prototypes/neighbours.parquet when they were mined from
    this checkpoint (the sha256 of its weights; ``step`` is recorded for people) with these settings, else mined now
    (over ``windows`` random training windows, default all) and saved."""
    path = Path(model_folder) / FOLDER / NEIGHBOURS
    key = {"checkpoint": checkpoint_digest(model_folder), "top": top, "sample": windows,
           "seed": seed if windows is not None else None}  # the seed draws the sample only
    if path.exists() and not force:
        saved = Neighbours.load(path)
        if saved.meta.get("key") == key:
            return saved, True
    chosen = data.train_windows
    if windows is not None and windows < len(chosen):
        chosen = np.sort(np.random.default_rng(seed).choice(chosen, windows, replace=False))
    neighbours = mine(model, data, top, chosen, batch_size, progress)
    neighbours.meta.update(key=key, step=step)
    neighbours.save(path)
    return neighbours, False


def load_neighbours(model_folder: str | Path) -> Neighbours:
    path = Path(model_folder) / FOLDER / NEIGHBOURS
    if not path.exists():
        raise FileNotFoundError(f"{path}: no mined prototypes; run `atlas cblm prototypes {model_folder}` first")
    return Neighbours.load(path)


def load_cards(model_folder: str | Path) -> list[dict]:
    path = Path(model_folder) / FOLDER / CARDS
    if not path.exists():
        raise FileNotFoundError(f"{path}: no prototype cards; run `atlas cblm prototypes {model_folder}` first")
    return json.loads(path.read_text())


def write_cards(model_folder: str | Path, result: list[dict]) -> Path:
    path = Path(model_folder) / FOLDER / CARDS
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1, ensure_ascii=False))
    return path


@torch.no_grad()
def explain(model: CBLM, neighbours: Neighbours, ids: list[int], codec: Codec, run_dir: str | Path | None = None,
            card_list: list[dict] | None = None, top: int = 10) -> str:
    """What `atlas cblm attribute` prints for a PRISM model: the prototype/residual split of the text's logits, the
    prototypes behind its last prediction, and the training chunks (with their documents) behind the last prediction
    and behind the whole text (A summed over its positions)."""
    device = model.tok_emb.weight.device
    idx = torch.tensor([ids[:-1]], device=device)
    targets = torch.tensor([ids[1:]], device=device)
    _, parts = model(idx)
    terms = decompose(model.tok_emb.weight, model.prism, parts, targets)
    lines = [f"{idx.shape[1]} predicted tokens, summed logit {float(terms['logit'].sum()):.3f} = prototypes "
             f"{float(terms['prototypes'].sum()):.3f} + residual {float(terms['residual'].sum()):.3f}",
             f"prototypes behind the last logit ({codec.decode([int(targets[0, -1])])!r}, "
             f"{float(terms['logit'][0, -1]):.3f}; a_i (W p_i)_y):"]
    last = terms["prototypes"][0, -1]
    for i in last.abs().argsort(descending=True)[:top].tolist():
        if float(parts.alpha[0, -1, i]) > 0:
            name = f"  {card_list[i]['name']} [{card_list[i]['category']}]" if card_list else ""
            lines.append(f"  {float(last[i]):+8.3f}  prototype {i:>5}{name}")
    names = neighbours.chunk_names()
    alpha = parts.alpha[0]
    ranked = attribution_weights(torch.stack([alpha[-1], alpha.sum(0)]), neighbours, top)
    documents = chunk_documents(run_dir, [names[r] for hits in ranked for r, _ in hits]) if run_dir else {}
    for title, hits in zip(("the last prediction", "the whole text"), ranked):
        lines.append(f"training chunks behind {title} (prototype neighbours, one forward pass):")
        for row, weight in hits:
            doc = documents.get(names[row])
            lines.append(f"  {weight:.3f}  {names[row]}" + (f"  (document {doc})" if doc else ""))
    return "\n".join(lines)
