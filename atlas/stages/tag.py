"""Stage ``tag`` (map): chunks -> structured free-form tags (paper 4.2.1).

Each chunk is tagged with the schema of its domain (``schemas/tags/<domain>.json``; ``generic``
for other domains) through the configured engine: ``offline`` (no LLM), ``openai`` (any
OpenAI-compatible server) or ``vllm``. Answers are parsed, repaired where harmless, validated
against the schema and normalized; an answer that still fails is asked again (with a short note
on what was wrong) up to ``tag.max_attempts`` times, then the chunk is quarantined in
``tags/_rejects/`` with the raw answer and the reason.

Invariant, checked for every shard: chunks tagged + chunks quarantined = chunks in.

The whole shard is asked through one window (``atlas.llm.ask``): a retry is submitted as soon as its
answer fails, while other chunks are still being answered. Answers are cached per shard in
``RUN/_cache/tag/NNNNN.jsonl`` as they arrive, keyed by chunk, attempt, everything the engine sees and
the engine's identity, so a killed shard resumes without asking the engine again.
"""

from __future__ import annotations

import pyarrow as pa

from atlas.config import PROJECT_ROOT
from atlas.core.extras import llm_extras
from atlas.core.files import atomic_write_parquet, read_parquet, sha256_bytes
from atlas.core.rundir import RunDir
from atlas.core.stage import Stage
from atlas.core.stats import Stats
from atlas.io import layout
from atlas.io.tags import TAG_SCHEMA
from atlas.llm.answers import Parsed, TagSchema, load_schemas, normalize_tag, parse_answer
from atlas.llm.ask import ask_until_done
from atlas.llm.cache import RequestCache
from atlas.llm.engine import LLMRequest, LLMResult, make_tag_engine
from atlas.llm.prompts import load_prompt

TAG_STAGE_VERSION = 1
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
        tag = self.config.tag.model_dump(exclude={"prompt", "schema_dir"})
        return {
            "version": TAG_STAGE_VERSION,
            "tag": tag,
            "engine": make_tag_engine(self.config).identity(),  # model and sampling; never the API key or URL
            "prompt_sha256": prompt.sha256,
            "schema_files": {f"{p.parent.name}/{p.name}": sha256_bytes(p.read_bytes()) for p in files},
        }

    def plan(self, run: RunDir, stage_hash: str) -> int:
        return run.read_manifest()["stages"]["chunk"]["num_shards"]  # shard i of chunks -> shard i of tags

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
            key=f"{chunk['chunk_id']}#{attempt}",
            system=self.prompt.templates["system"],
            user=user,
            schema=schema.schema,
            schema_name=f"tags_{schema.name}",
            context={"task": "tag", "text": chunk["chunk_text"], "domain": chunk["domain"],
                     "candidates": {name: self.candidates[name] for name in lists}},
        )

    def run_shard(self, run: RunDir, shard: int) -> Stats:
        chunks = read_parquet(run.part_path(layout.CHUNKS, shard), ["chunk_id", "domain", "chunk_text"]).to_pylist()
        stats = Stats({"chunks_in": len(chunks)})
        tagged: dict[str, dict] = {}
        quarantined: dict[str, dict] = {}

        def request(i: int, attempt: int, problem: str | None) -> LLMRequest:
            if attempt > 1:
                stats.inc("requests_retried")
            return self._request(chunks[i], attempt, problem)

        def check(i: int, attempt: int, result: LLMResult) -> str | None:
            return self._check(chunks[i], attempt, result, stats, tagged, quarantined)

        cache = RequestCache(run.root / layout.CACHE / "tag" / f"{shard:05d}.jsonl", self.engine.identity())
        try:
            stats.merge(ask_until_done(self.engine, cache, len(chunks), request, check, self.config.tag.batch_size))
        finally:
            cache.close()

        if len(tagged) + len(quarantined) != len(chunks):  # never lose a chunk silently
            raise RuntimeError(f"tag shard {shard}: {len(chunks)} chunks in, {len(tagged)} tagged, "
                               f"{len(quarantined)} quarantined")
        rows: dict[str, list] = {name: [] for name in TAG_SCHEMA.names}
        for chunk in chunks:
            for field, tags in tagged.get(chunk["chunk_id"], {}).items():
                for rank, (tag, norm) in enumerate(tags):
                    for key, value in zip(TAG_SCHEMA.names, (chunk["chunk_id"], field, tag, norm, rank)):
                        rows[key].append(value)
        stats.inc("chunks_tagged", len(tagged))
        stats.inc("chunks_quarantined", len(quarantined))
        stats.inc("tags_out", len(rows["tag"]))
        atomic_write_parquet(run.part_path(self.output, shard), pa.table(rows, schema=TAG_SCHEMA))
        ordered = [quarantined[c["chunk_id"]] for c in chunks if c["chunk_id"] in quarantined]
        run.write_rejects(self.output, shard, ordered, QUARANTINE_SCHEMA)
        return stats

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
