"""Diagnostics of the concept-bottleneck LM (atlas/cblm/diagnostics.py): attention entropy and sink share on hand-made
maps, signal/noise head groups, attention_maps against the attention it describes, the repetition-escape detector,
the prototype disruption, and `atlas cblm eval --diagnostics` on a tiny run."""

from __future__ import annotations

import json
import math

import pytest
import torch
from test_cblm import TINY, one_thread, tiny_run  # noqa: F401  (fixtures: the tiny run, one thread)

from atlas.cblm import diagnostics
from atlas.cblm.diagnostics import (
    attention_stats,
    combine_heads,
    critical_temperature,
    cycle_continuation,
    disrupted,
    disruption_diagnostics,
    escaped,
    format_diagnostics,
    head_groups,
    mixer_inputs,
    pick_sentence,
    relative_change,
    repeated_prefix,
    repetition_escape,
    repetition_prompt,
    routing_diagnostics,
    row_entropy,
    target_probabilities,
)
from atlas.cblm.generate import Codec
from atlas.cblm.model import CBLM, ModelConfig, rope_tables
from atlas.models.tokenizer import BOS, cl100k

T = 12


def model_with(seed: int = 0, **overrides) -> CBLM:
    torch.manual_seed(seed)
    settings = dict(vocab_size=50, seq_len=16, d_model=16, n_head=4, n_layer=2, mask_id=49, block_size=4)
    return CBLM(ModelConfig(**{**settings, **overrides})).eval()


def causal() -> torch.Tensor:
    return torch.ones(T, T, dtype=torch.bool).tril()


def uniform_map() -> torch.Tensor:
    """[1, 1, T, T]: row i spreads its mass evenly over positions 0..i."""
    allowed = causal().float()
    return (allowed / allowed.sum(-1, keepdim=True))[None, None]


# --- attention -------------------------------------------------------------------------------------------------------

def test_entropy_of_uniform_and_one_hot_attention():
    assert torch.allclose(row_entropy(uniform_map())[0, 0], torch.arange(1, T + 1).float().log())
    one_hot = torch.eye(T)[None, None]
    stats = combine_heads(attention_stats([uniform_map(), one_hot], causal()), {"all": [0]})
    uniform, peaked = stats[0]["groups"]["all"], stats[1]["groups"]["all"]
    # rows 1..T-1 (row 0 sees one position and is left out): mean of ln(i + 1), normalized exactly 1
    assert uniform["entropy"] == pytest.approx(sum(math.log(i + 1) for i in range(1, T)) / (T - 1), rel=1e-6)
    assert uniform["entropy_normalized"] == pytest.approx(1.0, rel=1e-6)
    assert peaked["entropy"] == 0 and peaked["entropy_normalized"] == 0


def test_sink_share_on_a_constructed_case():
    """Head 0 puts half of every row on position 0 and spreads the rest; head 1 is uniform. The sink share reads rows
    >= SINK_FROM only."""
    rest = causal().float()
    rest[:, 0] = 0  # positions 1..i
    sink_head = 0.5 * rest / rest.sum(-1, keepdim=True).clamp_min(1)
    sink_head[:, 0] = 0.5
    sink_head[0, 0] = 1.0  # row 0 sees only position 0
    maps = [torch.stack([sink_head, uniform_map()[0, 0]])[None].repeat(3, 1, 1, 1)]  # [B=3, heads=2, T, T]
    assert torch.allclose(maps[0].sum(-1), torch.ones(3, 2, T))
    layer = combine_heads(attention_stats(maps, causal(), sink_from=4), {"signal": [0], "noise": [1]})[0]
    assert layer["groups"]["signal"]["sink"] == pytest.approx(0.5)
    assert layer["groups"]["noise"]["sink"] == pytest.approx(sum(1 / (i + 1) for i in range(4, T)) / (T - 4))
    assert layer["heads"][0]["sink"] == pytest.approx(0.5)


def test_signal_and_noise_heads_for_pi_rope():
    model = model_with(rope="pi")
    assert head_groups(model) == {"signal": [0, 1], "noise": [2, 3]}
    assert head_groups(model_with()) == {"all": [0, 1, 2, 3]}
    # the "signal" heads are the ones that rotate with the slow base pi * rope_base
    slow, fast = rope_tables(16, 4, 10000.0 * math.pi)[0], rope_tables(16, 4, 10000.0 / math.pi)[0]
    assert all(torch.allclose(model.rope_cos[h], slow) for h in (0, 1))
    assert all(torch.allclose(model.rope_cos[h], fast) for h in (2, 3))
    result = diagnostics.attention_diagnostics(model, torch.randint(0, 49, (3, T)))
    assert set(result["last_layer"]) == {"signal", "noise"} and len(result["layers"]) == 2


@pytest.mark.parametrize("rope,objective", [("standard", "ar"), ("pi", "ar"), ("pi", "diffusion")])
def test_attention_maps_are_distributions_and_reproduce_the_attention(rope, objective):
    """weights @ v through proj equals Attention.forward at every layer, on that layer's own input: this checks
    CBLM.attention_maps itself (which layer, which input, which mask and RoPE tables)."""
    model = model_with(rope=rope, objective=objective)
    idx = torch.randint(0, 49, (2, T))
    maps = model.attention_maps(idx)
    allowed = diagnostics.allowed_positions(model, T)
    x = model.tok_emb(idx)
    with torch.no_grad():
        for layer, block in enumerate(model.blocks):
            weights = maps[layer]
            assert torch.allclose(weights.sum(-1), torch.ones(2, 4, T), atol=1e-6)
            assert (weights[..., ~allowed] == 0).all()
            inp = block.attn_norm(x)
            _, _, v = block.attn._qkv(inp, model.rope_cos, model.rope_sin)
            from_maps = block.attn.proj((weights @ v).transpose(1, 2).reshape(2, T, -1))
            assert torch.allclose(from_maps, block.attn(inp, model.rope_cos, model.rope_sin, model.attn_mask),
                                  atol=1e-6)
            x = block(x, model.rope_cos, model.rope_sin, model.attn_mask)


# --- repetition escape -----------------------------------------------------------------------------------------------

def test_escape_detector_on_hand_made_sequences():
    cycle = [5, 6, 7]
    assert cycle_continuation(cycle, 7) == [5, 6, 7, 5, 6, 7, 5]
    assert cycle_continuation(cycle, 4, phase=2) == [7, 5, 6, 7]
    assert not escaped([5, 6, 7, 5, 6], cycle) and repeated_prefix([5, 6, 7, 5, 6], cycle) == 5
    assert escaped([5, 6, 7, 5, 9], cycle) and repeated_prefix([5, 6, 7, 5, 9], cycle) == 4  # the last token differs
    assert escaped([6, 7, 5], cycle) and not escaped([6, 7, 5], cycle, phase=1)
    assert repeated_prefix([1, 6, 7], cycle) == 0
    assert critical_temperature({0.1: 0.0, 0.2: 0.5, 0.3: 1.0}) == 0.2
    assert critical_temperature({0.1: 0.4, 0.2: 0.3}) is None


def test_repetition_prompt_is_the_repeated_text_and_ends_with_a_whole_cycle():
    encoding = cl100k()
    text = "A little black cat. A little black cat. A little black cat."
    codec = Codec(sorted(set(encoding.encode_ordinary(text)) | {BOS}))
    prompt, cycle, dropped = repetition_prompt(codec, "A little black cat", 3)
    assert dropped == 0 and codec.decode(prompt) == "[BOS]" + text and codec.decode(cycle) == " A little black cat."
    assert prompt[-len(cycle):] == cycle
    # the seeds' sentence needs " alarm" and " clock", which this vocabulary lacks: the complete fallback is used
    assert repetition_prompt(codec, "A little alarm clock", 2)[2] > 0
    assert pick_sentence(codec) == "A little black cat"


def test_escape_rate_and_critical_temperature_from_generation(monkeypatch):
    """A stand-in generator that repeats the cycle below temperature 0.5 and leaves it above: T_c = 0.5."""
    codec = Codec(sorted(set(cl100k().encode_ordinary("A little black cat. A little black cat.")) | {BOS}))
    _, cycle, _ = repetition_prompt(codec, "A little black cat", 2)

    def fake_generate(model, prompt, max_new_tokens, temperature, top_k, seed):
        new = cycle_continuation(cycle, max_new_tokens)
        if temperature >= 0.5 and seed % 2 == 0 or temperature >= 0.7:
            new[10] = BOS  # leaves the loop after 10 repeated tokens
        return prompt + new

    monkeypatch.setattr(diagnostics, "generate", fake_generate)
    result = repetition_escape(None, codec, repeats=(2, 5), seeds=4)
    assert [r["t_c"] for r in result["repeats"]] == [0.5, 0.5]
    assert result["sentence"] == "A little black cat" and "alarm clock" in result["note"]  # the fallback, reported
    rates = result["repeats"][0]["escape_rate"]
    assert rates[:4] == [0.0] * 4 and rates[4:6] == [0.5, 0.5] and rates[6:] == [1.0] * 6
    assert result["repeats"][0]["repeated_tokens"][0] == 20 and result["repeats"][0]["repeated_tokens"][-1] == 10
    table = format_diagnostics({"windows": 1, "seq_len": T, "mixer": "attention", "rope": "standard",
                                "repetition": result})
    assert table.splitlines()[-5].endswith("   0.5") and "does not copy the loop" not in table


# --- ProtoT ----------------------------------------------------------------------------------------------------------

def test_routing_metrics_read_each_blocks_mixer_input():
    model = model_with(mixer="prototype", mixer_channels=8)
    idx = torch.randint(0, 49, (3, T))
    inputs = mixer_inputs(model, idx)
    with torch.no_grad():
        assert torch.allclose(inputs[0], model.blocks[0].attn_norm(model.tok_emb(idx)))
        after_first = model.blocks[0](model.tok_emb(idx), model.rope_cos, model.rope_sin, None)
        assert torch.allclose(inputs[1], model.blocks[1].attn_norm(after_first))
    routing = routing_diagnostics(model, idx)
    assert [r["layer"] for r in routing] == [0, 1]
    assert all(r["alpha"] == 1.0 and 0 <= r["gini"] < 1 and 1 / 8 <= r["top1_mass"] <= 1 for r in routing)
    assert all(sum(r["load"]) == pytest.approx(1.0) for r in routing)


def test_relative_change_by_hand():
    before, after = torch.tensor([0.5, 0.005, 0.1]), torch.tensor([0.25, 0.5, 0.1])  # the middle one is < 1%
    change = relative_change(before, after)
    assert change == {"positions": 2, "mean_change": pytest.approx(-0.25), "mean_abs_change": pytest.approx(0.25),
                      "share_changed": pytest.approx(0.5)}


def test_disruption_works_on_a_copy_and_changes_p():
    model = model_with(mixer="prototype", mixer_channels=8)
    original = {k: v.clone() for k, v in model.state_dict().items()}
    windows = torch.randint(0, 49, (4, T + 1))
    clone = disrupted(model, layer=1, prototype=3)
    assert all(torch.equal(v, original[k]) for k, v in model.state_dict().items())  # the model is untouched
    changed = [k for k, v in clone.state_dict().items() if not torch.equal(v, original[k])]
    assert changed == ["blocks.1.attn.prototypes"]
    rows = clone.blocks[1].attn.prototypes.detach()
    assert not torch.equal(rows[3], original[changed[0]][3]) and torch.equal(rows[:3], original[changed[0]][:3])
    before, after = target_probabilities(model, windows), target_probabilities(clone, windows)
    assert before.shape == (4, T) and not torch.allclose(before, after)
    result = disruption_diagnostics(model, windows, routing_diagnostics(model, windows[:, :-1]))
    assert [(d["layer"], d["which"]) for d in result] == [(0, "most used"), (0, "least used"), (1, "most used"),
                                                          (1, "least used")]
    assert all(d["positions"] > 0 and d["mean_abs_change"] > 0 for d in result)  # untrained: p ~ 1/50 >= 1%
    assert all(torch.equal(v, original[k]) for k, v in model.state_dict().items())


# --- CLI -------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name,settings,expected", [
    ("diag-pi", ["rope=pi"], ("signal", "noise", "last layer entropy")),
    ("diag-proto", ["mixer=prototype", "mixer_channels=4"], ("ProtoT routing", "prototype disruption")),
])
def test_cli_eval_diagnostics(tiny_run, capsys, name, settings, expected):  # noqa: F811
    from atlas.cli import main

    overrides = TINY + ["head=none", "max_steps=2"] + settings
    assert main(["cblm", "train", str(tiny_run), "--name", name] + [x for s in overrides for x in ("--set", s)]) == 0
    folder = tiny_run / "cblm" / name
    capsys.readouterr()
    assert main(["cblm", "eval", str(folder), "--diagnostics", "--repeat-sentence", "The river flows",
                 "--repeat-n", "2,3", "--repeat-seeds", "2", "--diag-windows", "4"]) == 0
    captured = capsys.readouterr()
    assert all(text in captured.out for text in expected) and "T_c" in captured.out
    assert "repetition escape: N=2" in captured.err  # progress goes to stderr
    saved = json.loads((folder / "diagnostics.json").read_text())
    # the tiny corpus never has " The" (every text starts a chunk): the cycle " The river flows." loses it, and says so
    assert saved["repetition"]["sentence"] == "The river flows" and saved["repetition"]["dropped"] == 1
    assert "1 token(s) of it not in the vocabulary" in captured.out
    assert [r["n"] for r in saved["repetition"]["repeats"]] == [2, 3]
    assert ("attention" in saved) == (name == "diag-pi") and ("disruption" in saved) == (name == "diag-proto")
