"""Names and descriptions of concepts (paper 4.2.2): from an LLM, or offline from the evidence.

The LLM labeler sees a cluster's most frequent tags with their counts and a few representative chunks (the
paper's label prompt shows both), and answers ``{"name", "description"}`` under a JSON schema
(``prompts/label_cluster.yaml``).

Offline, the name is the cluster's most representative *and* distinctive tag: close to the centroid of the
cluster's frequent tags, far from the nearest other cluster, used often, and the head of the other tags that
name kinds of it (``name_scores``), with a bonus for a tag that is a Library of Congress subject heading
(``library.name_headings``); tags that cannot be
names (a stopword, a number, a repeated word) are never chosen. The description says what the
cluster's chunks share, in their own words: the other evidence tags and a sentence of a representative chunk.
``make_unique`` keeps names distinct.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator

import blingfire
import numpy as np

from atlas.config import PROJECT_ROOT
from atlas.llm.engine import LLMEngine, LLMRequest
from atlas.llm.prompts import load_prompt

ANSWER_SCHEMA = {
    "type": "object", "additionalProperties": False, "required": ["name", "description"],
    "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 60},
                   "description": {"type": "string", "minLength": 10, "maxLength": 300}},
}
EXAMPLE_CHARS = 400  # of each representative chunk shown to the LLM labeler
# A line that is not prose: a Q/A pair's ("Q:", "A:"), a message header's ("Re:", "Subject:") or a quote's (">", "|>")
NOT_PROSE_LINE = re.compile(r"\s*(?:[>|]|(?:[A-Za-z]{1,2}|subject|from|summary|keywords|organization|newsgroups)\s*:)",
                            re.IGNORECASE)
# e-mail addresses and message ids, URLs and paths (also a URL cut at its dots: "com/user/repo"), code (backticks,
# snake_case names, brackets, arrows, comparisons, docstring quotes) and markup
NOT_AN_EXAMPLE = re.compile(r"\S+@\S+|https?://|www\.|[A-Za-z0-9]/[A-Za-z]|`|<\w|\w>|>\w|\w_\w|[\[\]{}]|->|==|'''|\"\"\"")
# What a subject heading among a cluster's top tags adds to its name score: about the margin by which a specific
# member beats the general term a reader would use (on the dev corpus "austrian infantry" 1.005, "army" 0.960).
HEADING_BONUS = 0.1
# What naming the kinds of a cluster's tags adds, per unit of kinds_share: a tag that 30% of the occurrences are
# kinds of gains 0.09, about a heading's bonus. On the dev corpus it renames 43 of 846 clusters, each to the class
# of its members or the same thing ("mississippi river" -> "river", "guinea coup" -> "coup", "masjid assyakirin"
# -> "mosque", "public school" -> "school"); at 0.5 it renamed 65, some to a member ("roger goodell").
KINDS_WEIGHT = 0.3
# Words that never make a name on their own (the tagger's stopwords cover the rest).
NOT_A_NAME = frozenset("none nan null true false na n/a the a an and or of to in is it this that other misc".split())
# Particles of personal names: a name never ends on one ("jean françois de", "ahmed abu", "van de"); it may begin
# with one ("de gaulle", "el salvador").
NAME_PARTICLES = frozenset("de del della der den des di du da das dos van von zu la le al el bin ibn abu".split())


def valid_name(tag: str) -> bool:
    """A usable concept name: has a word of 3+ letters, no repeated word, not a number or a stopword, and does not
    end on a name's particle."""
    words = tag.split()
    return (bool(words) and tag not in NOT_A_NAME and len(set(words)) == len(words)
            and not (len(words) > 1 and words[-1] in NAME_PARTICLES)
            and any(len(w) >= 3 and w.isalpha() for w in words) and not re.fullmatch(r"[\d\s.,%$-]+", tag))


def kinds_share(tags: list[str], counts: np.ndarray) -> np.ndarray:
    """Per tag: the share of the cluster's tag occurrences that name a kind of it, the phrases that end with it as
    their head ("kemena river" and "monongahela river" are rivers; "polish" in "polish commonwealth" is no head)."""
    return np.array([sum(n for other, n in zip(tags, counts) if other.endswith(f" {tag}")) for tag in tags],
                    dtype=float) / max(float(counts.sum()), 1.0)


def name_scores(tags: list[str], vectors: np.ndarray, counts: np.ndarray, other_centroids: np.ndarray) -> np.ndarray:
    """Per tag of one cluster: representative (cosine to the count-weighted centroid) + distinctive (margin over
    the nearest other cluster's centroid) + a little frequency + ``KINDS_WEIGHT`` times ``kinds_share``, so the
    class a cluster's members belong to can name it ("river" rather than "mississippi river"). Vectors are
    L2-normalized."""
    centroid = (counts[:, None] * vectors).sum(axis=0)
    centroid /= np.linalg.norm(centroid) or 1.0
    representative = vectors @ centroid
    nearest_other = (vectors @ other_centroids.T).max(axis=1) if len(other_centroids) else np.zeros(len(vectors))
    return (representative + (representative - nearest_other) + 0.05 * np.log1p(counts)
            + KINDS_WEIGHT * kinds_share(tags, counts))


def offline_name(tags: list[str], counts: np.ndarray, vectors: np.ndarray, other_centroids: np.ndarray,
                 headings: np.ndarray | None = None) -> str:
    """The best-scoring valid tag (``name_scores``); a tag that is a subject heading (``headings``: one bool per
    tag, ``atlas.models.headings``) gets ``HEADING_BONUS``."""
    scores = name_scores(tags, vectors, counts.astype(float), other_centroids)
    if headings is not None:
        scores = scores + HEADING_BONUS * headings
    order = np.argsort(-scores, kind="stable")
    return next((tags[i] for i in order if valid_name(tags[i])), tags[int(order[0])])


def prose(sentence: str) -> bool:
    """Begins with a letter, a digit, a quote or a parenthesis, is mostly letters and spaces and mostly in lower
    case, as a sentence of prose is; a line of code or a formula is not (its brackets, operators and underscores),
    nor a quoted line, ASCII art ("\\ / Repent ...", a signature) or a heading in capitals."""
    letters = sum(c.isalpha() for c in sentence)
    return (bool(sentence) and (sentence[0].isalnum() or sentence[0] in "\"'“‘(")
            and letters + sentence.count(" ") >= 0.85 * len(sentence)
            and sum(c.isupper() for c in sentence) <= 0.5 * letters)


def prose_blocks(text: str) -> Iterator[str]:
    """Runs of consecutive prose lines, each joined into one string: a blank line ends a run, so a title or a
    headline is not glued to the sentence after it ("Nikola Tesla Tesla exhibited ..."), and so does a line that
    is not prose (``NOT_PROSE_LINE``: a question or answer of a Q/A pair, a message header, a quoted line), which
    is left out; a hard-wrapped paragraph's lines are joined."""
    block: list[str] = []
    for line in text.splitlines() + [""]:
        if line.strip() and not NOT_PROSE_LINE.match(line):
            block.append(line)
        elif block:
            yield " ".join(" ".join(block).split())
            block = []


def statements(text: str) -> list[str]:
    """The statements of a text's prose (``prose_blocks``): its sentences (BlingFire's, as the chunker splits) that
    end with "." or "!"; titles, questions and a sentence the chunk cuts off do not end as a statement does."""
    return [s for block in prose_blocks(text) for s in blingfire.text_to_sentences(block).split("\n")
            if s.endswith((".", "!"))]


def example_sentence(texts: list[str], words: list[str], limit: int = 200) -> str | None:
    """The statement of the representative chunks ``texts`` (``statements``) that holds the most of ``words`` (the
    concept's tags, matched as whole words, in the singular or plural), trimmed to ``limit``; None when no statement
    holds any (a sentence about something else, a signature or a quoted header, says nothing about the concept).
    Sentences with an e-mail address, a URL or path, code in backticks or markup, or that are not prose (``prose``:
    this also rules out ASCII art) are never chosen."""
    # tag heads are singular: "prime number" also finds "prime numbers"
    patterns = [re.compile(rf"\b{re.escape(w)}(?:s|es)?\b") for w in dict.fromkeys(words) if w]
    best, best_hits = None, 0
    for text in texts:
        for sentence in statements(text):
            if len(sentence) <= 20 or NOT_AN_EXAMPLE.search(sentence) or not prose(sentence):
                continue
            lowered = sentence.lower()
            hits = sum(bool(p.search(lowered)) for p in patterns)
            if hits > best_hits:
                best, best_hits = sentence, hits
    if best is None:
        return None
    return best if len(best) <= limit else best[: limit - 1].rsplit(" ", 1)[0] + "…"


def offline_description(name: str, evidence: list[str], example: str | None) -> str:
    """What the cluster's chunks share: its other evidence tags and a representative sentence."""
    others = [t for t in evidence if t != name and t not in name][:5]
    parts = [f"{name[0].upper()}{name[1:]}" + (f": {', '.join(others)}." if others else ".")]
    if example:
        parts.append(f'As in "{example}".')
    return " ".join(parts)


def label_prompt():
    return load_prompt(PROJECT_ROOT / "prompts" / "label_cluster.yaml",
                       {"system": set(), "user": {"tags", "examples"}})


def llm_labels(engine: LLMEngine, evidence: list[list[tuple[str, int]]],
               examples: list[list[str]] | None = None) -> list[tuple[str, str] | None]:
    """(name, description) per evidence list (and representative chunk texts) from the LLM (an engine that is
    set up), or None where the answer is unusable."""
    prompt = label_prompt()
    examples = examples or [[] for _ in evidence]
    requests = [LLMRequest(key=str(i), system=prompt.templates["system"], schema=ANSWER_SCHEMA, schema_name="label",
                           user=prompt.render("user", tags="\n".join(f"- {t} ({n})" for t, n in items),
                                              examples="\n".join(f"[{j + 1}] {' '.join(text.split())[:EXAMPLE_CHARS]}"
                                                                 for j, text in enumerate(texts)) or "(none)"))
                for i, (items, texts) in enumerate(zip(evidence, examples))]
    answers = []
    for result in engine.generate(requests):
        try:
            data = json.loads(result.text or "")
            name, description = str(data["name"]).strip().lower(), str(data["description"]).strip()
        except (ValueError, KeyError, TypeError):
            answers.append(None)
            continue
        answers.append((name, description) if 1 <= len(name.split()) <= 6 and valid_name(name) and description
                       else None)
    return answers


def configured_llm_labels(config, evidence: list[list[tuple[str, int]]],
                          examples: list[list[str]] | None = None) -> list[tuple[str, str] | None] | None:
    """``llm_labels`` with the engine of ``config`` (an LLMConfig), set up and closed here; None for the offline
    engine, which has no answers to give (its callers label from the evidence themselves)."""
    from atlas.llm.engine import setup_engine

    engine = setup_engine(config)
    if engine is None:
        return None
    try:
        return llm_labels(engine, evidence, examples)
    finally:
        engine.close()


def make_unique(names: list[str], alternatives: list[list[str]], reserved: Iterable[str] = ()) -> list[str]:
    """Names in order of priority; a taken name gets its next alternative tag in parentheses, else a number.
    ``reserved`` names are taken from the start (the auxiliary labels': a content concept is never called
    ``sarcastic`` or ``children``, which a reader would take for the tone or the demographic label)."""
    taken, out = set(reserved), []
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
