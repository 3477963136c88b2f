"""What a run shows besides its Parquet files: step and progress artifacts (tasks/observability.py),
read back through the Prefect API, and `grpo report`'s PNG of the training curves."""

import json

import pyarrow as pa
from prefect import flow
from prefect.runtime import flow_run

from grpo_flow.flows.cli import main
from grpo_flow.schemas.records import RolloutBatch, RunPlan, metrics_table
from grpo_flow.schemas.presets import preset_config
from grpo_flow.tasks.observability import (
    artifact_key,
    create_run_progress,
    flush_artifacts,
    pick_samples,
    publish,
    step_artifact,
    step_markdown,
    update_run_progress,
)
from grpo_flow.workers.state.storage import RunStorage

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def read_artifacts(key: str) -> list:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey
    from prefect.client.schemas.sorting import ArtifactSort

    with get_client(sync_client=True) as client:
        return client.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])), sort=ArtifactSort.CREATED_DESC
        )


# -- observability ---------------------------------------------------------------------------------------
def test_artifact_keys_are_valid_prefect_keys():
    assert artifact_key("grpo-step", "My_Run.v2") == "grpo-step-my-run-v2"
    assert artifact_key("eval", "--") == "eval"


def test_samples_are_the_best_a_middle_and_the_worst():
    rows = [{"completion": str(i), "reward": r} for i, r in enumerate([0.5, 1.0, float("nan"), 0.0, 0.25])]
    assert [row["completion"] for row in pick_samples(rows)] == ["1", "4", "2"]  # NaN ranks last
    assert pick_samples(rows[:2]) == [rows[1], rows[0]]


def test_markdown_fences_survive_backticks_in_completions():
    text = step_markdown("r", 1, {"reward": 0.5}, [{"prompt": "p", "completion": "```python\nx\n```", "reward": 1.0}])
    assert "\n````\n```python\nx\n```\n````" in text


def test_step_and_progress_artifacts_inside_a_flow(prefect_server, tmp_path):
    plan = RunPlan(
        run_id="Obs_Run",
        storage_root=str(tmp_path),
        model_path="tiny",
        total_steps=2,
        reward_names=("last_digit",),
        extra_columns=("answer",),
        num_train_prompts=10,
    )
    batch = RolloutBatch(
        run_id="Obs_Run",
        step=2,
        policy_version=1,
        worker_id="rollout-0",
        prompt_id=["p0"] * 4,
        group_index=[0] * 4,
        sample_index=[0, 1, 2, 3],
        prompt=["35060="] * 4,
        completion=["0", "7", "1", "0 "],
        prompt_token_ids=[[1]] * 4,
        completion_token_ids=[[2]] * 4,
        sampling_logprobs=[[-0.1]] * 4,
        finish_reason=["stop"] * 4,
        rewards={"last_digit": [1.0, 0.0, 0.0, 0.5]},
        reward=[1.0, 0.0, 0.0, 0.5],
        advantage=[1.2, -0.8, -0.8, 0.4],
    )

    @flow(name="observability-test")
    def observed() -> list:
        progress = create_run_progress(plan, total_steps=2)
        step_artifact(
            plan,
            1,
            {"step": 1, "reward": 0.25, "loss": -0.01, "kl": 0.002},
            pa.table({"prompt": ["12="], "completion": ["2"], "reward": [1.0]}),
        )
        update_run_progress(progress, 1, 2)
        # As the grpo flow does it: on the artifact thread, in order, then flushed.
        published = [
            publish(step_artifact, plan, 2, {"step": 2, "reward": 0.375, "loss": 0.02, "time/actor_s": 0.3}, [batch]),
            publish(update_run_progress, progress, 2, 2),
        ]
        flush_artifacts()
        assert all(future.done() for future in published)
        broken = step_artifact("Obs_Run", 3, {"reward": 0.0}, rollouts_table=42)  # never raises
        return [progress, broken, flow_run.get_id()]

    progress_id, broken, flow_run_id = observed()
    assert progress_id is not None and broken is None
    newest, oldest = read_artifacts("grpo-step-obs-run")  # one key per run, a version per step
    assert newest.type == "markdown" and "step 2" in newest.data and "step 1" in oldest.data
    assert "| reward | 0.375 |" in newest.data and "| time/actor_s | 0.3 |" in newest.data
    assert "**1. reward 1** (last_digit 1), advantage 1.2" in newest.data
    assert "**3. reward 0** (last_digit 0)" in newest.data and newest.data.count("Completion:") == 3
    assert str(newest.flow_run_id) == str(oldest.flow_run_id) == flow_run_id  # linked to the flow run, thread or not
    (progress,) = read_artifacts("grpo-progress-obs-run")
    assert progress.id == progress_id and progress.type == "progress"
    assert float(progress.data) == 100.0 and progress.description == "step 2 / 2"


# -- grpo report -----------------------------------------------------------------------------------------
def write_metrics(root, run_id: str, steps: int, with_kl: bool) -> RunStorage:
    storage = RunStorage(root, run_id)
    storage.write_config(preset_config("tiny", run_id=run_id).model_dump(mode="json"))
    for step in range(1, steps + 1):
        row = {
            "run_id": run_id,
            "step": step,
            "policy_version": step,
            "num_completions": 64,
            "reward": step / steps,
            "reward_std": 0.1,
            "loss": 0.01 * step,
            "completions/mean_length": 2.0,
        }
        if with_kl:
            row["kl"] = 0.001 * step
        storage.write_metrics(step, metrics_table(row))
    return storage


def test_report_plots_what_the_run_logged(tmp_path):
    from grpo_flow.flows.evaluate import EVAL_METADATA_KEY, write_once
    from grpo_flow.flows.report import write_report

    write_metrics(tmp_path, "no-kl", 5, with_kl=False)
    report = write_report(tmp_path, "no-kl")
    assert report.path == tmp_path / "runs" / "no-kl" / "report.png"
    assert report.panels == ("reward", "loss", "completions/mean_length") and report.steps == 5
    assert report.path.read_bytes().startswith(PNG_SIGNATURE)

    storage = write_metrics(tmp_path, "with-kl", 3, with_kl=True)
    summary = {"checkpoint_step": 3, "pass@1": 0.4, "pass@8": 0.9, "greedy_accuracy": 0.5}
    write_once(
        storage.eval_path(3),
        pa.table({"x": [1]}).replace_schema_metadata({EVAL_METADATA_KEY: json.dumps(summary).encode()}),
    )
    report = write_report(tmp_path, "with-kl", tmp_path / "out" / "curves.png")
    assert report.panels == ("reward", "loss", "kl", "completions/mean_length", "eval")
    assert (tmp_path / "out" / "curves.png").read_bytes().startswith(PNG_SIGNATURE)


def test_grpo_report_cli(tmp_path, capsys):
    write_metrics(tmp_path, "curves", 2, with_kl=False)
    RunStorage(tmp_path, "empty").write_config(preset_config("tiny", run_id="empty").model_dump(mode="json"))
    out = tmp_path / "r.png"
    assert main(["report", "curves", "--out", str(out), "--storage-root", str(tmp_path)]) == 0
    assert f"wrote {out}" in capsys.readouterr().out and out.read_bytes().startswith(PNG_SIGNATURE)
    assert main(["report", "nope", "--storage-root", str(tmp_path)]) == 2
    assert "RUN: no run 'nope'" in capsys.readouterr().err
    assert main(["report", "empty", "--storage-root", str(tmp_path)]) == 2
    assert "has no logged steps yet" in capsys.readouterr().err
