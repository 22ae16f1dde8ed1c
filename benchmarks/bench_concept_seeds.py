"""Concept quality over library seeds: re-cluster a finished run at several ``library.seed`` values and compare each
library and annotator with plain clustering, so that a ratio near 1 is read over seeds, not from one draw.

    python benchmarks/bench_concept_seeds.py --config configs/dev.yaml --run runs/dev [--seeds 0,1,2,3,4]
                                             [--workdir runs/seeds] [--label-field label] [--json PATH]

For each seed S the run is copied to WORKDIR/seedS, without the outputs of annotate, tokenize and index (a new
library makes them stale), then re-clustered and evaluated with the CLI:

    atlas run CONFIG --run-dir WORKDIR/seedS --set library.seed=S --force \\
        --stages cluster,coherence,label,library,targets,train_annotator
    atlas eval library WORKDIR/seedS --label-field FIELD
    atlas eval annotator WORKDIR/seedS --label-field FIELD

On the dev corpus a seed takes about 9 minutes on 2 quiet CPU cores (5-6 to re-cluster, 4 to evaluate). A seed is done
when both evals are (WORKDIR/seedS/bench_seed.json says so) and its stages are those this config and this Atlas would
compute from the source run's tags as they are now, and its reports were written by these evals (their eval_version);
a done seed is not redone, so after a stop the same command goes on where it was, and after an upgrade, a change of
the config or new tags in the source run it redoes the seeds that makes stale (new tags: from a new copy; evals of
other rules: the evals only).

Prints, per labelled source and eval (library: the concepts the tags inherit; annotator: its calibrated
probabilities), the top-concept homogeneity ratio concepts / k-means at each seed, their mean and minimum, and how
many seeds put it below or above k-means beyond the labelled sample's noise (its 95% interval wholly under or over
1); then the probe ratios concept / raw embedding the same way. See docs/quality.md for what each figure means.
With ``--json``: one row per source, eval and figure (the mean over seeds as ``atlas``, 1 as the baseline).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
from _results import add_json_option, row, write_json

from atlas.core.rundir import RunDir
from atlas.io import layout

RECLUSTER_STAGES = "cluster,coherence,label,library,targets,train_annotator"
TAGS_STAGE = "vocab"  # the stage before them, copied from the source run
STALE_OUTPUTS = (layout.ANNOTATED, layout.EMBEDDINGS, layout.TOKENS, layout.INDEX)  # downstream of the library
REPORTS = {"library": "library_eval.json", "annotator": "annotator_probe.json"}  # written by `atlas eval`
DONE = "bench_seed.json"  # written in the seed's run directory once both evals are done


class CommandFailed(Exception):
    pass


def atlas(*args: str) -> None:
    """Run the atlas CLI of this interpreter (its output streams to ours); CommandFailed if it exits non-zero."""
    print("$ atlas " + " ".join(args), flush=True)
    code = subprocess.run([sys.executable, "-m", "atlas.cli", *args]).returncode
    if code != 0:
        raise CommandFailed(f"`atlas {' '.join(args)}` exited with {code}")


def tags_hash(run: Path) -> str | None:
    """The hash of the run's vocab stage, which chains those of its chunks and tags: what a seed's copy re-clusters."""
    return RunDir(run).read_manifest().get("stages", {}).get(TAGS_STAGE, {}).get("hash")


def clustered(config: Path, run: Path, seed_run: Path, seed: int, label_field: str) -> bool:
    """The library clustered with ``seed`` was evaluated on ``label_field`` once (a copied run's own reports are not:
    they are the source run's), on the source run's tags as they are now, and its stages are what this config and
    this Atlas would compute: a seed clustered before a change of any of these is redone."""
    from atlas.config import load_config
    from atlas.runner import RunConflict, StageFailed, check_run

    done = seed_run / DONE
    if not done.is_file() or json.loads(done.read_text()) != {"library_seed": seed, "label_field": label_field}:
        return False
    if tags_hash(seed_run) != tags_hash(run):
        return False
    try:
        checked = check_run(load_config(config, [f"library.seed={seed}"], run_dir=seed_run),
                            RECLUSTER_STAGES.split(","), plan_only=True)
    except (RunConflict, StageFailed):  # a stage of another identity (another config or version), or unfinished
        return False
    return all(stage.done for stage in checked)


def reports_current(seed_run: Path) -> bool:
    """Both eval reports are there and were written by these evals (``EVAL_VERSION``): reports of other rules
    (another choice of a document's top concept) are evaluated again, on the same clustering."""
    from atlas.tools.evaluate import EVAL_VERSION

    paths = [seed_run / layout.REPORT / name for name in REPORTS.values()]
    return all(p.is_file() and json.loads(p.read_text()).get("eval_version") == EVAL_VERSION for p in paths)


def evaluated(config: Path, run: Path, seed_run: Path, seed: int, label_field: str) -> bool:
    """The seed is clustered as this config and Atlas would (``clustered``) and its reports are current."""
    return clustered(config, run, seed_run, seed, label_field) and reports_current(seed_run)


def run_seed(config: Path, run: Path, workdir: Path, seed: int, label_field: str) -> Path:
    seed_run = workdir / f"seed{seed}"
    if evaluated(config, run, seed_run, seed, label_field):
        print(f"seed {seed}: evaluated before ({seed_run})", flush=True)
        return seed_run
    if clustered(config, run, seed_run, seed, label_field):
        print(f"seed {seed}: clustered before ({seed_run}); its reports are of other evals: evaluating it again",
              flush=True)
    else:
        if seed_run.is_dir() and tags_hash(seed_run) != tags_hash(run):  # the source's tags changed since the copy
            print(f"seed {seed}: {seed_run} holds tags that {run} no longer has; copying it again", flush=True)
            shutil.rmtree(seed_run)
        if not seed_run.is_dir():  # copied under another name first, so a stopped copy is never taken for a run
            print(f"seed {seed}: copying {run} to {seed_run}", flush=True)
            partial = seed_run.with_name(seed_run.name + ".partial")
            shutil.rmtree(partial, ignore_errors=True)
            shutil.copytree(run, partial, ignore=lambda folder, names: [n for n in names if Path(folder) == run
                                                                        and n in (*STALE_OUTPUTS, DONE)])
            partial.rename(seed_run)
        atlas("run", str(config), "--run-dir", str(seed_run), "--set", f"library.seed={seed}", "--force",
              "--stages", RECLUSTER_STAGES)
    for what in REPORTS:
        atlas("eval", what, str(seed_run), "--label-field", label_field)
    (seed_run / DONE).write_text(json.dumps({"library_seed": seed, "label_field": label_field}) + "\n")
    return seed_run


def read_reports(seed_run: Path) -> dict[str, dict]:
    return {what: json.loads((seed_run / layout.REPORT / name).read_text())["per_source"]
            for what, name in REPORTS.items()}


def _beyond(bound: float | None, below: bool) -> bool:
    """An interval bound on the far side of 1 (None: no interval, a source too small to bootstrap)."""
    return bound is not None and (bound < 1 if below else bound > 1)


def summarize(per_seed: dict[int, dict[str, dict]]) -> list[dict]:
    """One entry per (eval, source) with a homogeneity ratio at every seed: the ratios, the probe ratios, and the
    seeds below / above k-means beyond the noise."""
    seeds = sorted(per_seed)
    first = per_seed[seeds[0]]
    out = []
    for what in REPORTS:
        for source, entry in first[what].items():
            if entry.get("homogeneity_ratio") is None:
                continue  # skipped (no labels) at this seed
            cells = [per_seed[s][what].get(source, {}) for s in seeds]
            if any(c.get("homogeneity_ratio") is None for c in cells):
                continue
            out.append({
                "eval": what, "source": source,
                "ratios": [c["homogeneity_ratio"] for c in cells],
                "probes": [c["probe"]["ratio"] for c in cells],
                "below": sum(_beyond(c["homogeneity_ratio_interval"]["high"], below=True) for c in cells),
                "above": sum(_beyond(c["homogeneity_ratio_interval"]["low"], below=False) for c in cells),
            })
    return out


def print_table(seeds: list[int], summary: list[dict]) -> None:
    head = " ".join(f"{f's{s}':>6}" for s in seeds)

    def block(title: str, key: str, counts: bool) -> None:
        counts_head = " below above" if counts else ""
        print(f"\n{title}\n{'eval':10} {'source':12} {head} {'mean':>6} {'min':>6}{counts_head}")
        for e in summary:
            cells = " ".join(f"{r:6.3f}" for r in e[key])
            print(f"{e['eval']:10} {e['source']:12} {cells} {np.mean(e[key]):6.3f} {min(e[key]):6.3f}"
                  + (f" {e['below']:5} {e['above']:5}" if counts else ""))

    block("homogeneity ratio, concepts / k-means at the same k (below / above: seeds whose 95% interval is wholly "
          "under / over 1)", "ratios", counts=True)
    block("probe ratio, concept vector / raw embedding", "probes", counts=False)
    n = len(summary) * len(seeds)
    below, above = sum(e["below"] for e in summary), sum(e["above"] for e in summary)
    print(f"\n{n} cells (sources x evals x seeds): {below} below k-means beyond the noise, {above} above, "
          f"{n - below - above} tie")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, required=True, help="the run's config (e.g. configs/dev.yaml)")
    parser.add_argument("--run", type=Path, required=True, help="a finished run directory to copy (e.g. runs/dev)")
    parser.add_argument("--seeds", default="0,1,2,3,4", help="library.seed values, comma-separated (default 0-4)")
    parser.add_argument("--workdir", type=Path, default=Path("runs/seeds"),
                        help="where the re-clustered copies go, one folder per seed (default runs/seeds)")
    parser.add_argument("--label-field", default="label", help="the metadata field of the documents' labels")
    add_json_option(parser)
    args = parser.parse_args()
    if not (args.run / layout.TAG_VOCAB / "_SUCCESS").is_file():
        parser.error(f"--run {args.run}: not a run whose tags are done ({layout.TAG_VOCAB}/_SUCCESS is missing); "
                     f"run `atlas run {args.config}` first")
    seeds = [int(s) for s in args.seeds.split(",")]
    try:
        per_seed = {s: read_reports(run_seed(args.config, args.run, args.workdir, s, args.label_field))
                    for s in seeds}
    except CommandFailed as e:
        parser.exit(1, f"error: {e}; the seeds finished before it are kept: fix the cause and run the same command\n")
    summary = summarize(per_seed)
    print_table(seeds, summary)
    write_json(args.json, [
        row("concept_seeds", f"{e['eval']} {e['source']} {figure}", float(np.mean(e[key])), 1.0, "ratio",
            "k-means at the same k" if key == "ratios" else "raw-embedding probe",
            note=f"seeds {args.seeds}: min {min(e[key]):.3f}" + (f", below {e['below']}, above {e['above']}"
                                                                  if key == "ratios" else ""))
        for e in summary for figure, key in (("homogeneity", "ratios"), ("probe", "probes"))])


if __name__ == "__main__":
    main()
