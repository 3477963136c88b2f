"""A run whose actor is 2 ranks (actor_num_processes=2, the local backend, gloo on CPU) through the unchanged
flow: it completes, samples what the one-process run samples, and ends with its weights."""

from __future__ import annotations

from safetensors.torch import load_file

from grpo_flow.flows.grpo import grpo
from grpo_flow.schemas.presets import preset_config
from grpo_flow.workers.backends import release
from grpo_flow.workers.state.storage import RunStorage
from linear_updates import assert_same_update, use_sgd  # tests/linear_updates.py

STEPS = 3


def run(storage_root, processes: int) -> RunStorage:
    config = preset_config(
        "tiny",
        run_id=f"actor-processes-{processes}",
        storage_root=str(storage_root),
        max_steps=STEPS,
        prompts_per_step=4,
        num_generations=4,
        save_steps=STEPS,
        eval_prompts=0,
        actor_num_processes=processes,
    )
    try:
        assert grpo(config)["status"] == "completed"
    finally:
        release(config.run_id)  # the ranks end with the run's workers
    return RunStorage(storage_root, config.run_id)


def test_a_two_rank_actor_runs_the_flow_and_ends_with_the_one_process_weights(
    prefect_server, storage_root, monkeypatch
):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # each rank one thread: the machine is shared
    use_sgd(monkeypatch)  # the runs' updates compared as tests/workers/actor/test_sharded_actor.py does
    one, two = run(storage_root, 1), run(storage_root, 2)
    assert two.complete_checkpoints() == [STEPS]
    assert two.read_rollouts(columns=["completion"]).equals(one.read_rollouts(columns=["completion"]))
    weights = [load_file(run.checkpoint_dir(STEPS) / "model" / "model.safetensors") for run in (one, two)]
    initial = load_file(storage_root / "models" / "tiny-qwen2" / "model.safetensors")
    assert_same_update(initial, weights[0], weights[1])
