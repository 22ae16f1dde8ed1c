"""Atomic file writes: write to a temporary name in the same folder, then rename.

A crash leaves either the previous file or the new one, never half a file. Every artifact Atlas
writes (Parquet parts, JSON markers, manifests) goes through these helpers.

The readers at the end (``read_json``, ``open_parquet``, ``read_parquet``, ``read_parts``) check what they read
back: a damaged, truncated or foreign file, or a missing column, is an ``ArtifactError`` that names the file.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO

import pyarrow as pa
import pyarrow.parquet as pq


class InputError(ValueError):
    """A file that cannot be used at all: an input file, or an artifact of the run directory that is missing,
    damaged or inconsistent. The message names the file, and the column, row or field where that applies."""


class ArtifactError(InputError):
    """A file in the run directory (a part, a marker, a model, an array) that is missing, damaged or does not
    match the files it goes with. Nothing is changed or deleted when this is raised: fix or restore the file, or
    recompute the stage that writes it."""


class OutsideWriteRoots(InputError):
    """A write that would land outside the folders the command writes to (through a symbolic link, or a name with
    '..'): refused, and nothing is written."""


# The folders this process writes to (a run directory, an export's OUT), set by ``confined_writes``; every atomic
# write checks its real destination against them. Process-wide, not per thread: shard workers are threads.
_WRITE_ROOTS: list[Path] = []


@contextmanager
def confined_writes(*roots: str | Path) -> Iterator[None]:
    """For the ``with`` block, atomic writes land only under ``roots`` (resolved now), whatever symbolic links on the
    way say: a received run whose ``report/`` is a link to another folder cannot make a command write there."""
    resolved = [Path(root).resolve() for root in roots]
    _WRITE_ROOTS.extend(resolved)
    try:
        yield
    finally:
        for root in resolved:
            _WRITE_ROOTS.remove(root)


def inside(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


def check_write(path: str | Path) -> None:
    """``OutsideWriteRoots`` when ``path``'s real place (its folder's symbolic links followed) is outside every root
    of ``confined_writes``; no check outside such a block."""
    if not _WRITE_ROOTS:
        return
    path = Path(path)
    real = path.parent.resolve() / path.name
    if not any(inside(real, root) for root in _WRITE_ROOTS):
        roots = ", ".join(str(r) for r in _WRITE_ROOTS)
        raise OutsideWriteRoots(f"{path}: refused to write there: it leads to {real}, outside {roots} (a symbolic "
                                f"link inside the folder?); nothing was written. Replace the link with a folder")


def temporary_path(path: Path) -> Path:
    """Where a file is written before it is renamed to ``path``: a hidden name in the same folder, per process."""
    return path.with_name(f".{path.name}.{os.getpid()}.tmp")


@contextmanager
def atomic_writer(path: str | Path) -> Iterator[BinaryIO]:
    """A binary file written under a temporary name and renamed to ``path`` on a clean exit (for a file too large
    to hold in memory: ``atomic_write_bytes`` otherwise)."""
    path = Path(path)
    check_write(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary_path(path)
    try:
        with open(tmp, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:  # a full disk or a kill: the previous file stays, the half-written one goes
        tmp.unlink(missing_ok=True)
        raise


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    with atomic_writer(path) as f:
        f.write(data)


def atomic_write_json(path: str | Path, obj: Any) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n").encode())


def read_json(path: str | Path, expect_object: bool = True) -> Any:
    """A JSON file Atlas wrote (a marker, a manifest, a plan); damage is an ArtifactError that names the file."""
    path = Path(path)
    try:
        data = json.loads(path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        where = f" at line {e.lineno}, column {e.colno}" if isinstance(e, json.JSONDecodeError) else ""
        problem = e.msg if isinstance(e, json.JSONDecodeError) else str(e)
        raise ArtifactError(f"{path}: not valid JSON ({problem}{where}); the file is damaged or was cut short "
                            "(an interrupted copy?)") from None
    if expect_object and not isinstance(data, dict):
        raise ArtifactError(f"{path}: expected a JSON object, found {type(data).__name__}; the file is damaged")
    return data


def atomic_write_parquet(path: str | Path, table: pa.Table) -> None:
    """Write a Parquet file atomically; the same table always gives the same bytes."""
    path = Path(path)
    check_write(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary_path(path)
    try:
        pq.write_table(table, tmp, compression="zstd", row_group_size=64_000)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_write_npy(path: str | Path, array) -> None:
    """Write a numpy array as .npy atomically."""
    import io

    import numpy as np

    buffer = io.BytesIO()
    np.save(buffer, array)
    atomic_write_bytes(path, buffer.getvalue())


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def stable_hash(obj: Any) -> str:
    """sha256 of a JSON-serializable object with sorted keys: equal content, equal hash."""
    return sha256_bytes(json.dumps(obj, sort_keys=True, default=str, separators=(",", ":")).encode())


def file_fingerprint(path: str | Path, cache: dict | None = None) -> dict:
    """Content identity of an input file: its size and the sha256 of all its bytes, so an edit anywhere is seen.

    Hashing reads the whole file (sha256: about 0.55 s per GB on one core, as long as reading it from an SSD), so
    ``cache`` (a dict kept in RUN/_cache/fingerprints.json) holds each file's hash under its size, mtime, ctime and
    inode: an unchanged file is not read again, and any write, which moves mtime and ctime, hashes it again. Times
    key only the cache, never the identity: copying or rebuilding an identical file must not invalidate a finished run.
    """
    path = Path(path)
    st = path.stat()
    stamp = [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev]
    key = str(path.resolve())
    entry = (cache or {}).get(key)
    if entry and entry.get("stamp") == stamp:
        digest = entry["sha256"]
    else:
        with open(path, "rb") as f:
            digest = hashlib.file_digest(f, "sha256").hexdigest()
        # A write within the same clock tick as the stat above would not move mtime: only settled files are cached.
        if cache is not None and time.time_ns() - st.st_mtime_ns > 2_000_000_000:
            cache[key] = {"stamp": stamp, "sha256": digest}
    return {"size": st.st_size, "sha256": digest}


# --- reading Parquet artifacts ---------------------------------------------------------------------


def _column_problems(schema: pa.Schema, required) -> str | None:
    """What is wrong with ``schema`` for a reader that needs ``required`` (names, or a schema: names and types)."""
    names = schema.names
    wanted = list(required.names if isinstance(required, pa.Schema) else required)
    if missing := [c for c in wanted if c not in names]:
        return f"missing column(s) {missing}; the file has {names}"
    if isinstance(required, pa.Schema):
        for expected in required:
            actual = schema.field(expected.name).type
            if not actual.equals(expected.type):
                return f"column {expected.name!r} is {actual}, expected {expected.type}"
    return None


def open_parquet(path: str | Path, required=(), hint: str = "") -> pq.ParquetFile:
    """A Parquet artifact opened for reading, with its columns checked.

    ``required``: the column names the reader needs, or a schema whose columns must be there with the same types.
    A missing, truncated or foreign file, or a missing or mistyped column, is an ArtifactError that names the
    file (pyarrow's own messages often do not), followed by ``hint`` (what to rerun).
    """
    path = Path(path)
    tail = f"; {hint}" if hint else ""
    if not path.is_file():
        raise ArtifactError(f"{path}: missing{tail}")
    try:
        pf = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise ArtifactError(f"{path}: not a readable Parquet file ({e}): truncated, damaged or not Parquet{tail}") \
            from None
    if problem := _column_problems(pf.schema_arrow, required):
        pf.close()
        raise ArtifactError(f"{path}: {problem}{tail}")
    return pf


def read_parquet(path: str | Path, columns: list[str] | None = None, required=(), hint: str = "") -> pa.Table:
    """``columns`` of a Parquet artifact (all when None), checked as :func:`open_parquet` does (``required``
    defaults to ``columns``). Damage found only while decoding (a cut row group) is an ArtifactError as well."""
    pf = open_parquet(path, required or (columns or ()), hint)
    try:
        with pf:
            return pf.read(columns=columns)
    except (pa.ArrowException, OSError) as e:
        raise ArtifactError(f"{path}: cannot be decoded ({e}): truncated or damaged" + (f"; {hint}" if hint else "")) \
            from None


def read_parts(parts: list[Path], columns: list[str] | None = None, required=(), hint: str = "") -> pa.Table:
    """The given parts of a stage folder (``RunDir.parts``: exactly the planned ones) as one table, in order, each
    checked as :func:`read_parquet` does: unlike ``pq.read_table(folder)``, a part with another schema is an error that
    names it, never a column of nulls."""
    return pa.concat_tables([read_parquet(p, columns, required, hint) for p in parts])
