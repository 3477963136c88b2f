"""The real model (SmolLM2-135M-Instruct, the smol-math preset) on the backends other than the local one: a
step with vLLM engines on Ray actors of a real local cluster, and a step through the Modal wrappers in
`.local()` mode. Each run is one short step; what it checks is that the model, its chat prompts and LoRA
travel through each backend's workers and come back as logged, trainable rows."""

import warnings

import pytest

from grpo_flow.flows.grpo import grpo
from grpo_flow.schemas.presets import preset_config
from grpo_flow.workers.state.storage import RunStorage

pytestmark = [pytest.mark.real_model, pytest.mark.slow]

SHORT = dict(max_steps=1, save_steps=1, prompts_per_step=2, num_generations=4, max_completion_length=8, eval_prompts=4)


def assert_one_step_logged(storage: RunStorage, summary: dict) -> None:
    assert summary["status"] == "completed", summary.get("error")
    rows = storage.read_rollouts(1).to_pylist()
    assert len(rows) == 2 * 4 and {row["policy_version"] for row in rows} == {0}
    assert all(row["prompt"].count("<|im_start|>system") == 1 for row in rows)  # templated once
    assert any(row["completion_tokens"] > 1 for row in rows)
    assert storage.complete_checkpoints() == [1]
    assert summary["initial_eval_accuracy"] == summary["initial_eval_accuracy"]  # measured: not NaN


@pytest.mark.ray
@pytest.mark.vllm
def test_a_smol_math_step_with_vllm_engines_on_ray_actors(prefect_server, storage_root, smollm2_path, ray_cluster):
    config = preset_config(
        "smol-math",
        run_id="smol-ray-vllm",
        storage_root=str(storage_root),
        backend="ray",
        ray_address=ray_cluster.address,
        rollout_engine="vllm",
        **SHORT,
    )
    summary = grpo(config)
    storage = RunStorage(storage_root, config.run_id)
    assert_one_step_logged(storage, summary)
    assert (storage.run_dir / "logs" / "rollout-0.log").is_file()  # the engine ran in its own process there
    assert not ray_cluster.named_actors(f"grpo-flow/{config.run_id}/")  # the run's end stopped its actors


def test_a_smol_math_step_through_the_modal_wrappers(prefect_server, storage_root, smollm2_path, monkeypatch):
    monkeypatch.setenv("GRPO_FLOW_MODAL_MODE", "local")
    warnings.filterwarnings("ignore", message=".*executing locally and will not have access to the mounted Volume")
    config = preset_config(
        "smol-math", run_id="smol-modal-local", storage_root=str(storage_root), backend="modal", **SHORT
    )
    summary = grpo(config)
    storage = RunStorage(storage_root, config.run_id)
    assert_one_step_logged(storage, summary)
    assert storage.read_metrics().to_pylist()[0]["gpu_seconds/actor"] > 0  # through the Modal classes
