"""``atlas judge RUN``: the relevance judge (paper Fig. 32) on the tags of a sample of tagged chunks.

    atlas judge RUN [--sample 200] [--set llm.engine=openai --set llm.base_url=...]

writes ``RUN/report/tag_relevance.json`` and histograms of per-chunk and per-tag averages
(``tag_relevance_per_chunk.png``, ``tag_relevance_per_tag.png``). The judging itself is
``atlas.models.judge.judge_pairs``.
"""

from __future__ import annotations

import random
from collections import defaultdict

from atlas.config import AtlasConfig
from atlas.core.rundir import RunDir
from atlas.io import layout
from atlas.io.chunks import read_chunks
from atlas.io.tags import read_tags
from atlas.models.judge import MAX_CONCEPTS_PER_REQUEST, judge_pairs


def judge_tags(config: AtlasConfig, sample: int = 200, seed: int = 0, batch_size: int = 64) -> dict:
    """Judge the tags of ``sample`` random tagged chunks; returns (and writes) the summary."""
    run = RunDir(config.run_dir)
    tags = read_tags(run, ["chunk_id", "tag_norm"]).to_pylist()
    by_chunk: dict[str, list[str]] = defaultdict(list)
    for row in tags:
        if row["tag_norm"] not in by_chunk[row["chunk_id"]]:
            by_chunk[row["chunk_id"]].append(row["tag_norm"])
    chosen = sorted(random.Random(seed).sample(sorted(by_chunk), min(sample, len(by_chunk))))
    chunks = read_chunks(run, set(chosen))
    samples = [(c, chunks[c]["chunk_text"], by_chunk[c][:MAX_CONCEPTS_PER_REQUEST]) for c in chosen]

    return judge_pairs(config, samples, batch_size, what="tag", report=run.root / layout.REPORT)
