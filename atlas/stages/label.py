"""Stage ``label`` (global): each kept cluster -> a concept name and description (paper 4.2.2).

The labeler sees the cluster's ``library.label_tags`` most frequent tags (50-100 in the paper)
with their counts. With an LLM engine it answers ``{"name", "description"}`` under a JSON schema
(``prompts/label_cluster.yaml``); an answer that fails is replaced by the offline label and
counted. Offline, the name is the cluster's medoid tag (the one closest, weighted by frequency, to
the other representative tags) and the description is a sentence built from the evidence tags.
No two concepts share a name: a repeated name gets the cluster's next most representative tag.
"""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from atlas.config import PROJECT_ROOT
from atlas.core.files import atomic_write_parquet
from atlas.core.rundir import RunDir
from atlas.core.stage import Stage
from atlas.core.stats import Stats
from atlas.llm.engine import LLMRequest, make_engine
from atlas.llm.prompts import load_prompt
from atlas.stages.vocab import load_vocab

LABEL_VERSION = 1
EVIDENCE_KEPT = 20
LABEL_SCHEMA = pa.schema(
    [("cluster_id", pa.int64()), ("name", pa.string()), ("description", pa.string()),
     ("evidence_tags", pa.list_(pa.string())), ("n_tags", pa.int64()), ("count", pa.int64())]
)
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


def llm_labels(config, evidence: list[list[tuple[str, int]]]) -> list[tuple[str, str] | None]:
    """(name, description) per evidence list from the LLM, or None where the answer is unusable."""
    prompt = label_prompt()
    engine = make_engine(config.llm)
    engine.setup()
    requests = [LLMRequest(key=str(i), system=prompt.templates["system"], schema=ANSWER_SCHEMA, schema_name="label",
                           user=prompt.render("user", tags="\n".join(f"- {t} ({n})" for t, n in items)))
                for i, items in enumerate(evidence)]
    answers = []
    try:
        for result in engine.generate(requests):
            try:
                data = json.loads(result.text or "")
                name, description = str(data["name"]).strip().lower(), str(data["description"]).strip()
            except (ValueError, KeyError, TypeError):
                answers.append(None)
                continue
            answers.append((name, description) if 1 <= len(name.split()) <= 6 and description else None)
    finally:
        engine.close()
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


class LabelStage(Stage):
    name = "label"
    output = "labels"
    kind = "global"
    upstream = ("coherence",)

    def identity(self) -> dict:
        identity = {"version": LABEL_VERSION, "label_tags": self.config.library.label_tags}
        if self.config.llm.engine == "offline":
            return identity
        return identity | {"engine": make_engine(self.config.llm).identity(), "prompt_sha256": label_prompt().sha256}

    def run_shard(self, run: RunDir, shard: int) -> Stats:
        _, vectors = load_vocab(run)
        clusters = pq.read_table(run.part_path("clusters", 0)).to_pydict()
        kept = [r["cluster_id"] for r in pq.read_table(run.part_path("coherence", 0)).to_pylist() if r["kept"]]
        labels, tags, counts = np.asarray(clusters["cluster_id"]), clusters["tag_norm"], np.asarray(clusters["count"])
        x = vectors.astype(np.float32)
        stats = Stats({"clusters_in": len(kept)})

        rows, evidence = [], []
        for cluster in kept:
            members = np.flatnonzero(labels == cluster)
            order = members[np.lexsort((np.array(tags, dtype=object)[members], -counts[members]))]
            top = order[: self.config.library.label_tags]
            name, description = offline_label([tags[i] for i in top], counts[top].astype(float), x[top])
            rows.append({"cluster_id": cluster, "name": name, "description": description,
                         "evidence_tags": [tags[i] for i in top[:EVIDENCE_KEPT]], "n_tags": len(members),
                         "count": int(counts[members].sum())})
            evidence.append([(tags[i], int(counts[i])) for i in top])
        if self.config.llm.engine != "offline":
            for row, answer in zip(rows, llm_labels(self.config, evidence)):
                if answer is None:
                    stats.inc("labels_offline_fallback")
                else:
                    row["name"], row["description"] = answer
        rows.sort(key=lambda r: (-r["count"], r["cluster_id"]))  # the most used concept keeps a contested name
        unique = make_unique([r["name"] for r in rows], [r["evidence_tags"] for r in rows])
        stats.inc("names_disambiguated", sum(a != b for a, b in zip(unique, (r["name"] for r in rows))))
        for row, name in zip(rows, unique):
            row["name"] = name
        rows.sort(key=lambda r: r["cluster_id"])
        stats.inc("concepts_out", len(rows))
        atomic_write_parquet(run.part_path(self.output, 0), pa.Table.from_pylist(rows, schema=LABEL_SCHEMA))
        return stats
