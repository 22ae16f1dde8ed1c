"""What Atlas promises about a user's files and its own results: it deletes or overwrites only what it wrote
(ownership), writes nowhere but the run directory or the named output (containment), gives every document and chunk
an id of its own (identity), never calls a failed stage done, and checks every setting before it deletes anything."""

import hashlib
import json
import os
import shutil
import typing

import pyarrow.parquet as pq
import pytest
import yaml
import zstandard
from conftest import copy_run_dir, write_config, write_jsonl
from fault_server import FaultServer

from atlas.cli import main
from atlas.config import AtlasConfig, load_config
from atlas.core.ownership import OWNER_FILE


def tree_hash(folder) -> dict:
    """Every path under ``folder`` with its bytes' hash (links: their target), to see that nothing changed."""
    out = {}
    for p in sorted(folder.rglob("*")):
        rel = str(p.relative_to(folder))
        if p.is_symlink():
            out[rel] = "-> " + os.readlink(p)
        elif p.is_file():
            out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
        else:
            out[rel] = "dir"
    return out


def cli(argv, capsys) -> tuple[int, str]:
    try:
        code = main([str(a) for a in argv])
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    return code, capsys.readouterr().err


def one_line_error(err: str, *said: str) -> None:
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines and lines[0].startswith("error:"), err
    for text in said:
        assert text in err, err


def user_folder(root):
    """A folder of a user's own files, some with names Atlas uses."""
    root.mkdir(parents=True)
    (root / "thesis.tex").write_text("my thesis")
    (root / "chunks").mkdir()
    (root / "chunks" / "notes.txt").write_text("notes")
    (root / "report").mkdir()
    (root / "report" / "index.html").write_text("<p>my page</p>")
    (root / "export.json").write_text('{"mine": true}')
    (root / "photos").mkdir()
    (root / "photos" / "a.jpg").write_bytes(b"\xff\xd8 jpeg")
    return root


@pytest.fixture()
def docs(tmp_path, demo_records):
    return write_jsonl(tmp_path / "docs.jsonl", demo_records[:6])


@pytest.fixture()
def chunked(tmp_path, docs, capsys):
    config = write_config(tmp_path, docs)
    assert main(["run", str(config), "--inline", "--stages", "chunk"]) == 0
    capsys.readouterr()
    return config, tmp_path / "run"


# --- 1. ownership ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("command", [["run", "--inline", "--stages", "chunk"],
                                     ["run", "--inline", "--stages", "chunk", "--force"],
                                     ["plan", "--stages", "chunk"]])
def test_a_users_folder_as_run_dir_is_refused_and_left_as_it_was(tmp_path, docs, capsys, command):
    folder = user_folder(tmp_path / "mine")
    config = write_config(tmp_path, docs, run_dir=str(folder))
    before = tree_hash(folder)
    code, err = cli([command[0], config, *command[1:]], capsys)
    assert code != 0
    one_line_error(err, str(folder), "not a folder Atlas created")
    assert tree_hash(folder) == before


def test_an_empty_folder_is_fine_and_a_refused_run_leaves_no_record_in_it(tmp_path, docs, capsys):
    folder = tmp_path / "empty"
    folder.mkdir()
    config = write_config(tmp_path, docs, run_dir=str(folder))
    code, err = cli(["run", config, "--inline", "--stages", "vocab"], capsys)  # refused: tag never ran
    assert code != 0 and list(folder.iterdir()) == []
    assert main(["run", str(config), "--inline", "--stages", "chunk"]) == 0
    assert json.loads((folder / OWNER_FILE).read_text())["kind"] == "run"


def test_demo_corpus_does_not_overwrite_a_file_of_the_users(tmp_path, capsys):
    mine = tmp_path / "corpus.jsonl"
    mine.write_text('{"id": 1, "text": "my own corpus"}\n')
    code, err = cli(["demo-corpus", mine], capsys)
    assert code != 0 and "not a demo corpus" in err
    assert mine.read_text() == '{"id": 1, "text": "my own corpus"}\n'


@pytest.mark.parametrize("command", ["report", "eval", "judge", "status", "stage"])
def test_read_commands_do_not_write_into_a_folder_that_only_looks_like_a_run(tmp_path, capsys, command):
    folder = user_folder(tmp_path / "mine")
    stages = {"chunk": {"hash": "0" * 64, "num_shards": 1, "output": "chunks"}}
    (folder / "manifest.json").write_text(json.dumps({"name": "x", "stages": stages, "config": {}}))
    before = tree_hash(folder)
    argv = {"report": ["report", folder], "eval": ["eval", "library", folder], "judge": ["judge", folder],
            "status": ["status", folder], "stage": ["stage", "chunk", "--run-dir", folder, "--shard", "0"]}[command]
    cli(argv, capsys)
    assert tree_hash(folder) == before


def test_force_refuses_to_delete_a_file_a_user_put_into_a_finished_stage(chunked, capsys):
    config, run_dir = chunked
    mine = run_dir / "chunks" / "my-notes.txt"
    mine.write_text("keep me")
    before = tree_hash(run_dir)
    code, err = cli(["run", config, "--inline", "--stages", "chunk", "--force"], capsys)
    assert code != 0
    one_line_error(err, "chunks/my-notes.txt", "did not write")
    assert tree_hash(run_dir) == before
    mine.unlink()
    assert main(["run", str(config), "--inline", "--stages", "chunk", "--force"]) == 0


def test_an_older_atlas_run_without_the_record_is_adopted(chunked, capsys):
    config, run_dir = chunked
    (run_dir / OWNER_FILE).unlink()
    assert main(["run", str(config), "--inline", "--stages", "chunk"]) == 0
    assert (run_dir / OWNER_FILE).exists()


@pytest.fixture(scope="module")
def annotated(annotated_run, tmp_path_factory):
    return copy_run_dir(annotated_run[1].root, tmp_path_factory.mktemp("trust") / "run")


@pytest.mark.parametrize("command", ["export", "export-tokens"])
def test_export_into_a_users_folder_is_refused_and_an_earlier_export_replaced(annotated, tmp_path, capsys, command):
    folder = user_folder(tmp_path / "mine")
    before = tree_hash(folder)
    code, err = cli([command, annotated, folder], capsys)
    assert code != 0
    one_line_error(err, str(folder), "not a folder Atlas created")
    assert tree_hash(folder) == before

    out = tmp_path / "out"
    assert main([command, str(annotated), str(out)]) == 0
    first = tree_hash(out)
    assert main([command, str(annotated), str(out)]) == 0  # an earlier export is Atlas's: replaced
    assert tree_hash(out) == first
    (out / "mine.txt").write_text("a file of mine in the export")  # ... but only what the export wrote goes
    before = tree_hash(out)
    code, err = cli([command, annotated, out], capsys)
    assert code != 0
    one_line_error(err, "mine.txt", "did not write")
    assert tree_hash(out) == before
    inside = annotated / "myexport"
    code, err = cli([command, annotated, inside], capsys)
    assert code != 0 and not inside.exists()


def test_push_to_a_local_folder_of_the_users_is_refused(annotated, tmp_path, capsys):
    folder = user_folder(tmp_path / "mine")
    before = tree_hash(folder)
    code, err = cli(["export", annotated, tmp_path / "out", "--push-to-hub", folder], capsys)
    assert code != 0 and "not a folder Atlas created" in err
    assert tree_hash(folder) == before
    mirror = tmp_path / "mirror"
    for _ in range(2):  # new, then an earlier mirror
        assert main(["export", str(annotated), str(tmp_path / "out"), "--push-to-hub", str(mirror)]) == 0
    assert (mirror / "export.json").exists() and (mirror / OWNER_FILE).exists()


# --- 2. containment --------------------------------------------------------------------------------------------


def test_a_report_folder_linked_elsewhere_is_not_written_through(chunked, tmp_path, capsys):
    _, run_dir = chunked
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "index.html").write_text("somebody else's page")
    shutil.rmtree(run_dir / "report")
    (run_dir / "report").symlink_to(elsewhere)
    before = tree_hash(elsewhere)
    code, err = cli(["report", run_dir], capsys)
    assert code != 0
    one_line_error(err, "outside the run directory", str(elsewhere))
    assert tree_hash(elsewhere) == before


def test_a_stage_folder_linked_out_of_the_run_is_refused_before_anything_runs(chunked, tmp_path, capsys):
    config, run_dir = chunked
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep.txt").write_text("keep")
    (run_dir / "tags").symlink_to(elsewhere, target_is_directory=True)
    before = tree_hash(elsewhere)
    for extra in ([], ["--force"]):
        code, err = cli(["run", config, "--inline", "--stages", "tag", *extra], capsys)
        assert code != 0
        one_line_error(err, "outside the run directory")
        assert tree_hash(elsewhere) == before


def test_atlas_stage_on_a_copied_run_writes_into_the_copy(tmp_path, docs, capsys):
    config = write_config(tmp_path, docs)
    assert main(["plan", str(config), "--stages", "chunk"]) == 0
    original = tmp_path / "run"
    copy = tmp_path / "copy"
    shutil.copytree(original, copy)
    before = tree_hash(original)
    assert main(["stage", "chunk", "--run-dir", str(copy), "--shard", "0"]) == 0
    assert tree_hash(original) == before
    assert (copy / "chunks" / "part-00000.parquet").exists()


# --- 3. identity -----------------------------------------------------------------------------------------------


def chunk_ids(run_dir) -> list[str]:
    return pq.read_table(run_dir / "chunks", columns=["chunk_id"]).column(0).to_pylist()


def doc_ids(run_dir) -> list[str]:
    table = pq.read_table(run_dir / "chunks", columns=["doc_id", "doc_end_flag"])
    return [d for d, end in zip(table.column(0).to_pylist(), table.column(1).to_pylist()) if end]


@pytest.mark.parametrize("id_field", [None, "id"])
def test_same_named_files_in_two_folders_give_unique_ids(tmp_path, demo_records, capsys, id_field):
    data = tmp_path / "data"
    for i, folder in enumerate(["a", "b", "b/c"]):
        (data / folder).mkdir(parents=True)
        write_jsonl(data / folder / "part.jsonl", [{"id": f"doc{j}", "text": r["text"][:2000]}
                                                   for j, r in enumerate(demo_records[3 * i : 3 * i + 3])])
    config = write_config(tmp_path, data, input={"id_field": id_field})
    assert main(["run", str(config), "--inline", "--stages", "chunk"]) == 0
    ids = doc_ids(tmp_path / "run")
    assert len(ids) == 9 and len(set(ids)) == 9, ids
    assert len(set(chunk_ids(tmp_path / "run"))) == len(chunk_ids(tmp_path / "run"))
    assert any("@b/c/part.jsonl:" in i for i in ids)  # the later ones are named by their path, not the file name


def test_an_explicit_id_equal_to_a_generated_one_is_renamed(tmp_path, demo_records, capsys):
    records = [{"text": demo_records[0]["text"][:1000]}, {"id": "docs:0", "text": demo_records[1]["text"][:1000]},
               {"id": "x", "text": demo_records[2]["text"][:1000]}, {"id": "x", "text": demo_records[3]["text"][:500]}]
    config = write_config(tmp_path, write_jsonl(tmp_path / "docs.jsonl", records))
    assert main(["run", str(config), "--inline", "--stages", "chunk"]) == 0
    ids = doc_ids(tmp_path / "run")
    assert sorted(ids) == sorted(["docs:0", "docs:0@docs.jsonl:1", "x", "x@docs.jsonl:3"])


def test_a_new_name_that_is_another_records_id_is_refused(tmp_path, demo_records, capsys):
    records = [{"id": "x", "text": "one. " * 20}, {"id": "x", "text": "two. " * 20},
               {"id": "x@docs.jsonl:1", "text": "three. " * 20}]
    config = write_config(tmp_path, write_jsonl(tmp_path / "docs.jsonl", records))
    code, err = cli(["run", config, "--inline", "--stages", "chunk"], capsys)
    assert code != 0
    one_line_error(err, "docs.jsonl:1", "docs.jsonl:2")


def test_an_input_changed_after_planning_fails_its_shard(tmp_path, demo_records, capsys):
    path = write_jsonl(tmp_path / "docs.jsonl", [{"id": str(i), "text": r["text"][:500]}
                                                  for i, r in enumerate(demo_records[:6])])
    config = write_config(tmp_path, path)
    assert main(["plan", str(config), "--stages", "chunk"]) == 0
    write_jsonl(path, [{"id": str(i), "text": r["text"][:400]} for i, r in enumerate(demo_records[2:9])])
    # `atlas run` finds a changed input by its hash; the SLURM tasks of a plan read it as the plan cut it
    code, err = cli(["stage", "chunk", "--run-dir", tmp_path / "run", "--shard", "0"], capsys)
    assert code != 0 and "has changed since the run planned its shards" in err, err
    assert not (tmp_path / "run" / "chunks" / "_shards").exists()
    assert main(["run", str(config), "--inline", "--stages", "chunk", "--force"]) == 0
    assert len(set(doc_ids(tmp_path / "run"))) == 7


def test_an_input_touched_after_planning_is_still_read_by_atlas_run(tmp_path, demo_records, capsys):
    path = write_jsonl(tmp_path / "docs.jsonl", [{"id": str(i), "text": r["text"][:500]}
                                                  for i, r in enumerate(demo_records[:6])])
    config = write_config(tmp_path, path)
    assert main(["plan", str(config), "--stages", "chunk"]) == 0
    os.utime(path, (1_000_000_000, 1_000_000_000))  # same bytes, another time: `atlas run` hashes it, and goes on
    assert main(["run", str(config), "--inline", "--stages", "chunk"]) == 0
    assert len(doc_ids(tmp_path / "run")) == 6


def test_duplicate_chunk_ids_in_the_parts_are_an_error(tmp_path, demo_records, capsys):
    config = write_config(tmp_path, write_jsonl(tmp_path / "docs.jsonl", demo_records[:4]),
                          input={"docs_per_shard": 2})
    assert main(["run", str(config), "--inline", "--stages", "chunk"]) == 0
    chunks = tmp_path / "run" / "chunks"
    shutil.copy(chunks / "part-00000.parquet", chunks / "part-00001.parquet")
    (chunks / "_SUCCESS").unlink()
    code, err = cli(["run", config, "--inline", "--stages", "chunk"], capsys)
    assert code != 0
    one_line_error(err, "duplicate chunk id", "part-00000.parquet, part-00001.parquet")
    assert not (chunks / "_SUCCESS").exists()


# --- 4. a failure is not done ----------------------------------------------------------------------------------


def test_a_tag_stage_whose_endpoint_is_down_fails_and_runs_again_when_it_is_back(tmp_path, docs, capsys):
    with FaultServer(mode="ok") as server:
        base_url = server.base_url
    llm = {"engine": "openai", "base_url": base_url, "model": "m", "timeout_s": 1.0, "max_retries": 0,
           "backoff_s": 0.01}
    config = write_config(tmp_path, docs, llm=llm)
    code, err = cli(["run", config, "--inline", "--stages", "chunk,tag"], capsys)
    assert code != 0 and "tag.max_failed_share" in err and "failed" in err, err
    assert not (tmp_path / "run" / "tags" / "_SUCCESS").exists()
    status = json.loads((tmp_path / "run" / "manifest.json").read_text())["stages"]["tag"]["status"]
    assert status == "failed"
    with FaultServer(mode="ok") as server:  # the server's address is not part of the stage's identity
        assert main(["run", str(config), "--inline", "--stages", "chunk,tag", "--set",
                     f"llm.base_url={server.base_url}"]) == 0
        assert server.requests
    assert (tmp_path / "run" / "tags" / "_SUCCESS").exists()


def test_a_truncated_zstd_file_is_an_error_that_names_it(tmp_path, demo_records, capsys):
    lines = [json.dumps({"id": str(i), "text": r["text"][:2000]}) + "\n" for i, r in enumerate(demo_records[:40])]
    frames = [zstandard.ZstdCompressor().compress("".join(lines[i : i + 10]).encode()) for i in range(0, 40, 10)]
    packed = b"".join(frames)  # four frames, as streaming writers make them; the file ends inside the third
    path = tmp_path / "docs.jsonl.zst"
    path.write_bytes(packed[: len(frames[0]) + len(frames[1]) + len(frames[2]) // 2])
    config = write_config(tmp_path, path)
    code, err = cli(["run", config, "--inline", "--stages", "chunk"], capsys)
    assert code != 0
    one_line_error(err, f"{path}: truncated: the file ends inside a zstd frame")
    assert not (tmp_path / "run" / "chunks" / "_SUCCESS").exists()


def test_json_that_python_cannot_hold_is_rejected_by_line_and_the_shard_goes_on(tmp_path, capsys):
    records = [{"id": "a", "text": "A fine document. " * 10}, '{"id": "b", "text": "x", "n": ' + "9" * 5000 + "}",
               '{"id": "c", "text": "y", "deep": ' + "[" * 100_000 + "]" * 100_000 + "}",
               {"id": "d", "text": "Another fine document. " * 10}]
    config = write_config(tmp_path, write_jsonl(tmp_path / "docs.jsonl", records))
    assert main(["run", str(config), "--inline", "--stages", "chunk"]) == 0
    assert sorted(doc_ids(tmp_path / "run")) == ["a", "d"]
    rejects = pq.read_table(tmp_path / "run" / "chunks" / "_rejects").to_pylist()
    assert [(r["row"], r["reason"]) for r in rejects] == [(1, "invalid_json"), (2, "invalid_json")]
    assert "digits" in rejects[0]["detail"] and "deeply" in rejects[1]["detail"]


# --- 5. every setting checked before anything is deleted -------------------------------------------------------


@pytest.mark.parametrize("setting", ["library.k=-3", "library.k=0", "library.ks=[]", "library.ks=[1,5]",
                                     "index.nlist=0", "annotator.reservoir_size=0", "library.dedup_taus=[5.0]",
                                     "library.seed=-1", "tag.max_failed_share=2", "llm.max_model_len=0",
                                     "execution.ray_gpus={annotate: -1}", "annotator.aux_min_similarity=3"])
def test_a_value_out_of_range_is_refused_before_force_deletes_anything(chunked, capsys, setting):
    config, run_dir = chunked
    before = tree_hash(run_dir)
    code, err = cli(["run", config, "--inline", "--stages", "chunk", "--force", "--set", setting], capsys)
    assert code == 2
    one_line_error(err, setting.split("=")[0])
    assert tree_hash(run_dir) == before


def _numeric_fields(model, prefix=""):
    for name, field in model.model_fields.items():
        annotation = field.annotation
        args = typing.get_args(annotation)
        nested = next((a for a in (annotation, *args) if isinstance(a, type) and hasattr(a, "model_fields")), None)
        if nested is not None:
            yield from _numeric_fields(nested, f"{prefix}{name}.")
            continue
        if typing.get_origin(annotation) in (list, dict) or any(typing.get_origin(a) in (list, dict) for a in args):
            inner = typing.get_args(next(a for a in (annotation, *args) if typing.get_origin(a) in (list, dict)))[-1]
            if typing.get_origin(inner) is typing.Annotated:
                yield f"{prefix}{name}[]", typing.get_args(inner)[0], typing.get_args(inner)[1].metadata
            elif inner in (int, float):
                yield f"{prefix}{name}[]", inner, []
            elif isinstance(inner, type) and hasattr(inner, "model_fields"):
                yield from _numeric_fields(inner, f"{prefix}{name}[].")
            continue
        if annotation in (int, float) or any(a in (int, float) for a in args):
            yield prefix + name, annotation, field.metadata


def test_every_numeric_setting_has_a_range():
    unbounded = [name for name, _, metadata in _numeric_fields(AtlasConfig) if not metadata]
    assert unbounded == []


def test_a_section_given_twice_is_refused_with_its_line(tmp_path, docs):
    path = tmp_path / "twice.yaml"
    path.write_text(f"input:\n  path: {docs}\nlibrary:\n  k: 20\nlibrary:\n  seed: 3\n")
    with pytest.raises(Exception, match=r"'library' is given twice .*line 3") as caught:
        load_config(path)
    assert "line 5" in str(caught.value)


def test_a_run_dir_with_a_tilde_is_in_the_home_folder(tmp_path, docs, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"run_dir": "~/runs/x", "input": {"path": str(docs)}}))
    assert load_config(path).run_dir == str(tmp_path / "home" / "runs" / "x")


def test_a_run_dir_inside_the_input_folder_is_refused(tmp_path, docs, capsys):
    config = write_config(tmp_path, tmp_path, run_dir=str(tmp_path / "run"))
    code, err = cli(["run", config, "--inline", "--stages", "chunk"], capsys)
    assert code == 2
    one_line_error(err, "inside the input folder")
    assert not (tmp_path / "run").exists()


# --- no command writes outside its run directory or its named output --------------------------------------------


def _hostile_run(annotated, world, hostile: str):
    """``world/parent/run``: a copy of a finished run made hostile, beside decoys and a home folder of the user's."""
    home, parent = world / "home", world / "parent"
    home.mkdir(parents=True)
    (home / "notes.txt").write_text("the user's notes")
    run = copy_run_dir(annotated, parent / "run")
    decoy = user_folder(parent / "decoy")
    if hostile == "links":  # links out of the run where commands write: the report, the caches, a stage's rejects
        shutil.rmtree(run / "report")
        (run / "report").symlink_to(decoy / "report", target_is_directory=True)
        shutil.copytree(run / "_cache", decoy / "_cache")
        shutil.rmtree(run / "_cache")
        (run / "_cache").symlink_to(decoy / "_cache", target_is_directory=True)
        (run / "tags" / "_rejects").symlink_to(home, target_is_directory=True)
    else:  # a received run whose manifest names the folder it came from, and a file name that climbs
        original = user_folder(parent / "original")
        manifest = json.loads((run / "manifest.json").read_text())
        manifest["config"]["run_dir"] = str(original)
        manifest["name"] = "../../escape"
        (run / "manifest.json").write_text(json.dumps(manifest))
    return home, parent, run


@pytest.mark.parametrize("hostile", ["links", "manifest"])
def test_no_command_writes_outside_its_run_or_output(annotated, tmp_path, monkeypatch, capsys, hostile):
    world = tmp_path / "world"
    home, parent, run = _hostile_run(annotated, world, hostile)
    from atlas.models.embedder import cache_root

    monkeypatch.setenv("ATLAS_CACHE", str(cache_root()))  # where this machine's models are unpacked: Atlas's own
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(parent)
    config = parent / "config.yaml"  # the run's own config, as its user would keep it
    settings = json.loads((annotated / "manifest.json").read_text())["config"]
    config.write_text(yaml.safe_dump(settings | {"run_dir": str(run), "run_url": None}))
    outputs = [parent / "out", parent / "tokens-out", parent / "mirror", parent / ".mirror.publish.tmp"]
    commands = [["status", run], ["status", run, "--json"], ["inspect", run, "chunks", "-n", "2"],
                ["inspect", run, "library", "-n", "2"], ["inspect", run, "tags", "-n", "1"], ["report", run],
                ["eval", "library", run], ["eval", "annotator", run], ["judge", run, "--sample", "3"],
                ["run", config, "--inline", "--stages", "annotate,tokenize,index"],
                ["search", run, "a query", "-k", "2"], ["annotate-text", run, "a text about numbers"],
                ["export", run, outputs[0], "--push-to-hub", outputs[2]], ["export-tokens", run, outputs[1]],
                ["stage", "annotate", "--run-dir", run, "--shard", "0"]]

    def outside() -> dict:
        return {k: v for k, v in tree_hash(world).items()
                if not any(k == str(p.relative_to(world)) or k.startswith(str(p.relative_to(world)) + "/")
                           for p in (run, *outputs))}

    before = outside()
    said = {" ".join(str(a) for a in argv): cli(argv, capsys) for argv in commands}
    codes = {argv: code for argv, (code, _) in said.items()}
    assert outside() == before
    if hostile == "links":  # refused at once, but annotate-text, which writes nothing
        assert [argv for argv, code in codes.items() if code == 0] == [f"annotate-text {run} a text about numbers"]
    else:  # the manifest's own folder is not where they work: they work, in the run given
        assert [err for code, err in said.values() if code] == []


def test_a_bucket_object_replaced_after_planning_fails_its_shard(s3, tmp_path, demo_records, capsys):
    from conftest import BUCKET

    def upload(records):
        s3.pipe(f"{BUCKET}/replaced/docs.jsonl", "".join(json.dumps(r) + "\n" for r in records).encode())

    upload([{"id": str(i), "text": r["text"][:500]} for i, r in enumerate(demo_records[:6])])
    config = write_config(tmp_path, f"s3://{BUCKET}/replaced/docs.jsonl")
    assert main(["plan", str(config), "--stages", "chunk"]) == 0
    upload([{"id": str(i), "text": r["text"][:300]} for i, r in enumerate(demo_records[3:10])])
    code, err = cli(["stage", "chunk", "--run-dir", tmp_path / "run", "--shard", "0"], capsys)
    assert code != 0 and "replaced/docs.jsonl: has changed since the run planned its shards" in err, err
