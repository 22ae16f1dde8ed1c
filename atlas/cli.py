"""The ``atlas`` command line.

    atlas run CONFIG [--stages chunk] [--input PATH] [--run-dir DIR] [--set KEY=VALUE] [--force]
    atlas plan CONFIG                         prepare the run directory and shard plans (for SLURM)
    atlas stage NAME --run-dir RUN --shard I [--num-shards N]   run shard(s) of one stage
    atlas status RUN                          per stage: shards done/pending, counts, drops
    atlas inspect RUN chunks|tags [-n 5]      a few rows, readable
    atlas inspect RUN shard-labels [--label NAME -n 5 --random SEED]   labels the annotated shards hold, and chunks
    atlas judge RUN [--sample 200]            relevance of tags to chunks, 1-5 (offline: a proxy)
    atlas eval library RUN [--label-field L]  per source, by document: probes, top-concept homogeneity vs k-means
    atlas eval annotator RUN [--label-field L]  the same on the annotator's concepts, plus held-out chunk probes
    atlas annotate-text RUN "text" [...]      the concepts the trained annotator gives a text, with scores
    atlas search RUN "query" [-k 10]          the nearest training chunks, through the IVFPQ index
    atlas export RUN OUT [--push-to-hub DEST] the release view: chunks, concepts, field guide, co-occurrence
    atlas export-tokens RUN OUT --format megatron   the token shards as Megatron-LM indexed datasets (.bin/.idx)
    atlas report RUN                          (re)write RUN/report/index.html, the self-contained run report
    atlas estimate CONFIG [--sample-docs 200]  throughput on a sample -> projected hours per stage
    atlas demo-corpus OUT                     build the offline demo corpus
    atlas cblm train|eval|generate|attribute  the concept-bottleneck LM (see atlas/cblm/cli.py)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import shlex
import signal
import sys
import textwrap
from pathlib import Path

from atlas.core.signals import Terminated, sigterm_as_interrupt
from atlas.io import layout

EXAMPLES = """examples:
  atlas run configs/demo.yaml                       # the whole pipeline (as far as it exists)
  atlas run configs/demo.yaml --stages chunk        # only chunking
  atlas run my.yaml --input data/ --run-dir runs/x  # override input and output
  atlas run my.yaml --set chunk.domains.web.max_tokens=200
  atlas status runs/demo
  atlas inspect runs/demo chunks -n 3
  atlas inspect runs/demo shard-labels              # labels in the annotated shards, per label and data domain
  atlas inspect runs/demo shard-labels --label demographic:children -n 3 --random 1   # chunks carrying it
  atlas annotate-text runs/demo "Binary search halves the interval at every step."
  atlas cblm train runs/demo                        # a toy concept-bottleneck LM on the demo's token shards
"""


def _load(args) -> AtlasConfig:  # noqa: F821
    from atlas.config import load_config

    # Paths given on the command line are relative to where the command runs, not to the config.
    return load_config(args.config, list(args.set or []), input=getattr(args, "input", None) or None,
                       run_dir=getattr(args, "run_dir", None) or None)


def cmd_run(args) -> int:
    from atlas.core.files import confined_writes
    from atlas.core.lock import run_lock
    from atlas.io.remote_run import mirror_of
    from atlas.runner import check_run, run_stages

    config = _load(args)
    args.run_dir = config.run_dir  # main names the stage a Ctrl-C interrupted from it
    if args.inline:
        config.execution.orchestrator = "inline"
    if args.no_progress:
        config.execution.progress = False
    stages = args.stages.split(",") if args.stages else None
    mirror = mirror_of(config)  # a run_dir in object storage: its lock there too, and the local copy pulled
    where = config.run_url or config.run_dir
    with run_lock(config.run_dir, getattr(args, "command_line", None), mirror), confined_writes(config.run_dir):
        # Everything that can refuse the run (a conflict, a missing input, an unknown stage) is checked before
        # anything is written: a refused run leaves the run directory as it was, report included.
        checked = check_run(config, stages, args.force)
        reports, interrupted = [], False
        try:
            if config.execution.orchestrator == "prefect" and not all(c.done for c in checked):
                from flows.pipeline import run_with_prefect

                reports = run_with_prefect(config, stages, args.force)
            else:  # inline, or nothing to do (which needs no Prefect server)
                reports = run_stages(config, stages, args.force, checked=checked)
            if all(r.skipped for r in reports):
                print(f"Nothing to do: every stage is already done in {where}")
            else:
                print(f"Outputs in {where} (see `atlas status {where}`)")
        except KeyboardInterrupt:
            interrupted = True  # leave at once: the next run (or `atlas report RUN`) rewrites the report
            raise
        finally:
            # Also after a failure (no reports then): the report shows the failed shards and what was dropped so
            # far. A run that found nothing to do leaves an existing report as it is.
            run_dir = Path(config.run_dir)
            nothing_ran = (reports and all(r.skipped for r in reports)
                           and (run_dir / layout.REPORT / "index.html").exists())
            if not interrupted and not nothing_ran and (run_dir / "manifest.json").exists():
                from atlas.tools.report import refresh_report

                refresh_report(config.run_dir, mirror)
    return 0


def cmd_plan(args) -> int:
    from atlas.core.lock import run_lock
    from atlas.io.remote_run import mirror_of
    from atlas.runner import run_stages

    config = _load(args)
    stages = args.stages.split(",") if args.stages else None
    with run_lock(config.run_dir, getattr(args, "command_line", None), mirror_of(config)):
        run_stages(config, stages, args.force, plan_only=True)
    return 0


def cmd_stage(args) -> int:
    """One SLURM array task: takes no run lock, so the tasks of one planned run work side by side."""
    from atlas.config import config_from_dict
    from atlas.core.extras import require
    from atlas.core.rundir import RunDir
    from atlas.runner import run_one_shard
    from atlas.stages import STAGES

    run = RunDir(args.run_dir)
    manifest = run.read_manifest()
    info = manifest.get("stages", {}).get(args.name)
    if not info or not info.get("hash"):
        raise SystemExit(f"{run.root}: stage '{args.name}' is not planned; run `atlas plan CONFIG` first")
    if args.name not in STAGES:
        raise SystemExit(f"unknown stage '{args.name}'; stages are: {', '.join(STAGES)}")
    config = manifest["config"]
    if Path(config["run_dir"]).resolve() != run.root.resolve():
        # A copied or moved run: its manifest names the folder it was planned in, and every write goes here instead
        # (and, copied from a run kept in object storage, not to that bucket either).
        config = dict(config, run_dir=str(run.root.resolve()), run_url=None, local_copy=None)
    require(STAGES[args.name](config_from_dict(config)).extras(), f"stage '{args.name}'")
    n = info["num_shards"]
    shards = [s for s in range(n) if s % args.num_shards == args.shard]
    if not shards:  # a mis-sized SLURM array must not look green
        tasks = min(n, args.num_shards)
        raise UsageError(f"--shard {args.shard} selects none of the {n} shard(s) of stage '{args.name}': its tasks "
                         f"are 0 to {tasks - 1}; size the SLURM array to the plan (--array=0-{tasks - 1})")
    for shard in shards:
        if run.is_shard_done(STAGES[args.name].output, shard, info["hash"]):
            print(f"{args.name} shard {shard:05d}: already done")
            continue
        counters = run_one_shard(config, args.name, shard, info["hash"])
        print(f"{args.name} shard {shard:05d}: done {json.dumps(counters)}")
    return 0


def cmd_status(args) -> int:
    from atlas.core.rundir import RunDir
    from atlas.tools.status import format_status, status_rows

    run = RunDir(args.run_dir)
    if not run.manifest_path.exists():
        raise FileNotFoundError(f"{run.root}: not an Atlas run directory (no manifest.json)")
    print(json.dumps(status_rows(run), indent=1) if args.json else format_status(run))
    return 0


def _print_text(text: str, limit: int) -> None:
    shown = text if len(text) <= limit else text[:limit] + " [...]"
    print(textwrap.indent(shown, "    │ ", lambda line: True))


# Not an output folder (``labels`` is the label stage's): what the annotated parts hold, counted in them.
SHARD_LABELS = "shard-labels"


def cmd_inspect(args) -> int:
    from atlas.core.rundir import RunDir
    from atlas.io.chunks import read_chunks
    from atlas.io.library import load_library
    from atlas.io.tags import read_tags
    from atlas.stages import STAGES

    if args.what == SHARD_LABELS:
        _inspect_shard_labels(RunDir(args.run_dir), args)
        return 0
    if args.label is not None:
        raise UsageError(f"--label goes with `atlas inspect RUN {SHARD_LABELS}`, not with {args.what!r}")
    outputs = {stage.output: name for name, stage in STAGES.items()}
    if args.what not in outputs:
        raise UsageError(f"{args.what!r} is not an output folder; inspect one of: {', '.join(outputs)}")
    run = RunDir(args.run_dir)
    folder = run.output_dir(args.what)
    if not sorted(folder.glob("*.parquet")):
        raise FileNotFoundError(f"{folder}: no parts yet (try `atlas status {args.run_dir}`)")
    if args.what == "library":  # concepts, most used first (at random: among the content concepts)
        concepts = load_library(run)[0]
        if args.random is not None:
            concepts = [c for c in concepts if c["domain"] == "content"]
        for row in _rows(concepts, args):
            print("-" * 100)
            if row["domain"] != "content":  # an auxiliary label: from a fixed list, never counted here
                print(f"concept {row['concept_id']}: {row['name']}  ({row['domain']} label)")
            else:
                print(f"concept {row['concept_id']}: {row['name']}  ({row['chunk_count']} chunks, prevalence "
                      f"{row['prevalence']:.4f}, merged from {len(row['merged_from'])} cluster(s))")
            print(f"    {row['description']}")
            print(f"    evidence: {', '.join(row['evidence_tags'][:8])}")
            print(f"    lifted words: {', '.join(row['lifted_words'])}")
        return 0
    if args.what in ("annotator", "targets"):  # held-out predictions / training targets, with concept names
        _inspect_concepts(run, args)
        return 0
    if args.what == "tags":  # chunks with their tags, field by field
        chosen = list(dict.fromkeys(read_tags(run, ["chunk_id"]).column("chunk_id").to_pylist()))
        chosen = [chosen[i] for i in _row_indices(len(chosen), args)]
        tags = _tags_by_field(run, chosen)
        texts = _chunk_texts(run, chosen, read_chunks(run, chosen, ("domain", "n_tokens", "chunk_text")),
                             run.output_dir(layout.TAGS), "tag")
        for chunk_id in chosen:
            chunk = texts[chunk_id]
            print("-" * 100)
            print(f"chunk_id={chunk_id}  domain={chunk['domain']}  n_tokens={chunk['n_tokens']}")
            _print_text(chunk["chunk_text"], args.chars)
            for field, values in tags.get(chunk_id, {}).items():
                print(f"    {field}: {', '.join(values)}")
        return 0
    # The index stage has the annotate stage's shard count but writes one id map.
    parts = [run.part_path(args.what, 0)] if args.what == layout.INDEX else run.parts(args.what)
    for row in _part_rows(parts, args, f"recompute it: atlas run CONFIG --force --stages {outputs[args.what]}"):
        text = row.pop("chunk_text", None)
        print("-" * 100)
        shown = {k: (str(v) if len(str(v)) <= 120 else str(v)[:117] + "...") for k, v in row.items()}
        print("  ".join(f"{k}={v}" for k, v in shown.items() if k != "metadata"))
        if text is not None:
            _print_text(text, args.chars)
    return 0


def _inspect_shard_labels(run, args) -> None:
    """The label counts of the annotated parts; with ``--label``, ``-n`` chunks carrying it, drawn at random."""
    from atlas.io.library import load_library
    from atlas.tools.labels import find_labels, print_label_counts, print_label_sample

    concepts = load_library(run)[0]
    if args.label is None:
        print_label_counts(run, concepts)
        return
    found = find_labels(concepts, args.label)
    if len(found) != 1:
        which = "; ".join(f"{c['concept_id']} ({c['domain']})" for c in found) if found else "none"
        raise UsageError(f"--label {args.label!r} names {len(found)} concepts of the library ({which}); give "
                         "DOMAIN:NAME, a concept id, or a name from `atlas inspect RUN library`")
    print_label_sample(run, found[0], args.n, 0 if args.random is None else args.random, args.chars)


def _row_indices(total: int, args) -> list[int]:
    """The rows ``atlas inspect`` shows: the first ``-n``, or ``-n`` drawn at random with ``--random SEED``
    (in file order), so a reader sees typical rows, not only the first or the most used ones."""
    import numpy as np

    if args.random is None:
        return list(range(min(args.n, total)))
    rng = np.random.default_rng(args.random)
    return sorted(rng.choice(total, min(args.n, total), replace=False).tolist())


def _rows(table, args) -> list[dict]:
    """The chosen rows (see ``_row_indices``) of a pyarrow Table or a list of rows, as dicts."""
    if isinstance(table, list):
        return [table[i] for i in _row_indices(len(table), args)]
    return table.take(_row_indices(table.num_rows, args)).to_pylist()


def _part_rows(parts, args, hint: str) -> list[dict]:
    """The chosen rows of a stage's parts, as if they were one table: each part's footer is checked and only the
    parts that hold a chosen row are decoded (checked too), so a damaged part is an error that names it."""
    from atlas.core.files import open_parquet, read_parquet

    starts = [0]
    for part in parts:
        with open_parquet(part, hint=hint) as pf:
            starts.append(starts[-1] + pf.metadata.num_rows)
    chosen = _row_indices(starts[-1], args)
    rows = []
    for i, part in enumerate(parts):
        if local := [r - starts[i] for r in chosen if starts[i] <= r < starts[i + 1]]:
            rows.extend(read_parquet(part, hint=hint).take(local).to_pylist())
    return rows


def _tags_by_field(run, chunk_ids: list[str]) -> dict[str, dict[str, list[str]]]:
    """chunk id -> field -> its normalized tags, for a few chunks (the tag parts are read filtered)."""
    from atlas.io.tags import read_tags_of

    out: dict[str, dict[str, list[str]]] = {}
    for r in read_tags_of(run, chunk_ids):
        out.setdefault(r["chunk_id"], {}).setdefault(r["field"], []).append(r["tag_norm"])
    return out


def _chunk_texts(run, chunk_ids, found: dict, named_in, stage: str) -> dict:
    """``found`` (read_chunks of ``chunk_ids``), checked to hold every one: a chunk that ``named_in`` (written by
    ``stage``) names but the chunk parts lack means the two are not of the same run."""
    from atlas.core.files import ArtifactError

    if lost := [c for c in chunk_ids if c not in found]:
        raise ArtifactError(f"{named_in}: chunk {lost[0]!r} ({len(lost)} in all) is in no part of "
                            f"{run.output_dir(layout.CHUNKS)}; recompute it: atlas run CONFIG --force --stages "
                            f"{stage}")
    return found


def _inspect_concepts(run, args) -> None:
    from atlas.core.files import read_parquet
    from atlas.io.chunks import read_chunks
    from atlas.io.library import check_concept_ids, load_library

    concepts = load_library(run)[0]
    names = {r["concept_id"]: (r["domain"], r["name"]) for r in concepts}
    if args.what == "annotator":
        path = run.output_dir(layout.ANNOTATOR) / "heldout_predictions.parquet"
        hint = "retrain the annotator: atlas run CONFIG --force --stages train_annotator"
        table = read_parquet(path, ["chunk_id", "domain", "concepts", "concept_scores", "targets"], hint=hint)
        check_concept_ids(path, table, ["concepts", "targets"], len(concepts), hint)
    else:
        path = run.parts(layout.TARGETS)[0]
        hint = "recompute the targets: atlas run CONFIG --force --stages targets"
        table = read_parquet(path, ["chunk_id", "domain", "split", "picked", "concepts"], hint=hint)
        check_concept_ids(path, table, ["concepts"], len(concepts), hint)
    rows = _rows(table, args)
    texts = _chunk_texts(run, [r["chunk_id"] for r in rows], read_chunks(run, {r["chunk_id"] for r in rows}), path,
                         "train_annotator" if args.what == "annotator" else "targets")
    tags = _tags_by_field(run, [r["chunk_id"] for r in rows])
    for row in rows:
        print("-" * 100)
        extra = f"  split={row['split']}  picked={row['picked']}" if "split" in row else "  (held-out)"
        print(f"chunk_id={row['chunk_id']}  domain={row['domain']}{extra}")
        _print_text(texts[row["chunk_id"]]["chunk_text"], args.chars)
        fields = tags.get(row["chunk_id"], {})
        print("    tags: " + "; ".join(f"{field}: {', '.join(values)}" for field, values in fields.items()))
        if args.what == "annotator":
            known = set(row["targets"])
            for g, score in zip(row["concepts"], row["concept_scores"]):
                mark = "*" if g in known else " "
                print(f"    {mark} {score:.2f}  {names[g][0]:<11} {names[g][1]}")
            print("    (* = also an inherited target)")
        else:
            by_domain: dict[str, list[str]] = {}
            for g in row["concepts"]:
                by_domain.setdefault(names[g][0], []).append(names[g][1])
            for domain, values in by_domain.items():
                print(f"    {domain}: {'; '.join(values)}")


def cmd_annotate_text(args) -> int:
    from atlas.core.rundir import RunDir
    from atlas.io.library import load_library
    from atlas.models.annotator import Annotator

    folder = Path(args.annotator)
    run_dir = folder if (folder / "manifest.json").exists() else None
    if run_dir is not None:
        folder = RunDir(run_dir).output_dir(layout.ANNOTATOR)
    concepts, _ = load_library(RunDir(run_dir or folder.parent))
    annotator = Annotator(folder).setup()
    annotator.check_library(concepts)
    texts = args.text or [sys.stdin.read()]
    embeddings = annotator.embedder.encode(texts)
    probs = annotator.probabilities(embeddings)
    for text, decided, i in zip(texts, annotator.decide(probs, embeddings), range(len(texts))):
        print("-" * 100)
        _print_text(text, 300)
        for domain, labels in decided.items():
            if args.top:  # the best-scored labels, whatever the decision rule says
                offset = annotator.spec.domains[domain]["offset"]
                order = probs[domain][i].argsort()[::-1][: args.top]
                labels = [(offset + int(j), float(probs[domain][i][j])) for j in order]
            shown = ", ".join(f"{concepts[g]['name']} ({p:.2f})" for g, p in labels) or "-"
            print(f"    {domain:<11} {shown}")
    return 0


def cmd_search(args) -> int:
    from atlas.tools.search import search_run

    for query, hits in zip(args.query, search_run(args.run_dir, args.query, args.k, args.nprobe)):
        print("=" * 100)
        print(f"query: {query}")
        for hit in hits:
            print(f"  {hit['rank']:>2}. {hit['score']:.3f}  {hit['chunk_id']}  ({hit['data_src']})")
            _print_text(hit["text"], args.chars)
    return 0


def cmd_export(args) -> int:
    from atlas.tools.export import export_release
    from atlas.tools.publish import PublishError, check_destination, publish

    try:
        if args.push_to_hub:  # a missing token or a foreign folder stops here, before the export's work
            check_destination(args.push_to_hub, args.out)
        summary = export_release(args.run_dir, args.out)
        print(json.dumps(summary, indent=2))
        print(f"release view written to {args.out} (see {Path(args.out) / 'README.md'})")
        if args.push_to_hub:
            print(f"published to {publish(args.out, args.push_to_hub, private=args.private)}")
    except PublishError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


def cmd_export_tokens(args) -> int:
    from atlas.tools.export_tokens import export_tokens

    summary = export_tokens(args.run_dir, args.out, args.format)
    print(f"{summary['shards']} {args.format} shard(s): {summary['sequences']:,} sequences (chunks), "
          f"{summary['documents']:,} documents, {summary['tokens']:,} tokens written to {args.out} "
          f"(see {Path(args.out) / 'README.md'})")
    return 0


def cmd_estimate(args) -> int:
    from atlas.tools.estimate import estimate

    config = _load(args)
    rows = estimate(config, args.sample_docs)
    print(f"{'stage':<48} {'sample':>7} {'per second':>11} {'corpus':>13} {'hours/worker':>13} "
          f"{'hours (' + str(config.execution.workers) + ' workers)':>18}")
    for r in rows:
        print(f"{r['stage']:<48} {r['sample']:>7,} {r['per_second']:>9,.1f}/s {r['corpus']:>9,} {r['unit']:<3} "
              f"{r['hours_one_worker']:>13,.2f} {r['hours']:>18,.2f}")
    for path, what in (("library sample", "tag the library sample"),
                       ("corpus", "chunk, annotate and tokenize every document")):
        hours = sum(r["hours"] for r in rows if r["path"] == path)
        print(f"{path} path ({what}): {hours:,.2f} hours with {config.execution.workers} workers")
    print("not projected: the global stages (vocab ... train_annotator; they scale with the tag vocabulary and the "
          "reservoir) and the index (see benchmarks/bench_index.py)")
    return 0


def cmd_judge(args) -> int:
    from atlas.config import config_from_dict
    from atlas.core.rundir import RunDir
    from atlas.tools.judge import judge_tags

    run = RunDir(args.run_dir)
    manifest = run.read_manifest()
    if "tag" not in manifest.get("stages", {}):
        raise FileNotFoundError(f"{args.run_dir}: no tags yet; run the tag stage first")
    config = _run_config(run, manifest)
    from atlas.config import apply_override

    data = config.model_dump()
    for assignment in args.set or []:
        apply_override(data, assignment)
    config = config_from_dict(data)
    summary = judge_tags(config, sample=args.sample, seed=args.seed)
    print(json.dumps(summary, indent=2))
    if summary["success_rate"] is not None:
        print(f"success_rate {summary['success_rate']:.3f} over {summary['pairs']:,} pairs: "
              f"{summary['success_rate_is']}")
    print(f"histograms and summary in {Path(args.run_dir) / layout.REPORT}")
    return 0


def _run_config(run, manifest: dict):
    """The config the run's manifest records, for the run directory as it is now (moved or not)."""
    from atlas.tools.labels import run_config

    return run_config(run)


def cmd_eval(args) -> int:
    from atlas.core.rundir import RunDir
    from atlas.tools.evaluate import evaluate_annotator, evaluate_library, format_per_source

    run = RunDir(args.run_dir)
    manifest = run.read_manifest()
    needed = {"library": run.output_dir(layout.LIBRARY) / "concepts.parquet",
              "annotator": run.output_dir(layout.ANNOTATOR) / "heldout_predictions.parquet"}[args.what]
    if not needed.exists():
        raise FileNotFoundError(f"{args.run_dir}: no {args.what} yet ({needed} is missing); run the pipeline that far "
                                "first")
    config = _run_config(run, manifest)
    if args.what == "library":
        summary = evaluate_library(config, args.label_field, args.sample, args.seed)
    else:
        summary = evaluate_annotator(config, args.label_field)
    table = format_per_source(summary)  # none when no document has a label (said last, below)
    if table:  # the per-source table first, readable; its rows in full are in the file, not repeated below
        print("\n".join([*table, ""]))
        summary = {k: v for k, v in summary.items() if k != "per_source"}
    print(json.dumps(summary, indent=2))
    if "label_metrics" in summary:  # no labels: say so last, where it is seen
        print(f"no label metrics: {summary['label_metrics'].removeprefix('not computed: ')}")
    summary = args.what + ("_eval" if args.what == "library" else "_probe") + ".json"
    print(f"written to {run.root / layout.REPORT / summary}" + (" (per_source in full)" if table else ""))
    return 0


# Commands that read a finished or running run; given a URL, they read its local copy, pulled first.
READ_COMMANDS = ("status", "inspect", "judge", "eval", "search", "export", "export-tokens", "report")
WRITE_REPORT = ("judge", "eval", "report")  # and these upload RUN/report/ back to the bucket


def cmd_report(args) -> int:
    from atlas.tools.report import write_html_report

    print(write_html_report(args.run_dir))
    return 0


def cmd_demo_corpus(args) -> int:
    from atlas.tools.demo_corpus import build_demo_corpus

    path, counts = build_demo_corpus(args.out)
    print(f"wrote {sum(counts.values())} documents to {path}: " + ", ".join(f"{k}={v}" for k, v in counts.items()))
    return 0


def _at_least(minimum: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value
    return parse


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="atlas",
        description="Atlas: turn a text corpus into a concept library, annotated training shards and a "
                    "concept-bottleneck LM.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)

    def config_args(p):
        p.add_argument("config", help="run configuration (YAML), e.g. configs/demo.yaml")
        p.add_argument("--stages", help="comma-separated stages to run (default: all, in pipeline order)")
        p.add_argument("--input", help="input documents: a file, glob or folder, or a URL such as "
                                       "s3://bucket/corpus/ or hf://datasets/org/name/; overrides input.path")
        p.add_argument("--run-dir", help="run directory: a folder, or a URL such as s3://bucket/runs/mine (worked on "
                                         "in a local copy, uploaded as it goes); overrides run_dir")
        p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config value (repeatable)")
        p.add_argument("--force", action="store_true",
                       help="recompute the stages even if done, or if the run dir holds another config")

    p = sub.add_parser("run", help="run the pipeline (skips what is already done)", epilog=EXAMPLES,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    config_args(p)
    p.add_argument("--inline", action="store_true", help="run shards in this process, without Prefect")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(fn=cmd_run)

    p = sub.add_parser("plan", help="prepare the run directory and shard plans without running (for SLURM arrays)")
    config_args(p)
    p.set_defaults(fn=cmd_plan)

    p = sub.add_parser("stage", help="run shard(s) of one planned stage (one SLURM array task)")
    p.add_argument("name", help="stage name, e.g. chunk")
    p.add_argument("--run-dir", required=True)
    p.add_argument("--shard", type=_at_least(0), required=True, help="this task's index (e.g. $SLURM_ARRAY_TASK_ID)")
    p.add_argument("--num-shards", type=_at_least(1), default=None,
                   help="number of tasks; task I runs the shards s with s %% N == I (default: one shard per task)")
    p.set_defaults(fn=cmd_stage)

    p = sub.add_parser("status",
                       help="per stage: state (running, interrupted, failed, done), shards, counters, drops, errors")
    p.add_argument("run_dir")
    p.add_argument("--json", action="store_true", help="print the status as JSON rows")
    p.set_defaults(fn=cmd_status)

    p = sub.add_parser("inspect", help="print a few rows of a stage's output, or the labels the shards hold",
                       epilog="examples:\n  atlas inspect runs/demo library -n 5 --random 1\n"
                              f"  atlas inspect runs/demo {SHARD_LABELS}\n"
                              f"  atlas inspect runs/demo {SHARD_LABELS} --label demographic:children -n 3 --random 1",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir")
    p.add_argument("what", help="output folder: chunks, tags, tag_vocab, clusters, coherence, labels (the label "
                                "stage's cluster names), library, targets, annotator (held-out predictions), "
                                "annotated; or "
                                f"{SHARD_LABELS}: the labels the annotated shards hold, counted per label domain "
                                "and data domain")
    p.add_argument("--label", metavar="NAME",
                   help=f"with {SHARD_LABELS}: -n chunks carrying this label (a name, DOMAIN:NAME or a concept "
                        "id), drawn at random (--random SEED, default 0)")
    p.add_argument("-n", type=_at_least(1), default=5, help="rows to show")
    p.add_argument("--chars", type=_at_least(1), default=600, help="characters of text to show per row")
    p.add_argument("--random", type=_at_least(0), metavar="SEED", default=None,
                   help="show -n rows drawn at random with this seed instead of the first ones (typical rows, "
                        "not only the most used concepts)")
    p.set_defaults(fn=cmd_inspect)

    p = sub.add_parser("judge", help="score the relevance of tags to their chunks (1-5; offline: a proxy)")
    p.add_argument("run_dir")
    p.add_argument("--sample", type=_at_least(1), default=200, help="chunks to judge")
    p.add_argument("--seed", type=_at_least(0), default=0)
    p.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="override the run's config, e.g. llm.engine=openai llm.base_url=http://host:8000/v1")
    p.set_defaults(fn=cmd_judge)

    p = sub.add_parser("eval", help="evaluate an artifact against ground truth: `atlas eval library RUN`",
                       description="Per labelled source (data_src), by document: linear probes on concept vectors "
                                   "vs raw embeddings, and homogeneity / NMI of each document's top concept vs a "
                                   "k-means baseline with as many clusters, the homogeneity ratio with its 95% "
                                   "interval over a bootstrap of the documents, and a control (the same top-concept "
                                   "rule with each document given another's concepts); then the summary as JSON. "
                                   "docs/quality.md says how each figure is computed.")
    p.add_argument("what", choices=["library", "annotator"])
    p.add_argument("run_dir")
    p.add_argument("--label-field", default="label", help="metadata field of the chunks holding the true label")
    p.add_argument("--sample", type=_at_least(1), default=200, help="chunks for the relevance judge (or proxy)")
    p.add_argument("--seed", type=_at_least(0), default=0)
    p.set_defaults(fn=cmd_eval)

    p = sub.add_parser("annotate-text", help="label texts with the trained annotator: concepts and scores",
                       epilog='example: atlas annotate-text runs/demo '
                              '"The integral of x squared is x cubed over three."',
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("annotator", help="a run directory, or an annotator folder (RUN/annotator)")
    p.add_argument("text", nargs="*", help="texts to label (none: read one text from standard input)")
    p.add_argument("--top", type=_at_least(0), default=0,
                   help="show the N best-scored labels per domain instead of the decided ones")
    p.set_defaults(fn=cmd_annotate_text)

    p = sub.add_parser("search", help="the training chunks nearest to a query text (IVFPQ index)",
                       epilog='example: atlas search runs/demo "how do I open a file for writing?" -k 5',
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir")
    p.add_argument("query", nargs="+", help="query texts")
    p.add_argument("-k", type=_at_least(1), default=10, help="chunks per query")
    p.add_argument("--nprobe", type=_at_least(1), default=None,
                   help="coarse lists to search (default: the index stage's)")
    p.add_argument("--chars", type=_at_least(1), default=200, help="characters of each chunk to show")
    p.set_defaults(fn=cmd_search)

    p = sub.add_parser("export", help="write the release view: chunks, concepts, field guide, co-occurrence")
    p.add_argument("run_dir")
    p.add_argument("out", help="output folder")
    p.add_argument("--push-to-hub", metavar="DEST",
                   help="then publish OUT: ORG/NAME is a Hugging Face dataset repository (created if missing; needs "
                        "a write token in HF_TOKEN or from `hf auth login`); a path or file:// URL is a local folder "
                        "that gets the same files (an air-gapped mirror). Either loads with "
                        "datasets.load_dataset(DEST)")
    p.add_argument("--private", action="store_true", help="with --push-to-hub ORG/NAME: create the repository private")
    p.set_defaults(fn=cmd_export)

    p = sub.add_parser("export-tokens", help="write the token shards for another trainer: Megatron-LM .bin/.idx",
                       description="Write each token shard i as OUT/part-NNNNN.bin + .idx, a Megatron-LM / NeMo "
                       "indexed dataset (one sequence per chunk, documents marked), with its chunks' concepts in "
                       "OUT/part-NNNNN.concepts.parquet and the --data-path line in OUT/README.md. The tokenize "
                       "stage must have finished. Rerunning replaces an earlier export in OUT.",
                       epilog="example: atlas export-tokens runs/demo runs/demo-megatron --format megatron")
    p.add_argument("run_dir")
    p.add_argument("out", help="output folder (empty, new, or an earlier export-tokens output)")
    p.add_argument("--format", choices=["megatron"], default="megatron",
                   help="megatron: MMIDIDX .bin/.idx, as Megatron-LM's tools/preprocess_data.py writes (default)")
    p.set_defaults(fn=cmd_export_tokens)

    p = sub.add_parser("estimate", help="measure throughput on a sample and project the hours of each map stage")
    p.add_argument("config", help="run configuration (YAML)")
    p.add_argument("--sample-docs", type=int, default=200, help="documents to measure on")
    p.add_argument("--input", help="input documents; overrides input.path")
    p.add_argument("--run-dir", help="run directory (its trained annotator, if any, is timed)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config value (repeatable)")
    p.set_defaults(fn=cmd_estimate)

    p = sub.add_parser("report", help="(re)write RUN/report/index.html: stages, drops, plots, concepts, metrics")
    p.add_argument("run_dir")
    p.set_defaults(fn=cmd_report)

    p = sub.add_parser("demo-corpus", help="build the small offline demo corpus from text installed with Python")
    p.add_argument("out", help="output JSONL file")
    p.set_defaults(fn=cmd_demo_corpus)

    from atlas.cblm.cli import add_parser as add_cblm_parser

    add_cblm_parser(sub)
    return parser


class UsageError(ValueError):
    """A command given arguments that cannot work (a shard beyond the plan, a folder that is not an output)."""


def _interrupted(args, how: str = "interrupted") -> str:
    """The one line a Ctrl-C (or SIGTERM: ``how``) prints: what it stopped and how to go on."""
    from atlas.core.rundir import RunDir
    from atlas.tools.status import run_status

    what = args.command_line
    if args.command == "run" and getattr(args, "run_dir", None):
        try:
            stage = next((s for s in run_status(RunDir(args.run_dir)) if s.state in ("running", "interrupted")), None)
        except Exception:  # whatever the run directory holds, this line must not fail
            stage = None
        if stage is not None:
            what = f"stage {stage.name} ({stage.shards_done} of {stage.shards_total} shard(s) done)"
    if args.command in ("run", "stage"):
        return f"{how}: {what}; finished shards are kept, rerun the same command to resume"
    return f"{how}: {what}"


class _TerminalHandler(logging.Handler):
    """The library's log records as the command's own lines: the message alone, information on standard output and
    warnings on standard error, as the commands printed them. The streams are looked up at each record (pytest's
    capture replaces them) and written to directly (a Prefect flow turns ``print`` into log records of its own)."""

    def emit(self, record: logging.LogRecord) -> None:
        stream = sys.stderr if record.levelno >= logging.WARNING else sys.stdout
        try:
            stream.write(self.format(record) + "\n")
            stream.flush()  # `atlas estimate | tee` shows each measurement as it ends
        except Exception:  # noqa: BLE001 - logging's own rule: a failed write never stops the program
            self.handleError(record)


@contextlib.contextmanager
def _log_to_terminal():
    """For one command: the "atlas" loggers print through ``_TerminalHandler``, from INFO up. Not propagated: a
    handler that Prefect or Ray puts on the root logger would print each record a second time."""
    logger = logging.getLogger("atlas")
    handler, level, propagate = _TerminalHandler(), logger.level, logger.propagate
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    try:
        yield
    finally:  # main() in a notebook or a test leaves the logger as it found it
        logger.removeHandler(handler)
        logger.setLevel(level)
        logger.propagate = propagate


def _prefect_logging_config() -> None:
    """Point Prefect at its own logging config with SQLAlchemy's pool logger quieted (unless the user set one).

    Ctrl-C reaches Prefect's temporary server too (a subprocess sharing our terminal); its shutdown cancels the
    server's database work midway, and SQLAlchemy's pool logs each cancelled rollback as an ERROR with a
    traceback, under the one line Atlas prints. Prefect configures the logging of both processes from the file
    that PREFECT_LOGGING_SETTINGS_PATH names, so the file is Prefect's installed logging.yml plus that logger,
    written once per Prefect version. Set before Prefect is imported."""
    import importlib.metadata
    import importlib.util
    import tempfile

    import yaml

    from atlas.core.files import atomic_write_bytes

    spec = importlib.util.find_spec("prefect")
    if "PREFECT_LOGGING_SETTINGS_PATH" in os.environ or spec is None or spec.origin is None:
        return
    version = importlib.metadata.version("prefect")
    path = Path(tempfile.gettempdir()) / f"atlas-prefect-logging-{version}-{os.getuid()}.yml"
    if not path.exists():
        config = yaml.safe_load((Path(spec.origin).parent / "logging" / "logging.yml").read_text())
        config.setdefault("loggers", {})["sqlalchemy.pool"] = {"level": "CRITICAL"}
        atomic_write_bytes(path, yaml.safe_dump(config, sort_keys=False).encode())
    os.environ["PREFECT_LOGGING_SETTINGS_PATH"] = str(path)


def _confined(args) -> contextlib.AbstractContextManager:
    """Where a command may write: its run directory and its named output (``OUT``), nowhere else, whatever links
    inside them say (``atlas.core.files.confined_writes``). A command that writes a run's report must be given an
    Atlas run. `atlas run` and `atlas plan` confine themselves once their config is read."""
    from atlas.config import is_url
    from atlas.core.files import confined_writes
    from atlas.core.ownership import require_owned
    from atlas.core.rundir import RunDir

    if args.command in ("run", "plan", "estimate") or args.command.startswith("cblm"):
        return contextlib.nullcontext()
    roots = [value for key in ("run_dir", "out") if (value := getattr(args, key, None)) and not is_url(value)]
    if getattr(args, "push_to_hub", None):  # a local mirror, and the folder it is staged in
        from atlas.tools.publish import PublishError, destination, staging_folder

        with contextlib.suppress(PublishError):
            if isinstance(target := destination(args.push_to_hub), Path):
                roots += [target, staging_folder(target)]
    if args.command in (*WRITE_REPORT, "stage") and roots:
        require_owned(roots[0], "run", "run directory")
    if getattr(args, "run_dir", None) and (Path(args.run_dir) / "manifest.json").is_file():
        RunDir(args.run_dir).check_links()
    return confined_writes(*roots) if roots else contextlib.nullcontext()


def _run_command(args) -> int:
    """Run the command; a run directory given as a URL is read from its local copy (atlas.io.remote_run)."""
    from atlas.config import is_url

    url = getattr(args, "run_dir", None) if args.command in (*READ_COMMANDS, "stage") else None
    if not url or not is_url(url):
        with _confined(args):
            return args.fn(args)
    if args.command == "stage":
        raise UsageError(f"--run-dir {url}: SLURM array tasks need the run directory on a file system their nodes "
                         f"share; a run in object storage runs with `atlas run CONFIG --run-dir {url}`")
    from atlas.io import layout
    from atlas.io.remote_run import RunMirror, local_run

    args.run_dir = str(local_run(url, metadata_only=args.command == "status"))
    with _confined(args):
        code = args.fn(args)
    if args.command in WRITE_REPORT:
        RunMirror(url, args.run_dir).push_tree([Path(args.run_dir) / layout.REPORT])
    return code


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.command_line = shlex.join(["atlas", *(sys.argv[1:] if argv is None else argv)])
    # Offline machines: Prefect's anonymous usage telemetry would only log connection errors.
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    # The temporary server can take longer than Prefect's 20 s to start on a busy laptop.
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    _prefect_logging_config()
    if getattr(args, "num_shards", "absent") is None:
        args.num_shards = 1 << 62  # one shard per task
    from atlas.config import ConfigError
    from atlas.core.extras import MissingExtra
    from atlas.core.lock import RunLocked
    from atlas.io.inputs import InputError
    from atlas.runner import RunConflict, StageFailed

    try:
        with _log_to_terminal(), sigterm_as_interrupt():
            code = _run_command(args)
            sys.stdout.flush()  # a reader that left (`| head -1`) is found here, not at exit
            return code
    except KeyboardInterrupt as e:  # Ctrl-C or SIGTERM: one line, no traceback (the run lock is released on the way)
        terminated = isinstance(e, Terminated)
        print(_interrupted(args, "terminated" if terminated else "interrupted"), file=sys.stderr)
        return 128 + (signal.SIGTERM if terminated else signal.SIGINT)
    except BrokenPipeError:  # the reader of standard output left: stop quietly, as a command in a pipe does
        with contextlib.suppress(OSError, ValueError):  # Python flushes stdout at exit: into devnull, not the pipe
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE
    except (ConfigError, UsageError, InputError, RunConflict, RunLocked, StageFailed, MissingExtra, FileNotFoundError,
            FileExistsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2 if isinstance(e, (ConfigError, UsageError, RunConflict)) else 1
    except OSError as e:  # a full disk, a read-only or unwritable run directory: every write is atomic
        print(f"error: {e}\nNothing written so far is lost (every file is written whole, then renamed); "
              f"fix the cause and rerun the same command to continue.", file=sys.stderr)
        return 1
    except Exception as e:  # noqa: BLE001 - reading a run: what its readers did not foresee is still one line
        if args.command not in (*READ_COMMANDS, "annotate-text") or os.environ.get("ATLAS_TRACEBACK"):
            raise
        run = getattr(args, "run_dir", None) or args.annotator
        print(f"error: {run}: {type(e).__name__} while reading it ({' '.join(str(e).split())[:300]}): a file of the "
              f"run is damaged or was edited; `atlas status {run}` shows its stages, and recomputing the stage that "
              f"wrote the file replaces it (atlas run CONFIG --force --stages STAGE); ATLAS_TRACEBACK=1 shows where",
              file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
