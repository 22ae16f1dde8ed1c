"""The Atlas pipeline as a Prefect flow: every map stage is mapped over its shards.

``execution.task_runner`` picks where the shard tasks run:

- ``threads`` (default) / ``processes``: a pool of ``execution.workers`` on this machine;
- ``ray``: one Ray task per shard (prefect-ray, the ``cluster`` extra). ``execution.ray_address``
  ``None`` starts a small local Ray instance (``workers`` CPUs, no dashboard); ``"auto"`` or
  ``"ray://head:10001"`` joins a running cluster, whose nodes need Atlas installed and the run
  directory on a shared file system. ``execution.ray_gpus`` (e.g. ``{tag: 1, annotate: 1}``) is
  the number of GPUs each shard task of that stage requests (``ray_remote_options``).

Runs locally with no server to set up (Prefect starts a temporary one). On a cluster, point
``PREFECT_API_URL`` at your server so that every worker reports to it.

    python -m flows.pipeline configs/demo.yaml [execution.task_runner=ray ...]   # KEY=VALUE overrides

``atlas_run`` takes a config *path* (plus optional stages, force and ``--set`` overrides): it is
the entrypoint of the deployments in ``prefect.yaml``.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Sequence

from prefect import flow, task, unmapped
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.futures import as_completed
from prefect.task_runners import ProcessPoolTaskRunner, ThreadPoolTaskRunner

from atlas.config import AtlasConfig, ConfigError, ExecutionConfig, config_from_dict, load_config
from atlas.core.rundir import RunDir
from atlas.runner import StageReport, run_one_shard, run_stages
from atlas.tools.status import status_rows


@task(name="shard", task_run_name="{stage_name}-{shard:05d}")
def shard_task(config: dict, stage_name: str, shard: int, stage_hash: str) -> dict:
    return run_one_shard(config, stage_name, shard, stage_hash)


def ray_remote_options(execution: dict, stage_name: str) -> dict:
    """Ray options of one shard task of ``stage_name``: ``num_gpus`` from ``execution.ray_gpus``.

    Only the Ray runner uses them. Ray gives every task with GPUs a fresh worker process
    (``max_calls=1``), so such a stage loads its model once per shard: keep its shards large.
    """
    if execution.get("task_runner") != "ray":
        return {}
    gpus = execution.get("ray_gpus", {}).get(stage_name)
    return {"num_gpus": gpus} if gpus else {}


def _ray_options_context(stage_name: str, options: dict):
    if not options:
        return contextlib.nullcontext()
    import ray
    from prefect_ray.context import remote_options  # only with the Ray runner (the `cluster` extra)

    gpus = ray.cluster_resources().get("GPU", 0) if ray.is_initialized() else None
    if gpus is not None and gpus < options.get("num_gpus", 0):  # Ray would wait silently, maybe forever
        print(f"warning: {stage_name} asks {options['num_gpus']} GPU(s) per shard task and the Ray cluster has "
              f"{gpus:g} now; its tasks wait until GPU nodes join")
    return remote_options(**options)


def map_with_prefect(config: dict, stage_name: str, shards: Sequence[int],
                     stage_hash: str) -> list[BaseException | None]:
    """Submit one task per shard to the flow's task runner; collect failures instead of raising."""
    from tqdm.auto import tqdm

    with _ray_options_context(stage_name, ray_remote_options(config["execution"], stage_name)):  # read at submit
        futures = shard_task.map(unmapped(config), unmapped(stage_name), list(shards), unmapped(stage_hash))
    index = {f.task_run_id: i for i, f in enumerate(futures)}
    errors: list[BaseException | None] = [None] * len(futures)
    with tqdm(total=len(futures), desc=stage_name, unit="shard", disable=not config["execution"]["progress"]) as bar:
        for future in as_completed(futures):
            try:
                future.result()
            except Exception as e:  # keep going: the other shards still finish and are kept
                errors[index[future.task_run_id]] = e
            bar.update()
    return errors


def publish_status(run: RunDir, stage_name: str) -> None:
    """After each stage: the run's status table (what `atlas status` prints) as a Prefect artifact, and
    the stage's counters and drops as one of its own, so the Prefect UI shows what the CLI shows."""
    rows = status_rows(run)
    flat = [{k: v if isinstance(v, (str, int, float, type(None))) else json.dumps(v) for k, v in row.items()}
            for row in rows]
    create_table_artifact(flat, key="atlas-status", description=f"Atlas run {run.root}: status per stage")
    row = next(r for r in rows if r["stage"] == stage_name)
    lines = [f"### {stage_name}: {row['state']}, shards {row['shards']}", "", "| counter | value |", "|---|---:|"]
    lines += [f"| {k} | {v:,} |" for k, v in row["counters"].items()]
    lines += [f"| FAILED shard {s} | {e} |" for s, e in row["failed"].items()]
    create_markdown_artifact("\n".join(lines), key=f"atlas-{stage_name.replace('_', '-')}",
                             description=f"Atlas stage {stage_name}")


@flow(name="atlas-pipeline", log_prints=True)
def atlas_pipeline(config: dict, stages: list[str] | None = None, force: bool = False) -> list[dict]:
    reports = run_stages(config_from_dict(config), stages, force, map_shards=map_with_prefect, on_stage=publish_status)
    return [r.__dict__ for r in reports]


def make_task_runner(execution: ExecutionConfig):
    """The Prefect task runner that ``execution.task_runner`` names."""
    if execution.task_runner == "ray":
        try:
            from prefect_ray import RayTaskRunner
        except ImportError:
            raise ConfigError("execution.task_runner: ray needs the `cluster` extra: "
                              "pip install -c requirements/constraints.txt -e '.[cluster]'") from None
        if execution.ray_address is None:
            # A local instance sized like the other runners; nothing that needs a network or a UI.
            os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
            init_kwargs = {"num_cpus": execution.workers, "include_dashboard": False}
        else:
            # "auto" must join a running cluster (RayTaskRunner alone would start a local one instead).
            init_kwargs = {"address": "auto"} if execution.ray_address == "auto" else {}
        return RayTaskRunner(address=execution.ray_address, init_kwargs=init_kwargs)
    runner_cls = ProcessPoolTaskRunner if execution.task_runner == "processes" else ThreadPoolTaskRunner
    return runner_cls(max_workers=execution.workers)


def _api_for_ray_workers(execution: ExecutionConfig):
    """Ray workers are separate processes: with no Prefect server configured, each would start its own
    temporary one (~15 s each). For a local Ray instance, start the temporary server here and hand its
    URL to the workers (it travels with the settings context). A Ray cluster needs a real server."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    if execution.task_runner != "ray" or PREFECT_API_URL.value():
        return contextlib.nullcontext()
    if execution.ray_address is not None:
        raise ConfigError("execution.ray_address joins a Ray cluster: set PREFECT_API_URL to a Prefect server that "
                          "every Ray node can reach (e.g. `prefect server start --host 0.0.0.0` on the head node)")
    from prefect.server.api.server import SubprocessASGIServer

    server = SubprocessASGIServer()  # the same temporary server Prefect would start (stopped at exit)
    server.start()
    return temporary_settings({PREFECT_API_URL: server.api_url})


def run_with_prefect(config: AtlasConfig, stages: Sequence[str] | None = None,
                     force: bool = False) -> list[StageReport]:
    flow_fn = atlas_pipeline.with_options(task_runner=make_task_runner(config.execution))
    with _api_for_ray_workers(config.execution):
        reports = flow_fn(config.model_dump(), list(stages) if stages else None, force)
    return [StageReport(**r) for r in reports]


@flow(name="atlas-run", log_prints=True)
def atlas_run(config_path: str, stages: list[str] | None = None, force: bool = False,
              overrides: list[str] | None = None) -> list[dict]:
    """Run a config file (the deployments' entrypoint): ``overrides`` are ``--set`` values, e.g.
    ``["execution.task_runner=ray", "execution.ray_gpus={tag: 1}"]``. The pipeline runs as a
    subflow with the task runner that the config names."""
    # A deployment loads this file as a module named "pipeline", which Ray workers and process pools
    # cannot import: submit the tasks of the installed module `flows.pipeline` instead.
    from flows.pipeline import run_with_prefect as run_installed

    config = load_config(config_path, overrides or [])
    return [r.__dict__ for r in run_installed(config, stages, force)]


if __name__ == "__main__":  # tasks from the importable module, not __main__ (see atlas_run)
    from flows.pipeline import run_with_prefect as run_installed

    run_installed(load_config(sys.argv[1], sys.argv[2:]))
