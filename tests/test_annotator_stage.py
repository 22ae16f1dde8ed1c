"""The targets and train_annotator stages end to end on a small offline run."""

import json
import shutil

import numpy as np
import pyarrow.parquet as pq
import pytest

from atlas.cli import main
from atlas.core.rundir import RunDir
from atlas.runner import run_stages

pytestmark = pytest.mark.slow  # loads the embedding model



def annotator_files(run: RunDir) -> dict:
    folder = run.output_dir("annotator")
    names = ("model.safetensors", "config.json", "metrics.json", "calibration.parquet", "heldout_predictions.parquet")
    return {"targets": run.part_path("targets", 0).read_bytes()} | {n: (folder / n).read_bytes() for n in names}


def test_targets_contract(trained):
    config, run = trained
    library = json.loads((run.output_dir("library") / "config.json").read_text())
    offsets, sizes = library["domain_offsets"], library["domain_sizes"]
    assert sorted(offsets, key=offsets.get) == ["content", "tone", "demographic", "alignment"]
    assert sizes["tone"] == 80 and offsets["tone"] == sizes["content"]
    rows = pq.read_table(run.part_path("targets", 0)).to_pylist()
    tagged = set(pq.read_table(run.output_dir("tags"), columns=["chunk_id"]).column(0).to_pylist())
    assert {r["chunk_id"] for r in rows} == tagged  # no reservoir_size: every tagged chunk
    split_of_doc = {}
    for r in rows:
        assert split_of_doc.setdefault(r["doc_id"], r["split"]) == r["split"]  # a document is never split
        for domain in offsets:
            ids = r[f"{domain}_global_ids"]
            assert all(offsets[domain] <= g < offsets[domain] + sizes[domain] for g in ids)
        assert r["concepts"] == sorted(g for d in offsets for g in r[f"{d}_global_ids"])
        assert r["aux_status"] == "offline"
    # Offline, a tone only where one stands out (min_labels is what an LLM is asked for): some chunks, not all.
    assert 0 < sum(bool(r["tone_global_ids"]) for r in rows) < len(rows)
    assert {"train", "heldout"} == {r["split"] for r in rows}


def test_annotator_artifacts_metrics_and_determinism(trained):
    config, run = trained
    first = annotator_files(run)
    metrics = json.loads(first["metrics.json"])
    content = metrics["domains"]["content"]
    assert set(metrics["domains"]) == {"content", "tone", "demographic", "alignment"}
    assert 0 <= content["recall_at"]["10"] <= 1 and 0 < content["pr_auc"] <= 1
    assert set(metrics["baselines"]) == {"knn_concept_embeddings", "knn_training_chunks"}
    assert len(metrics["history"]) == config.annotator.epochs and metrics["judge"]["is_proxy"]
    spec = json.loads(first["config.json"])
    assert spec["encoder"] == "all-MiniLM-L6-v2" and spec["domains"]["tone"]["offset"] > 0
    predictions = pq.read_table(run.output_dir("annotator") / "heldout_predictions.parquet").to_pylist()
    for p in predictions:
        assert len(p["concepts"]) == len(p["concept_scores"])
        content_ids = [g for g in p["concepts"] if g < spec["domains"]["tone"]["offset"]]
        assert len(content_ids) <= spec["domains"]["content"]["cap"]
    assert (run.root / "report" / "annotator_training.png").exists()

    run_stages(config, ["targets", "train_annotator"], force=True, log=lambda m: None)
    assert annotator_files(run) == first  # same seed, same bytes

    reseeded = config.model_copy(deep=True)
    reseeded.annotator.seed = 1
    reseeded.run_dir = str(run.root.parent / "run-seed1")
    shutil.copytree(run.root, reseeded.run_dir)
    run_stages(reseeded, ["targets", "train_annotator"], force=True, log=lambda m: None)
    other = annotator_files(RunDir(reseeded.run_dir))
    assert other["model.safetensors"] != first["model.safetensors"]


def test_annotator_is_calibrated_and_decides_per_chunk(trained):
    """Platt maps in config.json, cross-fitted ECE and the rule's labels per chunk in metrics.json, and a reloaded
    annotator's probabilities are those the stage computed."""
    from atlas.io import layout
    from atlas.io.chunks import read_chunks
    from atlas.models.annotator import Annotator
    from atlas.models.embedder import encode_cached

    config, run = trained
    folder = run.output_dir("annotator")
    metrics = json.loads((folder / "metrics.json").read_text())
    spec = json.loads((folder / "config.json").read_text())
    for d, m in metrics["domains"].items():
        stored, c = spec["domains"][d]["calibration"], m["calibration"]
        assert set(stored) == {"method", "a", "b"} and stored["method"] == "platt" and stored["a"] > 0
        assert (c["a"], c["b"]) == (stored["a"], stored["b"]) and c["pairs"] == metrics["heldout_chunks"] * m["labels"]
        assert 0 <= c["ece"] <= 1 and 0 <= c["ece_uncalibrated"] <= 1 and len(c["ece_halves"]) == 2
        assert c["ece"] == pytest.approx(np.mean(c["ece_halves"]))
        assert m["reliability"]["cross_fitted"] and m["reliability"]["ece"] == c["ece"]  # what the report shows
        assert sum(m["reliability"]["bin_pairs"]) == sum(c["reliability_uncalibrated"]["bin_pairs"]) == c["pairs"]
        counts = m["labels_per_chunk"]
        assert {"min", "median", "mean", "p90", "max", "share_at_cap", "share_zero", "histogram"} <= counts.keys()
        assert sum(counts["histogram"]) == metrics["heldout_chunks"] and counts["max"] <= spec["domains"][d]["cap"]
        assert counts["mean"] == pytest.approx(m.get("mean_predicted_per_chunk", counts["mean"]))
        assert m["median_predicted_score"] is None or spec["domains"][d]["threshold"] <= m["median_predicted_score"]
        if m["pr_auc"] is not None:  # an increasing map: the ranking metrics are those of the raw logits
            assert m["recall_at"] == m["ranking_uncalibrated"]["recall_at"]
            assert m["pr_auc"] == pytest.approx(m["ranking_uncalibrated"]["pr_auc"], abs=1e-6)
        rule = metrics["rules"][d]
        assert (rule["threshold"], rule["cap"]) == (spec["domains"][d]["threshold"], spec["domains"][d]["cap"])
        assert rule["cap"] == config.annotator.max_caps[d]  # the cap is a safety limit, not chosen
    assert metrics["rules"]["content"]["threshold_from"] == "max F1 of known positives (held-out)"
    assert metrics["rules"]["content"]["threshold"] == metrics["rules"]["content"]["best_f1"]["threshold"]
    for d in ("tone", "demographic", "alignment"):
        assert metrics["rules"][d]["threshold"] == config.annotator.aux_min_probability
    assert (run.root / "report" / "annotator_reliability.png").exists()

    # a reloaded annotator gives exactly the probabilities (and so the labels) of training
    targets = pq.read_table(run.part_path("targets", 0)).to_pydict()
    chunks = read_chunks(run, set(targets["chunk_id"]))
    annotator = Annotator(folder).setup()
    vectors, computed = encode_cached(annotator.embedder, [chunks[c]["chunk_text"] for c in targets["chunk_id"]],
                                      run.root / layout.CACHE / "embeddings", config.annotator.embed_batch_size)
    assert computed == 0  # the stage's own cached embeddings
    held = [i for i, split in enumerate(targets["split"]) if split == "heldout"]
    probs = annotator.probabilities(vectors.astype(np.float32)[held])
    predictions = pq.read_table(folder / "heldout_predictions.parquet").to_pylist()
    assert [p["chunk_id"] for p in predictions] == [targets["chunk_id"][i] for i in held]
    for p, row in zip(predictions, annotator.decide(probs)):
        assert p["concepts"] == [g for d in row for g, _ in row[d]]
        assert p["concept_scores"] == [s for d in row for _, s in row[d]]
    table = pq.read_table(folder / "calibration.parquet").to_pylist()
    for d in annotator.spec.domains:
        means = [r["mean_probability"] for r in table if r["domain"] == d]
        np.testing.assert_allclose(means, probs[d].mean(axis=0), rtol=1e-5, atol=1e-7)


def test_cli_annotate_inspect_and_probe(trained, capsys):
    _, run = trained
    capsys.readouterr()
    assert main(["annotate-text", str(run.root), "The sine of an angle is the ratio of two sides.", "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "content" in out and "tone" in out and out.count("(0.") >= 6
    assert main(["inspect", str(run.root), "annotator", "-n", "2", "--random", "1"]) == 0
    out = capsys.readouterr().out
    assert "inherited target" in out and out.count("    tags: ") == 2 and out.count("chunk_id=") == 2
    assert main(["inspect", str(run.root), "targets", "-n", "2"]) == 0
    assert "split=" in capsys.readouterr().out
    assert main(["eval", "annotator", str(run.root), "--label-field", "label"]) == 0
    probe = json.loads((run.root / "report" / "annotator_probe.json").read_text())
    for name in ("predicted_concept_probabilities", "predicted_concepts_multi_hot", "raw_embeddings"):
        assert 0 <= probe[name]["accuracy"] <= 1


def test_annotator_refuses_another_library(trained, tmp_path, capsys):
    _, run = trained
    copy = tmp_path / "run"
    shutil.copytree(run.root, copy)
    concepts = pq.read_table(copy / "library" / "concepts.parquet")
    pq.write_table(concepts.slice(1), copy / "library" / "concepts.parquet")  # a tampered library
    capsys.readouterr()
    assert main(["annotate-text", str(copy), "some text"]) == 1  # a clear error, not a traceback
    err = capsys.readouterr().err
    assert str(copy / "library" / "concepts.parquet") in err and "row 0: concept_id is 1 (expected 0)" in err


def test_finetune_mode_saves_its_encoder(trained, tmp_path, capsys):
    """End-to-end fine-tuning (one short epoch on CPU here; the GPU is where it belongs)."""
    config, run = trained
    tuned = config.model_copy(deep=True)
    tuned.annotator.mode, tuned.annotator.epochs, tuned.annotator.batch_size = "finetune", 1, 32
    tuned.annotator.reservoir_size = 80  # a few steps are enough to show the mechanics
    tuned.run_dir = str(tmp_path / "run")
    shutil.copytree(run.root, tuned.run_dir)
    run_stages(tuned, ["targets", "train_annotator"], force=True, log=lambda m: None)
    folder = RunDir(tuned.run_dir).output_dir("annotator")
    assert json.loads((folder / "config.json").read_text())["encoder"] == "encoder"
    assert (folder / "encoder" / "model.safetensors").exists() and not list(folder.rglob("*.bin"))
    assert main(["annotate-text", tuned.run_dir, "A function that returns the sum of two numbers."]) == 0
    assert "content" in capsys.readouterr().out


@pytest.mark.parametrize("mode, fault_rate, all_ok", [("mixed", 0.3, True), ("invalid_json", 1.0, False)])
def test_llm_auxiliary_labels_under_faults(trained, tmp_path, mode, fault_rate, all_ok):
    """30% faulty answers are retried until every chunk has labels; a server that never answers well
    leaves every chunk's content targets in place, with its auxiliary status saying why."""
    from fault_server import FaultServer
    from test_tag_stage import openai_sections

    config, run = trained
    copy = tmp_path / "run"
    shutil.copytree(run.root, copy)
    with FaultServer(mode=mode, fault_rate=fault_rate, seed=3) as server:
        sections = openai_sections(server, tag={"max_attempts": 4})
        llm = config.model_copy(deep=True)
        llm.run_dir = str(copy)
        llm.llm = llm.llm.model_copy(update=sections["llm"])
        llm.tag = llm.tag.model_copy(update=sections["tag"])
        run_stages(llm, ["targets"], force=True, log=lambda m: None)
    before = pq.read_table(run.part_path("targets", 0)).to_pylist()
    after = pq.read_table(RunDir(copy).part_path("targets", 0)).to_pylist()
    assert [r["chunk_id"] for r in after] == [r["chunk_id"] for r in before]  # every chunk accounted for
    assert [r["content_global_ids"] for r in after] == [r["content_global_ids"] for r in before]
    if all_ok:
        # every chunk answered; an answer may abstain ("none"): no tone then, but not for all
        assert all(r["aux_status"] == "ok" for r in after) and any(r["tone_global_ids"] for r in after)
    else:
        assert all(r["aux_status"] == "failed:invalid_json" and not r["tone_global_ids"] for r in after)


def test_auxiliary_labels_stay_off_the_null(trained):
    """Every label but the expository tones has its own threshold, just above what the null's neutral texts reach:
    the trained annotator gives none of those labels to a null text, in the targets or in its decisions."""
    from atlas.io.neutral_text import neutral_texts
    from atlas.models.annotator import Annotator
    from atlas.models.auxiliary import configured_domains

    config, run = trained
    spec = json.loads((run.output_dir("annotator") / "config.json").read_text())
    annotator = Annotator(run.output_dir("annotator")).setup()
    null = list(neutral_texts())[::10]
    decided = annotator.annotate(null)
    for domain in configured_domains(config):
        thresholds = spec["domains"][domain.name]["label_thresholds"]
        assert len(thresholds) == len(domain.labels)
        assert all((t > 0) == checked for t, checked in zip(thresholds, domain.null_checked))
        offset = spec["domains"][domain.name]["offset"]
        given = [domain.names[g - offset] for row in decided for g, _ in row[domain.name]]
        assert not [name for name in given if domain.null_checked[domain.names.index(name)]]
    counters = run.read_manifest()["stages"]["targets"]["counters"]
    assert counters["null_texts"] == len(neutral_texts()) and "aux_like_null" in counters


def test_the_null_is_neutral_text_the_demo_does_not_hold(demo_records):
    from atlas.io.neutral_text import NULL_MODULES, neutral_texts, pieces
    from atlas.tools.demo_corpus import MATH_MODULES, STDLIB_MODULES

    texts = neutral_texts()
    assert len(texts) > 500 and len(set(texts)) == len(texts) and texts == neutral_texts()
    assert not set(NULL_MODULES) & (set(STDLIB_MODULES) | set(MATH_MODULES))  # the demo stays text the null never saw
    demo = {r["text"] for r in demo_records}
    assert not any(piece in text for piece in texts[::25] for text in demo)
    assert any("WARRANTY" in t for t in texts) and max(len(t.split()) for t in texts) < 400
    first, second, long = "one paragraph of docs " * 3, "and another paragraph " * 3, "word " * 200
    assert pieces(f"{first}\n\n{second}\n\n{long}\n\nshort", words=30) == [
        f"{first.strip()}\n\n{second.strip()}", long.strip()]  # packed up to the size; a long paragraph stays whole


def test_a_chunk_that_reads_like_the_null_gets_no_null_checked_label(trained):
    """The annotator saves the null as its encoder sees it; a chunk at null_nearest or more from a null text gets
    no null-checked label (as the targets stage), an expository tone still may."""
    from atlas.io.neutral_text import neutral_texts
    from atlas.models.annotator import NULL_FILE, Annotator, withhold_like_null

    config, run = trained
    folder = run.output_dir("annotator")
    annotator = Annotator(folder).setup()
    null = np.load(folder / NULL_FILE)
    assert null.shape == (len(neutral_texts()), annotator.spec.dim)
    assert annotator.spec.null_nearest == config.annotator.aux_null_nearest
    texts = list(neutral_texts())[:3]
    assert annotator.reads_like_null(annotator.embedder.encode(texts)).all()  # a null text is its own neighbour
    tone = annotator.spec.domains["tone"]
    probs = np.ones((2, tone["size"]), np.float32)
    kept = withhold_like_null(probs, tone, np.array([True, False]))
    checked = np.array(tone["label_thresholds"]) > 0
    assert (kept[0][checked] == 0).all() and (kept[0][~checked] == 1).all() and (kept[1] == 1).all()
