"""`grpo train --simple-mode`: TRL's own GRPOTrainer loop, writing the same storage layout."""

import pytest

from grpo_flow.flows.cli import main
from grpo_flow.flows.simple import grpo_simple
from grpo_flow.schemas.presets import preset_config
from grpo_flow.workers.state.storage import RunStorage


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
    # Nor does grpo-flow's loop go on from TRL's checkpoints: refused before anything starts, and
    # nothing (no resume record) written.
    from grpo_flow.flows.grpo import grpo
    from grpo_flow.workers.state.resume import ResumeError

    with pytest.raises(ResumeError, match=r"run_id: run 'simple-mode' was trained by TRL's loop \(--simple-mode\)"):
        grpo(config.model_copy(update={"max_steps": 4}))
    assert storage.resume_count() == 0


def test_resuming_a_simple_mode_run_is_refused_by_the_cli_in_one_line(tmp_path, capsys):
    from grpo_flow.flows.cli import build_config

    storage = RunStorage(tmp_path, "simple")
    config = build_config("tiny", {"run_id": "simple", "storage_root": str(tmp_path)})
    storage.write_config(config.model_dump(mode="json"), mode="simple")
    assert main(["train", "--run-id", "simple", "--resume", "--storage-root", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "--run-id: run 'simple' was trained by TRL's loop (--simple-mode), which does not resume" in err


def test_simple_mode_refuses_an_existing_run_before_starting(tmp_path, capsys):
    from grpo_flow.flows.cli import build_config

    storage = RunStorage(tmp_path, "taken")
    storage.write_config(
        build_config("tiny", {"run_id": "taken", "storage_root": str(tmp_path)}).model_dump(mode="json")
    )
    assert main(["train", "--simple-mode", "--run-id", "taken", "--storage-root", str(tmp_path)]) == 2
    assert "--simple-mode: run 'taken' exists" in capsys.readouterr().err


@pytest.mark.slow
def test_simple_mode_with_lora_keeps_the_adapter_and_warns_when_no_group_differs(storage_root, tmp_path):
    """TRL's loop gets the run's LoRA (peft), its checkpoints hold the adapter as the `grpo` flow's do, and a
    reward that ties every group gets the same one-line warning as in the `grpo` flow."""
    from cli_output import run_cli  # tests/flows/cli_output.py

    (tmp_path / "flat_rewards.py").write_text("def same(completions, **kwargs):\n    return [1.0] * len(completions)\n")
    trained = run_cli(
        "train", "--simple-mode", "--preset", "tiny", "--use-lora", "true", "--reward-funcs", "flat_rewards:same",
        "--max-steps", "2", "--save-steps", "2", "--no-signal-warning-steps", "2", "--run-id", "simple-lora",
        "--storage-root", str(storage_root), "--no-progress", cwd=tmp_path,
        env_extra={"PREFECT_HOME": str(tmp_path / "prefect-home")},
    )  # fmt: skip
    assert trained.returncode == 0, trained.stderr[-3000:]
    warnings = [line for line in trained.stderr.splitlines() if "no learning signal" in line]
    assert len(warnings) == 1 and warnings[0].startswith("grpo-flow: warning: steps 1-2: no learning signal"), warnings
    storage = RunStorage(storage_root, "simple-lora")
    files = storage.verify_checkpoint(2)["files"]
    assert "adapter/adapter_model.safetensors" in files and "base_model.json" in files
    assert not [name for name in files if name.startswith("model/")]  # no copy of the base model
