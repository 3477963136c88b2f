"""The Ray backend's parts: resource checks (no Ray needed), and against a real local Ray cluster (the
`ray_cluster` fixture, tests/conftest.py) every weight-sync method that makes sense on Ray (into the
transformers engine, and the LoRA and checkpoint paths into a vLLM engine), healing when the published
weights are gone, and a checkpoint written while the engines lag the actor, restored
after every worker process was killed."""

import os
import signal

import pyarrow as pa
import pytest
import torch

from grpo_flow.schemas.presets import preset_config
from grpo_flow.workers.backends.ray_backend import RayNotReadyError, check_resources, cluster_address, plan_bundles
from grpo_flow.workers.data.loaders import load_task
from grpo_flow.workers.data.tiny_model import ensure_tiny_model
from grpo_flow.workers.rollout.base import SamplingParams
from grpo_flow.workers.rollout.transformers_engine import TransformersRolloutEngine
from grpo_flow.workers.state.storage import RunStorage


def config(**fields):
    return preset_config("tiny", **{"run_id": "ray-unit", "backend": "ray", **fields})


# -- resources and addresses, no cluster needed ------------------------------------------------------------
def test_bundles_follow_the_fields_and_gpus_default_to_one_each_on_a_gpu_cluster():
    assert (
        plan_bundles(config(ray_actor_cpus=2, ray_rollout_cpus=0.5), cluster_gpus=0)
        == [{"CPU": 2}] + [{"CPU": 0.5}] * 2
    )
    assert plan_bundles(config(), cluster_gpus=8) == [{"CPU": 1, "GPU": 1}] * 3
    assert (
        plan_bundles(config(ray_actor_gpus=2, ray_rollout_gpus=0.5), cluster_gpus=8)
        == [{"CPU": 1, "GPU": 2}] + [{"CPU": 1, "GPU": 0.5}] * 2
    )


def test_too_few_gpus_are_refused_in_all_and_per_node():
    two_nodes = [{"CPU": 8, "GPU": 1}, {"CPU": 8, "GPU": 1}]
    check_resources(config(), two_nodes[:1] * 3, "here")  # three 1-GPU nodes hold three 1-GPU workers
    with pytest.raises(RayNotReadyError, match=r"asks for 3 GPU .* has 2 GPU in all"):
        check_resources(config(), two_nodes, "here")
    with pytest.raises(RayNotReadyError, match=r"ray_actor_gpus: 2 GPU for one worker, but no node .* more than 1 GPU"):
        check_resources(config(ray_actor_gpus=2, ray_rollout_gpus=0), two_nodes, "here")
    with pytest.raises(RayNotReadyError, match=r"ray_actor_cpus/ray_rollout_cpus: the run asks for 3 CPU"):
        check_resources(config(ray_rollout_cpus=1), [{"CPU": 2}], "here")


def test_the_default_rollout_cpus_fit_a_ray_start_head_on_two_cores():
    """The tiny preset asked for 3 CPUs of the 2 that `ray start --head` gives a 2-core machine (issue 30, item 14):
    by default each rollout engine gets 1 CPU where the cluster has them, else a share of what the actor leaves."""
    check_resources(config(), [{"CPU": 2}], "here")
    assert plan_bundles(config(), cluster_gpus=0, cluster_cpus=2) == [{"CPU": 1}, {"CPU": 0.5}, {"CPU": 0.5}]
    assert plan_bundles(config(num_rollout_workers=4, prompts_per_step=8), 0, 2) == [{"CPU": 1}] + [{"CPU": 0.25}] * 4
    assert plan_bundles(config(), cluster_gpus=0, cluster_cpus=16) == [{"CPU": 1}] * 3
    with pytest.raises(
        RayNotReadyError, match=r"asks for 3 CPU \(ray_actor_cpus 1 \+ num_rollout_workers 2 x ray_rollout_cpus 1\)"
    ):
        check_resources(config(), [{"CPU": 1}], "here")  # nothing left beside the actor: said, not divided by zero


@pytest.mark.ray
def test_the_tiny_preset_with_the_default_cpus_is_ready_on_a_two_cpu_cluster(ray_cluster, tmp_path):
    from grpo_flow.workers.backends.ray_backend import check_ray_ready

    check_ray_ready(config(ray_address=ray_cluster.address, storage_root=str(tmp_path)))


def test_the_address_comes_from_the_config_then_ray_address_then_a_local_instance(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert cluster_address(config()) == ("local", "default")
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    assert cluster_address(config()) == ("10.0.0.1:6379", "RAY_ADDRESS")
    assert cluster_address(config(ray_address="auto")) == ("auto", "ray_address")


def test_a_ray_actors_vllm_engine_keeps_the_gpus_ray_assigned_it(monkeypatch, tmp_path):
    """The local backend pins engine i of server mode to GPU i + 1; on Ray the engine process inherits the
    CUDA_VISIBLE_DEVICES Ray set for its actor, takes the actor's CPUs as threads, logs in the run folder."""
    from pathlib import Path

    from grpo_flow.workers.backends import vllm_env
    from grpo_flow.workers.backends.servers import default_engine

    python = tmp_path / "vllm-env" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text("#!/bin/sh\n")
    python.chmod(0o755)
    monkeypatch.setattr(vllm_env, "has_cuda", lambda: True)
    monkeypatch.setattr(vllm_env, "vllm_importable", lambda: False)  # the project's environment, as here
    run_config = config(
        rollout_engine="vllm", vllm_python=str(python), storage_root=str(tmp_path / "store"), ray_rollout_cpus=3
    )
    local = vllm_env.local_engine(
        run_config.model_copy(update={"backend": "local", "vllm_mode": "server"}), "m", 1, 2, None
    )
    assert local.env == {"CUDA_VISIBLE_DEVICES": "2"}
    root = Path(run_config.storage_root)
    engine = default_engine(run_config, "m", 1, "cuda", root)
    assert type(engine).__name__ == "VLLMProcessEngine" and engine.env == {} and engine.threads == 3
    assert engine.options.enable_sleep_mode is False and engine.options.gpu_memory_utilization == 0.9  # server mode
    assert engine.log_path == tmp_path / "store" / "runs" / "ray-unit" / "logs" / "rollout-1.log"
    monkeypatch.setattr(vllm_env, "vllm_importable", lambda: True)  # a Ray worker image with vLLM: in the actor
    assert type(default_engine(run_config, "m", 1, "cuda", root)).__name__ == "VLLMRolloutEngine"


# -- against the cluster ----------------------------------------------------------------------------------
PARAMS = SamplingParams(n=2, max_tokens=2, seed=7)


def sample(workers, index, version):
    """(completion token ids, sampling log-probs) of engine `index`'s seeded generation on six fixed prompts,
    at policy `version`."""
    result = workers.generate(index, version, load_task("last_digit").train.select(range(6))["prompt"], PARAMS, 32)
    return result.completion_token_ids, result.sampling_logprobs, result


def to_initial(workers, index):
    """Engine `index` back on the initial model (after `checkpoint`: an engine on it again)."""
    workers.rollout[index].call("initial")
    workers.rollout_versions[index] = 0


def ray_workers(run_config, model_path):
    from grpo_flow.workers.backends.ray_backend import RayPlacement
    from grpo_flow.workers.backends.workers import Workers

    return Workers(run_config, model_path, RayPlacement(run_config, model_path)).start()


def use_method(workers, run_config, method):
    workers.placement.config = run_config.model_copy(update={"weight_sync_method": method})


def rollouts_table(result, seed):
    """The columns of a logged step the actor reads: the engine's samples, with made-up advantages."""
    generator = torch.Generator().manual_seed(seed)
    return pa.table(
        {
            "prompt_token_ids": [ids for ids in result.prompt_token_ids for _ in range(PARAMS.n)],
            "completion_token_ids": result.completion_token_ids,
            "sampling_logprobs": result.sampling_logprobs,
            "advantage": torch.randn(len(result.texts), generator=generator).tolist(),
        }
    )


def kill(worker):
    pid = worker.call("ready", None)["pid"]  # the worker's own answer (the dashboard's state API is off in tests)
    os.kill(pid, signal.SIGKILL)
    return pid


@pytest.mark.ray
@pytest.mark.vllm
def test_a_vllm_engine_on_a_ray_actor_takes_the_adapter_and_the_merged_weights_by_each_method(
    ray_cluster, storage_root
):
    """rollout_engine='vllm' with use_lora and lora_publish='adapter': the adapter alone through the object
    store (`direct`) and as a folder on the storage root (`lora`), the merged weights as a saved model the
    engine is re-created from (`checkpoint`). (Before the `run` fixture: the cluster's 2 CPUs hold one run.)"""

    run_config = config(
        run_id="ray-vllm-unit",
        storage_root=str(storage_root),
        ray_address=ray_cluster.address,
        rollout_engine="vllm",
        num_rollout_workers=1,
        ray_actor_cpus=1,
        ray_rollout_cpus=1,
        use_lora=True,
        lora_publish="adapter",
    )
    workers = ray_workers(run_config, ensure_tiny_model(storage_root))
    try:
        assert workers.rollout[0].call("ready", None)["engine"] == "VLLMProcessEngine"
        ids0, logprobs0, result0 = sample(workers, 0, 0)
        workers.actor_step(0, rollouts_table(result0, seed=0))
        synced = {}
        for method in ("direct", "checkpoint", "lora"):
            use_method(workers, run_config, method)
            to_initial(workers, 0)
            assert sample(workers, 0, 0)[:2] == (ids0, logprobs0)
            assert workers.sync_weights() == 1 and workers.last_sync["bytes"] > 0
            synced[method] = sample(workers, 0, 1)[:2]
    finally:
        workers.close()
    assert synced["direct"][1] != logprobs0  # the new policy samples otherwise
    assert synced["lora"] == synced["direct"]  # the same adapter, in memory or as a folder
    ids, logprobs = synced["checkpoint"]  # merged into the weights: the same policy, up to rounding
    assert ids == synced["direct"][0]
    torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(synced["direct"][1]), atol=1e-4, rtol=0)


@pytest.fixture(scope="module")
def run(ray_cluster, storage_root):
    """Ray workers of a scratch run (the tiny model, two engines), its initial samples, and its config."""
    model_path = ensure_tiny_model(storage_root)
    run_config = config(
        storage_root=str(storage_root), ray_address=ray_cluster.address, ray_actor_cpus=1, ray_rollout_cpus=0.5
    )
    workers = ray_workers(run_config, model_path)
    try:
        yield workers, sample(workers, 0, 0), run_config
    finally:
        workers.close()


@pytest.mark.ray
def test_every_weight_sync_method_gives_both_engines_the_actors_new_weights(run, storage_root):
    workers, (ids0, logprobs0, result0), run_config = run
    workers.actor_step(0, rollouts_table(result0, seed=0))
    assert workers.actor_version == 1
    weights_dir = RunStorage(storage_root, "ray-unit").run_dir / "weights"
    synced = {}
    for method in ("reload", "direct", "volume", "checkpoint"):
        use_method(workers, run_config, method)
        for index in range(len(workers.rollout)):
            to_initial(workers, index)
        assert sample(workers, 1, 0)[:2] == (ids0, logprobs0)
        files_before = sorted(weights_dir.rglob("*")) if weights_dir.exists() else []
        assert workers.sync_weights() == 1 and workers.last_sync["bytes"] > 0
        synced[method] = [sample(workers, index, 1)[:2] for index in range(len(workers.rollout))]
        assert synced[method][0] == synced[method][1]
        files_after = sorted(weights_dir.rglob("*")) if weights_dir.exists() else []
        # reload and direct go through Ray's object store; volume and checkpoint write versioned folders.
        assert (files_after == files_before) == (method in ("reload", "direct")), method
    assert synced["reload"][0][1] != logprobs0  # the new weights sample otherwise
    assert all(synced[m] == synced["reload"] for m in synced)
    # What the engines hold is what the actor published: a local engine with those tensors samples the same.
    import ray

    local = TransformersRolloutEngine(workers.model_path)
    local.load()
    use_method(workers, run_config, run_config.weight_sync_method)
    workers.sync_weights()
    local.load_state_dict(ray.get(workers.published[1]), 1)
    generated = local.generate(load_task("last_digit").train.select(range(6))["prompt"], PARAMS, 32)
    ids, logprobs = generated.completion_token_ids, generated.sampling_logprobs
    assert ids == synced["reload"][0][0]
    torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(synced["reload"][0][1]), atol=1e-5, rtol=0)


@pytest.mark.ray
def test_an_engine_whose_published_weights_are_gone_gets_them_published_again(run, ray_cluster):
    """The published copy's owner died (as when its node goes): the restarted engine's load fails with
    Ray's ObjectLostError, and the backend publishes the actor's weights at that version again."""
    import ray

    workers, _, _ = run
    expected = sample(workers, 0, 1)[:2]

    @ray.remote(num_cpus=0)  # the run's placement group holds every CPU of the test cluster
    class Owner:
        def put(self, value):
            return [ray.put(value)]  # a reference this actor owns

    owner = Owner.remote()
    [orphan] = ray.get(owner.put.remote(ray.get(workers.published[1])))
    ray.kill(owner)
    workers.published = (1, orphan)
    kill(workers.rollout[1])
    assert sample(workers, 1, 1)[:2] == expected
    assert workers.published[1] is not orphan


@pytest.mark.ray
@pytest.mark.parametrize("method", ["reload", "volume"])
def test_a_checkpoint_taken_while_the_engines_lag_restores_them_after_every_worker_was_killed(
    run, ray_cluster, storage_root, method
):
    """sync_weights_every > 1: the checkpoint keeps the engines' older weights (a file from the object
    store's copy, or the path of the versioned folder on the storage root)."""
    workers, (_, _, result0), run_config = run
    use_method(workers, run_config, method)
    storage = RunStorage(storage_root, run_config.run_id)  # where the actor writes and commits it
    version = workers.actor_version
    workers.sync_weights()  # the engines hold `version`
    lagging = sample(workers, 0, version)[:2]
    workers.actor_step(version, rollouts_table(result0, seed=version))  # the actor moves on, no sync
    state = workers.save_checkpoint(storage, version + 1, {})
    assert state["rollout_policy_version"] == version and ("rollout_weights" in state) == (method == "volume")
    assert storage.verify_checkpoint(version + 1) == state

    killed = [kill(worker) for worker in (workers.actor, *workers.rollout)]
    assert workers.restore(storage, version + 1) == version
    assert workers.actor_version == version + 1
    assert [sample(workers, index, version)[:2] for index in range(2)] == [lagging, lagging]
    for pid in killed:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
