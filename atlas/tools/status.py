"""Where a run stands, per stage: shards done, counters, drops, failures, timings.

Read from the run directory alone (manifest, shard markers), so it works while a run is going, after
it finished, after it was killed, and from another machine. ``atlas status RUN`` prints it; the
Prefect flow publishes the same table as an artifact after every stage; the run report shows it.
"""

from __future__ import annotations

import socket
import textwrap
from dataclasses import dataclass, field

from atlas.core.files import ArtifactError
from atlas.core.lock import pid_alive
from atlas.core.rundir import RunDir
from atlas.stages import LIBRARY_STAGES, STAGES


@dataclass
class StageStatus:
    name: str
    # done, running, interrupted, failed, planned, not started, unknown (a record without hash), not in this run (a
    # library stage of a run that uses another run's annotator)
    state: str
    shards_done: int = 0
    shards_total: int = 0
    counters: dict = field(default_factory=dict)  # summed over the finished shards
    failed: dict = field(default_factory=dict)  # shard -> "ErrorType: message" of its last attempt
    shard_seconds: float = 0.0  # summed over the finished shards (work, not wall time)
    wall_seconds: float | None = None

    @property
    def drops(self) -> dict:
        return {k.removeprefix("dropped."): v for k, v in self.counters.items() if k.startswith("dropped.")}


def driver_alive(driver: dict | None) -> bool | None:
    """Whether the process that ran the stages is still alive: None when it ran on another host."""
    if not driver:
        return False
    if driver.get("host") != socket.gethostname():
        return None
    return pid_alive(driver["pid"])


def run_status(run: RunDir, manifest: dict | None = None) -> list[StageStatus]:
    """Every pipeline stage's status; ``manifest`` when the caller has already read it."""
    manifest = manifest if manifest is not None else run.read_manifest()
    if not manifest:
        raise FileNotFoundError(f"{run.root}: not an Atlas run directory (no manifest.json)")
    recorded, alive = manifest.get("stages", {}), driver_alive(manifest.get("driver"))
    borrowed = manifest.get("config", {}).get("annotate", {}).get("annotator_from")
    statuses = []
    for name, stage in STAGES.items():
        info = recorded.get(name)
        if not info:
            statuses.append(StageStatus(name, "not in this run" if borrowed and name in LIBRARY_STAGES
                                        else "not started"))
            continue
        if not info.get("hash"):  # a half record (older Atlas, two runs at once): not done, whatever it says
            statuses.append(StageStatus(name, "unknown"))
            continue
        status = StageStatus(name, info.get("status", "planned"), shards_total=info.get("num_shards", 0),
                             wall_seconds=info.get("wall_seconds"))
        for shard in range(status.shards_total):
            marker = run.shard_marker(stage.output, shard)
            if marker and marker.get("stage_hash") == info["hash"]:
                counters, seconds = marker.get("counters", {}), marker.get("seconds", 0.0)
                if not (isinstance(counters, dict) and all(_is_number(v) for v in counters.values())
                        and _is_number(seconds)):
                    raise ArtifactError(f"{run.marker_path(stage.output, shard)}: its counters or seconds are not "
                                        f"numbers: the marker was edited or damaged; recompute the stage: atlas "
                                        f"run CONFIG --force --stages {name}")
                status.shards_done += 1
                status.shard_seconds += seconds
                for key, value in counters.items():
                    status.counters[key] = status.counters.get(key, 0) + value
        status.failed = {int(k): v for k, v in info.get("errors", {}).items()}
        if run.is_stage_done(stage.output, info["hash"]):
            status.state = "done"
        elif status.state == "running" and alive is False:
            status.state = "interrupted"  # killed or crashed: the same command resumes it
        statuses.append(status)
    return statuses


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def format_status(run: RunDir) -> str:
    manifest = run.read_manifest()
    statuses = run_status(run, manifest)
    driver = manifest.get("driver") or {}
    alive = driver_alive(driver)
    lines = [f"run {manifest.get('name')} in {run.root}  (updated {manifest.get('updated', '?')})"]
    if any(s.state in ("running", "interrupted") for s in statuses):
        where = f"pid {driver.get('pid')} on {driver.get('host')}"
        lines.append(f"  driver {where}: " + {True: "running", False: "not running (the run was stopped; rerun the "
                                                "same command to resume)", None: "on another host"}[alive])
    if sample := sample_summary(manifest, statuses):
        lines.append(f"  {sample}")
    lines.append(f"  {'stage':<16} {'state':<15} {'shards':>9} {'dropped':>9} {'work s':>9} {'wall s':>9}")
    for s in statuses:
        shards = f"{s.shards_done}/{s.shards_total}" if s.shards_total else "-"
        wall = f"{s.wall_seconds:.1f}" if s.wall_seconds is not None else "-"
        lines.append(f"  {s.name:<16} {s.state:<15} {shards:>9} {sum(s.drops.values()):>9,} "
                     f"{s.shard_seconds:>9.1f} {wall:>9}")
        kept = [f"{k}={v:,}" for k, v in s.counters.items() if not k.startswith("dropped.")]
        if kept:
            lines.extend(textwrap.wrap(", ".join(kept), width=100, initial_indent="      ",
                                       subsequent_indent="      "))
        for reason, n in sorted(s.drops.items(), key=lambda kv: -kv[1]):
            lines.append(f"      dropped {reason}: {n:,}")
        for shard, error in sorted(s.failed.items()):
            lines.append(f"      FAILED shard {shard:05d}: {error}")
        if s.state == "unknown":
            lines.append(f"      its manifest record is incomplete (no hash): recompute it with "
                         f"atlas run CONFIG --force --stages {s.name}")
    return "\n".join(lines)


def sample_summary(manifest: dict, statuses: list[StageStatus]) -> str:
    """What the library was built from, when not from every document: the tagged sample, or another run's
    annotator ("" otherwise)."""
    config = manifest.get("config", {})
    if borrowed := config.get("annotate", {}).get("annotator_from"):
        return f"annotator and library from {borrowed}: this run tags nothing"
    tag = next(s for s in statuses if s.name == "tag").counters
    if "docs_sampled" not in tag or tag["chunks_sampled"] == tag.get("chunks_in"):
        return ""
    rule = config.get("tag", {})
    cap = f", at most {rule['sample_max_docs']:,}" if rule.get("sample_max_docs") else ""
    return (f"library sample (tag.sample_fraction {rule.get('sample_fraction')}{cap}): {tag['docs_sampled']:,} of "
            f"{tag['docs_in']:,} documents, {tag['chunks_sampled']:,} of {tag['chunks_in']:,} chunks tagged; "
            f"annotate, tokenize and index see every chunk")


def status_rows(run: RunDir) -> list[dict]:
    """The status as table rows (for Prefect's table artifact and ``atlas status --json``)."""
    rows = []
    for s in run_status(run):
        rows.append({"stage": s.name, "state": s.state, "shards": f"{s.shards_done}/{s.shards_total}",
                     "counters": s.counters, "dropped": s.drops, "failed": s.failed,
                     "shard_seconds": round(s.shard_seconds, 3), "wall_seconds": s.wall_seconds})
    return rows
