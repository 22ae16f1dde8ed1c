"""Auxiliary concept domains (paper 4.2.3): tone, demographic reference, alignment-relevant.

Unlike content concepts, which come out of clustering, each auxiliary domain is a finite list of
labels in ``schemas/aux/<domain>.json`` (name + one-sentence description, at most ``max_labels``
per chunk). The same engines annotate them:

- an LLM (``openai``, ``vllm``) is shown the lists and picks which labels apply, answering JSON
  constrained to the lists (``prompts/aux.yaml``), with ``"none"`` as the answer that abstains;
  answers are validated, retried and cached like tags;
- offline, each label's "name: description" is embedded and compared with the chunk.

**Abstain unless the evidence beats a null.** A demographic or alignment label, or a tone other than the
expository ones (``"expository": true``: neutral, technical, instructional, explanatory, ...), must stay off
neutral, technical text: a licence refers to no religion, a debugger's documentation to no self-harm. Such a
label is *calibrated against a null* (``atlas.io.neutral_text``: API documentation, licence terms, a
changelog): its threshold is the score that the null's texts reach (``null_thresholds``: their highest by
default), and a chunk gets the label only above it. Offline the score is the embedding similarity; for the
annotator it is the calibrated probability (``atlas.stages.train_annotator``), so the LLM's labels, learned by
the annotator, go through the same kind of threshold. Offline, a chunk that reads like the null (its nearest null
text at cosine ``aux_null_nearest`` or more, ``reads_like_null``) gets none of these labels at all: on such text
a zero-shot score is noise (a licence clause "proud", a documentation link "women, workers").

An expository tone is compared with the chunks being labeled instead (raw cosines are not comparable across
labels): it applies when its similarity is ``min_z`` standard deviations above that label's mean. Every label
needs at least ``min_similarity``, and a chunk where no label passes gets none.

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
    sensitive: bool = False  # every label marks a group of people or a risk (demographic, alignment)

    @property
    def null_checked(self) -> list[bool]:
        """Per label: whether it must stay off neutral, technical and expository text (the null). A label marked
        ``"expository": true`` (a tone such as ``technical`` or ``neutral``) may describe that text; every other
        label is calibrated against the null."""
        return [not label.get("expository", False) for label in self.labels]

    @property
    def sensitive_names(self) -> list[str]:
        """The labels a publisher checks by hand: every label of a sensitive domain, and the emotional tones
        (``"emotional": true``: an emotion or attitude, such as ``angry`` or ``sarcastic``)."""
        return [label["name"] for label in self.labels if self.sensitive or label.get("emotional", False)]

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
            if bad := [k for k in ("expository", "emotional") if not isinstance(label.get(k, False), bool)]:
                raise SchemaError(f"{path}: labels[{i}] ({label['name']}): {bad[0]!r} must be true or false")
            if label.get("expository") and label.get("emotional"):
                raise SchemaError(f"{path}: labels[{i}] ({label['name']}) cannot be both expository and emotional")
        names_seen = [label["name"] for label in labels]
        if ABSTAIN in names_seen:
            raise SchemaError(f"{path}: {ABSTAIN!r} is the answer that abstains, not a label name")
        if duplicates := sorted({n for n in names_seen if names_seen.count(n) > 1}):
            raise SchemaError(f"{path}: duplicate label names {duplicates}")
        max_labels, min_labels = int(data.get("max_labels", 3)), int(data.get("min_labels", 0))
        if not 0 <= min_labels <= max_labels:
            raise SchemaError(f"{path}: need 0 <= min_labels <= max_labels, got {min_labels} and {max_labels}")
        if not isinstance(data.get("sensitive", False), bool):
            raise SchemaError(f"{path}: 'sensitive' must be true or false")
        domains.append(AuxDomain(name, str(data.get("description", "")), labels, max_labels, min_labels, path,
                                 bool(data.get("sensitive", False))))
    return domains


def configured_domains(config) -> list[AuxDomain]:
    """The auxiliary domains an ``AtlasConfig`` asks for (``library.aux_domains``), from its schema folder."""
    return load_aux_domains(config.library.aux_domains, config.tag.schema_dir)


def list_hashes(domains: list[AuxDomain]) -> dict[str, str]:
    """The sha256 of each domain's list file: part of the identity of every stage whose output the lists decide
    (library: the labels' ids and names; targets: which labels a chunk gets)."""
    return {d.name: sha256_bytes(d.path.read_bytes()) for d in domains}


ABSTAIN = "none"  # the LLM's answer for a list of which nothing clearly applies


def answer_schema(domains: list[AuxDomain]) -> TagSchema:
    """The JSON schema of an LLM's answer: per domain, a list of label names from the domain's list, or
    ``["none"]`` (at least one entry, so abstaining is a choice the model makes, not a list it forgot)."""
    schema = {
        "type": "object", "additionalProperties": False, "required": [d.name for d in domains],
        "properties": {d.name: {"type": "array", "description": d.description,
                                "items": {"enum": [*d.names, ABSTAIN]}, "minItems": max(1, d.min_labels),
                                "maxItems": d.max_labels, "uniqueItems": True}
                       for d in domains},
    }
    return TagSchema("aux", schema, Draft202012Validator(schema))


def chosen_labels(answer: list[str]) -> list[str]:
    """The labels an answer gives: none when it abstains, also when it abstains beside a label (it contradicts
    itself, and a label that may be wrong is better absent)."""
    return [] if ABSTAIN in answer else list(answer)


def describe_lists(domains: list[AuxDomain]) -> str:
    """The candidate lists as the prompt shows them."""
    blocks = []
    for d in domains:
        lines = "\n".join(f"  - {label['name']}: {label['description']}" for label in d.labels)
        blocks.append(f"{d.name} ({d.description} Pick up to {d.max_labels}, or \"{ABSTAIN}\".)\n{lines}")
    return "\n\n".join(blocks)


def null_thresholds(null_scores: np.ndarray, domain: AuxDomain, quantile: float, floor: float) -> np.ndarray:
    """Per label of ``domain``, the score a chunk must beat: for a null-checked label the ``quantile`` of its
    scores over the null's texts (``null_scores`` [texts, labels]; 1.0: the highest), at least ``floor``; for an
    expository label ``floor`` alone. Raises on an empty null: with nothing to compare, no label is safe."""
    if null_scores.shape[0] == 0:
        raise ValueError("the null of the auxiliary labels is empty: no neutral text to calibrate against")
    checked = np.array(domain.null_checked)
    reached = np.quantile(null_scores, quantile, axis=0) if quantile < 1 else null_scores.max(axis=0)
    return np.where(checked, np.maximum(reached, floor), floor).astype(np.float32)


def reads_like_null(chunks: np.ndarray, null: np.ndarray, max_similarity: float) -> np.ndarray:
    """Per chunk (rows of L2-normalized ``chunks``), whether its nearest null text is at cosine ``max_similarity``
    or more: such a chunk is technical text of the null's kind (a licence clause, an API reference, a changelog
    entry), and a label score it reaches is the noise of a short or formulaic text, not evidence."""
    if len(chunks) == 0 or len(null) == 0:
        return np.zeros(len(chunks), dtype=bool)
    return (chunks @ null.T).max(axis=1) >= max_similarity


def calibrated_labels(similarity: np.ndarray, domain: AuxDomain, min_z: float, thresholds: np.ndarray,
                      column_stats: tuple[np.ndarray, np.ndarray] | None = None,
                      like_null: np.ndarray | None = None) -> list[list[tuple[int, float]]]:
    """Offline decision for one domain: ``similarity`` [chunks, labels] -> per chunk (label index, cosine).

    A null-checked label applies when its cosine is above its threshold (``null_thresholds``) and the chunk does
    not read like the null itself (``like_null``, per chunk: see ``reads_like_null``). An expository label applies
    when its cosine reaches its threshold (the floor) and its z-score over the chunks (standardized per column, so
    a description close to everything does not fire everywhere) reaches ``min_z``. At most max_labels per chunk,
    highest z first; none when no label passes.
    ``column_stats``: the (mean, std) of each column over all the chunks, when ``similarity`` is a block of them.
    """
    if similarity.shape[0] == 0:
        return []
    mean, std = column_stats if column_stats is not None else (similarity.mean(axis=0), similarity.std(axis=0))
    z = (similarity - mean) / (std + 1e-6)
    checked = np.array(domain.null_checked)
    beats_null = similarity > thresholds
    if like_null is not None:
        beats_null &= ~np.asarray(like_null, dtype=bool)[:, None]
    passes = np.where(checked, beats_null, (similarity >= thresholds) & (z >= min_z))
    # All rows at once (a loop of per-row argsorts was most of the targets stage's time): each row's passing
    # labels by z, best first, at most max_labels.
    order = np.argsort(-np.where(passes, z, -np.inf), axis=1, kind="stable")[:, :domain.max_labels]
    kept = np.take_along_axis(passes, order, axis=1)
    sim_top = np.take_along_axis(similarity, order, axis=1)
    return [[(j, s) for j, s, ok in zip(labels, cosines, row) if ok]
            for labels, cosines, row in zip(order.tolist(), sim_top.tolist(), kept.tolist())]
