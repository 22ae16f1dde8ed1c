"""benchmarks/run_all.py: one benchmark at a tiny size gives complete result rows; a missing input is skipped."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

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
