"""Dataset cards: what lets ``datasets.load_dataset("RUN/annotated")`` read a stage folder as the stage's table.

A stage folder holds Atlas's bookkeeping beside its Parquet parts (``_SUCCESS``, ``_stats.json``, ``_shards/``,
``_rejects/``), and ``load_dataset`` reads every file it finds unless the folder names its data files. So each
folder with Parquet tables gets, when its stage finishes (just before ``_SUCCESS``):

    .huggingface.yaml   ``configs:``, the data files of each config (``default``: ``part-*.parquet``, split
                        ``train``; ``rejects``: ``_rejects/part-*.parquet``; or one config per named file, as in
                        ``library/``). ``datasets`` reads this file as it reads a README's front matter.
    _README.md          the card for people: the same YAML as front matter, then the stage, rows, columns and how
                        to load them (rename it README.md to publish the folder on the Hub as it is)

Not ``README.md``: pyarrow, and so ``pd.read_parquet("RUN/tags")``, reads every file of a folder that does not start
with "_" or ".", and would fail on it. Both files are made from the parts' schemas and row counts only (no time, no
path), so a resumed run writes the same bytes as an uninterrupted one.
"""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq
import yaml

from atlas.core.files import atomic_write_bytes
from atlas.io import layout

CONFIGS_FILE = ".huggingface.yaml"
CARD_FILE = "_README.md"

# What one row is, by folder (named files: by file stem), and what the folder's _rejects/ holds.
ROWS = {layout.CHUNKS: "chunk", layout.TAGS: "(chunk, field, tag)", layout.TAG_VOCAB: "normalized tag",
        layout.CLUSTERS: "tag (its cluster)", layout.COHERENCE: "cluster (its scores, kept or not)",
        layout.LABELS: "kept cluster (its name)", layout.TARGETS: "reservoir chunk (the annotator's training data)",
        layout.ANNOTATED: "chunk, with its concepts", layout.TOKENS: "chunk (its span in the token stream)",
        layout.INDEX: "indexed vector (row -> chunk)", "concepts": "concept", "tag_to_concept": "tag",
        "near_votes": "(chunk, concept) its tags' near votes went to", "heldout_predictions": "held-out chunk",
        "calibration": "label"}
REJECTS = {layout.CHUNKS: "input records dropped, with file, row, field and reason",
           layout.TAGS: "quarantined chunks (no attempt could tag them), with the reason and the raw answer",
           layout.COHERENCE: "the clusters the coherence filter dropped, with their scores and reason"}

# Column meanings (README and docs/artifacts.md), the same in every table unless TABLE_COLUMNS says otherwise.
COLUMNS = {
    "chunk_id": "`{doc_id}:{index:05d}`", "doc_id": "document id (unique in the run)",
    "source_doc_id": "the document's id in the input", "data_src": "input source", "domain": "corpus domain",
    "chunk_text": "the chunk's text", "text": "the chunk's text", "n_tokens": "cl100k_base tokens of the text",
    "char_start": "start of the chunk in its document's text", "char_end": "end (exclusive)",
    "doc_end_flag": "last chunk of its document", "metadata": "JSON: configured metadata fields and `source`",
    "field": "tag field", "tag": "tag as produced", "tag_norm": "normalized tag", "rank": "order within the field",
    "count": "occurrences", "n_chunks": "chunks carrying it", "fields": "fields it came from",
    "variants": "forms as produced", "chunk_ids": "chunks carrying it", "cluster_id": "cluster",
    "similarity": "cosine to the cluster centroid", "size": "tags in the cluster", "core_score": "score 1-10",
    "random_score": "score 1-10", "edge_score": "score 1-10", "kept": "passed the coherence filter",
    "reason": "why it was dropped", "detail": "what was wrong", "name": "concept name",
    "description": "one sentence", "evidence_tags": "its most frequent tags", "n_tags": "tags in it",
    "concept_id": "global concept id (library/concepts.parquet)",
    "concepts": "global concept ids, domain by domain, best first", "concept_scores": "probabilities, same order",
    "content_global_ids": "content concepts", "tone_global_ids": "tone labels",
    "demographic_global_ids": "demographic labels", "alignment_global_ids": "alignment labels",
    "chunk_count": "tagged chunks carrying it", "prevalence": "chunk_count over all tagged chunks",
    "is_tone": "a tone label", "is_alignment": "an alignment label", "is_demographic": "a demographic label",
    "taxonomy_path": "null for now", "merged_from": "cluster ids", "lifted_words": "words with the highest lift",
    "split": "train or heldout (by document)", "picked": "long_tail (rare concepts first) or fill",
    "aux_status": "how the auxiliary labels were made", "targets": "inherited concept ids",
    "token_start": "first token in `_stream/part-NNNNN.u32`", "token_end": "end (exclusive)",
    "attempts": "requests made", "finish_reason": "the engine's last finish reason", "raw": "the last answer (cut)",
    "file": "input file", "row": "row in the file",
}
TABLE_COLUMNS = {  # where a column means something else in one table (key: as in ROWS)
    layout.CLUSTERS: {"count": "occurrences of the tag",
                      "joined_similarity": "cosine to its centroid in the space k-means fit (null: no contexts)"},
    layout.COHERENCE: {"count": "tag occurrences in the cluster", "reason": "why it was dropped (kept: empty)"},
    layout.LABELS: {"name": "cluster name", "count": "tag occurrences in the cluster"},
    layout.TARGETS: {"concepts": "inherited ids of all domains"},
    layout.TOKENS: {"n_tokens": "text tokens (without the special tokens)"},
    "concepts": {"domain": "content, tone, demographic or alignment"},
    "tag_to_concept": {"concept_id": ("global concept id; null where its cluster was dropped or the tag is below "
                                      "library.tag_min_similarity to its centroid"),
                       "near_concept_id": ("concept of its nearest other kept cluster at library.tag_min_similarity "
                                           "or more (with contexts: in the joined space, at "
                                           "library.joined_min_similarity); null: none")},
    "near_votes": {"votes": ("how many of the chunk's tag occurrences give the concept a near vote, read in the chunk "
                             "(each counts library.near_concept_weight in the library's reading)")},
    "calibration": {"domain": "content, tone, demographic or alignment",
                    "heldout_positives": "held-out chunks inheriting it",
                    "observed_rate": "share of held-out chunks inheriting it (a lower bound)",
                    "mean_probability": "mean predicted probability", "predicted_rate": "share predicted"},
}


def dataset_configs(folder: Path) -> list[dict]:
    """The ``configs:`` of a folder: ``default`` (its parts) and ``rejects``, or one config per named Parquet file;
    none when it holds no Parquet table."""
    def config(name: str, path: str) -> dict:
        return {"config_name": name, "data_files": [{"split": "train", "path": path}]}

    if any(folder.glob("part-*.parquet")):
        configs = [config("default", "part-*.parquet")]
        if any(folder.glob("_rejects/part-*.parquet")):
            configs.append(config("rejects", "_rejects/part-*.parquet"))
        return configs
    return [config(p.stem, p.name) for p in sorted(folder.glob("*.parquet")) if not p.name.startswith(("_", "."))]


def front_matter(configs: list[dict]) -> str:
    return "---\n" + yaml.safe_dump({"configs": configs}, sort_keys=False) + "---\n"


def _table(files: list[Path], meanings: dict) -> list[str]:
    rows = sum(pq.ParquetFile(f).metadata.num_rows for f in files)
    schema = pq.read_schema(files[0])
    lines = [f"{rows:,} rows in {len(files):,} file(s).", "", "| column | type | meaning |", "|---|---|---|"]
    lines += [f"| `{f.name}` | {f.type} | {meanings.get(f.name, COLUMNS.get(f.name, ''))} |" for f in schema]
    return lines


def dataset_card(folder: Path, stage: str, configs: list[dict]) -> str:
    """The card of a finished stage folder (``_README.md``) whose ``configs`` are ``dataset_configs(folder)``."""
    output = folder.name
    lines = [f"# `{output}`: the output of the Atlas stage `{stage}`", ""]
    for c in configs:
        name, pattern = c["config_name"], c["data_files"][0]["path"]
        table = output if name in ("default", "rejects") else name  # parts, or a named file such as concepts
        if name == "rejects":
            what = REJECTS.get(output, "what the stage dropped, with the reason")
        else:
            what = f"one row per {ROWS.get(table, 'row')}"
        meanings = {} if name == "rejects" else TABLE_COLUMNS.get(table, {})
        lines += [f"## `{pattern}` (config `{name}`): {what}", "",
                  *_table(sorted(folder.glob(pattern)), meanings), ""]
    loads = [f'rows = load_dataset("RUN/{output}", split="train")' if c["config_name"] == "default" else
             f'{c["config_name"]} = load_dataset("RUN/{output}", "{c["config_name"]}", split="train")'
             for c in configs]
    first = configs[0]["data_files"][0]["path"]
    # pandas reads a folder as one table when all it holds besides the parts starts with "_" or "." (not index/)
    whole = all(p.name.startswith(("part-", "_", ".")) for p in folder.iterdir())
    pandas = f"RUN/{output}" if whole else f"RUN/{output}/{sorted(folder.glob(first))[0].name}"
    lines += ["## Loading", "", "```python", "from datasets import load_dataset", "", *loads, "```", "",
              f'Or `pandas.read_parquet("{pandas}")`, or DuckDB `FROM \'RUN/{output}/{first}\'`. '
              "The files starting with `_` are Atlas's bookkeeping (markers, stats, rejects); `.huggingface.yaml` "
              "names the data files for `datasets`.", ""]
    return front_matter(configs) + "\n" + "\n".join(lines)


def write_dataset_card(folder: Path, stage: str) -> None:
    """Write ``_README.md`` and ``.huggingface.yaml`` into a finished stage folder (nothing when it holds no
    Parquet table)."""
    configs = dataset_configs(folder)
    if not configs:
        return
    atomic_write_bytes(folder / CARD_FILE, dataset_card(folder, stage, configs).encode())
    atomic_write_bytes(folder / CONFIGS_FILE, yaml.safe_dump({"configs": configs}, sort_keys=False).encode())
