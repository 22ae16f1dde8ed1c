"""The null of the auxiliary labels: neutral, technical text that every Python installation holds.

A demographic, alignment or emotional-tone label must stay off text that is about none of them. Each such label
is calibrated against this null (``atlas.models.auxiliary``): a chunk gets the label only when its score beats the
score that label reaches on this text. The text is read from the running Python, never downloaded or shipped:

- the docstrings of the public functions, classes and methods in the sources of ``NULL_MODULES`` (API
  documentation);
- CPython's ``LICENSE.txt`` (licence terms: warranty, liability, terms and conditions);
- IDLE's ``NEWS.txt`` (a changelog).

It holds no source file, no language-reference page and none of the modules the demo corpus is built from
(``atlas.tools.demo_corpus``), so the demo and the dev corpus stay text the null never saw. Long texts are cut at
blank lines into pieces of about ``PIECE_WORDS`` words, the size of a prose chunk; a module's docstrings are read
in order as one text, as on its documentation page.
"""

from __future__ import annotations

import ast
import sysconfig
from functools import lru_cache
from pathlib import Path

PIECE_WORDS = 110  # about 150 tokens, the prose chunk of the paper
MIN_CHARS = 40  # a shorter docstring ("Return self.") says nothing either way

# standard-library modules written in Python (their docstrings are read from the source)
NULL_MODULES = [
    "abc", "argparse", "ast", "bz2", "codecs", "collections", "concurrent.futures", "configparser", "copy",
    "datetime", "email.message", "email.utils", "enum", "filecmp", "ftplib", "gettext", "gzip", "hashlib", "hmac",
    "http.client", "http.cookies", "http.server", "imaplib", "importlib.metadata", "inspect", "io", "ipaddress",
    "locale", "logging", "logging.handlers", "lzma", "mailbox", "mimetypes", "numbers", "operator", "os", "pathlib",
    "pickle", "pkgutil", "platform", "plistlib", "poplib", "re", "secrets", "selectors", "shutil", "signal",
    "smtplib", "socket", "socketserver", "sqlite3", "ssl", "struct", "subprocess", "sysconfig", "tarfile",
    "tempfile", "threading", "timeit", "tomllib", "traceback", "typing", "unittest", "urllib.parse",
    "urllib.request", "uuid", "warnings", "wave", "weakref", "xml.dom.minidom", "xml.etree.ElementTree", "zipfile",
    "zoneinfo",
]


def pieces(text: str, words: int = PIECE_WORDS) -> list[str]:
    """``text`` cut at blank lines into pieces of at most about ``words`` words (a longer paragraph stays whole)."""
    out, current, size = [], [], 0
    for paragraph in (p.strip() for p in text.split("\n\n")):
        if not paragraph:
            continue
        n = len(paragraph.split())
        if current and size + n > words:
            out.append("\n\n".join(current))
            current, size = [], 0
        current.append(paragraph)
        size += n
    if current:
        out.append("\n\n".join(current))
    return [p for p in out if len(p) >= MIN_CHARS]


def _docstrings(module_name: str) -> list[str]:
    """The docstrings in a standard-library module's source file, in file order: the module's, and those of its
    public functions, classes and their public methods. Read from the source, not from the imported module: what
    an imported module holds depends on what else was imported (other packages patch ``inspect`` and ``logging``),
    and the null must be the same in every process. A module without a Python source gives nothing."""
    base = Path(sysconfig.get_paths()["stdlib"]) / module_name.replace(".", "/")
    source = next((p for p in (base.with_suffix(".py"), base / "__init__.py") if p.is_file()), None)
    if source is None:
        return []
    tree = ast.parse(source.read_text(encoding="utf-8"))
    docs = [ast.get_docstring(tree) or ""]
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and not node.name.startswith("_"):
            docs.append(ast.get_docstring(node) or "")
            if isinstance(node, ast.ClassDef):
                docs += [ast.get_docstring(member) or "" for member in node.body
                         if isinstance(member, (ast.FunctionDef, ast.AsyncFunctionDef))
                         and not member.name.startswith("_")]
    return docs


def _installed_file(relative: str) -> str:
    path = Path(sysconfig.get_paths()["stdlib"]) / relative
    return path.read_text(encoding="utf-8", errors="replace") if path.is_file() else ""


@lru_cache(maxsize=1)
def neutral_texts() -> tuple[str, ...]:
    """The null's pieces, deduplicated, in a fixed order (the same for the same Python)."""
    # a module's docstrings read as its documentation page, cut like a chunk: one-line docstrings alone are
    # shorter than any chunk, and a score's spread depends on the length of what is scored
    texts = ["\n\n".join(_docstrings(module)) for module in NULL_MODULES]
    texts += [_installed_file("LICENSE.txt"), _installed_file("idlelib/NEWS.txt")]
    seen: dict[str, None] = {}
    for text in texts:
        for piece in pieces(text):
            seen.setdefault(piece, None)
    return tuple(seen)
