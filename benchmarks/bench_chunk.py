"""Chunker throughput against the floor of its two library calls, measured in the same process.

    python benchmarks/bench_chunk.py [--corpus ../shared/data/dev/corpus.parquet] [--repeats 3] [--json PATH]

floor   = BlingFire sentence split + tiktoken ``encode_ordinary`` of every document (the least any
          sentence chunker that counts cl100k tokens must do)
chunker = atlas' Chunker.split on every document, in both token-count modes

Runs alternate and the best of ``--repeats`` is kept, so machine noise hits both sides alike.
Prints MB/s and the ratio chunker / floor (goal: at least 0.6).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import blingfire
import pyarrow.parquet as pq
from _results import add_json_option, row, write_json

from atlas.config import ChunkConfig
from atlas.core.stats import Stats
from atlas.stages.chunk import Chunker

DEFAULT_CORPUS = Path(__file__).resolve().parents[2] / "shared" / "data" / "dev" / "corpus.parquet"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS)
    parser.add_argument("--repeats", type=int, default=3)
    add_json_option(parser)
    args = parser.parse_args()
    if not args.corpus.exists():
        raise SystemExit(f"{args.corpus} not found: pass --corpus PATH (a Parquet file with text and domain columns)")

    records = pq.read_table(args.corpus, columns=["text", "domain"]).to_pylist()
    megabytes = sum(len(r["text"].encode()) for r in records) / 1e6
    config = ChunkConfig()
    exact = Chunker(config.max_sentence_tokens, exact_token_counts=True)
    in_context = Chunker(config.max_sentence_tokens, exact_token_counts=False)
    enc = exact.enc

    def floor():
        for r in records:
            blingfire.text_to_sentences(r["text"])
            enc.encode_ordinary(r["text"])

    def chunk_with(chunker):
        def run():
            for r in records:
                chunker.split(r["text"], config.for_domain(r["domain"]), Stats())
        return run

    candidates = {"floor": floor, "chunker (exact n_tokens)": chunk_with(exact),
                  "chunker (in-context n_tokens)": chunk_with(in_context)}
    best = {name: float("inf") for name in candidates}
    for _ in range(args.repeats):
        for name, fn in candidates.items():
            start = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - start)

    print(f"corpus: {args.corpus} ({len(records)} documents, {megabytes:.2f} MB), best of {args.repeats}")
    print(f"{'':32} {'MB/s':>8} {'vs floor':>9}")
    for name, seconds in best.items():
        print(f"{name:32} {megabytes / seconds:8.2f} {best['floor'] / seconds:9.2f}")
    write_json(args.json, [
        row("chunk", name.removeprefix("chunker (").removesuffix(")"), megabytes / best[name],
            megabytes / best["floor"], "MB/s", "floor: BlingFire split + tiktoken encode",
            note=f"goal >= 0.6; {len(records)} docs, {megabytes:.1f} MB")
        for name in best if name != "floor"])


if __name__ == "__main__":
    main()
