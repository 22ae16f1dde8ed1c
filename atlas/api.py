"""Atlas from Python: run the pipeline, read what it wrote, annotate and search with it.

    import atlas.api as atlas

    config = atlas.load_config("configs/demo.yaml", run_dir="runs/demo")   # --run-dir; --set: tag__batch_size=64
    run = atlas.run(config)                   # the stages not yet done, in this process (`atlas run --inline`)
    run = atlas.Run("runs/demo")              # or open a run that exists
    run.status()                              # per stage: state, shards, counters (`atlas status --json`)
    chunks = run.table("annotate")            # a pyarrow Table of the stage's parts (chunks, text, concept ids)
    for batch in run.batches("annotate", columns=["chunk_id", "concepts"]):  # bounded memory, batch by batch
        ...
    run.library()                             # the concepts, a pyarrow Table
    run.annotate(["Binary search halves the interval at every step."])  # `atlas annotate-text`
    run.search("how do I open a file for writing?", k=5)                # `atlas search`
    for window in run.token_windows(256):     # atlas.io.tokens.TokenWindow: tokens, chunk_of_token, concepts
        ...

The same three names are importable from ``atlas`` itself (``atlas.run``, ``atlas.Run``, ``atlas.load_config``).
Progress goes to the ``atlas`` logger (a line per stage, the report's path), where `atlas run` prints it;
``logging.basicConfig(format="%(message)s"); logging.getLogger("atlas").setLevel("INFO")`` shows it in a notebook.

This module sits beside the CLI: it calls what the commands call (atlas.runner, atlas.tools, atlas.io), and
nothing in the library imports it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from atlas.io import layout

if TYPE_CHECKING:
    import pyarrow as pa
    import pyarrow.dataset as ds

    from atlas.config import AtlasConfig
    from atlas.io.tokens import TokenWindow


class StageNotDone(RuntimeError):
    """The outputs of a stage that has not finished (or never ran) in this run were asked for."""


class Annotation(NamedTuple):
    """One concept the annotator gives a text."""

    concept: str  # its name in the library
    score: float  # calibrated probability
    concept_id: int
    domain: str  # "content", or an auxiliary domain (tone, demographic, ...)


def load_config(path: str | Path | None = None, *, input: str | Path | None = None,
                run_dir: str | Path | None = None, **overrides: Any) -> AtlasConfig:
    """The config of ``atlas run PATH``: ``input`` and ``run_dir`` as ``--input`` and ``--run-dir`` (relative to the
    working directory), ``overrides`` as ``--set``, by dotted key with ``__`` for the dot:
    ``load_config(path, tag__batch_size=64)`` or ``load_config(path, **{"chunk.domains.web.max_tokens": 200})``.
    Values are Python values (a string stays a string, a list a list)."""
    from atlas.config import load_config as load

    settings = [f"{key.replace('__', '.')}={json.dumps(value, default=str)}" for key, value in overrides.items()]
    return load(path, settings, input=input, run_dir=run_dir)


def run(config: AtlasConfig, stages: Sequence[str] | None = None, force: bool = False) -> Run:
    """Run ``stages`` (default: all) in pipeline order in this process, as ``atlas run --inline`` does: it skips
    what is done, resumes unfinished stages, refuses a run directory of another config (``RunConflict``) unless
    ``force``, and rewrites RUN/report/. Errors are those the CLI reports: ConfigError, RunConflict, RunLocked,
    StageFailed, MissingExtra, InputError."""
    from atlas.core.lock import run_lock
    from atlas.io.remote_run import mirror_of
    from atlas.runner import check_run, run_stages
    from atlas.tools.report import refresh_report

    config = config.model_copy(deep=True)  # the caller's config stays as it was
    config.execution.orchestrator = "inline"
    run_dir, mirror = Path(config.run_dir), mirror_of(config)
    with run_lock(run_dir, f"atlas.api.run(stages={list(stages) if stages else None}, force={force})", mirror):
        checked = check_run(config, stages, force)  # a refused run writes nothing, its report included
        try:
            reports = run_stages(config, stages, force, checked=checked)
        except Exception:  # not Ctrl-C: as after `atlas run`, the report shows the failed shards
            if (run_dir / "manifest.json").exists():
                refresh_report(run_dir, mirror)
            raise
        if not all(r.skipped for r in reports) or not (run_dir / layout.REPORT / "index.html").exists():
            refresh_report(run_dir, mirror)
    return Run(run_dir)


class Run:
    """A run directory, read back: its status, its stages' tables, its library, annotator, index and token shards.
    Only finished stages are read; anything else raises ``StageNotDone``."""

    def __init__(self, path: str | Path):
        from atlas.config import is_url
        from atlas.core.rundir import RunDir

        if is_url(path):  # a run kept in object storage: read from its local copy, pulled first
            from atlas.io.remote_run import local_run

            path = local_run(str(path))
        self.dir = RunDir(path)
        if not self.dir.manifest_path.exists():
            raise FileNotFoundError(f"{path}: not an Atlas run directory (no manifest.json)")
        self._annotator = None  # loaded on the first annotate() (the encoder takes seconds to load)

    @property
    def path(self) -> Path:
        return self.dir.root

    def __repr__(self) -> str:
        return f"Run({str(self.path)!r})"

    def status(self) -> list[dict]:
        """Per stage: state, shards done/total, counters, drops, failures, seconds (``atlas status RUN --json``)."""
        from atlas.tools.status import status_rows

        return status_rows(self.dir)

    def _finished(self, stage: str) -> str:
        """The stage ``stage`` names (a stage or its output folder: "annotate" or "annotated"), checked done."""
        from atlas.stages import STAGES
        from atlas.tools.status import run_status

        name = next((n for n, s in STAGES.items() if stage in (n, s.output)), None)
        if name is None:
            raise ValueError(f"unknown stage {stage!r}; stages are: {', '.join(STAGES)}")
        status = next(s for s in run_status(self.dir) if s.name == name)
        if status.state != "done":
            raise StageNotDone(f"{self.path}: stage '{name}' is {status.state} ({status.shards_done}/"
                               f"{status.shards_total} shards); finish it first: atlas run CONFIG --stages {name}")
        return name

    def dataset(self, stage: str) -> ds.Dataset:
        """The finished stage's Parquet parts (exactly parts 0..n-1 of its plan) as one pyarrow dataset."""
        import pyarrow.dataset as ds

        from atlas.stages import STAGES

        output = STAGES[self._finished(stage)].output
        if not any(self.dir.output_dir(output).glob("part-*.parquet")):  # library, train_annotator: files of their own
            raise ValueError(f"stage {stage!r} writes no Parquet parts (see {self.dir.output_dir(output)}); "
                             f"the concepts are Run.library()")
        return ds.dataset([str(p) for p in self.dir.parts(output)], format="parquet")

    def table(self, stage: str, columns: list[str] | None = None) -> pa.Table:
        """All rows of a finished stage (``columns``: only those), in shard order. Large stages: ``batches``."""
        return self.dataset(stage).to_table(columns=columns)

    def batches(self, stage: str, columns: list[str] | None = None,
                batch_size: int = 65_536) -> Iterator[pa.RecordBatch]:
        """The rows of a finished stage, a record batch at a time: memory stays bounded however large the stage."""
        yield from self.dataset(stage).to_batches(columns=columns, batch_size=batch_size)

    def library(self) -> pa.Table:
        """The concept library (library/concepts.parquet): concept_id, domain, name, description, evidence_tags..."""
        import pyarrow.parquet as pq

        from atlas.io.library import load_library

        load_library(self.dir)  # checked against its config.json, as every reader of the library does
        return pq.read_table(self.dir.output_dir(layout.LIBRARY) / "concepts.parquet")

    def annotate(self, texts: Sequence[str]) -> list[list[Annotation]]:
        """Per text, the concepts the run's trained annotator decides (each domain's threshold and cap), with their
        calibrated probabilities: what ``atlas annotate-text RUN`` prints."""
        from atlas.io.library import load_library
        from atlas.models.annotator import Annotator

        concepts, _ = load_library(self.dir)
        if self._annotator is None:
            annotator = Annotator(self.dir.output_dir(layout.ANNOTATOR)).setup()
            annotator.check_library(concepts)
            self._annotator = annotator
        return [[Annotation(concepts[g]["name"], float(p), g, domain) for domain, labels in decided.items()
                 for g, p in labels]
                for decided in self._annotator.annotate(list(texts))]

    def search(self, text: str, k: int = 10, nprobe: int | None = None) -> list[dict]:
        """The ``k`` training chunks nearest to ``text`` through the run's IVFPQ index (``atlas search``): dicts of
        rank, score, row, chunk_id, doc_id, data_src, text."""
        from atlas.tools.search import search_run

        self._finished("index")
        return search_run(self.path, [text], k, nprobe)[0]

    def token_windows(self, length: int, stride: int | None = None) -> Iterator[TokenWindow]:
        """Windows of ``length`` tokens every ``stride`` (default ``length``) over the token shards, shard by shard,
        with each token's chunk and the chunks' concepts (``atlas.io.tokens.TokenShards.windows``)."""
        from atlas.io.tokens import TokenShards

        self._finished("tokenize")
        return TokenShards(self.path).windows(length, stride)
