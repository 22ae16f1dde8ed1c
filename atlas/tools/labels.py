"""What the annotated shards hold, for a person: ``atlas inspect RUN shard-labels`` and the report's "Labels in the
shards".

The counts and samples are read from the parts by ``atlas.io.annotated``; here the labels get their names, the
labels a publisher checks by hand are picked (``AuxDomain.sensitive_names``), and the counts are laid out as rows
that the report and the command line both show.
"""

from __future__ import annotations

import textwrap

from atlas.core.files import ArtifactError, InputError
from atlas.core.rundir import RunDir
from atlas.io import layout
from atlas.io.annotated import ALL, label_counts, sample_chunks

COUNT_HEADER = ["labels", "data domain", "chunks", "chunks labeled", "share", "labels in all", "labels / chunk"]


def count_rows(counts: dict[str, dict[str, dict]]) -> list[list]:
    """One row per label domain and data domain (``"all"`` last): ``COUNT_HEADER``'s columns. ``share`` and
    ``labels / chunk`` are over all the chunks of the data domain, labeled or not."""
    return [[domain, data_domain, cell["chunks"], cell["chunks_labeled"],
             round(cell["chunks_labeled"] / max(cell["chunks"], 1), 4), cell["labels"],
             round(cell["labels"] / max(cell["chunks"], 1), 3)]
            for domain, cells in counts.items() for data_domain, cell in cells.items()]


def run_config(run: RunDir):
    """The config the run's manifest records; one that cannot be read is an ArtifactError naming the manifest."""
    from atlas.config import ConfigError, config_from_dict

    config = run.read_manifest().get("config")
    fix = ("the manifest was edited, damaged or written by another Atlas version: restore it from a copy, or move it "
           "aside and rerun `atlas run CONFIG` (finished stages are found again from their _SUCCESS markers)")
    if not isinstance(config, dict):
        raise ArtifactError(f"{run.manifest_path}: no config; {fix}")
    try:
        return config_from_dict(dict(config, run_dir=str(run.root.resolve())))
    except ConfigError as e:
        raise ArtifactError(f"{run.manifest_path}: its config is not valid ({' '.join(str(e).split())}); {fix}") \
            from None


def sensitive_labels(run: RunDir, concepts: list[dict]) -> list[dict]:
    """The library's labels a publisher checks by hand, in id order: the ``sensitive_names`` of the run's auxiliary
    lists (every demographic and alignment label, and the emotional tones), matched to the library by domain and
    name (a label renamed since the library was built is not found, and not shown)."""
    from atlas.llm.answers import SchemaError
    from atlas.models.auxiliary import configured_domains

    try:
        domains = configured_domains(run_config(run))
    except SchemaError as e:  # a list file that cannot be read: named in the message
        raise InputError(str(e)) from None
    wanted = {(d.name, name) for d in domains for name in d.sensitive_names}
    return [c for c in concepts if (c["domain"], c["name"]) in wanted]


def find_labels(concepts: list[dict], label: str) -> list[dict]:
    """The concepts ``label`` names: a concept id, a name (any case; a name can be in more than one domain, such as a
    content concept and a demographic label "children"), or ``DOMAIN:NAME``."""
    label = label.strip()
    if label.isdigit():
        return [c for c in concepts if c["concept_id"] == int(label)]
    domain, _, name = label.partition(":")
    if name and domain in {c["domain"] for c in concepts}:
        return [c for c in concepts if c["domain"] == domain and c["name"].casefold() == name.strip().casefold()]
    return [c for c in concepts if c["name"].casefold() == label.casefold()]


def print_label_counts(run: RunDir, concepts: list[dict], top: int = 8) -> None:
    """The counts table of ``count_rows``, then each label domain's most carried labels."""
    counts = label_counts(run)
    folder = run.output_dir(layout.ANNOTATED)
    total = next(iter(counts.values()), {}).get(ALL, {}).get("chunks", 0)
    print(f"labels in the shards ({folder}/part-*.parquet, {total:,} chunks; share and labels / chunk are over all "
          "the chunks of the data domain)")
    rows = [[str(v) if not isinstance(v, float) else (f"{v:.1%}" if i == 4 else f"{v:.2f}") for i, v in enumerate(r)]
            for r in count_rows(counts)]
    widths = [max(len(str(x)) for x in column) for column in zip(COUNT_HEADER, *rows)]
    for row in [COUNT_HEADER, *rows]:
        print("  ".join(str(x).ljust(w) if i < 2 else str(x).rjust(w) for i, (x, w) in enumerate(zip(row, widths))))
    names = {c["concept_id"]: c["name"] for c in concepts}
    for domain, cells in counts.items():
        carried = sorted(cells[ALL]["per_label"].items(), key=lambda kv: (-kv[1], kv[0]))
        shown = ", ".join(f"{names.get(g, g)} {n:,}" for g, n in carried[:top])
        print(f"{domain}: {len(carried):,} label(s) carried" + (f"; most: {shown}" if carried else ""))


def print_label_sample(run: RunDir, concept: dict, n: int, seed: int, chars: int) -> None:
    """How many chunks carry ``concept``, and ``n`` of them drawn at random (seeded), with the label's score."""
    counts = label_counts(run).get(concept["domain"], {})
    carried = counts.get(ALL, {}).get("per_label", {}).get(concept["concept_id"], 0)
    chunks = sample_chunks(run, [concept["concept_id"]], n, seed, chars)[concept["concept_id"]]
    print(f"label {concept['concept_id']}: {concept['name']}  ({concept['domain']}): carried by {carried:,} "
          f"chunk(s); {len(chunks)} drawn at random (seed {seed})")
    for chunk in chunks:
        print("-" * 100)
        print(f"chunk_id={chunk['chunk_id']}  domain={chunk['domain']}  data_src={chunk['data_src']}  "
              f"score={chunk['score']:.3f}")
        print(textwrap.indent(chunk["text"], "    │ ", lambda line: True))
