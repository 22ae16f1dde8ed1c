"""The contract every stage follows.

A stage is one module with one class. The constructor is cheap (it only keeps the config), so
stages can be pickled to Prefect workers; expensive state (tokenizers, models, engines) loads in
``setup``. Map stages process shard ``i`` of their input into shard ``i`` of their output; global
stages see everything at once and run as a single shard. Heavy libraries (torch, faiss, scikit-learn)
are imported inside ``setup`` or ``run_shard``, so importing a stage costs nothing and a core install
can run the stages that need no extra.
"""

from __future__ import annotations

from typing import ClassVar

from atlas.config import AtlasConfig
from atlas.core.files import stable_hash
from atlas.core.rundir import RunDir
from atlas.core.stats import Stats


class Stage:
    name: ClassVar[str]  # CLI name, e.g. "chunk"
    output: ClassVar[str]  # folder under RUN/ (a constant of atlas.io.layout), e.g. "chunks"
    needs: ClassVar[tuple[str, ...]] = ()  # extras it imports when it runs (atlas.core.extras)
    upstream: ClassVar[tuple[str, ...]] = ()  # names of the stages whose outputs this one reads
    extra_outputs: ClassVar[tuple[str, ...]] = ()  # other paths under RUN/ it writes (cleared with its output)

    def __init__(self, config: AtlasConfig):
        self.config = config

    def extras(self) -> tuple[str, ...]:
        """The extras this stage needs with this config (checked by the runner before it runs)."""
        return self.needs

    def identity(self) -> dict:
        """Everything that determines this stage's output (config, prompt and schema files...).

        The stage hash is a hash of this plus the upstream stages' hashes: change it and the
        stage and everything after it reruns.
        """
        raise NotImplementedError

    def stage_hash(self, upstream_hashes: dict[str, str]) -> str:
        return stable_hash({"stage": self.name, "identity": self.identity(), "upstream": upstream_hashes})

    def plan(self, run: RunDir, stage_hash: str) -> int:
        """Decide the shards (written under the run directory) and return how many there are."""
        return 1

    def setup(self) -> None:
        """Load expensive state. Called once per worker process before its first shard."""

    def teardown(self) -> None:
        """Free what ``setup`` loaded (a vLLM model holds its GPU memory until closed). Called after the stage."""

    def run_shard(self, run: RunDir, shard: int) -> Stats:
        """Process one shard: write its part (atomically) and return its counters."""
        raise NotImplementedError

    def finalize(self, run: RunDir, stats: Stats) -> None:
        """After all shards: global checks and summaries (optional)."""
