"""The relevance judge (paper 4.2, prompt in appendix C, Figure 32).

Scores (tag, chunk) pairs from 1 (absent) to 5 (central), several tags of one chunk per request.
A score of 2 or more counts as success. With an LLM engine it uses the paper's prompt; with the
offline engine it is an embedding-similarity **proxy**, and every output says so.

    atlas judge RUN [--sample 200] [--set llm.engine=openai --set llm.base_url=...]

writes ``RUN/report/tag_relevance.json`` and histograms of per-chunk and per-tag averages
(``tag_relevance_per_chunk.png``, ``tag_relevance_per_tag.png``).
"""

from __future__ import annotations

import json
import random
import string
from collections import defaultdict
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from atlas.config import PROJECT_ROOT, AtlasConfig
from atlas.core.files import atomic_write_json
from atlas.core.rundir import RunDir
from atlas.llm.engine import LLMRequest
from atlas.llm.prompts import load_prompt
from atlas.report import histogram

MAX_CONCEPTS_PER_REQUEST = 26  # letters A-Z


def judge_schema(n: int) -> dict:
    letters = string.ascii_uppercase[:n]
    return {"type": "object", "additionalProperties": False, "required": list(letters),
            "properties": {c: {"type": "integer", "minimum": 1, "maximum": 5} for c in letters}}


def _requests(samples: list[tuple[str, str, list[str]]], prompt) -> list[LLMRequest]:
    requests = []
    for chunk_id, text, tags in samples:
        listing = "\n".join(f"{string.ascii_uppercase[i]}. {tag}" for i, tag in enumerate(tags))
        requests.append(LLMRequest(
            key=chunk_id, system=prompt.templates["system"],
            user=prompt.render("user", text_chunk=text, concepts_with_descriptions=listing),
            schema=judge_schema(len(tags)), schema_name="relevance",
            context={"task": "judge", "text": text, "concepts": tags},
        ))
    return requests


def _parse_scores(text: str | None, n: int) -> list[int] | None:
    try:
        data = json.loads(text or "")
        scores = [int(data[c]) for c in string.ascii_uppercase[:n]]
    except (ValueError, KeyError, TypeError):
        return None
    return scores if all(1 <= s <= 5 for s in scores) else None


def judge_tags(config: AtlasConfig, sample: int = 200, seed: int = 0, batch_size: int = 64) -> dict:
    """Judge the tags of ``sample`` random tagged chunks; returns (and writes) the summary."""
    run = RunDir(config.run_dir)
    tags = pq.read_table(run.output_dir("tags"), columns=["chunk_id", "tag_norm"]).to_pylist()
    by_chunk: dict[str, list[str]] = defaultdict(list)
    for row in tags:
        if row["tag_norm"] not in by_chunk[row["chunk_id"]]:
            by_chunk[row["chunk_id"]].append(row["tag_norm"])
    chosen = sorted(random.Random(seed).sample(sorted(by_chunk), min(sample, len(by_chunk))))
    from atlas.stages.chunk import read_chunks

    chunks = read_chunks(run, set(chosen))
    samples = [(c, chunks[c]["chunk_text"], by_chunk[c][:MAX_CONCEPTS_PER_REQUEST]) for c in chosen]

    return judge_pairs(config, samples, batch_size, what="tag", report=run.root / "report")


def judge_pairs(config: AtlasConfig, samples: list[tuple[str, str, list[str]]], batch_size: int = 64,
                what: str = "concept", report: Path | None = None) -> dict:
    """Score (item, chunk) pairs: ``samples`` holds (chunk id, chunk text, items). Writes the summary
    and histograms to ``report`` when given (``<what>_relevance.json`` and two PNGs)."""
    from atlas.stages.tag import tag_engine

    prompt = load_prompt(PROJECT_ROOT / "prompts" / "judge_relevance.yaml",
                         {"system": set(), "user": {"text_chunk", "concepts_with_descriptions"}})
    engine = tag_engine(config)
    engine.setup()
    proxy = config.llm.engine == "offline"
    per_chunk, per_item, all_scores, failed = {}, defaultdict(list), [], 0
    try:
        for start in range(0, len(samples), batch_size):
            batch = samples[start : start + batch_size]
            for (chunk_id, _, items), result in zip(batch, engine.generate(_requests(batch, prompt))):
                scores = _parse_scores(result.text, len(items))
                if scores is None:
                    failed += 1
                    continue
                per_chunk[chunk_id] = float(np.mean(scores))
                for item, score in zip(items, scores):
                    per_item[item].append(score)
                all_scores.extend(scores)
    finally:
        engine.close()

    scores = np.array(all_scores, dtype=float)
    item_means = [float(np.mean(v)) for v in per_item.values()]
    summary = {
        "judge": "embedding-similarity PROXY (offline engine), not an LLM judge" if proxy else
                 f"LLM judge: {config.llm.model} via {config.llm.engine}",
        "is_proxy": proxy,
        "chunks_judged": len(per_chunk), "chunks_failed": failed, "pairs": int(scores.size),
        "mean_score": float(scores.mean()) if scores.size else None,
        "success_rate": float((scores >= 2).mean()) if scores.size else None,  # paper: a score >= 2 is success
        "per_chunk_mean_success_rate": float(np.mean([m >= 2 for m in per_chunk.values()])) if per_chunk else None,
        "score_counts": {str(s): int((scores == s).sum()) for s in range(1, 6)},
        "unique_items": len(per_item),
    }
    if report is None:
        return summary
    label = " (proxy)" if proxy else ""
    if per_chunk:
        bins = np.linspace(1, 5, 17)
        histogram(list(per_chunk.values()), report / f"{what}_relevance_per_chunk.png",
                  f"{what} relevance per chunk{label}", "average relevance (1-5)", bins)
        histogram(item_means, report / f"{what}_relevance_per_{what}.png", f"{what} relevance per {what}{label}",
                  "average relevance (1-5)", bins)
    atomic_write_json(report / f"{what}_relevance.json", summary)
    return summary
