"""Security: nothing from a run directory is unpickled, API keys stay secret, writes stay inside the run.

A run directory can come from someone else (a shared cluster folder, a downloaded release), so every
reader treats it as untrusted: weights are safetensors, arrays are raw bytes, and a planted pickle
must fail loudly without running.
"""

import ast
import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO, write_config, write_jsonl
from fault_server import FaultServer

from atlas.cblm.train import TrainConfig
from atlas.config import load_config
from atlas.core.rundir import RunDir
from atlas.io.embedding_store import open_embeddings
from atlas.models.embedder import Embedder, minilm_path
from atlas.runner import run_stages


class Payload:
    """Unpickling this creates ``sentinel``: the proof that a loader ran code from a file."""

    def __init__(self, sentinel: Path):
        self.sentinel = sentinel

    def __reduce__(self):
        return Path.touch, (self.sentinel,)


def test_no_pickle_based_loader_in_the_source():
    """pickle/joblib/torch.load/pd.read_pickle never appear; np.load always says allow_pickle=False."""
    banned_calls = {"pickle.load", "pickle.loads", "joblib.load", "torch.load", "pd.read_pickle", "dill.load",
                    "cloudpickle.load", "cloudpickle.loads"}
    found = []
    for path in sorted([*(REPO / "atlas").rglob("*.py"), *(REPO / "flows").rglob("*.py")]):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            name = ast.unparse(node.func)
            if name in banned_calls:
                found.append(f"{path.relative_to(REPO)}:{node.lineno} {name}")
            if name in ("np.load", "numpy.load"):
                flags = {k.arg: ast.unparse(k.value) for k in node.keywords}
                if flags.get("allow_pickle") != "False":
                    found.append(f"{path.relative_to(REPO)}:{node.lineno} np.load without allow_pickle=False")
    assert not found, found


def test_the_pos_tagger_weights_reader_takes_plain_data_only(tmp_path):
    """The offline tagger's part-of-speech weights ship as a pickle (textblob-aptagger): they are read with an
    unpickler that refuses every class but a set, so a swapped file fails before it runs anything."""
    import io

    from atlas.llm.offline import PlainDataUnpickler

    plain = ({"word": {"NN": 1.5}}, {"the": "DT"}, {"NN", "DT"})
    assert PlainDataUnpickler(io.BytesIO(pickle.dumps(plain, protocol=2))).load() == plain
    sentinel = tmp_path / "pwned"
    with pytest.raises(pickle.UnpicklingError, match="refused"):
        PlainDataUnpickler(io.BytesIO(pickle.dumps(Payload(sentinel)))).load()
    assert not sentinel.exists()


def test_a_planted_pickle_weight_file_is_refused_without_running(tmp_path):
    """A fine-tuned encoder folder (RUN/annotator/encoder/) whose weights were swapped for a pickle."""
    folder = tmp_path / "encoder"
    shutil.copytree(minilm_path(), folder)
    (folder / "model.safetensors").unlink()
    sentinel = tmp_path / "pwned"
    (folder / "pytorch_model.bin").write_bytes(pickle.dumps(Payload(sentinel)))
    with pytest.raises(Exception, match="safetensors"):
        Embedder(str(folder)).setup()
    assert not sentinel.exists()


def test_an_object_array_in_the_run_is_refused_without_running(trained, tmp_path):
    config, run = trained
    root = tmp_path / "run"
    shutil.copytree(run.root, root)
    config = config.model_copy(update={"run_dir": str(root)})
    sentinel = tmp_path / "pwned"
    vectors = root / "tag_vocab" / "_embeddings.npy"
    rows = len(np.load(vectors))
    np.save(vectors, np.array([Payload(sentinel)] * rows, dtype=object), allow_pickle=True)
    # refused as unreadable: memory-mapped, an object array cannot even be opened (and nothing is unpickled)
    with pytest.raises(Exception, match=r"_embeddings\.npy: unreadable \(.*(allow_pickle|Python objects)"):
        run_stages(config, ["cluster"], force=True, log=lambda m: None)
    assert not sentinel.exists()


def test_a_zarr_store_that_asks_for_a_pickle_codec_is_refused(tmp_path):
    import zarr

    store = tmp_path / "embeddings.zarr"
    group = zarr.open_group(str(store), mode="w", zarr_format=3)
    group.attrs["n_rows"] = 2
    group.create_array("embeddings", shape=(2, 4), dtype="float16")
    meta_path = store / "embeddings" / "zarr.json"
    meta = json.loads(meta_path.read_text())
    meta["codecs"].insert(0, {"name": "numcodecs.pickle", "configuration": {}})
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=r"embeddings/zarr.json: codec 'numcodecs.pickle' is not allowed"):
        open_embeddings(tmp_path)


@pytest.mark.slow
def test_the_api_key_never_reaches_output_logs_or_report(tmp_path, demo_records):
    """`atlas run` with the openai engine against a server that fails a third of the time: the key is
    sent to the server and appears nowhere else: not in stdout/stderr, the run directory or the report."""
    secret = "sk-atlas-test-0123456789abcdef"
    docs = write_jsonl(tmp_path / "docs.jsonl", [r for r in demo_records if r["data_src"] == "python-docs"][:4])
    with FaultServer(mode="mixed", fault_rate=0.3, seed=3) as server:
        llm = {"engine": "openai", "base_url": server.base_url, "model": "m", "timeout_s": 1.0, "max_retries": 1,
               "backoff_s": 0.01, "api_key_env": "ATLAS_SECRET_KEY"}
        config = write_config(tmp_path, docs, llm=llm, tag={"batch_size": 8})
        env = dict(os.environ, ATLAS_SECRET_KEY=secret)
        done = subprocess.run([sys.executable, "-m", "atlas.cli", "run", str(config), "--stages", "chunk,tag",
                               "--inline"], env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]
        assert server.headers and all(h["authorization"] == f"Bearer {secret}" for h in server.headers)
    subprocess.run([sys.executable, "-m", "atlas.cli", "report", str(tmp_path / "run")], env=env,
                   capture_output=True, text=True, timeout=300)
    assert secret not in done.stdout + done.stderr
    files = [p for p in (tmp_path / "run").rglob("*") if p.is_file()]
    assert any(p.name == "manifest.json" for p in files)
    for path in files:
        assert secret.encode() not in path.read_bytes(), path


def test_names_from_configs_and_commands_cannot_leave_the_run(tmp_path):
    run = RunDir(tmp_path / "run")
    for name in ("../outside", "/etc", "chunks/../../outside"):
        with pytest.raises(ValueError, match="inside the run directory"):
            run.output_dir(name)
    for name in ("../../outside", "/tmp/x", "a/b", ".."):
        with pytest.raises(ValueError, match="RUN/cblm/<name>"):
            TrainConfig.from_overrides(str(tmp_path / "run"), [f"name={name}"])
    with pytest.raises(Exception, match="name"):
        load_config(write_config(tmp_path, tmp_path / "docs.jsonl", name="../escape"))


def test_hostile_ids_domains_and_sources_in_the_corpus_stay_data(tmp_path):
    """Document ids, domains and sources go into rows, never into file names."""
    hostile = "../../escaped"
    records = [{"id": f"{hostile}/{i}", "text": "A sentence about planets. Another one about moons. " * 5,
                "domain": hostile, "data_src": "/tmp/escaped"} for i in range(3)]
    inside = tmp_path / "work"
    inside.mkdir()
    docs = write_jsonl(inside / "docs.jsonl", records)
    config = load_config(write_config(inside, docs, input={"domain_field": "domain", "data_src_field": "data_src"}))
    before = sorted(p for p in tmp_path.rglob("*"))
    run_stages(config, ["chunk", "tag"], log=lambda m: None)
    created = sorted(set(tmp_path.rglob("*")) - set(before))
    outside = [p for p in created if not p.is_relative_to(inside / "run")]
    assert not outside, outside
    assert not Path("/tmp/escaped").exists()
    chunks = RunDir(inside / "run").output_dir("chunks")
    import pyarrow.parquet as pq

    table = pq.read_table(chunks).to_pydict()
    assert set(table["domain"]) == {hostile} and table["doc_id"][0].startswith(hostile)
