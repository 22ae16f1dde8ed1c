"""The Atlas pipeline as a Prefect flow: every map stage is mapped over its shards.

Runs locally with no server to set up (Prefect starts a temporary one). On a cluster, point
``PREFECT_API_URL`` at your server and choose the Ray task runner in the config (later issue).

    python -m flows.pipeline configs/demo.yaml
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from prefect import flow, task, unmapped
from prefect.futures import as_completed
from prefect.task_runners import ProcessPoolTaskRunner, ThreadPoolTaskRunner

from atlas.config import AtlasConfig, config_from_dict, load_config
from atlas.runner import StageReport, run_one_shard, run_stages


@task(name="shard", task_run_name="{stage_name}-{shard:05d}")
def shard_task(config: dict, stage_name: str, shard: int, stage_hash: str) -> dict:
    return run_one_shard(config, stage_name, shard, stage_hash)


def map_with_prefect(config: dict, stage_name: str, shards: Sequence[int], stage_hash: str) -> list[BaseException | None]:
    """Submit one task per shard to the flow's task runner; collect failures instead of raising."""
    from tqdm.auto import tqdm

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


@flow(name="atlas-pipeline", log_prints=True)
def atlas_pipeline(config: dict, stages: list[str] | None = None, force: bool = False) -> list[dict]:
    reports = run_stages(config_from_dict(config), stages, force, map_shards=map_with_prefect)
    return [r.__dict__ for r in reports]


def run_with_prefect(config: AtlasConfig, stages: Sequence[str] | None = None, force: bool = False) -> list[StageReport]:
    execution = config.execution
    runner_cls = ProcessPoolTaskRunner if execution.task_runner == "processes" else ThreadPoolTaskRunner
    flow_fn = atlas_pipeline.with_options(task_runner=runner_cls(max_workers=execution.workers))
    reports = flow_fn(config.model_dump(), list(stages) if stages else None, force)
    return [StageReport(**r) for r in reports]


if __name__ == "__main__":
    run_with_prefect(load_config(sys.argv[1], sys.argv[2:]))
