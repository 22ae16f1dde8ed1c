"""``atlas estimate CONFIG``: measure throughput on a sample of the corpus and project the hours per stage.

The sample is ``sample_docs`` documents taken from shards spread evenly over the input. Chunking and
tagging run through the real stages (in a temporary run directory, with the configured engine);
annotation is timed with the run's trained annotator when ``RUN/annotator`` exists, else with the
configured encoder alone (its ``encode`` is nearly all of the annotation cost); tokenization times
tiktoken plus the stream layout. Rates are per worker; the projection divides by
``execution.workers``. Global stages (vocab ... train_annotator) and the index depend on the size of the tag
vocabulary and the reservoir rather than on the corpus and are not projected.

The two paths of the pipeline are projected apart: the **library path** tags only the library sample
(``tag.sample_fraction`` of the documents, at most ``tag.sample_max_docs``; none with
``annotate.annotator_from``), the **corpus path** chunks, annotates and tokenizes every document.
"""

from __future__ import annotations

import json
import logging
import tempfile
import time
from pathlib import Path

from atlas.config import AtlasConfig
from atlas.core.rundir import RunDir
from atlas.io import layout
from atlas.io.inputs import Document, plan_shards, read_shard

logger = logging.getLogger("atlas.tools.estimate")  # what it measures, as it goes (`atlas estimate` prints it)


def sample_documents(config: AtlasConfig, sample_docs: int) -> tuple[int, list[Document]]:
    """(documents in the corpus, a sample of them from shards spread over the input)."""
    plan = plan_shards(config.input)
    shards = plan["shards"]
    total = sum(s["stop"] - s["start"] for s in shards)
    picked = sorted({round(i * (len(shards) - 1) / max(1, min(len(shards), 8) - 1))
                     for i in range(min(len(shards), 8))})
    per_shard = -(-sample_docs // len(picked))
    docs: list[Document] = []
    for shard in picked:
        taken = 0
        for item in read_shard(plan, shard, config.input):
            if isinstance(item, Document) and item.text.strip():
                docs.append(item)
                taken += 1
                if taken == per_shard:
                    break
    return total, docs[:sample_docs]


def _measured(row: dict, seconds: float) -> str:
    return f"  {row['stage']}: {row['sample']:,} {row['unit']} in {seconds:,.1f} s = {row['per_second']:,.1f}/s"


def estimate(config: AtlasConfig, sample_docs: int = 200, log=logger.info) -> list[dict]:
    """Time each map stage on the sample, saying what it measures as it goes; one row per stage."""
    from atlas.runner import run_stages

    log(f"sampling up to {sample_docs} documents from {config.input.path} ...")
    total_docs, docs = sample_documents(config, sample_docs)
    if not docs:
        raise ValueError(f"{config.input.path}: no documents with text to sample")
    log(f"corpus: {total_docs:,} documents; sample: {len(docs)} documents")
    rows = []

    def measured(stage: str, n: int, seconds: float, unit: str, total: float, path: str = "corpus") -> None:
        rows.append(_row(stage, n, seconds, unit, total, config) | {"path": path})
        log(_measured(rows[-1], seconds))

    with tempfile.TemporaryDirectory(prefix="atlas-estimate-") as tmp:
        sample = Path(tmp) / "sample.jsonl"
        sample.write_text("".join(json.dumps({"id": d.doc_id, "text": d.text, "domain": d.domain,
                                              "data_src": d.data_src})
                                  + "\n" for d in docs))
        trial = config.model_copy(deep=True)
        trial.run_dir = str(Path(tmp) / "run")
        trial.input = trial.input.model_copy(update={
            "path": str(sample), "format": "jsonl", "text_field": "text", "id_field": "id", "domain_field": "domain",
            "data_src_field": "data_src", "metadata_fields": [], "docs_per_shard": len(docs)})
        trial.execution = trial.execution.model_copy(update={"orchestrator": "inline", "progress": False})
        trial.tag = trial.tag.model_copy(update={"sample_fraction": 1.0, "sample_max_docs": None})  # time them all
        run = RunDir(trial.run_dir)
        import pyarrow.parquet as pq

        log(f"measuring chunk on {len(docs)} documents ...")
        run_stages(trial, ["chunk"], log=lambda m: None)
        texts = pq.read_table(run.part_path(layout.CHUNKS, 0), columns=["chunk_text"]).column(0).to_pylist()
        total_chunks = total_docs * len(texts) / len(docs)
        measured("chunk", len(docs), run.shard_marker(layout.CHUNKS, 0)["seconds"], "docs", total_docs)

        share = library_share(config, total_docs)
        if share:
            log(f"measuring tag ({config.llm.engine}) on {len(texts):,} chunks (loads the engine first; the slowest "
                f"measurement); the library sample is {share:.1%} of the documents ...")
            run_stages(trial, ["tag"], log=lambda m: None)
            measured(f"tag ({config.llm.engine})", len(texts), run.shard_marker(layout.TAGS, 0)["seconds"],
                     "chunks", total_chunks * share, "library sample")
        else:
            log(f"no tagging: annotate.annotator_from uses the annotator of {config.annotate.annotator_from}")

        log(f"measuring annotate on {len(texts):,} chunks ...")
        measured(*_time_annotation(config, texts), "chunks", total_chunks)

        log(f"measuring tokenize on {len(texts):,} chunks ...")
        measured("tokenize", len(texts), _time_tokenization(config, texts), "chunks", total_chunks)
    return rows


def library_share(config: AtlasConfig, total_docs: int) -> float:
    """The share of the documents the tag stage sees: the library sample (none with annotate.annotator_from)."""
    if config.annotate.annotator_from:
        return 0.0
    share = config.tag.sample_fraction
    if config.tag.sample_max_docs is not None and total_docs:
        share = min(share, config.tag.sample_max_docs / total_docs)
    return share


def _row(stage: str, n: int, seconds: float, unit: str, total: float, config: AtlasConfig) -> dict:
    rate = n / max(seconds, 1e-9)
    hours = total / rate / 3600
    return {"stage": stage, "sample": n, "unit": unit, "per_second": rate, "corpus": int(total),
            "hours_one_worker": hours, "hours": hours / config.execution.workers}


def _time_annotation(config: AtlasConfig, texts: list[str]) -> tuple[str, int, float]:
    folder = RunDir(config.run_dir).output_dir(layout.ANNOTATOR)
    if config.annotate.annotator_from:
        from atlas.io.library import annotator_source

        folder = annotator_source(config.annotate.annotator_from)[0]
    if (folder / "config.json").exists():
        from atlas.models.annotator import Annotator

        annotator = Annotator(folder, device=config.annotate.device, batch_size=config.annotate.batch_size).setup()
        annotator.annotate(texts[:8])  # load and warm up
        start = time.perf_counter()
        annotator.annotate(texts)
        return "annotate", len(texts), time.perf_counter() - start
    from atlas.models.embedder import Embedder

    embedder = Embedder(config.annotator.encoder, device=config.annotate.device, batch_size=config.annotate.batch_size)
    embedder.encode(texts[:8])
    start = time.perf_counter()
    embedder.encode(texts)
    return "annotate (encoder only: no trained annotator yet)", len(texts), time.perf_counter() - start


def _time_tokenization(config: AtlasConfig, texts: list[str]) -> float:
    from atlas.models.tokenizer import cl100k
    from atlas.stages.tokenize import chunk_stream

    encoding = cl100k()
    start = time.perf_counter()
    tokens = encoding.encode_ordinary_batch(texts, num_threads=config.tokenize.threads)
    chunk_stream(tokens, [False] * len(tokens))
    return time.perf_counter() - start
