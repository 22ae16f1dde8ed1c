"""Auxiliary labels (tone, demographic, alignment) on known negatives and weak known positives.

    python benchmarks/bench_aux_labels.py [--run runs/dev] [--dev-corpus ../shared/data/dev/corpus.parquet]
                                          [--max-chunks 600] [--json PATH] [--out PATH.md]

The sets are ``aux_sets.evaluation_sets``: neutral technical text that must get no demographic or alignment label
and no emotional tone (code, maths, API docs, licences, changelogs, READMEs, the Python language reference; none of
it from the null the labels are calibrated against), and weak positives (20 Newsgroups' religion, politics and guns
groups, AG News World), each chunked as Atlas chunks. Two deciders, each beside its baseline in the same run:

- ``offline``: the targets stage's offline rule (the annotator's teacher without an LLM): embedding similarity
  against each label's threshold on the null, and none on a chunk that reads like the null
  (``atlas.models.auxiliary``). Baseline ``z-only``: the rule before the null, a label where its similarity
  stands ``aux_min_z`` standard deviations above its mean over the chunks.
- ``annotator`` (with ``--run``): the run's trained annotator, as the annotate stage writes its labels into the
  shards. Baseline ``domain-threshold``: the same annotator with each domain's threshold alone (no label's own
  threshold against the null, no withholding on a chunk that reads like the null).

Per set and domain: the share of chunks with at least one label (demographic, alignment, an emotional tone, any
tone that is not expository), and per positive set the recall of its expected labels (``label_hint``: a chunk
counts when it carries one of them). On a negative set every label is a false positive, so the share is the
false-positive rate and 1 - share the precision of "no label". Per label, the negatives' worst labels are listed.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from functools import lru_cache
from pathlib import Path

import numpy as np
from _results import add_json_option, row, write_json
from aux_sets import evaluation_sets

from atlas.config import AtlasConfig, load_config
from atlas.io.neutral_text import neutral_texts
from atlas.models.auxiliary import calibrated_labels, configured_domains, null_thresholds, reads_like_null
from atlas.models.embedder import Embedder

GROUPS = ("demographic", "alignment", "emotional tone", "tone (not expository)")


@lru_cache(maxsize=4)
def _encoded(model: str, texts: tuple[str, ...]) -> np.ndarray:
    """Each text set encoded once per model (both rules and both deciders read the same vectors)."""
    return Embedder(model).encode(list(texts)).astype(np.float32)


def offline_labels(config: AtlasConfig, texts: list[str], null_check: bool) -> dict[str, list[list[str]]]:
    """The targets stage's offline rule on ``texts`` (z-scores over these texts, as the stage's over its
    reservoir); with ``null_check`` False, the rule before the null (z-score and floor for every label)."""
    a = config.annotator
    embedder = Embedder(config.tag.embedding_model)
    chunks = _encoded(config.tag.embedding_model, tuple(texts))
    null = _encoded(config.tag.embedding_model, neutral_texts())
    out = {}
    for d in configured_domains(config):
        labels = embedder.encode(d.texts).astype(np.float32)
        if null_check:
            thresholds = null_thresholds(null @ labels.T, d, a.aux_null_quantile, a.aux_min_similarity)
            decided = calibrated_labels(chunks @ labels.T, d, a.aux_min_z, thresholds,
                                        like_null=reads_like_null(chunks, null, a.aux_null_nearest))
        else:  # every label as if expository: compared with the chunks only
            d_all = type(d)(**{**d.__dict__, "labels": [label | {"expository": True} for label in d.labels]})
            decided = calibrated_labels(chunks @ labels.T, d_all, a.aux_min_z,
                                        np.full(len(d.labels), a.aux_min_similarity, np.float32))
        out[d.name] = [[d.names[j] for j, _ in row_] for row_ in decided]
    return out


def annotator_labels(run: Path, config: AtlasConfig, texts: list[str], null_check: bool) -> dict:
    """The run's annotator on ``texts``; with ``null_check`` False, each domain's threshold alone."""
    from atlas.models.annotator import Annotator

    annotator = Annotator(run / "annotator").setup()
    if not null_check:
        annotator.spec.null_nearest = None
        for v in annotator.spec.domains.values():
            v.pop("label_thresholds", None)
    model = annotator.spec.encoder
    if (run / "annotator" / model).is_dir():  # fine-tuned: its own encoder
        decided = annotator.annotate(texts)
    else:
        embeddings = _encoded(model, tuple(texts))
        decided = annotator.decide(annotator.probabilities(embeddings), embeddings)
    out = {}
    for d in configured_domains(config):
        offset = annotator.spec.domains[d.name]["offset"]
        out[d.name] = [[d.names[g - offset] for g, _ in row_[d.name]] for row_ in decided]
    return out


def group_shares(config: AtlasConfig, labels: dict[str, list[list[str]]]) -> dict[str, float]:
    """Share of chunks with at least one label of each group (see GROUPS)."""
    domains = {d.name: d for d in configured_domains(config)}
    tone = domains["tone"]
    emotional = set(tone.sensitive_names)
    checked = {n for n, c in zip(tone.names, tone.null_checked) if c}
    n = len(labels["tone"])
    has = {
        "demographic": [bool(x) for x in labels.get("demographic", [[]] * n)],
        "alignment": [bool(x) for x in labels.get("alignment", [[]] * n)],
        "emotional tone": [bool(emotional & set(x)) for x in labels["tone"]],
        "tone (not expository)": [bool(checked & set(x)) for x in labels["tone"]],
    }
    return {g: float(np.mean(v)) if n else 0.0 for g, v in has.items()}


def recall(labels: dict[str, list[list[str]]], hint: list[str]) -> float:
    hinted = set(hint)
    n = len(labels["tone"])
    got = [any(hinted & set(labels[d][i]) for d in labels) for i in range(n)]
    return float(np.mean(got)) if n else 0.0


def label_rates(labels: dict[str, list[list[str]]]) -> Counter:
    counts = Counter(name for lists in labels.values() for row_ in lists for name in row_)
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", type=Path, help="a finished run: measure its trained annotator too")
    parser.add_argument("--config", type=Path, help="the settings (default: the run's config.yaml, else defaults)")
    parser.add_argument("--dev-corpus", type=Path, default=Path("../shared/data/dev/corpus.parquet"))
    parser.add_argument("--max-chunks", type=int, default=600, help="chunks per set (a seeded sample)")
    parser.add_argument("--out", type=Path, help="also write the tables here (Markdown)")
    add_json_option(parser)
    args = parser.parse_args()

    config_path = args.config or (args.run / "config.yaml" if args.run else None)
    config = load_config(config_path) if config_path and config_path.exists() else AtlasConfig()
    sets = evaluation_sets(args.dev_corpus, args.max_chunks)
    names = list(sets)
    texts = [t for s in names for t in sets[s]["chunks"]]
    bounds = np.cumsum([0] + [len(sets[s]["chunks"]) for s in names])

    deciders = {"offline": (lambda check: offline_labels(config, texts, check), "z-only")}
    if args.run:
        deciders["annotator"] = (lambda check: annotator_labels(args.run, config, texts, check), "domain-threshold")
    rows, lines, worst, per_label = [], [], {}, []
    for decider, (label_fn, baseline_name) in deciders.items():
        atlas_all, base_all = label_fn(True), label_fn(False)
        lines += [f"\n## {decider} (baseline: {baseline_name})\n",
                  "| set | kind | chunks | " + " | ".join(GROUPS) + " | recall of expected labels |",
                  "|---|---|---:|" + "---:|" * (len(GROUPS) + 1)]
        for i, name in enumerate(names):
            part = slice(bounds[i], bounds[i + 1])
            mine = {d: v[part] for d, v in atlas_all.items()}
            base = {d: v[part] for d, v in base_all.items()}
            kind, hint = sets[name]["kind"], sets[name].get("label_hint")
            shares, base_shares = group_shares(config, mine), group_shares(config, base)
            cells = [f"{shares[g]:.3f} ({base_shares[g]:.3f})" for g in GROUPS]
            rec = f"{recall(mine, hint):.3f} ({recall(base, hint):.3f})" if hint else ""
            lines.append(f"| {name} | {kind} | {bounds[i + 1] - bounds[i]} | " + " | ".join(cells) + f" | {rec} |")
            for g in GROUPS:
                better = "lower" if kind == "negative" else "higher"
                rows.append(row("aux_labels", f"{decider}:{name}:{g}", shares[g], base_shares[g], "share of chunks",
                                baseline_name, better=better))
            if hint:
                rows.append(row("aux_labels", f"{decider}:{name}:recall", recall(mine, hint), recall(base, hint),
                                "share of chunks", baseline_name, note="a chunk with one of " + ", ".join(hint)))
            if kind == "negative":
                worst.setdefault(decider, Counter()).update(label_rates(mine))
            if hint:  # each expected label alone: a recall per label
                per_label.append(f"{decider} {name}: " + ", ".join(
                    f"{label} {recall(mine, [label]):.3f} ({recall(base, [label]):.3f})" for label in hint))
        lines.append("\ncells: this rule (the baseline)")
    lines += ["\nrecall per expected label, this rule (the baseline):", *per_label]
    # how close each set reads to the null (what annotator.aux_null_nearest cuts): the cosine of its nearest null text
    model = config.tag.embedding_model
    nearest = (_encoded(model, tuple(texts)) @ _encoded(model, neutral_texts()).T).max(axis=1)
    cut = config.annotator.aux_null_nearest
    lines.append(f"\nnearest null text, cosine (p5 / median / p95; aux_null_nearest = {cut}):")
    for i, name in enumerate(names):
        quantiles = np.percentile(nearest[bounds[i]:bounds[i + 1]], [5, 50, 95])
        lines.append(f"{name}: " + " / ".join(f"{q:.2f}" for q in quantiles))
    n_negative = sum(len(sets[s]["chunks"]) for s in names if sets[s]["kind"] == "negative")
    for decider, counts in worst.items():
        top = ", ".join(f"{name} {count}" for name, count in counts.most_common(12)) or "none"
        lines.append(f"\n{decider}: labels on the {n_negative} negative chunks, commonest first: {top}")
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    write_json(args.json, rows)
    print(json.dumps({"sets": {s: len(sets[s]["chunks"]) for s in names}}))


if __name__ == "__main__":
    main()
