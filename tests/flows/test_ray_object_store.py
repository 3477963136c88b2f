"""Ray across nodes that share no folder: the run's storage is an S3 bucket (moto's server, tests/conftest.py),
the actor on one node and the rollout workers on another (`ray.cluster_utils.Cluster`, custom resources
pinning each bundle of the run's placement group). The checks before start ask every node whether it
reaches the storage. A run moves between the local backend and the cluster between resumes, ending
with the unbroken run's weights (the tiny preset samples and trains bit for bit the same on both)."""

import os
import signal
import subprocess

import pytest

from grpo_flow.flows.grpo import grpo
from grpo_flow.schemas.presets import preset_config
from grpo_flow.workers.backends import ray_backend
from grpo_flow.workers.state.location import reach_from_here
from grpo_flow.workers.state.resume import config_for_resume
from grpo_flow.workers.state.storage import RunStorage
from grpo_flow.workers.state.verify import verify_run
from train_cli import assert_same_weights, cli_env, final_weights, train_argv  # tests/flows/train_cli.py

SMALL = dict(prompts_per_step=4, num_generations=4, num_rollout_workers=2, eval_prompts=0, save_steps=2)
SMALL_CLI = ["--preset", "tiny", "--max-steps", "4", *(f"--{k.replace('_', '-')}={v}" for k, v in SMALL.items())]
RAY = dict(backend="ray", ray_actor_cpus=1.0, ray_rollout_cpus=0.5)


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


@pytest.fixture(scope="module")
def two_nodes(storage_root):
    """A head that runs nothing, a node for the actor and a node for the rollout workers (1 CPU each), for
    the module. Their processes keep what a URL root keeps on local disk in the session's cache, with its
    tiny model. The run's placement group pins bundle 0 (the actor) to one node, the rest to the other."""
    from ray.cluster_utils import Cluster

    planned = ray_backend.plan_bundles

    def pinned(*args, **kwargs):
        bundles = planned(*args, **kwargs)
        return [{**b, "actor-node" if i == 0 else "rollout-node": 0.5} for i, b in enumerate(bundles)]

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("GRPO_FLOW_CACHE", str(storage_root))
        patch.setattr(ray_backend, "plan_bundles", pinned)
        cluster = Cluster(
            initialize_head=True,
            head_node_args={"num_cpus": 0, "include_dashboard": False, "object_store_memory": 100 * 2**20},
        )
        for name in ("actor-node", "rollout-node"):
            cluster.add_node(num_cpus=1, resources={name: 1.0}, object_store_memory=100 * 2**20)
        try:
            yield cluster
        finally:
            import ray

            ray.shutdown()
            cluster.shutdown()


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """The runs' working folder: a URL taken as a path would leave an `s3:` folder in it."""
    with pytest.MonkeyPatch.context() as patch:
        folder = tmp_path_factory.mktemp("cwd")
        patch.chdir(folder)
        yield folder


@pytest.fixture(scope="module")
def unbroken(prefect_server, s3_root, two_nodes, workdir):
    summary = grpo(
        preset_config(
            "tiny", run_id="ray-s3", storage_root=s3_root, ray_address=two_nodes.address, max_steps=4, **RAY, **SMALL
        )
    )
    return summary, RunStorage(s3_root, "ray-s3")


@pytest.mark.ray
@pytest.mark.slow
def test_a_run_completes_with_its_actor_and_rollout_workers_on_nodes_that_share_only_the_bucket(unbroken, workdir):
    summary, storage = unbroken
    assert summary["status"] == "completed" and summary["steps_completed"] == 4
    assert storage.complete_checkpoints() == [2, 4]  # written and committed on the bucket by the actor's node
    check = verify_run(storage)
    assert check.clean and check.leftovers == []
    assert os.listdir(workdir) == []  # nothing in a local folder named after the URL


def killed_at_step_4(s3_root: str, run_id: str, *args: str) -> RunStorage:
    """`grpo train` of the tiny run SIGKILLed before it generates step 4: checkpoint 2, step 3 logged."""
    argv = train_argv(s3_root, run_id, *SMALL_CLI, *args)
    killed = subprocess.run(argv, capture_output=True, text=True, env=cli_env("generate@4:kill"), timeout=600)
    assert killed.returncode == -9, killed.stderr[-3000:]
    storage = RunStorage(s3_root, run_id)
    assert storage.latest_valid_checkpoint() == 2 and storage.rollout_steps() == [1, 2, 3]
    return storage


def kill_during_first(monkeypatch, worker: str, method: str) -> list[int]:
    """SIGKILL `worker`'s process while its first `method` call is in flight; the pids killed."""
    killed: list[int] = []
    original = ray_backend.RayHandle.call

    def call(self, name, *args):
        if (self.name, name) != (worker, method) or killed:
            return original(self, name, *args)
        pid = original(self, "ready")["pid"]  # the worker's own answer
        ref = getattr(self.handle, name).remote(*args)
        os.kill(pid, signal.SIGKILL)
        killed.append(pid)
        return self.ray.get(ref)

    monkeypatch.setattr(ray_backend.RayHandle, "call", call)
    return killed


def assert_ends_as_unbroken(storage: RunStorage, unbroken: RunStorage) -> None:
    assert_same_weights(final_weights(storage, 4), final_weights(unbroken, 4))
    columns = ["step", "completion", "advantage"]
    assert storage.read_rollouts(columns=columns).equals(unbroken.read_rollouts(columns=columns))
    assert storage.uncommitted() == []


@pytest.mark.ray
@pytest.mark.slow
def test_a_run_moves_from_the_local_backend_to_the_cluster_and_back_to_the_unbroken_weights(
    unbroken, s3_root, two_nodes, workdir, monkeypatch
):
    """Local on S3, SIGKILLed, resumed on the two-node cluster, where a rollout worker's process is SIGKILLed
    while it generates step 4 (Ray restarts it; it heals). Then the other way: a Ray run SIGKILLed (its
    driver, `grpo train`), resumed with the local backend. Both end with the unbroken run's weights."""
    storage = killed_at_step_4(s3_root, "to-ray")
    killed = kill_during_first(monkeypatch, "rollout-1", "generate")
    moved = config_for_resume(storage, {**RAY, "ray_address": two_nodes.address})
    summary = grpo(moved)
    assert summary["status"] == "completed" and len(killed) == 1
    with pytest.raises(ProcessLookupError):
        os.kill(killed[0], 0)
    assert storage.effective_config()["backend"] == "ray"  # the resume record keeps the backend it moved to
    assert_ends_as_unbroken(storage, unbroken[1])

    ray_cli = ["--backend", "ray", "--ray-address", two_nodes.address, "--ray-actor-cpus=1", "--ray-rollout-cpus=0.5"]
    storage = killed_at_step_4(s3_root, "to-local", *ray_cli)
    summary = grpo(config_for_resume(storage, {"backend": "local"}))
    assert summary["status"] == "completed"
    assert (storage.read_config()["backend"], storage.effective_config()["backend"]) == ("ray", "local")
    assert_ends_as_unbroken(storage, unbroken[1])
    assert os.listdir(workdir) == []
