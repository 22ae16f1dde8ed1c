"""The annotator's pieces, without a model: losses by hand, decision rule, reservoir, split, save/load."""

import json
import math

import numpy as np
import pytest
import torch

from atlas.llm.answers import SchemaError
from atlas.models.annotator import (
    Annotator,
    AnnotatorHeads,
    AnnotatorSpec,
    annotator_loss,
    choose_rule,
    decide,
    masked_bce_positive,
    nn_pu_risk,
    pu_priors,
    save_annotator,
)
from atlas.models.auxiliary import AuxDomain, calibrated_labels, load_aux_domains
from atlas.models.pu_metrics import ranking_metrics
from atlas.stages.targets import build_reservoir, heldout_split


def softplus(x: float) -> float:
    return math.log1p(math.exp(x))


def test_masked_bce_counts_only_positives():
    logits = torch.tensor([[0.0, 5.0], [-7.0, 1.0]])
    targets = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    expected = (softplus(-0.0) + softplus(-1.0)) / 2  # the unlabeled 5.0 and -7.0 do not count
    assert masked_bce_positive(logits, targets).item() == pytest.approx(expected, rel=1e-6)
    assert masked_bce_positive(logits, torch.zeros_like(targets)).item() == 0.0


def test_nn_pu_risk_by_hand():
    # one concept; chunk 0 is a labeled positive, chunks 1 and 2 are unlabeled; prior 0.2 among unlabeled
    logits = torch.tensor([[2.0], [-1.0], [0.0]])
    targets = torch.tensor([[1.0], [0.0], [0.0]])
    positive = 0.2 * softplus(-2.0)
    negative = (softplus(-1.0) + softplus(0.0)) / 2 - 0.2 * softplus(2.0)
    risk, objective = nn_pu_risk(logits, targets, torch.tensor([0.2]))
    assert negative > 0
    assert risk.item() == pytest.approx(positive + negative, rel=1e-6)
    assert objective.item() == pytest.approx(positive + negative, rel=1e-6)


def test_nn_pu_clamps_a_negative_risk_and_steps_back():
    # an overconfident positive makes the unbiased negative risk negative: nnPU clamps it to 0
    logits = torch.tensor([[5.0], [-3.0]])
    targets = torch.tensor([[1.0], [0.0]])
    negative = softplus(-3.0) - 0.5 * softplus(5.0)
    assert negative < 0
    risk, objective = nn_pu_risk(logits, targets, torch.tensor([0.5]), beta=0.0, gamma=1.0)
    assert risk.item() == pytest.approx(0.5 * softplus(-5.0), rel=1e-5)
    assert objective.item() == pytest.approx(-negative, rel=1e-5)  # Kiryo's step back: -gamma * negative risk


def test_nn_pu_risk_is_never_negative():
    generator = torch.Generator().manual_seed(0)
    for _ in range(50):
        logits = torch.randn(16, 7, generator=generator) * 6
        targets = (torch.rand(16, 7, generator=generator) < 0.3).float()
        prior = torch.rand(7, generator=generator) * 0.5
        risk, _ = nn_pu_risk(logits, targets, prior)
        assert risk.item() >= 0


def test_annotator_loss_sums_domains_and_backpropagates():
    logits = {"content": torch.zeros(2, 3, requires_grad=True), "tone": torch.zeros(2, 2, requires_grad=True)}
    targets = {"content": torch.tensor([[1.0, 0, 0], [0, 1, 0]]), "tone": torch.tensor([[0.0, 1], [0, 0]])}
    priors = {"content": torch.zeros(3), "tone": torch.zeros(2)}
    loss, parts = annotator_loss(logits, targets, priors)
    # zero priors: nnPU is the plain BCE of every unlabeled pair; all logits 0 -> every term is log 2
    assert loss.item() == pytest.approx(4 * math.log(2), rel=1e-6)
    assert set(parts) == {"content_bce", "content_pu", "tone_bce", "tone_pu"}
    loss.backward()
    assert logits["content"].grad.abs().sum() > 0


def test_pu_priors():
    assert pu_priors(np.array([0.1]), 0.5)[0] == pytest.approx(0.1 / 0.9)  # true rate 0.2, 0.1 of it unlabeled
    assert pu_priors(np.array([0.1, 0.0]), 1.0).tolist() == [0.0, 0.0]  # every positive is labeled
    assert pu_priors(np.array([0.4]), 0.1)[0] == 0.5  # clipped


def test_decide_applies_threshold_then_cap():
    probs = np.array([[0.9, 0.2, 0.8, 0.7], [0.1, 0.3, 0.2, 0.0]])
    assert [[j for j, _ in row] for row in decide(probs, 0.5, 2)] == [[0, 2], []]
    assert [[j for j, _ in row] for row in decide(probs, 0.25, 10)] == [[0, 2, 3], [1]]


def test_choose_rule_finds_the_separating_threshold_and_cap():
    # every chunk has exactly one positive, its best-scored label; the others sit at 0.1-0.4
    probs = np.array([[0.9, 0.4, 0.1], [0.3, 0.85, 0.2], [0.1, 0.4, 0.8]])
    targets = np.eye(3)
    rule = choose_rule(probs, targets, max_cap=3)
    assert all([j for j, _ in row] == [i] for i, row in enumerate(decide(probs, rule["threshold"], rule["cap"])))
    second = np.array([[0.9, 0.6, 0.1], [0.3, 0.85, 0.7], [0.65, 0.1, 0.8]])  # each chunk's runner-up at 0.6-0.7
    rule = choose_rule(second, targets, max_cap=3)
    assert all([j for j, _ in row] == [i] for i, row in enumerate(decide(second, rule["threshold"], rule["cap"])))
    assert choose_rule(probs, np.zeros((3, 3)), 3)["criterion"] == -1.0  # nothing known: a default rule


def test_ranking_metrics_by_hand():
    scores = np.array([[0.9, 0.1, 0.5], [0.2, 0.8, 0.7], [0.3, 0.3, 0.3]])
    truth = np.array([[0, 0, 1], [0, 1, 1], [0, 0, 0]])
    m = ranking_metrics(scores, truth, decided=[[(0, 0.9)], [(1, 0.8), (2, 0.7)], []])
    # positives: (0,2) ranked 2nd; (1,1) 1st and (1,2) 2nd -> recall@1 = 1/3, recall@5 = 1
    assert m["recall_at"]["1"] == pytest.approx(1 / 3) and m["recall_at"]["5"] == 1.0
    assert m["precision_lower_bound"] == pytest.approx(2 / 3) and m["recall"] == pytest.approx(2 / 3)
    assert m["chunks_with_positives"] == 2 and m["share_with_prediction"] == pytest.approx(2 / 3)
    assert 0 < m["pr_auc"] <= 1 and m["reliability"]["bin_pairs"] and 0 <= m["reliability"]["ece"] <= 1


def test_reservoir_takes_the_long_tail_first_then_fills():
    chunks = [f"c{i:03d}" for i in range(100)]
    concepts = {c: [0] for c in chunks[:90]} | {c: [1] for c in chunks[90:95]} | {chunks[95]: [2]}
    picked = build_reservoir(chunks, concepts, size=20, min_per_concept=3, seed=0)
    assert len(picked) == 20
    rare = [c for c in picked if concepts.get(c) == [1]]
    assert len(rare) >= 3 and chunks[95] in picked  # the rare concepts got their minimum
    assert sum(v == "long_tail" for v in picked.values()) == 3 + 3 + 1
    assert build_reservoir(chunks, concepts, None, 3, 0).keys() == set(chunks)  # no size: everything
    assert build_reservoir(chunks, concepts, 20, 3, 0) == picked  # deterministic


def test_split_is_by_document_and_stable():
    splits = [heldout_split(f"doc{i}", 0.2, seed=0) for i in range(2000)]
    assert 0.17 < splits.count("heldout") / 2000 < 0.23
    assert heldout_split("doc7", 0.2, 0) == heldout_split("doc7", 0.2, 0)


def test_calibrated_aux_labels():
    domain = AuxDomain("tone", "", [{"name": n, "description": ""} for n in "abc"], max_labels=2, min_labels=1,
                       path=None)
    similarity = np.full((20, 3), 0.3) + np.random.default_rng(0).normal(0, 0.01, (20, 3))
    similarity[5, 1] = 0.6  # label b stands out for chunk 5 only
    labels = calibrated_labels(similarity, domain, min_z=2.0, min_similarity=0.2)
    assert [j for j, _ in labels[5]] == [1]
    assert all(len(row) == 1 for row in labels)  # min_labels=1: every chunk gets its best label
    strict = AuxDomain("alignment", "", domain.labels, 2, 0, None)
    assert calibrated_labels(similarity, strict, 2.0, 0.2)[0] == []  # nothing stands out, nothing applies


def test_aux_lists_ship_and_bad_files_are_named(tmp_path):
    tone, demographic, alignment = load_aux_domains(["tone", "demographic", "alignment"])
    assert (len(tone.labels), len(demographic.labels), len(alignment.labels)) == (80, 38, 8)
    (tmp_path / "aux").mkdir()
    (tmp_path / "aux" / "tone.json").write_text(json.dumps({"labels": [{"name": "x", "description": ""}] * 2}))
    with pytest.raises(SchemaError, match=r"tone.json: duplicate label names \['x'\]"):
        load_aux_domains(["tone"], str(tmp_path))
    with pytest.raises(SchemaError, match="no candidate list for auxiliary domain 'mood'"):
        load_aux_domains(["mood"], str(tmp_path))


def small_annotator(tmp_path, seed=0):
    torch.manual_seed(seed)
    heads = AnnotatorHeads(8, 5, {"tone": 3}, hidden=16, dropout=0.0)
    spec = AnnotatorSpec(encoder="all-MiniLM-L6-v2", dim=8, hidden=16, dropout=0.0,
                         domains={"content": {"offset": 0, "size": 5, "threshold": 0.5, "cap": 2},
                                  "tone": {"offset": 5, "size": 3, "threshold": 0.4, "cap": 1}})
    save_annotator(tmp_path, heads, spec)
    return heads, spec


def test_save_and_load_round_trip(tmp_path):
    heads, spec = small_annotator(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]  # nothing pickled
    loaded = Annotator(tmp_path)
    assert loaded.spec == spec
    z = torch.nn.functional.normalize(torch.randn(4, 8), dim=-1)
    probs = loaded.probabilities(z.numpy())
    heads.eval()
    with torch.no_grad():
        expected = {d: torch.sigmoid(v).numpy() for d, v in heads(z).items()}
    for domain in ("content", "tone"):
        np.testing.assert_array_equal(probs[domain], expected[domain])
    for row in loaded.decide(probs):  # global ids: tone labels come after the 5 content concepts
        assert len(row["content"]) <= 2 and all(0 <= g < 5 for g, _ in row["content"])
        assert len(row["tone"]) <= 1 and all(5 <= g < 8 for g, _ in row["tone"])


def test_loading_checks_files_and_label_space(tmp_path):
    with pytest.raises(FileNotFoundError, match="no trained annotator here"):
        Annotator(tmp_path)
    small_annotator(tmp_path)
    library = [{"domain": "content"}] * 4 + [{"domain": "tone"}] * 3
    with pytest.raises(ValueError, match="knows 5 content concepts but the library has 4"):
        Annotator(tmp_path).check_library(library)
    config = json.loads((tmp_path / "config.json").read_text())
    config["domains"]["content"]["size"] = 6
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"concept matrix is \(5, 8\), config.json says \(6, 8\)"):
        Annotator(tmp_path).setup()
