"""Evaluation sets for the auxiliary labels (tone, demographic, alignment): known negatives and weak known positives.

    python benchmarks/aux_sets.py [--corpus ../shared/data/dev/corpus.parquet] [--max 600] [--seed 0]

Negatives are neutral technical text, which should get no demographic or alignment label and no emotional tone:
the dev corpus' code and maths, and text installed with the venv's third-party packages (docstrings, licences,
changelogs, READMEs), plus the Python language reference. The labels are calibrated against a null made of the
standard library (module docstrings, CPython's LICENSE.txt, idlelib's NEWS.txt), so nothing here comes from those:
measurement stays apart from calibration. Positives are dev-corpus groups whose chunks often (not always: weak)
carry the labels named in ``label_hint``; ``20ng-other`` is ordinary web text to compare against.

Every text is cut by Atlas' own chunker (``atlas.stages.chunk.Chunker``, default ``chunk`` config); chunks under
``MIN_CHARS`` are dropped, repeats within a set kept once, and at most ``max_chunks_per_set`` drawn per set.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import random
import re
import sys
import sysconfig
import time
import warnings
from email import message_from_string
from pathlib import Path
from pydoc_data.topics import topics  # the language reference that pydoc shows: the null does not use it

import pyarrow.parquet as pq

from atlas.config import ChunkConfig, InputConfig
from atlas.core.stats import Stats
from atlas.stages.chunk import Chunker

DEFAULT_CORPUS = Path(__file__).resolve().parents[2] / "shared" / "data" / "dev" / "corpus.parquet"
SITE = Path(sysconfig.get_paths()["purelib"])  # the venv's site-packages
MIN_CHARS = 20  # shorter chunks ("Examples", "----", a bare name) say nothing about a label

# Third-party modules whose public docstrings make ``api-docs``: quick to import here (sentence_transformers, ~10 s,
# and transformers, whose lazy namespace imports everything on dir(), are left out); missing ones are skipped.
API_MODULES = ("numpy", "numpy.linalg", "numpy.random", "pyarrow", "pyarrow.compute", "scipy.linalg",
               "scipy.optimize", "scipy.stats", "torch", "torch.nn", "pandas", "pydantic", "httpx", "duckdb", "faiss",
               "tqdm", "prefect")
# A few wheels ship CPython's own licence (typing_extensions, distlib, greenlet...), and pyarrow and regex bundle
# parts of it: such files would put the null's text into the negatives, so they are left out.
CPYTHON_LICENCE = re.compile(r"Python Software Foundation|BeOpen|\bCNRI\b", re.I)
LICENCE_FILE = re.compile(r"(LICEN[CS]E|COPYING|NOTICE)", re.I)
CHANGELOG_FILE = re.compile(r"(^|_)(CHANGES|CHANGELOG|HISTORY|NEWS)(\.|$)", re.I)  # also numpy's API_CHANGES.txt
CHANGELOG_TITLE = re.compile(r"change ?log|changes|history|release notes|release history|news", re.I)
VERSION_TITLE = re.compile(r"\[?v?(ersion )?\d|unreleased", re.I)  # "## v2.14.3 (2026-11-02)", "1.25.1"
MD_HEADING = re.compile(r"^(#{1,6})[ \t]+(.+?)[ \t#]*$", re.M)
RST_HEADING = re.compile(r"^(\S.*?)[ \t]*\n([=\-~^*+#\"'`])\2{2,}[ \t]*$", re.M)  # a title over a line of one mark

NG_RELIGION = ("alt.atheism", "soc.religion.christian", "talk.religion.misc")
NG_POLITICS = ("talk.politics.misc", "talk.politics.mideast")
NG_GUNS = ("talk.politics.guns",)
# The labels each positive set should often get (names from schemas/aux/*.json).
LABEL_HINTS = {
    "20ng-religion": ["christians", "jewish people", "muslims", "hindus", "buddhists", "atheists"],
    "20ng-politics": ["conservatives", "liberals", "middle eastern people", "jewish people", "nationalities"],
    "20ng-guns": ["violence and weapons"],
    "agnews-world": ["nationalities", "violence and weapons", "middle eastern people", "refugees",
                     "veterans and military"],
}


def evaluation_sets(dev_corpus: Path, max_chunks_per_set: int = 600, seed: int = 0) -> dict[str, dict]:
    """name -> {"kind": "negative" | "positive" | "reference", "label_hint", "chunks", "source"}, in a fixed order."""
    rows = sorted(pq.read_table(dev_corpus, columns=["doc_id", "text", "data_src", "domain", "label"]).to_pylist(),
                  key=lambda r: r["doc_id"])

    def corpus(keep) -> list[tuple[str, str]]:  # (text, domain) of the rows kept: chunked by their own domain
        return [(r["text"], r["domain"]) for r in rows if keep(r)]

    def ng(labels, inside: bool = True) -> list[tuple[str, str]]:
        return corpus(lambda r: r["data_src"] == "20ng" and (r["label"] in labels) == inside)

    def prose(texts: list[str]) -> list[tuple[str, str]]:  # as Atlas chunks a record with no domain field
        return [(t, InputConfig().default_domain) for t in texts]

    readmes, changelogs = _package_descriptions()
    site = "site-packages/*.dist-info"
    specs = {  # name: (kind, (text, domain) pairs, source)
        "code": ("negative", corpus(lambda r: r["data_src"] == "code"), "dev corpus: TheAlgorithms/Python files"),
        "math": ("negative", corpus(lambda r: r["data_src"] in ("gsm8k", "math")), "dev corpus: gsm8k and MATH"),
        "api-docs": ("negative", prose(_docstrings()), "docstrings of public names of " + ", ".join(API_MODULES)),
        "licences": ("negative", prose(_licences()), f"LICENSE/COPYING/NOTICE in {site}, none of CPython's"),
        "changelogs": ("negative", prose(changelogs), f"changelog sections of {site}/METADATA, CHANGES files"),
        "readmes": ("negative", prose(readmes), f"{site}/METADATA long descriptions, changelogs cut out"),
        "python-docs": ("negative", prose([topics[key] for key in sorted(topics)]),
                        "pydoc_data.topics: the Python language reference"),
        "20ng-religion": ("positive", ng(NG_RELIGION), "dev corpus 20NG: " + ", ".join(NG_RELIGION)),
        "20ng-politics": ("positive", ng(NG_POLITICS), "dev corpus 20NG: " + ", ".join(NG_POLITICS)),
        "20ng-guns": ("positive", ng(NG_GUNS), "dev corpus 20NG: " + ", ".join(NG_GUNS)),
        "agnews-world": ("positive", corpus(lambda r: r["data_src"] == "agnews" and r["label"] == "World"),
                         "dev corpus AG News: World"),
        "20ng-other": ("reference", ng(NG_RELIGION + NG_POLITICS + NG_GUNS, inside=False),
                       "dev corpus 20NG: the 14 other groups"),
    }
    config = ChunkConfig()
    chunker = Chunker(config.max_sentence_tokens, config.exact_token_counts)
    sets = {}
    for name, (kind, texts, source) in specs.items():
        chunks: dict[str, None] = {}  # insertion-ordered set: a chunk repeated across texts (boilerplate) counts once
        for text, domain in texts:
            for span in chunker.split(text, config.for_domain(domain), Stats()):
                if len(chunk := text[span.start : span.end]) >= MIN_CHARS:
                    chunks.setdefault(chunk)
        pool = list(chunks)
        if len(pool) > max_chunks_per_set:  # seeded by set name too: one set's sample does not move with another's
            keep = random.Random(f"{seed}:{name}").sample(range(len(pool)), max_chunks_per_set)
            pool = [pool[i] for i in sorted(keep)]
        sets[name] = {"kind": kind, "label_hint": LABEL_HINTS.get(name), "chunks": pool, "source": source}
    return sets


def _docstrings() -> list[str]:
    """The own docstrings of the modules and public functions and classes of ``API_MODULES``, each text once."""
    docs: dict[str, None] = {}
    with warnings.catch_warnings():  # deprecated aliases warn when touched
        warnings.simplefilter("ignore")
        for name in API_MODULES:
            try:
                module = importlib.import_module(name)
            except Exception:  # not installed, or broken in this venv: the set is made of what imports
                continue
            for attr in ["", *sorted(a for a in dir(module) if not a.startswith("_"))]:
                try:
                    obj = getattr(module, attr) if attr else module
                except Exception:
                    continue
                if _own_docstring(obj):
                    docs.setdefault(inspect.cleandoc(obj.__doc__))
    return list(docs)


def _own_docstring(obj) -> bool:
    """Whether obj (a module, class or callable) has a docstring of its own from third-party code.

    Not inspect.getdoc's fallback: it gives a class or method without a docstring the one of its base, often from
    the standard library (Exception, Enum, dict), and an instance (a dtype, a ufunc) carries its type's.
    """
    doc = getattr(obj, "__doc__", None)
    if not isinstance(doc, str) or not (inspect.ismodule(obj) or inspect.isclass(obj) or callable(obj)):
        return False
    if not (inspect.ismodule(obj) or inspect.isclass(obj)) and doc == type(obj).__doc__:
        return False
    home = obj.__name__ if inspect.ismodule(obj) else str(getattr(obj, "__module__", None) or "")
    return home.split(".")[0] not in sys.stdlib_module_names | {"builtins"}


def _dist_infos() -> list[Path]:
    """The third-party distributions of the venv (Atlas' own left out), sorted."""
    return sorted(p for p in SITE.glob("*.dist-info") if not p.name.startswith("atlas_concepts"))


def _licences() -> list[str]:
    """The licence files of every distribution (nested ones under licenses/ too), each content once."""
    texts: dict[str, str] = {}  # whitespace-normalised text -> text
    for dist in _dist_infos():
        for path in sorted(dist.rglob("*")):
            if path.is_file() and LICENCE_FILE.match(path.name):
                text = path.read_text("utf-8", "replace")
                if text.strip() and not CPYTHON_LICENCE.search(text):
                    texts.setdefault(" ".join(text.split()), text)
    return list(texts.values())


def _package_descriptions() -> tuple[list[str], list[str]]:
    """(READMEs, changelogs): the long description of each distribution, split where a changelog section starts,
    and the few CHANGES/HISTORY/NEWS files shipped inside packages (site-packages has no other changelog)."""
    readmes, changelogs = [], []
    for dist in _dist_infos():
        if not (dist / "METADATA").is_file():
            continue
        message = message_from_string((dist / "METADATA").read_text("utf-8", "replace"))
        body = message.get_payload() or message.get("Description", "")
        readme, changelog = _split_changelog(body if isinstance(body, str) else "")
        readmes += [readme] if readme.strip() else []
        changelogs += [changelog] if changelog.strip() else []
    files = (p for p in SITE.rglob("*") if CHANGELOG_FILE.search(p.name) and p.suffix in ("", ".txt", ".md", ".rst"))
    changelogs += [p.read_text("utf-8", "replace") for p in sorted(files) if p.is_file()]
    return list(dict.fromkeys(readmes)), list(dict.fromkeys(changelogs))


def _split_changelog(body: str) -> tuple[str, str]:
    """(body without its changelog section, the section): from a heading such as "## Changelog" or "History" over
    "=======" to the next heading of the same or a higher level that is not a version (or the end): the versions
    are often headings of the changelog's own level."""
    headings = _headings(body)
    for i, (start, level, title) in enumerate(headings):
        if CHANGELOG_TITLE.fullmatch(title.strip(" :")):
            stop = next((s for s, lvl, t in headings[i + 1 :] if lvl <= level and not VERSION_TITLE.match(t)),
                        len(body))
            return body[:start] + body[stop:], body[start:stop]
    return body, ""


def _headings(body: str) -> list[tuple[int, int, str]]:
    """(offset, level, title) of the Markdown and reStructuredText headings of a text, in order. A reST level is
    the underline mark's rank in order of first use, as reST itself reads it."""
    found = [(m.start(), len(m[1]), m[2]) for m in MD_HEADING.finditer(body)]
    marks: list[str] = []
    for m in RST_HEADING.finditer(body):
        marks += [] if m[2] in marks else [m[2]]
        found.append((m.start(), marks.index(m[2]) + 1, m[1]))
    return sorted(found)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS)
    parser.add_argument("--max", type=int, default=600, help="chunks per set at most")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if not args.corpus.exists():
        raise SystemExit(f"{args.corpus} not found: pass --corpus PATH (the dev corpus Parquet file)")
    started = time.perf_counter()
    result = evaluation_sets(args.corpus, args.max, args.seed)
    print(f"{len(result)} sets in {time.perf_counter() - started:.1f} s\n")
    for set_name, s in result.items():
        hint = f", labels expected: {', '.join(s['label_hint'])}" if s["label_hint"] else ""
        print(f"== {set_name}: {s['kind']}, {len(s['chunks'])} chunks{hint}\n   from {s['source']}")
        for i, example in enumerate(random.Random(set_name).sample(s["chunks"], min(2, len(s["chunks"]))), 1):
            print(f"  [{i}] " + example[:200].replace("\n", "\n      "))
        print()
