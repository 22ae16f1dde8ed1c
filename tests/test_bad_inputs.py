"""The bad-input suite: configuration, corpus files and intermediate artifacts, each broken for real on disk.

Every case runs the real command (``atlas run ... --stages S``, ``atlas search``, ``atlas cblm train``) and checks
that it (a) stops with ``error: ...`` (exit 1 or 2), never a traceback, (b) names the file and what is wrong in it
(column, row, field, storage chunk...), and (c) loses nothing already finished: every output that was on disk
before is still there, byte for byte, and every stage the manifest had as done still is.

Artifacts are tampered with in copies of the session's ``trained`` run (chunk .. train_annotator) or of a small
corpus run built once here (annotate, tokenize, index). A stage is "unfinished" where needed (its ``_SUCCESS`` and
shard markers removed, as after a kill) so that the command really reads the damaged file.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from conftest import SMALL, write_config, write_jsonl
from test_corpus import copy_run

from atlas.cli import main
from atlas.core.files import atomic_write_parquet
from atlas.core.rundir import RunDir
from atlas.runner import run_stages

# --- helpers -------------------------------------------------------------------------------------------------------


def snapshot(root: Path) -> dict[str, bytes]:
    """Every finished output under a run directory, by relative path. Left out: what a later attempt may rewrite
    by design (shard markers hold timings; stats; the manifest, checked apart; the report; caches)."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and not {"_shards", "_cache", "report"} & set(p.relative_to(root).parts)
            and p.name not in ("manifest.json", "_stats.json")}


def done_stages(root: Path) -> dict[str, str]:
    manifest = json.loads((root / "manifest.json").read_text())
    return {name: info["hash"] for name, info in manifest["stages"].items() if info.get("status") == "done"}


def unfinish(run: RunDir, output: str, shards: list[int] | None = None) -> None:
    """As after a kill: the stage's _SUCCESS goes, and the markers of ``shards`` (None: all of them)."""
    run.success_path(output).unlink()
    for marker in sorted(run.output_dir(output).glob("_shards/*.json")):
        if shards is None or int(marker.stem) in shards:
            marker.unlink()


def rewrite(path: Path, change) -> None:
    """Rewrite a Parquet file as ``change(rows, schema) -> (rows, schema)`` says."""
    table = pq.read_table(path)
    rows, schema = change(table.to_pylist(), table.schema)
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path)


def truncate(path: Path, keep: float = 0.5) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


def edit_json(path: Path, change) -> None:
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def cli(args: list[str], capsys) -> tuple[int, str]:
    """``atlas ARGS`` in this process: (exit code, its "error: ..." message). An uncaught exception fails the test,
    with its traceback. (Anything printed before the error, e.g. the run report's own warnings, is left out.)"""
    capsys.readouterr()
    code = main(args)
    err = capsys.readouterr().err
    return code, err[err.find("error: "):] if "error: " in err else err


def assert_nothing_lost(run: RunDir, before: dict[str, bytes], stages_before: dict[str, str], failing: str | None,
                        manifest: bytes) -> None:
    """Every output on disk before is there, unchanged; no stage became done; the manifest still has every stage
    but the failing one as done, with the same hash (when the manifest is the damaged file: it is left as it was)."""
    after = snapshot(run.root)
    assert sorted(name for name, data in before.items() if after.get(name) != data) == []
    assert [name for name in after if name.endswith("_SUCCESS") and name not in before] == []
    try:
        stages_after = done_stages(run.root)
    except json.JSONDecodeError:
        assert run.manifest_path.read_bytes() == manifest
        return
    assert {k: v for k, v in stages_before.items() if k != failing} == {k: v for k, v in stages_after.items()
                                                                        if k != failing}


def assert_names(message: str, expected: tuple[str, ...]) -> None:
    assert message.startswith("error: "), message
    for fragment in expected:
        assert fragment in message, f"{fragment!r} not in:\n{message}"
    for raw in ("Traceback", "KeyError", "JSONDecodeError", "IndexError", "ArrowInvalid"):
        assert raw not in message, message


# --- intermediate artifacts ------------------------------------------------------------------------------------------


def _garbage_library(run):
    (run.output_dir("library") / "concepts.parquet").write_bytes(b"PAR1 this is not a parquet file")
    unfinish(run, "targets")


def _library_missing_column(run):
    path = run.output_dir("library") / "concepts.parquet"
    pq.write_table(pq.read_table(path).drop(["domain"]), path)
    unfinish(run, "targets")


def _library_duplicate_id(run):
    def change(rows, schema):
        rows[3]["concept_id"] = 2
        return rows, schema

    rewrite(run.output_dir("library") / "concepts.parquet", change)
    unfinish(run, "targets")


def _library_renamed_concept(run):  # a "harmless" edit: the counts still match, the file is not the trained one
    def change(rows, schema):
        rows[0]["name"] = "something else"
        return rows, schema

    rewrite(run.output_dir("library") / "concepts.parquet", change)


def _library_config_count(run):
    edit_json(run.output_dir("library") / "config.json", lambda d: d.update(n_concepts=d["n_concepts"] + 1))
    unfinish(run, "targets")


def _tag_to_unknown_concept(run):
    def change(rows, schema):
        next(r for r in rows if r["concept_id"] is not None)["concept_id"] = 9999
        return rows, schema

    rewrite(run.output_dir("library") / "tag_to_concept.parquet", change)
    unfinish(run, "targets")


def _tags_part_renamed_column(run):
    path = run.part_path("tags", 1)
    table = pq.read_table(path)
    pq.write_table(table.rename_columns(["tags" if n == "tag" else n for n in table.column_names]), path)
    unfinish(run, "tag_vocab")


def _tags_part_missing(run):
    run.part_path("tags", 1).unlink()  # its marker and _SUCCESS stay: vocab read the other parts and went on
    unfinish(run, "tag_vocab")


def _tags_part_missing_for_targets(run):
    run.part_path("tags", 1).unlink()
    unfinish(run, "targets")


def _chunks_part_missing(run):
    run.part_path("chunks", 2).unlink()
    unfinish(run, "targets")


def _chunks_part_truncated(run):
    truncate(run.part_path("chunks", 1))
    unfinish(run, "tags", [1])


def _chunks_part_without_text(run):
    path = run.part_path("chunks", 0)
    pq.write_table(pq.read_table(path).drop(["chunk_text"]), path)


def _vocab_embeddings_short(run):
    path = run.output_dir("tag_vocab") / "_embeddings.npy"
    np.save(path, np.load(path, allow_pickle=False)[:-3])
    unfinish(run, "clusters")


def _clustered_vectors_short(run):
    path = run.output_dir("clusters") / "_vectors.npy"  # the tags joined with their contexts (library.context_weight)
    np.save(path, np.load(path, allow_pickle=False)[:-3])
    unfinish(run, "coherence")


def _vocab_embeddings_garbage(run):
    (run.output_dir("tag_vocab") / "_embeddings.npy").write_bytes(b"\x93NUMPY garbage, not an array")
    unfinish(run, "clusters")


def _targets_missing_split(run):
    path = run.part_path("targets", 0)
    pq.write_table(pq.read_table(path).drop(["split"]), path)
    unfinish(run, "annotator")


def _sweep_invalid_json(run):
    (run.output_dir("clusters") / "_sweep.json").write_text("{'chosen_k': 16")
    unfinish(run, "library")


def _shard_marker_invalid_json(run):
    run.success_path("tags").unlink()  # killed before the stage was finalized...
    run.marker_path("tags", 1).write_text('{"stage_hash": "ab')  # ...and a marker cut short by a copy


def _success_empty(run):
    run.success_path("chunks").write_text("")


def _success_not_an_object(run):
    run.success_path("tags").write_text("[]")


def _manifest_truncated(run):
    truncate(run.manifest_path, 0.4)


def _annotator_count(run):
    edit_json(run.output_dir("annotator") / "config.json", lambda d: d["domains"]["content"].update(size=8))


def _annotator_weights_missing(run):
    (run.output_dir("annotator") / "model.safetensors").unlink()


def _annotator_weights_truncated(run):
    truncate(run.output_dir("annotator") / "model.safetensors", 0.3)


def _annotator_config_invalid_json(run):
    (run.output_dir("annotator") / "config.json").write_text('{"format": 1, "dim": ')


def _annotator_config_foreign(run):
    (run.output_dir("annotator") / "config.json").write_text(json.dumps({"format": 1, "model_type": "bert"}))


TRAINED_CASES = [
    pytest.param(_garbage_library, "targets", ("library/concepts.parquet", "not a readable Parquet file"),
                 id="library-concepts-garbage-bytes"),
    pytest.param(_library_missing_column, "targets", ("library/concepts.parquet", "missing column(s) ['domain']"),
                 id="library-concepts-missing-column"),
    pytest.param(_library_duplicate_id, "targets",
                 ("library/concepts.parquet", "row 3: concept_id is 2 (a duplicate)"), id="library-duplicate-id"),
    pytest.param(_library_renamed_concept, "annotate",
                 ("library/concepts.parquet", "not the library this annotator was trained on"),
                 id="library-edited-after-training"),
    pytest.param(_library_config_count, "targets", ("library/config.json", "n_concepts is"),
                 id="library-config-wrong-count"),
    pytest.param(_tag_to_unknown_concept, "targets",
                 ("library/tag_to_concept.parquet", "row ", "concept_id 9999 is not a content concept"),
                 id="tag-to-concept-unknown-concept"),
    pytest.param(_tags_part_renamed_column, "vocab", ("tags/part-00001.parquet", "missing column(s) ['tag']"),
                 id="tags-part-wrong-schema"),
    pytest.param(_chunks_part_truncated, "tag", ("chunks/part-00001.parquet", "not a readable Parquet file"),
                 id="chunks-part-truncated"),
    pytest.param(_tags_part_missing, "vocab", ("tags/part-00001.parquet: missing (stage 'tag' has 3 part(s), "
                                               "part-00000 to part-00002); recompute it: atlas run CONFIG --force "
                                               "--stages tag",), id="tags-part-missing"),
    pytest.param(_tags_part_missing_for_targets, "targets", ("tags/part-00001.parquet: missing",),
                 id="tags-part-missing-for-targets"),
    pytest.param(_chunks_part_missing, "targets", ("chunks/part-00002.parquet: missing (stage 'chunk' has 3 part(s)",),
                 id="chunks-part-missing-for-targets"),
    pytest.param(_chunks_part_without_text, "annotate",
                 ("chunks/part-00000.parquet", "missing column(s) ['chunk_text']"), id="chunks-part-wrong-schema"),
    pytest.param(_vocab_embeddings_short, "cluster", ("tag_vocab/_embeddings.npy", "tags (row i embeds tag i)"),
                 id="vocab-embeddings-wrong-shape"),
    pytest.param(_vocab_embeddings_garbage, "cluster", ("tag_vocab/_embeddings.npy", "unreadable"),
                 id="vocab-embeddings-garbage"),
    pytest.param(_clustered_vectors_short, "coherence", ("clusters/_vectors.npy", "rerun the cluster stage"),
                 id="clustered-vectors-wrong-shape"),
    pytest.param(_targets_missing_split, "train_annotator",
                 ("targets/part-00000.parquet", "missing column(s) ['split']"), id="targets-part-wrong-schema"),
    pytest.param(_sweep_invalid_json, "library", ("clusters/_sweep.json", "not valid JSON"), id="sweep-json-damaged"),
    pytest.param(_shard_marker_invalid_json, "tag", ("tags/_shards/00001.json", "not valid JSON"),
                 id="shard-marker-damaged"),
    pytest.param(_success_empty, "chunk", ("chunks/_SUCCESS", "not valid JSON"), id="success-marker-empty"),
    pytest.param(_success_not_an_object, "tag", ("tags/_SUCCESS", "expected a JSON object"),
                 id="success-marker-not-an-object"),
    pytest.param(_manifest_truncated, "chunk", ("manifest.json", "not valid JSON"), id="manifest-truncated"),
    pytest.param(_annotator_count, "annotate",
                 ("annotator/config.json", "knows 8 content concepts but the library has"),
                 id="annotator-concept-count-differs"),
    pytest.param(_annotator_weights_missing, "annotate", ("annotator/model.safetensors", "missing"),
                 id="annotator-weights-missing"),
    pytest.param(_annotator_weights_truncated, "annotate",
                 ("annotator/model.safetensors", "not a readable safetensors file"), id="annotator-weights-truncated"),
    pytest.param(_annotator_config_invalid_json, "annotate", ("annotator/config.json", "not valid JSON"),
                 id="annotator-config-damaged"),
    pytest.param(_annotator_config_foreign, "annotate", ("annotator/config.json", "not an annotator config"),
                 id="annotator-config-foreign"),
]


@pytest.mark.parametrize("tamper, stage, expected", TRAINED_CASES)
def test_damaged_artifact_of_a_trained_run(trained, tmp_path, capsys, tamper, stage, expected):
    path, config = copy_run(trained, tmp_path)
    run = RunDir(config.run_dir)
    stages_before = done_stages(run.root)
    tamper(run)
    before, manifest = snapshot(run.root), run.manifest_path.read_bytes()
    code, err = cli(["run", str(path), "--inline", "--no-progress", "--stages", stage], capsys)
    assert code in (1, 2)
    assert_names(err, expected)
    assert_nothing_lost(run, before, stages_before, stage, manifest)


def test_stray_files_in_a_stage_folder_are_not_read(trained, tmp_path, capsys):
    """A copy beside a part ("part-00000 (copy).parquet") was read as one more part, and so was a part beyond the
    stage's shard count: readers take exactly the parts the stage planned, and the outputs stay byte for byte."""
    path, config = copy_run(trained, tmp_path)
    run = RunDir(config.run_dir)
    for output in ("tags", "chunks"):
        shutil.copy(run.part_path(output, 0), run.output_dir(output) / "part-00000 (copy).parquet")
        shutil.copy(run.part_path(output, 1), run.part_path(output, 7))
    before = {output: run.part_path(output, 0).read_bytes() for output in ("tag_vocab", "targets")}
    unfinish(run, "tag_vocab")
    unfinish(run, "targets")
    code, err = cli(["run", str(path), "--inline", "--no-progress", "--stages", "vocab,targets"], capsys)
    assert code == 0, err
    assert {output: run.part_path(output, 0).read_bytes() for output in before} == before


@pytest.mark.parametrize("command, expected", [
    (["inspect", "RUN", "chunks"], "chunks/part-00001.parquet: missing"),
    (["inspect", "RUN", "tags"], "chunks/part-00001.parquet: missing"),
    (["judge", "RUN", "--sample", "3", "--set", "run_dir=RUN"], "chunks/part-00001.parquet: missing"),
])
def test_commands_that_read_a_run_name_a_missing_part(trained, tmp_path, capsys, command, expected):
    _, config = copy_run(trained, tmp_path)
    run = RunDir(config.run_dir)
    run.part_path("chunks", 1).unlink()
    code, err = cli([word.replace("RUN", config.run_dir) for word in command], capsys)
    assert code == 1
    assert_names(err, (expected,))


# --- corpus artifacts: annotated shards, embeddings.zarr, token shards, the index ----------------------------------


@pytest.fixture(scope="module")
def corpus_run(trained, tmp_path_factory):
    """A copy of ``trained`` with 12 chunks per shard, annotated, tokenized and indexed (small and fast)."""
    _, config = copy_run(trained, tmp_path_factory.mktemp("bad_corpus"), **SMALL, index={"code_bytes": 8})
    run = RunDir(config.run_dir)
    for part in sorted(run.output_dir("chunks").glob("part-*.parquet")):
        atomic_write_parquet(part, pq.read_table(part).slice(0, 12))
    run_stages(config, ["annotate", "tokenize", "index"], log=lambda m: None)
    return config, run


def _annotated_without_text(run):
    path = run.part_path("annotated", 1)
    pq.write_table(pq.read_table(path).drop(["text"]), path)
    unfinish(run, "tokens", [1])


def _annotated_truncated(run):
    truncate(run.part_path("annotated", 1), 0.7)
    unfinish(run, "tokens", [1])


def _zarr_chunk_truncated(run):
    truncate(run.root / "embeddings.zarr" / "embeddings" / "c" / "1" / "0")
    unfinish(run, "index")


def _zarr_chunk_missing(run):
    (run.root / "embeddings.zarr" / "embeddings" / "c" / "1" / "0").unlink()
    unfinish(run, "index")


def _faiss_truncated(run):
    truncate(run.output_dir("index") / "index.faiss")


def _stream_truncated(run):
    truncate(run.output_dir("tokens") / "_stream" / "part-00001.u32")


def _token_part_missing(run):
    run.part_path("tokens", 1).unlink()


CORPUS_CASES = [
    pytest.param(_annotated_without_text, ["run", "--stages", "tokenize"],
                 ("annotated/part-00001.parquet", "missing column(s) ['text']"), id="annotated-part-wrong-schema"),
    pytest.param(_annotated_truncated, ["run", "--stages", "tokenize"],
                 ("annotated/part-00001.parquet", "not a readable Parquet file"), id="annotated-part-truncated"),
    pytest.param(_zarr_chunk_truncated, ["run", "--stages", "index"],
                 ("embeddings.zarr/embeddings", "storage chunk c/1/0 (rows 7..13) cannot be decoded"),
                 id="zarr-chunk-truncated"),
    pytest.param(_zarr_chunk_missing, ["run", "--stages", "index"],
                 ("embeddings.zarr/embeddings", "c/1/0 (rows 7..13) missing"), id="zarr-chunk-missing"),
    pytest.param(_faiss_truncated, ["search", "RUN", "binary search"],
                 ("index/index.faiss", "not a readable FAISS index"), id="faiss-index-truncated"),
    pytest.param(_stream_truncated, ["cblm", "train", "RUN", "--set", "max_steps=1"],
                 ("tokens/_stream/part-00001.u32", "the stream is truncated"), id="token-stream-truncated"),
    pytest.param(_token_part_missing, ["cblm", "train", "RUN", "--set", "max_steps=1"],
                 ("tokens/part-00001.parquet: missing",), id="token-index-part-missing"),
]


@pytest.mark.slow
@pytest.mark.parametrize("tamper, command, expected", CORPUS_CASES)
def test_damaged_corpus_artifact(corpus_run, tmp_path, capsys, tamper, command, expected):
    path, config = copy_run(corpus_run, tmp_path)
    run = RunDir(config.run_dir)
    stages_before = done_stages(run.root)
    tamper(run)
    before, manifest = snapshot(run.root), run.manifest_path.read_bytes()
    failing = command[-1] if command[0] == "run" else None
    if command[0] == "run":
        command = ["run", str(path), "--inline", "--no-progress", *command[1:]]
    command = [str(run.root) if word == "RUN" else word for word in command]
    code, err = cli(command, capsys)
    assert code in (1, 2)
    assert_names(err, expected)
    assert_nothing_lost(run, before, stages_before, failing, manifest)


# --- configuration -----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def config_run(trained, tmp_path_factory):
    """One copy of the trained run that every bad configuration is pointed at (none may touch it)."""
    folder = tmp_path_factory.mktemp("bad_config")
    path, config = copy_run(trained, folder)
    return path, RunDir(config.run_dir)


CONFIG_CASES = [
    pytest.param({"annotate": {"block_rows": -5}}, "annotate.block_rows: Input should be greater than or equal to 1",
                 id="negative-number"),
    pytest.param({"llm": {"engine": "gpt-5"}}, "llm.engine: Input should be 'offline', 'openai' or 'vllm'",
                 id="unknown-engine"),
    pytest.param({"annotator": {"thresholds": {"content": 1.5}}},
                 "annotator.thresholds.content: Input should be less than or equal to 1", id="threshold-above-1"),
    pytest.param({"annotator": {"caps": {"tone": 0}}},
                 "annotator.caps.tone: Input should be greater than or equal to 1", id="cap-zero"),
    pytest.param({"annotator": {"heldout_fraction": 1.0}}, "annotator.heldout_fraction: Input should be less than 1",
                 id="fraction-out-of-range"),
    pytest.param({"tag": {"batch_size": "many"}}, "tag.batch_size: Input should be a valid integer",
                 id="wrong-type-int"),
    pytest.param({"input": {"metadata_fields": "label"}}, "input.metadata_fields: Input should be a valid list",
                 id="wrong-type-list"),
    pytest.param({"input": {"format": "csv"}}, "input.format: Input should be 'auto', 'parquet', 'jsonl' or 'text'",
                 id="unknown-input-format"),
    pytest.param({"tag": {"domain_schemas": {"web": "nosuch"}}}, "tag.domain_schemas.web: no schema 'nosuch' in",
                 id="unknown-domain-schema"),
    pytest.param({"library": {"aux_domains": ["tone", "moods"]}}, "library.aux_domains.1: no schema 'moods' in",
                 id="unknown-aux-domain"),
    pytest.param({"tag": {"prompt": "prompts/missing.yaml"}}, "tag.prompt: file not found:", id="missing-prompt-file"),
]


@pytest.mark.parametrize("sections, message", CONFIG_CASES)
def test_bad_configuration_names_the_key_and_touches_nothing(config_run, tmp_path, capsys, sections, message):
    path, run = config_run
    data = yaml.safe_load(path.read_text())
    for key, value in sections.items():
        data[key] = {**data[key], **value}
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(data))
    before, stages_before = snapshot(run.root), done_stages(run.root)
    code, err = cli(["run", str(bad), "--inline", "--no-progress"], capsys)
    assert code == 2
    assert_names(err, (str(bad), message))
    assert snapshot(run.root) == before and done_stages(run.root) == stages_before


# --- corpus files ------------------------------------------------------------------------------------------------


def _empty_file(folder):
    (folder / "docs.jsonl").write_bytes(b"")
    return folder / "docs.jsonl"


def _binary_as_jsonl(folder):
    (folder / "docs.jsonl").write_bytes(np.random.default_rng(0).bytes(6000))
    return folder / "docs.jsonl"


def _csv_named_parquet(folder):
    (folder / "docs.parquet").write_text("id,text\n1,hello world\n2,another document\n")
    return folder / "docs.parquet"


def _csv_extension(folder):
    (folder / "docs.csv").write_text("id,text\n1,hello world\n")
    return folder / "docs.csv"


def _mixed_formats(folder):
    data = folder / "data"
    data.mkdir()
    write_jsonl(data / "a.jsonl", [{"id": "a", "text": "Some text."}])
    pq.write_table(pa.table({"id": ["b"], "text": ["More text."]}), data / "b.parquet")
    return data


def _all_documents_empty(folder):
    return write_jsonl(folder / "docs.jsonl", [{"id": "a", "text": ""}, {"id": "b", "text": "   \n\t"},
                                               {"id": "c", "text": "\n"}])


def _text_column_of_ints(folder):
    pq.write_table(pa.table({"id": ["a", "b", "c"], "text": [1, 2, 3]}), folder / "docs.parquet")
    return folder / "docs.parquet"


def _text_column_missing(folder):
    pq.write_table(pa.table({"id": ["a"], "body": ["The text is in another column."]}), folder / "docs.parquet")
    return folder / "docs.parquet"


INPUT_CASES = [
    pytest.param(_empty_file, ("docs.jsonl", "no records", "empty file"), False, id="empty-file"),
    pytest.param(_binary_as_jsonl, ("no usable document, every record was rejected", "invalid_", "chunks/_rejects"),
                 True, id="binary-file-as-jsonl"),
    pytest.param(_csv_named_parquet, ("docs.parquet", "not a readable Parquet file"), False,
                 id="csv-given-as-parquet"),
    pytest.param(_csv_extension, ("docs.csv", "cannot tell the format from the name; set input.format"), False,
                 id="unknown-extension"),
    pytest.param(_mixed_formats, ("data: mixes ['jsonl', 'parquet'] files",), False, id="mixed-formats"),
    pytest.param(_all_documents_empty, ("no usable document", "empty_document: 3"), True, id="all-documents-empty"),
    pytest.param(_text_column_of_ints, ("no usable document", "non_string_text: 3"), True, id="text-column-of-ints"),
    pytest.param(_text_column_missing, ("docs.parquet: no text column 'text'; available columns: id, body",), False,
                 id="text-column-missing"),
]


@pytest.mark.parametrize("make, expected, chunked", INPUT_CASES)
def test_bad_corpus_file_is_named_and_rejects_are_kept(tmp_path, capsys, make, expected, chunked):
    """Unreadable input stops before any work; input read but without one usable document stops after chunking,
    with every record in chunks/_rejects (file, row, field, reason), and nothing of it is marked done."""
    config = write_config(tmp_path, make(tmp_path))
    code, err = cli(["run", str(config), "--inline", "--no-progress"], capsys)
    assert code == 1
    assert_names(err, expected)
    run = RunDir(tmp_path / "run")
    assert not run.success_path("chunks").exists() and not run.output_dir("tags").exists()
    if chunked:  # the shards ran: their (empty) parts and the rejects stay, and a rerun says the same at once
        rejects = pq.read_table(run.output_dir("chunks") / "_rejects").to_pylist()
        assert rejects and all(r["file"] and r["row"] is not None and r["reason"] and r["field"] for r in rejects)
        before = snapshot(run.root)
        code, again = cli(["run", str(config), "--inline", "--no-progress"], capsys)
        assert code == 1 and again == err and snapshot(run.root) == before
    else:
        assert not list(run.root.glob("chunks/part-*.parquet"))


def test_missing_id_field_falls_back_to_positions_and_is_counted(tmp_path, capsys):
    """input.id_field names a field the records lack: documented fallback ids "<file stem>:<row>", counted."""
    docs = write_jsonl(tmp_path / "docs.jsonl", [{"doc": f"d{i}", "text": f"Document number {i} has text."}
                                                 for i in range(3)])
    config = write_config(tmp_path, docs)  # id_field: id
    code, _ = cli(["run", str(config), "--inline", "--no-progress", "--stages", "chunk"], capsys)
    assert code == 0
    run = RunDir(tmp_path / "run")
    assert pq.read_table(run.output_dir("chunks"), columns=["doc_id"]).column(0).to_pylist() == \
        ["docs:0", "docs:1", "docs:2"]
    assert json.loads(run.stats_path("chunks").read_text())["counters"]["ids_missing"] == 3


def test_the_suite_covers_at_least_25_distinct_bad_inputs():
    ids = [p.id for cases in (TRAINED_CASES, CORPUS_CASES, CONFIG_CASES, INPUT_CASES) for p in cases]
    assert len(ids) == len(set(ids)) >= 25
