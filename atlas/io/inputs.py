"""Input readers: Parquet, JSONL (plain, .gz, .zst) and folders of .txt/.md files.

Reading happens in two steps so that one huge file still parallelizes:

1. ``plan_shards`` lists the input files and cuts them into shards of about
   ``input.docs_per_shard`` documents (row ranges for Parquet, line ranges for JSONL, file ranges
   for text folders). It reads each file once, streaming: a plain JSONL shard records the byte
   offset of its first line, so that reading it starts there. It also finds duplicate document ids
   across the whole input, out of core (below).
2. ``read_shard`` yields the documents of one shard, and a ``Reject`` (file, row, field, reason)
   for every record that cannot be used. Bad records never stop the run.

Ids are unique across the whole input, whatever the files are called. A record without an id gets
``<file stem>:<row>``. The first occurrence of an id (in file order, then row order) keeps it; every later
one becomes ``<id>@<file's path in the input>:<row>``, unique and the same however the input is sharded,
and the original id stays in ``source_doc_id``. Generated ids take part (two folders' ``data.jsonl`` both
have ``data:0``; an explicit id may equal a generated one); a new name that is some other record's own id
is an error naming both records. Planning spills every (id, position) to a Parquet file and DuckDB finds
the later occurrences within ``execution.memory_gb``; their positions, sorted, go to ``_renames.parquet``
beside the plan, and each shard reads only its own range of it. The plan records each file's version
(size and time, or the store's tag): a file changed after planning is an error when its shard is read.

Where: ``input.path`` is a local path (read with plain ``open`` and pyarrow's local files), or a URL that fsspec
reads (``s3://bucket/prefix/``, ``gs://``, ``hf://datasets/org/name/...``; each a folder, a file or a glob). Remote
files stream as local ones do: a plain JSONL shard seeks to its byte offset, a Parquet shard reads only its row
groups. Plans, rejects and messages name a remote file by its URL.
"""

from __future__ import annotations

import glob
import gzip
import hashlib
import io
import itertools
import json
import math
import os
import tempfile
import zlib
from array import array
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from pathlib import Path, PurePosixPath
from typing import NamedTuple

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import zstandard

from atlas.config import InputConfig, is_url
from atlas.core.extras import MissingExtra, require
from atlas.core.files import InputError  # noqa: F401 (defined with the other file errors; imported from here too)
from atlas.io.outofcore import PartWriter, duckdb_session, record_batches, scratch

TEXT_SUFFIXES = (".txt", ".md")
JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst", ".json.gz", ".ndjson")
INPUT_SUFFIXES = (".parquet", *JSONL_SUFFIXES, *TEXT_SUFFIXES)  # the files a folder's listing keeps
PLAN_VERSION = 3  # 3: file versions; generated ids and renames that name the file's path in the input
RENAMES = "_renames.parquet"  # beside the plan: the sorted positions of the records whose duplicate id is renamed
RENAMES_SCHEMA = pa.schema([("position", pa.int64())])
ROW_BITS = 40  # a record's position in the input is file index << ROW_BITS | row (2**40 rows a file at most)
ROW_MASK = (1 << ROW_BITS) - 1


def generated_id(name: str, row: int) -> str:
    """The id of a record without one: its file's stem and its row (``corpus:12``)."""
    return f"{Path(PurePosixPath(name).name).stem}:{row}"


def renamed_id(doc_id: str, name: str, row: int) -> str:
    """The id of a record whose id an earlier record has: unique, as it holds the file's name within the input."""
    return f"{doc_id}@{name}:{row}"


def input_names(files: list[str]) -> list[str]:
    """Each input file's name within the input: its path below the files' common folder (``a/data.jsonl``), so
    files of the same name in two folders have two names. A single file: its name."""
    paths = [PurePosixPath(f.split("://", 1)[1]) if is_url(f) else PurePosixPath(Path(f).as_posix()) for f in files]
    base = PurePosixPath(os.path.commonpath([str(p) for p in paths])) if len(paths) > 1 else paths[0].parent
    return [p.relative_to(base).as_posix() for p in paths]


def _where(names: list[str], position: int) -> str:
    return f"{names[position >> ROW_BITS]}:{position & ROW_MASK}"


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
    offset: int | None = None  # plain JSONL: the byte offset of line ``start``


# --- remote files: URLs read through fsspec --------------------------------------------------------------------

# Keys of fsspec's info() that tell one version of a remote file from another. A checksum or ETag first: an identical
# re-upload keeps it, as an identical local copy keeps its sha256. Else a version id or a modification time.
CONTENT_TAGS = ("ETag", "etag", "md5Hash", "crc32c", "blob_id", "Content-MD5", "Digest")
VERSION_TAGS = ("VersionId", "generation", "LastModified", "last_modified", "updated", "mtime")


def filesystem(url: str, what: str = "input.path") -> tuple[fsspec.AbstractFileSystem, str]:
    """The fsspec filesystem that reads ``url``, and the path within it. ``what``: the setting that named it."""
    scheme = url.split("://", 1)[0]
    options = {}
    if scheme in ("s3", "s3a"):
        require(["s3"], f"{what} {url}")
        # S3-compatible stores (MinIO, Ceph, R2): botocore reads these variables itself since 2023, older versions not
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        if endpoint and os.environ.get("AWS_IGNORE_CONFIGURED_ENDPOINT_URLS", "").lower() != "true":
            options["endpoint_url"] = endpoint
    if scheme not in fsspec.available_protocols():
        raise InputError(f"{url}: unknown URL scheme '{scheme}://'; {what} is a local path, or a URL of a scheme "
                         f"fsspec knows: {', '.join(sorted(fsspec.available_protocols()))}")
    try:
        return fsspec.core.url_to_fs(url, **options)
    except ImportError as e:  # fsspec knows the scheme, but the package that implements it is not installed
        raise MissingExtra(f"{what} {url}: reading {scheme}:// needs a package that is not installed: {e}") from None


def _list_url(url: str, cfg: InputConfig) -> list[str]:
    """The input files of a URL (a folder, a file or a glob) as URLs, in the order the same local files would have."""
    fs, root = filesystem(url)
    fs.invalidate_cache()  # a listing cached by an earlier run in this process would hide a changed file
    try:
        folder = fs.isdir(root)
        if folder:
            found = [p for p in fs.find(root) if PurePosixPath(p).name.lower().endswith(INPUT_SUFFIXES)]
        elif glob.has_magic(root):
            found = [p for p, info in fs.glob(root, detail=True).items() if info["type"] == "file"]
        else:
            fs.info(root)  # its FileNotFoundError says what is missing: the file, or the bucket
            found = [root]
    except FileNotFoundError as e:
        why = "" if root in str(e) else f" ({e})"  # s3fs: "The specified bucket does not exist"
        raise InputError(f"input not found: {url}{why}") from None
    except PermissionError as e:
        raise InputError(f"{url}: access denied ({e}); check the credentials (for S3: AWS_ACCESS_KEY_ID and "
                         "AWS_SECRET_ACCESS_KEY, AWS_PROFILE or ~/.aws/credentials)") from None
    except Exception as e:  # an unreachable store: no network, a wrong endpoint (botocore's errors are no OSError)
        raise InputError(f"{url}: cannot list the input ({type(e).__name__}: {e})") from e
    if not found:
        raise InputError(f"{url}: no input files in it" if folder else f"input not found: {url}")
    if folder:
        _check_one_format(url, found, cfg)
    return [fs.unstrip_protocol(p) for p in sorted(found, key=PurePosixPath)]


def _open_binary(path: str, **options):
    """A local file opened with plain ``open``; a URL through fsspec (its files seek). ``options``: fsspec's."""
    if not is_url(path):
        return open(path, "rb")
    fs, inner = filesystem(path)
    return fs.open(inner, "rb", **options)


def _read_bytes(path: str) -> bytes:
    if not is_url(path):
        return Path(path).read_bytes()
    fs, inner = filesystem(path)
    return fs.cat_file(inner)


def url_fingerprint(url: str) -> dict:
    """Identity of a remote input file, for the chunk stage's hash, without reading it: its size and the checksum,
    ETag, version or modification time that its store gives (see CONTENT_TAGS); a store that gives none has the
    file's bytes hashed, as a local file's are."""
    fs, inner = filesystem(url)
    info = fs.info(inner)
    for key in (*CONTENT_TAGS, *VERSION_TAGS):
        if info.get(key):
            return {"size": info["size"], key: str(info[key])}
    with fs.open(inner, "rb") as f:
        return {"size": info["size"], "sha256": hashlib.file_digest(f, "sha256").hexdigest()}


# --- discovery ---------------------------------------------------------------------------------


def _format_of(path: str, fmt: str) -> str:
    if fmt != "auto":
        return fmt
    name = PurePosixPath(path).name.lower()
    if name.endswith(".parquet"):
        return "parquet"
    if name.endswith(JSONL_SUFFIXES):
        return "jsonl"
    if name.endswith(TEXT_SUFFIXES):
        return "text"
    raise InputError(f"{path}: cannot tell the format from the name; set input.format (parquet, jsonl or text)")


def _check_one_format(where, files: list, cfg: InputConfig) -> None:
    formats = {_format_of(str(p), cfg.format) for p in files}
    if len(formats) > 1:
        raise InputError(f"{where}: mixes {sorted(formats)} files; set input.format to choose one")


def _list_local(cfg: InputConfig) -> list[str]:
    root = Path(cfg.path)
    if root.is_dir():
        files = sorted(p for p in root.rglob("*") if p.is_file() and p.name.lower().endswith(INPUT_SUFFIXES))
        _check_one_format(root, files, cfg)
    else:
        files = [root] if root.exists() else sorted(Path(p) for p in glob.glob(str(root)))
    if not files:
        raise InputError(f"input not found: {root}" if not root.exists() else f"{root}: no input files in it")
    return [str(p) for p in files]


def list_input_files(cfg: InputConfig) -> tuple[str, list[str]]:
    """The input files (local paths, or URLs when input.path is one), sorted, and their common format."""
    if not cfg.path:
        raise InputError("no input: set input.path in the config or pass --input PATH")
    files = _list_url(cfg.path, cfg) if is_url(cfg.path) else _list_local(cfg)
    return _format_of(files[0], cfg.format), files


# --- planning ----------------------------------------------------------------------------------


def _is_compressed(path: str) -> bool:
    return path.lower().endswith((".gz", ".zst"))


def _open_text(path: str, stack: ExitStack) -> io.IOBase:
    """The bytes of a JSONL file, decompressed; ``stack`` closes it and the file under it."""
    raw = stack.enter_context(_open_binary(path))
    name = path.lower()
    if name.endswith(".gz"):
        return stack.enter_context(gzip.GzipFile(fileobj=raw, mode="rb"))
    if name.endswith(".zst"):
        return stack.enter_context(io.BufferedReader(_ZstdFrames(raw, path)))
    return raw


class _ZstdFrames(io.RawIOBase):
    """The decompressed bytes of a .zst file, frame after frame. A file cut inside a frame is an InputError at its
    end: zstandard's own stream reader ends there quietly, as if the file were whole."""

    READ = 1 << 18  # compressed bytes read at a time

    def __init__(self, raw, path: str):
        self.raw, self.path = raw, path
        self.context = zstandard.ZstdDecompressor()
        self.frame = self.context.decompressobj()
        self.in_frame = False  # bytes of the current frame were read, and its end not yet
        self.out, self.at = b"", 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        while self.at == len(self.out):
            data = self.raw.read(self.READ)
            if not data:
                if self.in_frame:
                    raise InputError(f"{self.path}: truncated: the file ends inside a zstd frame (an interrupted "
                                     "download or copy?); restore the whole file")
                return 0
            self.out, self.at = b"", 0
            while data:
                if self.frame.eof:  # the next frame of a multi-frame file
                    self.frame = self.context.decompressobj()
                self.out += self.frame.decompress(data)
                self.in_frame = not self.frame.eof
                data = self.frame.unused_data if self.frame.eof else b""
        n = min(len(buffer), len(self.out) - self.at)
        buffer[:n] = self.out[self.at : self.at + n]
        self.at += n
        return n


def _iter_lines(path: str, offset: int = 0) -> Iterator[bytes]:
    """The lines of a JSONL file; a plain one from byte ``offset`` on."""
    with ExitStack() as stack:
        raw = _open_text(path, stack)
        if offset:
            raw.seek(offset)
        try:
            yield from io.BufferedReader(raw) if not isinstance(raw, io.BufferedReader) else raw
        except (OSError, EOFError, zlib.error, zstandard.ZstdError) as e:  # truncated or corrupt .gz / .zst
            raise InputError(f"{path}: cannot decompress ({e}); is the file truncated?") from e


def _parquet_file(path: str) -> pq.ParquetFile:
    # A remote file without read-ahead: pyarrow asks for the footer, then for the column chunks of the row groups it
    # reads, which pre_buffer joins into few requests.
    source = _open_binary(path, cache_type="none") if is_url(path) else path
    try:
        return pq.ParquetFile(source, pre_buffer=is_url(path))
    except (pa.ArrowInvalid, OSError) as e:
        raise InputError(f"{path}: not a readable Parquet file ({e}); is it corrupt or truncated?") from e


def _check_parquet_columns(path: str, pf: pq.ParquetFile, cfg: InputConfig) -> None:
    names = pf.schema_arrow.names
    if cfg.text_field not in names:
        raise InputError(
            f"{path}: no text column '{cfg.text_field}'; available columns: {', '.join(names)}. "
            f"Set input.text_field to the column that holds the text."
        )
    missing = [c for c in cfg.metadata_fields if c not in names]
    if missing:
        raise InputError(f"{path}: metadata column(s) {missing} not found; available columns: {', '.join(names)}")


class _IdSpill:
    """The (id, position) of every record that has an id, written to a Parquet file one batch at a time; then the
    records whose id an earlier one has, found out of core."""

    BATCH = 65_536
    SCHEMA = pa.schema([("id", pa.string()), ("position", pa.int64())])

    def __init__(self, folder: Path):
        self.path = folder / "ids.parquet"
        self.writer = pq.ParquetWriter(self.path, self.SCHEMA)
        self.ids: list[str] = []
        self.positions: list[int] = []

    def add(self, doc_id: str, file_index: int, row: int) -> None:
        self.ids.append(doc_id)
        self.positions.append(file_index << ROW_BITS | row)
        if len(self.ids) == self.BATCH:
            self._flush()

    def _flush(self) -> None:
        if not self.ids:
            return
        try:
            ids = pa.array(self.ids, pa.string())
        except (UnicodeEncodeError, pa.ArrowInvalid):  # ids UTF-8 cannot write are rejected when read: leave them out
            keep = [i for i, doc_id in enumerate(self.ids) if _unwritable(doc_id) is None]
            ids, self.positions = pa.array([self.ids[i] for i in keep], pa.string()), [self.positions[i] for i in keep]
        self.writer.write_table(pa.table([ids, pa.array(self.positions, pa.int64())], schema=self.SCHEMA))
        self.ids, self.positions = [], []

    def write_renames(self, path: Path, memory_gb: float, names: list[str]) -> int:
        """Write the sorted positions of the records whose id an earlier record has to ``path``; their number.
        ``names``: each file's name within the input, which renamed ids hold (``renamed_id``). A renamed id that
        another record has as its own is an InputError naming both: ids stay unique, or the input is refused."""
        self._flush()
        self.writer.close()
        later = """SELECT s.id, s.position FROM read_parquet(?) s
                   JOIN (SELECT id, min(position) AS first FROM read_parquet(?) GROUP BY id HAVING count(*) > 1) d
                   ON s.id = d.id WHERE s.position <> d.first ORDER BY s.position"""
        renamed = self.path.with_name("renamed.parquet")
        with duckdb_session(self.path.parent, memory_gb) as con:
            with PartWriter(path, RENAMES_SCHEMA) as out, PartWriter(renamed, self.SCHEMA) as new_ids:
                for batch in record_batches(con, later, [str(self.path), str(self.path)]):
                    positions = batch.column("position").to_pylist()
                    out.write(pa.table([batch.column("position")], schema=RENAMES_SCHEMA))
                    ids = [renamed_id(doc_id, names[p >> ROW_BITS], p & ROW_MASK)
                           for doc_id, p in zip(batch.column("id").to_pylist(), positions)]
                    new_ids.write(pa.table([pa.array(ids, pa.string()), batch.column("position")], schema=self.SCHEMA))
            if out.rows:
                clash = con.execute("""SELECT r.id, r.position, s.position FROM read_parquet(?) r
                                       JOIN read_parquet(?) s ON r.id = s.id ORDER BY r.position LIMIT 1""",
                                    [str(renamed), str(self.path)]).fetchone()
                if clash:
                    new_id, renamed_at, owner_at = clash
                    raise InputError(f"{_where(names, renamed_at)} repeats an earlier record's id, and its unique "
                                     f"name {new_id!r} is the id of {_where(names, owner_at)}: give one of them "
                                     f"another id (input.id_field)")
        return out.rows


def _scan_parquet(path: str, cfg: InputConfig, file_index: int, ids: _IdSpill | None) -> int:
    """The number of rows of a Parquet file, its columns checked; the id of each row goes to ``ids``."""
    pf = _parquet_file(path)
    _check_parquet_columns(path, pf, cfg)
    if ids is not None and cfg.id_field in pf.schema_arrow.names:
        row = 0
        for batch in pf.iter_batches(columns=[cfg.id_field], batch_size=65_536):
            for value in _column_values(batch.column(0)):
                if not isinstance(value, _NotUtf8):  # _NotUtf8: the row is rejected
                    ids.add(str(value) if value is not None else generated_id(path, row), file_index, row)
                row += 1
    elif ids is not None:  # no id column: every row's id is generated, and may equal another file's ids
        for row in range(pf.metadata.num_rows):
            ids.add(generated_id(path, row), file_index, row)
    return pf.metadata.num_rows


def _scan_jsonl(path: str, cfg: InputConfig, file_index: int, ids: _IdSpill | None,
                offsets_path: Path | None) -> int:
    """The number of lines of a JSONL file, in one pass that also writes the byte offset of every line to
    ``offsets_path`` (8 bytes a line, so memory does not grow with the file) and gives each record's id to ``ids``."""
    offsets, position, rows = array("q"), 0, 0
    with ExitStack() as stack:
        out = stack.enter_context(open(offsets_path, "wb")) if offsets_path else None
        for rows, line in enumerate(_iter_lines(path), start=1):
            if out is not None:
                offsets.append(position)
                position += len(line)
                if len(offsets) == 65_536:
                    offsets.tofile(out)
                    del offsets[:]
            if ids is not None:
                try:
                    value = json.loads(line).get(cfg.id_field)
                except (ValueError, AttributeError, RecursionError):  # rejected when its shard is read
                    continue
                ids.add(str(value) if value is not None else generated_id(path, rows - 1), file_index, rows - 1)
        if out is not None:
            offsets.tofile(out)
    return rows


def _text_root(path: str, files: list[str]) -> str:
    """The folder that a text input's document ids are relative to: the input folder, or the first file's."""
    if is_url(path):
        fs, inner = filesystem(path)
        return fs.unstrip_protocol(inner) if fs.isdir(inner) else files[0].rsplit("/", 1)[0]
    return str(Path(path)) if Path(path).is_dir() else str(Path(files[0]).parent)


def _cut(n: int, docs_per_shard: int) -> list[tuple[int, int]]:
    """[start, stop) ranges of about ``docs_per_shard`` of ``n`` rows, of even sizes."""
    per = math.ceil(n / max(1, math.ceil(n / docs_per_shard))) if n else 0
    return [(start, min(start + per, n)) for start in range(0, n, per or 1)]


def plan_shards(cfg: InputConfig, folder: Path | None = None, *, scratch_dir: Path | None = None,
                memory_gb: float = 1.0) -> dict:
    """Cut the input into shards and find duplicate ids, reading each file once. The result is JSON (stored in the
    run, in ``folder``).

    The positions of the records whose duplicate id is renamed go to ``folder / RENAMES``; without a ``folder``,
    duplicate ids are not looked for (enough to sample documents). Spill files go to ``scratch_dir`` (by default a
    temporary folder), which is emptied on the way in and removed on the way out. Memory: one batch of ids, the
    shard list, and at most ``memory_gb`` for the duplicate search.
    """
    fmt, files = list_input_files(cfg)
    if folder is not None:
        (folder / RENAMES).unlink(missing_ok=True)  # an earlier plan's
    shards: list[ShardSpec] = []
    if fmt == "text":
        root = _text_root(cfg.path, files)
        for start in range(0, len(files), cfg.docs_per_shard):
            shards.append(ShardSpec(root, start, min(start + cfg.docs_per_shard, len(files))))
        return {"version": PLAN_VERSION, "format": fmt, "files": files, "versions": [file_version(f) for f in files],
                "shards": [asdict(s) for s in shards], "renamed": 0}

    with ExitStack() as stack:
        spill = Path(stack.enter_context(scratch(scratch_dir) if scratch_dir else tempfile.TemporaryDirectory()))
        ids = _IdSpill(spill) if folder is not None else None
        for file_index, path in enumerate(files):
            if fmt == "parquet":
                ranges = _cut(_scan_parquet(path, cfg, file_index, ids), cfg.docs_per_shard)
                shards += [ShardSpec(path, start, stop) for start, stop in ranges]
                continue
            offsets_path = None if _is_compressed(path) else spill / "offsets.bin"  # compressed: no seeking
            ranges = _cut(_scan_jsonl(path, cfg, file_index, ids, offsets_path), cfg.docs_per_shard)
            if offsets_path and ranges:
                offsets = np.memmap(offsets_path, dtype=np.int64, mode="r")
                shards += [ShardSpec(path, start, stop, int(offsets[start])) for start, stop in ranges]
                del offsets
            else:
                shards += [ShardSpec(path, start, stop) for start, stop in ranges]
        if not shards:
            names = ", ".join(PurePosixPath(p).name for p in files)
            raise InputError(f"{cfg.path}: no records in {names} (empty file(s)); nothing to process")
        renamed = ids.write_renames(folder / RENAMES, memory_gb, input_names(files)) if ids is not None else 0
    return {"version": PLAN_VERSION, "format": fmt, "files": files, "versions": [file_version(f) for f in files],
            "shards": [asdict(s) for s in shards], "renamed": renamed}


# --- reading -----------------------------------------------------------------------------------


def _records_parquet(spec: ShardSpec, cfg: InputConfig) -> Iterator[tuple[int, dict | None, str | None]]:
    """(row, record, problem) for rows [start, stop) of a Parquet file, reading only the row groups needed."""
    path = spec.file
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
    if spec.offset is not None:  # a plain file: read from the shard's first line on
        lines = _iter_lines(spec.file, spec.offset)
    else:  # a compressed one is decompressed from its start
        lines = itertools.islice(_iter_lines(spec.file), spec.start, None)
    for row, line in zip(range(spec.start, spec.stop), lines):
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
        except (ValueError, RecursionError) as e:  # an integer of over 4,300 digits; nesting deeper than the stack
            why = "nested too deeply" if isinstance(e, RecursionError) else str(e).split(";")[0]
            yield row, None, f"invalid_json: {why}"
            continue
        if not isinstance(record, dict):
            yield row, None, f"invalid_json: expected an object, got {type(record).__name__}"
            continue
        yield row, record, None


def _records_text(spec: ShardSpec, files: list[str],
                  cfg: InputConfig) -> Iterator[tuple[int, dict | None, str | None]]:
    root = PurePosixPath(spec.file)  # a local folder or a URL: both are /-separated
    for index in range(spec.start, spec.stop):
        path = PurePosixPath(files[index])
        rel = path.relative_to(root).as_posix() if path.is_relative_to(root) else path.name
        raw = _read_bytes(files[index])
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            yield index, None, f"invalid_utf8: byte {e.start} of {rel}"
            continue
        yield index, {cfg.text_field: text, "__default_id__": rel}, None


def _renamed_rows(plan: dict, spec: ShardSpec, folder: Path | None) -> set[int]:
    """The rows of a shard whose id an earlier record has (read from the plan's RENAMES, this shard's range only)."""
    if not plan.get("renamed"):
        return set()
    if folder is None:
        raise ValueError("the plan renames duplicate ids: read_shard needs the plan's folder")
    base = plan["files"].index(spec.file) << ROW_BITS
    table = pq.read_table(folder / RENAMES, columns=["position"],
                          filters=[("position", ">=", base + spec.start), ("position", "<", base + spec.stop)])
    return {position - base for position in table.column(0).to_pylist()}


def file_version(path: str) -> dict:
    """What tells this version of an input file from a later one, cheaply: a local file's size and modification
    time; a remote file's size and its store's tag (``url_fingerprint``)."""
    if is_url(path):
        return url_fingerprint(path)
    stat = os.stat(path)
    return {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def check_unchanged(plan: dict, spec: ShardSpec) -> None:
    """An input file replaced or edited after the plan cut it into shards would give some documents twice and lose
    others: an InputError that names it (the plan is made again with --force)."""
    if "versions" not in plan:  # a plan of an older Atlas: nothing to compare with
        return
    files = plan["files"]
    indices = range(spec.start, spec.stop) if plan["format"] == "text" else [files.index(spec.file)]
    for i in indices:
        try:
            now = file_version(files[i])
        except FileNotFoundError:
            now = None
        if now != plan["versions"][i]:
            what = "is gone" if now is None else "has changed"
            raise InputError(f"{_printable(files[i])}: {what} since the run planned its shards (size, time or "
                             f"version differs from the plan's), so its shards would no longer match; restore it, "
                             f"or re-plan the input with --force --stages chunk")


def read_shard(plan: dict, shard: int, cfg: InputConfig, folder: Path | None = None) -> Iterator[Document | Reject]:
    """Documents of one shard, and a Reject for each record that cannot be used (``folder``: the plan's)."""
    spec = ShardSpec(**plan["shards"][shard])
    fmt = plan["format"]
    renamed = _renamed_rows(plan, spec, folder)
    if fmt == "parquet":
        records = _records_parquet(spec, cfg)
    elif fmt == "jsonl":
        records = _records_jsonl(spec, cfg)
    else:
        records = _records_text(spec, plan["files"], cfg)
    check_unchanged(plan, spec)
    names = input_names(plan["files"])
    file, file_name = _printable(spec.file), Path(spec.file).name
    name = names[plan["files"].index(spec.file)] if fmt != "text" else file_name
    for row, record, problem in records:
        if problem is not None:
            reason, _, detail = problem.partition(": ")
            yield Reject(file, row, None, "(record)", reason, _printable(detail))
            continue
        raw_id = record.get(cfg.id_field) if cfg.id_field else None
        source_id = str(raw_id) if raw_id is not None else record.get("__default_id__", generated_id(file_name, row))
        doc_id = renamed_id(source_id, name, row) if row in renamed else source_id
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
