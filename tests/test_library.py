"""From tags to the concept library: cluster, coherence, label, dedup, artifact, evaluation."""

import json

import numpy as np
import pyarrow.parquet as pq
import pytest
from conftest import write_config, write_jsonl
from fault_server import FaultServer
from test_tag_stage import openai_sections

from atlas.cli import main
from atlas.config import load_config
from atlas.core.rundir import RunDir
from atlas.models.labeler import make_unique
from atlas.runner import run_stages
from atlas.stages.cluster import choose_k
from atlas.stages.coherence import cohesion_score, strata

pytestmark = pytest.mark.slow  # loads the embedding model
STAGES_TO_LIBRARY = ["chunk", "tag", "vocab", "cluster", "coherence", "label", "library"]


def library_files(run_dir):
    folder = run_dir / "library"
    return {name: (folder / name).read_bytes()
            for name in ("concepts.parquet", "tag_to_concept.parquet", "config.json")}


@pytest.fixture(scope="module")
def labeled_docs(tmp_path_factory, demo_records):
    picked = [r for r in demo_records if r["data_src"] == "python-docs"][:6] + \
             [r for r in demo_records if r["data_src"] == "python-math-docs"][:6]
    records = [dict(r, label=r["data_src"]) for r in picked]
    return write_jsonl(tmp_path_factory.mktemp("library") / "docs.jsonl", records)


def offline_library(folder, docs):
    config = load_config(write_config(folder, docs, input={"metadata_fields": ["label"]},
                                      library={"ks": [8, 16, 32]}, tag={"batch_size": 64}))
    run_stages(config, STAGES_TO_LIBRARY, log=lambda m: None)
    return config


def test_offline_library_is_deterministic_and_keeps_its_contract(tmp_path, labeled_docs, capsys):
    config = offline_library(tmp_path, labeled_docs)
    first = library_files(tmp_path / "run")
    run_stages(config, ["vocab", "cluster", "coherence", "label", "library"], force=True, log=lambda m: None)
    assert library_files(tmp_path / "run") == first  # same seed, same library

    run = RunDir(config.run_dir)
    concepts = pq.read_table(run.output_dir("library") / "concepts.parquet").to_pylist()
    mapping = pq.read_table(run.output_dir("library") / "tag_to_concept.parquet").to_pylist()
    coherence = {r["cluster_id"]: r for r in pq.read_table(run.part_path("coherence", 0)).to_pylist()}
    sweep = json.loads((run.output_dir("clusters") / "_sweep.json").read_text())
    assert [row["k"] for row in sweep["sweep"]] == [8, 16, 32] and sweep["chosen_k"] in (8, 16, 32)
    assert concepts and [c["concept_id"] for c in concepts] == list(range(len(concepts)))
    aux = [c for c in concepts if c["domain"] != "content"]  # the auxiliary labels follow the content concepts
    assert [c["domain"] for c in aux] == ["tone"] * 80 + ["demographic"] * 38 + ["alignment"] * 8
    concepts = concepts[: len(concepts) - len(aux)]
    assert len({c["name"] for c in concepts}) == len(concepts)
    assert all(c["chunk_count"] > 0 and 0 < c["prevalence"] <= 1 and c["domain"] == "content" for c in concepts)
    assert all(1 <= len(c["name"].split()) <= 8 and c["description"].endswith(".") for c in concepts)
    kept = {cluster for cluster, row in coherence.items() if row["kept"]}
    assert {m for c in concepts for m in c["merged_from"]} == kept
    for row in mapping:
        assert (row["concept_id"] is None) == (row["cluster_id"] not in kept)
    assert (run.root / "report" / "k_sweep.png").exists() and (run.root / "report" / "concept_map.png").exists()

    capsys.readouterr()
    assert main(["eval", "library", str(run.root), "--label-field", "label", "--sample", "5"]) == 0
    summary = json.loads((run.root / "report" / "library_eval.json").read_text())
    assert summary["labels"] == 2 and 0 < summary["purity"] <= 1 and 0 <= summary["nmi"] <= 1
    assert summary["relevance"]["is_proxy"] and summary["relevance"]["chunks_judged"] == 5
    assert main(["inspect", str(run.root), "library", "-n", "2"]) == 0
    assert "concept 0:" in capsys.readouterr().out


def test_llm_engine_judges_coherence_and_names_concepts(tmp_path, labeled_docs):
    with FaultServer(mode="ok") as server:
        sections = openai_sections(server)
        library = {"k": 10, "core_min": 1, "random_min": 1, "edge_min": 1}  # whatever the fake judge says
        annotator = {"epochs": 2, "judge_sample": 3}
        config = load_config(write_config(tmp_path, labeled_docs, **sections, library=library, annotator=annotator))
        run_stages(config, log=lambda m: None)
        prompts = [r["messages"][0]["content"] for r in server.requests]
    assert any("coherent concept" in p for p in prompts) and any("You name concepts" in p for p in prompts)
    assert any("You label short text chunks" in p for p in prompts)  # auxiliary labels from the LLM
    run = RunDir(config.run_dir)
    targets = pq.read_table(run.part_path("targets", 0)).to_pylist()
    assert targets and all(t["aux_status"] == "ok" and t["tone_global_ids"] for t in targets)
    assert (run.output_dir("annotator") / "model.safetensors").exists()
    concepts = pq.read_table(run.output_dir("library") / "concepts.parquet").to_pylist()
    assert len({c["name"] for c in concepts}) == len(concepts)


def test_small_pieces():
    assert choose_k([{"k": 10, "silhouette": 0.2, "davies_bouldin": 2.0},
                     {"k": 20, "silhouette": 0.3, "davies_bouldin": 2.5},
                     {"k": 40, "silhouette": float("nan"), "davies_bouldin": float("nan")}]) == 20
    same = np.tile(np.eye(4)[0], (5, 1))
    assert cohesion_score(same) == 10 and cohesion_score(np.eye(4)) <= 3 and cohesion_score(same[:1]) == 10
    members = np.arange(30)
    sets = strata(members, np.linspace(1, 0, 30), 10, np.random.default_rng(0))
    assert list(sets["core"]) == list(range(10)) and list(sets["edge"]) == list(range(20, 30))
    assert len(set(sets["random"])) == 10
    assert make_unique(["python", "python", "python"], [["python", "snake"], ["python", "snake"], []]) == [
        "python", "python (snake)", "python 2"]
