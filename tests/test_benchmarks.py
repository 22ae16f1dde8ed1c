"""The benchmarks at tiny sizes: run_all.py gives complete result rows and skips a missing input; the LLM client,
scale and concept-seed benchmarks run end to end."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FIELDS = {"benchmark", "case", "atlas", "baseline", "unit", "ratio", "better", "baseline_name"}


def test_run_all_louvain_tiny(tmp_path):
    out = tmp_path / "bench.md"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "run_all.py"), "--only", "louvain,corpus",
         "--run", str(tmp_path / "no-run"), "--args", "louvain=--n 1000 --topics 100 --repeats 1",
         "--out", str(out), "--timeout", "120"],
        cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.with_suffix(".json").read_text())
    status = {b["name"]: b["status"] for b in result["benchmarks"]}
    assert status["louvain"] == "ok", status
    assert status["corpus"].startswith("skipped:"), status  # no trained annotator in the run given
    rows = result["rows"]
    assert rows and all(r["benchmark"] == "louvain" for r in rows)
    for r in rows:
        assert FIELDS <= set(r), r
        assert r["better"] in ("higher", "lower")
        assert r["atlas"] > 0 and r["baseline"] > 0 and r["ratio"] > 0
    table = out.read_text()
    assert "community step" in table and "skipped:" in table
    assert table in proc.stdout  # the same table is printed


def test_llm_client_benchmark_tiny(tmp_path):
    """bench_llm_client.py against its loopback server: rows for the window, the batch barrier and bare httpx."""
    out = tmp_path / "llm.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_llm_client.py"), "--n", "60", "--concurrency", "8",
         "--median", "0.02", "--batch-size", "16", "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads(out.read_text())
    assert [r["case"].split(":")[0] for r in rows] == ["window", "batch", "floor", "window vs batch barrier"]
    for r in rows:
        assert FIELDS <= set(r) and r["atlas"] > 0 and r["baseline"] > 0 and r["ratio"] > 0, r
    assert "window" in proc.stdout and "ideal" in proc.stdout


def test_scale_benchmark_tiny(tmp_path):
    """bench_scale.py on a hand-made source run: every global stage runs at two sizes, and the rows hold the time
    growth and RSS ratio of each."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    source = tmp_path / "source"
    words = ["graph", "matrix", "python", "prime number", "binary search", "sorting", "limit", "vector space"]
    texts = [f"Sentence {i} is about {words[i % 8]} and {words[(i * 3) % 8]}. It has a second sentence here."
             for i in range(40)]
    (source / "chunks").mkdir(parents=True)
    (source / "tags").mkdir()
    pq.write_table(pa.table({"chunk_id": [f"d:{i:05d}" for i in range(40)], "chunk_text": texts}),
                   source / "chunks" / "part-00000.parquet")
    rows = [(f"d:{i:05d}", ("main", "minor", "purpose")[j % 3], words[(i + j) % 8])
            for i in range(40) for j in range(4)]
    pq.write_table(pa.table({"chunk_id": [r[0] for r in rows], "field": [r[1] for r in rows],
                             "tag_norm": [r[2] for r in rows]}), source / "tags" / "part-00000.parquet")
    out = tmp_path / "scale.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_scale.py"), "--source", str(source), "--sizes", "300,600",
         "--k", "8", "--workdir", str(tmp_path), "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads(out.read_text())
    stages = ["vocab", "cluster", "coherence", "label", "library", "targets", "export"]
    assert [r["case"].split(" ")[0] for r in rows] == [s for s in stages for _ in range(2)]
    for r in rows:
        assert FIELDS <= set(r) and r["atlas"] > 0 and r["baseline"] > 0 and r["ratio"] > 0, r
    assert "time growth" in proc.stdout and not list(tmp_path.glob("bench-scale-*"))  # the runs are removed


@pytest.mark.slow
def test_concept_seeds_benchmark_on_a_trained_run(run_copy, trained, tmp_path, monkeypatch):
    """bench_concept_seeds.py on the small trained run: a failed atlas command fails the bench and leaves the seed
    unfinished; then the seed is a re-clustered copy with both eval reports, the table and the rows hold its ratios,
    a second call reuses the finished seed, reports of other evals are evaluated again without re-clustering, and
    another config or new tags in the source make it stale (one seed: each costs a re-clustering and two evals)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import yaml

    for part in sorted((run_copy / "chunks").glob("part-*.parquet")):  # one source of three labels (its documents'
        table = pq.read_table(part)                                    # sources), so the evals have one to compare
        i = table.schema.get_field_index("data_src")
        pq.write_table(table.set_column(i, table.schema.field(i), pa.array(["merged"] * len(table))), part)
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(trained[0].model_dump(mode="json") | {"run_dir": str(run_copy)}))
    out, workdir = tmp_path / "seeds.json", tmp_path / "seeds"
    command = [sys.executable, str(ROOT / "benchmarks" / "bench_concept_seeds.py"), "--config", str(config),
               "--run", str(run_copy), "--seeds", "1", "--workdir", str(workdir), "--json", str(out)]

    failed = subprocess.run([*command[:3], str(tmp_path / "absent.yaml"), *command[4:]], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)  # atlas run fails: so does the bench
    assert failed.returncode == 1 and "exited with 2; the seeds finished before it are kept" in failed.stderr
    assert (workdir / "seed1").is_dir() and not (workdir / "seed1" / "bench_seed.json").exists()

    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=400)  # goes on from the copy
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    seed_run = workdir / "seed1"
    assert json.loads((seed_run / "bench_seed.json").read_text()) == {"library_seed": 1, "label_field": "label"}
    assert json.loads((seed_run / "manifest.json").read_text())["config"]["library"]["seed"] == 1
    assert not (run_copy / "bench_seed.json").exists()  # the source run is only read
    rows = json.loads(out.read_text())
    assert sorted(r["case"] for r in rows) == ["annotator merged homogeneity", "annotator merged probe",
                                              "library merged homogeneity", "library merged probe"]
    for r in rows:
        assert FIELDS <= set(r) and r["atlas"] > 0 and r["baseline"] == 1.0 and "seeds 1: min " in r["note"], r
    assert "library    merged" in proc.stdout and "2 cells (sources x evals x seeds)" in proc.stdout

    again = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "seed 1: evaluated before" in again.stdout and "$ atlas" not in again.stdout
    assert json.loads(out.read_text()) == rows
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from bench_concept_seeds import clustered, evaluated

    # a report of other evals (another eval_version) is evaluated again, on the same clustering
    report = seed_run / "report" / "library_eval.json"
    report.write_text(json.dumps(json.loads(report.read_text()) | {"eval_version": 1}))
    assert clustered(config, run_copy, seed_run, 1, "label") and not evaluated(config, run_copy, seed_run, 1, "label")
    redone = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert redone.returncode == 0, redone.stdout[-3000:] + redone.stderr[-3000:]
    assert "evaluating it again" in redone.stdout and "$ atlas eval library" in redone.stdout
    assert "$ atlas run" not in redone.stdout and evaluated(config, run_copy, seed_run, 1, "label")
    # a config (or an Atlas) that would compute the library otherwise makes the finished seed stale: it is redone

    changed = tmp_path / "changed.yaml"
    settings = yaml.safe_load(config.read_text())
    settings["library"]["lift_min_support"] += 1
    changed.write_text(yaml.safe_dump(settings))
    assert evaluated(config, run_copy, seed_run, 1, "label") and not evaluated(changed, run_copy, seed_run, 1, "label")
    retagged = tmp_path / "retagged"  # and so does a source run whose tags are no longer those copied
    manifest = json.loads((run_copy / "manifest.json").read_text())
    manifest["stages"]["vocab"]["hash"] = "another"
    retagged.mkdir()
    (retagged / "manifest.json").write_text(json.dumps(manifest))
    assert not evaluated(config, retagged, seed_run, 1, "label")
