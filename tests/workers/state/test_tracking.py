"""wandb receives every numeric metric of a step, under the run's id (offline mode, no network)."""

from pathlib import Path

from grpo_flow.schemas.presets import preset_config
from grpo_flow.workers.state import tracking


def test_metrics_reach_wandb_under_the_run_id(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    config = preset_config("tiny", run_id="tracked", report_to="wandb", wandb_project="grpo-flow-tests")
    tracking.wandb_log(config, "tracked", 1, {"run_id": "tracked", "step": 1, "reward": 0.25, "loss": -0.5})
    tracking.wandb_log(config, "tracked", 2, {"run_id": "tracked", "step": 2, "reward": 0.75, "loss": -0.1})
    run = tracking._RUNS["tracked"]
    assert run.id == "tracked" and run.project == "grpo-flow-tests"
    assert run.summary["reward"] == 0.75 and run.summary["loss"] == -0.1
    assert run.config["learning_rate"] == config.learning_rate
    tracking.wandb_finish("tracked")
    assert "tracked" not in tracking._RUNS
    # The offline run file, where this process's wandb put it (an earlier test may have set its dir).
    sync_file = Path(run.settings.sync_file)
    assert sync_file.name == "run-tracked.wandb" and sync_file.exists() and sync_file.stat().st_size > 0
