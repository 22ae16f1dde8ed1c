"""The tokenize stage: [BOS] + tokens + [EOC] per chunk, <|endoftext|> after a document's last one."""

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from conftest import write_config

from atlas.config import load_config
from atlas.core.rundir import RunDir
from atlas.io.tokens import INDEX_SCHEMA, STREAM
from atlas.models.tokenizer import BOS, ENDOFTEXT, EOC, cl100k
from atlas.stages.tokenize import TokenizeStage, chunk_stream


def test_chunk_stream_takes_arrays_and_lists_alike():
    arrays = [np.array(ids, dtype=np.uint32) for ids in ([5, 6], [], [7])]
    for tokens, doc_end in ((arrays, np.array([False, False, True])), ([[5, 6], [], [7]], [False, False, True])):
        stream, spans = chunk_stream(tokens, doc_end)
        assert stream.dtype == np.uint32
        assert stream.tolist() == [BOS, 5, 6, EOC, BOS, EOC, BOS, 7, EOC, ENDOFTEXT]
        assert spans.tolist() == [[0, 4], [4, 6], [6, 10]]
    stream, spans = chunk_stream([], [])
    assert stream.tolist() == [] and spans.shape == (0, 2)


def test_the_stage_writes_each_chunk_as_tiktoken_encodes_it_in_blocks_and_threads(tmp_path):
    texts = ["", "A first chunk.", "Text that spells [BOS] or <|endoftext|> is ordinary text.",
             "Ünïcödé 東京 \U0001F600",
             *(f"Chunk {i} of a longer document, " + "with more words " * (i % 30) for i in range(200))]
    doc_end = [i % 3 == 2 for i in range(len(texts))]
    concepts = [[i % 5, 7] if i % 4 else [] for i in range(len(texts))]
    annotated = pa.table({"chunk_id": [f"d{i // 3}:{i % 3:05d}" for i in range(len(texts))],
                          "doc_id": [f"d{i // 3}" for i in range(len(texts))], "text": texts,
                          "doc_end_flag": doc_end, "concepts": pa.array(concepts, pa.list_(pa.int64()))})
    enc = cl100k()
    expected = []
    for text, last in zip(texts, doc_end):
        expected += [BOS, *enc.encode_ordinary(text), EOC] + ([ENDOFTEXT] if last else [])
    for block_rows, threads in ((7, 1), (64, 3), (8192, 2)):
        (tmp_path / f"{block_rows}").mkdir()
        config = load_config(write_config(tmp_path / f"{block_rows}", tmp_path / "unused.jsonl",
                                          tokenize={"block_rows": block_rows, "threads": threads}))
        run = RunDir(config.run_dir)
        run.part_path("annotated", 0).parent.mkdir(parents=True)
        pq.write_table(annotated, run.part_path("annotated", 0))
        stage = TokenizeStage(config)
        stage.setup()
        stats = stage.run_shard(run, 0)

        stream = np.fromfile(run.output_dir("tokens") / STREAM / "part-00000.u32", dtype="<u4")
        assert stream.tolist() == expected
        index = pq.read_table(run.part_path("tokens", 0))
        assert index.schema == INDEX_SCHEMA
        rows = index.to_pydict()
        assert rows["chunk_id"] == annotated.column("chunk_id").to_pylist() and rows["concepts"] == concepts
        assert rows["n_tokens"] == [len(enc.encode_ordinary(t)) for t in texts]
        for start, end, n, last in zip(rows["token_start"], rows["token_end"], rows["n_tokens"], doc_end):
            assert end - start == n + 2 + last and stream[start] == BOS
        assert rows["token_start"][1:] == rows["token_end"][:-1] and rows["token_end"][-1] == len(stream)
        assert stats["chunks"] == len(texts) and stats["documents"] == sum(doc_end)
        assert stats["text_tokens"] == sum(rows["n_tokens"]) and stats["stream_tokens"] == len(stream)
