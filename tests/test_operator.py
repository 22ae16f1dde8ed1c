"""Operator experience (issue 18, item 3): progress inside long shards, `atlas estimate` saying what it measures,
defined judge figures, `atlas eval` without labels, the report's explanations and readable plots."""

from __future__ import annotations

import json

import numpy as np
from conftest import write_config, write_jsonl

from atlas.cli import main


def test_targets_shows_progress_inside_its_one_shard(run_copy, capsys):
    """targets is a global stage (one shard: the runner's bar sits at 0/1 until the end); its slow loop, embedding
    the reservoir, has a bar of its own."""
    from atlas.config import config_from_dict
    from atlas.core.rundir import RunDir
    from atlas.stages import STAGES

    config = config_from_dict(json.loads((run_copy / "manifest.json").read_text())["config"])
    config.execution.progress = True
    stage = STAGES["targets"](config)
    stage.setup()
    try:
        stats = stage.run_shard(RunDir(run_copy), 0)
        err = capsys.readouterr().err
        reservoir = stats.to_dict()["reservoir"]
        assert "targets: embed reservoir" in err and f"{reservoir}/{reservoir}" in err
        config.execution.progress = False  # and none with progress off (tests, --no-progress)
        stage.run_shard(RunDir(run_copy), 0)
        assert "embed reservoir" not in capsys.readouterr().err
    finally:
        stage.teardown()


def test_estimate_says_what_it_measures_as_it_goes(tmp_path, demo_records, capsys):
    config_path = write_config(tmp_path, write_jsonl(tmp_path / "docs.jsonl", demo_records[:3]))
    assert main(["estimate", str(config_path), "--sample-docs", "3"]) == 0
    lines = capsys.readouterr().out.splitlines()
    said = [line for line in lines if line.startswith(("measuring", "  "))]
    assert [s.split(" on ")[0] for s in said[0::2]] == ["measuring chunk", "measuring tag (offline)",
                                                          "measuring annotate", "measuring tokenize"]
    assert said[1].startswith("  chunk: 3 docs in ") and said[3].startswith("  tag (offline): ")
    assert said[5].startswith("  annotate (encoder only: no trained annotator yet): ") and "/s" in said[7]
    table = next(i for i, line in enumerate(lines) if line.startswith("stage "))
    assert lines.index(said[-1]) < table  # each measurement as it ends, then the table
    paths = [line for line in lines if " path (" in line]
    assert [line.split(" path (")[0] for line in paths] == ["library sample", "corpus"]
    assert all("hours with" in line for line in paths)


def test_estimate_projects_tagging_on_the_library_sample_only():
    from atlas.config import AtlasConfig
    from atlas.tools.estimate import library_share

    config = AtlasConfig.model_validate({"tag": {"sample_fraction": 0.25, "sample_max_docs": 1000}})
    assert library_share(config, 2000) == 0.25 and library_share(config, 100_000) == 0.01
    config.annotate.annotator_from = "/elsewhere"
    assert library_share(config, 2000) == 0.0


def test_judge_defines_success_rate_where_it_prints_it(run_copy, capsys):
    assert main(["judge", str(run_copy), "--sample", "3"]) == 0
    out = capsys.readouterr().out
    summary = json.loads(out[out.index("{"):out.rindex("}") + 1])
    assert summary["success_rate_is"].startswith("share of the judged (tag, chunk) pairs scored >= 2 on the 1-5 scale")
    assert list(summary).index("success_rate_is") == list(summary).index("success_rate") + 1  # right beside it
    assert (f"success_rate {summary['success_rate']:.3f} over {summary['pairs']:,} pairs: share of the judged (tag, "
            "chunk) pairs scored >= 2") in out
    written = json.loads((run_copy / "report" / "tag_relevance.json").read_text())
    assert written["success_rate_is"] == summary["success_rate_is"]


def test_eval_library_says_when_it_found_no_labels(run_copy, capsys):
    assert main(["eval", "library", str(run_copy), "--label-field", "topic", "--sample", "3"]) == 0
    out = capsys.readouterr().out
    summary = json.loads(out[out.index("{"):out.rindex("}") + 1])
    assert not {"purity", "nmi", "labels", "chunks_with_label", "concepts_per_label_mean"} & set(summary)  # no 0s
    assert summary["label_metrics"].startswith("not computed: no chunk has a 'topic' metadata field (fields found: "
                                               "'label' (")
    assert "no label metrics: no chunk has a 'topic' metadata field" in out and "pass --label-field FIELD" in out
    assert main(["eval", "library", str(run_copy), "--sample", "3"]) == 0  # the trained run's documents have labels
    summary = json.loads((run_copy / "report" / "library_eval.json").read_text())
    assert "label_metrics" not in summary and summary["chunks_with_label"] > 0 and 0 < summary["purity"] <= 1


# --- the report ------------------------------------------------------------------------------------------------------

def _report_text(root) -> str:
    from html.parser import HTMLParser

    class Text(HTMLParser):
        parts: list[str] = []

        def handle_data(self, data):
            self.parts.append(data)

    assert main(["report", str(root)]) == 0
    parser = Text()
    parser.parts = []
    parser.feed((root / "report" / "index.html").read_text())
    return " ".join("".join(parser.parts).split())


def test_report_says_which_validation_loss_is_which(run_copy, capsys):
    model = run_copy / "cblm" / "cblm"
    (model / "checkpoint").mkdir(parents=True)
    config = {"eval_every": 100, "eval_batches": 8, "batch_size": 8, "val_fraction": 0.1}
    (model / "checkpoint" / "state.json").write_text(json.dumps({"step": 300, "train_config": config}))
    (model / "metrics.json").write_text(json.dumps({"val_loss": 7.019, "val_tokens": 20992, "step": 300}))
    write_jsonl(model / "log.jsonl", [{"step": s, "train": {"lm": 7.5 - s / 300}, "val": {"val_loss": 7.2 - s / 400,
                                                                                       "val_tokens": 8192}}
                                      for s in (100, 200, 300)])
    text = _report_text(run_copy)
    assert ("val_loss in the table (7.019, on 20,992 tokens) is metrics.json: the final evaluation at the end of "
            "training, the same as atlas cblm eval, on every held-out window") in text
    assert ("val loss in the plot (last point 6.45 at step 300, on 8,192 tokens) is log.jsonl: the estimate taken "
            "every 100 steps on the first 8 batches of 8 held-out windows only") in text
    assert "At step 300 both score the same weights: they differ only by the windows they score." in text
    assert "the last 10% of each token shard's windows" in text
    assert "cblm: loss (log.jsonl); the star: metrics.json" in text


def test_report_explains_the_annotator_curves(run_copy, capsys):
    metrics = json.loads((run_copy / "annotator" / "metrics.json").read_text())
    first, last = metrics["history"][0], metrics["history"][-1]
    text = _report_text(run_copy)
    assert "Training curves (annotator_training.png)" in text
    assert (f"held-out loss (all domains): the same loss on the {metrics['heldout_chunks']:,} held-out chunks, "
            f"unweighted: {first['heldout_loss']:.2f} at epoch 1 → {last['heldout_loss']:.2f} at epoch "
            f"{last['epoch']}. Per domain (BCE + nnPU risk), first → lowest (epoch) → last: content ") in text
    assert "held-out recall@10, the share of the held-out chunks' inherited concepts" in text


def test_concept_map_labels_do_not_overlap(tmp_path):
    from atlas.core.plots import scatter

    rng = np.random.default_rng(0)
    points = np.concatenate([rng.normal(0, 0.05, (60, 2)), rng.normal(0, 1, (200, 2))])  # a crowded middle
    labels = {i: f"concept name {i}" for i in range(40)}
    shown = scatter(points, np.full(len(points), 10.0), labels, tmp_path / "map.png", "map")
    assert (tmp_path / "map.png").read_bytes().startswith(b"\x89PNG")
    assert 0 in shown and 3 <= len(shown) < len(labels)  # the first always fits; crowded ones are left out
    boxes = list(shown.values())
    for a in range(len(boxes)):
        for b in range(a + 1, len(boxes)):
            (ax0, ay0, ax1, ay1), (bx0, by0, bx1, by1) = boxes[a], boxes[b]
            assert ax1 <= bx0 or bx1 <= ax0 or ay1 <= by0 or by1 <= ay0, (a, b)


def test_concept_size_histogram_has_a_log_x_axis(tmp_path, monkeypatch):
    """The library stage's histogram says "log scale": its x axis is logarithmic, not only its bins."""
    from atlas.config import AtlasConfig
    from atlas.core import plots
    from atlas.core.rundir import RunDir
    from atlas.stages.library import LibraryStage

    drawn = {}

    def keep(plt, fig, path, layout=True):
        ax = fig.axes[0]
        drawn[path.name] = (ax.get_xscale(), ax.get_yscale(), ax.get_xlabel())
        plt.close(fig)

    monkeypatch.setattr(plots, "_save", keep)
    stage = LibraryStage(AtlasConfig(run_dir=str(tmp_path)))
    stage._embed = lambda texts, run: np.random.default_rng(0).normal(size=(len(texts), 8)).astype(np.float32)
    rows = [{"name": f"c{i}", "description": "d", "chunk_count": int(c)} for i, c in enumerate([1, 3, 10, 40, 300])]
    stage._plot(RunDir(tmp_path), rows)
    assert drawn["concept_sizes.png"] == ("log", "log", "chunks per concept (log scale)")
    assert "concept_map.png" in drawn
