"""The `grpo` command as a user types it: bad input is refused before anything is written."""

import json
import os
import subprocess
import sys

import pytest

from flows.cli import build_config, main, make_parser, parse_overrides


def run_cli(*args, env_extra=None, timeout=600):
    env = {**os.environ, "PREFECT_SERVER_ANALYTICS_ENABLED": "false", **(env_extra or {})}
    return subprocess.run(
        [sys.executable, "-m", "flows.cli", *args], capture_output=True, text=True, env=env, timeout=timeout
    )


def test_every_config_field_is_an_option():
    from schemas.config import GRPOFlowConfig

    args = make_parser().parse_args(
        ["train", "--max-steps", "3", "--loss-type", "grpo", "--run-id", "abc", "--reward-funcs", "last_digit"]
    )
    overrides = parse_overrides(args)
    assert overrides == {"max_steps": "3", "loss_type": "grpo", "run_id": "abc", "reward_funcs": ["last_digit"]}
    config = build_config("tiny", overrides)
    assert (config.max_steps, config.loss_type, config.run_id) == (3, "grpo", "abc")
    help_text = make_parser()._subparsers._group_actions[0].choices["train"].format_help()
    for name in GRPOFlowConfig.model_fields:
        assert "--" + name.replace("_", "-") in help_text


def test_optional_fields_accept_none():
    args = make_parser().parse_args(["train", "--epsilon-high", "none"])
    assert build_config("tiny", parse_overrides(args)).epsilon_high is None


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["train", "--preset", "nope"], "--preset: unknown preset 'nope'"),
        (["train", "--max-steps", "abc"], "--max-steps: Input should be a valid integer"),
        (["train", "--loss-type", "ppo"], "--loss-type: Input should be"),
        (["train", "--beta", "-1"], "--beta: Input should be greater than or equal to 0"),
        (["train", "--num-generations", "1"], "--num-generations: Input should be greater than or equal to 2"),
        (["train", "--prompts-per-step", "6", "--num-rollout-workers", "4"], "prompts_per_step (6)"),
        (["train", "--epsilon", "0.3", "--epsilon-high", "0.2"], "epsilon_high (0.2) must be >= epsilon (0.3)"),
    ],
)
def test_bad_train_input_exits_2_naming_the_field_and_writes_nothing(tmp_path, capsys, argv, expected):
    root = tmp_path / "store"
    assert main([*argv, "--storage-root", str(root)]) == 2
    assert expected in capsys.readouterr().err
    assert not root.exists()


def test_storage_root_that_cannot_be_a_folder_is_refused(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    assert main(["train", "--storage-root", str(blocker / "sub")]) == 2
    assert "--storage-root" in capsys.readouterr().err
    assert blocker.read_text() == "not a folder"


def test_resume_refuses_an_unknown_run_and_a_changed_model_before_writing(tmp_path, capsys):
    from workers.state.storage import RunStorage

    assert main(["train", "--resume", "--run-id", "nope", "--storage-root", str(tmp_path)]) == 2
    assert "--resume: no run 'nope'" in capsys.readouterr().err
    storage = RunStorage(tmp_path, "mine")
    storage.write_config(
        build_config("tiny", {"run_id": "mine", "storage_root": str(tmp_path)}).model_dump(mode="json")
    )
    before = sorted(p.name for p in tmp_path.rglob("*"))
    assert main(["train", "--run-id", "mine", "--model", "other/model", "--storage-root", str(tmp_path)]) == 2
    assert "run 'mine' belongs to model 'tiny', not 'other/model'" in capsys.readouterr().err
    assert main(["train", "--run-id", "mine", "--fail-at", "nowhere@1", "--storage-root", str(tmp_path)]) == 2
    assert "--fail_at: 'nowhere@1'" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.rglob("*")) == before


def test_unknown_run_and_step_are_refused(tmp_path, capsys):
    assert main(["rollouts", "nope", "--storage-root", str(tmp_path)]) == 2
    assert "no run 'nope'" in capsys.readouterr().err
    assert main(["runs", "--storage-root", str(tmp_path)]) == 0
    assert "no runs" in capsys.readouterr().out


def test_train_then_list_then_read_rollouts(tmp_path):
    """The user path: a short run through the CLI on its own ephemeral Prefect server."""
    root = tmp_path / "store"
    env = {"PREFECT_HOME": str(tmp_path / "prefect-home")}
    trained = run_cli(
        "train",
        "--preset",
        "tiny",
        "--max-steps",
        "2",
        "--run-id",
        "cli-run",
        "--eval-prompts",
        "16",
        "--storage-root",
        str(root),
        "--no-progress",
        env_extra=env,
    )
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert "held-out accuracy, after RL" in trained.stdout
    assert "steps" in trained.stdout and "2 / 2" in trained.stdout

    listed = run_cli("runs", "--storage-root", str(root))
    assert listed.returncode == 0
    line = next(line for line in listed.stdout.splitlines() if line.startswith("cli-run"))
    assert line.split()[1:] == ["completed", "2"]

    shown = run_cli("rollouts", "cli-run", "--step", "1", "--limit", "3", "--storage-root", str(root))
    assert shown.returncode == 0, shown.stderr
    rows = [json.loads(line) for line in shown.stdout.splitlines()[1:]]
    assert len(rows) == 3 and all("completion" in r and "reward" in r for r in rows)

    again = run_cli(
        "train", "--run-id", "cli-run", "--storage-root", str(root), "--learning-rate", "0.5", env_extra=env
    )
    assert again.returncode == 2 and "learning_rate: 0.005 -> 0.5" in again.stderr
    missing_step = run_cli("rollouts", "cli-run", "--step", "9", "--storage-root", str(root))
    assert missing_step.returncode == 2 and "--step" in missing_step.stderr
