"""Auxiliary concept domains (paper 4.2.3): tone, demographic reference, alignment-relevant.

Unlike content concepts, which come out of clustering, each auxiliary domain is a finite list of
labels in ``schemas/aux/<domain>.json`` (name + one-sentence description, at most ``max_labels``
per chunk, at least ``min_labels``). The same engines annotate them:

- an LLM (``openai``, ``vllm``) is shown the lists and picks which labels apply, answering JSON
  constrained to the lists (``prompts/aux.yaml``); answers are validated, retried and cached like tags;
- offline, each label's "name: description" is embedded and compared with the chunk. Raw cosines
  are not comparable across labels (some descriptions sit close to everything), so each label is
  **calibrated** on the chunks being labeled: a label applies when its similarity is ``min_z``
  standard deviations above that label's mean and at least ``min_similarity``. ``min_labels`` is
  what an LLM, which reads the text, is asked for; offline a chunk where no label stands out gets
  none (its best label would be noise: "promotional" on a word problem, "frustrated" on a doctest).

Every label gets a global concept id in the library: ``domain_offsets[domain] + position in the list``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from jsonschema import Draft202012Validator

from atlas.config import PROJECT_ROOT
from atlas.core.files import sha256_bytes
from atlas.llm.answers import SchemaError, TagSchema


@dataclass
class AuxDomain:
    name: str
    description: str
    labels: list[dict]  # {"name", "description"}
    max_labels: int
    min_labels: int
    path: Path

    @property
    def names(self) -> list[str]:
        return [label["name"] for label in self.labels]

    @property
    def texts(self) -> list[str]:
        """What is embedded (offline) for each label."""
        return [f"{label['name']}: {label['description']}" for label in self.labels]


def aux_dir(schema_dir: str | None = None) -> Path:
    return Path(schema_dir or PROJECT_ROOT / "schemas") / "aux"


def load_aux_domains(names: list[str], schema_dir: str | None = None) -> list[AuxDomain]:
    """The auxiliary domains, in the given order; a bad file is an error that names it and the problem."""
    domains = []
    for name in names:
        path = aux_dir(schema_dir) / f"{name}.json"
        if not path.exists():
            raise SchemaError(f"{path}: no candidate list for auxiliary domain {name!r}")
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise SchemaError(f"{path}: not valid JSON: {e}") from None
        labels = data.get("labels") if isinstance(data, dict) else None
        if not isinstance(labels, list) or not labels:
            raise SchemaError(f"{path}: expected an object with a non-empty 'labels' list")
        for i, label in enumerate(labels):
            if not (isinstance(label, dict) and isinstance(label.get("name"), str) and label["name"].strip()
                    and isinstance(label.get("description"), str)):
                raise SchemaError(f"{path}: labels[{i}] needs a non-empty 'name' and a 'description'")
        names_seen = [label["name"] for label in labels]
        if duplicates := sorted({n for n in names_seen if names_seen.count(n) > 1}):
            raise SchemaError(f"{path}: duplicate label names {duplicates}")
        max_labels, min_labels = int(data.get("max_labels", 3)), int(data.get("min_labels", 0))
        if not 0 <= min_labels <= max_labels:
            raise SchemaError(f"{path}: need 0 <= min_labels <= max_labels, got {min_labels} and {max_labels}")
        domains.append(AuxDomain(name, str(data.get("description", "")), labels, max_labels, min_labels, path))
    return domains


def configured_domains(config) -> list[AuxDomain]:
    """The auxiliary domains an ``AtlasConfig`` asks for (``library.aux_domains``), from its schema folder."""
    return load_aux_domains(config.library.aux_domains, config.tag.schema_dir)


def list_hashes(domains: list[AuxDomain]) -> dict[str, str]:
    """The sha256 of each domain's list file: part of the identity of every stage whose output the lists decide
    (library: the labels' ids and names; targets: which labels a chunk gets)."""
    return {d.name: sha256_bytes(d.path.read_bytes()) for d in domains}


def answer_schema(domains: list[AuxDomain]) -> TagSchema:
    """The JSON schema of an LLM's answer: per domain, a list of label names from the domain's list."""
    schema = {
        "type": "object", "additionalProperties": False, "required": [d.name for d in domains],
        "properties": {d.name: {"type": "array", "description": d.description, "items": {"enum": d.names},
                                "minItems": d.min_labels, "maxItems": d.max_labels, "uniqueItems": True}
                       for d in domains},
    }
    return TagSchema("aux", schema, Draft202012Validator(schema))


def describe_lists(domains: list[AuxDomain]) -> str:
    """The candidate lists as the prompt shows them."""
    blocks = []
    for d in domains:
        lines = "\n".join(f"  - {label['name']}: {label['description']}" for label in d.labels)
        blocks.append(f"{d.name} ({d.description} Pick {d.min_labels} to {d.max_labels}.)\n{lines}")
    return "\n\n".join(blocks)


def calibrated_labels(similarity: np.ndarray, domain: AuxDomain, min_z: float, min_similarity: float,
                      column_stats: tuple[np.ndarray, np.ndarray] | None = None) -> list[list[tuple[int, float]]]:
    """Offline decision for one domain: ``similarity`` [chunks, labels] -> per chunk (label index, cosine).

    Each label is standardized over the chunks (z-score per column), so a label whose description is
    close to everything does not fire everywhere. A label applies when z >= min_z and cosine >=
    min_similarity; at most max_labels per chunk (highest z first), and none when no label passes
    (``min_labels`` is not forced offline: see the module docstring).
    ``column_stats``: the (mean, std) of each column over all the chunks, when ``similarity`` is a block of them.
    """
    if similarity.shape[0] == 0:
        return []
    mean, std = column_stats if column_stats is not None else (similarity.mean(axis=0), similarity.std(axis=0))
    std = std + 1e-6
    z = (similarity - mean) / std
    # All rows at once (a loop of per-row argsorts was most of the targets stage's time): each row's best
    # max_labels labels by z, best first, of which those that pass both thresholds are kept.
    order = np.argsort(-z, axis=1, kind="stable")[:, :domain.max_labels]
    z_top = np.take_along_axis(z, order, axis=1)
    sim_top = np.take_along_axis(similarity, order, axis=1)
    passes = (z_top >= min_z) & (sim_top >= min_similarity)
    return [[(j, s) for j, s, ok in zip(labels, cosines, row) if ok]
            for labels, cosines, row in zip(order.tolist(), sim_top.tolist(), passes.tolist())]
