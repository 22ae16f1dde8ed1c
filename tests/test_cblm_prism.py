"""Tools around a PRISM model (atlas/cblm/prototypes.py): nearest-neighbour mining against brute force, the one-pass
training-data attribution by hand, the logit edits of the interventions, cards, the measurement and the CLI."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from test_cblm import TINY, one_thread, tiny_run  # noqa: F401  (fixtures: one thread, the tiny run)
from test_cblm_attribution import tiny_run as index_run  # noqa: F401  (a tiny run with embeddings and an index)

from atlas.cblm import checkpoint
from atlas.cblm.data import TokenData
from atlas.cblm.generate import Codec, generate
from atlas.cblm.model import CBLM, ModelConfig
from atlas.cblm.prototypes import (
    CATEGORIES,
    Neighbours,
    attribute,
    attribution_weights,
    cards,
    category_edit,
    explain,
    find_category,
    llm_names,
    measure_attribution,
    mine,
    prototype_edit,
    token_category,
)

T = 16


def prism_model(vocab_size: int, prototypes: int = 6, topk: int = 3, seed: int = 0, **kw) -> CBLM:
    torch.manual_seed(seed)
    return CBLM(ModelConfig(vocab_size=vocab_size, prototypes=prototypes, prototype_topk=topk, seq_len=T,
                            d_model=16, n_head=2, n_layer=1, **kw)).eval()


@pytest.fixture(scope="module")
def data(tiny_run):  # noqa: F811
    return TokenData(tiny_run, T, val_fraction=0.2)


# --- mining ---------------------------------------------------------------------------------------------------------


def test_mining_keeps_the_true_top_distinct_positions(data):
    """Streaming with batches of 3 windows (so buffers merge many times), with windows given twice, equals ranking
    every input position of the training windows by brute force: the same top scores, each at a position that has
    that score; positions are inputs (t < seq_len) and distinct. (The tiny run repeats its texts, so equal contexts
    tie: the positions themselves are not unique.)"""
    model, top = prism_model(data.vocab_size), 5
    windows = np.concatenate([data.train_windows, data.train_windows[:4]])  # repeated windows are scanned once
    found = mine(model, data, top=top, windows=windows, batch_size=3)
    with torch.no_grad():
        cos = model.prism.activations(model.hidden(data.windows[:, :T]))[0]  # [all windows, T, K]
    train = cos[data.train_windows].reshape(-1, 6)
    for i in range(6):
        np.testing.assert_allclose(found.score[i], train[:, i].sort(descending=True).values[:top].numpy(), rtol=1e-6)
        np.testing.assert_allclose(cos[found.window[i], found.position[i], i].numpy(), found.score[i], rtol=1e-6)
        assert len(set(zip(found.window[i], found.position[i]))) == top and found.position[i].max() < T
        assert set(found.window[i]) <= set(data.train_windows.tolist())
    assert np.array_equal(found.chunk_row, data.chunk_rows[found.window, found.position].numpy())
    assert found.chunk_id[2, 0] == data.chunk_ids[found.chunk_row[2, 0]]


def test_neighbours_round_trip_with_fewer_positions_than_asked(data, tmp_path):
    model = prism_model(data.vocab_size)
    seen = []
    found = mine(model, data, top=T + 4, windows=data.train_windows[:1], progress=lambda d, n: seen.append((d, n)))
    assert seen == [(1, 1)]
    assert found.valid.sum(1).tolist() == [T] * 6 and np.isneginf(found.score[:, T:]).all()
    found.meta["step"] = 7
    found.save(tmp_path / "n.parquet")
    back = Neighbours.load(tmp_path / "n.parquet")
    for name in ("score", "window", "position", "chunk_row", "chunk_id"):
        assert np.array_equal(getattr(back, name), getattr(found, name)), name
    assert back.meta["step"] == 7 and back.meta["top"] == T + 4


# --- attribution ----------------------------------------------------------------------------------------------------


def hand_neighbours() -> Neighbours:
    """Prototype 0's two neighbours are both in chunk 5, prototype 1's in chunks 5 and 7; prototype 2 has none."""
    rows = np.array([[5, 5], [5, 7], [-1, -1]])
    windows = np.where(rows >= 0, 0, -1)
    ids = np.array([[f"c{r}" if r >= 0 else "" for r in row] for row in rows], dtype=object)
    return Neighbours(np.where(rows >= 0, 0.9, -np.inf).astype(np.float32), windows, windows.copy(), rows, ids)


def test_attribution_follows_the_formula_by_hand():
    """A(c) = sum_i a_i |S_i in c| / |S_i|, normalized over prototypes with neighbours: a = (1, 2, 4) gives
    chunk 5: 1 * 2/2 + 2 * 1/2 = 2, chunk 7: 2 * 1/2 = 1, so 2/3 and 1/3 (prototype 2 has no training tokens)."""
    ranked = attribution_weights(torch.tensor([[1.0, 2.0, 4.0], [0.0, 0.0, 3.0], [0.0, 1.0, 0.0]]),
                                 hand_neighbours(), top=None)
    assert [r for r, _ in ranked[0]] == [5, 7]
    np.testing.assert_allclose([w for _, w in ranked[0]], [2 / 3, 1 / 3])
    assert ranked[1] == []  # only a prototype without neighbours is active
    np.testing.assert_allclose([w for _, w in ranked[2]], [0.5, 0.5])
    assert attribution_weights(torch.tensor([[1.0, 2.0, 4.0]]), hand_neighbours(), top=1)[0] == [(5, 2 / 3)]


def test_attribute_is_the_formula_on_the_models_routed_activations(data):
    model = prism_model(data.vocab_size)
    found = mine(model, data, top=4, batch_size=8)
    idx = data.windows[data.val_windows[0], :T]
    result = attribute(model, found, idx, positions=[3, T - 1], top=None)
    with torch.no_grad():
        alpha = model(idx[None])[1].alpha[0]
    names = found.chunk_names()
    for got, row in zip(result, (3, T - 1)):
        assert abs(sum(w for _, w in got) - 1) < 1e-9
        expected = attribution_weights(alpha[row:row + 1], found, top=None)[0]
        assert got == [(names[r], w) for r, w in expected]


# --- interventions --------------------------------------------------------------------------------------------------


def last_position(model, idx):
    with torch.no_grad():
        logits, parts = model(idx)
    return logits[:, -1], SimpleNamespace(alpha=parts.alpha[:, -1]), parts


@pytest.mark.parametrize("strength", [0.5, 0.0, -0.25])
def test_prototype_edit_clamps_one_activation(strength):
    """The edited logits are W r + sum_{j != i} a_j W p_j + a* W p_i, with a* chosen so that a* max_y (W p_i)_y is
    strength * |top-1 logit|; strength 0 removes the prototype's term."""
    model = prism_model(40, prototypes=8, topk=4)
    idx = torch.randint(0, 40, (2, 10))
    logits, last, parts = last_position(model, idx)
    i = int(last.alpha[0].argmax())  # active at row 0
    edited = prototype_edit(model, i, strength)(logits, last)
    W, P = model.tok_emb.weight.detach(), model.prism.prototypes.detach()
    signature = P[i] @ W.T
    a_star = strength * logits.amax(-1).abs() / signature.max()
    alpha = last.alpha.clone()
    alpha[:, i] = a_star
    expected = (parts.residual[:, -1] + alpha @ P) @ W.T
    torch.testing.assert_close(edited, expected, atol=1e-5, rtol=1e-5)
    # its contribution to the token its signature raises most is that fraction of the top-1 logit
    torch.testing.assert_close(a_star * signature.max(), strength * logits.amax(-1).abs())
    if strength == 0:
        torch.testing.assert_close(edited, logits - last.alpha[:, i, None] * signature)


def test_category_edit_adds_the_scaled_signature_sum_of_active_members():
    model = prism_model(40, prototypes=8, topk=3)
    idx = torch.randint(0, 40, (1, 10))
    logits, last, _ = last_position(model, idx)
    active = (last.alpha[0] > 0).nonzero()[:, 0].tolist()
    inactive = [i for i in range(8) if i not in active]
    members = active[:2] + inactive[:1]
    signatures = model.prism.prototypes.detach() @ model.tok_emb.weight.detach().T
    total = signatures[active[:2]].sum(0)  # the inactive member does not count
    expected = logits + 0.3 * logits.amax(-1, keepdim=True).abs() * total / total.max()
    torch.testing.assert_close(category_edit(model, members, 0.3)(logits, last), expected)
    assert torch.equal(category_edit(model, inactive, 0.3)(logits, last), logits)  # no member active: no change
    # only the `top` most active count: with top=1, only the largest activation's prototype can
    first = int(last.alpha[0].argmax())
    only = category_edit(model, [first], 0.3, top=1)(logits, last)
    assert torch.allclose(only, category_edit(model, [first], 0.3)(logits, last))
    assert torch.equal(category_edit(model, [a for a in active if a != first], 0.3, top=1)(logits, last), logits)


@pytest.mark.parametrize("mixer", ["attention", "prototype"])
def test_generation_samples_from_the_edited_logits(mixer):
    model = prism_model(40, mixer=mixer)
    prompt = [1, 2, 3]
    plain = generate(model, prompt, 6, seed=3)
    assert generate(model, prompt, 6, seed=3, logit_edit=lambda logits, parts: logits) == plain

    def forced(logits, parts):
        assert logits.shape == (1, 40) and parts.alpha.shape == (1, 6)  # the last position's logits and parts
        return torch.where(torch.arange(40) == 7, 0.0, -float("inf")).expand_as(logits)

    assert generate(model, prompt, 6, seed=3, logit_edit=forced) == prompt + [7] * 6
    # clamped at 20x the top-1 logit, a prototype's favourite token wins every greedy step
    signatures = model.prism.prototypes.detach() @ model.tok_emb.weight.detach().T
    i = next(i for i in range(6) if int(signatures[i].argmax()) != model.config.mask_id)
    favourite = int(signatures[i].argmax())
    assert generate(model, prompt, 6, temperature=0, logit_edit=prototype_edit(model, i, 20.0)) == \
        prompt + [favourite] * 6


def test_diffusion_refuses_logit_edits():
    model = prism_model(40, objective="diffusion", block_size=4)
    with pytest.raises(ValueError, match="AR models only"):
        generate(model, [1, 2], 4, logit_edit=lambda logits, parts: logits)


# --- cards and measurement ------------------------------------------------------------------------------------------


def test_token_categories_by_hand():
    expected = {" 1999": "numbers & time", " January": "numbers & time", ".": "punctuation & formatting",
                "\n\n": "punctuation & formatting", "[EOC]": "punctuation & formatting", " the": "function words",
                "ing": "word pieces", " Paris": "names & capitalized", " river": "content words"}
    assert {t: token_category(t) for t in expected} == expected
    assert [find_category(q) for q in ("numbers", "Time", "pieces", "punct")] == \
        ["numbers & time", "numbers & time", "word pieces", "punctuation & formatting"]
    with pytest.raises(ValueError, match="expected one of"):
        find_category("words")  # function words or content words


def test_cards_have_their_fields(data):
    model = prism_model(data.vocab_size)
    found = mine(model, data, top=4)
    names = ["triangles", "python code", "rivers", "music", "tone: formal", "tone: casual"]
    result = cards(model, data, found, names, n_top_tokens=5, contexts=3)
    assert [c["prototype"] for c in result] == list(range(6))
    for card in result:
        assert set(card) == {"prototype", "name", "category", "usage", "top_tokens", "contexts", "concept"}
        assert card["name"] and card["category"] in CATEGORIES and 0 <= card["usage"] <= 1
        assert len(card["top_tokens"]) == 5 and len(card["contexts"]) == 3
        assert all("«" in c["text"] and c["text"].endswith("»") for c in card["contexts"])
        assert card["concept"]["name"] in names and 0 < card["concept"]["share"] <= 1
    with torch.no_grad():  # usage: the share of held-out positions where the prototype is routed (a > 0)
        alpha = model(data.windows[data.val_windows, :T])[1].alpha
    np.testing.assert_allclose([c["usage"] for c in result], (alpha > 0).float().mean((0, 1)).numpy(), atol=1e-4)


def test_an_llm_engine_names_the_cards_with_the_label_prompt(data):
    """With an LLM engine (the openai one, against a real loopback server), every card gets the LLM's name and
    description, asked with the label stage's prompt: the prototype's firing and promoted tokens as its tags, its
    contexts as the examples; an unusable answer keeps the offline name."""
    from fault_server import FaultServer

    from atlas.config import LLMConfig

    def openai(server, retries: int) -> LLMConfig:
        return LLMConfig(engine="openai", base_url=server.base_url, model="test-model", timeout_s=2.0,
                         max_retries=retries, backoff_s=0.01)

    model = prism_model(data.vocab_size)
    result = cards(model, data, mine(model, data, top=4), n_top_tokens=5, contexts=3)
    offline = [c["name"] for c in result]
    assert llm_names(result, LLMConfig(engine="offline")) is None and [c["name"] for c in result] == offline
    with FaultServer(mode="ok") as server:
        assert llm_names(result, openai(server, 1)) == len(result)
        prompts = [r["messages"][1]["content"] for r in server.requests]
    assert len(prompts) == len(result) and all("fires on" in p and "promotes" in p for p in prompts)
    assert all(c["named_by"] == "llm" and c["description"] for c in result)
    assert [c["name"] for c in result] != offline
    fresh = cards(model, data, mine(model, data, top=4), n_top_tokens=5, contexts=3)
    with FaultServer(mode="invalid_json") as server:
        assert llm_names(fresh, openai(server, 0)) == 0
    assert [c["name"] for c in fresh] == offline and all(c["named_by"] == "offline" for c in fresh)


def test_measurement_against_random_and_the_ivfpq_transducer(index_run):  # noqa: F811
    from atlas.cblm.attribution import build_training_attribution, load_transducer

    data = TokenData(index_run, T, val_fraction=0.2)
    model = prism_model(data.vocab_size)
    out = index_run / "cblm" / "prism"
    checkpoint.save(out, model, None, {"step": 0, "train_config": {"val_fraction": 0.2},
                                       "model_config": model.config.to_dict(), "vocab": data.vocab.tolist()})
    build_training_attribution(index_run, out, hidden=16, steps=5)
    found = mine(model, data, top=4)
    result = measure_attribution(model, data, found, positions=30, k=5, run_dir=index_run,
                                 transducer=load_transducer(out / "transducer"))
    assert result["k"] == 5 and 0 < result["positions"] <= 30
    for criterion in ("concepts", "next_token", "next_token_or_lifted"):
        assert set(result[criterion]) == {"prism", "random", "ivfpq"}
        assert all(0 <= v <= 1 for v in result[criterion].values())
    for method in ("prism", "random", "ivfpq"):
        assert result["next_token_or_lifted"][method] >= result["next_token"][method]
    # `atlas cblm attribute` on a PRISM model names the documents of the chunks, from the run's embeddings store
    text = explain(model, found, data.windows[data.val_windows[0], :8].tolist(), Codec(data.vocab), index_run)
    assert "training chunks behind the whole text" in text and "(document doc" in text


# --- CLI ------------------------------------------------------------------------------------------------------------


def test_cli_prototypes_generate_attribute(tiny_run, capsys):  # noqa: F811
    from atlas.cli import main

    sets = TINY + ["head=prism", "prototypes=8", "prototype_topk=4", "max_steps=2", "val_fraction=0.2"]
    assert main(["cblm", "train", str(tiny_run), "--name", "prism"] + [x for s in sets for x in ("--set", s)]) == 0
    folder = tiny_run / "cblm" / "prism"
    command = ["cblm", "prototypes", str(folder), "--top", "4", "--cards", "2"]
    capsys.readouterr()
    assert main(command + ["--measure", "20"]) == 0
    out = capsys.readouterr().out
    assert "mined the 4 nearest" in out and "8 cards in" in out and out.count("routed at") == 2
    assert "share a concept" in out and "atlas cblm tda" in out  # no transducer: the hint for the ivfpq column
    assert (folder / "prototypes" / "neighbours.parquet").exists() and (folder / "prototypes" / "cards.json").exists()
    assert main(command) == 0 and "kept the 4 nearest" in capsys.readouterr().out  # same checkpoint: not mined again

    generate_command = ["cblm", "generate", str(folder), "--prompt", "The river", "--max-new-tokens", "4"]
    assert main(generate_command + ["--prototype", "1", "--strength", "1"]) == 0
    out = capsys.readouterr().out
    assert "prototype 1 (" in out and "before ---" in out and "--- after ---" in out
    assert main(generate_command + ["--category", "content", "--strength", "-0.5"]) == 0
    assert "category 'content words'" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="category 'colours'"):
        main(generate_command + ["--category", "colours"])

    assert main(["cblm", "attribute", str(folder), "The triangle has three sides"]) == 0
    out = capsys.readouterr().out
    assert "= prototypes" in out and "training chunks behind the last prediction" in out

    concept_model = tiny_run / "cblm" / "concepts-untrained"
    model = CBLM(ModelConfig(vocab_size=50, n_concepts=6, seq_len=T, d_model=16, n_head=2, n_layer=1,
                             unknown_rank=4))
    checkpoint.save(concept_model, model, None, {"step": 0, "train_config": {"head": "concepts"},
                                                 "model_config": model.config.to_dict(), "vocab": list(range(50))})
    with pytest.raises(SystemExit, match="no PRISM head"):
        main(["cblm", "prototypes", str(concept_model)])
    with pytest.raises(SystemExit, match="need a PRISM model|edit a PRISM model"):
        main(["cblm", "generate", str(concept_model), "--prototype", "0"])
