"""Stage ``chunk`` (map): documents -> token-bounded chunks (paper 4.2.1 and 4.5.1).

Prose is split into sentences with BlingFire; consecutive sentences are joined until the next one
would pass the domain's token threshold (150 tokens for web/general/academic/QA, 256 for math and
code by default). A sentence longer than the threshold stays a chunk of its own; one longer than
``max_sentence_tokens`` (50,000) is dropped and counted.

Source code is split differently, because sentence splitters cut code mid-statement: blocks
separated by blank lines are joined up to the threshold; a block longer than the threshold is cut
between lines; a single line longer than the threshold stays whole.

Each chunk's text is exactly ``text[char_start:char_end]`` of its document (Python string
offsets), and only whitespace between chunks is left out. Packing decisions use one cl100k_base
pass over the whole document (every token is given to the sentence or line in which it ends).
``n_tokens`` is then, by default, the exact length of ``encode_ordinary(chunk_text)``, the count
the tokenize stage will see; only the few characters before the first and after the last safe
pre-token boundary of each chunk are encoded again (see ``Chunker._count_exactly``). With
``chunk.exact_token_counts: false`` it is the in-context count of the first pass, which differs
by one token in about one chunk in ten (measured on the dev corpus).
"""

from __future__ import annotations

import ctypes
import json
import os
import threading
from bisect import bisect_left, bisect_right
from dataclasses import asdict, dataclass
from pathlib import Path, PurePosixPath

import numpy as np
import pyarrow as pa

from atlas.config import ChunkDomain, is_url
from atlas.core.files import (
    ArtifactError,
    InputError,
    atomic_write_json,
    atomic_write_parquet,
    file_fingerprint,
    read_json,
)
from atlas.core.rundir import RunDir
from atlas.core.stage import Stage
from atlas.core.stats import Stats
from atlas.io import layout
from atlas.io.chunks import CHUNK_SCHEMA
from atlas.io.inputs import (
    PLAN_VERSION,
    Document,
    Reject,
    file_version,
    list_input_files,
    plan_shards,
    read_shard,
    url_fingerprint,
)
from atlas.io.outofcore import duckdb_session, scratch

CHUNKER_VERSION = 2  # bump when the algorithm changes, so finished runs are recomputed

REJECT_SCHEMA = pa.schema(
    [
        ("file", pa.string()),
        ("row", pa.int64()),
        ("doc_id", pa.string()),
        ("field", pa.string()),
        ("reason", pa.string()),
        ("detail", pa.string()),
    ]
)


# --- splitting ---------------------------------------------------------------------------------


class _BlingFire:
    """Direct call into BlingFire's sentence splitter, returning UTF-8 byte offsets.

    blingfire's Python wrapper maps offsets to characters with a per-byte Python loop, which
    costs more than the split itself; we keep byte offsets and map them with numpy instead.
    Each thread keeps its output buffers from one text to the next (texts up to ``KEEP`` bytes):
    allocating them for every text costs about a tenth of the split.
    """

    KEEP = 1 << 20

    def __init__(self):
        import blingfire

        self.fn = blingfire.blingfire.TextToSentencesWithOffsets
        self.fn.restype = ctypes.c_int
        self.fn.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                            ctypes.c_int]
        self.kept = threading.local()  # the threads of a worker share one Chunker

    @staticmethod
    def _buffers(capacity: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[int]]:
        """The output buffers (the sentences joined by newlines, their starts, their ends) and their addresses."""
        out = np.empty(capacity, dtype=np.uint8)
        starts, ends = np.empty(capacity, dtype=np.int32), np.empty(capacity, dtype=np.int32)
        return out, starts, ends, [out.ctypes.data, starts.ctypes.data, ends.ctypes.data]

    def spans(self, data: bytes) -> tuple[np.ndarray, np.ndarray] | None:
        n = len(data)
        cap = 2 * n + 1  # the library's own wrapper sizes its buffers this way
        if n > self.KEEP:
            buffers = self._buffers(cap)
        elif (buffers := getattr(self.kept, "buffers", None)) is None:
            buffers = self.kept.buffers = self._buffers(2 * self.KEEP + 1)
        _, starts, ends, addresses = buffers
        written = self.fn(data, n, *addresses, cap)
        if written < 0 or written > cap:
            return None
        count = ctypes.string_at(addresses[0], max(written - 1, 0)).count(b"\n") + 1  # of sentences
        return starts[:count].astype(np.int64), ends[:count].astype(np.int64) + 1  # copies; end: exclusive


# Both splitters see every line terminator str.splitlines knows as b"\n", at the same byte offsets: \r, \v, \f and
# \x1c-\x1e become b"\n"; the multi-byte ones keep their length, padded before the b"\n" (\r\n -> b" \n", U+0085 ->
# b" \n", U+2028 and U+2029 -> b"  \n") so that the next line still starts on a character. A line's span may then end
# inside the terminator's character, which is whitespace and trimmed from the chunk.
_ONE_BYTE_BREAKS = bytes.maketrans(b"\r\v\f\x1c\x1d\x1e", b"\n" * 6)
_MULTI_BYTE_BREAKS = ((b"\r\n", b" \n"), ("\x85".encode(), b" \n"), ("\u2028".encode(), b"  \n"),
                      ("\u2029".encode(), b"  \n"))


def _unify_line_breaks(data: bytes) -> bytes:
    for old, new in _MULTI_BYTE_BREAKS[: 1 if data.isascii() else None]:
        data = data.replace(old, new)
    return data.translate(_ONE_BYTE_BREAKS)


def _line_spans(data: bytes) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Byte spans of every line (newline excluded) and whether each line is blank (``data``: unified line breaks)."""
    arr = np.frombuffer(data, dtype=np.uint8)
    newlines = np.flatnonzero(arr == 10)
    starts = np.concatenate([[0], newlines + 1])
    ends = np.concatenate([newlines, [len(data)]])
    blank = np.array([not data[s:e].strip() for s, e in zip(starts.tolist(), ends.tolist())], dtype=bool)
    return starts, ends, blank


def _pack(counts: list[int], max_tokens: int) -> list[tuple[int, int]]:
    """Greedy packing of consecutive units into [first, last) ranges of at most max_tokens.

    A unit above max_tokens becomes a range of its own.
    """
    ranges, first, total = [], 0, 0
    for i, n in enumerate(counts):
        if i > first and total + n > max_tokens:
            ranges.append((first, i))
            first, total = i, 0
        total += n
    if counts:
        ranges.append((first, len(counts)))
    return ranges


@dataclass(slots=True)
class Span:
    start: int  # string offsets in the document
    end: int
    n_tokens: int


def _starts_pretoken_table() -> np.ndarray:
    """[byte before, byte at] -> True where an ASCII letter is followed by an ASCII character that is not a letter.

    cl100k_base starts a new pre-token there in any context: a letter run ends at the first non-letter, and no other
    part of its pattern can hold a letter and reach past it.
    """
    codes = np.arange(256)
    letter = ((codes >= ord("A")) & (codes <= ord("Z"))) | ((codes >= ord("a")) & (codes <= ord("z")))
    return letter[:, None] & ((codes < 128) & ~letter)[None, :]


_STARTS_PRETOKEN = _starts_pretoken_table()


class Chunker:
    """Splits one document into chunks; holds the tokenizer and sentence splitter."""

    def __init__(self, max_sentence_tokens: int, exact_token_counts: bool = True):
        from atlas.models.tokenizer import cl100k, ordinary_to_numpy, token_byte_lengths

        self.enc = cl100k()
        self.encode_to_numpy = ordinary_to_numpy()  # the whole document's ids, without a list of ints
        self.token_lengths = token_byte_lengths()
        self.blingfire = _BlingFire()
        self.max_sentence_tokens = max_sentence_tokens
        self.exact_token_counts = exact_token_counts

    def _units(self, text: str, data: bytes,
               domain: ChunkDomain) -> tuple[list[int], list[int], list[int], list[int], np.ndarray]:
        """Units (sentences or lines) as byte starts and ends, the tokens before each unit (and after the last), the
        units where a packing group starts, and the byte end of every token of one whole-document encoding.

        Every token is given to the unit it ends in (tokens before the first unit to the first one, a blank line's
        to the line before). Sentences form one group; code lines form one group per blank-line-separated block.
        """
        if domain.splitter == "sentences":
            spans = self.blingfire.spans(_unify_line_breaks(data))
            if spans is None:  # the splitter refused the text: fall back to lines
                return self._units(text, data, ChunkDomain(max_tokens=domain.max_tokens, splitter="lines"))
            starts, ends = spans
            group_starts = [0]
        else:
            starts, ends, blank = _line_spans(_unify_line_breaks(data))
            line_numbers = np.flatnonzero(~blank)  # blank lines are not units
            starts, ends = starts[line_numbers], ends[line_numbers]
            # Code: a new block starts wherever blank lines separate two consecutive units.
            group_starts = [0, *(np.flatnonzero(np.diff(line_numbers) > 1) + 1).tolist()]
        # Array methods rather than numpy's functions: on short documents the cost per call counts.
        token_ends = self.token_lengths[self.encode_to_numpy(text)].cumsum()
        before = token_ends.searchsorted(starts, side="right").tolist()  # the tokens that end before each unit
        if before:
            before[0] = 0
        return starts.tolist(), ends.tolist(), [*before, len(token_ends)], group_starts, token_ends

    def _ranges(self, before: list[int], group_starts: list[int], splitter: str,
                max_tokens: int, stats: Stats) -> list[tuple[int, int]]:
        """The chunks as [first, last) ranges of units (``before``: tokens before each unit, then the total).

        A unit over max_sentence_tokens is dropped and ends the chunk before it. Sentences are packed greedily; code
        joins whole blocks while they fit, and a block over the threshold is cut between lines.
        """
        tokens = [b - a for a, b in zip(before, before[1:])]
        too_long = [unit for unit, n in enumerate(tokens) if n > self.max_sentence_tokens]
        ranges: list[tuple[int, int]] = []

        def flush(first: int, last: int) -> None:
            ranges.extend((first + a, first + b) for a, b in _pack(tokens[first:last], max_tokens))

        pending = 0  # units [pending, kept) wait to be joined with the ones after them (code: whole blocks)
        for start, stop in zip(group_starts, [*group_starts[1:], len(tokens)]):
            kept = start  # units [kept, stop) of this group are kept
            for unit in too_long[bisect_left(too_long, start) : bisect_left(too_long, stop)]:
                stats.inc("sentences_dropped")
                stats.inc("sentence_tokens_dropped", tokens[unit])
                flush(pending, unit)  # a dropped sentence also ends the chunk before it
                pending = kept = unit + 1
            if splitter == "lines":
                block_tokens = before[stop] - before[kept]
                if pending < kept and before[kept] - before[pending] + block_tokens > max_tokens:
                    flush(pending, kept)
                    pending = kept
                if block_tokens > max_tokens:
                    flush(kept, stop)
                    pending = stop
            else:
                flush(pending, stop)
                pending = stop
        flush(pending, len(tokens))
        return ranges

    def split(self, text: str, domain: ChunkDomain, stats: Stats) -> list[Span]:
        """Chunks of one document as character spans (start, end, n_tokens)."""
        if not text:  # BlingFire would make one sentence of it
            return []
        data = text.encode("utf-8")
        starts, ends, before, group_starts, token_ends = self._units(text, data, domain)
        char_of_byte = None  # ASCII: byte and string offsets agree
        if len(data) != len(text):
            char_of_byte = np.cumsum((np.frombuffer(data, dtype=np.uint8) & 0xC0) != 0x80) - 1
        strip_start = domain.splitter == "sentences"  # BlingFire spans can carry whitespace; code keeps its indent
        chunks = []
        for first, last in self._ranges(before, group_starts, domain.splitter, domain.max_tokens, stats):
            start, end = starts[first], ends[last - 1]
            if char_of_byte is not None:
                start, end = int(char_of_byte[start]), int(char_of_byte[end - 1]) + 1
            if strip_start and text[start].isspace():
                start = end - len(text[start:end].lstrip())
            if start < end and text[end - 1].isspace():
                end = start + len(text[start:end].rstrip())
            if start < end:
                chunks.append(Span(start, end, before[last] - before[first]))
        if self.exact_token_counts and chunks:
            self._count_exactly(text, data, chunks, token_ends, char_of_byte)
        return chunks

    def _count_exactly(self, text: str, data: bytes, chunks: list[Span], token_ends: np.ndarray,
                       char_of_byte: np.ndarray | None) -> None:
        """Set each chunk's n_tokens to len(encode_ordinary(chunk text)), reusing the whole-document tokens.

        Tokens between two points where a pre-token starts in any context (``_STARTS_PRETOKEN``) are the same whether
        the document or only the chunk is encoded, so only the head before the chunk's first such point and the tail
        after its last one are encoded again (a chunk with no such point: all of it); a head at the start of the
        document, or a tail at its end, is the same in both encodings too.
        """
        if len(chunks) == 1 and chunks[0].start == 0 and chunks[0].end == len(text):  # half the documents
            chunks[0].n_tokens = len(token_ends)  # the whole text: its tokens are the document's
            return
        codes = np.frombuffer(data, dtype=np.uint8)
        inner = token_ends[:-1]  # the points must be token ends; the document's end is none
        token_before = _STARTS_PRETOKEN[codes[inner - 1], codes[inner]].nonzero()[0]  # the one ending at each point
        points = inner[token_before]  # byte offsets
        token_before = token_before.tolist()
        if char_of_byte is None:
            points = point_chars = points.tolist()
            starts, ends = [c.start for c in chunks], [c.end for c in chunks]
        else:
            point_chars = char_of_byte[points].tolist()
            points = points.tolist()
            byte_of_char = np.append(np.flatnonzero((codes & 0xC0) != 0x80), len(data))
            starts = byte_of_char[[c.start for c in chunks]].tolist()
            ends = byte_of_char[[c.end for c in chunks]].tolist()
        encode, text_end, tokens = self.enc.encode_ordinary, len(text), len(token_ends)
        for chunk, start, end in zip(chunks, starts, ends):
            i, j = bisect_right(points, start), bisect_left(points, end) - 1  # the first and last point inside
            if i > j:
                chunk.n_tokens = len(encode(text[chunk.start : chunk.end]))
                continue
            head = token_before[i] + 1 if chunk.start == 0 else len(encode(text[chunk.start : point_chars[i]]))
            tail = (tokens - 1 - token_before[j] if chunk.end == text_end
                    else len(encode(text[point_chars[j] : chunk.end])))
            chunk.n_tokens = head + token_before[j] - token_before[i] + tail


# --- the stage ---------------------------------------------------------------------------------


class ChunkStage(Stage):
    name = "chunk"
    output = layout.CHUNKS
    _identity: dict | None = None  # once per command: the runner asks twice, and hashing a large input takes seconds
    _new_cache: dict | None = None  # input hashes that RUN/_cache/fingerprints.json lacks, written by plan()

    def identity(self) -> dict:
        if self._identity is None:
            _, files = list_input_files(self.config.input)
            self._identity = {
                "version": CHUNKER_VERSION,
                "chunk": self.config.chunk.model_dump(),
                "input": self.config.input.model_dump(exclude={"path"}),
                "files": self._fingerprints(files),
            }
        return self._identity

    def _fingerprints(self, files: list[str]) -> dict:
        """Size and sha256 of every input file by its name within the input (not its absolute path: a moved input is
        the same input), so that a conflict names the file that changed. The hashes are cached in the run directory
        (see ``file_fingerprint``); new ones are written by ``plan``, as a run that is refused writes nothing.
        Remote files (URLs) have their size and their store's ETag or version instead (see ``url_fingerprint``)."""
        paths = [PurePosixPath(f.split("://", 1)[1]) if is_url(f) else Path(f) for f in files]
        base = Path(os.path.commonpath(paths)) if len(paths) > 1 else paths[0].parent
        names = [p.relative_to(base).as_posix() for p in paths]
        if is_url(files[0]):  # nothing to cache: the store's listing gives each file's tag
            return {name: url_fingerprint(url) for name, url in zip(names, files)}
        try:
            known = read_json(self._cache_path()) if self._cache_path().is_file() else {}
        except InputError:  # a damaged cache (read_json names it) only costs a re-hash
            known = {}
        cache = dict(known)
        fingerprints = {name: file_fingerprint(p, cache) for name, p in zip(names, paths)}
        listed = {str(p.resolve()) for p in paths}
        cache = {key: entry for key, entry in cache.items() if key in listed}  # files gone from the input leave it
        self._new_cache = cache if cache != known else None
        return fingerprints

    def _cache_path(self) -> Path:
        return RunDir(self.config.run_dir).root / layout.CACHE / "fingerprints.json"

    def _plan_path(self, run: RunDir) -> Path:
        return run.output_dir(self.output) / "_plan.json"

    def plan(self, run: RunDir, stage_hash: str) -> int:
        if self._new_cache is not None:
            atomic_write_json(self._cache_path(), self._new_cache)
        path = self._plan_path(run)
        if path.exists():
            plan = read_json(path)
            if plan.get("stage_hash") == stage_hash and plan.get("version") == PLAN_VERSION:
                # The stage hash holds every file's content hash, taken by this run: a file whose time moved
                # (touched, copied) is the file the plan cut, and its shards may go on reading it.
                versions = [file_version(f) for f in plan["files"]]
                if versions != plan["versions"]:
                    atomic_write_json(path, plan | {"versions": versions})
                return len(plan["shards"])
        # An older plan is made again: the same input gives the same shards, so finished ones stay valid.
        plan = plan_shards(self.config.input, path.parent, scratch_dir=run.output_dir(layout.TMP) / self.name,
                           memory_gb=self.config.execution.memory_gb) | {"stage_hash": stage_hash}
        atomic_write_json(path, plan)  # last: the renames it names are written
        return len(plan["shards"])

    def setup(self) -> None:
        self.chunker = Chunker(self.config.chunk.max_sentence_tokens, self.config.chunk.exact_token_counts)

    def run_shard(self, run: RunDir, shard: int) -> Stats:
        plan = read_json(self._plan_path(run))
        stats = Stats()
        rows: dict[str, list] = {name: [] for name in CHUNK_SCHEMA.names}
        rejects: list[Reject] = []
        for item in read_shard(plan, shard, self.config.input, self._plan_path(run).parent):
            if isinstance(item, Reject):
                rejects.append(item)
                stats.drop(item.reason)
                continue
            stats.inc("docs_in")
            stats.inc("chars_in", len(item.text))
            if not item.text.strip():
                rejects.append(Reject(item.file, item.row, item.doc_id, self.config.input.text_field,
                                      "empty_document", "text is empty or whitespace"))
                stats.drop("empty_document")
                continue
            if item.doc_id != item.source_doc_id:
                stats.inc("duplicate_ids_renamed")
            if item.id_missing:  # counted, so that an input.id_field that matches nothing shows in the stats
                stats.inc("ids_missing")
            spans = self.chunker.split(item.text, self.config.chunk.for_domain(item.domain), stats)
            if not spans:  # every sentence (or line) was dropped as too long
                limit = self.config.chunk.max_sentence_tokens
                rejects.append(Reject(item.file, item.row, item.doc_id, self.config.input.text_field, "no_chunks_left",
                                      f"every sentence or line is over chunk.max_sentence_tokens ({limit} tokens) "
                                      "and was dropped"))
                stats.drop("no_chunks_left")
                continue
            self._add_rows(rows, item, spans)
            stats.inc("docs_out")
            stats.inc("chunks_out", len(spans))
            stats.inc("tokens_out", sum(s.n_tokens for s in spans))
        atomic_write_parquet(run.part_path(self.output, shard), pa.table(rows, schema=CHUNK_SCHEMA))
        run.write_rejects(self.output, shard, [asdict(r) for r in rejects], REJECT_SCHEMA)
        return stats

    def finalize(self, run: RunDir, stats: Stats) -> None:
        """No chunk at all means the input is unusable as configured: stop here, not stages later."""
        if stats["chunks_out"] == 0:
            drops = {k.removeprefix("dropped."): v for k, v in stats.to_dict().items() if k.startswith("dropped.")}
            reasons = ", ".join(f"{k}: {v}" for k, v in sorted(drops.items(), key=lambda kv: -kv[1])) or "none"
            raise InputError(
                f"{self.config.input.path}: no usable document, every record was rejected ({reasons}); each one "
                f"is listed with its file, row, field and reason in {run.output_dir(self.output) / '_rejects'}")
        self._check_unique_ids(run)

    def _check_unique_ids(self, run: RunDir) -> None:
        """Every chunk id once, every document in one part, across the whole run: a duplicate here would merge two
        chunks' tags and concepts downstream. Out of core (DuckDB, ``execution.memory_gb``)."""
        parts = [str(p) for p in run.parts(self.output)]
        query = """SELECT chunk_id, list(DISTINCT filename ORDER BY filename) FROM read_parquet(?, filename = true)
                   GROUP BY chunk_id HAVING count(*) > 1 ORDER BY chunk_id LIMIT 3"""
        with scratch(run.output_dir(layout.TMP) / self.name) as folder, \
                duckdb_session(folder, self.config.execution.memory_gb) as con:
            repeated = con.execute(query, [parts]).fetchall()
        if repeated:
            shown = "; ".join(f"{chunk_id!r} in {', '.join(Path(f).name for f in files)}"
                              for chunk_id, files in repeated)
            raise ArtifactError(f"{run.output_dir(self.output)}: duplicate chunk id(s) ({shown}); ids must be unique "
                                f"across the whole input: recompute with atlas run CONFIG --force --stages chunk")

    @staticmethod
    def _add_rows(rows: dict[str, list], doc: Document, spans: list[Span]) -> None:
        metadata = json.loads(doc.metadata) | {"source": doc.source}
        metadata_json = json.dumps(metadata, sort_keys=True, ensure_ascii=False)
        for index, span in enumerate(spans):
            rows["chunk_id"].append(f"{doc.doc_id}:{index:05d}")
            rows["doc_id"].append(doc.doc_id)
            rows["source_doc_id"].append(doc.source_doc_id)
            rows["data_src"].append(doc.data_src)
            rows["domain"].append(doc.domain)
            rows["chunk_text"].append(doc.text[span.start : span.end])
            rows["n_tokens"].append(span.n_tokens)
            rows["char_start"].append(span.start)
            rows["char_end"].append(span.end)
            rows["doc_end_flag"].append(index == len(spans) - 1)
            rows["metadata"].append(metadata_json)


