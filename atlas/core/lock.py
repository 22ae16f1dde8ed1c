"""The run lock: one driver (`atlas run`, `atlas plan`) per run directory at a time.

``RUN/_lock`` holds the pid, host, start time and command of the process that drives the run. It appears whole
or not at all: the lock is written under a temporary name, then hard-linked to ``RUN/_lock``, which fails when a
lock is already there. A lock left on this host by a process that is gone (killed, crashed) is stale and taken
over; a lock of another host is never broken, as only that host can tell whether its process still runs.

The lock is let go when no shard runs in this process any more. Interrupted (Ctrl-C, SIGTERM), the driver stops
waiting for its shards, but shards already running in its worker threads run to their end (a thread cannot be
stopped from outside) and the process exits only then: letting the lock go earlier let a second `atlas run` start on
the run while the first still wrote shards (seen on the dev corpus: two drivers tagging one run).

`atlas stage` (one SLURM array task of a planned run) takes no lock: the tasks of one plan run side by side,
each writing only its own shards. Commands that only read a run (status, report, inspect) take none either.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import shlex
import socket
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from atlas.core.ownership import OWNER_FILE, claim

LOCK_NAME = "_lock"
log = logging.getLogger("atlas.core.lock")

# Locks this process holds: path -> pid. `atlas run` holds the lock while run_stages, inside it, takes it again;
# the pid keeps a forked worker from thinking it holds its parent's lock.
_HELD: dict[Path, int] = {}


# Shards running in this process (see shard_running), whatever thread runs them.
_running = 0
_running_changed = threading.Condition()


@contextlib.contextmanager
def shard_running() -> Iterator[None]:
    """Around each shard this process runs: a run lock it holds is kept until no shard runs any more."""
    global _running
    with _running_changed:
        _running += 1
    try:
        yield
    finally:
        with _running_changed:
            _running -= 1
            _running_changed.notify_all()


def _wait_for_running_shards() -> None:
    with _running_changed:
        if _running:
            log.warning("waiting for %d shard(s) still running to finish; the run stays locked until then",
                        _running)
        _running_changed.wait_for(lambda: not _running)


class RunLocked(RuntimeError):
    """Another process drives this run directory."""


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` of this host still runs (a zombie, killed but not yet reaped, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, owned by someone else
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):  # no /proc (macOS): kill(0) said it exists
        return True


def _read(path: Path) -> dict | None:
    """The lock's holder; None when there is no lock; {} when the file is damaged (never taken as stale)."""
    try:
        holder = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}
    return holder if isinstance(holder, dict) else {}


def is_stale(holder: dict) -> bool:
    pid = holder.get("pid")
    return holder.get("host") == socket.gethostname() and isinstance(pid, int) and not pid_alive(pid)


def locked_message(root: str | Path, holder: dict) -> str:
    """Who holds the lock of ``root`` (a folder or a URL) and what to do."""
    who = (f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')}, started {holder.get('started', '?')}"
           if holder else "its lock file is unreadable")
    command = f": {holder['command']}" if holder.get("command") else ""
    return (f"{root} is in use by another atlas run ({who}{command}); wait for it or, if that process is gone, "
            f"remove {root}/{LOCK_NAME}")


def _break_stale(path: Path, holder: dict) -> None:
    """Remove a stale lock, unless another process took it over in the meantime (its fresh lock stays)."""
    aside = path.with_name(f".{path.name}.{os.getpid()}.stale.tmp")
    try:
        os.rename(path, aside)  # atomic: of two processes breaking the same stale lock, one gets it
    except FileNotFoundError:
        return
    try:
        if _read(aside) != holder:  # we moved a fresh lock, not the stale one: put it back
            os.link(aside, path)
    finally:
        aside.unlink(missing_ok=True)


def _acquire(root: Path, path: Path, command: str) -> dict:
    mine = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "command": command}
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(mine) + "\n")
    try:
        for _ in range(5):  # a lock released or broken by someone else meanwhile: try again
            try:
                os.link(tmp, path)
                return mine
            except FileExistsError:
                holder = _read(path)
                if holder is None:
                    continue
                if not is_stale(holder):
                    raise RunLocked(locked_message(root, holder)) from None
                log.warning("note: %s was left by pid %s on this host, which is no longer running (killed?); "
                            "taking it over", path, holder["pid"])
                _break_stale(path, holder)
        raise RunLocked(locked_message(root, _read(path) or {}))
    finally:
        tmp.unlink(missing_ok=True)


@contextlib.contextmanager
def run_lock(root: str | Path, command: str | None = None, mirror=None, claim_root: bool = True) -> Iterator[None]:
    """Hold ``RUN/_lock`` for the ``with`` block (released on exceptions and Ctrl-C too); ``RunLocked`` when another
    live process holds it. A run directory this creates is removed again if nothing was written into it.

    ``mirror``: for a run kept in object storage (``atlas.io.remote_run.RunMirror``), whose lock in the bucket is
    held too, and whose local copy is brought up to date once both locks are held.

    ``claim_root``: False for a folder inside a run that the caller has checked is Atlas's (a model's
    RUN/cblm/NAME): it is locked the same way but gets no ownership record of its own."""
    root = Path(root).resolve()
    path = root / LOCK_NAME
    if _HELD.get(path) == os.getpid():  # already ours (`atlas run` around run_stages): the outer block releases it
        yield
        return
    created = list(itertools.takewhile(lambda p: not p.exists(), [root, *root.parents]))
    recorded = (root / OWNER_FILE).exists()
    if claim_root:
        # a folder of the user's is refused before the lock is written into it
        claim(root, "run", f"local_copy of {mirror.url}" if mirror is not None else "run directory")
    else:
        root.mkdir(parents=True, exist_ok=True)
    try:
        mine = _acquire(root, path, command or shlex.join(sys.argv))
        _HELD[path] = os.getpid()
        try:
            with mirror.hold(mine) if mirror is not None else contextlib.nullcontext():
                yield
        finally:
            _wait_for_running_shards()  # interrupted again while waiting: the lock stays, stale once we are gone
            del _HELD[path]
            if _read(path) == mine:
                path.unlink()
    finally:
        with contextlib.suppress(OSError):  # a refused run leaves the folder as it found it: no record in it either
            if not recorded and os.listdir(root) == [OWNER_FILE]:
                (root / OWNER_FILE).unlink()
        for folder in created:  # ... and no empty run directory behind
            try:
                folder.rmdir()
            except OSError:  # not empty: the run wrote into it
                break
