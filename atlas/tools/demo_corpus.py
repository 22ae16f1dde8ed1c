"""The offline demo corpus, built from real text that every Atlas installation already has.

Nothing here is written for the project, and nothing is downloaded:

- ``python-docs`` (academic): the Python Language Reference topics shipped in ``pydoc_data``;
- ``python-stdlib`` (code): source files of standard-library modules;
- ``python-math-docs`` (math): docstrings of the statistical and random-distribution functions;
- ``package-readmes`` (web): the README texts (long descriptions) of installed packages.

The output depends only on the Python version and the pinned package versions, so the demo gives
the same corpus on every machine with the same set-up.
"""

from __future__ import annotations

import importlib
import inspect
import json
from email.parser import HeaderParser
from importlib import metadata
from pathlib import Path

from atlas.core.files import atomic_write_bytes
from atlas.core.ownership import NotOwned

MAX_CHARS = 20_000  # like the dev corpus: long texts are cut at a line break before this
MIN_CHARS = 200

STDLIB_MODULES = [
    "bisect", "heapq", "textwrap", "difflib", "fractions", "statistics", "shlex", "calendar", "colorsys",
    "graphlib", "fnmatch", "glob", "csv", "json.decoder", "json.encoder", "html.parser", "base64", "queue",
    "sched", "string", "dataclasses", "functools", "contextlib", "pprint", "tokenize",
]
MATH_MODULES = ["statistics", "random", "fractions", "decimal", "cmath"]
README_PACKAGES = ["numpy", "pyarrow", "pydantic", "prefect", "tqdm", "PyYAML", "zstandard", "tiktoken", "blingfire",
                   "fastapi", "starlette", "httpx", "rich", "click", "SQLAlchemy", "Jinja2", "packaging"]


def _truncate(text: str) -> str:
    text = text.strip()
    if len(text) <= MAX_CHARS:
        return text
    cut = text.rfind("\n", 0, MAX_CHARS)
    return text[: cut if cut > 0 else MAX_CHARS].rstrip()


def _python_docs():
    import pydoc_data.topics

    for name, text in sorted(pydoc_data.topics.topics.items()):
        yield f"python-docs:{name}", text, "academic", "python-docs", {"topic": name}


def _stdlib_sources():
    for module_name in STDLIB_MODULES:
        module = importlib.import_module(module_name)
        path = Path(inspect.getfile(module))
        yield (f"python-stdlib:{module_name}", path.read_text(encoding="utf-8"), "code", "python-stdlib",
               {"module": module_name})


def _math_docstrings():
    for module_name in MATH_MODULES:
        module = importlib.import_module(module_name)
        for name, obj in sorted(vars(module).items()):
            doc = (inspect.getdoc(obj) if (inspect.isfunction(obj) or inspect.isbuiltin(obj) or inspect.isclass(obj))
                   else None)
            if doc and not name.startswith("_") and getattr(obj, "__module__", module_name) == module_name:
                yield (f"python-math-docs:{module_name}.{name}", doc, "math", "python-math-docs",
                       {"object": f"{module_name}.{name}"})


def _package_readmes():
    for package in README_PACKAGES:
        try:
            raw = metadata.distribution(package).read_text("METADATA") or ""
        except metadata.PackageNotFoundError:
            continue
        message = HeaderParser().parsestr(raw)
        body = message.get_payload() or message.get("Description", "")
        version = message.get("Version", "")
        yield f"package-readmes:{package}", body, "web", "package-readmes", {"package": package, "version": version}


def build_demo_corpus(out: str | Path) -> tuple[Path, dict[str, int]]:
    """Write the demo corpus as JSONL (fields id, text, domain, data_src, meta); returns counts per source.

    The file is only rewritten when its content changes, so a finished demo run stays valid.
    """
    out = Path(out)
    lines, counts = [], {}
    for source in (_python_docs, _stdlib_sources, _math_docstrings, _package_readmes):
        for doc_id, text, domain, data_src, meta in source():
            text = _truncate(text)
            if len(text) < MIN_CHARS:
                continue
            record = {"id": doc_id, "text": text, "domain": domain, "data_src": data_src, "meta": meta}
            lines.append(json.dumps(record, ensure_ascii=False))
            counts[data_src] = counts.get(data_src, 0) + 1
    data = ("\n".join(lines) + "\n").encode("utf-8")
    if out.exists() and not _is_demo_corpus(out):
        raise NotOwned(f"demo-corpus OUT {out}: exists and is not a demo corpus Atlas wrote; it was left as it "
                       f"is. Name a new file")
    if not out.exists() or out.read_bytes() != data:
        atomic_write_bytes(out, data)
    return out, counts


def _is_demo_corpus(path: Path) -> bool:
    """Whether ``path`` is an earlier demo corpus (its first record is one), which may be rewritten."""
    try:
        with open(path, "rb") as f:
            first = json.loads(f.readline())
    except (OSError, ValueError):
        return False
    return (isinstance(first, dict) and set(first) == {"id", "text", "domain", "data_src", "meta"}
            and str(first["id"]).startswith(f"{first['data_src']}:"))
