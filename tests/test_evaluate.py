"""atlas.tools.evaluate: the per-source, document-level table (synthetic arrays) and both evals on a trained run."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from scipy import sparse
from sklearn.metrics import homogeneity_score

from atlas.cli import main
from atlas.tools.evaluate import (
    KMEANS_SEEDS,
    _probes,
    _ratio_interval,
    _reassign,
    _weighted_homogeneity,
    format_per_source,
    per_source_table,
)


def synthetic(n_docs=120, n_labels=4, dim=16, source="news", seed=0, chunks_per_doc=(1, 4), separated=False):
    """Chunks of ``n_docs`` documents with labels 0..n_labels-1 in turn; embeddings are noise, or (``separated``)
    tight clusters around one direction per label."""
    rng = np.random.default_rng(seed)
    doc_ids, labels = [], []
    for d in range(n_docs):
        for _ in range(rng.integers(*chunks_per_doc)):
            doc_ids.append(f"{source}:{d:04d}")
            labels.append(f"label-{d % n_labels}")
    embeddings = rng.normal(size=(len(doc_ids), dim)).astype(np.float32)
    if separated:
        centers = np.eye(dim, dtype=np.float32)[:n_labels] * 10
        embeddings = 0.1 * embeddings + centers[[int(label.split("-")[1]) for label in labels]]
    return doc_ids, embeddings, labels, [source] * len(doc_ids)


def one_hot(labels, n_concepts):
    concepts = np.zeros((len(labels), n_concepts), dtype=np.float32)
    concepts[np.arange(len(labels)), [int(label.split("-")[1]) for label in labels]] = 1
    return concepts


def test_concepts_equal_to_the_labels_are_perfectly_homogeneous():
    doc_ids, embeddings, labels, sources = synthetic()
    result = per_source_table(doc_ids, embeddings, one_hot(labels, 10), labels, sources)
    e = result["per_source"]["news"]
    assert result["documents"] == 120 and e["docs"] == e["docs_evaluated"] == 120 and e["labels"] == 4
    assert e["top_concept"]["homogeneity"] == pytest.approx(1.0) and e["top_concept"]["nmi"] == pytest.approx(1.0)
    assert e["top_concept"]["purity"] == 1.0 and e["top_concept"]["groups"] == 4
    assert e["top_concept"]["ami"] == pytest.approx(1.0) and e["top_concept"]["homogeneity_shuffled"] < 0.2
    assert e["probe"]["concept_accuracy"] == 1.0 and e["probe"]["ratio"] >= 1
    assert e["majority_baseline"] == pytest.approx(0.25) and e["probe"]["folds"] == 5
    assert e["kmeans"]["k"] == 4 and e["kmeans"]["homogeneity"] < 0.5  # noise embeddings: k-means finds no labels
    seeds = e["kmeans"]["homogeneity_seeds"]  # the baseline is their mean; their spread, the noise of a gap
    assert len(seeds) == KMEANS_SEEDS and np.mean(seeds) == pytest.approx(e["kmeans"]["homogeneity"])
    assert e["kmeans"]["homogeneity_sd"] == pytest.approx(np.std(seeds)) and max(seeds) < 0.5
    assert e["homogeneity_ratio"] > 1
    overall = result["overall"]
    assert overall["sources_evaluated"] == ["news"] and overall["all_sources_at_least_baseline"] is True
    assert overall["concept_homogeneity_mean"] == pytest.approx(1.0) and overall["probe_ratio_mean"] >= 1


def test_annotator_probabilities_top_concept_is_the_most_over_represented():
    """A broad concept (0.6 on every chunk) loses the top to the document's own concept (0.3 where it applies,
    0.01 elsewhere): lift, not the raw probability, picks the top; the probe reads the mean log-odds."""
    doc_ids, embeddings, labels, sources = synthetic()
    own = one_hot(labels, 4)
    probabilities = np.column_stack([0.01 + 0.29 * own, np.full(len(labels), 0.6, dtype=np.float32)])
    e = per_source_table(doc_ids, embeddings, probabilities, labels, sources,
                         concept_vector="probabilities")["per_source"]["news"]
    assert e["top_concept"]["groups"] == 4 and e["top_concept"]["homogeneity"] == pytest.approx(1.0)
    assert e["probe"]["concept_accuracy"] == 1.0 and e["probe"]["concept_probabilities_accuracy"] == 1.0
    mean = per_source_table(doc_ids, embeddings, probabilities, labels, sources)["per_source"]["news"]
    assert mean["top_concept"]["groups"] == 1  # by the raw mean, the broad concept tops every document


def test_annotator_top_concept_is_distinctive_and_representative():
    """A rare concept firing at random (0.9 on a quarter of the documents) has the largest lift there, so the lift
    alone makes it those documents' top concept, across labels. Its centroid is the mean of every label's
    embeddings, far from each document, so the representative choice among the top candidates keeps the
    document's own concept: homogeneity 1, where the lift alone mixes labels."""
    doc_ids, embeddings, labels, sources = synthetic(separated=True, chunks_per_doc=(1, 2))
    own = one_hot(labels, 4)
    fires = (np.arange(len(labels)) % 4 == np.arange(len(labels)) // 4 % 4)[:, None]  # every label, in turn
    rare = np.where(fires, 0.9, 0.001).astype(np.float32)
    probabilities = np.column_stack([0.01 + 0.29 * own, rare])
    counts = np.column_stack([own, np.arange(len(labels)) % 9 == 0]).astype(np.float32)  # the library's: rarer
    for vector, scores in (("probabilities", probabilities), ("share", counts)):
        e = per_source_table(doc_ids, embeddings, scores, labels, sources, concept_vector=vector)["per_source"]["news"]
        assert e["top_concept_by_lift"]["groups"] == 5 and e["top_concept_by_lift"]["homogeneity"] < 0.95, vector
        assert e["top_concept"]["groups"] == 4 and e["top_concept"]["homogeneity"] == pytest.approx(1.0), vector


def test_top_concepts_are_reassigned_to_the_concept_whose_documents_they_resemble():
    """Documents a1..a3 lie along one axis, b1..b3 along another. The first pass gave every one but a1 and b1 the
    broad concept 0, mixing the axes; a1 has only concept 1, b1 only concept 2. Each a may also take 1, each b 2:
    compared with the documents each concept heads, the a's join a1, and every concept heads one axis."""
    rng = np.random.default_rng(0)
    axes = np.eye(8)[[0] * 3 + [1] * 3] + 0.1 * rng.normal(size=(6, 8))
    documents = axes / np.linalg.norm(axes, axis=1, keepdims=True)
    candidates = np.array([[1, 0], [0, 1], [0, 1], [2, 0], [0, 2], [0, 2]])
    allowed = np.array([[True, False], [True, True], [True, True], [True, False], [True, True], [True, True]])
    first = np.array([1, 0, 0, 2, 0, 0])
    top = _reassign(documents, candidates, allowed, first, 3, "test")
    assert top[:3].tolist() == [1, 1, 1] and set(top[3:]) <= {0, 2} and top[3] == 2  # b2, b3: with b1 or together
    assert first.tolist() == [1, 0, 0, 2, 0, 0]  # the input is left as it was
    alone = allowed & (np.arange(2) == 0)  # one allowed candidate each: no choice, nothing moves
    assert _reassign(documents, candidates, alone, first, 3, "test").tolist() == first.tolist()


def test_the_control_shuffles_the_concepts_among_the_documents():
    """Concepts equal to the labels, and rare ones at random: the top concepts are the labels (homogeneity 1); the
    same rule on the concepts shuffled among the documents groups them by chance, far below k-means on the same
    embeddings."""
    doc_ids, embeddings, labels, sources = synthetic(n_docs=200, separated=True, chunks_per_doc=(1, 3))
    counts = np.column_stack([one_hot(labels, 4), np.random.default_rng(2).random((len(labels), 200)) < 0.01])
    e = per_source_table(doc_ids, embeddings, counts.astype(np.float32), labels, sources,
                         concept_vector="share")["per_source"]["news"]
    assert e["top_concept"]["homogeneity"] == pytest.approx(1.0) and e["homogeneity_ratio"] >= 1
    control = e["shuffled_concepts"]
    assert control["homogeneity"] < 0.5 and control["homogeneity_ratio"] < 0.6 and control["ami"] < 0.3
    assert control["k"] >= 2 and control["kmeans_homogeneity"] > 0.9  # k-means finds the labels at that k
    assert e["top_concept_first_pass"]["k"] >= 1 and e["top_concept_by_lift"]["k"] >= 1


def test_a_concept_only_one_document_has_is_not_its_top_concept():
    """Each document has its label's concept and a concept of its own (the rarer: the larger lift). The own
    concept's centroid is the document itself, nearest of all; left out of it, the concept has no other chunks and
    comes last, so the label's concept is the top: 4 groups, not one per document."""
    doc_ids, embeddings, labels, sources = synthetic(separated=True)
    docs, doc_of_chunk = np.unique(doc_ids, return_inverse=True)
    alone = np.eye(len(docs), dtype=np.float32)[doc_of_chunk]  # [n_chunks, n_docs]: each document's own concept
    counts = np.column_stack([one_hot(labels, 4), alone])
    e = per_source_table(doc_ids, embeddings, counts, labels, sources, concept_vector="share")["per_source"]["news"]
    assert e["top_concept_by_lift"]["groups"] == len(docs)
    assert e["top_concept"]["groups"] == e["kmeans"]["k"] == 4 and e["top_concept"]["homogeneity"] == pytest.approx(1)


def test_noise_concepts_probe_worse_than_informative_embeddings():
    doc_ids, embeddings, labels, sources = synthetic(separated=True)
    noise = np.random.default_rng(1).random((len(doc_ids), 50)).astype(np.float32)
    result = per_source_table(doc_ids, embeddings, noise, labels, sources)
    e = result["per_source"]["news"]
    assert e["probe"]["raw_accuracy"] == 1.0 and e["probe"]["concept_accuracy"] < 0.6 and e["probe"]["ratio"] < 0.6
    assert e["kmeans"]["homogeneity"] > e["top_concept"]["homogeneity"]  # the clusters are the labels; noise isn't
    assert e["kmeans"]["ami"] > 0.3 and abs(e["top_concept"]["ami"]) < 0.1  # k ~ 50 groups: AMI stays below 1
    overall = result["overall"]
    assert overall["all_sources_at_least_baseline"] is False and overall["all_sources_at_least_baseline_ami"] is False


def test_probe_reads_a_label_concept_among_rare_ones():
    """A share vector: the label's concept (0.2) beside 4 of 400 rare concepts (0.2 each). The probe (unit rows,
    C chosen by inner cross-validation) reads the label perfectly, whatever the rows' scale; a fixed C=1 on
    standardized columns read 0.79 here, as each rare concept standardizes to a huge value."""
    rng = np.random.default_rng(0)
    n, n_labels, rare = 120, 4, 400
    truth = np.array([f"label-{i % n_labels}" for i in range(n)])
    shares = np.zeros((n, n_labels + rare), dtype=np.float32)
    shares[np.arange(n), np.arange(n) % n_labels] = 0.2
    for i in range(n):
        shares[i, n_labels + rng.choice(rare, 4, replace=False)] = 0.2
    probe = _probes(truth, {"concept": shares, "raw": 100 * shares}, folds=5, seed=0)
    assert probe["concept_accuracy"] == probe["raw_accuracy"] == 1.0
    # a rare label (2 documents) does not cut the probe to 2 folds trained on half the documents
    rare_label = np.concatenate([truth, ["rare", "rare"]])
    rare_shares = np.vstack([shares, np.eye(2, shares.shape[1], k=n_labels, dtype=np.float32)])
    assert _probes(rare_label, {"concept": rare_shares, "raw": rare_shares}, folds=5, seed=0)["folds"] == 5


def test_tag_shares_probe_beside_the_concepts():
    """The library eval also probes the documents' own tags: tags that name the label (one per label, among noise
    tags every document has) read it perfectly, while noise concepts do not; the table prints that line."""
    doc_ids, embeddings, labels, sources = synthetic(separated=True)
    label_tag = sparse.csr_matrix(one_hot(labels, 4))
    tags = sparse.hstack([label_tag, sparse.csr_matrix(np.ones((len(labels), 3), dtype=np.float32))]).tocsr()
    noise = np.random.default_rng(1).random((len(doc_ids), 50)).astype(np.float32)
    summary = per_source_table(doc_ids, embeddings, noise, labels, sources, concept_vector="share", tags=lambda: tags)
    probe = summary["per_source"]["news"]["probe"]
    assert probe["tags_accuracy"] == 1.0 and probe["tags_dim"] == 7 and probe["concept_accuracy"] < 0.6
    line = format_per_source(summary)[-1]
    assert line.startswith("the same probe on the documents' own tags") and "news 1.000 (1.00 of raw)" in line
    assert "tags_accuracy" not in per_source_table(doc_ids, embeddings, noise, labels, sources)["per_source"]["news"][
        "probe"]


def test_weighted_homogeneity_is_scikit_learns_on_the_resampled_documents():
    rng = np.random.default_rng(3)
    truth = rng.integers(0, 4, 300)
    groups = np.where(rng.random(300) < 0.6, truth * 10 + rng.integers(0, 3, 300), rng.integers(0, 80, 300))
    weights = rng.multinomial(300, np.full(300, 1 / 300), size=4).astype(np.float64)
    got = _weighted_homogeneity(truth, groups, np.vstack([np.ones(300), weights]))
    resampled = [np.repeat(np.arange(300), w.astype(int)) for w in weights]
    expected = [homogeneity_score(truth, groups)] + [homogeneity_score(truth[i], groups[i]) for i in resampled]
    assert got == pytest.approx(expected, abs=1e-12)


def test_ratio_interval_holds_1_for_a_tie_and_not_for_a_clear_gap():
    rng = np.random.default_rng(4)
    truth = rng.integers(0, 4, 400)
    noisy = [np.where(rng.random(400) < 0.5, truth, rng.integers(0, 4, 400)) * 5 + rng.integers(0, 5, 400)
             for _ in range(6)]

    def interval(ours):
        measured = homogeneity_score(truth, ours) / np.mean([homogeneity_score(truth, b) for b in noisy[1:]])
        return measured, _ratio_interval(truth, ours, noisy[1:], measured, seed=0)

    measured, tie = interval(noisy[0])
    assert tie["low"] < 1 < tie["high"] and tie["draws"] == 1000
    assert (tie["low"] + tie["high"]) / 2 == pytest.approx(measured)  # centred on the measured ratio
    assert tie["high"] - tie["low"] == pytest.approx(2 * 1.959964 * tie["sd"], rel=1e-5) and 0 < tie["sd"] < 0.1
    _, better = interval(truth * 5 + rng.integers(0, 5, 400))
    assert better["low"] > 1
    _, worse = interval(rng.integers(0, 20, 400))
    assert worse["high"] < 1


def test_kmeans_has_as_many_clusters_as_distinct_top_concepts():
    doc_ids, embeddings, labels, sources = synthetic(n_docs=60, chunks_per_doc=(1, 2))  # one chunk per document
    docs = sorted(set(doc_ids))
    concepts = np.zeros((len(doc_ids), 20), dtype=np.float32)
    for row, doc in enumerate(doc_ids):
        concepts[row, docs.index(doc) % 7 + 3] = 1  # top concepts 3..9: 7 distinct
    e = per_source_table(doc_ids, embeddings, concepts, labels, sources)["per_source"]["news"]
    assert e["top_concept"]["groups"] == e["kmeans"]["k"] == 7


def test_concept_sums_ties_and_documents_without_concepts():
    # a: chunks with concepts {5, 2} and {5} -> top 5; b: {4, 1}, a tie -> 1 (the smaller id); c: none -> no top
    # concept (its own group); d..g: 0; h: 1. Tie to 1: 4 distinct tops (5, 1, none, 0); to 4 it would be 5.
    doc_ids = ["a", "a", "b", "c", "d", "e", "f", "g", "h"]
    labels = ["x", "x", "y", "y", "x", "y", "x", "y", "x"]
    rows, cols = [0, 0, 1, 2, 2, 4, 5, 6, 7, 8], [5, 2, 5, 4, 1, 0, 0, 0, 0, 1]
    concepts = sparse.csr_matrix((np.ones(len(rows), dtype=np.float32), (rows, cols)), shape=(9, 6))
    embeddings = np.random.default_rng(0).normal(size=(9, 8))
    e = per_source_table(doc_ids, embeddings, concepts, labels, ["s"] * 9, concept_vector="mean")["per_source"]["s"]
    assert e["top_concept"]["groups"] == e["kmeans"]["k"] == 4 and e["top_concept"]["docs_without_concepts"] == 1
    assert e["probe"]["concept_dim"] == 5  # concepts 0, 1, 2, 4, 5: the columns some document has
    assert e["probe"]["folds"] == 4 and e["docs_evaluated"] == 8 and e["chunks"] == 9


def test_sources_without_enough_labels_are_skipped_with_the_reason():
    doc_ids, embeddings, labels, sources = synthetic(n_docs=40)
    n = len(doc_ids)
    extra = {"gsm8k": ([f"g:{i}" for i in range(6)], [None] * 6),
             "single": ([f"s:{i}" for i in range(6)], ["only"] * 6),
             "unique": ([f"u:{i}" for i in range(6)], [f"u{i}" for i in range(6)]),
             "mixed": ([f"m:{i}" for i in range(7)], ["p", "p", "p", "q", "q", "rare", None])}
    for source, (ids, values) in extra.items():
        doc_ids, labels, sources = doc_ids + ids, labels + values, sources + [source] * len(ids)
    embeddings = np.random.default_rng(0).normal(size=(len(doc_ids), 16))
    concepts = np.random.default_rng(1).random((len(doc_ids), 8))
    table = per_source_table(doc_ids, embeddings, concepts, labels, sources)["per_source"]
    assert table["gsm8k"] == {"docs": 6, "docs_with_label": 0, "skipped": "no document has a label"}
    assert table["single"]["skipped"] == "only 1 distinct label among its 6 labelled documents"
    assert table["unique"]["skipped"].startswith("0 label(s) with at least 2 documents (6 of 6 labels have a single")
    mixed = table["mixed"]
    assert "skipped" not in mixed and mixed["labels"] == 2 and mixed["labels_dropped"] == 1
    assert mixed["docs"] == 7 and mixed["docs_with_label"] == 6 and mixed["docs_dropped"] == 1
    # 3 folds: as many as the largest label ("p") has documents; "q" (2) is in two of the test folds
    assert mixed["docs_evaluated"] == 5 and mixed["probe"]["folds"] == 3
    assert table["news"]["docs_evaluated"] == 40

    calls = []

    def never():
        calls.append(1)
        raise AssertionError("no source to evaluate: embeddings are not needed")

    result = per_source_table(doc_ids[n:], never, never, [None] * (len(doc_ids) - n), sources[n:])
    overall = result["overall"]
    assert not calls and overall["sources_evaluated"] == [] and len(overall["sources_skipped"]) == 4
    assert overall["all_sources_at_least_baseline"] is False and overall["concept_homogeneity_mean"] is None


def test_table_lines_have_one_row_per_source_and_no_braces():
    doc_ids, embeddings, labels, sources = synthetic()
    doc_ids, labels, sources = doc_ids + ["g:1"], labels + [None], sources + ["gsm8k"]
    embeddings = np.vstack([embeddings, np.ones((1, embeddings.shape[1]), dtype=np.float32)])
    result = per_source_table(doc_ids, embeddings, one_hot(labels[:-1] + ["label-0"], 4), labels, sources)
    lines = format_per_source({"label_field": "label", "embeddings": "test"} | result)
    text = "\n".join(lines)
    assert "{" not in text and "}" not in text
    assert any(line.startswith("news ") and " 120 " in line for line in lines)
    assert any(line.startswith("gsm8k ") and "skipped: no document has a label" in line for line in lines)
    assert lines[-1].startswith("overall (1 sources): homogeneity concept 1.000 vs k-means")
    assert lines[-1].endswith("below it beyond the sample's noise (interval under 1): none")
    interval = result["per_source"]["news"]["homogeneity_ratio_interval"]
    assert interval["low"] > 1 and f"{interval['low']:.2f}-{interval['high']:.2f}" in text
    unlabelled = per_source_table(doc_ids, embeddings, embeddings, [None] * len(doc_ids), sources)
    assert format_per_source(unlabelled) == []  # the "no label" message says it all


def test_arrays_must_align():
    with pytest.raises(ValueError, match="must align"):
        per_source_table(["a", "b"], np.zeros((2, 2)), np.zeros((2, 2)), ["x"], ["s", "s"])


# --- both evals on the small trained run of conftest (slow: it loads the embedding model) ----------------------------

@pytest.mark.slow
def test_evals_report_per_source_on_a_trained_run(run_copy, capsys):
    """The trained run's documents are labelled by their source; merged into one source, that source has three
    labels, and both evals report it; with a field no chunk has, every source is skipped."""
    root = run_copy
    for part in sorted((root / "chunks").glob("part-*.parquet")):
        table = pq.read_table(part)
        i = table.schema.get_field_index("data_src")
        table = table.set_column(i, table.schema.field(i), pa.array(["merged"] * len(table), pa.string()))
        pq.write_table(table, part)

    capsys.readouterr()
    assert main(["eval", "library", str(root), "--sample", "3"]) == 0
    out = capsys.readouterr().out
    summary = json.loads((root / "report" / "library_eval.json").read_text())
    e = summary["per_source"]["merged"]
    assert e["labels"] == 3 and e["docs_evaluated"] == 30 and e["kmeans"]["k"] == e["top_concept"]["groups"] >= 1
    for part in ("top_concept", "kmeans"):
        assert 0 <= e[part]["homogeneity"] <= 1 and 0 <= e[part]["nmi"] <= 1 and 0 < e[part]["purity"] <= 1
    assert 0 <= e["probe"]["concept_accuracy"] <= 1 and 0 < e["probe"]["raw_accuracy"] <= 1
    assert summary["overall"]["sources_evaluated"] == ["merged"] and summary["chunks_with_concepts"] >= 0
    assert out.index("merged ") < out.index("{") and '"per_source"' not in out[out.index("{"):]
    assert "source 1 of 1 evaluated: merged (30 documents, probes and k-means at k = " in out  # progress, as it goes

    assert main(["eval", "annotator", str(root), "--label-field", "label"]) == 0
    probe = json.loads((root / "report" / "annotator_probe.json").read_text())
    e = probe["per_source"]["merged"]
    assert e["labels"] == 3 and e["docs_evaluated"] == 30 and e["kmeans"]["k"] == e["top_concept"]["groups"]
    assert 0 <= e["top_concept"]["homogeneity"] <= 1 and 0 <= e["kmeans"]["homogeneity"] <= 1
    assert 0 <= probe["raw_embeddings"]["accuracy"] <= 1 and probe["embeddings"].startswith("encoded with ")

    capsys.readouterr()
    assert main(["eval", "annotator", str(root), "--label-field", "topic"]) == 0
    out = capsys.readouterr().out
    probe = json.loads(out[out.index("{"):out.rindex("}") + 1])  # no table before it: nothing to show
    assert probe["label_metrics"].startswith("not computed: no chunk has a 'topic' metadata field")
    assert probe["per_source"]["merged"]["skipped"] == "no document has a label" and "no label metrics: " in out
