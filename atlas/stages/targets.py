"""Stage ``targets`` (global): the annotator's training data (paper 4.2.3).

1. **Inherited targets.** A tagged chunk inherits the concepts of its tags, through tag -> cluster
   -> concept (``library/tag_to_concept.parquet``). These are positives only: a concept a chunk
   did not inherit is *unlabeled*, not negative (the annotator is trained as positive-unlabeled).
2. **Reservoir, long-tail enriched.** Going through the concepts from rarest to most common, up to
   ``annotator.min_per_concept`` chunks of each are taken first (``picked = "long_tail"``); the rest
   is a uniform fill up to ``annotator.reservoir_size`` (``"fill"``; None: every tagged chunk).
3. **Split by document.** A document's chunks all go to ``train`` or all to ``heldout``
   (``annotator.heldout_fraction``; the paper held out 597k of 2.9M chunks), so the held-out
   figures are not inflated by near-copies from the same document.
4. **Auxiliary labels** (tone, demographic reference, alignment-relevant) for every reservoir chunk
   from the finite lists in ``schemas/aux/`` (see ``atlas.models.auxiliary``): an LLM picks which apply,
   or offline, calibrated embedding similarity. LLM answers are validated, retried and cached in
   ``RUN/_cache/aux/``; a chunk whose answers all fail keeps its content targets, gets no auxiliary
   labels and is counted (``aux_status`` says why).

    targets/part-00000.parquet   chunk_id, doc_id, domain, split, picked, concepts (all global ids),
                                 content_global_ids, <aux>_global_ids, aux_status
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pyarrow as pa

from atlas.config import PROJECT_ROOT
from atlas.core.extras import llm_extras
from atlas.core.files import atomic_write_parquet, sha256_bytes, stable_hash
from atlas.core.rundir import RunDir
from atlas.core.stage import Stage
from atlas.core.stats import Stats
from atlas.io import layout
from atlas.io.chunks import read_chunks
from atlas.io.library import check_tag_to_concept, chunk_concepts, load_library
from atlas.io.tags import read_tags
from atlas.llm.answers import parse_answer
from atlas.llm.ask import ask_until_done
from atlas.llm.cache import RequestCache
from atlas.llm.engine import LLMRequest, LLMResult, make_tag_engine
from atlas.llm.prompts import load_prompt
from atlas.models.auxiliary import answer_schema, calibrated_labels, describe_lists, load_aux_domains
from atlas.models.embedder import Embedder, encode_cached

TARGETS_VERSION = 1
AUX_PROMPT = {"system": set(), "user": {"lists", "text"}, "repair": {"problem", "field_names"}}


def targets_schema(aux_domains: list[str]) -> pa.Schema:
    ids = pa.list_(pa.int64())
    return pa.schema(
        [("chunk_id", pa.string()), ("doc_id", pa.string()), ("domain", pa.string()), ("split", pa.string()),
         ("picked", pa.string()), ("concepts", ids), ("content_global_ids", ids)]
        + [(f"{d}_global_ids", ids) for d in aux_domains] + [("aux_status", pa.string())]
    )


def build_reservoir(chunk_ids: list[str], concepts: dict[str, list[int]], size: int | None, min_per_concept: int,
                    seed: int) -> dict[str, str]:
    """chunk id -> "long_tail" or "fill": up to ``min_per_concept`` chunks per concept (rarest concept
    first, counting chunks already taken), then a uniform random fill up to ``size`` (None: all)."""
    order = [chunk_ids[i] for i in np.random.default_rng(seed).permutation(len(chunk_ids))]
    size = len(order) if size is None else min(size, len(order))
    members: dict[int, list[str]] = {}
    for chunk in order:  # each concept's chunks in the same random order
        for concept in concepts.get(chunk, []):
            members.setdefault(concept, []).append(chunk)
    picked: dict[str, str] = {}
    for concept in sorted(members, key=lambda c: (len(members[c]), c)):
        have = sum(chunk in picked for chunk in members[concept])
        for chunk in members[concept]:
            if have >= min_per_concept or len(picked) >= size:
                break
            if chunk not in picked:
                picked[chunk] = "long_tail"
                have += 1
    for chunk in order:
        if len(picked) >= size:
            break
        picked.setdefault(chunk, "fill")
    return picked


def heldout_split(doc_id: str, fraction: float, seed: int) -> str:
    """"heldout" for a stable ``fraction`` of documents, whatever the order or sharding."""
    return "heldout" if int(stable_hash([seed, doc_id])[:8], 16) / 16**8 < fraction else "train"


class TargetsStage(Stage):
    name = "targets"
    output = layout.TARGETS
    upstream = ("tag", "library")
    needs = ("embed",)

    def extras(self) -> tuple[str, ...]:
        return self.needs + llm_extras(self.config.llm.engine)

    def identity(self) -> dict:
        a = self.config.annotator
        identity = {"version": TARGETS_VERSION, "seed": a.seed, "reservoir_size": a.reservoir_size,
                    "min_per_concept": a.min_per_concept, "heldout_fraction": a.heldout_fraction}
        if self.config.llm.engine == "offline":
            return identity | {"aux": "offline", "embedding_model": self.config.tag.embedding_model,
                               "min_z": a.aux_min_z, "min_similarity": a.aux_min_similarity,
                               "batch": a.embed_batch_size}
        prompt = load_prompt(PROJECT_ROOT / "prompts" / "aux.yaml", AUX_PROMPT)
        return identity | {"aux": make_tag_engine(self.config).identity(), "prompt_sha256": prompt.sha256,
                           "max_attempts": self.config.tag.max_attempts}

    def setup(self) -> None:
        # Auxiliary labels: offline, embedding similarity to each label; otherwise the tag stage's engine.
        if self.config.llm.engine == "offline":
            self.embedder, self.engine = Embedder(self.config.tag.embedding_model), None
        else:
            self.embedder, self.engine = None, make_tag_engine(self.config)
            self.engine.setup()

    def teardown(self) -> None:
        if self.engine is not None:
            self.engine.close()

    def run_shard(self, run: RunDir, shard: int) -> Stats:
        a = self.config.annotator
        _, library = load_library(run)
        domains = load_aux_domains(self.config.library.aux_domains, self.config.tag.schema_dir)
        offsets = library["domain_offsets"]
        if missing := [d.name for d in domains if d.name not in offsets]:
            raise ValueError(f"{run.output_dir(layout.LIBRARY)}/config.json has no offsets for auxiliary domains "
                             f"{missing}; rebuild the library (atlas run CONFIG --force --stages library)")


        check_tag_to_concept(run, library["domain_sizes"]["content"])
        tags = read_tags(run, ["chunk_id"])
        tagged = sorted(set(tags.column(0).to_pylist()))
        content = chunk_concepts(run)
        stats = Stats({"chunks_tagged": len(tagged), "chunks_with_concepts": len(content)})
        picked = build_reservoir(tagged, content, a.reservoir_size, a.min_per_concept, a.seed)
        chosen = sorted(picked)
        chunks = read_chunks(run, set(chosen), ("doc_id", "domain", "chunk_text"))
        texts = [chunks[c]["chunk_text"] for c in chosen]
        aux, status = (self._aux_offline(run, domains, texts, stats) if self.config.llm.engine == "offline"
                       else self._aux_llm(run, domains, chosen, texts, stats))

        rows = []
        for i, chunk_id in enumerate(chosen):
            doc_id = chunks[chunk_id]["doc_id"]
            row = {"chunk_id": chunk_id, "doc_id": doc_id, "domain": chunks[chunk_id]["domain"],
                   "split": heldout_split(doc_id, a.heldout_fraction, a.seed), "picked": picked[chunk_id],
                   "content_global_ids": sorted(content.get(chunk_id, [])), "aux_status": status[i]}
            for d in domains:
                row[f"{d.name}_global_ids"] = [offsets[d.name] + j for j in aux[d.name][i]]
            row["concepts"] = sorted(c for key, ids in row.items() if key.endswith("_global_ids") for c in ids)
            rows.append(row)
        schema = targets_schema([d.name for d in domains])
        atomic_write_parquet(run.part_path(self.output, 0), pa.Table.from_pylist(rows, schema=schema))

        splits = Counter(r["split"] for r in rows)
        stats.inc("reservoir", len(rows))
        stats.inc("reservoir_long_tail", sum(p == "long_tail" for p in picked.values()))
        stats.inc("train", splits["train"])
        stats.inc("heldout", splits["heldout"])
        stats.inc("positives_content", sum(len(r["content_global_ids"]) for r in rows))
        for d in domains:
            stats.inc(f"positives_{d.name}", sum(len(r[f"{d.name}_global_ids"]) for r in rows))
        counts = Counter(c for r in rows for c in r["content_global_ids"])
        stats.inc("concepts_below_min_per_concept", sum(1 for n in counts.values() if n < a.min_per_concept))
        return stats

    def _bar(self, total: int, desc: str, unit: str):
        """A progress bar inside the stage's one shard (the runner's bar shows shards: 0/1 until the end)."""
        from tqdm.auto import tqdm

        return tqdm(total=total, desc=desc, unit=unit, disable=not self.config.execution.progress)

    def _aux_offline(self, run: RunDir, domains, texts: list[str], stats: Stats):
        """Calibrated embedding similarity between each chunk and each label's "name: description"."""
        a = self.config.annotator
        embedder = self.embedder
        with self._bar(len(texts), "targets: embed reservoir", "chunk") as bar:
            chunk_vectors, computed = encode_cached(embedder, texts, run.root / layout.CACHE / "embeddings",
                                                    a.embed_batch_size, progress=bar.update)
        stats.inc("chunks_embedded", computed)
        aux = {}
        for d in domains:
            label_vectors, _ = encode_cached(embedder, d.texts, run.root / layout.CACHE / "embeddings")
            similarity = chunk_vectors.astype(np.float32) @ label_vectors.astype(np.float32).T
            aux[d.name] = [[j for j, _ in labels]
                           for labels in calibrated_labels(similarity, d, a.aux_min_z, a.aux_min_similarity)]
        return aux, ["offline"] * len(texts)

    def _aux_llm(self, run: RunDir, domains, chunk_ids: list[str], texts: list[str], stats: Stats):
        """An LLM picks labels from the lists; validated, retried up to tag.max_attempts, cached."""
        prompt = load_prompt(PROJECT_ROOT / "prompts" / "aux.yaml", AUX_PROMPT)
        schema, lists, engine = answer_schema(domains), describe_lists(domains), self.engine
        answers: dict[int, dict] = {}
        status = ["failed"] * len(texts)

        def request(i: int, attempt: int, problem: str | None) -> LLMRequest:
            user = prompt.render("user", lists=lists, text=texts[i])
            if problem:  # a second chance, told what was wrong
                user += "\n\n" + prompt.render("repair", problem=problem, field_names=", ".join(schema.fields))
            return LLMRequest(f"{chunk_ids[i]}#{attempt}", prompt.templates["system"], user, schema.schema,
                              "aux_labels", {"task": "aux"})

        def check(i: int, attempt: int, result: LLMResult) -> str | None:
            parsed = parse_answer(result.text, result.finish_reason, schema) if not result.error else None
            if parsed is not None and parsed.answer is not None:
                answers[i], status[i] = parsed.answer, "ok"
                return None
            status[i] = f"failed:{result.error or parsed.problem}"
            if attempt == self.config.tag.max_attempts:
                return None
            return result.error or f"{parsed.problem}: {parsed.detail}"

        cache = RequestCache(run.root / layout.CACHE / "aux" / f"{sha256_bytes(lists.encode())[:12]}.jsonl",
                             engine.identity())
        try:
            counters = ask_until_done(engine, cache, len(texts), request, check, self.config.tag.batch_size)
        finally:
            cache.close()
        stats.merge({f"aux_{name}": n for name, n in counters.items() if n})
        stats.inc("aux_failed", sum(s != "ok" for s in status))
        position = {d.name: {name: j for j, name in enumerate(d.names)} for d in domains}
        aux = {d.name: [[position[d.name][n] for n in answers.get(i, {}).get(d.name, [])] for i in range(len(texts))]
               for d in domains}
        return aux, status
