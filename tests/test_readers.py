import gzip
import json
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard
from conftest import write_jsonl

from atlas.config import InputConfig
from atlas.io.inputs import RENAMES, ROW_BITS, Document, InputError, Reject, plan_shards, read_shard


def read_all(cfg: InputConfig, folder: Path):
    """Plan (into ``folder``) and read every shard: the plan, the documents and the rejects."""
    folder.mkdir(exist_ok=True)
    plan = plan_shards(cfg, folder)
    items = [item for shard in range(len(plan["shards"])) for item in read_shard(plan, shard, cfg, folder)]
    return plan, [i for i in items if isinstance(i, Document)], [i for i in items if isinstance(i, Reject)]


def test_parquet_is_sharded_by_row_ranges_within_and_across_row_groups(tmp_path):
    n = 1000
    table = pa.table({"doc_id": [f"d{i}" for i in range(n)], "text": [f"text {i}" for i in range(n)]})
    pq.write_table(table, tmp_path / "big.parquet", row_group_size=300)
    cfg = InputConfig(path=str(tmp_path / "big.parquet"), docs_per_shard=128)
    plan, docs, rejects = read_all(cfg, tmp_path / "plan")
    assert len(plan["shards"]) == 8  # one file of 1000 rows still parallelizes
    assert [d.doc_id for d in docs] == [f"d{i}" for i in range(n)]  # every row exactly once, in order
    assert not rejects


def test_jsonl_plain_gz_zst_and_text_folder(tmp_path):
    records = [{"doc_id": f"x{i}", "text": f"document number {i}.", "domain": "math"} for i in range(25)]
    lines = "".join(json.dumps(r) + "\n" for r in records).encode()
    (tmp_path / "a.jsonl").write_bytes(lines)
    (tmp_path / "b.jsonl.gz").write_bytes(gzip.compress(lines))
    (tmp_path / "c.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(lines))
    for name in ("a.jsonl", "b.jsonl.gz", "c.jsonl.zst"):
        plan, docs, _ = read_all(InputConfig(path=str(tmp_path / name), docs_per_shard=10), tmp_path / "plan")
        assert len(plan["shards"]) == 3
        assert [d.text for d in docs] == [r["text"] for r in records]
        assert {d.domain for d in docs} == {"math"}
    folder = tmp_path / "notes"
    (folder / "sub").mkdir(parents=True)
    (folder / "one.txt").write_text("First note.")
    (folder / "sub" / "two.md").write_text("# Second\n\nA note.")
    _, docs, _ = read_all(InputConfig(path=str(folder), default_domain="general"), tmp_path / "plan")
    assert [(d.doc_id, d.domain) for d in docs] == [("one.txt", "general"), ("sub/two.md", "general")]


def test_missing_input_and_corrupt_parquet(tmp_path):
    with pytest.raises(InputError, match="input not found"):
        plan_shards(InputConfig(path=str(tmp_path / "nothing.parquet")))
    with pytest.raises(InputError, match="no input"):
        plan_shards(InputConfig())
    (tmp_path / "garbage.parquet").write_bytes(b"this is not parquet at all" * 10)
    with pytest.raises(InputError, match="garbage.parquet: not a readable Parquet file"):
        plan_shards(InputConfig(path=str(tmp_path / "garbage.parquet")))
    good = tmp_path / "good.parquet"
    pq.write_table(pa.table({"text": ["a" * 50] * 100}), good)
    truncated = tmp_path / "truncated.parquet"
    truncated.write_bytes(good.read_bytes()[:-200])
    with pytest.raises(InputError, match="truncated.parquet: .*corrupt or truncated"):
        plan_shards(InputConfig(path=str(truncated)))


def test_truncated_gzip_names_the_file(tmp_path):
    data = gzip.compress(b"".join(json.dumps({"text": "x" * 100}).encode() + b"\n" for _ in range(2000)))
    (tmp_path / "cut.jsonl.gz").write_bytes(data[: len(data) // 2])
    with pytest.raises(InputError, match="cut.jsonl.gz: cannot decompress"):
        plan_shards(InputConfig(path=str(tmp_path / "cut.jsonl.gz")))


def test_missing_text_column_lists_the_available_ones(tmp_path):
    pq.write_table(pa.table({"doc_id": ["a"], "body": ["hello"], "url": ["u"]}), tmp_path / "x.parquet")
    with pytest.raises(InputError) as err:
        plan_shards(InputConfig(path=str(tmp_path / "x.parquet")))
    message = str(err.value)
    assert "x.parquet: no text column 'text'" in message and "available columns: doc_id, body, url" in message


def test_bad_records_are_rejected_with_file_row_field_and_reason(tmp_path):
    path = tmp_path / "mixed.jsonl"
    path.write_bytes(
        b'{"doc_id": "ok", "text": "fine"}\n'
        b'{"doc_id": "n", "text": null}\n'
        b'{"doc_id": "i", "text": 42}\n'
        b'{"doc_id": "m", "body": "no text field"}\n'
        b'{"doc_id": "u", "text": "bad \xff\xfe bytes"}\n'
        b'{"doc_id": "j", "text": unquoted}\n'
        b'["not", "an", "object"]\n'
    )
    _, docs, rejects = read_all(InputConfig(path=str(path)), tmp_path / "plan")
    assert [d.doc_id for d in docs] == ["ok"]
    got = [(r.row, r.doc_id, r.field, r.reason) for r in rejects]
    assert got == [
        (1, "n", "text", "null_text"),
        (2, "i", "text", "non_string_text"),
        (3, "m", "text", "missing_field"),
        (4, None, "(record)", "invalid_utf8"),
        (5, None, "(record)", "invalid_json"),
        (6, None, "(record)", "invalid_json"),
    ]
    assert all(r.file == str(path) for r in rejects)
    assert rejects[3].detail.startswith("byte 29 of the line")


def test_parquet_null_text_is_rejected_per_row(tmp_path):
    pq.write_table(pa.table({"doc_id": ["a", "b", "c"], "text": ["one", None, "three"]}), tmp_path / "n.parquet")
    _, docs, rejects = read_all(InputConfig(path=str(tmp_path / "n.parquet")), tmp_path / "plan")
    assert [d.doc_id for d in docs] == ["a", "c"]
    assert [(r.row, r.doc_id, r.reason) for r in rejects] == [(1, "b", "null_text")]


@pytest.mark.parametrize("docs_per_shard", [1, 3, 100])
def test_duplicate_ids_are_renamed_the_same_way_however_the_input_is_sharded(tmp_path, docs_per_shard):
    ids = ["a", "b", "a", "c", "a", "b"]
    path = write_jsonl(tmp_path / "dups.jsonl", [{"doc_id": i, "text": f"text {n}"} for n, i in enumerate(ids)])
    _, docs, _ = read_all(InputConfig(path=str(path), docs_per_shard=docs_per_shard), tmp_path / "plan")
    assert [d.doc_id for d in docs] == ["a", "b", "a@dups.jsonl:2", "c", "a@dups.jsonl:4", "b@dups.jsonl:5"]
    assert [d.source_doc_id for d in docs] == ids
    assert len({d.doc_id for d in docs}) == len(ids)


def test_records_without_id_get_a_positional_one_and_metadata_is_kept(tmp_path):
    path = write_jsonl(tmp_path / "plain.jsonl", [{"text": "one", "url": "http://a"}, {"text": "two"}])
    _, docs, _ = read_all(InputConfig(path=str(path), metadata_fields=["url"]), tmp_path / "plan")
    assert [d.doc_id for d in docs] == ["plain:0", "plain:1"]
    assert json.loads(docs[0].metadata) == {"url": "http://a"} and json.loads(docs[1].metadata) == {}
    assert docs[0].data_src == "plain"


def test_text_that_utf8_cannot_write_is_rejected_by_record_with_its_field(tmp_path):
    """A JSON escape gives a lone surrogate ("\\ud83d": half an emoji), which Python holds and UTF-8 cannot write."""
    half = "\ud83d"
    records = [
        {"doc_id": "ok", "text": "A good document.", "url": "http://a"},
        {"doc_id": "t", "text": f"Broken emoji {half} here."},
        {"doc_id": f"id{half}", "text": "Fine text."},
        {"doc_id": "d", "text": "Fine text.", "domain": f"web{half}"},
        {"doc_id": "s", "text": "Fine text.", "data_src": half},
        {"doc_id": "m", "text": "Fine text.", "url": {"parts": ["x", half]}},
        {"doc_id": "ok2", "text": "Whole emoji \U0001F600 is fine."},
    ]
    path = write_jsonl(tmp_path / "crawl.jsonl", records)
    assert "\\ud83d" in path.read_text()  # the escape itself is in the file, as crawls have it
    _, docs, rejects = read_all(InputConfig(path=str(path), metadata_fields=["url"]), tmp_path / "plan")
    assert [d.doc_id for d in docs] == ["ok", "ok2"]
    assert [(r.row, r.doc_id, r.field, r.reason) for r in rejects] == [
        (1, "t", "text", "invalid_unicode"), (2, None, "doc_id", "invalid_unicode"),
        (3, "d", "domain", "invalid_unicode"), (4, "s", "data_src", "invalid_unicode"),
        (5, "m", "url", "invalid_unicode")]
    assert rejects[0].detail == "lone surrogate '\\ud83d' at character 13 (not valid Unicode)"
    assert all(r.file == str(path) for r in rejects)


def test_parquet_string_that_is_not_utf8_is_rejected_by_row(tmp_path):
    """Parquet writers need not check UTF-8; one bad value failed planning or the whole shard with a bare
    UnicodeDecodeError."""
    def strings(values: list[bytes]) -> pa.Array:  # a string column holding the bytes as given, unchecked
        offsets = pa.array([sum(map(len, values[:i])) for i in range(len(values) + 1)], pa.int32())
        data = pa.py_buffer(b"".join(values))
        return pa.Array.from_buffers(pa.string(), len(values), [None, offsets.buffers()[1], data])

    table = pa.table({"doc_id": strings([b"a", b"b\xff", b"c", b"d"]),
                      "text": strings([b"one", b"two", b"bad \xed\xa0\xbd", b"four"]),
                      "url": strings([b"u", b"u", b"u", b"\xc0u"])})
    pq.write_table(table, tmp_path / "w.parquet")
    cfg = InputConfig(path=str(tmp_path / "w.parquet"), metadata_fields=["url"])
    _, docs, rejects = read_all(cfg, tmp_path / "plan")
    assert [d.doc_id for d in docs] == ["a"]
    assert [(r.row, r.doc_id, r.field, r.reason, r.detail) for r in rejects] == [
        (1, None, "doc_id", "invalid_utf8", "byte 1 of the value is not UTF-8"),
        (2, "c", "text", "invalid_utf8", "byte 4 of the value is not UTF-8"),
        (3, "d", "url", "invalid_utf8", "byte 0 of the value is not UTF-8")]


def test_text_folder_bad_bytes_are_rejected_and_a_name_that_is_not_utf8_is_escaped(tmp_path):
    folder = tmp_path / "notes"
    folder.mkdir()
    (folder / "a.txt").write_text("A fine note.")
    (folder / "b.txt").write_bytes(b"Latin-1, not UTF-8: caf\xe9.")
    (Path(os.fsdecode(bytes(folder) + b"/caf\xe9.txt"))).write_text("A note whose name is Latin-1.")
    _, docs, rejects = read_all(InputConfig(path=str(folder)), tmp_path / "plan")
    assert [(r.row, r.field, r.reason, r.detail) for r in rejects] == [
        (1, "(record)", "invalid_utf8", "byte 23 of b.txt")]
    assert [d.doc_id for d in docs] == ["a.txt", "caf\\udce9.txt"]  # writable, and still unique
    assert docs[1].source == "notes:2" and docs[1].text == "A note whose name is Latin-1."
    pa.table({"doc_id": [d.doc_id for d in docs], "source": [d.source for d in docs]})  # Arrow takes them


def test_a_plain_jsonl_shard_starts_at_its_byte_offset_and_reads_no_earlier_line(tmp_path):
    path = write_jsonl(tmp_path / "docs.jsonl", [{"doc_id": f"x{i}", "text": f"document {i}."} for i in range(50)])
    cfg = InputConfig(path=str(path), docs_per_shard=10)
    plan = plan_shards(cfg, tmp_path)
    lines = path.read_bytes().splitlines(keepends=True)
    assert [s["offset"] for s in plan["shards"]] == [len(b"".join(lines[: s["start"]])) for s in plan["shards"]]
    before = list(read_shard(plan, 3, cfg, tmp_path))
    # Every byte before shard 3 becomes garbage, newlines included: shard 3 reads the same records at the same
    # rows, so it never read them (counting lines from the start would now find its records on line 0).
    offset = plan["shards"][3]["offset"]
    planned = path.stat().st_mtime_ns  # the file keeps its size and time: the plan's version check lets it be read
    path.write_bytes(b"\xff" * offset + path.read_bytes()[offset:])
    os.utime(path, ns=(planned, planned))
    assert list(read_shard(plan, 3, cfg, tmp_path)) == before
    assert [d.doc_id for d in before] == [f"x{i}" for i in range(30, 40)] and [d.row for d in before] == list(
        range(30, 40))
    assert isinstance(next(read_shard(plan, 0, cfg, tmp_path)), Reject)  # the garbage is there


def test_duplicate_ids_across_files_are_found_by_spilling_and_the_plan_holds_no_id(tmp_path):
    folder = tmp_path / "input"
    folder.mkdir()
    write_jsonl(folder / "a.jsonl", [{"doc_id": "dup-id", "text": "one"}, {"doc_id": "unique-id", "text": "two"}])
    write_jsonl(folder / "b.jsonl", [{"text": "no id"}, {"doc_id": "dup-id", "text": "three"},
                                     {"doc_id": "dup-id", "text": "four"}])
    cfg = InputConfig(path=str(folder), docs_per_shard=1)
    plan, docs, _ = read_all(cfg, tmp_path / "plan")
    assert [d.doc_id for d in docs] == ["dup-id", "unique-id", "b:0", "dup-id@b.jsonl:1", "dup-id@b.jsonl:2"]
    assert "dup-id" not in json.dumps(plan) and plan["renamed"] == 2
    renamed = pq.read_table(tmp_path / "plan" / RENAMES).column("position").to_pylist()
    assert renamed == [1 << ROW_BITS | 1, 1 << ROW_BITS | 2]  # (file b, rows 1 and 2), sorted
    assert plan_shards(cfg, tmp_path / "plan", scratch_dir=tmp_path / "spill") == plan
    assert not (tmp_path / "spill").exists()  # the spill files are removed
