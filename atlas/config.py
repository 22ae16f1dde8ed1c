"""Run configuration: one YAML file, validated with pydantic.

Every section forbids unknown keys, and a typo is reported with the nearest valid key, e.g.
``llm.modle: unknown key; did you mean 'model'?``. Command-line overrides use
dotted paths: ``--set chunk.domains.web.max_tokens=200``.
"""

from __future__ import annotations

import difflib
import json
import os
import re
import typing
from pathlib import Path, PurePosixPath
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator


class ConfigError(ValueError):
    """A configuration file or override that cannot be used; the message says where and why."""


_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")  # "s3://", "hf://", "file://": an fsspec URL, not a local path


def is_url(path: str | Path) -> bool:
    """Whether ``path`` is a URL (``s3://bucket/key``) rather than a local path."""
    return _URL.match(str(path)) is not None


def default_local_copy(url: str) -> Path:
    """Where a run directory in object storage is worked on when the config names no ``local_copy``:
    ``$ATLAS_CACHE/runs/<scheme>/<bucket>/<path>`` (ATLAS_CACHE defaults to ~/.cache/atlas)."""
    scheme, rest = url.split("://", 1)
    if ".." in PurePosixPath(rest).parts:
        raise ConfigError(f"run_dir {url}: '..' is not allowed in a run directory URL")
    cache = Path(os.environ.get("ATLAS_CACHE", Path.home() / ".cache" / "atlas"))
    return cache / "runs" / scheme / PurePosixPath(rest.strip("/"))


def _is_number(annotation: Any) -> bool:
    return annotation in (int, float) or any(a in (int, float) for a in typing.get_args(annotation))


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    @field_validator("*", mode="before")
    @classmethod
    def _bool_is_not_a_number(cls, v: Any, info: ValidationInfo) -> Any:
        # pydantic reads true as 1: a token count, a size or a threshold given as true/false (YAML yes/no) is a mistake
        if isinstance(v, bool) and _is_number(cls.model_fields[info.field_name].annotation):
            raise ValueError("must be a number, not a bool")
        return v


class InputConfig(Section):
    """Where the documents come from and which fields hold what."""

    # a file, a glob, or a directory; relative paths resolve against the config file. Or a URL that fsspec reads:
    # s3://bucket/prefix/ (the s3 extra), gs://, hf://datasets/org/name/..., each a file, a folder or a glob.
    path: str | None = None
    format: Literal["auto", "parquet", "jsonl", "text"] = "auto"
    text_field: str = "text"
    id_field: str | None = "doc_id"  # None (or a missing field) -> "<file stem>:<row>"
    domain_field: str | None = "domain"
    data_src_field: str | None = "data_src"
    metadata_fields: list[str] = Field(default_factory=list)  # copied into the chunk's metadata JSON
    default_domain: str = "web"  # for records without a domain field
    docs_per_shard: int = Field(default=1000, ge=1)  # large files are split into shards of about this size


class ChunkDomain(Section):
    max_tokens: int = Field(ge=1)
    # "sentences": BlingFire sentences (prose). "lines": blank-line blocks, then lines (source code).
    splitter: Literal["sentences", "lines"] = "sentences"


def _default_chunk_domains() -> dict[str, ChunkDomain]:
    # Paper 4.2.1: 150 tokens for web/general text, 256 for math and code.
    prose = {d: ChunkDomain(max_tokens=150) for d in ("web", "general", "academic", "qa")}
    return prose | {"math": ChunkDomain(max_tokens=256), "code": ChunkDomain(max_tokens=256, splitter="lines")}


class ChunkConfig(Section):
    domains: dict[str, ChunkDomain] = Field(default_factory=_default_chunk_domains)  # merged onto the defaults
    default: ChunkDomain = ChunkDomain(max_tokens=150)  # for domains not listed above
    max_sentence_tokens: int = Field(default=50_000, ge=1)  # longer sentences are dropped (paper 4.2.1)
    # True: n_tokens == len(encode(chunk_text)) exactly (only each chunk's first and last words are encoded
    # again). False: the count of the whole-document pass, off by one token in about 1 chunk in 10; ~1.3x faster.
    exact_token_counts: bool = True

    @field_validator("domains", mode="before")
    @classmethod
    def _merge_with_defaults(cls, v: Any) -> Any:
        if not isinstance(v, dict):
            return v
        merged = {name: d.model_dump() for name, d in _default_chunk_domains().items()}
        for name, d in v.items():
            merged[name] = {**merged.get(name, {}), **d} if isinstance(d, dict) else d
        return merged

    def for_domain(self, domain: str) -> ChunkDomain:
        return self.domains.get(domain, self.default)


PROJECT_ROOT = Path(__file__).resolve().parent.parent  # holds prompts/ and schemas/


class LLMConfig(Section):
    """The engine behind every LLM step: tagging, judging, coherence, labeling, merging."""

    engine: Literal["offline", "openai", "vllm"] = "offline"  # offline: no LLM, runs on a laptop
    model: str = "mistralai/Mistral-Small-3.1-24B-Instruct-2503"  # the paper's annotator (openai, vllm)
    temperature: float = Field(default=0.0, ge=0)
    top_p: float = Field(default=1.0, gt=0, le=1)
    max_tokens: int = Field(default=512, ge=1)  # per answer; an answer cut here is finish_reason "length"
    seed: int = Field(default=0, ge=0, lt=2**31)
    # openai: any OpenAI-compatible server. The key is read from the environment variable named
    # here and never written to configs, manifests, logs or reports.
    base_url: str = "http://127.0.0.1:8000/v1"
    api_key_env: str = "OPENAI_API_KEY"
    max_concurrency: int = Field(default=16, ge=1)  # requests in flight
    timeout_s: float = Field(default=120.0, gt=0)  # per request
    max_retries: int = Field(default=4, ge=0)  # transport retries: HTTP 429/5xx, timeouts, lost connections
    backoff_s: float = Field(default=1.0, ge=0)  # first wait between retries, doubled each time
    retry_after_max_s: float = Field(default=60.0, ge=0)  # longest wait honoured from a Retry-After (429/503)
    requests_per_minute: float | None = Field(default=None, gt=0)  # None: no limit; per shard task
    tokens_per_minute: float | None = Field(default=None, gt=0)  # prompt + answer tokens; None: no limit
    # vllm: offline batched inference on local GPUs
    tensor_parallel_size: int = Field(default=1, ge=1)
    gpu_memory_utilization: float = Field(default=0.9, gt=0, le=1)
    max_model_len: int | None = Field(default=8192, ge=1)
    dtype: str = "auto"


class TagConfig(Section):
    """Stage 1 tagging (paper 4.2.1): structured free-form tags for every chunk."""

    embedding_model: str = "all-MiniLM-L6-v2"  # the offline engine's embedder (a name or a local folder)
    prompt: str | None = None  # None: the project's prompts/tag.yaml; else a path relative to the config file
    schema_dir: str | None = None  # None: the project's schemas/ (tags/<domain>.json, candidates/<list>.json)
    # corpus domain -> tag schema; domains not listed use the schema of the same name, else "generic"
    domain_schemas: dict[str, str] = Field(default_factory=dict)
    max_attempts: int = Field(default=3, ge=1)  # answers that fail validation are asked again, then quarantined
    # A shard whose quarantined share of its sampled chunks passes this fails (and runs again on the next run): an
    # endpoint that is down or a key that is unset quarantines every chunk, which is no result. 1: never fail.
    max_failed_share: float = Field(default=0.5, ge=0, le=1)
    # requests per call of a batch engine (offline, vLLM); a server gets llm.max_concurrency at once
    batch_size: int = Field(default=256, ge=1)
    # The library sample (paper 4.2: 6.6M of 1.84B documents tagged). A document is tagged when a stable hash of
    # its id falls below sample_fraction (the same documents however the input is sharded; every data_src in
    # proportion), at most sample_max_docs of them. Tag -> ... -> train_annotator see the sample only; annotate,
    # tokenize and index see every chunk.
    sample_fraction: float = Field(default=1.0, gt=0, le=1)
    sample_max_docs: int | None = Field(default=None, ge=1)


class VocabConfig(Section):
    """The tag vocabulary and its embeddings, the input of clustering (paper 4.2.2)."""

    # Tags seen fewer times are left out (the paper clustered the ~1M of 14M unique tags seen more than 15 times).
    min_count: int = Field(default=1, ge=1)
    # The fields whose tags become content concepts, by their schema role ("x-atlas-role"): "topic" fields say what a
    # chunk is about; "style" fields (purpose, tone, difficulty, notation...) how it is written. Style tags stay in
    # tags/ and the auxiliary domains (library.aux_domains) label style; ["topic", "style"] clusters everything.
    roles: list[Literal["topic", "style"]] = Field(default_factory=lambda: ["topic"], min_length=1)
    # Tags on more than this share of the tagged chunks say nothing about any of them ("number", "people"): left out.
    max_chunk_share: float = Field(default=0.02, gt=0, le=1)
    generic_min_chunks: int = Field(default=20, ge=1)  # ... and on more than this many (small corpora: none generic)
    # Generic in context: a tag on at least context_min_chunks chunks whose chunks are no more alike than random chunks
    # of their domain ("way", "value", "answer"; "fraction" across a math corpus) says nothing about them either:
    # left out when its excess cohesion within its domains is below min_context_specificity (0: no such test).
    # The most frequent context_max_tags tags are tested (generic words are frequent), each on up to 32 chunks
    # embedded with annotator.encoder; see the vocab stage.
    min_context_specificity: float = Field(default=0.05, ge=0, lt=1)
    context_min_chunks: int = Field(default=8, ge=2)
    context_max_tags: int = Field(default=5000, ge=1)
    embedding_model: str = "all-MiniLM-L6-v2"  # paper: all-mpnet-base-v2 (768-d), from a local folder or the HF cache
    batch_size: int = Field(default=256, ge=1)  # tags per encode call; also the embedding cache's unit


class LibraryConfig(Section):
    """From the tag vocabulary to the concept library (paper 4.2.2): cluster, filter, label, merge."""

    seed: int = Field(default=0, ge=0, lt=2**31)
    # k-sweep: None sweeps a grid from the vocabulary size (about n/200 to n/5); k fixes one value.
    ks: list[Annotated[int, Field(ge=2)]] | None = Field(default=None, min_length=1)
    k: int | None = Field(default=None, ge=2)
    # ... the largest k of the sweep whose silhouette is within this share of the best (0: the best silhouette). On the
    # dev corpus k = 500 and 1,000 were 1% to 8% apart, by seed: within the spread of k-means itself, so the finer
    # is kept; 2,000 was 25% below.
    k_tolerance: float = Field(default=0.10, ge=0, lt=1)
    # ... each k scored by this many k-means runs (seeds seed, seed+1, ...), averaged: one run's silhouette at a k
    # moved by 6% with the seed on the dev corpus. The sweep takes this many times as long (dev corpus: 95 s, not 35);
    # a fixed library.k is scored once.
    sweep_seeds: int = Field(default=3, ge=1)
    # What k-means clusters: "occurrences" weights each tag by how often it was produced, so centroids go where the
    # corpus' tags are ("equation" x55 and "polynomial" x30 get their own concepts rather than sharing one with 37
    # rare variants); "tags" weighs every distinct tag alike.
    cluster_weights: Literal["occurrences", "tags"] = "occurrences"
    # How the chosen k's fit starts: "k-means++" seeds the centroids apart (scikit-learn, on the fit's sample), so
    # the fit ends in a better optimum than from random tags (dev corpus: mean cosine to the centroid 0.710, not
    # 0.688) and more topical concepts; "random" is FAISS' default and costs nothing (k-means++ added 40 s to the
    # dev corpus' fit, and grows with k x the sample). The sweep's many fits start at random either way.
    kmeans_init: Literal["k-means++", "random"] = "k-means++"
    # The chosen k is fit on each tag's embedding joined with the mean embedding of its chunks (annotator.encoder),
    # this share of the cosine from the chunks: tags that only look alike ("afp", "type ub") part, and tags given to
    # texts of one subject meet; the coherence stage's tag-set test reads the same vectors. 0: the tag embeddings
    # alone (see atlas/stages/cluster.py).
    context_weight: float = Field(default=0.4, ge=0, lt=1)
    # Coherence filter (paper: core >= 9, random >= 8, edge >= 7 on a 1-10 scale, sets of 10 tags).
    strata_size: int = Field(default=10, ge=2)
    core_min: int = Field(default=9, ge=1, le=10)
    random_min: int = Field(default=8, ge=1, le=10)
    edge_min: int = Field(default=7, ge=1, le=10)
    # A cluster's chunks must be closer to each other than random chunks of the corpus: with m and r their mean
    # pairwise cosines, (m - r) / (1 - r) >= this (clusters of filler words cover chunks with nothing in common).
    # 0: no such test.
    min_chunk_cohesion: float = Field(default=0.05, ge=0, lt=1)
    # The same excess over the pairs of a cluster's chunks that share none of its tags must reach this: tags that
    # only look alike ("strip", "nl wrap", "reel") each have cohesive chunks, but not across them. 0: no such test.
    min_cross_tag_cohesion: float = Field(default=0.035, ge=0, lt=1)
    # A concept must be on at least this many chunks: a cluster of the tags of one or two chunks (with contexts, their
    # tags share one context and cluster together) names those chunks, not something the corpus has. 1: no such test.
    min_concept_chunks: int = Field(default=5, ge=1)
    # A tag inherits its cluster's concept only when its cosine to the cluster's centroid reaches this: the tags at a
    # cluster's edge are often another sense of a word ("inequality" of incomes in a cluster of math inequalities).
    tag_min_similarity: float = Field(default=0.55, ge=-1, le=1)
    # With contexts (context_weight > 0) a tag also inherits it when its cosine to the centroid in the space k-means
    # fit (the tag joined with its chunks) reaches this: a tag clustered by its chunks ("nci guideline" with
    # mammography) is not at its cluster's edge though its words are. Near concepts are found in that space too.
    joined_min_similarity: float = Field(default=0.5, ge=-1, le=1)
    # A tag also counts this much of a vote, in the library's reading of a chunk (atlas eval library), for its near
    # concept: that of the nearest other kept cluster at tag_min_similarity or more (a tag between two topics, or one
    # whose cluster was dropped). With contexts it is read for each occurrence, in its chunk: the tag joined with
    # that chunk's embedding, in the space k-means fit, at near_min_similarity; a tag with no concept of its own
    # gives its two nearest concepts there this much each. Read when the library is read, by no stage: the
    # annotator's targets are the tags' own concepts. 0: own concepts only.
    near_concept_weight: float = Field(default=0.5, ge=0, le=1)
    # With contexts: an occurrence's near concept is at least this close (cosine in the joined space) to its cluster's
    # centroid. 0.3 passes 99% of the dev corpus' tags (0.5, the inheritance floor, 44%): what a near concept is for
    # is the topic nearest a tag in its chunk, which a tag's words alone often are far from (docs/quality.md).
    near_min_similarity: float = Field(default=0.3, ge=-1, le=1)
    label_tags: int = Field(default=60, ge=5)  # representative tags per cluster shown to the labeler (paper: 50-100)
    # Offline names prefer a top tag that is a Library of Congress subject heading ("army" over "austrian infantry"
    # for a cluster of armies): "lcsh" needs them installed once (bash scripts/get_lcsh.sh, 6 MB); "none": no bonus.
    name_headings: Literal["none", "lcsh"] = "none"
    # Dedup: edges to the m nearest concepts with cosine >= tau, Louvain, merge; one pass per tau.
    dedup_taus: list[Annotated[float, Field(gt=0, le=1)]] = Field(default_factory=lambda: [0.95, 0.90, 0.85])
    dedup_m: int = Field(default=20, ge=1)
    dedup_min_merged: float = Field(default=0.005, ge=0)  # repeat a tau while a pass merges more than this share
    name_merge_tau: float = Field(default=0.9, gt=0, le=1)  # then: concepts whose names have cosine > this merge
    # a word must occur in this many of a concept's chunks to be "lifted"
    lift_min_support: int = Field(default=5, ge=1)
    # Auxiliary domains (paper 4.2.3), each a finite list in schemas/aux/<domain>.json. Their labels join
    # the library after the content concepts: one global id space, with per-domain offsets in config.json.
    aux_domains: list[str] = Field(default_factory=lambda: ["tone", "demographic", "alignment"])


class AnnotatorConfig(Section):
    """Stage 3 (paper 4.2.3): the targets, the reservoir and the concept annotator."""

    seed: int = Field(default=0, ge=0, lt=2**31)
    # Reservoir (long-tail enriched): up to min_per_concept chunks of every concept first, then a
    # uniform fill up to reservoir_size (None: every tagged chunk). Split by document, not chunk.
    reservoir_size: int | None = Field(default=None, ge=1)
    min_per_concept: int = Field(default=20, ge=1)
    heldout_fraction: float = Field(default=0.2, gt=0, lt=1)  # paper: 597k of 2.9M chunks held out
    # Auxiliary labels. A demographic, alignment or emotional-tone label must stay off neutral, technical text:
    # each such label is calibrated against a null of that text (atlas.io.neutral_text), and a chunk gets it only
    # when its score beats the null's aux_null_quantile (1.0: the highest score any null text reaches), both for
    # the targets (offline: the label's embedding similarity) and for the annotator's calibrated probabilities.
    # Offline, a label that may describe such text (a tone marked "expository": technical, neutral, ...) applies
    # when its similarity is aux_min_z standard deviations above its mean over the reservoir; every label needs
    # a similarity of at least aux_min_similarity.
    # A chunk whose nearest null text is at cosine aux_null_nearest or more reads like the null (a licence clause,
    # an API reference) and gets none of these labels: on such text a label's score is noise (docs/quality.md).
    aux_null_quantile: float = Field(default=1.0, ge=0.5, le=1)
    aux_null_nearest: float = Field(default=0.4, gt=0, le=1)
    aux_min_z: float = Field(default=2.0, ge=-10, le=10)
    aux_min_similarity: float = Field(default=0.2, ge=-1, le=1)
    # Model: encoder -> pooled embedding; content head = scale * <embedding, K_c> + b_c with K initialized
    # from the concepts' "name: description" embeddings; MLP trunk + linear heads for the auxiliary domains.
    encoder: str = "all-MiniLM-L6-v2"  # paper: Qwen3-Embedding-0.6B (a local folder or the HF cache)
    mode: Literal["frozen", "finetune"] = "frozen"  # frozen: heads on cached embeddings (CPU); finetune: GPU
    device: str | None = None  # None: cuda if available, else cpu
    hidden: int = Field(default=512, ge=8)
    dropout: float = Field(default=0.1, ge=0, lt=1)
    epochs: int = Field(default=30, ge=1)
    batch_size: int = Field(default=256, ge=1)
    lr: float = Field(default=3e-3, gt=0)
    encoder_lr: float = Field(default=2e-5, gt=0)  # finetune mode only
    weight_decay: float = Field(default=0.01, ge=0)
    embed_batch_size: int = Field(default=128, ge=1)  # chunks per encode call; also the embedding cache's unit
    # Loss: masked BCE on positives + pu_weight * non-negative PU risk (Kiryo et al. 2017). The class
    # prior of concept c among unlabeled chunks follows from its labeled rate p_c and the assumed
    # label_frequency (the share of a concept's true chunks that tagging found): pi = p(1/f - 1) / (1 - p).
    pu_weight: float = Field(default=1.0, ge=0)
    label_frequency: float = Field(default=0.5, gt=0, le=1)
    pu_beta: float = Field(default=0.0, ge=0)  # nnPU: when the negative risk is below -beta ...
    pu_gamma: float = Field(default=1.0, ge=0)  # ... step on -gamma * (negative risk) instead
    # sampling weight of a chunk: mean over its concepts of count^-power
    rarity_power: float = Field(default=0.5, ge=0)
    # Calibration and decision rule, on the held-out split. Each domain's logits are Platt-calibrated to the
    # probability of a known positive (stored in annotator/config.json). A content concept is given when its
    # calibrated probability reaches the threshold that maximizes F1 of the known positives on held-out pairs
    # (at least the domain's known-positive rate); an auxiliary label (tone, demographic, alignment) when it
    # reaches aux_min_probability and, unless it is an expository tone, beats the null (aux_null_quantile above),
    # so a chunk may get none. max_caps only bounds the labels per chunk (a safety
    # limit, not chosen by a criterion). Fixed values per domain in thresholds (calibrated probabilities) and
    # caps override the rule and max_caps.
    aux_min_probability: float = Field(default=0.5, gt=0, le=1)
    max_caps: dict[str, Annotated[int, Field(ge=1)]] = Field(
        default_factory=lambda: {"content": 20, "tone": 3, "demographic": 3, "alignment": 2})
    thresholds: dict[str, Annotated[float, Field(ge=0, le=1)]] = Field(default_factory=dict)  # probabilities
    caps: dict[str, Annotated[int, Field(ge=1)]] = Field(default_factory=dict)
    judge_sample: int = Field(default=100, ge=0)  # held-out chunks whose predictions the relevance judge scores


class AnnotateConfig(Section):
    """Corpus annotation (paper 4.5): every chunk -> concepts + an FP16 embedding, shard by shard."""

    batch_size: int = Field(default=64, ge=1)  # chunks per encoder forward pass
    block_rows: int = Field(default=4096, ge=1)  # chunks read, encoded and written at a time (bounds memory)
    # Rows per storage chunk of RUN/embeddings.zarr (1024 x 384 x 2 bytes = 768 KiB). Shards write the chunks
    # inside their rows directly; chunks shared by two shards are written at the end: keep it below the shard size.
    zarr_chunk_rows: int = Field(default=1024, ge=1)
    device: str | None = None  # None: cuda if available, else cpu
    # A finished run (or an annotator folder beside its library) whose annotator labels this corpus: the run then
    # chunks, annotates, tokenizes and indexes without tagging (relative paths resolve against the config file).
    annotator_from: str | None = None


class TokenizeConfig(Section):
    """Training shards (paper 4.5.1): [BOS] + chunk tokens + [EOC], <|endoftext|> after a document's last chunk."""

    block_rows: int = Field(default=8192, ge=1)  # chunks tokenized at a time
    threads: int = Field(default=2, ge=1)  # tiktoken's encode_ordinary_batch threads


class IndexConfig(Section):
    """FAISS IVFPQ over the chunk embeddings, for training-data attribution (paper 4.6)."""

    code_bytes: int = Field(default=64, ge=1)  # PQ code size per vector
    nlist: int | None = Field(default=None, ge=1)  # None: the documented rule in atlas.models.ivfpq.nlist_for
    nprobe: int = Field(default=16, ge=1)  # coarse clusters searched (paper: recall@10 0.968 at 16)
    on_disk: bool | None = None  # None: on-disk inverted lists above atlas.models.ivfpq's size threshold
    seed: int = Field(default=0, ge=0, lt=2**31)


class ExecutionConfig(Section):
    orchestrator: Literal["prefect", "inline"] = "prefect"  # inline: plain loop, no Prefect (debugging)
    # threads: the chunker's heavy calls (BlingFire, tiktoken) release the GIL. processes: separate Python
    # processes; each starts its own temporary Prefect server unless PREFECT_API_URL points at one.
    # ray: each shard is a Ray task (prefect-ray); a local Ray instance unless ray_address names a cluster.
    task_runner: Literal["threads", "processes", "ray"] = "threads"
    workers: int = Field(default=2, ge=1)  # shards processed at once (threads, processes)
    ray_address: str | None = None  # ray: None starts a local instance; "auto" or "ray://head:10001" joins a cluster
    # ray: GPUs per actor by stage, e.g. {annotate: 1}: that stage's shards run on long-lived actors (one model load
    # per actor, as many actors as the cluster's GPUs hold), not as one Ray task per shard
    ray_gpus: dict[str, Annotated[float, Field(gt=0)]] = Field(default_factory=dict)
    shard_retries: int = Field(default=1, ge=0)  # a failed shard task is run again this many times (Prefect only)
    shard_retry_delay_seconds: float = Field(default=5.0, ge=0)
    progress: bool = True
    # The most memory (GiB) a global stage's out-of-core work (DuckDB aggregations, joins) may hold before it
    # spills to RUN/_tmp; peak memory is bounded by this, not by the corpus size.
    memory_gb: float = Field(default=4.0, gt=0)


class AtlasConfig(Section):
    name: str = "atlas-run"
    # A local folder (relative paths resolve against the config file), or a URL in object storage (s3://bucket/runs/x,
    # gs://...): such a run is worked on in a local copy and every finished shard is uploaded (atlas.io.remote_run).
    # After load_config, run_dir is always the local folder the stages work in, and run_url the URL or None.
    run_dir: str = "runs/atlas"
    local_copy: str | None = None  # with a run_dir URL: the local copy's folder (default: $ATLAS_CACHE/runs/<url>)
    run_url: str | None = None  # set by load_config from a run_dir URL
    llm: LLMConfig = Field(default_factory=LLMConfig)  # the engine of every LLM step (tagging, judging, library)
    input: InputConfig = Field(default_factory=InputConfig)
    chunk: ChunkConfig = Field(default_factory=ChunkConfig)
    tag: TagConfig = Field(default_factory=TagConfig)
    vocab: VocabConfig = Field(default_factory=VocabConfig)
    library: LibraryConfig = Field(default_factory=LibraryConfig)
    annotator: AnnotatorConfig = Field(default_factory=AnnotatorConfig)
    annotate: AnnotateConfig = Field(default_factory=AnnotateConfig)
    tokenize: TokenizeConfig = Field(default_factory=TokenizeConfig)
    index: IndexConfig = Field(default_factory=IndexConfig)
    execution: ExecutionConfig = Field(default_factory=ExecutionConfig)

    @field_validator("name")
    @classmethod
    def _name_is_simple(cls, v: str) -> str:
        if not v or "/" in v:
            raise ValueError("must be a non-empty name without '/'")
        return v


# --- loading -----------------------------------------------------------------------------------


def _valid_keys(model: type[BaseModel], path: tuple) -> list[str]:
    """The field names allowed at ``path`` (keys from the root), for "did you mean" hints."""
    node: Any = model
    for key in path:
        if isinstance(node, type) and issubclass(node, BaseModel):
            field = node.model_fields.get(key)
            node = field.annotation if field else None
        elif typing.get_origin(node) is dict:
            node = typing.get_args(node)[1]  # the key is a dict key (e.g. a domain name)
        else:
            return []
    return list(node.model_fields) if isinstance(node, type) and issubclass(node, BaseModel) else []


def _explain(err: ValidationError, source: str) -> str:
    lines = [f"invalid configuration in {source}:"]
    for e in err.errors():
        loc = tuple(e["loc"])
        where = ".".join(str(p) for p in loc) or "(top level)"
        if e["type"] == "extra_forbidden":
            valid = _valid_keys(AtlasConfig, loc[:-1])
            near = difflib.get_close_matches(str(loc[-1]), valid, n=1, cutoff=0.5)
            hint = f"; did you mean '{near[0]}'?" if near else (f"; valid keys: {', '.join(valid)}" if valid else "")
            lines.append(f"  {where}: unknown key{hint}")
        else:
            lines.append(f"  {where}: {e['msg']} (got {e.get('input')!r})")
    return "\n".join(lines)


class _UniqueKeys(yaml.SafeLoader):
    """YAML's safe loader, but a key given twice in one mapping (two `library:` sections) is an error: YAML itself
    keeps the last one, and the first section's settings would be dropped without a word."""


def _mapping_without_repeats(loader: _UniqueKeys, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: dict = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=True)
        if key == "<<":  # a merge key, which YAML allows more than once
            continue
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"{key!r} is given twice in the same section (first on line {seen[key]}): keep one, "
                f"with all its settings", key_node.start_mark)
        seen[key] = key_node.start_mark.line + 1
    return loader.construct_mapping(node, deep)


_UniqueKeys.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping_without_repeats)


def _local(path: str) -> str:
    """A local path as written in a config or on the command line, ``~`` expanded (a URL stays as it is)."""
    return path if is_url(path) else os.path.expanduser(path)


def apply_override(data: dict, assignment: str) -> None:
    """Apply ``a.b.c=value`` to a nested dict; the value is parsed as YAML (numbers, lists, null...)."""
    if "=" not in assignment:
        raise ConfigError(f"--set {assignment!r}: expected KEY=VALUE, e.g. chunk.max_sentence_tokens=1000")
    key, raw = assignment.split("=", 1)
    parts = key.strip().split(".")
    node = data
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"--set {assignment!r}: '{part}' is not a section")
    try:
        node[parts[-1]] = yaml.safe_load(raw)
    except yaml.YAMLError as e:
        raise ConfigError(f"--set {assignment!r}: the value {raw!r} is not valid YAML "
                          f"({getattr(e, 'problem', None) or e}); quote it to pass a string") from None


def load_config(path: str | Path | None = None, overrides: list[str] = (), *, input: str | Path | None = None,
                run_dir: str | Path | None = None) -> AtlasConfig:
    """Read a YAML config, apply ``--set`` overrides, validate, and resolve relative paths. ``input`` and ``run_dir``
    (``--input``, ``--run-dir``) replace input.path and run_dir, relative to the working directory, not the file."""
    data: dict[str, Any] = {}
    base = Path.cwd()
    source = "defaults"
    if path is not None:
        path = Path(path)
        if not path.exists():
            raise ConfigError(f"config file not found: {path}")
        try:
            data = yaml.load(path.read_text(), Loader=_UniqueKeys) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: not valid YAML: {e}") from e
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: expected a mapping at the top level, got {type(data).__name__}")
        base = path.resolve().parent
        source = str(path)
    declared = _declared_domains(data)  # before the overrides: a --set may change a domain, not add one
    for assignment in overrides:
        apply_override(data, assignment)
    if input is not None:  # JSON strings are YAML: the path is taken as it is, never parsed as a number or a list
        where = str(input) if is_url(input) else str(Path(_local(str(input))).resolve())
        apply_override(data, f"input.path={json.dumps(where)}")
    if run_dir is not None:
        where = str(run_dir) if is_url(run_dir) else str(Path(_local(str(run_dir))).resolve())  # a URL: as it is
        apply_override(data, f"run_dir={json.dumps(where)}")
    if data.get("run_url") is not None:
        raise ConfigError(f"{source}: run_url is set by Atlas; write the URL as run_dir (run_dir: s3://bucket/runs/x)")
    try:
        config = AtlasConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_explain(e, source)) from None
    if config.run_dir.startswith("file://"):
        config.run_dir = config.run_dir.removeprefix("file://")
    config.run_dir = _local(config.run_dir)
    if config.local_copy:
        config.local_copy = _local(config.local_copy)
    if is_url(config.run_dir):  # Path() would make "s3://b/run" a local folder "s3:/b/run"
        config.run_url = config.run_dir.rstrip("/")
        config.run_dir = config.local_copy or str(default_local_copy(config.run_url))
    elif config.local_copy:
        raise ConfigError(f"local_copy {config.local_copy}: only used with a run_dir in object storage (a URL such "
                          f"as s3://bucket/runs/name); run_dir is the local folder {config.run_dir}")
    config.run_dir = str((base / config.run_dir).resolve())
    if config.local_copy:
        config.local_copy = config.run_dir
    for section, key in ((config.tag, "prompt"), (config.tag, "schema_dir"), (config.annotate, "annotator_from")):
        if getattr(section, key):
            setattr(section, key, str((base / _local(getattr(section, key))).resolve()))
    if config.input.path and not is_url(config.input.path):
        config.input.path = str((base / _local(config.input.path)).resolve())
    if config.input.path and not is_url(config.input.path) and Path(config.input.path).is_dir():
        run, folder = Path(config.run_dir), Path(config.input.path)
        if run == folder or folder in run.parents:
            raise ConfigError(f"{source}: run_dir {run} is inside the input folder {folder}: the run's own "
                              f"files would be read as input; put the run directory outside it")
    if problems := _missing_files(config) + _unknown_domains(config, declared):
        raise ConfigError("\n".join([f"invalid configuration in {source}:", *problems]))
    return config


def _missing_files(config: AtlasConfig) -> list[str]:
    """Names in the config that must be files (schemas, lists, the prompt) but are not: found at load time, not
    when the stage that reads them starts."""
    problems = []
    if config.annotate.annotator_from and not Path(config.annotate.annotator_from).is_dir():
        problems.append(f"  annotate.annotator_from: folder not found: {config.annotate.annotator_from}")
    if config.tag.prompt and not Path(config.tag.prompt).is_file():
        problems.append(f"  tag.prompt: file not found: {config.tag.prompt}")
    root = Path(config.tag.schema_dir) if config.tag.schema_dir else PROJECT_ROOT / "schemas"
    if not root.is_dir():
        return problems + [f"  tag.schema_dir: folder not found: {root}"]
    for key, folder, names in (("tag.domain_schemas", root / "tags", config.tag.domain_schemas),
                               ("library.aux_domains", root / "aux", config.library.aux_domains)):
        available = sorted(p.stem for p in folder.glob("*.json"))
        for where, name in (names.items() if isinstance(names, dict) else enumerate(names)):
            if name not in available:
                problems.append(f"  {key}.{where}: no schema {name!r} in {folder} (there are: {', '.join(available)})")
    return problems


def _declared_domains(data: dict) -> set[str]:
    """The corpus domains a config file names (under chunk.domains or tag.domain_schemas)."""
    names = set()
    for section, key in (("chunk", "domains"), ("tag", "domain_schemas")):
        value = data.get(section, {}).get(key) if isinstance(data.get(section), dict) else None
        names |= set(value) if isinstance(value, dict) else set()
    return names


def _unknown_domains(config: AtlasConfig, declared: set[str]) -> list[str]:
    """Domains that only a --set brings in, and that nothing else knows: a typo (chunk.domains.wbe) would otherwise
    add a domain silently. Known: the tag schemas' domains, the default chunk domains, input.default_domain, and
    those the config file declares."""
    root = Path(config.tag.schema_dir) if config.tag.schema_dir else PROJECT_ROOT / "schemas"
    known = sorted(declared | {p.stem for p in (root / "tags").glob("*.json")} | set(_default_chunk_domains())
                   | {config.input.default_domain})
    problems = []
    for key, names in (("chunk.domains", config.chunk.domains), ("tag.domain_schemas", config.tag.domain_schemas)):
        for name in sorted(set(names) - set(known)):
            near = difflib.get_close_matches(name, known, n=1, cutoff=0.5)
            hint = f"did you mean '{near[0]}'? " if near else ""
            problems.append(f"  {key}.{name}: unknown domain; {hint}(known: {', '.join(known)}; a new domain is "
                            "declared under chunk.domains in the config file)")
    return problems


def config_from_dict(data: dict) -> AtlasConfig:
    """Rebuild a resolved config (as stored in manifest.json)."""
    try:
        return AtlasConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_explain(e, "manifest.json")) from None
