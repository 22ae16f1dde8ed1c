"""The relevance judge (paper 4.2, prompt in appendix C, Figure 32).

Scores (item, chunk) pairs from 1 (absent) to 5 (central), several items (tags, concepts) of one chunk
per request. A score of 2 or more counts as success. With an LLM engine it uses the paper's prompt; with
the offline engine it is an embedding-similarity **proxy**, and every output says so. ``atlas judge``
(``atlas.tools.judge``) judges a run's tags with it; the annotator stage and ``atlas eval`` its concepts.
"""

from __future__ import annotations

import json
import string
from collections import defaultdict
from pathlib import Path

import numpy as np

from atlas.config import PROJECT_ROOT, AtlasConfig
from atlas.core.files import atomic_write_json
from atlas.core.plots import histogram
from atlas.llm.engine import LLMRequest
from atlas.llm.prompts import load_prompt

MAX_CONCEPTS_PER_REQUEST = 26  # letters A-Z
SUCCESS_RATE_IS = ("share of the judged ({what}, chunk) pairs scored >= 2 on the 1-5 scale (1 absent, 2 weakly "
                   "present, 3 moderately, 4 strongly, 5 central)")


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


def judge_pairs(config: AtlasConfig, samples: list[tuple[str, str, list[str]]], batch_size: int = 64,
                what: str = "concept", report: Path | None = None) -> dict:
    """Score (item, chunk) pairs: ``samples`` holds (chunk id, chunk text, items). Writes the summary
    and histograms to ``report`` when given (``<what>_relevance.json`` and two PNGs)."""
    from atlas.llm.engine import make_tag_engine

    prompt = load_prompt(PROJECT_ROOT / "prompts" / "judge_relevance.yaml",
                         {"system": set(), "user": {"text_chunk", "concepts_with_descriptions"}})
    engine = make_tag_engine(config)
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
        "success_rate_is": SUCCESS_RATE_IS.format(what=what),
        "per_chunk_mean_success_rate": float(np.mean([m >= 2 for m in per_chunk.values()])) if per_chunk else None,
        "per_chunk_mean_success_rate_is": f"share of the judged chunks whose mean score over their {what}s is >= 2",
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
