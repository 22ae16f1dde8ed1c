"""Run stages over a run directory: the logic that the CLI and the Prefect flow share.

A run holds the run lock (``RUN/_lock``, one driver at a time) and is checked whole before anything
is written (``check_run``): a refused run leaves the run directory as it was. For each stage, in
pipeline order:

1. compute its hash (its identity plus the upstream hashes) and compare it with the run
   directory's manifest: a different hash means the folder holds results of another config, and
   the run stops unless ``--force`` was given;
2. skip it if its ``_SUCCESS`` marker carries the same hash ("nothing to do");
3. plan its shards and run the ones whose marker is missing, through ``map_shards`` (a plain loop,
   or Prefect tasks);
4. merge the shard counters into ``_stats.json``, write the dataset card (``atlas.io.cards``), write ``_SUCCESS``
   and update the manifest.

A killed run resumes at step 3 with the unfinished shards; finished shards are never redone.

A run kept in object storage (``run_dir: s3://...``) runs in a local copy, and ``run.mirror`` uploads each
finished shard (its files, then its marker), each planned and each finished stage (``_SUCCESS`` last) and the
manifest (``atlas.io.remote_run``).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from atlas.config import AtlasConfig, ConfigError, config_from_dict
from atlas.core.extras import require
from atlas.core.files import InputError, atomic_write_json, confined_writes, read_json, stable_hash
from atlas.core.lock import run_lock, shard_running
from atlas.core.ownership import NotOwned
from atlas.core.rundir import RunDir
from atlas.core.stage import Stage
from atlas.core.stats import Stats
from atlas.io import layout
from atlas.io.cards import CARD_FILE, write_dataset_card
from atlas.io.remote_run import mirror_of
from atlas.stages import LIBRARY_STAGES, STAGES

# A line per stage (skipped, planned, started, done): the CLI prints them, a notebook sees them with logging at INFO.
logger = logging.getLogger("atlas.runner")


class RunConflict(RuntimeError):
    """The run directory holds results computed with another configuration or input."""


class StageFailed(RuntimeError):
    """Some shards of a stage failed; the finished ones are kept for the next attempt."""


@dataclass
class StageReport:
    name: str
    stage_hash: str
    num_shards: int = 0
    ran: list[int] = field(default_factory=list)
    skipped: bool = False
    counters: dict = field(default_factory=dict)
    seconds: float = 0.0


# Shard workers build each stage once per process and keep it, so `setup` runs once per worker.
_WORKER_STAGES: dict[tuple[str, str], Stage] = {}
_WORKER_LOCK = threading.Lock()


def run_one_shard(config: dict, stage_name: str, shard: int, stage_hash: str) -> dict:
    """Run one shard of one stage and write its completion marker. Safe to call in any process."""
    with shard_running():  # the driver keeps the run locked until the shard is over, even when interrupted
        key = (stage_name, stable_hash(config))
        with _WORKER_LOCK:  # threads of one worker share one stage (one model in memory), set up once
            stage = _WORKER_STAGES.get(key)
            if stage is None:
                stage = STAGES[stage_name](config_from_dict(config))
                stage.setup()
                _WORKER_STAGES[key] = stage
        run = RunDir(stage.config.run_dir, mirror_of(stage.config))
        with confined_writes(run.root):  # a worker process of its own (Ray, processes) is confined here
            started, start = time.time(), time.perf_counter()
            stats = stage.run_shard(run, shard)
            seconds = time.perf_counter() - start
            run.mark_shard_done(stage.output, shard, stage_hash, stats.to_dict(), seconds)
            if run.mirror is not None:  # the shard's files, then its marker
                run.mirror.push_shard(stage_folders(run, stage), started, run.marker_path(stage.output, shard))
        return stats.to_dict()


def stage_folders(run: RunDir, stage: Stage) -> list:
    return [run.output_dir(output) for output in (stage.output, *stage.extra_outputs)]


def release_stage(stage_name: str) -> None:
    """Tear down this process's cached instances of a finished stage (its model, its GPU memory)."""
    with _WORKER_LOCK:
        for key in [k for k in _WORKER_STAGES if k[0] == stage_name]:
            _WORKER_STAGES.pop(key).teardown()


MapShards = Callable[[dict, str, Sequence[int], str], list[BaseException | None]]


def map_inline(config: dict, stage_name: str, shards: Sequence[int], stage_hash: str) -> list[BaseException | None]:
    """Run shards one after the other in this process, with a progress bar."""
    from tqdm.auto import tqdm

    errors: list[BaseException | None] = []
    progress = config["execution"]["progress"]
    for shard in tqdm(shards, desc=stage_name, unit="shard", disable=not progress):
        try:
            run_one_shard(config, stage_name, shard, stage_hash)
            errors.append(None)
        except Exception as e:  # one failed shard must not stop the others
            errors.append(e)
    return errors


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        out |= _flatten(v, key + ".") if isinstance(v, dict) else {key: v}
    return out


def _describe_difference(old: dict, new: dict) -> str:
    """The keys whose values differ between a recorded identity (read from JSON) and a new one, which is compared as
    it would be recorded: a tuple reads back as a list, and is no difference."""
    a, b = _flatten(old), _flatten(json.loads(json.dumps(new, default=str)))  # as stable_hash reads it
    lines = [f"    {k}: {json.dumps(a.get(k))} -> {json.dumps(b.get(k))}"
             for k in sorted(a.keys() | b.keys()) if a.get(k) != b.get(k)]
    return "\n".join(lines[:10]) or "    (the stages before it changed)"


def pipeline_order(names: Sequence[str] | None) -> list[str]:
    if not names:
        return list(STAGES)
    unknown = [n for n in names if n not in STAGES]
    if unknown:
        raise ConfigError(f"unknown stage(s) {unknown}; stages are: {', '.join(STAGES)}")
    return [n for n in STAGES if n in names]


@dataclass
class Checked:
    """A stage as ``check_run`` found it: its hash, and whether its ``_SUCCESS`` already holds that hash."""
    name: str
    stage: Stage
    identity: dict
    stage_hash: str
    done: bool


def check_run(config: AtlasConfig, stages: Sequence[str] | None = None, force: bool = False,
              plan_only: bool = False) -> list[Checked]:
    """Everything that can refuse a run, checked before anything is written: unknown stages, a missing input or
    extra, upstream stages that never ran, a run directory of another config. Reads the run directory only."""
    run = RunDir(config.run_dir)
    selected = pipeline_order(stages)
    if config.annotate.annotator_from:
        if stages and (asked := [n for n in selected if n in LIBRARY_STAGES]):
            raise ConfigError(f"annotate.annotator_from is set ({config.annotate.annotator_from}): this run uses that "
                              f"annotator and library and runs no library stage; drop {asked} from --stages, or "
                              f"unset annotate.annotator_from to build a library here")
        selected = [n for n in selected if n not in LIBRARY_STAGES]
    recorded = dict(run.read_manifest().get("stages", {}))
    # A record without a hash (an older Atlas wrote half records when two runs raced) counts as no record here.
    hashes = {name: info["hash"] for name, info in recorded.items() if info.get("hash")}
    checked = []
    for name in selected:
        stage = STAGES[name](config)
        missing = [up for up in stage.upstream if up not in hashes]
        if missing:
            raise StageFailed(f"{name}: needs stage(s) {missing} first; run them too, "
                              f"e.g. --stages {','.join([*missing, name])}")
        identity = stage.identity()
        stage_hash = stage.stage_hash({up: hashes[up] for up in stage.upstream})
        previous = recorded.get(name)
        if previous and previous.get("hash") != stage_hash and not force:
            redo = f"--force --stages {','.join([name, *stages_after(name)])}"
            if not previous.get("hash"):
                raise RunConflict(f"{run.root}: the manifest's record of stage '{name}' is incomplete (no hash; "
                                  f"written by an older Atlas while two runs shared this directory), so what "
                                  f"{run.output_dir(stage.output)} holds is unknown: recompute it with {redo}")
            raise RunConflict(
                f"{run.root} already holds stage '{name}' computed with a different configuration or input:\n"
                f"{_describe_difference(previous.get('identity', {}), identity)}\n"
                f"Use another --run-dir, or recompute '{name}' and the stages after it with {redo}"
            )
        if force:  # it and the stages after it are cleared before it runs
            for later in stages_after(name):
                hashes.pop(later, None)
                recorded.pop(later, None)
            for cleared in [name, *stages_after(name)]:
                _check_clearable(run, STAGES[cleared])
        hashes[name] = stage_hash
        done = not force and run.is_stage_done(stage.output, stage_hash)
        if not done and not plan_only:
            unfinished = [up for up in stage.upstream
                          if up not in selected and not run.is_stage_done(STAGES[up].output, hashes[up])]
            if unfinished:
                raise StageFailed(f"{name}: stage(s) {unfinished} are not finished; run them first")
            require(stage.extras(), f"stage '{name}'")  # a core install says which extra a stage needs
        checked.append(Checked(name, stage, identity, stage_hash, done))
    return checked


def _check_clearable(run: RunDir, stage: type[Stage]) -> None:
    """--force deletes a stage's folders: refused, before anything is deleted, when they hold files the stage did not
    write or a link out of the run."""
    for output in (stage.output, *stage.extra_outputs):
        run.check_contained(output)
    if foreign := run.foreign_files(stage.output, stage.extra_outputs):
        shown = ", ".join(str(p.relative_to(run.root)) for p in foreign[:5])
        more = f" and {len(foreign) - 5} more" if len(foreign) > 5 else ""
        raise NotOwned(f"{run.root}: --force would delete {shown}{more}, which stage '{stage.name}' did not write; "
                       f"nothing was deleted. Move them out of the run directory, then rerun")


def run_stages(
    config: AtlasConfig,
    stages: Sequence[str] | None = None,
    force: bool = False,
    map_shards: MapShards = map_inline,
    plan_only: bool = False,
    log: Callable[[str], None] = logger.info,
    on_stage: Callable[[RunDir, str], None] = lambda run, name: None,
    checked: list[Checked] | None = None,
) -> list[StageReport]:
    """Run ``stages`` (default: all) in pipeline order; ``on_stage`` is called after each one ends.

    Holds the run lock (``RunLocked`` when another process drives the run). ``checked``: what ``check_run`` gave a
    caller that holds the lock already; otherwise the run is checked here, and a refused run writes nothing."""
    run = RunDir(config.run_dir, mirror_of(config))
    with run_lock(run.root, mirror=run.mirror), confined_writes(run.root):
        run.check_links()
        checked = checked if checked is not None else check_run(config, stages, force, plan_only)
        return _run_checked(run, config, checked, force, map_shards, plan_only, log, on_stage)


def _run_checked(run: RunDir, config: AtlasConfig, checked: list[Checked], force: bool, map_shards: MapShards,
                 plan_only: bool, log: Callable[[str], None],
                 on_stage: Callable[[RunDir, str], None]) -> list[StageReport]:
    config_dict = config.model_dump()
    manifest = run.read_manifest()
    if not manifest:
        manifest = {"name": config.name, "config": config_dict, "stages": {}}
    if not plan_only:  # lets `atlas status` tell a running run from a killed one
        manifest["driver"] = {"pid": os.getpid(), "host": socket.gethostname(),
                              "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    run.write_manifest(manifest)
    hashes = {name: info["hash"] for name, info in manifest.get("stages", {}).items() if info.get("hash")}
    reports = []
    for item in checked:
        name, stage, stage_hash = item.name, item.stage, item.stage_hash
        if force:
            later = stages_after(name)
            for stale in [name, *later]:
                for output in (STAGES[stale].output, *STAGES[stale].extra_outputs):
                    run.clear_output(output)
            manifest = run.read_manifest()
            for stale in [name, *later]:
                manifest.get("stages", {}).pop(stale, None)
            run.write_manifest(manifest)
        hashes[name] = stage_hash
        report = StageReport(name, stage_hash)
        reports.append(report)

        if run.is_stage_done(stage.output, stage_hash):
            info = run.read_manifest().get("stages", {}).get(name, {})
            if info.get("status") != "done":  # killed between _SUCCESS and its record: complete the record
                info = dict(info, hash=stage_hash, identity=item.identity, output=stage.output, status="done",
                            counters=read_json(run.stats_path(stage.output)).get("counters", {}),
                            failed_shards=[], errors={})
                run.update_stage(name, **info)
            if not (run.output_dir(stage.output) / CARD_FILE).exists():  # finished by an Atlas without cards
                write_dataset_card(run.output_dir(stage.output), name)
                if run.mirror is not None:
                    run.mirror.push_tree(stage_folders(run, stage))
            report.skipped = True
            report.counters, report.num_shards = info.get("counters", {}), info.get("num_shards", 0)
            log(f"{name}: already done (hash {stage_hash[:12]}), nothing to do")
            continue

        started = time.time()
        manifest = run.read_manifest()
        if manifest.get("config") != config_dict:  # `atlas stage` (SLURM tasks) runs with the manifest's config
            run.write_manifest(dict(manifest, config=config_dict))
        for output in (stage.output, *stage.extra_outputs):  # Zarr, FAISS and torch write there past core.files
            run.check_contained(output)
        report.num_shards = stage.plan(run, stage_hash)
        if run.mirror is not None:  # its plan files, which a run resumed on another machine reads
            run.mirror.push_tree(stage_folders(run, stage))
        # The record is written whole (hash first of all): readers never see a stage without its hash.
        run.update_stage(name, hash=stage_hash, identity=item.identity, num_shards=report.num_shards,
                         status="planned" if plan_only else "running", output=stage.output, failed_shards=[],
                         finalize_error=None,
                         errors={})
        if plan_only:
            log(f"{name}: planned {report.num_shards} shard(s) in {run.output_dir(stage.output)}")
            continue
        unfinished = [up for up in stage.upstream if not run.is_stage_done(STAGES[up].output, hashes[up])]
        if unfinished:
            raise StageFailed(f"{name}: stage(s) {unfinished} are not finished; run them first")
        pending = [i for i in range(report.num_shards) if not run.is_shard_done(stage.output, i, stage_hash)]
        done_before = report.num_shards - len(pending)
        log(f"{name}: {len(pending)} shard(s) to run" + (f", {done_before} already done" if done_before else ""))
        # Shards that run at once share the cores: torch's own threads would spin against each other (on 2 busy
        # cores, 2 threads per encoder ran 15x slower than 1). Read by atlas.models.embedder when a model loads.
        # The inline loop runs one shard at a time, whatever execution.workers says: it gets every core.
        at_once = 1 if map_shards is map_inline else min(len(pending), config.execution.workers) or 1
        os.environ["ATLAS_TORCH_THREADS"] = str(max(1, (os.cpu_count() or 1) // at_once))
        try:
            errors = map_shards(config_dict, name, pending, stage_hash) if pending else []
        finally:
            release_stage(name)
        report.ran = [s for s, e in zip(pending, errors) if e is None]
        failed = [(s, e) for s, e in zip(pending, errors) if e is not None]
        if failed:
            run.update_stage(name, status="failed", failed_shards=[s for s, _ in failed],
                             errors={str(s): f"{type(e).__name__}: {e}"[:500] for s, e in failed})
            on_stage(run, name)
            detail = "\n".join(f"  shard {s:05d}: {type(e).__name__}: {e}" for s, e in failed[:10])
            raise StageFailed(
                f"{name}: {len(failed)} of {report.num_shards} shard(s) failed (finished shards are kept; "
                f"rerun the same command to retry the rest):\n{detail}"
            )

        stats, seconds = Stats(), 0.0
        for shard in range(report.num_shards):
            marker = run.shard_marker(stage.output, shard)
            stats.merge(marker["counters"])
            seconds += marker["seconds"]
        try:
            stage.finalize(run, stats)
        except Exception as e:  # the stage's global checks refused its result: not done, and said so
            run.update_stage(name, status="failed", finalize_error=f"{type(e).__name__}: {e}"[:500])
            on_stage(run, name)
            if isinstance(e, InputError):
                raise
            raise StageFailed(f"{name}: {e}") from e
        atomic_write_json(run.stats_path(stage.output), {"stage": name, "counters": stats.to_dict()})
        write_dataset_card(run.output_dir(stage.output), name)  # so that datasets.load_dataset reads the folder
        run.mark_stage_done(stage.output, stage_hash, stage.extra_outputs)
        if run.mirror is not None:  # and the plots it drew in RUN/report/
            run.mirror.push_tree([*stage_folders(run, stage), run.root / layout.REPORT])
        report.counters, report.seconds = stats.to_dict(), seconds
        run.update_stage(name, status="done", counters=report.counters, shard_seconds=round(seconds, 3),
                         wall_seconds=round(time.time() - started, 3))
        on_stage(run, name)
        log(f"{name}: done, {_summary(report.counters)} -> {run.output_dir(stage.output)}")
    return reports


def stages_after(name: str) -> list[str]:
    names = list(STAGES)
    return names[names.index(name) + 1 :]


def _summary(counters: dict) -> str:
    main = [f"{k}={v}" for k, v in counters.items() if not k.startswith("dropped.")][:6]
    drops = sum(v for k, v in counters.items() if k.startswith("dropped."))
    return ", ".join(main + ([f"dropped={drops}"] if drops else []))
