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


def test_a_wandb_that_cannot_start_is_said_once_and_every_row_is_counted_not_delivered(monkeypatch):
    """`--report-to wandb` without a login logged nothing and said nothing: the failure failed log-metrics,
    whose retry found the Parquet row written and skipped wandb (issue 30, item 5)."""
    import wandb

    starts = []

    def no_login(**kwargs):
        starts.append(kwargs)
        raise wandb.errors.UsageError("No API key configured. Use `wandb login` to log in.")

    monkeypatch.setattr(wandb, "init", no_login)
    config = preset_config("tiny", run_id="unlogged", report_to="wandb")
    first = tracking.wandb_log(config, "unlogged", 1, {"step": 1, "reward": 0.5})
    assert first == (
        "wandb: step 1's metrics were not delivered (UsageError: No API key configured. Use `wandb login` to log "
        "in.); the run goes on, its metrics are in metrics/*.parquet, and the summary counts the steps wandb did not get"
    )
    assert [tracking.wandb_log(config, "unlogged", step, {"step": step}) for step in (2, 3)] == ["", ""]
    assert tracking.undelivered("unlogged") == 3 and len(starts) == 1  # not started again at every step
    tracking.wandb_finish("unlogged")
    assert tracking.undelivered("unlogged") == 0
