"""Run every benchmark, each against its baseline measured in the same run, and print one table of ratios.

    .venv/bin/python benchmarks/run_all.py [--size quick|full] [--only chunk,louvain] [--run runs/dev]
                                           [--corpus PATH] [--out runs/bench/latest.md] [--timeout SECONDS]
                                           [--args "louvain=--n 2000 --repeats 1" ...]

Each bench script runs as a subprocess with the size preset's arguments and ``--json`` (its result rows, see
``_results.py``); its output goes to ``<out folder>/logs/NAME.log``. ``quick`` (default) takes roughly 10-15 minutes
on 2 busy CPU cores; ``full`` uses the scripts' own defaults (hours on a CPU: k-means and the index at 1M vectors).
A benchmark whose input is missing is "skipped", one that exits non-zero (or runs past ``--timeout``) is "failed"
with its last output line; the others still run. The table goes to stdout, to ``--out`` (Markdown) and, with every
row and each benchmark's status, time and command, to the same path with ``.json``.

The ratio of a row is atlas/baseline or baseline/atlas (column "ratio is"); the arrow says which way is better for
atlas: a speed-up baseline/atlas ^ above 1 means atlas is faster.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

# (name, script and the arguments of both sizes, quick arguments, full arguments, inputs that must exist).
# {run} and {corpus} are filled in from --run and --corpus.
BENCHMARKS = [
    ("chunk", ["bench_chunk.py", "--corpus", "{corpus}"], ["--repeats", "2"], [], ["{corpus}"]),
    ("tag_offline", ["bench_tag_offline.py", "--chunks", "{run}/chunks"], ["--n", "128"], [], ["{run}/chunks"]),
    # quick: the latency's shape at a third of its scale (median 0.1 s), so the three modes take ~30 s together
    ("llm_client", ["bench_llm_client.py"], ["--n", "900", "--concurrency", "16", "--median", "0.1"], [], []),
    ("kmeans", ["bench_kmeans.py"], ["--n", "50000", "--ks", "100,500"], [], []),
    ("louvain", ["bench_louvain.py"], ["--n", "20000", "--repeats", "2"], [], []),
    ("corpus", ["bench_corpus.py", "--run", "{run}"], ["--chunks", "100", "--rss", "300,1000"], [],
     ["{run}/annotator/config.json"]),
    ("index", ["bench_index.py"], ["--n", "100000", "--variants", "mem"], [], []),
    # the global stages at growing corpus sizes (synthetic, drawn from the run's chunks and tags); full: 10k-1M
    # chunks and vocab on 20M tag rows (about half an hour on 2 CPU cores)
    ("scale", ["bench_scale.py", "--source", "{run}"], ["--sizes", "5000,50000"], ["--tag-rows", "20000000"],
     ["{run}/chunks", "{run}/tags"]),
    # --fresh: a reused model would report ~0 s of training; the bench models are RUN/cblm/bench-ar-*.
    # quick: val_fraction 0.02, as the final evaluation reads every held-out window
    ("cblm", ["bench_cblm.py", "--run", "{run}", "--fresh"],
     ["--set", "max_steps=50", "--set", "batch_size=4", "--set", "val_fraction=0.02", "--strengths", "0.5",
      "--prompt", "The"], [],
     ["{run}/tokens", "{run}/library"]),
    # the seeds' interpretable models at one budget: plain, concept bottleneck, PRISM, ProtoT, pi-RoPE
    ("cblm-models", ["bench_cblm.py", "--run", "{run}", "--fresh", "--architectures",
                     "baseline,concepts,prism,prism-unit,protot,pi-rope"],
     ["--set", "max_steps=50", "--set", "batch_size=4", "--set", "val_fraction=0.02"], [],
     ["{run}/tokens", "{run}/library"]),
]


def run_one(name: str, command: list[str], logs: Path, timeout: float | None) -> dict:
    """Run one bench script; its status ("ok" / "failed: ...") and result rows."""
    json_path, log = logs / f"{name}.json", logs / f"{name}.log"
    json_path.unlink(missing_ok=True)
    command = [sys.executable, str(HERE / command[0]), *command[1:], "--json", str(json_path)]
    start = time.perf_counter()
    with log.open("w") as out:  # own process group, so a timeout or Ctrl-C also ends its worker processes
        proc = subprocess.Popen(command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout)
        except (subprocess.TimeoutExpired, KeyboardInterrupt) as e:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            if isinstance(e, KeyboardInterrupt):
                raise
            rc = f"timed out after {timeout:.0f} s"
    result = {"name": name, "command": command, "log": str(log), "seconds": round(time.perf_counter() - start, 1)}
    if rc == 0 and json_path.exists():
        return result | {"status": "ok", "rows": json.loads(json_path.read_text())}
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    reason = rc if isinstance(rc, str) else (lines[-1].strip() if lines else f"exit code {rc}")
    if rc == 0:
        reason = "no results written"
    return result | {"status": f"failed: {reason}", "rows": []}


def fmt(x) -> str:
    if x is None:
        return "-"
    return f"{x:,.0f}" if abs(x) >= 1000 else f"{x:.2f}" if abs(x) >= 1 else f"{x:.4f}" if x else "0"


def table(results: list[dict]) -> str:
    lines = [["benchmark", "case", "atlas", "baseline", "ratio", "ratio is", "note"]]
    for r in results:
        if r["status"] != "ok":
            lines.append([r["name"], r["status"], "", "", "", "", ""])
        for row in r["rows"]:
            unit = row["unit"]
            lines.append([row["benchmark"], row["case"], f"{fmt(row['atlas'])} {unit}",
                          f"{fmt(row['baseline'])} {unit} ({row['baseline_name']})",
                          "-" if row["ratio"] is None else f"{row['ratio']:.2f}",
                          row["ratio_is"].replace("baseline", "base") + (" ^" if row["better"] == "higher" else " v"),
                          row.get("note", "")])
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    out = ["| " + " | ".join(c.ljust(w) for c, w in zip(line, widths)) + " |" for line in lines]
    out.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(out) + "\n\n^ higher ratio is better for atlas, v lower is better\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=["quick", "full"], default="quick")
    parser.add_argument("--only", default="", help="comma-separated benchmark names: "
                        + ", ".join(b[0] for b in BENCHMARKS))
    parser.add_argument("--run", default="runs/dev", help="a fully processed run (tag_offline, corpus, cblm)")
    parser.add_argument("--corpus", default=str(ROOT.parent / "shared" / "data" / "dev" / "corpus.parquet"),
                        help="Parquet corpus for the chunk benchmark")
    parser.add_argument("--out", type=Path, default=Path("runs/bench/latest.md"), help="Markdown table; .json beside")
    parser.add_argument("--timeout", type=float, default=None, help="seconds per benchmark (default: none)")
    parser.add_argument("--args", action="append", default=[], metavar="NAME=ARGS",
                        help="more arguments for one benchmark, after the preset's (a repeated option: the last wins)")
    args = parser.parse_args()
    only = {n for n in args.only.split(",") if n}
    extra = {name: shlex.split(value) for name, _, value in (a.partition("=") for a in args.args)}
    unknown = (only | set(extra)) - {b[0] for b in BENCHMARKS}
    if unknown:
        parser.error(f"unknown benchmark(s) {sorted(unknown)}; known: {[b[0] for b in BENCHMARKS]}")

    out = args.out if args.out.is_absolute() else ROOT / args.out
    logs = out.parent / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    run = Path(args.run) if Path(args.run).is_absolute() else ROOT / args.run
    fill = {"run": str(run), "corpus": args.corpus}
    started, results = time.perf_counter(), []
    for name, command, quick, full, needs in BENCHMARKS:
        if only and name not in only:
            continue
        missing = [p.format(**fill) for p in needs if not Path(p.format(**fill)).exists()]
        if missing:
            results.append({"name": name, "status": f"skipped: {missing[0]} not found", "rows": [], "seconds": 0})
        else:
            command = [a.format(**fill) for a in command + (quick if args.size == "quick" else full)]
            command += extra.get(name, [])
            print(f"[{name}] {' '.join(command)}", flush=True)
            results.append(run_one(name, command, logs, args.timeout))
        print(f"[{name}] {results[-1]['status']} ({results[-1]['seconds']:.0f} s)", flush=True)

    total = time.perf_counter() - started
    text = (f"# Benchmarks, size {args.size} ({total / 60:.1f} min; "
            + ", ".join(f"{r['name']} {r['seconds']:.0f} s" for r in results) + ")\n\n" + table(results))
    print("\n" + text)
    out.write_text(text)
    out.with_suffix(".json").write_text(json.dumps(
        {"size": args.size, "seconds": round(total, 1), "benchmarks": results,
         "rows": [row for r in results for row in r["rows"]]}, indent=2) + "\n")
    print(f"written: {out} and {out.with_suffix('.json')}; logs in {logs}")


if __name__ == "__main__":
    main()
