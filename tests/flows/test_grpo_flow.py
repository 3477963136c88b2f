"""The `grpo` flow end to end on Prefect's temporary server: rows, metrics, checkpoints, learning."""

import json

import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import load_file

from grpo_flow.flows.grpo import grpo
from grpo_flow.schemas.presets import preset_config
from grpo_flow.workers.state.storage import RunStorage


@pytest.fixture(scope="module")
def three_step_run(prefect_server, storage_root):
    config = preset_config(
        "tiny",
        run_id="three-steps",
        storage_root=str(storage_root),
        max_steps=3,
        prompts_per_step=4,
        num_generations=4,
        num_rollout_workers=2,
        save_steps=2,
        eval_prompts=20,
    )
    summary = grpo(config)
    return config, summary, RunStorage(storage_root, config.run_id)


def test_every_completion_is_logged_with_tokens_logprobs_and_rewards(three_step_run):
    config, _, storage = three_step_run
    rollouts = storage.read_rollouts()
    assert rollouts.num_rows == 3 * config.prompts_per_step * config.num_generations
    rows = rollouts.to_pylist()
    assert {r["step"] for r in rows} == {1, 2, 3}
    for row in rows:
        assert len(row["completion_token_ids"]) == row["completion_tokens"] >= 1
        assert len(row["sampling_logprobs"]) == len(row["completion_token_ids"])
        assert all(lp <= 0.0 for lp in row["sampling_logprobs"])
        assert row["prompt_token_ids"] and row["prompt"].endswith("=")
        assert row["reward_last_digit"] in (0.0, 1.0)
        assert row["reward"] == row["reward_last_digit"]
        assert row["finish_reason"] in ("stop", "length")
    # one Parquet file per rollout worker per step, each holding whole groups
    for step in (1, 2, 3):
        files = sorted(storage.rollout_dir(step).glob("*.parquet"))
        assert [f.name for f in files] == ["shard-00.parquet", "shard-01.parquet"]
        for f in files:
            assert pq.read_table(f).num_rows % config.num_generations == 0


def test_advantages_are_group_relative(three_step_run):
    _, _, storage = three_step_run
    table = storage.read_rollouts(step=1).to_pandas()
    for _, group in table.groupby("group_index"):
        assert abs(group["advantage"].sum()) < 1e-3
        if group["reward"].nunique() == 1:
            assert (group["advantage"] == 0).all()


def test_a_metrics_row_per_step(three_step_run):
    _, _, storage = three_step_run
    metrics = storage.read_metrics().to_pylist()
    assert [m["step"] for m in metrics] == [1, 2, 3]
    assert [m["policy_version"] for m in metrics] == [1, 2, 3]
    for m in metrics:
        assert m["num_completions"] == 16
        assert m["grad_norm"] >= 0 and m["learning_rate"] > 0
        assert 0.0 <= m["reward"] <= 1.0
        assert m["time/actor_s"] > 0 and m["time/generate_s"] > 0
        assert "entropy" in m and "clip_ratio/region_mean" in m


def test_checkpoints_are_complete_and_the_weights_moved(three_step_run):
    config, _, storage = three_step_run
    assert storage.complete_checkpoints() == [2, 3]  # save_steps=2, and the last step
    final = storage.checkpoint_dir(3)
    manifest = json.loads((final / "manifest.json").read_text())
    assert manifest["policy_version"] == 3
    for name in ("model/model.safetensors", "optimizer.pt", "scheduler.pt", "rng.pt", "actor_state.json"):
        assert name in manifest["files"]
    trained = load_file(final / "model" / "model.safetensors")
    initial = load_file(storage.root / "models" / "tiny-qwen2" / "model.safetensors")
    changed = [name for name in initial if not torch.equal(initial[name], trained[name])]
    assert changed, "no weight changed after 3 optimizer steps"


def test_config_and_summary_are_written(three_step_run):
    config, summary, storage = three_step_run
    assert storage.read_config()["learning_rate"] == config.learning_rate
    on_disk = storage.read_summary()
    assert on_disk["status"] == summary["status"] == "completed"
    assert on_disk["steps_completed"] == 3
    for key in ("initial_eval_accuracy", "final_eval_accuracy", "wall_seconds"):
        assert isinstance(on_disk[key], float)


def test_an_existing_run_id_with_other_training_fields_is_refused_and_left_untouched(three_step_run):
    config, _, storage = three_step_run
    before = sorted(p.stat().st_mtime_ns for p in storage.run_dir.rglob("*") if p.is_file())
    with pytest.raises(ValueError, match=r"seed: 42 -> 7"):
        grpo(config.model_copy(update={"seed": 7}))
    after = sorted(p.stat().st_mtime_ns for p in storage.run_dir.rglob("*") if p.is_file())
    assert before == after


@pytest.fixture(scope="module")
def tiny_preset_run(prefect_server, storage_root):
    config = preset_config("tiny", run_id="learning-bar", storage_root=str(storage_root), seed=42)
    return config, grpo(config)


@pytest.mark.slow
def test_tiny_preset_raises_heldout_accuracy_by_at_least_0_3(tiny_preset_run):
    """The learning bar: the RL phase lifts held-out accuracy on prompts never trained on."""
    config, summary = tiny_preset_run
    assert summary["steps_completed"] == config.max_steps
    assert summary["final_eval_accuracy"] - summary["initial_eval_accuracy"] >= 0.3, summary


@pytest.mark.slow
def test_one_step_off_pipelining_still_learns(tiny_preset_run, storage_root):
    """max_staleness 1 trains on rows one step stale (IS-corrected): over the same steps its held-out
    gain is at least 80 % of the on-policy run's."""
    config, on_policy = tiny_preset_run
    pipelined = grpo(config.model_copy(update={"run_id": "learning-bar-async", "max_staleness": 1}))
    assert pipelined["steps_completed"] == config.max_steps
    gain = pipelined["final_eval_accuracy"] - pipelined["initial_eval_accuracy"]
    assert gain >= 0.8 * (on_policy["final_eval_accuracy"] - on_policy["initial_eval_accuracy"]), (pipelined, on_policy)


def test_a_failing_step_fails_the_run_and_keeps_what_was_logged(prefect_server, storage_root, tmp_path, monkeypatch):
    (tmp_path / "flaky_rewards.py").write_text(
        "calls = 0\n"
        "def breaks_at_step_2(completions, **kwargs):\n"
        "    global calls\n"
        "    calls += 1\n"
        "    if calls > 1:\n"
        "        raise RuntimeError('reward service down')\n"
        "    return [0.5] * len(completions)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    config = preset_config(
        "tiny",
        run_id="fails-at-2",
        storage_root=str(storage_root),
        max_steps=3,
        prompts_per_step=2,
        num_generations=2,
        num_rollout_workers=1,
        eval_prompts=4,
        reward_funcs=["flaky_rewards:breaks_at_step_2"],
    )
    with pytest.raises(RuntimeError, match="reward service down"):
        grpo(config)
    storage = RunStorage(storage_root, config.run_id)
    summary = storage.read_summary()
    assert summary["status"] == "failed" and summary["steps_completed"] == 1
    assert summary["error"].startswith(
        "step 2: RewardFunctionError: reward function 'breaks_at_step_2' raised on sample 0"
    ), summary["error"]
    assert "RuntimeError: reward service down" in summary["error"]
    assert storage.logged_steps() == [1]
    assert storage.read_rollouts(step=1).column("reward_breaks_at_step_2").to_pylist() == [0.5] * 4
    assert not storage.rollout_dir(2).exists()

    from grpo_flow.workers.state.storage import list_runs

    assert ("fails-at-2", "failed", 1) in [(r.run_id, r.status, r.last_step) for r in list_runs(storage_root)]


def test_a_run_reads_back_with_plain_pandas(three_step_run):
    """As the README shows: no grpo-flow code needed to open a run."""
    import glob

    import pandas as pd

    config, _, storage = three_step_run
    rollouts = pd.read_parquet(storage.run_dir / "rollouts")
    metrics = pd.concat(map(pd.read_parquet, sorted(glob.glob(f"{storage.run_dir}/metrics/*.parquet"))))
    assert sorted(rollouts["step"].unique()) == [1, 2, 3]
    assert len(rollouts) == 3 * config.prompts_per_step * config.num_generations
    assert list(metrics.sort_values("step")["step"]) == [1, 2, 3]


def test_steps_without_subflows_train_the_same_and_make_no_step_subflow_runs(prefect_server, storage_root):
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName

    from grpo_flow.workers.backends import release

    runs = {}
    for step_subflows in (True, False):
        config = preset_config(
            "tiny",
            run_id=f"subflows-{str(step_subflows).lower()}",
            storage_root=str(storage_root),
            max_steps=2,
            prompts_per_step=4,
            num_generations=4,
            num_rollout_workers=2,
            save_steps=2,
            eval_prompts=0,
            step_subflows=step_subflows,
        )
        assert grpo(config)["status"] == "completed"
        release(config.run_id)
        runs[step_subflows] = RunStorage(storage_root, config.run_id)
    with_subflows, without = runs[True], runs[False]
    assert without.read_rollouts(columns=["completion"]).equals(with_subflows.read_rollouts(columns=["completion"]))
    for step in (1, 2):
        assert without.read_step_metrics(step)["loss"] == with_subflows.read_step_metrics(step)["loss"]
    trained = [load_file(run.checkpoint_dir(2) / "model" / "model.safetensors") for run in (with_subflows, without)]
    assert all(torch.equal(trained[0][name], trained[1][name]) for name in trained[0])

    with get_client(sync_client=True) as client:
        names = [f"{run.run_id}-step-1" for run in (with_subflows, without)]
        found = {
            r.name for r in client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=names)))
        }
    assert found == {"subflows-true-step-1"}


def test_the_flow_keeps_library_progress_bars_out_unless_verbose(prefect_server, storage_root, capfd, monkeypatch):
    """Called from Python (or in a deployment run), transformers drew "Loading weights" and "Writing model
    shards" bars per model load and save, which `grpo train` kept out only through its environment."""
    from datasets.utils import logging as datasets_logging
    from transformers.utils import logging as hf_logging

    def draws_bars(config, *args):
        list(hf_logging.tqdm(range(3), desc="Loading weights"))
        list(datasets_logging.tqdm(range(3), desc="Generating train split"))
        return {"run_id": config.run_id}

    monkeypatch.setattr("grpo_flow.flows.grpo.run_grpo", draws_bars)
    hf_logging.enable_progress_bar()
    config = preset_config("tiny", run_id="quiet-libraries", storage_root=str(storage_root))
    grpo(config)
    err = capfd.readouterr().err
    assert "Loading weights" not in err and "Generating train split" not in err
    assert hf_logging.is_progress_bar_enabled()  # as before the run
    grpo(config, verbose=True)
    err = capfd.readouterr().err
    assert "Loading weights" in err and "Generating train split" in err
