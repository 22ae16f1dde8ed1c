"""The Ray task runner (prefect-ray, the `cluster` extra): same outputs as the inline loop; GPU requests."""

import pytest

pytest.importorskip("prefect_ray")

from conftest import write_config, write_jsonl  # noqa: E402
from prefect_ray.context import RemoteOptionsContext  # noqa: E402
from test_run import outputs  # noqa: E402

from atlas.config import load_config  # noqa: E402
from atlas.core.files import stable_hash  # noqa: E402
from atlas.runner import _WORKER_STAGES, run_stages  # noqa: E402


def test_ray_gpus_become_the_remote_options_of_that_stages_shard_tasks(monkeypatch):
    import flows.pipeline as pipeline

    execution = {"task_runner": "ray", "ray_gpus": {"tag": 1, "annotate": 0.5}, "progress": False}
    assert pipeline.ray_remote_options(execution, "tag") == {"num_gpus": 1}
    assert pipeline.ray_remote_options(execution, "annotate") == {"num_gpus": 0.5}
    assert pipeline.ray_remote_options(execution, "chunk") == {}
    assert pipeline.ray_remote_options(dict(execution, task_runner="threads"), "tag") == {}  # Ray only

    # map_with_prefect submits a stage's tasks inside those options (what RayTaskRunner.submit reads).
    seen = {}

    class FakeTask:
        def map(self, config, stage_name, shards, stage_hash):
            seen[stage_name.value] = RemoteOptionsContext.get().current_remote_options
            return []

    monkeypatch.setattr(pipeline, "shard_task", FakeTask())
    for stage in ("chunk", "tag"):
        assert pipeline.map_with_prefect({"execution": execution}, stage, [], "hash") == []
    assert seen == {"chunk": {}, "tag": {"num_gpus": 1}}


@pytest.mark.slow
def test_ray_task_runner_gives_the_same_chunks_as_the_inline_loop(tmp_path, demo_records, prefect_harness):
    from flows.pipeline import run_with_prefect

    docs = write_jsonl(tmp_path / "docs.jsonl", demo_records[:60])  # 6 shards of 10 documents
    (tmp_path / "inline").mkdir()
    inline = load_config(write_config(tmp_path / "inline", docs))
    run_stages(inline, ["chunk"], log=lambda m: None)

    (tmp_path / "ray").mkdir()
    config = load_config(write_config(tmp_path / "ray", docs, execution={
        "orchestrator": "prefect", "task_runner": "ray", "workers": 2, "ray_address": None}))
    [report] = run_with_prefect(config, ["chunk"])  # starts and stops a local Ray instance of 2 CPUs

    assert report.num_shards == 6 and sorted(report.ran) == list(range(6))
    assert outputs(tmp_path / "ray" / "run") == outputs(tmp_path / "inline" / "run")
    # The shards ran in Ray workers, not here: this process never built the chunk stage of that config.
    assert ("chunk", stable_hash(config.model_dump())) not in _WORKER_STAGES
