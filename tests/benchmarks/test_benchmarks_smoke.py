"""The benchmarks' plumbing works: instant workers drive the real flow, the step clock and API
counter see its steps, the direct (no-Prefect) steps write what the flow writes, and gpu.py
refuses cleanly without CUDA. No timings are asserted: figures come from running benchmarks/."""

import subprocess
import sys

import pytest

from benchmarks.gpu import model_flops_per_step
from benchmarks.instant_workers import instant_model_dir, instant_workers
from benchmarks.memory import rollouts_table
from benchmarks.steps import ApiCounter, StepClock, run_steps_directly
from schemas.presets import preset_config
from workers.state.storage import RunStorage


def test_instant_workers_run_the_real_flow_and_direct_steps_continue_it(prefect_server, tmp_path):
    from flows.grpo import grpo
    from workers.backends import release

    config = preset_config(
        "tiny",
        model=instant_model_dir(tmp_path / "model"),
        storage_root=str(tmp_path / "storage"),
        run_id="instant",
        max_steps=2,
        save_steps=1,
        eval_prompts=0,
    )
    counter = ApiCounter()
    clock = StepClock(counter, count_from=2)
    with instant_workers(), counter.watch(), clock.watch():
        summary = grpo(config)
        assert summary["status"] == "completed"
        assert sorted(clock.intervals()) == [1, 2] and clock.plan.run_id == "instant"
        assert clock.counted["requests"] > 0 and clock.counted["events"] > 0
        release(config, config.run_id)
        more = config.model_copy(update={"max_steps": 4})
        seconds = run_steps_directly(more, clock.plan, 3, 4)
    assert sorted(seconds) == [3, 4]
    storage = RunStorage(config.storage_root, "instant")
    assert storage.logged_steps() == [1, 2, 3, 4] and storage.rollout_steps() == [1, 2, 3, 4]
    assert storage.complete_checkpoints() == [1, 2, 3, 4]
    flow_rows, direct_rows = storage.read_rollouts(2), storage.read_rollouts(3)
    assert flow_rows.schema == direct_rows.schema and flow_rows.num_rows == direct_rows.num_rows == 256
    assert storage.read_metrics().column("step").to_pylist() == [1, 2, 3, 4]


def test_instant_workers_as_ray_actors_run_the_real_flow(prefect_server, tmp_path, ray_cluster):
    """What `benchmarks/orchestration.py --backend ray` times: the flow with instant workers in Ray actors."""
    from flows.grpo import grpo

    config = preset_config(
        "tiny",
        model=instant_model_dir(tmp_path / "model"),
        storage_root=str(tmp_path / "storage"),
        run_id="instant-ray",
        max_steps=2,
        save_steps=1,
        eval_prompts=0,
        backend="ray",
        ray_address=ray_cluster.address,
        actor_cpus=1,
        rollout_cpus=0.5,
    )
    with instant_workers(ray=True) as running:
        summary = grpo(config)
        assert not running  # released at the run's end
    assert summary["status"] == "completed"
    rows = RunStorage(config.storage_root, "instant-ray").read_metrics().to_pylist()
    assert [r["synced_version"] for r in rows] == [1, 2] and all(r["sync/bytes"] == 16384 for r in rows)
    assert RunStorage(config.storage_root, "instant-ray").complete_checkpoints() == [1, 2]
    assert not ray_cluster.named_actors("grpo-flow/instant-ray/")


def test_memory_rollouts_table_has_the_requested_shape():
    table = rollouts_table(rows=3, prompt_tokens=5, completion_tokens=2, vocab=1000)
    assert table.num_rows == 3
    assert [len(r) for r in table.column("prompt_token_ids").to_pylist()] == [5, 5, 5]
    assert [len(r) for r in table.column("completion_token_ids").to_pylist()] == [2, 2, 2]


def test_model_flops_count_forward_backward_and_attention():
    assert model_flops_per_step(parameters=10, layers=1, hidden=2, rows=1, sequence=3) == pytest.approx(
        6 * 10 * 3 + 12 * 2 * 3 * 3
    )


def test_gpu_benchmark_refuses_without_cuda():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    done = subprocess.run([sys.executable, "-m", "benchmarks.gpu"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "needs a CUDA GPU" in done.stderr
