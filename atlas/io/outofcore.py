"""Out-of-core work for the global stages: DuckDB over the run's Parquet parts, and streamed writes.

The global stages aggregate and join corpus-sized tables (every tag row, every (concept, chunk) pair). DuckDB
reads the parts directly and holds at most ``execution.memory_gb`` of them, spilling the rest to
``RUN/_tmp/<stage>/``, which is removed when the work ends (and at its start, after a killed run). Nothing here
builds a Python object per row: results come back in Arrow record batches, in the order of the query's own
ORDER BY (DuckDB's order is otherwise arbitrary), and go straight to a :class:`PartWriter` or :class:`NpyWriter`.
Only integer counts are aggregated in SQL; float math stays in numpy, in a fixed order, so results are the same
bits whatever the thread count.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from atlas.core.files import open_parquet, temporary_path
from atlas.core.rundir import RunDir
from atlas.io import layout

THREADS = min(4, os.cpu_count() or 1)  # each DuckDB thread adds buffers; a few are enough to keep up with the disk
BATCH_ROWS = 64_000  # rows per record batch fetched from DuckDB
ROW_GROUP_ROWS = 64_000  # as atomic_write_parquet, so a streamed part has the bytes a whole-table write gives
MAX_LIST_VALUES = 500_000  # a row group also ends before its list column passes this many values (bounds memory)
LIST_BUDGET = 100_000  # list values read from DuckDB at a time
PAIRS_PER_PASS = 500_000  # (tag, chunk) pairs a query unnests at a time: its memory does not grow with the corpus


def sql_string(value: str | Path) -> str:
    """A string (a file name) as a SQL literal, where DuckDB takes no prepared parameter (views, COPY)."""
    return "'" + str(value).replace("'", "''") + "'"


def sql_list(values: Iterable[str | Path]) -> str:
    """Strings (file names for ``read_parquet``, field names) as a SQL list literal, for a view: views take no
    prepared parameters."""
    return "[" + ", ".join(sql_string(v) for v in values) + "]::VARCHAR[]"


def checked_parts(run: RunDir, output: str, required) -> list[Path]:
    """Every part of a stage's output, for a reader that queries the files directly (DuckDB): each is checked to
    have the ``required`` columns (names, or a schema), from its footer alone, so a damaged or foreign part is an
    ArtifactError that names it."""
    parts = run.parts(output)
    for part in parts:
        open_parquet(part, required=required).close()
    return parts


@contextmanager
def scratch(folder: Path) -> Iterator[Path]:
    """An empty folder for spill files (a stage's is ``RUN/_tmp/<stage>/``), removed on the way out, and on the way
    in after a kill."""
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        if folder.parent.name == layout.TMP:
            try:
                folder.parent.rmdir()  # RUN/_tmp goes too when nothing else is in it
            except OSError:
                pass


@contextmanager
def duckdb_session(folder: Path, memory_gb: float) -> Iterator:
    """A DuckDB database that holds at most ``memory_gb`` in memory and keeps the rest in ``folder`` (see ``scratch``).

    The database is a file there, removed on the way out: the tables a stage builds (a row per tag, per chunk) are
    then evicted to disk like any other block, where an in-memory database would have to hold them whole. Use
    tables, not TEMP tables, for what a second cursor (``con.cursor()``) must see: one connection streams one result
    at a time."""
    import duckdb

    database = folder / f"work.{os.getpid()}.duckdb"
    con = duckdb.connect(str(database), config={
        "memory_limit": f"{max(int(memory_gb * 1024), 64)}MiB", "temp_directory": str(folder / "duckdb"),
        "threads": THREADS, "preserve_insertion_order": False})
    try:
        yield con
    finally:
        con.close()
        for path in (database, database.with_name(database.name + ".wal")):
            path.unlink(missing_ok=True)


def record_batches(con, sql: str, params: list | None = None, rows: int = BATCH_ROWS) -> Iterator[pa.RecordBatch]:
    """The result of a query as Arrow record batches, streamed (never the whole result in memory)."""
    yield from con.execute(sql, params or []).to_arrow_reader(rows)


def rows_of(batches: Iterable[pa.RecordBatch], rows: int) -> Iterator[pa.Table]:
    """The rows of a stream of batches, ``rows`` at a time (the last table may be shorter)."""
    pending: list[pa.RecordBatch] = []
    have = 0
    for batch in batches:
        pending.append(batch)
        have += batch.num_rows
        while have >= rows:
            table = pa.Table.from_batches(pending)
            yield table.slice(0, rows)
            rest = table.slice(rows)
            pending, have = rest.to_batches(), rest.num_rows
    if have:
        yield pa.Table.from_batches(pending)


def runs_of(batches: Iterable[pa.RecordBatch], key: str, value: str) -> Iterator[tuple[int, np.ndarray]]:
    """(key, values) for each run of equal keys in a stream of (key, value) batches sorted by key."""
    keys, values = [], []
    for batch in batches:
        if batch.num_rows == 0:
            continue
        k, v = batch.column(key).to_numpy(), batch.column(value).to_numpy()
        starts = np.flatnonzero(np.diff(k)) + 1
        for i, (ks, vs) in enumerate(zip(np.split(k, starts), np.split(v, starts))):
            if keys and (i > 0 or keys[-1][0] != ks[0]):  # a new key: the previous run is complete
                yield int(keys[0][0]), np.concatenate(values)
                keys, values = [], []
            keys.append(ks)
            values.append(vs)
    if keys:
        yield int(keys[0][0]), np.concatenate(values)


class SortedLists:
    """Lists of values by key, from a stream of (key, value) batches sorted by key.

    ``take(keys)`` returns the lists of the next keys (increasing integers; a key with no values gets an empty
    list) and reads the stream only as far as those keys: memory holds one range of keys' values at a time (see
    ``budget_slices`` to keep that range small)."""

    def __init__(self, batches: Iterable[pa.RecordBatch], key: str, value: str):
        self.batches, self.key, self.value = iter(batches), key, value
        self.keys: list[np.ndarray] = []  # read and not yet taken, batch by batch
        self.values: list[pa.Array] = []
        self.done = False

    def take(self, keys: np.ndarray, value_type: pa.DataType) -> pa.ListArray:
        last = keys[-1] if len(keys) else -1
        while not self.done and (not self.keys or self.keys[-1][-1] <= last):
            batch = next(self.batches, None)
            if batch is None:
                self.done = True
            elif batch.num_rows:
                self.keys.append(batch.column(self.key).to_numpy())
                self.values.append(batch.column(self.value))
        read = np.concatenate(self.keys) if self.keys else np.zeros(0, np.int64)
        values = pa.concat_arrays(self.values).cast(value_type) if self.values else pa.array([], value_type)
        end = int(np.searchsorted(read, last, side="right"))
        mine, values_mine = read[:end], values.slice(0, end)
        self.keys = [read[end:]] if end < len(read) else []
        self.values = [values.slice(end)] if end < len(read) else []
        wanted = np.isin(mine, keys)
        if not wanted.all():  # keys the caller skipped: their values are dropped
            mine, values_mine = mine[wanted], values_mine.filter(pa.array(wanted))
        offsets = np.append(np.searchsorted(mine, keys, side="left"), len(mine)).astype(np.int32)
        return pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), values_mine)


def budget_slices(lengths: np.ndarray, budget: int = LIST_BUDGET) -> Iterator[slice]:
    """Consecutive slices of rows whose list lengths add up to at most ``budget`` (a longer row: alone)."""
    start = 0
    while start < len(lengths):
        fits = int(np.searchsorted(np.cumsum(lengths[start:]), budget, side="right"))
        stop = start + max(fits, 1)
        yield slice(start, stop)
        start = stop


class RowFile:
    """A float32 matrix of known width kept on disk, appended and read in row blocks.

    ``column_stats`` gives each column's mean and standard deviation with the same bits as numpy's
    ``matrix.mean(axis=0)`` and ``matrix.std(axis=0)`` of the whole matrix in memory: numpy sums a matrix of two or
    more columns row after row in float32, which blocks can continue exactly (a single column it sums pairwise, so
    that column is read whole: 4 bytes a row)."""

    def __init__(self, path: Path, width: int):
        self.path, self.width, self.rows = Path(path), width, 0
        self.path.write_bytes(b"")

    def append(self, block: np.ndarray) -> None:
        with open(self.path, "ab") as f:
            f.write(np.ascontiguousarray(block, dtype=np.float32).tobytes())
        self.rows += len(block)

    def read(self, start: int, rows: int) -> np.ndarray:
        rows = max(0, min(rows, self.rows - start))
        with open(self.path, "rb") as f:
            f.seek(start * self.width * 4)
            return np.fromfile(f, dtype=np.float32, count=rows * self.width).reshape(rows, self.width)

    def blocks(self, rows: int = 65_536) -> Iterator[np.ndarray]:
        for start in range(0, self.rows, rows):
            yield self.read(start, rows)

    def column_stats(self) -> tuple[np.ndarray, np.ndarray]:
        if self.width == 1 or self.rows == 0:
            whole = self.read(0, self.rows)
            return whole.mean(axis=0), whole.std(axis=0)
        count = np.intp(self.rows)  # numpy divides by the count as an intp scalar (float64 division, then float32)
        total = np.zeros(self.width, dtype=np.float32)
        for block in self.blocks():
            total = np.add.reduce(np.concatenate([total[None], block]), axis=0)
        mean = np.true_divide(total, count, out=total, casting="unsafe")
        squares = np.zeros(self.width, dtype=np.float32)
        for block in self.blocks():
            deviations = np.square(block - mean[None])
            squares = np.add.reduce(np.concatenate([squares[None], deviations]), axis=0)
        variance = np.true_divide(squares, count, out=squares, casting="unsafe")
        return mean, np.sqrt(variance)


class PartWriter:
    """A Parquet file written from tables that arrive in order, atomically (temporary name, then rename).

    Row groups hold ``ROW_GROUP_ROWS`` rows, as ``atomic_write_parquet`` writes them, so the file has the same bytes
    as that function gives for the whole table; a row group also ends early, before its ``list_column`` holds more
    than ``MAX_LIST_VALUES`` values (only the largest outputs, whose every row carries long lists, are cut
    differently; the cut depends on the data alone). Use as a context manager: the file appears on a clean exit."""

    def __init__(self, path: Path, schema: pa.Schema, list_column: str | None = None):
        self.path, self.schema, self.list_column = Path(path), schema, list_column
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = temporary_path(self.path)
        self.writer = pq.ParquetWriter(self.tmp, schema, compression="zstd")
        self.pending: list[pa.Table] = []
        self.pending_rows = self.pending_values = self.rows = 0

    def write(self, table: pa.Table) -> None:
        table = table.cast(self.schema) if table.schema != self.schema else table
        lengths = list_lengths(table.column(self.list_column)) if self.list_column else None
        start = 0
        while start < table.num_rows:
            take = min(ROW_GROUP_ROWS - self.pending_rows, table.num_rows - start)
            if lengths is not None:  # the rows that keep the group's list values within the limit
                total = np.cumsum(lengths[start : start + take]) + self.pending_values
                take = int(np.searchsorted(total, MAX_LIST_VALUES, side="right"))
                if take == 0 and self.pending_rows == 0:
                    take = 1  # one row longer than the limit: a group of its own
            if take:
                self.pending.append(table.slice(start, take))
                self.pending_rows += take
                self.pending_values += int(lengths[start : start + take].sum()) if lengths is not None else 0
                start += take
            if start < table.num_rows:  # the group is full, or the next row does not fit in it
                self._flush()
        if self.pending_rows == ROW_GROUP_ROWS:
            self._flush()

    def _flush(self) -> None:
        if self.pending_rows:
            group = pa.concat_tables(self.pending).combine_chunks()
            self.writer.write_table(group, row_group_size=group.num_rows)
            self.rows += group.num_rows
        self.pending, self.pending_rows, self.pending_values = [], 0, 0

    def __enter__(self) -> PartWriter:
        return self

    def __exit__(self, kind, error, trace) -> None:
        try:
            if kind is None:
                self._flush()
                if self.rows == 0:  # as pyarrow writes an empty table: one row group of no rows
                    self.writer.write_table(self.schema.empty_table())
            self.writer.close()
            if kind is None:
                with open(self.tmp, "rb+") as f:
                    os.fsync(f.fileno())
                os.replace(self.tmp, self.path)
        finally:
            self.tmp.unlink(missing_ok=True)


def list_lengths(column: pa.ChunkedArray) -> np.ndarray:
    import pyarrow.compute as pc

    return pc.list_value_length(column).fill_null(0).to_numpy()


class NpyWriter:
    """A .npy file of known shape written block by block, atomically; the same bytes as ``np.save`` of the whole
    array. Use as a context manager: the file appears on a clean exit, when every row was written."""

    def __init__(self, path: Path, shape: tuple[int, ...], dtype):
        self.path, self.shape, self.dtype = Path(path), shape, np.dtype(dtype)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = temporary_path(self.path)
        self.file = open(self.tmp, "wb")
        np.lib.format.write_array_header_1_0(self.file, {"descr": np.lib.format.dtype_to_descr(self.dtype),
                                                          "fortran_order": False, "shape": shape})
        self.rows = 0

    def write(self, block: np.ndarray) -> None:
        if block.dtype != self.dtype or block.shape[1:] != self.shape[1:]:
            raise ValueError(f"{self.path}: block {block.dtype} {block.shape}, expected {self.dtype} {self.shape}")
        self.file.write(np.ascontiguousarray(block).tobytes())
        self.rows += len(block)

    def __enter__(self) -> NpyWriter:
        return self

    def __exit__(self, kind, error, trace) -> None:
        try:
            self.file.flush()
            os.fsync(self.file.fileno())
            self.file.close()
            if kind is None:
                if self.rows != self.shape[0]:
                    raise RuntimeError(f"{self.path}: {self.rows} rows written, {self.shape[0]} expected")
                os.replace(self.tmp, self.path)
        finally:
            self.file.close()
            self.tmp.unlink(missing_ok=True)
