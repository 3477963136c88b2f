"""Ray across nodes that share no folder: the run's storage is an S3 bucket (moto's server, tests/conftest.py),
the actor on one node and the rollout workers on another (`ray.cluster_utils.Cluster`, custom resources
pinning each bundle of the run's placement group). The checks before start ask every node whether it
reaches the storage."""

import os

import pytest

from grpo_flow.flows.grpo import grpo
from grpo_flow.schemas.presets import preset_config
from grpo_flow.workers.backends import ray_backend
from grpo_flow.workers.state.location import reach_from_here
from grpo_flow.workers.state.storage import RunStorage
from grpo_flow.workers.state.verify import verify_run

SMALL = dict(prompts_per_step=4, num_generations=4, num_rollout_workers=2, eval_prompts=0, save_steps=2)


def test_a_node_that_does_not_see_a_local_storage_root_is_refused_naming_the_fix(tmp_path):
    answer = reach_from_here(str(tmp_path), str(tmp_path / ".storage-check" / "written-on-another-node"))
    assert answer["problem"]
    message = ray_backend.storage_problem_message(str(tmp_path), answer)
    assert message.startswith("storage_root: node ") and "\n" not in message
    assert "use a URL every node reaches" in message and "a folder every node mounts at the same path" in message
    assert reach_from_here(str(tmp_path), None)["problem"] is None


@pytest.mark.parametrize("method", ["volume", "checkpoint", "lora"])
def test_a_file_weight_sync_on_a_url_root_is_refused_naming_the_methods_that_work(method):
    config = preset_config("tiny", run_id="ray-url", storage_root="s3://bucket/grpo", backend="ray")
    config = config.model_copy(update={"weight_sync_method": method})
    with pytest.raises(ray_backend.RayNotReadyError, match="use 'reload' or 'direct'") as caught:
        ray_backend.check_storage_on_nodes(None, config)
    assert str(caught.value).startswith("weight_sync_method: ") and "\n" not in str(caught.value)


@pytest.fixture
def two_nodes(storage_root, monkeypatch):
    """A head that runs nothing, a node for the actor and a node for the rollout workers (1 CPU each).
    Their processes keep what a URL root keeps on local disk in the session's cache, with its tiny model."""
    from ray.cluster_utils import Cluster

    monkeypatch.setenv("GRPO_FLOW_CACHE", str(storage_root))
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 0, "include_dashboard": False, "object_store_memory": 100 * 2**20},
    )
    nodes = {
        name: cluster.add_node(num_cpus=1, resources={name: 1.0}, object_store_memory=100 * 2**20)
        for name in ("actor-node", "rollout-node")
    }
    try:
        yield cluster, nodes
    finally:
        import ray

        ray.shutdown()
        cluster.shutdown()


@pytest.mark.ray
@pytest.mark.slow
def test_a_run_completes_with_its_actor_and_rollout_workers_on_nodes_that_share_only_the_bucket(
    prefect_server, s3_root, two_nodes, monkeypatch, tmp_path
):
    cluster, _ = two_nodes
    planned = ray_backend.plan_bundles

    def pinned(*args, **kwargs):  # bundle 0 holds the actor, the rest the rollout workers
        bundles = planned(*args, **kwargs)
        return [{**b, "actor-node" if i == 0 else "rollout-node": 0.5} for i, b in enumerate(bundles)]

    monkeypatch.setattr(ray_backend, "plan_bundles", pinned)
    monkeypatch.chdir(tmp_path)
    config = preset_config(
        "tiny",
        run_id="ray-s3",
        storage_root=s3_root,
        backend="ray",
        ray_address=cluster.address,
        ray_actor_cpus=1.0,
        ray_rollout_cpus=0.5,
        max_steps=4,
        **SMALL,
    )
    summary = grpo(config)
    assert summary["status"] == "completed" and summary["steps_completed"] == 4
    storage = RunStorage(s3_root, "ray-s3")
    assert storage.complete_checkpoints() == [2, 4]  # written and committed on the bucket by the actor's node
    check = verify_run(storage)
    assert check.clean and check.leftovers == []
    assert os.listdir(tmp_path) == []  # nothing in a local folder named after the URL
