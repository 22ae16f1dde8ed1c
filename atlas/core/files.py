"""Atomic file writes: write to a temporary name in the same folder, then rename.

A crash leaves either the previous file or the new one, never half a file. Every artifact Atlas
writes (Parquet parts, JSON markers, manifests) goes through these helpers.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq


def _tmp_path(path: Path) -> Path:
    return path.with_name(f".{path.name}.{os.getpid()}.tmp")


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _tmp_path(path)
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def atomic_write_json(path: str | Path, obj: Any) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n").encode())


def read_json(path: str | Path) -> Any:
    return json.loads(Path(path).read_text())


def atomic_write_parquet(path: str | Path, table: pa.Table) -> None:
    """Write a Parquet file atomically; the same table always gives the same bytes."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _tmp_path(path)
    pq.write_table(table, tmp, compression="zstd", row_group_size=64_000)
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


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


def file_fingerprint(path: str | Path, sample: int = 1 << 20) -> dict:
    """Cheap content identity of an input file: size and a hash of its first and last MiB.

    Modification times are left out on purpose: copying or rebuilding an identical file must not
    invalidate a finished run.
    """
    path = Path(path)
    size = path.stat().st_size
    h = hashlib.sha256()
    with open(path, "rb") as f:
        h.update(f.read(sample))
        if size > sample:
            f.seek(max(sample, size - sample))
            h.update(f.read(sample))
    return {"path": str(path), "size": size, "sha256_head_tail": h.hexdigest()}
