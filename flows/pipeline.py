"""The Atlas pipeline as a Prefect flow: every map stage is mapped over its shards.

``execution.task_runner`` picks where the shard tasks run:

- ``threads`` (default) / ``processes``: a pool of ``execution.workers`` on this machine;
- ``ray``: one Ray task per shard (prefect-ray, the ``cluster`` extra). ``execution.ray_address``
  ``None`` starts a small local Ray instance (``workers`` CPUs, no dashboard); ``"auto"`` or
  ``"ray://head:10001"`` joins a running cluster, whose nodes need Atlas installed and the run
  directory on a shared file system. ``execution.ray_gpus`` (e.g. ``{tag: 1, annotate: 1}``) runs
  that stage's shards on long-lived Ray actors of that many GPUs each, one per GPU slot of the cluster,
  so that each loads its model once.

A failed shard task is retried ``execution.shard_retries`` times before its shard counts as failed.

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
import queue
import signal
import sys
from collections.abc import Sequence

from prefect import flow, task, unmapped
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.futures import as_completed
from prefect.task_runners import ProcessPoolTaskRunner, ThreadPoolTaskRunner

from atlas.config import AtlasConfig, ConfigError, ExecutionConfig, config_from_dict, load_config
from atlas.core.rundir import RunDir
from atlas.core.signals import sigterm_as_interrupt
from atlas.runner import StageReport, run_one_shard, run_stages
from atlas.tools.status import status_rows


@task(name="shard", task_run_name="{stage_name}-{shard:05d}")
def shard_task(config: dict, stage_name: str, shard: int, stage_hash: str) -> dict:
    return run_one_shard(config, stage_name, shard, stage_hash)


def ray_remote_options(execution: dict, stage_name: str) -> dict:
    """Ray options of the shard work of ``stage_name``: ``num_gpus`` from ``execution.ray_gpus``. Ray only."""
    if execution.get("task_runner") != "ray":
        return {}
    gpus = execution.get("ray_gpus", {}).get(stage_name)
    return {"num_gpus": gpus} if gpus else {}


class StageActor:
    """A long-lived Ray actor holding one GPU stage: it sets the stage up (loads its model) on its first shard and
    keeps it for the next ones (``run_one_shard``'s per-process cache)."""

    def run_shard(self, config: dict, stage_name: str, shard: int, stage_hash: str) -> dict:
        return run_one_shard(config, stage_name, shard, stage_hash)


_ACTORS: dict[str, queue.Queue] = {}  # stage name -> its idle actors, while the stage runs (driver side)


@task(name="shard", task_run_name="{stage_name}-{shard:05d}")
def gpu_shard_task(config: dict, stage_name: str, shard: int, stage_hash: str) -> dict:
    """A shard of a GPU stage on Ray: the Prefect task runs in a driver thread and hands the shard to an idle actor."""
    import ray

    actors = _ACTORS[stage_name]
    actor = actors.get()
    try:
        return ray.get(actor.run_shard.remote(config, stage_name, shard, stage_hash))
    finally:
        actors.put(actor)


@contextlib.contextmanager
def _gpu_actors(stage_name: str, options: dict, num_shards: int):
    """The stage's actors, ``num_gpus`` each, as many as the cluster's GPUs hold now (at least one); killed when
    the stage ends, which frees their GPU memory for the next stage.

    Why actors and not Ray tasks: Ray gives every task that requests GPUs a fresh worker process (``max_calls=1``),
    so a GPU stage run as tasks loads its model once per shard. ``max_calls=0`` would reuse worker processes, but
    an idle worker would then keep the previous stage's model in GPU memory while the next stage loads its own."""
    import ray

    gpus = ray.cluster_resources().get("GPU", 0)
    if gpus < options["num_gpus"]:  # Ray would wait silently, maybe forever
        print(f"warning: {stage_name} asks {options['num_gpus']} GPU(s) per actor and the Ray cluster has "
              f"{gpus:g} now; its shards wait until GPU nodes join")
    count = max(1, min(num_shards, int(gpus // options["num_gpus"])))
    actors = [ray.remote(StageActor).options(max_restarts=1, **options).remote() for _ in range(count)]
    _ACTORS[stage_name] = queue.Queue()
    for actor in actors:
        _ACTORS[stage_name].put(actor)
    try:
        yield count
    finally:
        del _ACTORS[stage_name]
        for actor in actors:
            ray.kill(actor)


def map_with_prefect(config: dict, stage_name: str, shards: Sequence[int],
                     stage_hash: str) -> list[BaseException | None]:
    """Submit one task per shard to the flow's task runner; collect failures instead of raising.

    A failed shard task is retried ``execution.shard_retries`` times, ``shard_retry_delay_seconds`` apart. A GPU
    stage on Ray (``execution.ray_gpus``) runs its shards on long-lived actors, one model load per actor."""
    from tqdm.auto import tqdm

    execution = config["execution"]
    retries = {"retries": execution.get("shard_retries", 0),
               "retry_delay_seconds": execution.get("shard_retry_delay_seconds", 0)}
    options = ray_remote_options(execution, stage_name)
    with contextlib.ExitStack() as stack:
        if options:
            count = stack.enter_context(_gpu_actors(stage_name, options, len(shards)))
            # one driver thread per actor: the Prefect tasks (states, retries) only wait for their actor
            runner = stack.enter_context(ThreadPoolTaskRunner(max_workers=count))
            params = {"config": config, "stage_name": stage_name, "stage_hash": stage_hash}
            futures = [runner.submit(gpu_shard_task.with_options(**retries), dict(params, shard=s)) for s in shards]
        else:
            futures = shard_task.with_options(**retries).map(unmapped(config), unmapped(stage_name), list(shards),
                                                             unmapped(stage_hash))
        index = {f.task_run_id: i for i, f in enumerate(futures)}
        errors: list[BaseException | None] = [None] * len(futures)
        with tqdm(total=len(futures), desc=stage_name, unit="shard", disable=not execution["progress"]) as bar:
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
    # print: log_prints makes each stage line a Prefect log record, which a deployment's worker shows too (the
    # "atlas" logger has no handler there)
    with sigterm_as_interrupt(nested=True):  # started by the CLI: in place of the engine's handler
        reports = run_stages(config_from_dict(config), stages, force, map_shards=map_with_prefect,
                             on_stage=publish_status, log=print)
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


def _temporary_server(execution: ExecutionConfig):
    """With no Prefect server configured (PREFECT_API_URL), start the temporary one here, out of reach of Ctrl-C.

    Ctrl-C in a terminal signals the whole foreground process group. A server in it stops at once, and the
    interrupted flow then retries its last API calls against it for minutes (httpx.ConnectError) before it exits.
    Started with SIGINT blocked (a child inherits its parent's signal mask), the server records the interrupted
    flow, then stops at exit like Prefect's own temporary server. Its URL also reaches the workers of a local Ray
    instance (it travels with the settings context): separate processes that would each start a temporary server
    of their own (~15 s each). A Ray cluster needs a real server."""
    from prefect.server.api.server import SubprocessASGIServer
    from prefect.settings import PREFECT_API_URL, temporary_settings

    if PREFECT_API_URL.value():
        return contextlib.nullcontext()
    if execution.task_runner == "ray" and execution.ray_address is not None:
        raise ConfigError("execution.ray_address joins a Ray cluster: set PREFECT_API_URL to a Prefect server that "
                          "every Ray node can reach (e.g. `prefect server start --host 0.0.0.0` on the head node)")

    class Server(SubprocessASGIServer):
        def _run_uvicorn_command(self):
            blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
            # Stopped right after an interrupt, the server logs a traceback for each event it was still recording
            # (harmless); its own log stays quiet unless PREFECT_SERVER_LOGGING_LEVEL asks otherwise.
            quiet = "PREFECT_SERVER_LOGGING_LEVEL" not in os.environ
            if quiet:
                os.environ["PREFECT_SERVER_LOGGING_LEVEL"] = "CRITICAL"
            try:
                return super()._run_uvicorn_command()  # the server inherits the mask and the environment
            finally:
                signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
                if quiet:
                    del os.environ["PREFECT_SERVER_LOGGING_LEVEL"]

    server = Server()  # stopped at exit, after Prefect has sent what it still holds
    server.start()
    return temporary_settings({PREFECT_API_URL: server.api_url})


def run_with_prefect(config: AtlasConfig, stages: Sequence[str] | None = None,
                     force: bool = False) -> list[StageReport]:
    flow_fn = atlas_pipeline.with_options(task_runner=make_task_runner(config.execution))
    with _temporary_server(config.execution):
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
