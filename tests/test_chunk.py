import json
import os
import random
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import write_config, write_jsonl

from atlas.config import ChunkConfig, ChunkDomain, load_config
from atlas.core.stats import Stats
from atlas.runner import run_stages
from atlas.stages.chunk import Chunker, _pack

# Every line terminator str.splitlines knows.
LINE_BREAKS = ("\n", "\r\n", "\r", "\v", "\f", "\x1c", "\x1d", "\x1e", "\x85", "\u2028", "\u2029")


@pytest.fixture(scope="module")
def chunker():
    return Chunker(max_sentence_tokens=50_000)


def check_chunks(chunker, text, domain, spans):
    """The contract every chunking must keep."""
    enc = chunker.enc
    position = 0
    for span in spans:
        assert not text[position : span.start].strip(), "only whitespace may fall between chunks"
        piece = text[span.start : span.end]
        if domain is not None and domain.splitter == "lines":  # code keeps the indentation of its first line
            assert piece.strip() and piece == piece.rstrip() and (span.start == 0 or text[span.start - 1] in "".join(
                LINE_BREAKS))
        else:
            assert piece and piece == piece.strip(), "chunks start and end on text"
        assert span.n_tokens == len(enc.encode_ordinary(piece))
        position = span.end
    assert not text[position:].strip()


def test_pack_is_greedy_and_keeps_oversized_units_alone():
    assert _pack([50, 60, 30, 20], 150) == [(0, 3), (3, 4)]
    assert _pack([10, 400, 10, 10], 150) == [(0, 1), (1, 2), (2, 4)]
    assert _pack([], 150) == []


def test_real_documents_keep_the_contract(chunker, demo_records):
    config = ChunkConfig()
    for record in demo_records:
        domain = config.for_domain(record["domain"])
        spans = chunker.split(record["text"], domain, Stats())
        check_chunks(chunker, record["text"], domain, spans)
        if domain.splitter == "lines":  # code: never cut inside a line
            for span in spans:
                assert span.start == 0 or record["text"][span.start - 1] in "".join(LINE_BREAKS)
                assert span.end == len(record["text"]) or record["text"][span.end] in "".join(LINE_BREAKS)


def test_sentences_are_joined_up_to_the_threshold(chunker):
    sentence = "The quick brown fox jumps over the lazy dog again. "
    text = sentence * 40
    spans = chunker.split(text, ChunkDomain(max_tokens=150), Stats())
    per_sentence = len(chunker.enc.encode_ordinary(sentence.strip()))
    assert len(spans) > 1
    for span in spans[:-1]:
        assert 150 - per_sentence - 2 < span.n_tokens <= 150  # full: the next sentence would not fit
    check_chunks(chunker, text, None, spans)


def test_long_sentence_stays_whole_and_huge_sentence_is_dropped(chunker):
    long_sentence = "This sentence goes on " + "and on " * 200 + "until it ends."
    text = f"A short opening sentence. {long_sentence} A short closing sentence."
    spans = chunker.split(text, ChunkDomain(max_tokens=150), Stats())
    assert any(s.n_tokens > 200 and text[s.start : s.end] == long_sentence.strip() for s in spans)

    small = Chunker(max_sentence_tokens=100)
    stats = Stats()
    spans = small.split(text, ChunkDomain(max_tokens=150), stats)
    assert stats["sentences_dropped"] == 1 and stats["sentence_tokens_dropped"] > 200
    assert [text[s.start : s.end] for s in spans] == ["A short opening sentence.", "A short closing sentence."]


def test_unicode_offsets_are_string_offsets(chunker):
    text = "Ünïcödé wörds hère. " * 30 + "Ànd möre: 東京は大きい都市です。" * 10
    spans = chunker.split(text, ChunkDomain(max_tokens=40), Stats())
    assert len(spans) > 3
    check_chunks(chunker, text, None, spans)


def test_code_is_split_at_blank_lines_then_lines(chunker):
    block = "def f{i}(x):\n    y = x * {i}\n    return y + 1\n"
    text = "\n\n".join(block.format(i=i) for i in range(30))
    spans = chunker.split(text, ChunkDomain(max_tokens=60, splitter="lines"), Stats())
    for span in spans:
        piece = text[span.start : span.end]
        assert piece.startswith("def ") and piece.endswith("+ 1"), "whole functions (blocks) per chunk"
    check_chunks(chunker, text, ChunkDomain(max_tokens=60, splitter="lines"), spans)
    one_block = "\n".join(f"x{i} = {i} * {i}" for i in range(200))  # no blank line: cut between lines
    spans = chunker.split(one_block, ChunkDomain(max_tokens=50, splitter="lines"), Stats())
    assert len(spans) > 5 and all(s.n_tokens <= 50 for s in spans)
    check_chunks(chunker, one_block, ChunkDomain(max_tokens=50, splitter="lines"), spans)


def test_the_code_splitter_ends_a_line_at_every_line_terminator(chunker):
    text = "".join(f"x{i} = {i}{end}" for i, end in enumerate(LINE_BREAKS))
    spans = chunker.split(text, ChunkDomain(max_tokens=1, splitter="lines"), Stats())
    assert [text[s.start : s.end] for s in spans] == text.splitlines()


@pytest.mark.parametrize("end", LINE_BREAKS, ids=repr)
def test_code_with_any_line_terminator_is_cut_between_lines(chunker, end):
    """Old-Mac (\r) source was one line: one chunk far over the limit, or dropped whole as a too-long "sentence"."""
    code = end.join(f"x{i} = {i} * {i}" for i in range(200))
    lines = ChunkDomain(max_tokens=50, splitter="lines")
    spans = chunker.split(code, lines, Stats())
    assert len(spans) > 5 and all(s.n_tokens <= 50 for s in spans)
    check_chunks(chunker, code, lines, spans)
    assert "".join(code[s.start : s.end].replace(end, "") for s in spans) == code.replace(end, "")  # whole lines
    stats = Stats()
    assert Chunker(max_sentence_tokens=500).split(code, lines, stats) and stats["sentences_dropped"] == 0


@pytest.mark.parametrize("end", LINE_BREAKS, ids=repr)
def test_the_sentence_splitter_sees_every_line_terminator_as_a_newline(chunker, end):
    lines = ["First sentence.", "Second sentence.", "Third one!", "", "Heading", "", "Para."]
    expected = [s.replace("\n", end) for s in [
        "First sentence.", "Second sentence.", "Third one!", "Heading\n\nPara."]]  # what BlingFire makes of "\n"
    text = end.join(lines)
    spans = chunker.split(text, ChunkDomain(max_tokens=1), Stats())  # each sentence alone
    assert [text[s.start : s.end] for s in spans] == expected


def test_dev_corpus_token_statistics(chunker, dev_corpus):
    """On real multi-domain text, chunk sizes land near the paper's averages (text ~104-158, code ~184-288)."""
    import pyarrow.parquet as pq

    config = ChunkConfig()
    sizes: dict[str, list[int]] = {}
    for record in pq.read_table(dev_corpus).slice(0, 4071).to_pylist()[::4]:
        domain = config.for_domain(record["domain"])
        spans = chunker.split(record["text"], domain, Stats())
        check_chunks(chunker, record["text"], domain, spans)  # n_tokens exact on real text of every domain
        sizes.setdefault(record["domain"], []).extend(span.n_tokens for span in spans)
    means = {d: float(np.mean(v)) for d, v in sizes.items()}
    for domain in ("web", "academic", "qa"):
        assert 80 <= means[domain] <= 150, means
    assert 140 <= means["code"] <= 256 and 120 <= means["math"] <= 256, means


def test_exact_counts_hold_on_text_made_to_break_them(chunker):
    """n_tokens reuses the whole document's tokens between points where a pre-token starts in any context; text
    mixing what cl100k_base splits on (contractions, digits, accents, marks, emoji, odd spaces, special-token
    spellings) must still give len(encode_ordinary(chunk))."""
    rng = random.Random(11)
    # (U+200B is not among them: BlingFire leaves it out between sentences, yet Python does not call it whitespace.)
    pieces = ["word", "Word", " ", "  ", "\n", "\n\n", "\t", "'s", "'LL", "don't", "123", "4567", ".", ",", "!?",
              "(x)", "é", "café", "naïve", "Ω", "e\u0301", "東京", "。", "\U0001F600", "\u00a0", "\u3000",
              "\r\n", "\u2028", "[BOS]", "<|endoftext|>", "x_y", "a-b", "def f():", "    return 1"]
    for _ in range(300):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 120)))
        for domain in (ChunkDomain(max_tokens=12), ChunkDomain(max_tokens=12, splitter="lines")):
            check_chunks(chunker, text, domain, chunker.split(text, domain, Stats()))


def test_threads_sharing_one_chunker_get_what_one_thread_gets(chunker, demo_records):
    """A worker's threads share one Chunker (and so its splitter's buffers, one set per thread)."""
    domain = ChunkDomain(max_tokens=60)
    texts = [r["text"] for r in demo_records[:40]]
    alone = [chunker.split(text, domain, Stats()) for text in texts]
    with ThreadPoolExecutor(4) as pool:
        together = list(pool.map(lambda text: chunker.split(text, domain, Stats()), texts * 3))
    assert together == alone * 3


def test_a_jsonl_input_in_many_shards_gives_the_chunks_of_one_shard(tmp_path, demo_records):
    records = demo_records[:30] + [demo_records[3]]  # the last one repeats an id: renamed, however it is sharded
    path = write_jsonl(tmp_path / "docs.jsonl", records)
    chunks = {}
    for docs_per_shard in (4, 1000):
        folder = tmp_path / f"shards-of-{docs_per_shard}"
        folder.mkdir()
        config = load_config(write_config(folder, path, input={"docs_per_shard": docs_per_shard}))
        run_stages(config, ["chunk"], log=lambda m: None)
        plan = json.loads((folder / "run" / "chunks" / "_plan.json").read_text())
        parts = sorted((folder / "run" / "chunks").glob("part-*.parquet"))
        assert len(parts) == len(plan["shards"]) == -(-len(records) // docs_per_shard)
        chunks[docs_per_shard] = pa.concat_tables([pq.read_table(p) for p in parts])
    assert chunks[4].equals(chunks[1000])
    doc_ids = chunks[4].column("doc_id").to_pylist()
    assert f"{records[3]['id']}@docs.jsonl:30" in doc_ids and len(set(doc_ids)) == len(records)


def test_the_inline_loop_gives_each_shard_every_core(tmp_path, demo_records, monkeypatch):
    """Shards that run at once divide the cores between their encoders; the inline loop runs one at a time, so
    execution.workers does not divide them (with workers 2 on 2 cores, tag and annotate took 1.7x as long)."""
    monkeypatch.setenv("ATLAS_TORCH_THREADS", "unset")  # restored after the test; the runner sets it per stage
    config = load_config(write_config(tmp_path, write_jsonl(tmp_path / "docs.jsonl", demo_records[:6]),
                                      input={"docs_per_shard": 2}, execution={"workers": 2}))
    run_stages(config, ["chunk"], log=lambda m: None)
    assert os.environ["ATLAS_TORCH_THREADS"] == str(os.cpu_count())
