"""``atlas export-tokens RUN OUT --format megatron``: token shards as Megatron-LM indexed datasets (.bin/.idx).

The files are checked with a reader written here from the format (megatron/core/datasets/indexed_dataset.py,
``_IndexWriter``), and, where megatron-core is installed (the dev extra), with Megatron's own reader and writer.
"""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from conftest import SMALL
from test_corpus import copy_run

from atlas.cli import main
from atlas.core.files import ArtifactError, atomic_write_parquet
from atlas.core.ownership import NotOwned
from atlas.core.rundir import RunDir
from atlas.io.tokens import INDEX_SCHEMA, STREAM
from atlas.models.tokenizer import BOS, ENDOFTEXT, EOC
from atlas.runner import run_stages
from atlas.tools.export_tokens import export_tokens


@pytest.fixture(scope="module")
def tokens_run(trained, tmp_path_factory):
    """A copy of ``trained`` with 12 chunks per shard (documents cut at shard ends), annotated and tokenized."""
    _, config = copy_run(trained, tmp_path_factory.mktemp("export_tokens"), **SMALL)
    run = RunDir(config.run_dir)
    for part in sorted(run.output_dir("chunks").glob("part-*.parquet")):
        atomic_write_parquet(part, pq.read_table(part).slice(0, 12))
    run_stages(config, ["annotate", "tokenize"], log=lambda m: None)
    return run


@pytest.fixture(scope="module")
def exported(tokens_run, tmp_path_factory):
    out = tmp_path_factory.mktemp("megatron") / "out"
    return out, export_tokens(tokens_run.root, out)


def read_megatron(prefix: Path) -> dict:
    """An MMIDIDX dataset read from the format alone: the header, the three arrays and the memory-mapped .bin."""
    idx = Path(f"{prefix}.idx").read_bytes()
    assert idx[:9] == b"MMIDIDX\x00\x00"
    version, dtype_code, n_sequences, n_documents = struct.unpack_from("<QBQQ", idx, 9)
    offset = 9 + 8 + 1 + 8 + 8
    lengths = np.frombuffer(idx, "<i4", n_sequences, offset)
    pointers = np.frombuffer(idx, "<i8", n_sequences, offset + 4 * n_sequences)
    documents = np.frombuffer(idx, "<i8", n_documents, offset + 12 * n_sequences)
    assert len(idx) == offset + 12 * n_sequences + 8 * n_documents  # nothing after (no sequence modes)
    tokens = np.memmap(f"{prefix}.bin", dtype="<i4", mode="r")
    return {"version": version, "dtype_code": dtype_code, "lengths": lengths, "pointers": pointers,
            "document_indices": documents, "tokens": tokens,
            "sequences": [tokens[p // 4 : p // 4 + n] for p, n in zip(pointers, lengths)]}


def test_every_document_round_trips_through_the_megatron_files(tokens_run, exported):
    out, summary = exported
    shards = sorted(tokens_run.output_dir("tokens").glob("part-*.parquet"))
    assert summary["shards"] == len(shards) >= 3 and summary["empty_shards_skipped"] == 0
    documents_seen = cut_documents = 0
    for shard, part in enumerate(shards):
        index = pq.read_table(part).to_pydict()
        stream = np.fromfile(tokens_run.output_dir("tokens") / STREAM / part.name.replace(".parquet", ".u32"), "<u4")
        data = read_megatron(out / f"part-{shard:05d}")
        assert data["version"] == 1 and data["dtype_code"] == 4  # int32
        # one sequence per chunk, each its span of the stream, back to back in the .bin
        assert len(data["lengths"]) == len(index["chunk_id"]) == 12
        assert data["lengths"].tolist() == [e - s for s, e in zip(index["token_start"], index["token_end"])]
        assert data["pointers"].tolist() == [4 * s for s in index["token_start"]]
        assert data["tokens"].tobytes() == stream.tobytes()
        for sequence, n_tokens, last in zip(data["sequences"], index["n_tokens"], index["doc_end_flag"]):
            assert sequence[0] == BOS and sequence[-1] == (ENDOFTEXT if last else EOC)
            assert len(sequence) == n_tokens + 2 + last

        # documents: 0, then the sequence after each document's last chunk; the shard's end closes a cut one
        doc_ids = index["doc_id"]
        expected = [0] + [i + 1 for i in range(len(doc_ids))
                          if index["doc_end_flag"][i] or i + 1 == len(doc_ids) or doc_ids[i + 1] != doc_ids[i]]
        assert data["document_indices"].tolist() == expected
        cut_documents += not index["doc_end_flag"][-1]  # 12 chunks cut its last document: still one here
        for first, end in zip(expected[:-1], expected[1:]):
            assert len(set(doc_ids[first:end])) == 1
            document = np.concatenate(data["sequences"][first:end])
            assert document.tolist() == stream[index["token_start"][first] : index["token_end"][end - 1]].tolist()
        documents_seen += len(expected) - 1

        sidecar = pq.read_table(out / f"part-{shard:05d}.concepts.parquet").to_pydict()
        assert sidecar["sequence"] == list(range(12))
        assert sidecar["chunk_id"] == index["chunk_id"] and sidecar["doc_id"] == doc_ids
        assert sidecar["concepts"] == index["concepts"] and any(sidecar["concepts"])
    assert summary["documents"] == documents_seen and summary["sequences"] == 12 * len(shards)
    assert cut_documents > 0

    readme = (out / "README.md").read_text()
    weights = " ".join(f"{s['tokens']} OUT/part-{i:05d}" for i, s in enumerate(summary["per_shard"]))
    assert f"--data-path {weights}\n" in readme and "`[BOS]` = 100278" in readme and "cl100k_base" in readme
    assert sum(s["tokens"] for s in summary["per_shard"]) == summary["tokens"]


def test_a_rerun_gives_the_same_bytes_and_other_folders_are_refused(tokens_run, exported, trained, tmp_path):
    out, _ = exported
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    (out / "part-00099.bin").write_bytes(b"left from a larger run")
    export_tokens(tokens_run.root, out)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before

    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(NotOwned, match="not a folder Atlas created"):
        export_tokens(tokens_run.root, foreign)
    assert (foreign / "notes.txt").read_text() == "mine"
    _, untokenized = trained
    with pytest.raises(FileNotFoundError, match="the tokenize stage has not finished"):
        export_tokens(untokenized.root, tmp_path / "new")


def test_an_empty_shard_is_skipped_and_ids_beyond_int32_are_refused(tokens_run, tmp_path):
    run = RunDir(tmp_path / "run")
    shutil.copytree(tokens_run.root, run.root, ignore=shutil.ignore_patterns("embeddings.zarr", "_cache"))
    streams = run.output_dir("tokens") / STREAM
    atomic_write_parquet(run.part_path("tokens", 1), INDEX_SCHEMA.empty_table())
    (streams / "part-00001.u32").write_bytes(b"")
    summary = export_tokens(run.root, tmp_path / "out")
    assert summary["empty_shards_skipped"] == 1 and [s["prefix"] for s in summary["per_shard"]][:2] == \
        ["part-00000", "part-00002"]
    assert not list((tmp_path / "out").glob("part-00001*"))
    assert " OUT/part-00001" not in (tmp_path / "out" / "README.md").read_text()

    stream = np.fromfile(streams / "part-00002.u32", "<u4")
    damaged = stream.copy()
    damaged[5] = 2**31
    damaged.tofile(streams / "part-00002.u32")
    with pytest.raises(ArtifactError, match=r"part-00002\.parquet: token 5 of its stream is 2147483648, beyond int32"):
        export_tokens(run.root, tmp_path / "out")
    assert not list((tmp_path / "out").glob(".*.tmp"))  # the half-copied .bin is gone
    stream.tofile(streams / "part-00002.u32")
    assert export_tokens(run.root, tmp_path / "out") == summary  # the interrupted export is replaced


def test_the_command_prints_one_line_of_counts(tokens_run, tmp_path, capsys):
    out = tmp_path / "megatron"
    assert main(["export-tokens", str(tokens_run.root), str(out), "--format", "megatron"]) == 0
    summary = json.loads((out / "export_tokens.json").read_text())
    printed = capsys.readouterr().out.strip().splitlines()
    assert printed == [f"{summary['shards']} megatron shard(s): {summary['sequences']:,} sequences (chunks), "
                       f"{summary['documents']:,} documents, {summary['tokens']:,} tokens written to {out} "
                       f"(see {out / 'README.md'})"]
    with pytest.raises(SystemExit) as exit_info:
        main(["export-tokens", str(tokens_run.root), str(tmp_path / "x"), "--format", "bogus"])
    assert exit_info.value.code == 2 and "invalid choice: 'bogus'" in capsys.readouterr().err


def test_megatron_reads_the_export_as_its_own_writer_would_write_it(tokens_run, exported, tmp_path):
    indexed_dataset = pytest.importorskip("megatron.core.datasets.indexed_dataset",
                                          reason="megatron-core is not installed (pip install -e '.[dev]')")
    import torch

    out, summary = exported
    for shard, part in enumerate(sorted(tokens_run.output_dir("tokens").glob("part-*.parquet"))):
        index = pq.read_table(part).to_pydict()
        stream = np.fromfile(tokens_run.output_dir("tokens") / STREAM / part.name.replace(".parquet", ".u32"), "<u4")
        dataset = indexed_dataset.IndexedDataset(str(out / f"part-{shard:05d}"))
        assert len(dataset) == len(index["chunk_id"])
        for i, (start, end) in enumerate(zip(index["token_start"], index["token_end"])):
            assert dataset[i].dtype == np.int32 and dataset[i].tolist() == stream[start:end].tolist()
            assert dataset.get(i, offset=1, length=2).tolist() == stream[start + 1 : start + 3].tolist()
        assert dataset.document_indices.tolist() == read_megatron(out / f"part-{shard:05d}")["document_indices"] \
            .tolist()

        # Megatron's own writer, given the same chunks and document ends, writes the same bytes
        builder = indexed_dataset.IndexedDatasetBuilder(str(tmp_path / f"{shard}.bin"), dtype=np.int32)
        ends = set(dataset.document_indices[1:].tolist())
        for i, (start, end) in enumerate(zip(index["token_start"], index["token_end"])):
            builder.add_item(torch.from_numpy(stream[start:end].astype(np.int64)))
            if i + 1 in ends:
                builder.end_document()
        builder.finalize(str(tmp_path / f"{shard}.idx"))
        for suffix in ("bin", "idx"):
            assert (tmp_path / f"{shard}.{suffix}").read_bytes() == (out / f"part-{shard:05d}.{suffix}").read_bytes()
