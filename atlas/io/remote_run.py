"""A run directory in object storage (``run_dir: s3://bucket/runs/x``), worked on in a local copy.

The stages write memmaps, SQLite caches, FAISS indexes and Zarr arrays, which need a local file system. So a run
whose ``run_dir`` is a URL works in a local folder (``local_copy``; default ``$ATLAS_CACHE/runs/<url>``), and the
bucket is kept up to date at these points:

- **taking the run** (``atlas run``, ``atlas plan``): the run lock is taken in the bucket too (``URL/_lock``,
  written only if absent). Then ``pull`` makes the local copy equal to the bucket, so that a run killed on one
  machine resumes on another.
- **after each shard**: the files the shard changed in its stage's folders, then its marker (``push_shard``).
- **after planning, and at the end of each stage**: the stage's folders in the bucket are made equal to the local
  ones, with ``_SUCCESS`` uploaded last (``push_tree``). The manifest is pushed each time it is written.

So the bucket keeps the run directory's contract:
- a shard's marker is there only after the files it vouches for;
- ``_SUCCESS`` is there only after the whole stage.

Each file goes up in one upload (a single PUT, or a multipart upload that the store completes at once), so a
reader never sees half a file.

A local file is in step with its object when both have the same size and the same modification time. Times are
compared in whole seconds, and a file's local time is set from its object's after each upload and download.

Not copied, either way:
- machine-local folders (``_cache``, ``_tmp``);
- the local lock.

``pull`` deletes local files that the bucket lacks, except in ``cblm/`` and ``report/``, the models and reports
made in the copy.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Iterable, Iterator
from datetime import datetime
from pathlib import Path

from atlas.config import default_local_copy
from atlas.core.files import ArtifactError, temporary_path
from atlas.core.lock import LOCK_NAME, RunLocked, is_stale, locked_message, run_lock
from atlas.io import layout
from atlas.io.inputs import filesystem

log = logging.getLogger("atlas.io.remote_run")

MACHINE_LOCAL = (layout.CACHE, layout.TMP, LOCK_NAME)  # top-level names never copied either way
KEPT_ON_PULL = (layout.CBLM, layout.REPORT)  # local files there stay even when the bucket lacks them
MARKERS = "_shards"  # a stage's folder of shard markers (atlas.core.rundir)
SUCCESS = "_SUCCESS"


def _mtime(info: dict) -> int:
    """An object's modification time in whole seconds, from whichever field its store gives."""
    for key in ("LastModified", "mtime", "created", "updated", "last_modified"):
        value = info.get(key)
        if isinstance(value, str):
            value = datetime.fromisoformat(value.replace("Z", "+00:00"))
        if isinstance(value, datetime):
            return int(value.timestamp())
        if value:
            return int(value)
    return 0


def _in_step(path: Path, info: dict) -> bool:
    stat = path.stat()
    return stat.st_size == info["size"] and int(stat.st_mtime) == _mtime(info)


def _is_temporary(path: Path) -> bool:
    """A file being written (``core.files.temporary_path``), renamed to its name when whole."""
    return path.name.startswith(".") and path.name.endswith(".tmp")


def _is_metadata(rel: str) -> bool:
    return rel == "manifest.json" or any(part.startswith("_") for part in rel.split("/"))


def _upload_order(path: Path) -> tuple:
    """Data first, markers after the files they vouch for, ``_SUCCESS`` last."""
    return path.name == SUCCESS, MARKERS in path.parts, str(path)


class RunMirror:
    """The run at ``url``, worked on in the local folder ``root``."""

    def __init__(self, url: str, root: str | Path):
        self.url = url.rstrip("/")
        self.root = Path(root)
        self.fs, base = filesystem(self.url, "run_dir")
        self.base = base.rstrip("/")

    def __repr__(self) -> str:
        return f"RunMirror({self.url!r}, {str(self.root)!r})"

    # --- what is where ------------------------------------------------------------------------------------
    def _key(self, path: Path) -> str:
        return f"{self.base}/{path.relative_to(self.root).as_posix()}"

    def _objects(self, under: Path | None = None) -> dict[str, dict]:
        """The run's objects (or those under the local folder ``under``), by path relative to the run."""
        where = self.base if under is None else self._key(under)
        self.fs.invalidate_cache()  # another machine may have written since this process last listed
        try:
            found = self.fs.find(where, detail=True)
        except FileNotFoundError:
            return {}
        start = len(self.base) + 1
        return {key[start:]: info for key, info in found.items()
                if key.startswith(where + "/")  # a store may list by bare prefix: runs/demo finds runs/demo2/ too
                and info.get("type", "file") == "file" and key[start:].split("/")[0] not in MACHINE_LOCAL}

    def _local_files(self, under: Path | None = None) -> Iterator[Path]:
        folder = under or self.root
        if not folder.is_dir():
            return
        for path in sorted(folder.rglob("*")):
            rel = path.relative_to(self.root)
            if path.is_file() and rel.parts[0] not in MACHINE_LOCAL and not _is_temporary(path):
                yield path

    def _settle(self, path: Path, info: dict) -> None:
        """Give the local file its object's time: the two are in step until one of them changes."""
        mtime = _mtime(info)
        os.utime(path, (mtime, mtime))

    # --- bucket -> local copy -----------------------------------------------------------------------------
    def pull(self, metadata_only: bool = False) -> str:
        """Make the local copy equal to the bucket: download what differs, delete what the bucket lacks; returns a
        line that says what it did. ``metadata_only``: only the manifest and the "_" files (markers, plans,
        counters), as `atlas status` needs."""
        start = time.perf_counter()
        objects = self._objects()
        local = {path.relative_to(self.root).as_posix(): path for path in self._local_files()}
        if metadata_only:
            objects, local = ({rel: v for rel, v in files.items() if _is_metadata(rel)} for files in (objects, local))
        if "manifest.json" not in objects and "manifest.json" in local:
            raise ArtifactError(f"{self.url} holds no run, but its local copy {self.root} holds one (the run was "
                                f"deleted from the bucket, or local_copy names another run's folder); remove "
                                f"{self.root} to start afresh, or upload it first (e.g. aws s3 sync {self.root} "
                                f"{self.url})")
        stale = [path for rel, path in local.items() if rel not in objects and rel.split("/")[0] not in KEPT_ON_PULL]
        for path in stale:
            path.unlink()
        fetch = [rel for rel, info in objects.items() if rel not in local or not _in_step(local[rel], objects[rel])]
        targets = [self.root / rel for rel in fetch]
        for target in targets:
            target.parent.mkdir(parents=True, exist_ok=True)
        temporary = [temporary_path(target) for target in targets]
        try:
            if fetch:  # one batch: fsspec's async stores (s3, gcs) download the files concurrently
                self.fs.get([f"{self.base}/{rel}" for rel in fetch], [str(t) for t in temporary])
            for rel, tmp, target in zip(fetch, temporary, targets):
                os.replace(tmp, target)
                self._settle(target, objects[rel])
        finally:
            for tmp in temporary:
                tmp.unlink(missing_ok=True)
        size = sum(objects[rel]["size"] for rel in fetch)
        return (f"{len(fetch)} file(s) ({size / 2**20:.1f} MiB) pulled from {self.url} into {self.root}, "
                f"{len(stale)} stale one(s) removed, in {time.perf_counter() - start:.1f} s")

    # --- local copy -> bucket -----------------------------------------------------------------------------
    def push(self, paths: Iterable[Path]) -> None:
        """Upload ``paths`` in the order given, each whole."""
        for path in paths:
            key = self._key(path)
            self.fs.put_file(str(path), key)
            self._settle(path, self.fs.info(key))

    def push_shard(self, folders: Iterable[Path], since: float, marker: Path) -> None:
        """After a shard: the files in its stage's ``folders`` changed since ``since`` (it started), then its
        ``marker``. Other shards' markers stay for their own shards to push: a marker may only follow its files."""
        changed = [path for folder in folders for path in self._local_files(folder)
                   if path.stat().st_mtime >= since - 1 and MARKERS not in path.parts and path.name != SUCCESS]
        self.push([*sorted(changed, key=_upload_order), marker])

    def push_tree(self, folders: Iterable[Path]) -> None:
        """Make the bucket's copy of ``folders`` equal to the local one: upload what differs (data, then markers,
        then ``_SUCCESS``) and delete what the local copy no longer has (staging files a stage merged)."""
        for folder in folders:
            objects = self._objects(folder)
            local = {path.relative_to(self.root).as_posix(): path for path in self._local_files(folder)}
            changed = [path for rel, path in local.items() if rel not in objects or not _in_step(path, objects[rel])]
            data = [p for p in changed if _upload_order(p)[:2] == (False, False)]
            if data:  # one batch, uploaded concurrently by async stores; then each file's time from one listing
                self.fs.put([str(p) for p in data], [self._key(p) for p in data])
                after = self._objects(folder)
                for path in data:
                    self._settle(path, after[path.relative_to(self.root).as_posix()])
            if gone := [f"{self.base}/{rel}" for rel in objects if rel not in local]:
                self.fs.rm(gone)
            self.push(sorted([p for p in changed if p not in data], key=_upload_order))

    def remove(self, folder: Path) -> None:
        """Delete the objects under a local folder's place in the bucket (a stage recomputed with --force)."""
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(self._key(folder), recursive=True)

    # --- the run lock in the bucket -------------------------------------------------------------------------
    def _lock_holder(self) -> dict | None:
        try:
            holder = json.loads(self.fs.cat_file(f"{self.base}/{LOCK_NAME}"))
        except FileNotFoundError:
            return None
        except ValueError:
            return {}
        return holder if isinstance(holder, dict) else {}

    @contextlib.contextmanager
    def hold(self, holder: dict) -> Iterator[None]:
        """For the ``with`` block: the run's lock in the bucket (``holder``: the local lock's content), and the
        local copy brought up to date first. The lock is written only where none is (a conditional PUT)."""
        key = f"{self.base}/{LOCK_NAME}"
        for _ in range(3):
            try:
                self.fs.pipe_file(key, json.dumps(holder).encode(), mode="create")
                break
            except FileExistsError:
                other = self._lock_holder()
                if other is not None and not is_stale(other):
                    raise RunLocked(locked_message(self.url, other)) from None
                if other is not None:
                    log.warning("note: %s/%s was left by pid %s on this host, which is no longer running; taking it "
                                "over", self.url, LOCK_NAME, other["pid"])
                    self.fs.rm(key)
        else:
            raise RunLocked(locked_message(self.url, self._lock_holder() or {}))
        try:
            log.info("%s: working in the local copy %s; %s", self.url, self.root, self.pull())
            yield
        finally:
            if self._lock_holder() == holder:
                self.fs.rm(key)


def local_run(url: str, metadata_only: bool = False) -> Path:
    """For a command that reads a run kept in object storage (status, report, export...): its default local copy,
    brought up to date. A copy that a run on this machine is driving is read as it is: it is the newest there is,
    and pulling would delete its unpushed files."""
    mirror = RunMirror(url, default_local_copy(url))
    try:
        with run_lock(mirror.root, f"atlas: reading {url}"):
            log.debug("%s", mirror.pull(metadata_only))  # debug: `atlas status --json` prints JSON alone
    except RunLocked:
        log.debug("%s is driven from this machine now: reading its local copy %s as it is", url, mirror.root)
    if not (mirror.root / "manifest.json").exists():
        raise ArtifactError(f"{url}: not an Atlas run directory (no manifest.json)")
    return mirror.root


def mirror_of(config) -> RunMirror | None:
    """The mirror of a config whose ``run_dir`` was a URL (``config.run_url``); None for a local run."""
    return RunMirror(config.run_url, config.run_dir) if config.run_url else None
