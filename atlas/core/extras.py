"""Optional dependencies ("extras"): which stage needs which, and a clear message when one is missing.

A core install (``pip install atlas-concepts``) chunks and tokenizes; embedding, clustering, the annotator
and the GPU engine come with extras. Stage modules import those libraries only when they run, so
``atlas --help`` and the chunk stage work without them, and a stage that needs one says which to install.
"""

from __future__ import annotations

import importlib.util

# extra -> the modules it installs that Atlas imports (pyproject.toml's optional-dependencies)
EXTRAS = {
    "embed": ("torch", "sentence_transformers", "safetensors", "lemminflect", "nltk", "textblob_aptagger"),
    "library": ("faiss", "community", "networkx", "sklearn", "scipy", "matplotlib"),
    "cluster": ("ray", "prefect_ray"),
    "gpu": ("vllm",),
    "s3": ("s3fs",),  # input.path s3://... (other fsspec URLs need their own package, e.g. gcsfs for gs://)
}


class MissingExtra(RuntimeError):
    """A stage or command needs an optional dependency that is not installed."""


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def require(extras, what: str) -> None:
    """Raise ``MissingExtra`` naming the pip command when a module of one of ``extras`` is not installed."""
    for extra in extras:
        missing = [m for m in EXTRAS[extra] if not _installed(m)]
        if missing:
            raise MissingExtra(f"{what} needs the '{extra}' extra ({', '.join(missing)} not installed): "
                               f"pip install 'atlas-concepts[{extra}]' (with -c requirements/constraints.txt)")


def llm_extras(engine: str) -> tuple[str, ...]:
    """What an LLM step needs beyond the stage's own extras: vLLM needs the GPU extra."""
    return ("gpu",) if engine == "vllm" else ()
