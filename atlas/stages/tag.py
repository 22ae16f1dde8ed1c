"""Stage ``tag`` (map): chunks -> structured free-form tags (paper 4.2.1).

Each chunk is tagged with the schema of its domain (``schemas/tags/<domain>.json``; ``generic``
for other domains) through the configured engine: ``offline`` (no LLM), ``openai`` (any
OpenAI-compatible server) or ``vllm``. Answers are parsed, repaired where harmless, validated
against the schema and normalized; an answer that still fails is asked again (with a short note
on what was wrong) up to ``tag.max_attempts`` times, then the chunk is quarantined in
``tags/_rejects/`` with the raw answer and the reason. A field whose schema maps file extensions to tags
(``"x-atlas-extensions"``: the code schema's ``language``) is then set from the document's id where it ends with one
of them (``maths/perfect_number.py``: "python"), whatever the engine said (counted as ``tags_from_file_extension``
and, where it said something else, ``engine_tags_replaced_by_file_extension``).

**The library sample** (paper 4.2: 6.6M of 1.84B documents are tagged; the trained annotator labels
the rest). Only the chunks of documents in the sample are tagged: a document is in it when its
``sample_position`` (a hash of its id) is below ``tag.sample_fraction``, and ``tag.sample_max_docs`` caps it
(the plan then keeps the documents with the lowest positions: ``RUN/tags/_sample.json``). Everything from
``vocab`` to ``train_annotator`` reads the tags and so sees the sample; ``annotate``, ``tokenize`` and
``index`` read the chunks and see every one.

**Each distinct text is asked once.** Chunks of a shard whose texts are equal after whitespace normalization
(boilerplate, repeated questions, mirrored pages) share one request and its answer (counted as
``duplicate_texts``). The request's key is the normalized text's hash and the attempt, not a chunk id.

Invariant, checked for every shard: chunks tagged + quarantined + outside the sample = chunks in.

The whole shard is asked through one window (``atlas.llm.ask``): a retry is submitted as soon as its
answer fails, while other chunks are still being answered. Answers are cached per shard in
``RUN/_cache/tag/NNNNN.jsonl`` as they arrive, keyed by content (normalized text, attempt), everything the
engine sees and the engine's identity, so a killed shard resumes without asking the engine again.
"""

from __future__ import annotations

import heapq

import pyarrow as pa

from atlas.config import PROJECT_ROOT
from atlas.core.extras import llm_extras
from atlas.core.files import atomic_write_json, atomic_write_parquet, read_parquet, sha256_bytes
from atlas.core.rundir import RunDir
from atlas.core.stage import Stage
from atlas.core.stats import Stats
from atlas.io import layout
from atlas.io.chunks import SAMPLE_FILE, sample_position, sample_threshold
from atlas.io.tags import TAG_SCHEMA
from atlas.llm.answers import Parsed, TagSchema, file_answers, load_schemas, normalize_tag, parse_answer
from atlas.llm.ask import ask_until_done
from atlas.llm.cache import RequestCache
from atlas.llm.engine import LLMRequest, LLMResult, make_tag_engine
from atlas.llm.prompts import load_prompt

TAG_STAGE_VERSION = 3  # 3: fields a document's file extension answers (a code file's language) are set from it
QUARANTINE_SCHEMA = pa.schema(
    [("chunk_id", pa.string()), ("domain", pa.string()), ("reason", pa.string()), ("detail", pa.string()),
     ("attempts", pa.int16()), ("finish_reason", pa.string()), ("raw", pa.string())]
)
RAW_KEPT = 4000  # characters of a quarantined raw answer kept for inspection
PROMPT_PLACEHOLDERS = {
    "system": set(),
    "user": {"domain", "domain_description", "fields", "text"},
    "repair": {"problem", "field_names"},
}


class TaggingFailed(RuntimeError):
    """Too many chunks failed to be tagged for a shard (or the stage) to count as done."""


def text_key(chunk: dict) -> str:
    """What makes two chunks one request: the domain (it picks the schema) and the text, whitespace normalized."""
    return chunk["domain"] + "\n" + " ".join(chunk["chunk_text"].split())


def _prompt_path(config) -> str:
    return config.tag.prompt or str(PROJECT_ROOT / "prompts" / "tag.yaml")


class TagStage(Stage):
    name = "tag"
    output = layout.TAGS
    upstream = ("chunk",)

    def extras(self) -> tuple[str, ...]:
        return ("embed",) if self.config.llm.engine == "offline" else llm_extras(self.config.llm.engine)

    def identity(self) -> dict:
        _, _, files = load_schemas(self.config.tag)
        prompt = load_prompt(_prompt_path(self.config), PROMPT_PLACEHOLDERS)
        # max_failed_share decides whether a shard is done, not what a done shard holds
        tag = self.config.tag.model_dump(exclude={"prompt", "schema_dir", "max_failed_share"})
        return {
            "version": TAG_STAGE_VERSION,
            "tag": tag,
            "engine": make_tag_engine(self.config).identity(),  # model and sampling; never the API key or URL
            "prompt_sha256": prompt.sha256,
            "schema_files": {f"{p.parent.name}/{p.name}": sha256_bytes(p.read_bytes()) for p in files},
        }

    def plan(self, run: RunDir, stage_hash: str) -> int:
        n_shards = run.read_manifest()["stages"]["chunk"]["num_shards"]  # shard i of chunks -> shard i of tags
        if run.success_path(layout.CHUNKS).exists():  # else planned ahead (atlas plan): decided when it runs
            atomic_write_json(run.output_dir(self.output) / SAMPLE_FILE, self._sample_rule(run))
        return n_shards

    def _sample_rule(self, run: RunDir) -> dict:
        """The library sample: documents below ``threshold``. With ``sample_max_docs``, the threshold is the
        position of the first document past the cap, found in one pass over the chunks' document ids that keeps
        at most ``sample_max_docs`` + 1 positions in memory."""
        c = self.config.tag
        rule = {"fraction": c.sample_fraction, "max_docs": c.sample_max_docs, "threshold": c.sample_fraction}
        if c.sample_max_docs is None:
            return rule
        lowest: list[float] = []  # a max-heap (negated) of the sample_max_docs + 1 lowest positions seen
        for part in run.parts(layout.CHUNKS):  # a document's chunks are all in one part (ids are unique)
            for doc_id in set(read_parquet(part, ["doc_id"]).column(0).to_pylist()):
                position = sample_position(doc_id)
                if position >= c.sample_fraction:
                    continue
                if len(lowest) <= c.sample_max_docs:
                    heapq.heappush(lowest, -position)
                elif position < -lowest[0]:
                    heapq.heappushpop(lowest, -position)
        if len(lowest) > c.sample_max_docs:  # more documents than the cap: stop below the one past it
            rule["threshold"] = -lowest[0]
        return rule

    def setup(self) -> None:
        self.schemas, self.candidates, _ = load_schemas(self.config.tag)
        self.prompt = load_prompt(_prompt_path(self.config), PROMPT_PLACEHOLDERS)
        self.engine = make_tag_engine(self.config)
        self.engine.setup()

    def teardown(self) -> None:
        self.engine.close()  # a vLLM engine frees its GPU memory for the next stage's model

    def schema_for(self, domain: str) -> TagSchema:
        name = self.config.tag.domain_schemas.get(domain, domain)
        return self.schemas.get(name, self.schemas["generic"])

    def _request(self, chunk: dict, attempt: int, problem: str | None) -> LLMRequest:
        schema = self.schema_for(chunk["domain"])
        user = self.prompt.render("user", domain=chunk["domain"], domain_description=schema.schema["description"],
                                  fields=schema.describe_fields(), text=chunk["chunk_text"])
        if problem:  # a second chance, told what was wrong
            user += "\n\n" + self.prompt.render("repair", problem=problem, field_names=", ".join(schema.fields))
        lists = {spec["x-atlas-offline"]["list"] for spec in schema.schema["properties"].values()
                 if spec["x-atlas-offline"]["method"] == "candidates"}
        return LLMRequest(
            key=f"{sha256_bytes(text_key(chunk).encode())[:24]}#{attempt}",
            system=self.prompt.templates["system"],
            user=user,
            schema=schema.schema,
            schema_name=f"tags_{schema.name}",
            context={"task": "tag", "text": chunk["chunk_text"], "domain": chunk["domain"],
                     "candidates": {name: self.candidates[name] for name in lists}},
        )

    def run_shard(self, run: RunDir, shard: int) -> Stats:
        every = read_parquet(run.part_path(layout.CHUNKS, shard),
                             ["chunk_id", "doc_id", "source_doc_id", "domain", "chunk_text"])
        threshold = sample_threshold(run, self.config.tag.sample_fraction, self.config.tag.sample_max_docs)
        in_sample = {doc: sample_position(doc) < threshold for doc in set(every.column("doc_id").to_pylist())}
        chunks = [c for c in every.to_pylist() if in_sample[c["doc_id"]]]
        stats = Stats({"chunks_in": every.num_rows, "chunks_sampled": len(chunks), "docs_in": len(in_sample),
                       "docs_sampled": sum(in_sample.values())})
        # One request per distinct (domain, normalized text): the first chunk with it asks, the others share.
        first_with: dict[str, int] = {}
        asker = [first_with.setdefault(text_key(c), i) for i, c in enumerate(chunks)]  # chunk -> who asks
        askers = sorted(first_with.values())
        stats.inc("duplicate_texts", len(chunks) - len(askers))
        tagged: dict[str, dict] = {}
        quarantined: dict[str, dict] = {}

        def request(i: int, attempt: int, problem: str | None) -> LLMRequest:
            if attempt > 1:
                stats.inc("requests_retried")
            return self._request(chunks[askers[i]], attempt, problem)

        def check(i: int, attempt: int, result: LLMResult) -> str | None:
            return self._check(chunks[askers[i]], attempt, result, stats, tagged, quarantined)

        cache = RequestCache(run.root / layout.CACHE / "tag" / f"{shard:05d}.jsonl", self.engine.identity())
        try:
            stats.merge(ask_until_done(self.engine, cache, len(askers), request, check, self.config.tag.batch_size))
        finally:
            cache.close()

        answers = {}  # chunk id -> its tags, or None when the answer for its text was quarantined
        for chunk, i in zip(chunks, asker):
            asked = chunks[i]["chunk_id"]
            answers[chunk["chunk_id"]] = tagged.get(asked)
            if asked in quarantined and chunk["chunk_id"] != asked:
                quarantined[chunk["chunk_id"]] = quarantined[asked] | {"chunk_id": chunk["chunk_id"]}
                stats.drop(quarantined[asked]["reason"])
        tagged_n = sum(tags is not None for tags in answers.values())
        if tagged_n + len(quarantined) != len(chunks):  # never lose a chunk silently
            raise RuntimeError(f"tag shard {shard}: {len(chunks)} chunks of the library sample, {tagged_n} tagged, "
                               f"{len(quarantined)} quarantined")
        self._check_failures(shard, len(chunks), quarantined, stats)
        rows: dict[str, list] = {name: [] for name in TAG_SCHEMA.names}
        for chunk in chunks:
            answer = answers[chunk["chunk_id"]]
            for field, tags in (self._with_file_answers(chunk, answer, stats) if answer else {}).items():
                for rank, (tag, norm) in enumerate(tags):
                    for key, value in zip(TAG_SCHEMA.names, (chunk["chunk_id"], field, tag, norm, rank)):
                        rows[key].append(value)
        stats.inc("chunks_tagged", tagged_n)
        stats.inc("chunks_quarantined", len(quarantined))
        stats.inc("tags_out", len(rows["tag"]))
        atomic_write_parquet(run.part_path(self.output, shard), pa.table(rows, schema=TAG_SCHEMA))
        ordered = [quarantined[c["chunk_id"]] for c in chunks if c["chunk_id"] in quarantined]
        run.write_rejects(self.output, shard, ordered, QUARANTINE_SCHEMA)
        return stats

    def finalize(self, run: RunDir, stats: Stats) -> None:
        """No tag at all is no library sample to build on: stop here, not in the next stage."""
        if stats["chunks_sampled"] and not stats["tags_out"]:
            raise TaggingFailed(f"tag: none of the {stats['chunks_sampled']:,} sampled chunks got a tag "
                                 f"(quarantined: {stats['chunks_quarantined']:,}; the reasons are in "
                                 f"{run.output_dir(self.output) / '_rejects'}); fix the engine, then rerun with "
                                 f"--force --stages tag")

    def _check_failures(self, shard: int, n_chunks: int, quarantined: dict, stats: Stats) -> None:
        """A shard that quarantined more than ``tag.max_failed_share`` of its chunks is no result: it fails, with the
        count and the commonest reasons, and its chunks are asked again on the next run (transport errors are not
        cached; answers that were are not asked again)."""
        limit = self.config.tag.max_failed_share
        if not n_chunks or len(quarantined) <= limit * n_chunks:
            return
        reasons: dict[str, int] = {}
        for row in quarantined.values():
            reasons[row["reason"]] = reasons.get(row["reason"], 0) + 1
        shown = ", ".join(f"{reason}: {count}" for reason, count in sorted(reasons.items(), key=lambda kv: -kv[1])[:3])
        errors = [k.removeprefix("engine_errors.") for k in stats.to_dict() if k.startswith("engine_errors.")]
        hint = (f" (engine errors: {', '.join(sorted(errors)[:3])}; is the server at {self.config.llm.base_url} up, "
                f"and {self.config.llm.api_key_env} set?)" if errors and self.config.llm.engine == "openai" else "")
        raise TaggingFailed(f"tag shard {shard}: {len(quarantined)} of {n_chunks} chunks failed ({shown}), more than "
                             f"tag.max_failed_share ({limit:g}){hint}; nothing of this shard is kept as done, rerun "
                             f"the same command to try it again")

    def _check(self, chunk: dict, attempt: int, result: LLMResult, stats: Stats, tagged: dict,
               quarantined: dict) -> str | None:
        """Count and judge one answer: the chunk is tagged, or quarantined after its last attempt (None for both),
        or asked again with the returned note on what was wrong."""
        chunk_id = chunk["chunk_id"]
        stats.inc("requests")
        stats.inc("tokens_in", result.tokens_in)
        stats.inc("tokens_out", result.tokens_out)
        if result.finish_reason:
            stats.inc(f"finish_reason.{result.finish_reason}")
        if result.error:
            stats.inc(f"engine_errors.{result.error}")
            parsed = Parsed(None, "engine_error", result.error)
        else:
            parsed = parse_answer(result.text, result.finish_reason, self.schema_for(chunk["domain"]))
            for repair in parsed.repairs:
                stats.inc(f"repaired.{repair}")
        if parsed.answer is not None:
            tags = {field: self._normalized(values) for field, values in parsed.answer.items()}
            if any(tags.values()):
                tagged[chunk_id] = tags
                if attempt > 1:
                    stats.inc("chunks_tagged_after_retry")
                return None
            parsed = Parsed(None, "no_tags", "every tag was empty after normalization")
        stats.inc(f"answer_problems.{parsed.problem}")
        if attempt < self.config.tag.max_attempts:
            return f"{parsed.problem}: {parsed.detail}"
        stats.drop(parsed.problem)
        quarantined[chunk_id] = {
            "chunk_id": chunk_id, "domain": chunk["domain"], "reason": parsed.problem, "detail": parsed.detail,
            "attempts": attempt, "finish_reason": result.finish_reason, "raw": (result.text or "")[:RAW_KEPT],
        }
        return None

    def _with_file_answers(self, chunk: dict, tags: dict, stats: Stats) -> dict:
        """The chunk's tags, with the fields its document's file name answers (``file_answers``: a code file's
        language from its extension) set from it, whatever the engine said; counted, and counted again where the
        engine had said something else."""
        known = {field: self._normalized(values) for field, values in
                 file_answers(self.schema_for(chunk["domain"]), chunk["source_doc_id"] or chunk["doc_id"]).items()}
        for field, values in known.items():
            stats.inc("tags_from_file_extension")
            if [norm for _, norm in tags.get(field, [])] != [norm for _, norm in values]:
                stats.inc("engine_tags_replaced_by_file_extension")
        return tags | known

    @staticmethod
    def _normalized(values: list[str]) -> list[tuple[str, str]]:
        """(tag as produced, normalized tag), without empty or repeated normalized tags."""
        seen, out = set(), []
        for value in values:
            norm = normalize_tag(value)
            if norm and norm not in seen:
                seen.add(norm)
                out.append((value.strip(), norm))
        return out
