"""Build a held-out evaluation corpus: documents of four dev-corpus sources that the dev corpus does not hold.

    python benchmarks/heldout_corpus.py --snapshots DIR --out ../heldout/corpus.parquet \\
        [--dev ../shared/data/dev/corpus.parquet]

Every choice in the pipeline (configs, thresholds, prompts) was tuned on the dev corpus. This script
draws a second corpus from the same public sources -- AG News (agnews), 20 Newsgroups (20ng),
MATH (math) and TheAlgorithms/Python (code) -- processed the same way as dev (see
``shared/data/PROVENANCE.md``) but made only of documents that are not in dev, so results on it
check whether those choices carry over to documents nothing was tuned on.

For each source the script
1. reads the source files from its git snapshot and processes them as PROVENANCE.md describes;
2. checks that processing: every dev document of the source is processed again by its id and
   compared with the dev text (the match rate is printed);
3. drops documents whose id or exact text is in dev, then per label draws as many documents as dev
   has for that label (``random.Random(f"heldout-{source}-{label}").sample`` over the sorted ids;
   all of them where fewer are left).
The output has the dev corpus' columns and per-source domain / source_repo / license values.

Snapshots: ``--snapshots DIR`` holds one folder per repository named ``owner+name``, either a bare git
directory at ``owner+name/repo`` (as fetched) or a plain clone at ``owner+name``. Files are read at
``HEAD``, so check out the commits named in PROVENANCE.md, for example::

    git clone https://github.com/tonyzhaozh/few-shot-learning DIR/tonyzhaozh+few-shot-learning
    git -C DIR/tonyzhaozh+few-shot-learning checkout e04d8643be91c2cce63f33e07760ff75d5aa3ad0
    # likewise YunomiXavia/20news-bydate 2298b3e1c9f66cc3f2d8bf6da5dd68f15b37eb88,
    # aiwaves-cn/agents e8c4e3c2d19739d3dff59e577d1c97090cc15f59,
    # TheAlgorithms/Python f5988cc09713315817df6a7e327e258013a94440

Only the standard library and pyarrow are used; one process, one ``git cat-file`` helper per source.
"""

from __future__ import annotations

import argparse
import csv
import html
import io
import json
import random
import re
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

MIN_CHARS = 200
MAX_CHARS = 20_000
COLUMNS = ["doc_id", "text", "data_src", "domain", "label", "source_repo", "license"]


class Snapshot:
    """Files of one repository at HEAD, read through git (bare directory or clone)."""

    def __init__(self, snapshots: Path, repo: str):
        folder = snapshots / repo.replace("/", "+")
        self.git_dir = next((d for d in (folder / "repo", folder) if d.is_dir()), None)
        if self.git_dir is None:
            sys.exit(f"no snapshot of {repo} under {snapshots}")
        self._cat = None

    def names(self) -> list[str]:
        out = subprocess.run(
            ["git", "-C", str(self.git_dir), "ls-tree", "-r", "-z", "--name-only", "HEAD"],
            check=True,
            capture_output=True,
        ).stdout
        return [n for n in out.decode("utf-8").split("\0") if n]

    def read(self, path: str) -> bytes:
        if self._cat is None:
            self._cat = subprocess.Popen(
                ["git", "-C", str(self.git_dir), "cat-file", "--batch"], stdin=subprocess.PIPE, stdout=subprocess.PIPE
            )
        self._cat.stdin.write(f"HEAD:{path}\n".encode())
        self._cat.stdin.flush()
        header = self._cat.stdout.readline().split()
        if header[-1] == b"missing":
            raise FileNotFoundError(path)
        data = self._cat.stdout.read(int(header[2]))
        self._cat.stdout.read(1)  # the newline after each object
        return data

    def close(self):
        if self._cat is not None:
            self._cat.stdin.close()
            self._cat.wait()


def truncate(text: str) -> tuple[str, bool]:
    """Cut a text over MAX_CHARS at the last line break (else sentence end) before the cap."""
    if len(text) <= MAX_CHARS:
        return text, False
    cut = text.rfind("\n", 0, MAX_CHARS)
    if cut <= 0:
        cut = max(text.rfind(end, 0, MAX_CHARS) for end in (". ", "! ", "? ")) + 1
    return text[:cut].rstrip(), True


# ---- agnews ------------------------------------------------------------------------------------

AG_LABELS = {"1": "World", "2": "Sports", "3": "Business", "4": "Sci/Tech"}
AG_ENTITY = re.compile(r"(?<!&)#(\d+);|(?<![&\w])(quot|amp|lt|gt);")  # AG's '&'-less escapes
AG_TAG = re.compile(r"</?[A-Za-z][^<>]*>")
AG_CONTRACTION = re.compile(r"(?<=\S) '(?=(?:s|t|ve|re|ll|d|m)\b)")  # "doesn #39;t" -> "doesn't"


def ag_clean(field: str) -> str:
    field = field.replace("\\", " ")  # '\' marks a line break ('\$' too)
    field = AG_ENTITY.sub(lambda m: f"&#{m[1]};" if m[1] else f"&{m[2]};", field)
    field = AG_TAG.sub(" ", html.unescape(field))
    field = re.sub(r"\s+", " ", field).strip()
    return AG_CONTRACTION.sub("'", field)


def load_agnews(snap: Snapshot, stats: Counter) -> dict[str, tuple[str, str]]:
    rows = list(csv.reader(io.StringIO(snap.read("data/agnews/test.csv").decode("utf-8"))))
    docs = {}
    for i, (cls, title, desc) in enumerate(rows[1:]):  # row 0 is the header
        docs[f"agnews:test-{i:05d}"] = (AG_LABELS[cls], ag_clean(title) + "\n\n" + ag_clean(desc))
    return docs


# ---- 20ng --------------------------------------------------------------------------------------

UU_LINE = re.compile(r"M[\x20-\x60]{59,61}|[A-Za-z0-9+/]{60,76}={0,2}")  # uuencode / base64 line


def ng_process(raw: str) -> tuple[str, str]:
    """(subject, body): headers dropped but the Subject; blank-line runs collapsed, lines rstripped."""
    head, _, body = raw.partition("\n\n")
    subject = next(
        (line[len("subject:") :].strip() for line in head.split("\n") if line.lower().startswith("subject:")), ""
    )
    body = re.sub(r"\n{3,}", "\n\n", body.strip("\n"))
    body = "\n".join(line.rstrip() for line in body.split("\n")).rstrip()
    return subject, body


def mostly_binary(body: str) -> bool:
    """At least half the body's non-blank characters are on uuencode/base64 lines."""
    lines = [line for line in body.split("\n") if line.strip()]
    return sum(len(line) for line in lines if UU_LINE.fullmatch(line)) * 2 >= sum(map(len, lines))


def load_20ng(snap: Snapshot, stats: Counter) -> dict[str, tuple[str, str]]:
    docs = {}
    for name in sorted(snap.names()):
        parts = name.split("/")  # 20news-bydate/20news-bydate-<split>/<group>/<id>
        if len(parts) != 4 or not parts[1].startswith("20news-bydate-"):
            continue
        stats["files"] += 1
        subject, body = ng_process(snap.read(name).decode("latin-1"))
        if not body.strip() or mostly_binary(body):
            stats["dropped as empty body" if not body.strip() else "dropped as uuencoded/binary"] += 1
            continue
        docs[f"20ng:{parts[1].rsplit('-', 1)[1]}-{parts[2]}-{parts[3]}"] = (parts[2], subject + "\n\n" + body)
    return docs


# ---- math --------------------------------------------------------------------------------------


def load_math(snap: Snapshot, stats: Counter) -> dict[str, tuple[str, str]]:
    root = "src/agents/datasets/data/math/"
    docs = {}
    for name in sorted(snap.names()):
        if not (name.startswith(root) and name.endswith(".json")):
            continue
        split, subject, file = name[len(root) :].split("/")
        item = json.loads(snap.read(name))
        text = item["problem"].strip() + "\n\n" + item["solution"].strip()
        docs[f"math:{split}-{subject}-{file[:-5]}"] = (subject, text)
    return docs


# ---- code --------------------------------------------------------------------------------------


def code_file_wanted(path: str) -> bool:
    parts = path.split("/")
    return (
        path.endswith(".py")
        and len(parts) > 1
        and parts[0] not in ("scripts", "docs")
        and not any(p.startswith(".") or p == "tests" for p in parts[:-1])
        and parts[-1] != "__init__.py"
        and not parts[-1].startswith("test_")
    )


def load_code(snap: Snapshot, stats: Counter) -> dict[str, tuple[str, str]]:
    docs = {}
    for name in sorted(filter(code_file_wanted, snap.names())):
        text = snap.read(name).decode("utf-8").replace("\r\n", "\n").strip()
        docs[f"code:{name}"] = (name.split("/")[0], text)
    return docs


SOURCES = {  # data_src: (repository, loader)
    "agnews": ("tonyzhaozh/few-shot-learning", load_agnews),
    "20ng": ("YunomiXavia/20news-bydate", load_20ng),
    "math": ("aiwaves-cn/agents", load_math),
    "code": ("TheAlgorithms/Python", load_code),
}


def build_source(source: str, snapshots: Path, dev_rows: list[dict], dev_texts: set[str]) -> list[dict]:
    repo, loader = SOURCES[source]
    snap = Snapshot(snapshots, repo)
    stats = Counter()
    raw = loader(snap, stats)
    snap.close()
    stats["files"] = stats["files"] or len(raw)  # 20ng counts its posts, dropped ones included

    docs, seen = {}, set()  # id -> (label, text) after the common rules, first of exact duplicates kept
    for doc_id, (label, text) in sorted(raw.items()):
        text, cut = truncate(text)
        stats["truncated"] += cut
        if len(text) < MIN_CHARS:
            stats["dropped as short"] += 1
        elif text in seen:
            stats["dropped as duplicate"] += 1
        else:
            seen.add(text)
            docs[doc_id] = (label, text)

    dev = [r for r in dev_rows if r["data_src"] == source]
    matched = sum(docs.get(r["doc_id"], (None, None)) == (r["label"], r["text"]) for r in dev)
    dev_ids = {r["doc_id"] for r in dev}
    pool = {i: d for i, d in docs.items() if i not in dev_ids and d[1] not in dev_texts}
    text_only = sum(i not in dev_ids for i in set(docs) - set(pool))
    by_label = {}
    for doc_id in sorted(pool):
        by_label.setdefault(pool[doc_id][0], []).append(doc_id)
    wanted = Counter(r["label"] for r in dev)
    drawn = []
    for label in sorted(wanted):
        ids = by_label.get(label, [])
        drawn += random.Random(f"heldout-{source}-{label}").sample(ids, min(wanted[label], len(ids)))
    meta = {k: dev[0][k] for k in ("domain", "source_repo", "license")}
    out = [{"doc_id": i, "text": pool[i][1], "data_src": source, "label": pool[i][0], **meta} for i in sorted(drawn)]

    got = Counter(r["label"] for r in out)
    short = {lab: f"{got[lab]}/{n}" for lab, n in sorted(wanted.items()) if got[lab] < n}
    print(
        f"\n[{source}] {repo}: {stats['files']} files; "
        + ", ".join(f"{k} {v}" for k, v in sorted(stats.items()) if k != "files")
    )
    print(
        f"  available {len(docs)}, excluded as dev {len(docs) - len(pool)} "
        f"({text_only} of them by text only), left {len(pool)}, drawn {len(out)} (dev has {len(dev)})"
    )
    print(f"  dev-text match: {matched}/{len(dev)} = {matched / max(len(dev), 1):.1%}")
    print(f"  drawn per label: {dict(sorted(got.items()))}")
    if short:
        print(f"  labels with fewer than dev (drawn/dev): {short}")
    unlabelled = sorted(set(by_label) - set(wanted))
    if unlabelled:
        print(f"  labels absent from dev, not drawn: {unlabelled}")
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--snapshots", type=Path, required=True, help="folder of the four repositories' snapshots")
    parser.add_argument("--dev", type=Path, default=Path("../shared/data/dev/corpus.parquet"), help="the dev corpus")
    parser.add_argument("--out", type=Path, required=True, help="the parquet file to write (kept out of the repo)")
    args = parser.parse_args()

    start = time.time()
    dev_table = pq.read_table(args.dev)
    dev_rows = dev_table.to_pylist()
    dev_texts = {r["text"] for r in dev_rows}
    rows = []
    for source in SOURCES:
        rows += build_source(source, args.snapshots, dev_rows, dev_texts)

    table = pa.Table.from_pylist(rows, schema=pa.schema([dev_table.schema.field(c) for c in COLUMNS]))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, args.out, compression="zstd")
    print(
        f"\nwrote {args.out}: {table.num_rows} documents, "
        f"{sum(map(len, table.column('text').to_pylist())) / 1e6:.1f} M characters, {time.time() - start:.0f} s"
    )


if __name__ == "__main__":
    main()
