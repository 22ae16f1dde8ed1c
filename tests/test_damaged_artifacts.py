"""Damaged artifacts read by the read commands: one line, never a traceback.

A copy of a finished run is damaged for real on disk (a Parquet part cut short or emptied, a column dropped, a
concept id outside the library, a manifest edited into another shape, a store whose ids were deleted), then a read
command (`atlas status`, `inspect`, `report`, `eval`, `judge`, `export`, `search`) runs in this process. It must
fail with one line on standard error, starting with ``error:``, that names the damaged file and says what to run.
The same for numbers the commands cannot use, for a reader that closes the pipe early, and for
``--push-to-hub`` with no network.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import REPO, copy_run_dir, finish_process

from atlas.cli import main

# --- damage, done for real on disk ----------------------------------------------------------------------------------


def truncate(path, keep: float = 0.5) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


def empty(path) -> None:
    path.write_bytes(b"")


def drop_column(path, column: str) -> None:
    pq.write_table(pq.read_table(path).drop([column]), path)


def concept_outside_library(path, column: str = "concepts") -> None:
    """The first non-empty list of ``column`` gets the id 99999 (no library here has that many concepts)."""
    table = pq.read_table(path)
    rows = table.to_pylist()
    next(r for r in rows if r[column])[column][0] = 99999
    pq.write_table(pa.Table.from_pylist(rows, schema=table.schema), path)


def edit_manifest(root, change) -> None:
    manifest = json.loads((root / "manifest.json").read_text())
    change(manifest)
    (root / "manifest.json").write_text(json.dumps(manifest))


def _stages_a_list(root):
    edit_manifest(root, lambda m: m.update(stages=sorted(m["stages"])))


def _stage_record_a_string(root):
    edit_manifest(root, lambda m: m["stages"].update(chunk="done"))


def _num_shards_a_string(stage):
    def damage(root):
        edit_manifest(root, lambda m: m["stages"][stage].update(num_shards="3"))
    return damage


def _config_a_string(root):
    edit_manifest(root, lambda m: m.update(config="configs/demo.yaml"))


def _errors_keyed_by_name(root):
    edit_manifest(root, lambda m: m["stages"]["tag"].update(errors={"first": "ValueError: x"}))


def _marker_counters_a_list(root):
    marker = root / "chunks" / "_shards" / "00001.json"
    data = json.loads(marker.read_text())
    marker.write_text(json.dumps(dict(data, counters=[1, 2])))


def _tags_map_outside_library(root):
    path = root / "library" / "tag_to_concept.parquet"
    table = pq.read_table(path)
    ids = [None if c is None else 99999 for c in table.column("concept_id").to_pylist()]
    pq.write_table(table.set_column(table.schema.get_field_index("concept_id"), "concept_id",
                                    pa.array(ids, pa.int64())), path)


def _empty_ids(path):
    table = pq.read_table(path)
    column = table.schema.get_field_index("chunk_id")
    pq.write_table(table.set_column(column, "chunk_id", pa.array([""] * table.num_rows, pa.string())), path)


def _store_ids_deleted(root):
    """The store's chunk ids deleted, and the index's id map written from that store, as the index stage does."""
    import zarr

    shutil.rmtree(root / "embeddings.zarr" / "chunk_id" / "c")
    ids = zarr.open_group(str(root / "embeddings.zarr"), mode="r")["chunk_id"][:].tolist()
    id_map = root / "index" / "part-00000.parquet"
    table = pq.read_table(id_map)
    pq.write_table(table.set_column(table.schema.get_field_index("chunk_id"), "chunk_id", pa.array(ids, pa.string())),
                   id_map)


def _id_map_short(root):
    path = root / "index" / "part-00000.parquet"
    pq.write_table(pq.read_table(path).slice(0, 20), path)


# --- the cases: damage, the commands that read it, what the line must name and say ---------------------------------

INSPECT = {name: ["inspect", "RUN", name] for name in ("chunks", "tags", "library", "targets", "annotator")}
STATUS, REPORT, JUDGE = ["status", "RUN"], ["report", "RUN"], ["judge", "RUN", "--sample", "3"]
EVAL_LIBRARY, EVAL_ANNOTATOR = ["eval", "library", "RUN", "--sample", "3"], ["eval", "annotator", "RUN"]
MANIFEST = ("manifest.json", "move it aside and rerun `atlas run CONFIG`")

# On the session's trained run (chunk .. train_annotator).
TRAINED = [
    ("chunks-part-truncated", lambda r: truncate(r / "chunks" / "part-00001.parquet"),
     [INSPECT["chunks"], INSPECT["tags"], EVAL_LIBRARY], ("chunks/part-00001.parquet", "--stages chunk")),
    ("chunks-part-empty", lambda r: empty(r / "chunks" / "part-00001.parquet"),
     [INSPECT["chunks"], INSPECT["tags"]], ("chunks/part-00001.parquet", "--stages chunk")),
    ("chunks-part-without-text", lambda r: drop_column(r / "chunks" / "part-00000.parquet", "chunk_text"),
     [INSPECT["tags"]], ("chunks/part-00000.parquet", "missing column(s) ['chunk_text']", "--stages chunk")),
    ("tags-part-truncated", lambda r: truncate(r / "tags" / "part-00001.parquet"),
     [INSPECT["tags"]], ("tags/part-00001.parquet", "--stages tag")),
    ("tags-part-without-tag-norm", lambda r: drop_column(r / "tags" / "part-00000.parquet", "tag_norm"),
     [INSPECT["tags"]], ("tags/part-00000.parquet", "missing column(s) ['tag_norm']", "--stages tag")),
    ("library-truncated", lambda r: truncate(r / "library" / "concepts.parquet"),
     [INSPECT["library"], REPORT], ("library/concepts.parquet", "--stages library")),
    ("library-empty", lambda r: empty(r / "library" / "concepts.parquet"),
     [INSPECT["library"], REPORT], ("library/concepts.parquet", "--stages library")),
    ("library-without-name", lambda r: drop_column(r / "library" / "concepts.parquet", "name"),
     [INSPECT["library"], REPORT], ("library/concepts.parquet", "missing column(s) ['name']", "--stages library")),
    ("targets-concept-outside-library", lambda r: concept_outside_library(r / "targets" / "part-00000.parquet"),
     [INSPECT["targets"]], ("targets/part-00000.parquet", "concept id 99999", "--stages targets")),
    ("tag-to-concept-outside-library", _tags_map_outside_library, [EVAL_LIBRARY],
     ("library/tag_to_concept.parquet", "concept id 99999", "--stages library")),
    ("heldout-concept-outside-library",
     lambda r: concept_outside_library(r / "annotator" / "heldout_predictions.parquet"),
     [INSPECT["annotator"], EVAL_ANNOTATOR],
     ("annotator/heldout_predictions.parquet", "concept id 99999", "--stages train_annotator")),
    ("heldout-truncated", lambda r: truncate(r / "annotator" / "heldout_predictions.parquet"),
     [INSPECT["annotator"], EVAL_ANNOTATOR], ("annotator/heldout_predictions.parquet", "--stages train_annotator")),
    ("manifest-stages-a-list", _stages_a_list, [STATUS, INSPECT["chunks"], REPORT, JUDGE, EVAL_LIBRARY],
     (*MANIFEST, "stages is [")),
    ("manifest-stage-record-a-string", _stage_record_a_string, [STATUS, INSPECT["chunks"], REPORT, EVAL_LIBRARY],
     (*MANIFEST, 'stages.chunk is "done" (a string), expected an object')),
    ("manifest-num-shards-a-string", _num_shards_a_string("chunk"), [STATUS, INSPECT["chunks"], REPORT, JUDGE],
     (*MANIFEST, 'stages.chunk.num_shards is "3" (a string), expected a whole number')),
    ("manifest-config-a-string", _config_a_string, [JUDGE, EVAL_LIBRARY], (*MANIFEST, "config is")),
    ("manifest-errors-not-by-shard", _errors_keyed_by_name, [STATUS, REPORT],
     (*MANIFEST, "stages.tag.errors has the key 'first'")),
    ("shard-marker-counters-a-list", _marker_counters_a_list, [STATUS, REPORT],
     ("chunks/_shards/00001.json", "--stages chunk")),
]

EXPORT, SEARCH = ["export", "RUN", "OUT"], ["search", "RUN", "binary search"]
SHARD_LABELS = ["inspect", "RUN", "shard-labels"]
# On a copy of it annotated and indexed (built once here).
INDEXED = [
    ("annotated-part-truncated", lambda r: truncate(r / "annotated" / "part-00001.parquet"),
     [EXPORT, SEARCH, ["inspect", "RUN", "annotated"], SHARD_LABELS, REPORT],
     ("annotated/part-00001.parquet", "--stages annotate")),
    ("annotated-part-empty", lambda r: empty(r / "annotated" / "part-00001.parquet"),
     [EXPORT, SEARCH, SHARD_LABELS], ("annotated/part-00001.parquet", "--stages annotate")),
    ("annotated-part-without-tone-ids",
     lambda r: drop_column(r / "annotated" / "part-00001.parquet", "tone_global_ids"), [SHARD_LABELS, REPORT],
     ("annotated/part-00001.parquet", "missing column(s) ['tone_global_ids']", "--stages annotate")),
    ("annotated-content-id-outside-its-domain",
     lambda r: concept_outside_library(r / "annotated" / "part-00000.parquet", "content_global_ids"), [SHARD_LABELS],
     ("annotated/part-00000.parquet", "content_global_ids holds concept id 99999", "--stages annotate")),
    ("annotated-part-without-concepts", lambda r: drop_column(r / "annotated" / "part-00000.parquet", "concepts"),
     [EXPORT], ("annotated/part-00000.parquet", "missing column(s) ['concepts']", "--stages annotate")),
    ("annotated-concept-outside-library",
     lambda r: concept_outside_library(r / "annotated" / "part-00000.parquet"),
     [EXPORT], ("annotated/part-00000.parquet", "concept id 99999", "--stages annotate")),
    ("store-ids-deleted", _store_ids_deleted, [SEARCH], ("embeddings.zarr/chunk_id", "--stages annotate")),
    ("id-map-ids-emptied", lambda r: _empty_ids(r / "index" / "part-00000.parquet"), [SEARCH],
     ("index/part-00000.parquet", "no chunk_id", "--stages index")),
    ("id-map-short", _id_map_short, [SEARCH], ("index/part-00000.parquet", "20 rows", "--stages index")),
    ("id-map-truncated", lambda r: truncate(r / "index" / "part-00000.parquet"), [SEARCH],
     ("index/part-00000.parquet", "--stages index")),
    ("manifest-num-shards-a-string", _num_shards_a_string("annotate"), [EXPORT, SEARCH],
     (*MANIFEST, "stages.annotate.num_shards")),
]


def cases(table):
    def words(command):
        return "-".join(w for w in command if w.isalpha() and w not in ("RUN", "OUT"))

    return [pytest.param(damage, command, said, id=f"{name}-{words(command)}")
            for name, damage, commands, said in table for command in commands]


def one_line_error(argv: list[str], capsys) -> str:
    """Run ``atlas ARGV`` in this process; it must fail with one line on stderr, ``error: ...``: returned."""
    capsys.readouterr()
    code = main(argv)
    err = capsys.readouterr().err
    assert code != 0, err
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


def check(root, tmp_path, damage, command, said, capsys) -> None:
    damage(root)
    line = one_line_error([{"RUN": str(root), "OUT": str(tmp_path / "out")}.get(w, w) for w in command], capsys)
    for fragment in said:
        assert fragment in line, f"{fragment!r} not in:\n{line}"


@pytest.fixture(scope="module")
def indexed(trained, tmp_path_factory):
    """The trained run, annotated and indexed, built once for this module."""
    from atlas.config import config_from_dict
    from atlas.runner import run_stages

    config, run = trained
    root = copy_run_dir(run.root, tmp_path_factory.mktemp("indexed") / "run")
    run_stages(config_from_dict(config.model_dump() | {"run_dir": str(root)}), ["annotate", "index"],
               log=lambda m: None)
    return root


@pytest.fixture
def indexed_copy(indexed, tmp_path):
    return copy_run_dir(indexed, tmp_path / "run")


@pytest.mark.parametrize("damage, command, said", cases(TRAINED))
def test_a_damaged_artifact_of_a_trained_run_is_one_line(run_copy, tmp_path, damage, command, said, capsys):
    check(run_copy, tmp_path, damage, command, said, capsys)


@pytest.mark.parametrize("damage, command, said", cases(INDEXED))
def test_a_damaged_artifact_of_an_indexed_run_is_one_line(indexed_copy, tmp_path, damage, command, said, capsys):
    check(indexed_copy, tmp_path, damage, command, said, capsys)


def test_inspect_index_shows_the_id_map(indexed_copy, capsys):
    """The index stage has the annotate stage's shard count but writes one id map: inspect reads that, and no
    missing part-00001 is asked for."""
    capsys.readouterr()
    assert main(["inspect", str(indexed_copy), "index", "-n", "2"]) == 0
    assert capsys.readouterr().out.count("chunk_id=") == 2


# --- numbers the commands cannot use: refused before anything is read ---------------------------------------------


@pytest.mark.parametrize("argv, said", [
    (["search", "RUN", "q", "-k", "0"], "argument -k: must be at least 1, got 0"),
    (["search", "RUN", "q", "-k", "-1"], "argument -k: must be at least 1, got -1"),
    (["search", "RUN", "q", "--nprobe", "0"], "argument --nprobe: must be at least 1, got 0"),
    (["search", "RUN", "q", "--chars", "0"], "argument --chars: must be at least 1, got 0"),
    (["judge", "RUN", "--sample", "-5"], "argument --sample: must be at least 1, got -5"),
    (["inspect", "RUN", "chunks", "-n", "-1"], "argument -n: must be at least 1, got -1"),
    (["inspect", "RUN", "chunks", "--chars", "0"], "argument --chars: must be at least 1, got 0"),
    (["inspect", "RUN", "chunks", "--random", "-3"], "argument --random: must be at least 0, got -3"),
    (["eval", "library", "RUN", "--sample", "-1"], "argument --sample: must be at least 1, got -1"),
    (["annotate-text", "RUN", "some text", "--top", "-1"], "argument --top: must be at least 0, got -1"),
], ids=["search-k-0", "search-k-negative", "search-nprobe-0", "search-chars-0", "judge-sample-negative",
        "inspect-n-negative", "inspect-chars-0", "inspect-random-negative", "eval-sample-negative",
        "annotate-text-top-negative"])
def test_numbers_a_read_command_cannot_use_are_refused(tmp_path, argv, said, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([str(tmp_path) if w == "RUN" else w for w in argv])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and said in err and "Traceback" not in err, err


# --- a reader that leaves early, a Hub out of reach -----------------------------------------------------------------


def test_a_reader_that_closes_the_pipe_ends_the_command_quietly(run_copy):
    """`atlas inspect RUN chunks | head -1`: the output (146 kB) is more than the pipe holds, so writing meets the
    closed pipe; the command stops without a traceback or "Exception ignored", with status 0 or 141 (SIGPIPE's)."""
    process = subprocess.Popen([sys.executable, "-m", "atlas.cli", "inspect", str(run_copy), "chunks", "-n", "1000",
                                "--chars", "100000"], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert process.stdout.readline().startswith(b"---")
    process.stdout.close()  # as `head -1` does once it has its line
    _, err = finish_process(process, "atlas inspect into a closed pipe", 120)
    assert process.returncode in (0, 141) and not err, err


def test_push_to_hub_without_network_keeps_the_export_and_says_to_rerun(indexed_copy, tmp_path):
    """huggingface_hub lets its HTTP client's connection errors through; the export in OUT is complete and the line
    says so. The Hub is a closed port on this machine, with a token that is never checked."""
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env |= {"HF_ENDPOINT": f"http://127.0.0.1:{port}", "HF_TOKEN": "hf_not_a_real_token",
            "HF_HOME": str(tmp_path / "hf_home")}
    out = tmp_path / "release"
    process = subprocess.Popen([sys.executable, "-m", "atlas.cli", "export", str(indexed_copy), str(out),
                                "--push-to-hub", "atlas-test/offline"], cwd=REPO, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    _, err = finish_process(process, "atlas export --push-to-hub with the Hub out of reach", 180)
    lines = [line for line in err.splitlines() if line.strip()]
    assert process.returncode == 1 and "Traceback" not in err, err
    assert len(lines) == 1 and lines[0].startswith("error: --push-to-hub atlas-test/offline: "), err
    assert f"the export in {out} is complete" in lines[0] and "rerun the same command when online" in lines[0], err
    assert json.loads((out / "export.json").read_text())["chunks"] > 0
