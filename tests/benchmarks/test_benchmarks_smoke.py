"""The benchmarks' plumbing works: instant workers drive the real flow, the step clock and API
counter see its steps, the direct (no-Prefect) steps write what the flow writes, and gpu.py
refuses cleanly without CUDA. No timings are asserted: figures come from running benchmarks/."""

import argparse
import subprocess
import sys
import time

import pytest

from benchmarks.gpu import model_flops_per_step
from benchmarks.instant_workers import instant_model_dir, instant_workers
from benchmarks.memory import rollouts_table
from benchmarks.steps import ApiCounter, StepClock, run_steps_directly
from grpo_flow.schemas.presets import preset_config
from grpo_flow.workers.state.storage import RunStorage


def test_instant_workers_run_the_real_flow_and_direct_steps_continue_it(prefect_server, tmp_path):
    from grpo_flow.flows.grpo import grpo
    from grpo_flow.workers.backends import release

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
        release(config.run_id)
        more = config.model_copy(update={"max_steps": 4})
        seconds = run_steps_directly(more, clock.plan, 3, 4)
    assert sorted(seconds) == [3, 4]
    storage = RunStorage(config.storage_root, "instant")
    assert storage.logged_steps() == [1, 2, 3, 4] and storage.rollout_steps() == [1, 2, 3, 4]
    assert storage.complete_checkpoints() == [1, 2, 3, 4]
    flow_rows, direct_rows = storage.read_rollouts(2), storage.read_rollouts(3)
    assert flow_rows.schema == direct_rows.schema and flow_rows.num_rows == direct_rows.num_rows == 256
    assert storage.read_metrics().column("step").to_pylist() == [1, 2, 3, 4]


@pytest.mark.ray
def test_orchestration_ray_side_runs_flow_and_direct_steps_on_ray_actors(
    prefect_server, tmp_path, ray_cluster, monkeypatch
):
    """What `benchmarks/orchestration.py --backend ray` times: the flow with instant workers in Ray actors,
    continued without Prefect; both sides' workers are released, so the cluster's CPUs are free again for
    the next run (a leftover placement group once kept the real Ray run waiting for its placement)."""
    import ray

    from benchmarks.orchestration import run_instant

    monkeypatch.setenv("RAY_ADDRESS", ray_cluster.address)
    result = run_instant(tmp_path, 2, 0, ray=True)
    assert len(result["per_step_s"]) == 2 and result["median_direct_step_s"] > 0
    assert set(result["median_stage_s"]) == {"time/generate_s", "time/score_s", "time/actor_s", "time/sync_s"}
    storage = RunStorage(str(tmp_path / "storage"), "instant-ray")
    rows = storage.read_metrics().to_pylist()
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert [r["synced_version"] for r in rows] == [1, 2, 3, 4] and all(r["sync/bytes"] == 16384 for r in rows)
    assert not ray_cluster.named_actors("grpo-flow/instant-ray/")
    deadline = time.monotonic() + 15
    while ray.available_resources().get("CPU", 0) < 2 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert ray.available_resources().get("CPU", 0) == 2  # no placement group left holding them


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


@pytest.mark.slow
def test_quickstart_times_a_checkouts_grpo_train_and_refuses_a_folder_that_is_not_one(tmp_path, storage_root):
    from benchmarks import harness
    from benchmarks.quickstart import check, timed_run

    assert "not a grpo-flow checkout" in check(argparse.Namespace(baseline=tmp_path))
    assert check(argparse.Namespace(baseline=harness.ROOT)) is None
    assert timed_run(harness.ROOT, storage_root, "quickstart", max_steps=1) > 0
    assert RunStorage(str(storage_root), "quickstart").logged_steps() == [1]


def test_a_side_that_fails_is_reported_in_its_place():
    """A side that raises, dies or hangs gives its error, so the benchmark measures the other sides."""
    import os

    from benchmarks.harness import side_or_error

    assert side_or_error(int, "x", timeout=60)["error"].startswith("ValueError: invalid literal")
    assert "died" in side_or_error(os.abort, timeout=60)["error"]
    assert side_or_error(time.sleep, 60, timeout=1) == {"error": "not done in --timeout 1 s"}
    assert side_or_error(int, "7", timeout=60) == 7


def test_memory_refuses_a_vllm_step_that_is_not_prompts_x_generations(capsys):
    from benchmarks.memory import main

    with pytest.raises(SystemExit) as exited:
        main(["--models", "smollm2-135m", "--vllm-step", "64by4"])
    assert exited.value.code == 2
    assert "--vllm-step: '64by4' is not PROMPTSxGENERATIONS" in capsys.readouterr().err


def test_memory_sums_a_process_trees_resident_memory():
    import psutil

    from benchmarks.memory import tree_rss_bytes

    child = subprocess.Popen([sys.executable, "-c", "import time; b = bytearray(200 * 2**20); time.sleep(30)"])
    try:
        deadline = time.monotonic() + 20
        me = psutil.Process()
        while tree_rss_bytes(me) - me.memory_info().rss < 200 * 2**20 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert tree_rss_bytes(me) - me.memory_info().rss >= 200 * 2**20
    finally:
        child.kill()
        child.wait()


def test_memory_refuses_actor_processes_that_are_not_rank_counts(capsys):
    from benchmarks.memory import main

    with pytest.raises(SystemExit) as exited:
        main(["--models", "smollm2-135m", "--actor-processes", "1,two"])
    assert exited.value.code == 2
    assert "--actor-processes: '1,two' is not a list of rank counts" in capsys.readouterr().err


@pytest.mark.slow
def test_memory_measures_each_rank_of_a_two_rank_step(storage_root, monkeypatch):
    from benchmarks.memory import measure_ranks
    from grpo_flow.workers.data.tiny_model import ensure_tiny_model

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    result = measure_ranks(str(ensure_tiny_model(storage_root)), 2, 8, 7, 2, 0)
    assert result["processes"] == 2 and result["micro_batches"] >= 1
    assert result["states_bytes_per_rank"] == 16 * result["parameters"] // 2 > 0
    assert result["peak_bytes"] >= result["loaded_peak_bytes"] > 0
