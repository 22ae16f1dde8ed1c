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
the tokenize stage will see; only the few words before the first and after the last safe
pre-token boundary of each chunk are encoded again (see ``_exact_count``). With
``chunk.exact_token_counts: false`` it is the in-context count of the first pass, which differs
by one token in about one chunk in ten (measured on the dev corpus).
"""

from __future__ import annotations

import ctypes
import json
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from atlas.config import ChunkDomain
from atlas.core.files import InputError, atomic_write_json, atomic_write_parquet, file_fingerprint, read_json
from atlas.core.rundir import RunDir
from atlas.core.stage import Stage
from atlas.core.stats import Stats
from atlas.io import layout
from atlas.io.chunks import CHUNK_SCHEMA
from atlas.io.inputs import Document, Reject, list_input_files, plan_shards, read_shard

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
    """

    def __init__(self):
        import blingfire

        self.fn = blingfire.blingfire.TextToSentencesWithOffsets
        self.fn.restype = ctypes.c_int
        self.fn.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                            ctypes.c_int]

    def spans(self, data: bytes) -> tuple[np.ndarray, np.ndarray] | None:
        n = len(data)
        cap = 2 * n + 1  # the library's own wrapper sizes its buffers this way
        out = np.empty(cap, dtype=np.uint8)  # the sentences joined by newlines; only the count is used
        starts = np.empty(cap, dtype=np.int32)
        ends = np.empty(cap, dtype=np.int32)
        written = self.fn(data, n, out.ctypes.data, starts.ctypes.data, ends.ctypes.data, cap)
        if written < 0 or written > cap:
            return None
        count = int(np.count_nonzero(out[: max(written - 1, 0)] == 10)) + 1
        return starts[:count].astype(np.int64), ends[:count].astype(np.int64) + 1  # end: exclusive


# Both splitters see every line terminator str.splitlines knows as b"\n", at the same byte offsets: \r, \v, \f and
# \x1c-\x1e become b"\n"; the multi-byte ones keep their length, padded before the b"\n" (\r\n -> b" \n", U+0085 ->
# b" \n", U+2028 and U+2029 -> b"  \n") so that the next line still starts on a character. A line's span may then end
# inside the terminator's character, which is whitespace and trimmed from the chunk.
_ONE_BYTE_BREAKS = bytes.maketrans(b"\r\v\f\x1c\x1d\x1e", b"\n" * 6)
_MULTI_BYTE_BREAKS = ((b"\r\n", b" \n"), ("\x85".encode(), b" \n"), ("\u2028".encode(), b"  \n"),
                      ("\u2029".encode(), b"  \n"))


def _unify_line_breaks(data: bytes) -> bytes:
    for old, new in _MULTI_BYTE_BREAKS:
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
    start: int  # byte offsets
    end: int
    n_tokens: int


# A space between two ASCII letters is a pre-token boundary of cl100k_base in any context: the
# letter run before it ends there and " word" starts there. Tokens between two such points are the
# same whether the document or only the chunk is encoded.
_SAFE_BOUNDARY = re.compile(r"(?<=[A-Za-z]) (?=[A-Za-z])")


class Chunker:
    """Splits one document into chunks; holds the tokenizer and sentence splitter."""

    def __init__(self, max_sentence_tokens: int, exact_token_counts: bool = True):
        from atlas.models.tokenizer import cl100k, token_byte_lengths

        self.enc = cl100k()
        self.token_lengths = token_byte_lengths()
        self.blingfire = _BlingFire()
        self.max_sentence_tokens = max_sentence_tokens
        self.exact_token_counts = exact_token_counts

    def _units(self, data: bytes, domain: ChunkDomain) -> tuple[list[list[Span]], np.ndarray]:
        """Units (sentences or lines) with their byte spans, in packing groups, and the token end offsets.

        Sentences form one group; code lines form one group per blank-line-separated block. Every
        token of one whole-document encoding is given to the unit it ends in.
        """
        if domain.splitter == "sentences":
            spans = self.blingfire.spans(_unify_line_breaks(data))
            if spans is None:  # the splitter refused the text: fall back to lines
                return self._units(data, ChunkDomain(max_tokens=domain.max_tokens, splitter="lines"))
            starts, ends = spans
            line_numbers = None
        else:
            starts, ends, blank = _line_spans(_unify_line_breaks(data))
            line_numbers = np.flatnonzero(~blank)  # blank lines are not units; their tokens go to the line before
            starts, ends = starts[line_numbers], ends[line_numbers]
        ids = np.asarray(self.enc.encode_ordinary(data.decode("utf-8")), dtype=np.int64)
        token_ends = np.cumsum(self.token_lengths[ids])
        owner = np.searchsorted(starts, token_ends - 1, side="right") - 1
        counts = np.bincount(np.clip(owner, 0, None), minlength=len(starts)).tolist()
        units = [Span(s, e, n) for s, e, n in zip(starts.tolist(), ends.tolist(), counts)]
        if line_numbers is None:
            return [units], token_ends
        # Code: a new block starts wherever blank lines separate two consecutive units.
        block_starts = np.flatnonzero(np.diff(line_numbers) > 1) + 1
        bounds = [0, *block_starts.tolist(), len(units)]
        return [units[a:b] for a, b in zip(bounds, bounds[1:]) if a < b], token_ends

    def _exact_count(self, text: str, start: int, end: int, token_ends: np.ndarray, byte_of_char) -> int:
        """len(encode_ordinary(text[start:end])), reusing the whole-document tokens of the chunk's middle.

        Only the head before the first safe boundary and the tail after the last one are encoded
        again; a chunk without a safe boundary is encoded whole.
        """
        first = _SAFE_BOUNDARY.search(text, start, end)
        if first is None:
            return len(self.enc.encode_ordinary(text[start:end]))
        last = first
        for match in _SAFE_BOUNDARY.finditer(text, max(first.start(), end - 64), end):
            last = match
        b1, b2 = byte_of_char(first.start()), byte_of_char(last.start())
        i1, i2 = np.searchsorted(token_ends, (b1, b2), side="right")
        if token_ends[i1 - 1] != b1 or token_ends[i2 - 1] != b2:  # not token boundaries after all: be safe
            return len(self.enc.encode_ordinary(text[start:end]))
        head = self.enc.encode_ordinary(text[start : first.start()])
        tail = self.enc.encode_ordinary(text[last.start() : end])
        return len(head) + int(i2 - i1) + len(tail)

    def split(self, text: str, domain: ChunkDomain, stats: Stats) -> list[Span]:
        """Chunks of one document as character spans (start, end, n_tokens)."""
        data = text.encode("utf-8")
        groups, token_ends = self._units(data, domain)
        chunks: list[Span] = []
        pending: list[Span] = []  # code: whole blocks waiting to be joined with the next ones

        def flush(units: list[Span]) -> None:
            for first, last in _pack([u.n_tokens for u in units], domain.max_tokens):
                part = units[first:last]
                chunks.append(Span(part[0].start, part[-1].end, sum(u.n_tokens for u in part)))

        for group in groups:
            kept = []
            for unit in group:
                if unit.n_tokens > self.max_sentence_tokens:
                    stats.inc("sentences_dropped")
                    stats.inc("sentence_tokens_dropped", unit.n_tokens)
                    flush(pending + kept)  # a dropped sentence also ends the chunk before it
                    pending, kept = [], []
                else:
                    kept.append(unit)
            if domain.splitter == "lines":
                # Join whole blocks while they fit; a block over the threshold is cut between lines.
                block_tokens = sum(u.n_tokens for u in kept)
                if pending and sum(u.n_tokens for u in pending) + block_tokens > domain.max_tokens:
                    flush(pending)
                    pending = []
                if block_tokens > domain.max_tokens:
                    flush(kept)
                else:
                    pending.extend(kept)
            else:
                flush(kept)
        flush(pending)

        if len(data) == len(text):  # ASCII: byte and string offsets agree
            char_of_byte = byte_of_char = lambda i: i  # noqa: E731
        else:
            is_char_start = (np.frombuffer(data, dtype=np.uint8) & 0xC0) != 0x80
            char_of_byte = (np.cumsum(is_char_start) - 1).__getitem__
            byte_of_char = np.flatnonzero(is_char_start).__getitem__
        result = []
        for c in chunks:
            start, end = int(char_of_byte(c.start)), int(char_of_byte(c.end - 1)) + 1
            piece = text[start:end]  # BlingFire spans can carry whitespace at their ends; code keeps its indentation
            if domain.splitter == "sentences":
                start += len(piece) - len(piece.lstrip())
            end -= len(piece) - len(piece.rstrip())
            if start < end:
                n_tokens = (self._exact_count(text, start, end, token_ends, byte_of_char) if self.exact_token_counts
                            else c.n_tokens)
                result.append(Span(start, end, n_tokens))
        return result


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

    def _fingerprints(self, files: list[Path]) -> dict:
        """Size and sha256 of every input file by its name within the input (not its absolute path: a moved input is
        the same input), so that a conflict names the file that changed. The hashes are cached in the run directory
        (see ``file_fingerprint``); new ones are written by ``plan``, as a run that is refused writes nothing."""
        try:
            known = read_json(self._cache_path()) if self._cache_path().is_file() else {}
        except InputError:  # a damaged cache (read_json names it) only costs a re-hash
            known = {}
        cache = dict(known)
        base = Path(os.path.commonpath(files)) if len(files) > 1 else files[0].parent
        fingerprints = {p.relative_to(base).as_posix(): file_fingerprint(p, cache) for p in files}
        listed = {str(p.resolve()) for p in files}
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
        if path.exists() and read_json(path).get("stage_hash") == stage_hash:
            return len(read_json(path)["shards"])
        plan = plan_shards(self.config.input) | {"stage_hash": stage_hash}
        atomic_write_json(path, plan)
        return len(plan["shards"])

    def setup(self) -> None:
        self.chunker = Chunker(self.config.chunk.max_sentence_tokens, self.config.chunk.exact_token_counts)

    def run_shard(self, run: RunDir, shard: int) -> Stats:
        plan = read_json(self._plan_path(run))
        stats = Stats()
        rows: dict[str, list] = {name: [] for name in CHUNK_SCHEMA.names}
        rejects: list[Reject] = []
        for item in read_shard(plan, shard, self.config.input):
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


