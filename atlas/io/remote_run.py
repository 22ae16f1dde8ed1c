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
reader never sees half a file, and once per change: shards running side by side in threads wait for a file that
another one is uploading rather than upload it again.

A local file is in step with its object when both have the same size and the same modification time. Times are
compared in whole seconds, and a file's local time is set from its object's after each upload and download. This
process also remembers each file it uploaded or downloaded as it then stood (size, time, inode), so a shard passes
over the files of the shards before it without asking the bucket.

Whose files these are:
- a URL that holds objects of something other than an Atlas run (no ownership object ``URL/.atlas-owner.json`` of
  kind run, no Atlas manifest) is refused before anything is written or deleted there (``NotOwned``). A run Atlas
  starts there gets that object; an earlier run with its manifest gets it on its next run;
- the local copy is claimed by the run lock (``atlas.core.ownership``): a folder of the user's is refused;
- nothing is written outside the local copy, whatever an object's name: a name with ``..``, ``.``, an empty part
  (a leading or doubled ``/``) or a backslash, or one that a symbolic link in the copy leads outside it, stops
  ``pull`` with an error that names it, before anything is written or deleted.

A store that cannot be reached, or that refuses the credentials, is a ``StoreError``: one line naming the URL.

Not copied, either way:
- machine-local folders (``_cache``, ``_tmp``);
- the local lock, and each side's ownership record;
- symbolic links in the local copy (neither uploaded, nor deleted, nor followed).

``pull`` deletes local files that the bucket lacks, except in ``cblm/`` and ``report/``, the models and reports
made in the copy.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Iterable, Iterator
from datetime import datetime
from pathlib import Path

from atlas.config import default_local_copy
from atlas.core.files import ArtifactError, InputError, temporary_path
from atlas.core.lock import LOCK_NAME, RunLocked, is_stale, locked_message, run_lock
from atlas.core.ownership import OWNER_FILE, NotOwned, is_atlas_manifest
from atlas.io import layout
from atlas.io.inputs import filesystem

log = logging.getLogger("atlas.io.remote_run")

MACHINE_LOCAL = (layout.CACHE, layout.TMP, LOCK_NAME, OWNER_FILE)  # top-level names never copied either way
KEPT_ON_PULL = (layout.CBLM, layout.REPORT)  # local files there stay even when the bucket lacks them
MARKERS = "_shards"  # a stage's folder of shard markers (atlas.core.rundir)
SUCCESS = "_SUCCESS"

# Local files this process knows to be in step with their objects: (size, mtime_ns, inode) as each stood when it
# was uploaded or downloaded. Shared by every RunMirror of the process (the runner makes one per shard).
_SYNCED: dict[str, tuple[int, int, int]] = {}
# One of these is held while a file is uploaded by push_shard: a thread that needs the same file waits, then finds
# it in step. Striped, so that the table does not grow with the run.
_UPLOADING = tuple(threading.Lock() for _ in range(64))
# Local causes of an OSError while downloading: the caller's to report, not the store's.
_LOCAL_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS}


class StoreError(InputError):
    """The object store of a run cannot be used: it cannot be reached, or it refused the credentials."""


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


def _signature(path: Path) -> tuple[int, int, int]:
    stat = path.stat()
    return stat.st_size, stat.st_mtime_ns, stat.st_ino


def _known(path: Path) -> bool:
    """Whether this process uploaded or downloaded ``path`` as it is now."""
    try:
        return _SYNCED.get(os.path.abspath(path)) == _signature(path)
    except FileNotFoundError:
        return False


def _is_temporary(path: Path) -> bool:
    """A file being written (``core.files.temporary_path``), renamed to its name when whole."""
    return path.name.startswith(".") and path.name.endswith(".tmp")


def _is_metadata(rel: str) -> bool:
    return rel == "manifest.json" or any(part.startswith("_") for part in rel.split("/"))


def _is_plain(rel: str) -> bool:
    """Whether an object's name within the run is a plain relative path: no '..', '.', empty part or backslash."""
    return "\\" not in rel and "\0" not in rel and all(part not in ("", ".", "..") for part in rel.split("/"))


def _upload_order(path: Path) -> tuple:
    """Data first, markers after the files they vouch for, ``_SUCCESS`` last."""
    return path.name == SUCCESS, MARKERS in path.parts, str(path)


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split()) or type(error).__name__


class RunMirror:
    """The run at ``url``, worked on in the local folder ``root``."""

    def __init__(self, url: str, root: str | Path):
        self.url = url.rstrip("/")
        self.root = Path(root)
        self.fs, base = filesystem(self.url, "run_dir")
        self.base = base.rstrip("/")

    def __repr__(self) -> str:
        return f"RunMirror({self.url!r}, {str(self.root)!r})"

    # --- the store's failures -----------------------------------------------------------------------------
    @contextlib.contextmanager
    def _store(self) -> Iterator[None]:
        """Around calls to the store: its failures become a ``StoreError`` that says which, in one line."""
        try:
            yield
        except (InputError, FileNotFoundError, FileExistsError):
            raise
        except Exception as e:
            failure = self._failure(e)
            if failure is None:
                raise
            raise failure from e

    def _failure(self, error: Exception) -> StoreError | None:
        if getattr(error, "filename", None) is not None or getattr(error, "errno", None) in _LOCAL_ERRNOS:
            return None  # a local file's (a full disk while downloading): the caller's OSError says so
        names = " ".join(cls.__name__ for cls in type(error).__mro__)  # botocore's and aiohttp's are no OSError
        endpoint = self.fs.storage_options.get("endpoint_url")
        store = f"the object store at {endpoint}" if endpoint else "the object store"
        if isinstance(error, PermissionError) or "Credential" in names:
            return StoreError(f"{self.url}: {store} refused the credentials or the access ({_one_line(error)}); "
                              f"check them (for S3: AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, AWS_PROFILE or "
                              f"~/.aws/credentials)")
        if isinstance(error, (ConnectionError, TimeoutError)) or "Connect" in names or "Timeout" in names:
            return StoreError(f"{self.url}: cannot reach {store} ({_one_line(error)}); check that it is up, and the "
                              f"network and endpoint (for S3: AWS_ENDPOINT_URL)")
        if isinstance(error, OSError) or type(error).__module__.split(".")[0] in ("botocore", "aiobotocore"):
            return StoreError(f"{self.url}: {store} failed ({type(error).__name__}: {_one_line(error)})")
        return None

    # --- what is where ------------------------------------------------------------------------------------
    def _key(self, path: Path) -> str:
        return f"{self.base}/{path.relative_to(self.root).as_posix()}"

    def _find(self, where: str) -> dict[str, dict]:
        """The files under ``where``, by path relative to the run, whatever their names."""
        self.fs.invalidate_cache()  # another machine may have written since this process last listed
        try:
            found = self.fs.find(where, detail=True)
        except FileNotFoundError:
            return {}
        start = len(self.base) + 1
        return {key[start:]: info for key, info in found.items()
                if key.startswith(where + "/")  # a store may list by bare prefix: runs/demo finds runs/demo2/ too
                and info.get("type", "file") == "file"}

    def _objects(self, under: Path | None = None) -> dict[str, dict]:
        """The run's objects (or those under the local folder ``under``), by path relative to the run; an object
        whose name is no plain relative path stops everything (``_is_plain``)."""
        found = self._find(self.base if under is None else self._key(under))
        for rel in found:
            if not _is_plain(rel):
                raise ArtifactError(f"{self.url}: refusing the object {rel!r} in it: its name is not a plain path "
                                    f"inside the run (an absolute path, '..', '.', an empty part or a backslash), "
                                    f"so it would be written outside the local copy {self.root} or under another "
                                    f"name; nothing was written. Remove or rename it in the bucket")
        return {rel: info for rel, info in found.items() if rel.split("/")[0] not in MACHINE_LOCAL}

    def _local_files(self, under: Path | None = None) -> Iterator[Path]:
        """The copy's files (or those under ``under``), symbolic links left out and never followed."""
        folder = under or self.root
        if not folder.is_dir() or (under is not None and not self._inside(folder)):
            return
        found = []
        for where, _, names in os.walk(folder):  # os.walk does not follow links to folders
            for name in names:
                path = Path(where, name)
                if (path.relative_to(self.root).parts[0] not in MACHINE_LOCAL and not _is_temporary(path)
                        and not path.is_symlink() and path.is_file()):
                    found.append(path)
        yield from sorted(found)

    def _inside(self, path: Path) -> bool:
        """Whether ``path`` leads to a place inside the local copy, symbolic links followed."""
        return path.resolve().is_relative_to(self.root.resolve())

    def _settle(self, path: Path, info: dict) -> None:
        """Give the local file its object's time: the two are in step until one of them changes."""
        mtime = _mtime(info)
        os.utime(path, (mtime, mtime))
        _SYNCED[os.path.abspath(path)] = _signature(path)

    # --- whose the URL is ---------------------------------------------------------------------------------
    def check_owned(self) -> bool:
        """Refuse (``NotOwned``) a URL that holds objects of something other than an Atlas run, before anything is
        written or deleted there; returns whether it holds the run's ownership object."""
        with self._store():
            names = sorted(rel for rel in self._find(self.base) if rel != LOCK_NAME)
            if not names:
                return False
            if OWNER_FILE in names:
                try:
                    record = json.loads(self.fs.cat_file(f"{self.base}/{OWNER_FILE}"))
                except (FileNotFoundError, ValueError):
                    record = None
                kind = record.get("kind") if isinstance(record, dict) else None
                if kind == "run":
                    return True
                what = f"it is an Atlas {kind}" if kind else f"its {OWNER_FILE} is not an Atlas record"
            elif "manifest.json" in names and is_atlas_manifest(self.fs.cat_file(f"{self.base}/manifest.json")):
                return False  # an older Atlas run: it gets its ownership object when next run
            else:
                shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
                what = f"it holds {shown}"
        raise NotOwned(f"{self.url}: not a run Atlas created ({what}); Atlas writes and deletes only under a new or "
                       f"empty prefix, or one it made as a run. Choose another run_dir, or empty this one yourself")

    # --- bucket -> local copy -----------------------------------------------------------------------------
    def pull(self, metadata_only: bool = False) -> str:
        """Make the local copy equal to the bucket: download what differs, delete what the bucket lacks; returns a
        line that says what it did. ``metadata_only``: only the manifest and the "_" files (markers, plans,
        counters), as `atlas status` needs."""
        start = time.perf_counter()
        with self._store():
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
        fetch = [rel for rel, info in objects.items() if rel not in local or not _in_step(local[rel], objects[rel])]
        targets = [self.root / rel for rel in fetch]
        for rel, target in zip(fetch, targets):  # all checked before anything is written or deleted
            if not self._inside(target):
                raise ArtifactError(f"{self.url}: refusing to download {rel!r}: {target} leads outside the local "
                                    f"copy {self.root} (a symbolic link on the way); nothing was written. Remove "
                                    f"the link")
        for path in stale:
            path.unlink()
        for target in targets:
            target.parent.mkdir(parents=True, exist_ok=True)
        temporary = [temporary_path(target) for target in targets]
        try:
            with self._store():
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
    def _upload(self, path: Path) -> None:
        key = self._key(path)
        self.fs.put_file(str(path), key)
        self._settle(path, self.fs.info(key))

    def push(self, paths: Iterable[Path]) -> None:
        """Upload ``paths`` in the order given, each whole."""
        with self._store():
            for path in paths:
                self._upload(path)

    def push_shard(self, folders: Iterable[Path], since: float, marker: Path) -> None:
        """After a shard: the files in its stage's ``folders`` changed since ``since`` (it started), then its
        ``marker``. Other shards' markers stay for their own shards to push: a marker may only follow its files.

        A file this process already put up (or pulled) as it is now is passed over: the files of the shards before
        this one have times of their objects, often within the second this shard started."""
        folders = list(folders)
        recent = [path for folder in folders for path in self._local_files(folder)
                  if path.stat().st_mtime >= since - 1 and MARKERS not in path.parts and path.name != SUCCESS]
        with self._store():
            # A whole-second time that this process did not set may have been set by another one (a pool of worker
            # processes) from the object: the bucket says whether the file is in step. A file just written has a
            # time with a fraction (on file systems that keep one), which needs no asking.
            unsure = {path for path in recent if path.stat().st_mtime_ns % 1_000_000_000 == 0 and not _known(path)}
            listed = {rel: info for folder in folders if any(folder in path.parents for path in unsure)
                      for rel, info in self._objects(folder).items()}
            for path in sorted(recent, key=_upload_order):
                rel = path.relative_to(self.root).as_posix()
                if path in unsure and rel in listed and _in_step(path, listed[rel]):
                    continue
                with _UPLOADING[hash(os.path.abspath(path)) % len(_UPLOADING)]:
                    if not _known(path):  # else a shard in another thread put it up while this one waited
                        self._upload(path)
            self._upload(marker)

    def push_tree(self, folders: Iterable[Path]) -> None:
        """Make the bucket's copy of ``folders`` equal to the local one: upload what differs (data, then markers,
        then ``_SUCCESS``) and delete what the local copy no longer has (staging files a stage merged)."""
        with self._store():
            for folder in folders:
                objects = self._objects(folder)
                local = {path.relative_to(self.root).as_posix(): path for path in self._local_files(folder)}
                changed = [path for rel, path in local.items()
                           if rel not in objects or not _in_step(path, objects[rel])]
                data = [p for p in changed if _upload_order(p)[:2] == (False, False)]
                if data:  # one batch, uploaded concurrently by async stores; then each file's time from one listing
                    self.fs.put([str(p) for p in data], [self._key(p) for p in data])
                    after = self._objects(folder)
                    for path in data:
                        self._settle(path, after[path.relative_to(self.root).as_posix()])
                if gone := [f"{self.base}/{rel}" for rel in objects if rel not in local]:
                    self.fs.rm(gone)
                for path in sorted([p for p in changed if p not in data], key=_upload_order):
                    self._upload(path)

    def remove(self, folder: Path) -> None:
        """Delete the objects under a local folder's place in the bucket (a stage recomputed with --force)."""
        with self._store(), contextlib.suppress(FileNotFoundError):
            self.fs.rm(self._key(folder), recursive=True)
        under = os.path.abspath(folder) + os.sep
        for path in [path for path in list(_SYNCED) if path.startswith(under)]:  # their objects are gone
            _SYNCED.pop(path, None)

    # --- the run lock in the bucket -------------------------------------------------------------------------
    def _lock_holder(self) -> dict | None:
        try:
            holder = json.loads(self.fs.cat_file(f"{self.base}/{LOCK_NAME}"))
        except FileNotFoundError:
            return None
        except ValueError:
            return {}
        return holder if isinstance(holder, dict) else {}

    def _take_lock(self, holder: dict) -> None:
        key = f"{self.base}/{LOCK_NAME}"
        for _ in range(3):
            try:
                self.fs.pipe_file(key, json.dumps(holder).encode(), mode="create")
                return
            except FileExistsError:
                other = self._lock_holder()
                if other is not None and not is_stale(other):
                    raise RunLocked(locked_message(self.url, other)) from None
                if other is not None:
                    log.warning("note: %s/%s was left by pid %s on this host, which is no longer running; taking it "
                                "over", self.url, LOCK_NAME, other["pid"])
                    self.fs.rm(key)
            except FileNotFoundError as e:  # s3fs: "The specified bucket does not exist"
                raise StoreError(f"{self.url}: cannot write there ({_one_line(e)}); create the bucket first, or "
                                 f"check the URL") from None
        raise RunLocked(locked_message(self.url, self._lock_holder() or {}))

    def _let_go(self, holder: dict, recorded: bool) -> None:
        """Give the bucket's lock back; a run that wrote nothing there takes its ownership object away too."""
        if recorded and not set(self._find(self.base)) - {LOCK_NAME, OWNER_FILE}:
            self.fs.rm(f"{self.base}/{OWNER_FILE}")
        if self._lock_holder() == holder:
            self.fs.rm(f"{self.base}/{LOCK_NAME}")

    @contextlib.contextmanager
    def hold(self, holder: dict) -> Iterator[None]:
        """For the ``with`` block: the run's lock in the bucket (``holder``: the local lock's content), and the
        local copy brought up to date first. The URL must be new, empty or an Atlas run's (``check_owned``); the
        lock is written only where none is (a conditional PUT)."""
        owned = self.check_owned()
        with self._store():
            self._take_lock(holder)
        recorded = False
        try:
            if not owned:
                with self._store():
                    self.fs.pipe_file(f"{self.base}/{OWNER_FILE}", json.dumps(
                        {"kind": "run", "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                         "host": socket.gethostname(), "pid": os.getpid()}).encode())
                recorded = True
            log.info("%s: working in the local copy %s; %s", self.url, self.root, self.pull())
            yield
        except BaseException:
            try:
                with self._store():
                    self._let_go(holder, recorded)
            except StoreError as e:  # the error that stopped the run is the one to report
                log.warning("note: %s", e)
            raise
        with self._store():
            self._let_go(holder, recorded)


def local_run(url: str, metadata_only: bool = False) -> Path:
    """For a command that reads a run kept in object storage (status, report, export...): its default local copy,
    brought up to date. A copy that a run on this machine is driving is read as it is: it is the newest there is,
    and pulling would delete its unpushed files."""
    mirror = RunMirror(url, default_local_copy(url))
    mirror.check_owned()  # a prefix of someone else's is neither copied nor written back to (report, eval)
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
