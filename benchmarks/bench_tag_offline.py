"""Offline tagging throughput against the bare embedder, measured in the same process.

    python benchmarks/bench_tag_offline.py --chunks runs/dev/chunks [--n 512] [--json PATH]

baseline = MiniLM ``encode`` of the chunk texts alone (what any embedding-based tagger pays)
tagger   = the offline engine answering tag requests for the same chunks (chunk embeddings +
           candidate-phrase embeddings + MMR + candidate lists), through the tag stage's requests

Prints chunks/s for both and the ratio tagger / baseline. Run ``atlas run configs/dev.yaml
--stages chunk`` first to have chunks of the dev corpus.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import pyarrow.dataset as ds
from _results import add_json_option, row, write_json

from atlas.config import load_config
from atlas.stages.tag import TagStage


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chunks", type=Path, default=Path("runs/dev/chunks"), help="a run's chunks folder")
    parser.add_argument("--n", type=int, default=512, help="chunks to tag (the first n)")
    parser.add_argument("--batch-size", type=int, default=256)
    add_json_option(parser)
    args = parser.parse_args()
    if not args.chunks.exists():
        raise SystemExit(f"{args.chunks} not found: run `atlas run configs/dev.yaml --stages chunk` first")
    chunks = ds.dataset(args.chunks, format="parquet").head(args.n, columns=["chunk_id", "domain", "chunk_text"])
    chunks = chunks.to_pylist()

    stage = TagStage(load_config(None, [f"tag.batch_size={args.batch_size}"]))
    stage.setup()
    embedder = stage.engine.embedder
    requests = [stage._request(c, 1, None) for c in chunks]
    texts = [c["chunk_text"] for c in chunks]
    embedder.encode(texts[:32])  # warm-up

    def baseline():
        for i in range(0, len(texts), args.batch_size):
            embedder.encode(texts[i : i + args.batch_size])

    def tagger():
        for i in range(0, len(requests), args.batch_size):
            stage.engine.generate(requests[i : i + args.batch_size])

    seconds = {}
    for name, fn in (("baseline: encode chunks", baseline), ("offline tagger", tagger)):
        start = time.perf_counter()
        fn()
        seconds[name] = time.perf_counter() - start
    print(f"{len(chunks)} chunks from {args.chunks}, batch size {args.batch_size}")
    print(f"{'':28} {'chunks/s':>9} {'vs baseline':>12}")
    base = seconds["baseline: encode chunks"]
    for name, s in seconds.items():
        print(f"{name:28} {len(chunks) / s:9.1f} {base / s:12.2f}")
    write_json(args.json, [row("tag_offline", f"{len(chunks)} chunks", len(chunks) / seconds["offline tagger"],
                               len(chunks) / base, "chunks/s", "bare MiniLM encode of the chunks",
                               note=f"batch size {args.batch_size}")])


if __name__ == "__main__":
    main()
