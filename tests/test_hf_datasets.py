"""Run folders and the export load the Hugging Face way: ``datasets.load_dataset(folder)`` gives exactly the rows of
the Parquet parts (the dataset cards name the data files), and ``atlas export --push-to-hub`` publishes the export.
Offline: a local folder stands in for the Hub."""

import shutil

import pandas as pd
import pyarrow.parquet as pq
import pytest
import yaml

from atlas.cli import main
from atlas.config import load_config
from atlas.core.rundir import RunDir
from atlas.io.cards import CARD_FILE, CONFIGS_FILE
from atlas.io.library import folder_digest
from atlas.runner import run_stages
from atlas.stages import STAGES


@pytest.fixture(autouse=True)
def offline_hub(monkeypatch, tmp_path):
    """No network, no token, no cache outside the test's folder."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    monkeypatch.delenv("HF_TOKEN", raising=False)


def load(path, config=None, cache=None):
    """The ``train`` split of ``load_dataset(path, config)``, read into a cache beside the test."""
    import datasets

    datasets.disable_progress_bars()
    return datasets.load_dataset(str(path), config, split="train", cache_dir=str(cache))


def parquet_rows(files) -> list[dict]:
    return [row for f in files for row in pq.read_table(f).to_pylist()]


@pytest.fixture(scope="module")
def annotated(trained, tmp_path_factory):
    """A copy of the trained run, annotated: every stage folder but tokens and index."""
    config, run = trained
    folder = tmp_path_factory.mktemp("hf_run")
    shutil.copytree(run.root, folder / "run")
    path = folder / "config.yaml"
    path.write_text(yaml.safe_dump(config.model_dump() | {"run_dir": str(folder / "run")}))
    config = load_config(path)
    run_stages(config, ["annotate"], log=lambda m: None)
    return config, RunDir(config.run_dir)


def test_load_dataset_on_a_stage_folder_gives_exactly_its_parts(annotated, tmp_path):
    _, run = annotated
    folder = run.output_dir("annotated")
    rows = load(folder, cache=tmp_path / "cache")
    expected = parquet_rows(run.parts("annotated"))
    assert rows.num_rows == len(expected) > 0
    assert rows["chunk_id"] == [r["chunk_id"] for r in expected]
    assert rows["concepts"] == [r["concepts"] for r in expected]
    assert rows.column_names == pq.read_schema(run.parts("annotated")[0]).names
    assert len(pd.read_parquet(folder)) == len(expected)  # pandas still reads the folder as one table

    card = (folder / CARD_FILE).read_text()
    configs = yaml.safe_load((folder / CONFIGS_FILE).read_text())
    assert configs == {"configs": [{"config_name": "default",
                                    "data_files": [{"split": "train", "path": "part-*.parquet"}]}]}
    assert card.startswith("---\n" + (folder / CONFIGS_FILE).read_text() + "---\n")  # the same YAML, as front matter
    n_parts = len(run.parts("annotated"))
    assert "Atlas stage `annotate`" in card and f"{len(expected):,} rows in {n_parts} file(s)" in card
    assert "| `concept_scores` | list<element: float> | probabilities, same order |" in card


def test_every_finished_stage_folder_has_a_card_and_rejects_load_as_their_own_config(annotated, tmp_path):
    config, run = annotated
    stages = run.read_manifest()["stages"]
    with_parts = [STAGES[name].output for name in stages if any(run.output_dir(STAGES[name].output).glob("*.parquet"))]
    assert {"chunks", "tags", "tag_vocab", "clusters", "coherence", "labels", "library", "targets", "annotator",
            "annotated"} <= set(with_parts)
    for output in with_parts:
        assert (run.output_dir(output) / CARD_FILE).is_file() and (run.output_dir(output) / CONFIGS_FILE).is_file()

    with_rejects = [o for o in with_parts if any(run.output_dir(o).glob("_rejects/part-*.parquet"))]
    assert with_rejects, "the trained run has no stage folder with rejects to load"
    folder = run.output_dir(with_rejects[0])
    rejects = load(folder, "rejects", cache=tmp_path / "cache")
    expected = parquet_rows(sorted(folder.glob("_rejects/part-*.parquet")))
    assert rejects.num_rows == len(expected) > 0 and rejects.to_list() == expected
    parts = run.parts(folder.name)
    assert load(folder, cache=tmp_path / "cache").num_rows == sum(pq.ParquetFile(p).metadata.num_rows for p in parts)
    assert "config `rejects`" in (folder / CARD_FILE).read_text()

    # named files: one config each (library/concepts.parquet, library/tag_to_concept.parquet)
    concepts = load(run.output_dir("library"), "concepts", cache=tmp_path / "cache")
    assert concepts.to_list() == pq.read_table(run.output_dir("library") / "concepts.parquet").to_pylist()


def test_a_card_is_the_same_bytes_when_written_again_and_no_part_of_a_digest(annotated):
    """A run finished before Atlas wrote cards gets them on the next `atlas run` (nothing recomputed), byte for byte
    what the stage wrote; and the library's digest (annotate.annotator_from's hash) does not see them."""
    config, run = annotated
    folders = [run.output_dir(o) for o in ("tags", "library", "annotated")]
    before = {f: ((f / CARD_FILE).read_bytes(), (f / CONFIGS_FILE).read_bytes()) for f in folders}
    digest = folder_digest(run.output_dir("library"))
    for f in folders:
        (f / CARD_FILE).unlink()
        (f / CONFIGS_FILE).unlink()
    assert folder_digest(run.output_dir("library")) == digest
    reports = run_stages(config, ["tag", "library", "annotate"], log=lambda m: None)
    assert all(r.skipped for r in reports)
    assert {f: ((f / CARD_FILE).read_bytes(), (f / CONFIGS_FILE).read_bytes()) for f in folders} == before


def test_the_export_card_loads_chunks_concepts_and_field_guide(annotated, tmp_path):
    _, run = annotated
    out = tmp_path / "release"
    assert main(["export", str(run.root), str(out)]) == 0
    readme = (out / "README.md").read_text()
    assert readme.startswith("---\nconfigs:\n- config_name: chunks\n  default: true\n")
    assert "| `chunks/part-*.parquet` |" in readme  # the table is still there, below the YAML

    chunks = load(out, cache=tmp_path / "cache")  # the default config
    assert chunks["chunk_id"] == [r["chunk_id"] for r in parquet_rows(run.parts("annotated"))]
    concepts = load(out, "concepts", cache=tmp_path / "cache")
    assert concepts.to_list() == pq.read_table(out / "concepts.parquet").to_pylist()
    guide = load(out, "field_guide", cache=tmp_path / "cache")
    assert guide.to_list() == parquet_rows(sorted((out / "field_guide").glob("part-*.parquet")))
    assert sorted(set(guide["concept_id"])) == list(range(len(concepts)))


def test_push_to_hub_a_local_folder_through_the_cli(annotated, tmp_path, capsys):
    _, run = annotated
    out, mirror = tmp_path / "release", tmp_path / "mirror"
    assert main(["export", str(run.root), str(out), "--push-to-hub", str(mirror)]) == 0
    assert f"published to {mirror}" in capsys.readouterr().out
    files = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    assert sorted(str(p.relative_to(mirror)) for p in mirror.rglob("*") if p.is_file()) == files
    assert all((mirror / f).read_bytes() == (out / f).read_bytes() for f in files)
    chunks = load(mirror, cache=tmp_path / "cache")
    assert chunks["chunk_id"] == [r["chunk_id"] for r in parquet_rows(run.parts("annotated"))]

    # again, as a file:// URL: the earlier mirror is replaced whole, so a stale part cannot join the chunks
    shutil.copy(mirror / "chunks" / "part-00000.parquet", mirror / "chunks" / "part-09999.parquet")
    assert main(["export", str(run.root), str(out), "--push-to-hub", mirror.as_uri()]) == 0
    assert sorted(str(p.relative_to(mirror)) for p in mirror.rglob("*") if p.is_file()) == files
    assert load(mirror, cache=tmp_path / "cache2").num_rows == chunks.num_rows


def test_push_to_hub_refuses_before_exporting_without_a_token_or_into_a_foreign_folder(annotated, tmp_path, capsys):
    from huggingface_hub import get_token

    _, run = annotated
    out = tmp_path / "release"
    if get_token():
        pytest.skip("this machine has a stored Hugging Face login")
    assert main(["export", str(run.root), str(out), "--push-to-hub", "atlas-test/release"]) == 1
    err = capsys.readouterr().err
    assert "error: --push-to-hub atlas-test/release: no Hugging Face token" in err and "HF_TOKEN" in err
    assert not out.exists()  # refused before the export's work

    foreign = tmp_path / "notes"
    foreign.mkdir()
    (foreign / "mine.txt").write_text("keep me")
    assert main(["export", str(run.root), str(out), "--push-to-hub", str(foreign)]) == 1
    assert "not a folder Atlas created" in capsys.readouterr().err
    assert [p.name for p in foreign.iterdir()] == ["mine.txt"] and not out.exists()
