"""Names and descriptions of concepts (paper 4.2.2): from an LLM, or offline from the evidence tags.

The LLM labeler sees a cluster's most frequent tags with their counts and answers ``{"name", "description"}``
under a JSON schema (``prompts/label_cluster.yaml``). Offline, the name is the cluster's medoid tag (the one
closest, weighted by frequency, to the other representative tags). ``make_unique`` keeps names distinct.
"""

from __future__ import annotations

import json

import numpy as np

from atlas.config import PROJECT_ROOT
from atlas.llm.engine import LLMEngine, LLMRequest
from atlas.llm.prompts import load_prompt

ANSWER_SCHEMA = {
    "type": "object", "additionalProperties": False, "required": ["name", "description"],
    "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 60},
                   "description": {"type": "string", "minLength": 10, "maxLength": 300}},
}


def offline_label(tags: list[str], counts: np.ndarray, vectors: np.ndarray) -> tuple[str, str]:
    """Medoid tag as the name; a description sentence from the other evidence tags."""
    weights = counts / counts.sum()
    centrality = (vectors @ vectors.T) @ weights
    name = tags[int(np.argmax(centrality))]
    others = [t for t in tags if t != name][:3]
    description = f"Text about {name}" + (f", with tags such as {', '.join(others)}." if others else ".")
    return name, description


def label_prompt():
    return load_prompt(PROJECT_ROOT / "prompts" / "label_cluster.yaml", {"system": set(), "user": {"tags"}})


def llm_labels(engine: LLMEngine, evidence: list[list[tuple[str, int]]]) -> list[tuple[str, str] | None]:
    """(name, description) per evidence list from the LLM (an engine that is set up), or None where the answer
    is unusable."""
    prompt = label_prompt()
    requests = [LLMRequest(key=str(i), system=prompt.templates["system"], schema=ANSWER_SCHEMA, schema_name="label",
                           user=prompt.render("user", tags="\n".join(f"- {t} ({n})" for t, n in items)))
                for i, items in enumerate(evidence)]
    answers = []
    for result in engine.generate(requests):
        try:
            data = json.loads(result.text or "")
            name, description = str(data["name"]).strip().lower(), str(data["description"]).strip()
        except (ValueError, KeyError, TypeError):
            answers.append(None)
            continue
        answers.append((name, description) if 1 <= len(name.split()) <= 6 and description else None)
    return answers


def make_unique(names: list[str], alternatives: list[list[str]]) -> list[str]:
    """Names in order of priority; a taken name gets its next alternative tag in parentheses, else a number."""
    taken, out = set(), []
    for name, options in zip(names, alternatives):
        candidate = name
        for option in (o for o in options if o != name):
            if candidate not in taken:
                break
            candidate = f"{name} ({option})"
        suffix = 2
        while candidate in taken:
            candidate, suffix = f"{name} {suffix}", suffix + 1
        taken.add(candidate)
        out.append(candidate)
    return out
