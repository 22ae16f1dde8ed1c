"""``RUN/embeddings.zarr``: FP16 chunk embeddings and aligned id arrays, written shard by shard.

Layout (zarr v3), row i everywhere = row i of the annotated Parquet parts read in shard order::

    embeddings.zarr/embeddings     float16 [N, d], L2-normalized
    embeddings.zarr/chunk_id       str [N]     (also doc_id, source_doc_id, data_src)
    attrs: n_rows, dim, shard_offsets, encoder, stage_hash

Shards write in parallel, and zarr rewrites a whole storage chunk on every write: two shards
writing rows of the same storage chunk at once could lose one of the writes. So a shard writes
only the storage chunks that lie entirely inside its rows, and leaves the rows of the chunks it
shares with a neighbour (at most two partial chunks) in a small staging file; ``finish`` writes
those shared chunks, one by one, once every shard is done. Each write is a whole storage chunk, so a
rerun (after a kill) rewrites the same bytes.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

from atlas.core.files import ArtifactError, read_json
from atlas.io import layout

ID_ARRAYS = ("chunk_id", "doc_id", "source_doc_id", "data_src")
STAGING = "_staging"


def create_store(path: Path, n_rows: int, dim: int, chunk_rows: int, attrs: dict) -> None:
    """An empty store with every array allocated (unwritten chunks read as zeros / empty strings)."""
    import zarr

    if path.exists():
        shutil.rmtree(path)
    group = zarr.open_group(str(path), mode="w")
    rows = max(1, min(chunk_rows, n_rows))
    group.create_array("embeddings", shape=(n_rows, dim), chunks=(rows, dim), dtype="float16", fill_value=0)
    for name in ID_ARRAYS:
        group.create_array(name, shape=(n_rows,), chunks=(rows,), dtype=str)
    group.attrs.update(attrs | {"n_rows": n_rows, "dim": dim, "chunk_rows": rows})


def owned_rows(start: int, end: int, chunk_rows: int, n_rows: int) -> tuple[int, int]:
    """The rows [lo, hi) of a shard's rows [start, end) that fill storage chunks no other shard touches."""
    first = -(-start // chunk_rows)  # the first storage chunk starting inside the shard
    last = end // chunk_rows if end < n_rows else -(-n_rows // chunk_rows)  # chunks before it end inside
    lo, hi = first * chunk_rows, min(last * chunk_rows, n_rows)
    return (lo, hi) if lo < hi else (start, start)


def write_rows(path: Path, shard: int, start: int, end: int, arrays: dict[str, np.ndarray]) -> None:
    """Write rows [start, end) of a shard: its own storage chunks directly, shared ones to staging."""
    import zarr

    group = zarr.open_group(str(path), mode="r+")
    lo, hi = owned_rows(start, end, group.attrs["chunk_rows"], group.attrs["n_rows"])
    if lo < hi:
        for name, values in arrays.items():
            group[name][lo:hi] = values[lo - start : hi - start]
    staged = {name: np.concatenate([values[: lo - start], values[hi - start :]]) for name, values in arrays.items()}
    rows = np.concatenate([np.arange(start, lo), np.arange(hi, end)]).astype(np.int64)
    staging = path / STAGING
    staging.mkdir(exist_ok=True)
    tmp = staging / f".{shard:05d}.npz.tmp"
    with open(tmp, "wb") as f:
        np.savez(f, rows=rows, **{name: np.asarray(v, dtype=np.float16 if name == "embeddings" else np.str_)
                                  for name, v in staged.items()})
    tmp.replace(staging / f"{shard:05d}.npz")


def finish(path: Path, n_shards: int) -> int:
    """Write the storage chunks that shards share, from the staging files; returns rows written.

    Chunks are written in order, each from the staging files of the shards it overlaps, and a file
    is dropped from memory once its shard is behind: memory stays at a few shards' staged rows.
    """
    import zarr

    group = zarr.open_group(str(path), mode="r+")
    chunk_rows, n_rows = group.attrs["chunk_rows"], group.attrs["n_rows"]
    starts = list(group.attrs["shard_offsets"]) + [n_rows]
    spans = [(starts[s], starts[s + 1]) for s in range(n_shards)]
    shared: set[int] = set()  # storage chunks holding staged rows, known from the shard bounds alone
    for start, end in spans:
        lo, hi = owned_rows(start, end, chunk_rows, n_rows)
        for a, b in ((start, lo), (hi, end)):
            if a < b:
                shared.update(range(a // chunk_rows, (b - 1) // chunk_rows + 1))
    loaded: dict[int, dict] = {}
    written = 0
    for chunk in sorted(shared):
        lo, hi = chunk * chunk_rows, min((chunk + 1) * chunk_rows, n_rows)
        rows, values = [], {}
        for shard, (start, end) in enumerate(spans):
            if start >= hi or end <= lo:
                continue
            if shard not in loaded:
                with np.load(path / STAGING / f"{shard:05d}.npz", allow_pickle=False) as data:
                    loaded[shard] = {name: data[name] for name in data.files}
            staged = loaded[shard]
            keep = (staged["rows"] >= lo) & (staged["rows"] < hi)
            rows.append(staged["rows"][keep])
            for name in staged:
                if name != "rows":
                    values.setdefault(name, []).append(staged[name][keep])
        rows = np.concatenate(rows)
        if sorted(rows.tolist()) != list(range(lo, hi)):
            raise RuntimeError(f"{path}: staged rows of storage chunk {chunk} do not cover rows {lo}..{hi - 1}")
        order = np.argsort(rows)
        for name, parts in values.items():
            group[name][lo:hi] = np.concatenate(parts)[order]
        written += hi - lo
        loaded = {shard: v for shard, v in loaded.items() if spans[shard][1] > hi}  # shards still ahead
    finished = path / f"{STAGING}.finished"  # one atomic rename: a kill while deleting leaves no half staging
    (path / STAGING).rename(finished)
    shutil.rmtree(finished, ignore_errors=True)
    return written


# Codecs that only decode bytes. Others (numcodecs' pickle, object codecs) can run code while
# decoding, and a run directory may come from someone else: they are refused before zarr reads.
SAFE_CODECS = frozenset({"bytes", "vlen-utf8", "vlen-bytes", "zstd", "blosc", "gzip", "transpose", "crc32c"})


def _check_codecs(path: Path) -> None:
    for meta in sorted(path.rglob("zarr.json")):
        for codec in read_json(meta).get("codecs", []):
            name = codec.get("name") if isinstance(codec, dict) else codec
            if name not in SAFE_CODECS:
                raise ArtifactError(f"{meta}: codec {name!r} is not allowed (allowed: "
                                    f"{', '.join(sorted(SAFE_CODECS))})")


def open_embeddings(run_root: Path):
    """The store as a zarr group (read-only); checks that it was completed."""
    import zarr

    path = Path(run_root) / layout.EMBEDDINGS
    if not (path / "zarr.json").exists():
        raise FileNotFoundError(f"{path}: no embeddings yet; run the annotate stage")
    _check_codecs(path)
    if (path / STAGING).exists():
        raise ArtifactError(f"{path}: incomplete (the annotate stage has not finished); rerun it")
    try:
        group = zarr.open_group(str(path), mode="r", zarr_format=3)
        present = set(group.array_keys())
        arrays = {name: group[name] for name in ("embeddings", *ID_ARRAYS) if name == "embeddings" or name in present}
        n_rows = group.attrs["n_rows"]
    except (KeyError, ValueError, TypeError, OSError) as e:  # zarr's own errors are ValueErrors or KeyErrors
        raise ArtifactError(f"{path}: not a complete embeddings store ({type(e).__name__}: {e}); {REANNOTATE}") \
            from None
    for name, array in arrays.items():
        if array.shape[0] != n_rows:
            raise ArtifactError(f"{path / name}: {array.shape[0]} rows, but the store's attrs say {n_rows}; "
                                f"{REANNOTATE}")
    return group


def stored_ids(run_root: Path, name: str = "chunk_id") -> np.ndarray:
    """The id array ``name`` of the store (row i: the id of embedding i), checked: a storage chunk that is missing
    (zarr would read empty strings) or an empty id is an ArtifactError that names the array."""
    group = open_embeddings(run_root)
    path = Path(run_root) / layout.EMBEDDINGS / name
    array = group[name]
    size = array.chunks[0]
    for i in range(array.cdata_shape[0]):
        if not (path / (key := array.metadata.encode_chunk_key((i,)))).is_file():
            last = min((i + 1) * size, array.shape[0]) - 1
            raise ArtifactError(f"{path}: storage chunk {key} (rows {i * size}..{last}) is missing, so those rows "
                                f"have no {name}; {REANNOTATE}")
    try:
        ids = array[:]
    except Exception as e:  # noqa: BLE001 - codecs raise anything (RuntimeError, ValueError...) on damaged bytes
        raise ArtifactError(f"{path}: cannot be decoded ({type(e).__name__}: {e}); {REANNOTATE}") from None
    empty = np.flatnonzero(ids == "")
    if len(empty):
        raise ArtifactError(f"{path}: row {int(empty[0])} has an empty {name} ({len(empty)} such rows); {REANNOTATE}")
    return ids


def describe(run_root: Path) -> str:
    group = open_embeddings(run_root)
    return json.dumps({"n_rows": group.attrs["n_rows"], "dim": group.attrs["dim"],
                       "encoder": group.attrs.get("encoder")})


REANNOTATE = "recompute it: atlas run CONFIG --force --stages annotate (then tokenize and index follow)"


class CheckedRows:
    """The zarr embeddings as ``build_ivfpq`` reads them, with damage named: a storage chunk that is missing (zarr
    would read zeros) is found before the build, one that cannot be decoded when it is read."""

    def __init__(self, array, path):
        self.array, self.path, self.shape, self.dtype = array, path, array.shape, array.dtype
        size = array.chunks[0]
        missing = [f"{key} (rows {i * size}..{min((i + 1) * size, array.shape[0]) - 1})"
                   for i in range(array.cdata_shape[0])
                   if not (path / (key := array.metadata.encode_chunk_key((i, 0)))).is_file()]
        if missing:
            more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
            raise ArtifactError(f"{path}: storage chunk(s) {', '.join(missing[:5])}{more} missing; {REANNOTATE}")

    def _read(self, read, rows: np.ndarray):
        try:
            return read()
        except Exception as e:  # noqa: BLE001 - codecs raise anything (RuntimeError, ValueError...) on damaged bytes
            size = self.array.chunks[0]
            for chunk in np.unique(np.asarray(rows) // size).tolist():  # find the storage chunk that fails
                try:
                    self.array[chunk * size : (chunk + 1) * size]
                except Exception:  # noqa: BLE001
                    key, last = self.array.metadata.encode_chunk_key((chunk, 0)), (chunk + 1) * size - 1
                    raise ArtifactError(f"{self.path}: storage chunk {key} (rows {chunk * size}..{last}) cannot be "
                                        f"decoded ({type(e).__name__}: {e}); {REANNOTATE}") from None
            raise

    def __getitem__(self, key):
        rows = np.arange(*key.indices(self.shape[0])) if isinstance(key, slice) else key
        return self._read(lambda: self.array[key], rows)

    def get_orthogonal_selection(self, selection):
        return self._read(lambda: self.array.get_orthogonal_selection(selection), selection[0])
