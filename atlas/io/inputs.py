"""Input readers: Parquet, JSONL (plain, .gz, .zst) and folders of .txt/.md files.

Reading happens in two steps so that one huge file still parallelizes:

1. ``plan_shards`` lists the input files and cuts them into shards of about
   ``input.docs_per_shard`` documents (row ranges for Parquet, line ranges for JSONL, file ranges
   for text folders). It also finds duplicate document ids across the whole input.
2. ``read_shard`` yields the documents of one shard, and a ``Reject`` (file, row, field, reason)
   for every record that cannot be used. Bad records never stop the run.

Duplicate ids: the first occurrence (in file order, then row order) keeps its id; every later one
becomes ``<id>@<file name>:<row>``, which is unique and the same however the input is sharded. The
original id stays in ``source_doc_id``.
"""

from __future__ import annotations

import glob
import gzip
import io
import json
import math
import zlib
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import NamedTuple

import pyarrow as pa
import pyarrow.parquet as pq
import zstandard

from atlas.config import InputConfig
from atlas.core.files import InputError  # noqa: F401 (defined with the other file errors; imported from here too)

TEXT_SUFFIXES = (".txt", ".md")
JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst", ".json.gz", ".ndjson")


@dataclass(slots=True)
class Document:
    doc_id: str
    source_doc_id: str
    data_src: str
    domain: str
    text: str
    metadata: str  # JSON object as a string
    file: str
    row: int
    id_missing: bool = False  # the record had no id (input.id_field): doc_id is "<file stem>:<row>"

    @property
    def source(self) -> str:
        """"<file name>:<row>", for messages and the chunk metadata."""
        return f"{Path(self.file).name}:{self.row}"


@dataclass(slots=True)
class Reject:
    file: str
    row: int
    doc_id: str | None
    field: str
    reason: str
    detail: str


class _NotUtf8(NamedTuple):
    """A Parquet string value whose bytes are not UTF-8 (Parquet writers need not check): its row is rejected."""

    byte: int


def _column_values(column: pa.ChunkedArray | pa.Array) -> list:
    """A column as Python values; one value that is not UTF-8 becomes _NotUtf8, instead of failing the whole shard."""
    try:
        return column.to_pylist()
    except UnicodeDecodeError:
        values = []
        for scalar in column:
            try:
                values.append(scalar.as_py())
            except UnicodeDecodeError as e:
                values.append(_NotUtf8(e.start))
        return values


def _unwritable(value) -> tuple[str, str] | None:
    """(reason, detail) when ``value`` (a string or any JSON value) holds text that UTF-8, and so Arrow and Parquet,
    cannot write, else None. Python strings can hold lone surrogates, e.g. the JSON escape "\\ud83d" (half an emoji,
    common in web crawls), which no UTF-8 encoder accepts."""
    if isinstance(value, _NotUtf8):
        return "invalid_utf8", f"byte {value.byte} of the value is not UTF-8"
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        where = "" if isinstance(value, str) else " of its JSON"
        return "invalid_unicode", f"lone surrogate {text[e.start]!r} at character {e.start}{where} (not valid Unicode)"
    return None


def _printable(name: str) -> str:
    """``name`` with what UTF-8 cannot encode escaped (a file name that is not UTF-8 reaches Python as surrogates)."""
    return name.encode("utf-8", "backslashreplace").decode("utf-8")


@dataclass(slots=True)
class ShardSpec:
    file: str
    start: int  # first row / line / file index (inclusive)
    stop: int  # exclusive


# --- discovery ---------------------------------------------------------------------------------


def _format_of(path: Path, fmt: str) -> str:
    if fmt != "auto":
        return fmt
    name = path.name.lower()
    if name.endswith(".parquet"):
        return "parquet"
    if name.endswith(JSONL_SUFFIXES):
        return "jsonl"
    if name.endswith(TEXT_SUFFIXES):
        return "text"
    raise InputError(f"{path}: cannot tell the format from the name; set input.format (parquet, jsonl or text)")


def list_input_files(cfg: InputConfig) -> tuple[str, list[Path]]:
    """The input files, sorted, and their common format."""
    if not cfg.path:
        raise InputError("no input: set input.path in the config or pass --input PATH")
    root = Path(cfg.path)
    if root.is_dir():
        known = (".parquet", *JSONL_SUFFIXES, *TEXT_SUFFIXES)
        files = sorted(p for p in root.rglob("*") if p.is_file() and p.name.lower().endswith(known))
        formats = {_format_of(p, cfg.format) for p in files}
        if len(formats) > 1:
            raise InputError(f"{root}: mixes {sorted(formats)} files; set input.format to choose one")
    else:
        files = [root] if root.exists() else sorted(Path(p) for p in glob.glob(str(root)))
    if not files:
        raise InputError(f"input not found: {root}" if not root.exists() else f"{root}: no input files in it")
    return _format_of(files[0], cfg.format), files


# --- planning ----------------------------------------------------------------------------------


def _open_text(path: Path) -> io.BufferedReader:
    name = path.name.lower()
    if name.endswith(".gz"):
        return gzip.open(path, "rb")
    if name.endswith(".zst"):
        return zstandard.ZstdDecompressor().stream_reader(open(path, "rb"), read_across_frames=True)
    return open(path, "rb")


def _iter_lines(path: Path) -> Iterator[bytes]:
    with _open_text(path) as raw:
        try:
            yield from io.BufferedReader(raw) if not isinstance(raw, io.BufferedReader) else raw
        except (OSError, EOFError, zlib.error, zstandard.ZstdError) as e:  # truncated or corrupt .gz / .zst
            raise InputError(f"{path}: cannot decompress ({e}); is the file truncated?") from e


def _parquet_file(path: Path) -> pq.ParquetFile:
    try:
        return pq.ParquetFile(path)
    except (pa.ArrowInvalid, OSError) as e:
        raise InputError(f"{path}: not a readable Parquet file ({e}); is it corrupt or truncated?") from e


def _check_parquet_columns(path: Path, pf: pq.ParquetFile, cfg: InputConfig) -> None:
    names = pf.schema_arrow.names
    if cfg.text_field not in names:
        raise InputError(
            f"{path}: no text column '{cfg.text_field}'; available columns: {', '.join(names)}. "
            f"Set input.text_field to the column that holds the text."
        )
    missing = [c for c in cfg.metadata_fields if c not in names]
    if missing:
        raise InputError(f"{path}: metadata column(s) {missing} not found; available columns: {', '.join(names)}")


def _ids_of_file(path: Path, fmt: str, cfg: InputConfig) -> Iterator[tuple[int, str]]:
    """(row, id) for every record that has an id, used to find duplicates across the input."""
    if fmt == "text" or not cfg.id_field:
        return
    if fmt == "parquet":
        pf = _parquet_file(path)
        if cfg.id_field not in pf.schema_arrow.names:
            return
        row = 0
        for batch in pf.iter_batches(columns=[cfg.id_field], batch_size=65_536):
            for value in _column_values(batch.column(0)):
                if value is not None and not isinstance(value, _NotUtf8):  # _NotUtf8: the row is rejected
                    yield row, str(value)
                row += 1
        return
    for row, line in enumerate(_iter_lines(path)):
        try:
            value = json.loads(line).get(cfg.id_field)
        except (ValueError, AttributeError):
            continue
        if value is not None:
            yield row, str(value)


def _count_rows(path: Path, fmt: str, cfg: InputConfig) -> int:
    if fmt == "parquet":
        pf = _parquet_file(path)
        _check_parquet_columns(path, pf, cfg)
        return pf.metadata.num_rows
    return sum(1 for _ in _iter_lines(path))


def plan_shards(cfg: InputConfig) -> dict:
    """Cut the input into shards and find duplicate ids. The result is JSON (stored in the run)."""
    fmt, files = list_input_files(cfg)
    shards: list[ShardSpec] = []
    if fmt == "text":
        root = Path(cfg.path) if Path(cfg.path).is_dir() else files[0].parent
        for start in range(0, len(files), cfg.docs_per_shard):
            shards.append(ShardSpec(str(root), start, min(start + cfg.docs_per_shard, len(files))))
        return {"format": fmt, "files": [str(p) for p in files], "shards": [asdict(s) for s in shards],
                "duplicates": {}}

    first_seen: dict[str, str] = {}
    duplicates: dict[str, str] = {}  # id -> position of its first occurrence
    for path in files:
        n = _count_rows(path, fmt, cfg)
        per = math.ceil(n / max(1, math.ceil(n / cfg.docs_per_shard))) if n else 0
        for start in range(0, n, per or 1):
            shards.append(ShardSpec(str(path), start, min(start + per, n)))
        for row, doc_id in _ids_of_file(path, fmt, cfg):
            where = f"{path.name}:{row}"
            if doc_id in first_seen:
                duplicates.setdefault(doc_id, first_seen[doc_id])
            else:
                first_seen[doc_id] = where
    if not shards:
        raise InputError(f"{cfg.path}: no records in {', '.join(p.name for p in files)} (empty file(s)); "
                         "nothing to process")
    return {"format": fmt, "files": [str(p) for p in files], "shards": [asdict(s) for s in shards],
            "duplicates": duplicates}


# --- reading -----------------------------------------------------------------------------------


def _records_parquet(spec: ShardSpec, cfg: InputConfig) -> Iterator[tuple[int, dict | None, str | None]]:
    """(row, record, problem) for rows [start, stop) of a Parquet file, reading only the row groups needed."""
    path = Path(spec.file)
    pf = _parquet_file(path)
    _check_parquet_columns(path, pf, cfg)
    wanted = [c for c in {cfg.text_field, cfg.id_field, cfg.domain_field, cfg.data_src_field, *cfg.metadata_fields}
              if c]
    columns = [c for c in wanted if c in pf.schema_arrow.names]
    row0 = 0
    for rg in range(pf.num_row_groups):
        n = pf.metadata.row_group(rg).num_rows
        lo, hi = max(spec.start, row0), min(spec.stop, row0 + n)
        if lo < hi:
            try:
                table = pf.read_row_group(rg, columns=columns).slice(lo - row0, hi - lo)
            except (pa.ArrowInvalid, OSError) as e:
                raise InputError(f"{path}: row group {rg} is unreadable ({e}); is the file corrupt?") from e
            values = {name: _column_values(table.column(name)) for name in table.column_names}
            for i, record in enumerate(dict(zip(values, row)) for row in zip(*values.values())):
                yield lo + i, record, None
        row0 += n
        if row0 >= spec.stop:
            break


def _records_jsonl(spec: ShardSpec, cfg: InputConfig) -> Iterator[tuple[int, dict | None, str | None]]:
    for row, line in enumerate(_iter_lines(Path(spec.file))):
        if row < spec.start:
            continue
        if row >= spec.stop:
            break
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError as e:
            yield row, None, f"invalid_utf8: byte {e.start} of the line ({line[max(0, e.start - 10):e.start + 10]!r})"
            continue
        if not text.strip():
            yield row, None, "empty_line: blank line"
            continue
        try:
            record = json.loads(text)
        except json.JSONDecodeError as e:
            yield row, None, f"invalid_json: {e.msg} at column {e.colno}"
            continue
        if not isinstance(record, dict):
            yield row, None, f"invalid_json: expected an object, got {type(record).__name__}"
            continue
        yield row, record, None


def _records_text(spec: ShardSpec, files: list[str],
                  cfg: InputConfig) -> Iterator[tuple[int, dict | None, str | None]]:
    root = Path(spec.file)
    for index in range(spec.start, spec.stop):
        path = Path(files[index])
        rel = path.relative_to(root).as_posix() if path.is_relative_to(root) else path.name
        raw = path.read_bytes()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            yield index, None, f"invalid_utf8: byte {e.start} of {rel}"
            continue
        yield index, {cfg.text_field: text, "__default_id__": rel}, None


def read_shard(plan: dict, shard: int, cfg: InputConfig) -> Iterator[Document | Reject]:
    """Documents of one shard, and a Reject for each record that cannot be used."""
    spec = ShardSpec(**plan["shards"][shard])
    fmt = plan["format"]
    duplicates = plan["duplicates"]
    if fmt == "parquet":
        records = _records_parquet(spec, cfg)
    elif fmt == "jsonl":
        records = _records_jsonl(spec, cfg)
    else:
        records = _records_text(spec, plan["files"], cfg)
    file, file_name = _printable(spec.file), Path(spec.file).name
    for row, record, problem in records:
        where = f"{file_name}:{row}"
        if problem is not None:
            reason, _, detail = problem.partition(": ")
            yield Reject(file, row, None, "(record)", reason, _printable(detail))
            continue
        raw_id = record.get(cfg.id_field) if cfg.id_field else None
        source_id = (str(raw_id) if raw_id is not None
                     else record.get("__default_id__", f"{Path(file_name).stem}:{row}"))
        doc_id = source_id
        if source_id in duplicates and duplicates[source_id] != where:
            doc_id = f"{source_id}@{where}"
        shown_id = _printable(doc_id)  # only an id made from a file name can change: record values are checked below
        if cfg.text_field not in record:
            yield Reject(file, row, shown_id, cfg.text_field, "missing_field", f"no '{cfg.text_field}' field")
            continue
        text = record[cfg.text_field]
        domain = record.get(cfg.domain_field) if cfg.domain_field else None
        data_src = record.get(cfg.data_src_field) if cfg.data_src_field else None
        metadata = {k: record.get(k) for k in cfg.metadata_fields if k in record}
        # Text that Python holds but UTF-8 cannot write would fail the whole shard at its write, on every rerun.
        fields = {cfg.text_field: text, cfg.id_field: raw_id, cfg.domain_field: domain, cfg.data_src_field: data_src,
                  **metadata}
        bad = next(((field, why) for field, value in fields.items()
                    if field and value is not None and (why := _unwritable(value))), None)
        if bad:
            field, (reason, detail) = bad
            yield Reject(file, row, None if field == cfg.id_field else shown_id, field, reason, detail)
            continue
        if text is None:
            yield Reject(file, row, shown_id, cfg.text_field, "null_text", "text is null")
            continue
        if not isinstance(text, str):
            yield Reject(file, row, shown_id, cfg.text_field, "non_string_text", f"text is {type(text).__name__}")
            continue
        yield Document(
            doc_id=shown_id,
            source_doc_id=_printable(source_id),
            data_src=str(data_src) if data_src is not None else _printable(Path(file_name).stem.split(".")[0]),
            domain=str(domain) if domain else cfg.default_domain,
            text=text,
            metadata=json.dumps(metadata, sort_keys=True, default=str, ensure_ascii=False),
            file=file,
            row=row,
            id_missing=bool(cfg.id_field) and raw_id is None,
        )
