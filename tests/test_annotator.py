"""The annotator's pieces, without a model: losses by hand, calibration, decision rule, reservoir, split, save/load."""

import json
import math
import shutil

import numpy as np
import pytest
import torch
from conftest import write_config
from scipy import sparse

from atlas.config import PROJECT_ROOT, load_config
from atlas.core.files import ArtifactError
from atlas.llm.answers import SchemaError
from atlas.models.annotator import (
    MIN_SLOPE,
    RETRAIN,
    Annotator,
    AnnotatorHeads,
    AnnotatorSpec,
    annotator_loss,
    calibrate,
    decide,
    fit_platt,
    masked_bce_positive,
    nn_pu_risk,
    pu_priors,
    save_annotator,
    valid_calibration,
)
from atlas.models.auxiliary import (
    AuxDomain,
    answer_schema,
    calibrated_labels,
    chosen_labels,
    describe_lists,
    load_aux_domains,
    null_thresholds,
    reads_like_null,
)
from atlas.models.pu_metrics import (
    best_f1_threshold,
    calibration_report,
    labels_per_chunk,
    median_predicted_score,
    ranking_metrics,
    reliability,
)
from atlas.stages.targets import TargetsStage, build_reservoir, heldout_split


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


def synthetic_domain(seed=0, n=2000, labels=50, a=0.35, b=-2.5):
    """Saturated logits (as nnPU gives) whose true probability of a known positive is sigmoid(a * logit + b)."""
    rng = np.random.default_rng(seed)
    logits = rng.normal(0.0, 8.0, (n, labels)).astype(np.float32)
    true = 1 / (1 + np.exp(-(a * logits.astype(np.float64) + b)))
    return logits, true, rng.random((n, labels)) < true


def test_platt_recovers_known_probabilities():
    logits, true, truth = synthetic_domain()
    fitted = fit_platt(logits, truth)
    assert fitted["a"] == pytest.approx(0.35, abs=0.02) and fitted["b"] == pytest.approx(-2.5, abs=0.1)
    assert fitted["fit_pairs"] == fitted["pairs"] == truth.size and fitted["known_positives"] == truth.sum()
    probs = calibrate(logits, fitted)
    assert probs.dtype == np.float32 and np.abs(probs - true).max() < 0.02
    report = calibration_report(logits, truth, seed=0)  # cross-fitted: each half calibrated by the other's map
    assert report["ece"] < 0.01 and len(report["ece_halves"]) == 2
    assert report["ece_uncalibrated"] > 0.1  # the raw sigmoid is far off: saturated, over-confident
    bins = report["reliability"]
    assert bins["cross_fitted"] and sum(bins["bin_pairs"]) == truth.size and bins["ece"] == report["ece"]
    for mean_p, observed, pairs in zip(bins["bin_mean_probability"], bins["bin_observed_rate"], bins["bin_pairs"]):
        assert pairs < 500 or abs(mean_p - observed) < 0.05


def test_platt_on_a_sample_stays_calibrated(monkeypatch):
    """Over the pair budget: positives (up to half) and a uniform sample, weighted by their inverse rates."""
    from atlas.models import pu_metrics

    logits, true, truth = synthetic_domain(seed=1)
    monkeypatch.setattr(pu_metrics, "MAX_PAIRS_FOR_PR_AUC", 25_000)  # the report on a fixed sample of chunks
    report = calibration_report(logits, truth, seed=0)
    assert report["chunks"] == 500 and report["ece"] < 0.02 and sum(report["reliability"]["bin_pairs"]) == 25_000
    full = fit_platt(logits, truth)
    sampled = fit_platt(logits, sparse.csr_matrix(truth.astype(np.float32)), max_pairs=20_000, seed=3)
    assert sampled["fit_pairs"] <= 20_000 and sampled["pairs"] == truth.size
    assert sampled["a"] == pytest.approx(full["a"], rel=0.1) and sampled["b"] == pytest.approx(full["b"], abs=0.2)
    assert reliability(calibrate(logits, sampled), truth)["ece"] < 0.01
    assert fit_platt(logits, truth, max_pairs=20_000, seed=3) == sampled  # seeded; dense and sparse agree


def test_platt_degenerate_domains_keep_an_increasing_map():
    logits = np.random.default_rng(0).normal(0, 3, (100, 4)).astype(np.float32)
    none = fit_platt(logits, np.zeros((100, 4)))  # no known positive: the level only, the ranking kept
    assert none["a"] == MIN_SLOPE and calibrate(logits, none).max() < 0.01
    separable = fit_platt(np.array([[5.0, -5.0], [-5.0, 5.0]]), np.eye(2))  # Platt's targets keep a finite
    assert 0 < separable["a"] < 10 and np.isfinite(separable["b"])
    assert fit_platt(np.zeros((0, 3)), np.zeros((0, 3)))["a"] == 1.0
    assert valid_calibration(none) and valid_calibration({"method": "platt", "a": 1, "b": 0})
    for bad in (None, {}, {"method": "platt", "a": 0.0, "b": 0.0}, {"method": "platt", "a": True, "b": 0.0},
                {"method": "platt", "a": float("nan"), "b": 0.0}, {"method": "isotonic", "a": 1.0, "b": 0.0}):
        assert not valid_calibration(bad)


def test_calibration_leaves_the_ranking_metrics_unchanged():
    logits, _, truth = synthetic_domain(seed=2, n=500)
    calibrated = ranking_metrics(calibrate(logits, fit_platt(logits, truth)), truth)
    raw = ranking_metrics(logits, truth, bins=None)
    assert calibrated["recall_at"] == raw["recall_at"]
    assert calibrated["pr_auc"] == pytest.approx(raw["pr_auc"], abs=1e-6)  # float32 ties at most
    assert "reliability" not in raw and "reliability" in calibrated


def test_best_f1_threshold_by_hand():
    probs = np.array([[0.9, 0.6, 0.1], [0.7, 0.2, 0.05], [0.3, 0.8, 0.02]])
    truth = np.array([[1, 1, 0], [1, 0, 0], [0, 1, 0]])
    best = best_f1_threshold(probs, truth, block_rows=2)  # blocks of rows give the same counts
    # every positive scores >= 0.6 and every other pair <= 0.3: any threshold in (0.3, 0.6] separates them
    assert 0.3 < best["threshold"] <= 0.6 and best["f1_lower_bound"] == 1.0 and best["recall"] == 1.0
    assert best_f1_threshold(probs, np.zeros((3, 3)))["threshold"] == 0.5  # nothing known: a default
    # no skill: F1 of known positives is best when every label is given; the floor (the known-positive rate,
    # lift >= 1) stops that
    rng = np.random.default_rng(0)
    noise, coin = rng.random((400, 5)), rng.random((400, 5)) < 0.5
    assert best_f1_threshold(noise, coin, floor=0.0)["threshold"] < 0.05
    floored = best_f1_threshold(noise, sparse.csr_matrix(coin))
    assert floored["floor"] == pytest.approx(coin.mean()) and coin.mean() <= floored["threshold"] < 0.56


def test_decision_rule_gives_each_chunk_the_labels_it_has():
    """Calibrated probabilities + a threshold: the number of labels varies and low probabilities fill no cap."""
    rng = np.random.default_rng(0)
    n, labels, cap = 400, 40, 20
    true = np.full((n, labels), 0.01)
    has = rng.integers(0, 6, n)  # chunk i carries has[i] labels, each likely
    for i, k in enumerate(has):
        true[i, rng.choice(labels, k, replace=False)] = 0.9
    truth = rng.random((n, labels)) < true
    threshold = best_f1_threshold(true, truth)["threshold"]
    assert 0.01 < threshold <= 0.9
    decided = decide(true, threshold, cap)
    assert [len(row) for row in decided] == has.tolist()  # as many labels as it has, never the cap
    stats = labels_per_chunk(decided, cap)
    assert stats["min"] == 0 and stats["max"] == 5 and stats["share_at_cap"] == 0.0
    assert stats["share_zero"] == pytest.approx((has == 0).mean()) and len(set(has)) > 3
    assert stats["histogram"][:6] == np.bincount(has, minlength=6).tolist() and len(stats["histogram"]) == cap + 1
    assert median_predicted_score(decided) == pytest.approx(0.9)
    low = decide(np.full((3, labels), 0.2), 0.5, cap)  # an auxiliary domain: nothing passes, no label
    assert low == [[], [], []] and median_predicted_score(low) is None


def test_rule_per_domain_and_its_overrides():
    from atlas.config import AtlasConfig
    from atlas.stages.train_annotator import TrainAnnotatorStage

    rng = np.random.default_rng(0)
    probs = rng.random((200, 10)).astype(np.float32)
    truth = rng.random((200, 10)) < probs * 0.5
    stage = TrainAnnotatorStage(AtlasConfig())
    content, tone = stage._rule("content", probs, truth), stage._rule("tone", probs, truth)
    assert content["threshold"] == best_f1_threshold(probs, truth)["threshold"] and content["cap"] == 20
    assert tone["threshold"] == 0.5 and tone["cap"] == 3 and tone["threshold_from"] == "annotator.aux_min_probability"
    assert stage._rule("mood", probs, truth)["cap"] == 10  # a domain without a max_caps entry
    config = AtlasConfig()
    config.annotator.thresholds, config.annotator.caps = {"content": 0.3}, {"tone": 1}
    config.annotator.aux_min_probability = 0.7
    overridden = TrainAnnotatorStage(config)
    assert overridden._rule("content", probs, truth)["threshold"] == 0.3
    tone = overridden._rule("tone", probs, truth)
    assert (tone["threshold"], tone["cap"]) == (0.7, 1)


def test_labels_per_chunk_by_hand():
    stats = labels_per_chunk([[(0, 0.9)], [], [(1, 0.8), (2, 0.7)], [(0, 0.6), (1, 0.6)]], cap=2)
    assert stats | {"p90": None} == {"chunks": 4, "min": 0, "median": 1.5, "mean": 1.25, "p90": None, "max": 2,
                                     "share_at_cap": 0.5, "share_zero": 0.25, "cap": 2, "histogram": [1, 1, 2]}
    assert stats["p90"] == pytest.approx(2.0)
    assert labels_per_chunk([], 3)["histogram"] == [0, 0, 0, 0]


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
    # a and b may describe neutral text (expository tones): compared with the chunks (z-score); c is calibrated
    # against the null: it applies only above what neutral text reaches, however it stands out among the chunks
    domain = AuxDomain("tone", "", [{"name": "a", "description": "", "expository": True},
                                    {"name": "b", "description": "", "expository": True},
                                    {"name": "c", "description": ""}], max_labels=2, min_labels=0, path=None)
    null = np.array([[0.5, 0.5, 0.35], [0.1, 0.1, 0.2]])
    thresholds = null_thresholds(null, domain, quantile=1.0, floor=0.2)
    assert thresholds.tolist() == pytest.approx([0.2, 0.2, 0.35])  # expository: the floor; c: the null's highest
    similarity = np.full((20, 3), 0.3) + np.where(np.arange(20)[:, None] % 2, 0.01, -0.01)  # z about +-1
    similarity[5, 1] = 0.6  # label b stands out for chunk 5 only
    labels = calibrated_labels(similarity, domain, min_z=2.0, thresholds=thresholds)
    assert [j for j, _ in labels[5]] == [1]
    # Nothing stands out for the other chunks: they get no label (their best is noise).
    assert all(row == [] for i, row in enumerate(labels) if i != 5)
    similarity[7] = [0.9, 0.8, 0.1]  # two labels stand out for chunk 7, the better first
    assert [j for j, _ in calibrated_labels(similarity, domain, 2.0, thresholds)[7]] == [0, 1]
    similarity[9, 2] = 0.34  # stands out among the chunks (z > 2) but not above the null: abstain
    assert calibrated_labels(similarity, domain, 2.0, thresholds)[9] == []
    similarity[:, 2] = 0.5  # above the null for every chunk: a label the whole corpus carries, z or not
    labels = calibrated_labels(similarity, domain, 2.0, thresholds)
    assert all([j for j, _ in row] == [2] for i, row in enumerate(labels) if i not in (5, 7))
    assert [j for j, _ in labels[7]] == [0, 1]  # at most max_labels, the best by z first
    assert null_thresholds(null, domain, 0.5, 0.2).tolist() == pytest.approx([0.2, 0.2, 0.275])
    # a chunk that reads like the null (a near copy of one of its texts) gets no null-checked label, only
    # expository ones
    like_null = np.zeros(20, dtype=bool)
    like_null[[0, 7]] = True
    labels = calibrated_labels(similarity, domain, 2.0, thresholds, like_null=like_null)
    assert labels[0] == [] and [j for j, _ in labels[7]] == [0, 1] and [j for j, _ in labels[1]] == [2]
    vectors = np.eye(3, dtype=np.float32)
    assert reads_like_null(vectors, vectors[[0]], 0.9).tolist() == [True, False, False]
    assert reads_like_null(vectors, np.zeros((0, 3), np.float32), 0.9).tolist() == [False] * 3
    with pytest.raises(ValueError, match="null of the auxiliary labels is empty"):
        null_thresholds(np.zeros((0, 3)), domain, 1.0, 0.2)


def test_aux_answers_can_abstain():
    tone, demographic = load_aux_domains(["tone", "demographic"])
    schema = answer_schema([tone, demographic])
    for name in ("tone", "demographic"):
        field = schema.schema["properties"][name]
        assert "none" in field["items"]["enum"] and field["minItems"] == 1  # abstaining is an answer
    assert chosen_labels(["none"]) == [] and chosen_labels(["women", "none"]) == []  # a contradiction: nothing
    assert chosen_labels(["women", "men"]) == ["women", "men"]
    assert "or \"none\"" in describe_lists([tone])
    # which labels stay off neutral text: every demographic label, and the tones that are not expository
    assert all(demographic.null_checked) and demographic.sensitive
    checked = dict(zip(tone.names, tone.null_checked))
    assert not checked["technical"] and not checked["neutral"] and checked["angry"] and checked["frustrated"]
    assert {"angry", "frustrated", "sarcastic", "hostile", "sad"} <= set(tone.sensitive_names)
    assert "technical" not in tone.sensitive_names and set(demographic.sensitive_names) == set(demographic.names)


def test_aux_lists_ship_and_bad_files_are_named(tmp_path):
    tone, demographic, alignment = load_aux_domains(["tone", "demographic", "alignment"])
    assert (len(tone.labels), len(demographic.labels), len(alignment.labels)) == (80, 38, 8)
    (tmp_path / "aux").mkdir()
    (tmp_path / "aux" / "tone.json").write_text(json.dumps({"labels": [{"name": "x", "description": ""}] * 2}))
    with pytest.raises(SchemaError, match=r"tone.json: duplicate label names \['x'\]"):
        load_aux_domains(["tone"], str(tmp_path))
    with pytest.raises(SchemaError, match="no candidate list for auxiliary domain 'mood'"):
        load_aux_domains(["mood"], str(tmp_path))
    (tmp_path / "aux" / "tone.json").write_text(json.dumps({"labels": [{"name": "none", "description": ""}]}))
    with pytest.raises(SchemaError, match="'none' is the answer that abstains"):
        load_aux_domains(["tone"], str(tmp_path))
    (tmp_path / "aux" / "tone.json").write_text(json.dumps({"labels": [{"name": "x", "description": "",
                                                                        "emotional": "yes"}]}))
    with pytest.raises(SchemaError, match=r"labels\[0\] \(x\): 'emotional' must be true or false"):
        load_aux_domains(["tone"], str(tmp_path))


def test_editing_an_auxiliary_list_makes_the_targets_stale(tmp_path):
    shutil.copytree(PROJECT_ROOT / "schemas", tmp_path / "schemas")
    schemas = {"schema_dir": str(tmp_path / "schemas")}
    config = load_config(write_config(tmp_path, tmp_path / "docs.jsonl", tag=schemas))
    before = TargetsStage(config).identity()
    tone = tmp_path / "schemas" / "aux" / "tone.json"
    tone.write_text(tone.read_text().replace('"name": "formal"', '"name": "official"'))
    assert TargetsStage(config).identity() != before  # the labels it gives come from these lists


def small_annotator(tmp_path, seed=0):
    torch.manual_seed(seed)
    heads = AnnotatorHeads(8, 5, {"tone": 3}, hidden=16, dropout=0.0)
    spec = AnnotatorSpec(encoder="all-MiniLM-L6-v2", dim=8, hidden=16, dropout=0.0,
                         domains={"content": {"offset": 0, "size": 5, "threshold": 0.5, "cap": 2,
                                              "calibration": {"method": "platt", "a": 0.5, "b": -1.0}},
                                  "tone": {"offset": 5, "size": 3, "threshold": 0.4, "cap": 1,
                                           "calibration": {"method": "platt", "a": 2.0, "b": 0.25}}})
    save_annotator(tmp_path, heads, spec)
    return heads, spec


def test_save_and_load_round_trip(tmp_path):
    heads, spec = small_annotator(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]  # nothing pickled
    loaded = Annotator(tmp_path)
    assert loaded.spec == spec
    z = torch.nn.functional.normalize(torch.randn(4, 8), dim=-1)
    probs = loaded.probabilities(z.numpy())  # the heads only: no encoder is loaded for this
    assert loaded.embedder is None
    heads.eval()
    with torch.no_grad():
        logits = heads(z)
    for domain in ("content", "tone"):  # calibrated: sigmoid(a * logit + b) with the stored (a, b)
        expected = calibrate(logits[domain].numpy(), spec.domains[domain]["calibration"])
        np.testing.assert_array_equal(probs[domain], expected)
        np.testing.assert_array_equal(loaded.logits(z.numpy())[domain], logits[domain].numpy())
        a, b = spec.domains[domain]["calibration"]["a"], spec.domains[domain]["calibration"]["b"]
        np.testing.assert_allclose(probs[domain], torch.sigmoid(a * logits[domain] + b).numpy(), rtol=1e-6)
    for row in loaded.decide(probs):  # global ids: tone labels come after the 5 content concepts
        assert len(row["content"]) <= 2 and all(0 <= g < 5 for g, _ in row["content"])
        assert len(row["tone"]) <= 1 and all(5 <= g < 8 for g, _ in row["tone"])


def test_an_annotator_without_calibration_is_refused(tmp_path):
    small_annotator(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    for v in config["domains"].values():  # what an annotator trained before calibration wrote
        del v["calibration"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ArtifactError, match=r"no calibration for domain\(s\) content, tone") as error:
        Annotator(tmp_path)
    assert RETRAIN in str(error.value) and str(tmp_path / "config.json") in str(error.value)
    config["domains"]["content"]["calibration"] = {"method": "platt", "a": -1.0, "b": 0.0}  # decreasing: refused
    config["domains"]["tone"]["calibration"] = {"method": "platt", "a": 1.0, "b": 0.0}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ArtifactError, match=r"no calibration for domain\(s\) content \("):
        Annotator(tmp_path)


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
