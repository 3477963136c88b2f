"""`grpo train --simple-mode`: TRL's own GRPOTrainer loop, writing the same storage layout."""

import pytest

from flows.cli import main
from flows.simple import grpo_simple
from schemas.presets import preset_config
from workers.state.storage import RunStorage


def test_simple_mode_runs_trls_loop_and_writes_metrics_and_checkpoints(prefect_server, storage_root):
    config = preset_config(
        "tiny",
        run_id="simple-mode",
        storage_root=str(storage_root),
        max_steps=3,
        prompts_per_step=4,
        num_generations=4,
        num_rollout_workers=1,
        eval_prompts=0,
        save_steps=2,
    )
    summary = grpo_simple(config)
    assert summary["status"] == "completed" and summary["steps_completed"] == 3 and summary["mode"] == "simple"
    storage = RunStorage(storage_root, "simple-mode")
    rows = storage.read_metrics().to_pylist()
    assert [r["step"] for r in rows] == [1, 2, 3]
    for name in (
        "loss",
        "grad_norm",
        "reward",
        "rewards/last_digit/mean",
        "entropy",
        "num_tokens",
        "clip_ratio/region_mean",
    ):
        assert all(r[name] is not None for r in rows), name  # TRL's own metric names
    assert storage.complete_checkpoints() == [2, 3]
    assert storage.verify_checkpoint(3)["mode"] == "simple"
    with pytest.raises(ValueError, match="simple mode does not resume"):
        grpo_simple(config)


def test_simple_mode_refuses_an_existing_run_before_starting(tmp_path, capsys):
    from flows.cli import build_config

    storage = RunStorage(tmp_path, "taken")
    storage.write_config(
        build_config("tiny", {"run_id": "taken", "storage_root": str(tmp_path)}).model_dump(mode="json")
    )
    assert main(["train", "--simple-mode", "--run-id", "taken", "--storage-root", str(tmp_path)]) == 2
    assert "--simple-mode: run 'taken' exists" in capsys.readouterr().err
