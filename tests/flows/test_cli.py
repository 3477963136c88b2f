"""The `grpo` command as a user types it: bad input is refused before anything is written."""

import json
import os
import re
import subprocess
import sys

import pytest

from cli_output import SIMPLE_MODE_SUMMARY_ROWS, SUMMARY_ROWS, run_cli, summary_lines  # tests/flows/cli_output.py
from grpo_flow.flows.cli import build_config, main, make_parser, parse_overrides


def test_every_config_field_is_an_option():
    from grpo_flow.schemas.config import GRPOFlowConfig

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
        (
            ["train", "--prompts-per-step", "6", "--num-rollout-workers", "4"],
            "grpo train: --prompts-per-step/--num-rollout-workers: prompts_per_step (6) must split",
        ),
        (
            ["train", "--epsilon", "0.3", "--epsilon-high", "0.2"],
            "grpo train: --epsilon-high/--epsilon: epsilon_high (0.2) must be >= epsilon (0.3)",
        ),
        (["train", "--max-steps", "0"], "grpo train: --max-steps: max_steps (0) must be a positive number"),
        (["train", "--run-id", "../x"], "grpo train: --run-id: '../x' is not a run id (1 to 128 letters, digits,"),
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
    from grpo_flow.workers.state.storage import RunStorage

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


@pytest.mark.slow
def test_simple_mode_prints_its_run_line_a_progress_bar_and_the_summary_only(storage_root, tmp_path):
    """TRL's trainer prints every log dict (its PrinterCallback, or its progress bar's `write`); a run does not."""
    env = {"PREFECT_HOME": str(tmp_path / "prefect-home")}
    common = ["train", "--simple-mode", "--max-steps", "2", "--storage-root", str(storage_root)]
    quiet = run_cli(*common, "--run-id", "simple-quiet", "--no-progress", env_extra=env)
    assert quiet.returncode == 0, quiet.stderr[-3000:]
    assert quiet.stderr == ""
    lines = quiet.stdout.splitlines()
    assert lines[0] == "grpo-flow: run simple-quiet in simple mode (TRL's GRPOTrainer loop)"
    assert lines[1].startswith("grpo-flow: settings: learning_rate 0.005 (preset tiny); ")
    summary = summary_lines(quiet.stdout)
    assert [line.split("  ")[0] for line in summary] == SIMPLE_MODE_SUMMARY_ROWS
    assert summary[2].split() == ["steps", "2", "/", "2"]
    shown = run_cli(*common, "--run-id", "simple-bar", env_extra=env)
    assert shown.returncode == 0, shown.stderr[-3000:]
    assert summary_lines(shown.stdout) and "{'loss'" not in shown.stdout + shown.stderr
    bar = shown.stderr.replace("\r", "\n").splitlines()
    assert bar[-1].startswith("simple-bar: 100%") and "2/2" in bar[-1] and "reward=" in bar[-1], bar[-3:]


@pytest.mark.slow
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
    # Only what the user asked for: the run line and the summary; Prefect's logs went to the log file.
    assert trained.stderr == ""
    lines = trained.stdout.splitlines()
    assert lines[0] == "grpo-flow: run cli-run (tiny, last_digit)"
    settings = (
        "grpo-flow: settings: learning_rate 0.005 (preset tiny); LoRA off (every weight trains) (default); "
        "max_completion_length 2 (preset tiny); rollout_engine transformers (default); "
        "prompts x generations 32 x 8 (preset tiny)"
    )  # and the estimate of the step's peak memory once the tiny model is built
    assert re.fullmatch(re.escape(settings) + r"(; peak memory ~\d+\.\d GiB \(estimate\))?", lines[1]), lines[1]
    summary = summary_lines(trained.stdout)
    assert [line.split("  ")[0] for line in summary] == SUMMARY_ROWS
    assert summary[2].split() == ["steps", "2", "/", "2"]
    assert " train --preset tiny --max-steps 2 " in (root / "logs" / "prefect.log").read_text()

    listed = run_cli("runs", "--storage-root", str(root))
    assert listed.returncode == 0
    assert listed.stdout.splitlines()[0].split() == ["run", "status", "model", "dataset", "steps", "accuracy"]
    line = next(line for line in listed.stdout.splitlines() if line.startswith("cli-run"))
    assert line.split()[1:5] == ["completed", "tiny", "last_digit", "2/2"]
    assert 0.0 <= float(line.split()[5]) <= 1.0

    shown = run_cli("rollouts", "cli-run", "--step", "1", "--limit", "3", "--storage-root", str(root), "--json")
    assert shown.returncode == 0, shown.stderr
    rows = [json.loads(line) for line in shown.stdout.splitlines()]  # only the objects: a script pipes them
    assert len(rows) == 3 and all(
        {"completion", "reward", "reward_last_digit", "completion_tokens"} <= set(r) for r in rows
    )
    assert shown.stderr == "run cli-run, step 1: 3 of its 256 completions\n"
    grouped = run_cli("rollouts", "cli-run", "--step", "1", "--sort", "reward", "--storage-root", str(root))
    lines = grouped.stdout.splitlines()
    assert grouped.returncode == 0 and lines[0] == "run cli-run, step 1: 8 of its 256 completions"
    scores = [line for line in lines if line.startswith("  [")]
    assert len(scores) == 8 and all("(last_digit " in line and "advantage" in line for line in scores)

    again = run_cli(
        "train", "--run-id", "cli-run", "--storage-root", str(root), "--learning-rate", "0.5", env_extra=env
    )
    assert again.returncode == 2 and "learning_rate: 0.005 -> 0.5" in again.stderr
    missing_step = run_cli("rollouts", "cli-run", "--step", "9", "--storage-root", str(root))
    assert missing_step.returncode == 2 and "--step" in missing_step.stderr


@pytest.mark.slow
def test_a_piped_run_says_what_it_does_first_and_draws_no_bars(tmp_path):
    """The first minutes were silent (issue 34): each phase is a line, in order, with the progress lines
    (each with its ETA) between the evaluations; no library's progress bar reaches the pipe."""
    root = tmp_path / "store"
    trained = run_cli(
        "train", "--max-steps", "2", "--run-id", "said", "--eval-prompts", "8", "--storage-root", str(root),
        env_extra={"PREFECT_HOME": str(tmp_path / "prefect-home")}, timeout=1500,  # the tiny model is built too
    )  # fmt: skip
    assert trained.returncode == 0, trained.stderr[-3000:]
    lines = trained.stderr.splitlines()
    phases = [line for line in lines if line.startswith("grpo-flow: ")]
    assert phases == [
        f"grpo-flow: building the tiny model 'tiny' into {root / 'models'} (once: a warm start on last_digit)",
        "grpo-flow: starting the actor and 2 rollout worker(s) on tiny",
        "grpo-flow: evaluating on 8 held-out prompts before training",
        "grpo-flow: evaluating on 8 held-out prompts after training",
    ], lines
    progress = [line for line in lines if line.startswith("said: step")]
    assert progress[0].startswith("said: step 1/2") and " s/step  ETA " in progress[0]
    assert lines.index(progress[0]) > lines.index(next(line for line in lines if "before training" in line))
    output = trained.stdout + trained.stderr
    assert "\r" not in output and "it/s" not in output and "%|" not in output


# -- checked before anything starts (issue 15, item 8) -------------------------------------------------
DATA = ["--reward-funcs", "last_digit"]  # a data set named by path or hub id has no default rewards


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--reward-funcs", "no_such_module:score"], "--reward-funcs: cannot import 'no_such_module:score'"),
        (["--reward-funcs", "last_digit", "unknown"], "--reward-funcs: 'unknown' is neither a built-in reward"),
        (["--reward-weights", "1", "2"], "--reward-weights: 2 weights for 1 reward functions (last_digit)"),
        (["--dataset", "hf:someone/prompts"], "--reward-funcs: data set 'hf:someone/prompts' has no default rewards"),
        (["--dataset", "hf:data.jsonl", *DATA], "--dataset: 'data.jsonl': no such file"),  # a file's name, no hub id
        (["--dataset", "hf:./no/such.jsonl", *DATA], "--dataset: './no/such.jsonl': no such file or folder"),
        (["--dataset", "hf:not a hub id", *DATA], "--dataset: 'not a hub id' is neither a local path nor a Hugging"),
        (["--model", "./no-such-model"], "--model: './no-such-model': no such file or folder"),
        (["--model", "not a model"], "--model: 'not a model' is neither a local path nor a Hugging Face hub id"),
    ],
)
def test_what_can_be_checked_before_a_run_starts_is_one_line_and_exit_2(tmp_path, capsys, argv, expected):
    root = tmp_path / "store"
    assert main(["train", *argv, "--storage-root", str(root)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("grpo train: " + expected) and err.count("\n") == 1, err
    assert not root.exists()


def test_a_storage_root_that_cannot_be_written_is_refused_even_as_root(tmp_path, capsys):
    # /sys is read-only for everyone; os.access() says root may write there, so the check writes a file.
    assert main(["train", "--storage-root", "/sys/grpo-flow-check"]) == 2
    assert capsys.readouterr().err.startswith("grpo train: --storage-root: '/sys/grpo-flow-check' is not a writable")
    (tmp_path / "ro").mkdir()
    (tmp_path / "ro").chmod(0o500)
    try:
        if os.geteuid() != 0:  # root writes into a 0500 folder anyway; /sys above covers root
            assert main(["train", "--storage-root", str(tmp_path / "ro" / "sub")]) == 2
            assert "--storage-root" in capsys.readouterr().err
    finally:
        (tmp_path / "ro").chmod(0o700)


def test_checks_load_no_model_torch_or_prefect(tmp_path):
    """Why they take about a second: the refusal happens before any heavy import."""
    code = (
        "import sys; from grpo_flow.flows.cli import main; "
        f"rc = main(['train', '--reward-funcs', 'no_such_module:score', '--storage-root', {str(tmp_path)!r}]); "
        "print(rc, sorted(m for m in ('torch', 'prefect', 'transformers') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.split("\n")[0] == "2 []", done.stderr


@pytest.mark.slow
def test_the_resume_hint_is_shown_only_for_a_run_that_exists(prefect_server, tmp_path):
    from prefect.settings import PREFECT_API_URL

    failed = run_cli(
        "train",
        "--dataset",
        "hf:nobody-grpo-flow/no-such-data-set",  # passes the checks (a hub id), fails to load offline
        "--reward-funcs",
        "last_digit",
        "--run-id",
        "never-started",
        "--storage-root",
        str(tmp_path),
        env_extra={"PREFECT_API_URL": PREFECT_API_URL.value(), "HF_HUB_OFFLINE": "1"},
    )
    assert failed.returncode == 1
    lines = failed.stderr.strip().splitlines()
    assert lines[-2].startswith("grpo train: run never-started failed:") and "resume it with" not in failed.stderr
    assert lines[-1].startswith("(add --verbose for the traceback; Prefect's log:")
    assert not (tmp_path / "runs" / "never-started").exists()


# -- the ephemeral Prefect server (item 7) -------------------------------------------------------------
def test_the_ephemeral_server_gets_time_to_start_and_a_timeout_says_what_to_do(tmp_path):
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PREFECT_API_URL", "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS")
    }
    code = "import flows; from prefect.settings import PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS as t; print(t.value())"
    default = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert default.stdout.strip() == "120"  # Prefect's own default, 20 s, was overrun on a busy machine

    (tmp_path / "home").mkdir()
    env.update(PREFECT_HOME=str(tmp_path / "home"), PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="0")
    refused = subprocess.run(
        [sys.executable, "-m", "grpo_flow.flows.cli", "train", "--storage-root", str(tmp_path / "store")],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert refused.returncode == 1
    assert refused.stderr.strip().splitlines() == [
        "grpo train: Prefect's ephemeral server did not answer within 0 s (a busy machine?): set "
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS higher (e.g. 300), or start a server with "
        f"`prefect server start` and set PREFECT_API_URL; server log: {tmp_path / 'store' / 'logs' / 'prefect.log'}"
    ]
    assert not (tmp_path / "store" / "runs").exists()


# -- grpo train --help (item 13) ------------------------------------------------------------------------
def test_help_shows_each_option_with_its_allowed_values_and_default_grouped_as_the_config():
    from grpo_flow.schemas.config import CONFIG_GROUPS

    help_text = make_parser()._subparsers._group_actions[0].choices["train"].format_help()
    assert not re.search(r"--[a-z0-9-]+ VALUE", help_text)  # every option says what it takes
    flat = " ".join(help_text.split())  # argparse wraps the text
    assert "--loss-type {grpo,dapo,dr_grpo,bnpo,cispo,sapo,luspo,vespo}" in flat
    assert "(default: dapo)" in flat and "--use-lora {true,false}" in flat and "(default: false)" in flat
    assert "--learning-rate X" in flat and "(default: 1e-06; a tiny model without --preset: 0.005; > 0)" in flat
    assert "--num-generations N" in flat
    assert "--reward-timeout-s X" in flat and "(default: none; > 0)" in flat  # reward_timeout_s
    assert "instead. (default: {})" in flat and "PydanticUndefined" not in flat  # storage_options: a dict factory
    headings = [line[:-1] for line in help_text.splitlines() if line.endswith(" (config fields):")]
    assert headings == [f"{group} (config fields)" for group in CONFIG_GROUPS]
    sections = help_text.split(" (config fields):")[1:]
    for group, section in zip(CONFIG_GROUPS.values(), sections, strict=True):
        flags = re.findall(r"^  (--[a-z0-9-]+)", section, re.M)  # an option's line, not `--x` in a help text
        assert flags == ["--" + name.replace("_", "-") for name in group]


def test_the_summary_says_what_was_not_measured_and_when_a_run_was_already_complete(capsys):
    from grpo_flow.flows.cli import print_summary

    summary = {
        "run_id": "done",
        "status": "completed",
        "steps_completed": 5,
        "total_steps": 5,
        "initial_eval_accuracy": float("nan"),  # evaluation off, in the flow's summary
        "final_eval_accuracy": None,  # the same, read back from summary.json
        "final_reward": 0.5,
        "wall_seconds": 3.25,
        "storage": "grpo-storage",
        "already_completed": True,
    }
    print_summary(summary)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "grpo-flow: run done was already complete; nothing to train"
    rows = dict(re.split(r"\s{2,}", line, maxsplit=1) for line in lines[1:])
    assert rows["held-out accuracy, before RL"] == rows["held-out accuracy, after RL"] == "not measured"
    assert rows["mean reward, last 5 steps"] == "0.500" and rows["wall time from the workers' start"] == "3.2 s"


@pytest.mark.parametrize("command", ["verify", "eval", "report", "rollouts", "checkpoints"])
def test_a_run_argument_is_a_run_id_never_a_path_out_of_the_storage_root(tmp_path, capsys, command):
    """`grpo verify ../../outside --storage-root R1` quarantined files of a folder outside R1 (issue 30, item 11)."""
    outside = tmp_path / "outside"
    (outside / "rollouts" / "step-000001").mkdir(parents=True)
    (outside / "config.json").write_text("{}")
    (outside / "rollouts" / "step-000001" / "shard-00.parquet").write_text("not parquet")
    root = tmp_path / "R1"
    root.mkdir()
    before = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    assert main([command, "../../outside", "--storage-root", str(root)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'../../outside' is not a run id (1 to 128 letters" in err, err
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == before


def test_a_corrupt_config_is_one_line_from_resume_and_eval(tmp_path, capsys):
    """A JSONDecodeError traceback before (issue 30, item 12)."""
    from grpo_flow.workers.state.storage import RunStorage

    storage = RunStorage(tmp_path, "broken")
    storage.write_config(build_config("tiny", {"run_id": "broken"}).model_dump(mode="json"))
    storage.config_path.write_text('{"model": "ti')
    assert main(["train", "--run-id", "broken", "--resume", "--storage-root", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("grpo train: --run-id: run 'broken' cannot be resumed: "), err
    assert "config.json: unreadable (Unterminated string" in err and err.rstrip().endswith("restore it from a backup")
    assert main(["eval", "broken", "--storage-root", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("grpo eval: RUN: run 'broken' cannot be evaluated: "), err


def test_a_full_disk_at_the_writer_lock_is_one_line_and_leaves_no_lock(tmp_path, capsys, monkeypatch):
    import errno

    from grpo_flow.workers.state import lock

    def full(*args):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(lock.os, "pwrite", full)
    root = tmp_path / "store"
    assert main(["train", "--run-id", "full", "--storage-root", str(root)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith("grpo train: --storage-root: run 'full': cannot write its writer lock ")
    assert err.rstrip().endswith("writer.lock: No space left on device")
    assert not (root / "runs" / "full").exists()


def test_taking_over_a_killed_writers_lock_is_said_as_a_grpo_flow_warning(tmp_path, capsys):
    """Resuming after a SIGKILL printed "run demo: taking over the writer lock of pid ..." without the
    prefix of every other warning: nothing had set up logging yet, so Python's last resort printed it."""
    from grpo_flow.flows.cli import hold_cli_lock
    from grpo_flow.workers.state.lock import LOCK_FILE, release_run_lock, this_host
    from grpo_flow.workers.state.storage import RunStorage

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    config = build_config("tiny", {"run_id": "demo", "storage_root": str(tmp_path)})
    run_dir = RunStorage.of(config).run_dir
    run_dir.mkdir(parents=True)
    record = {"host": this_host(), "pid": gone.pid, "since": "then", "expires": 0, "token": "killed"}
    (run_dir / LOCK_FILE).write_text(json.dumps(record))
    try:
        hold_cli_lock(config)
    finally:
        release_run_lock(run_dir)
    err = capsys.readouterr().err
    holder = f"pid {gone.pid} on host {this_host()} since then"
    assert err == f"grpo-flow: warning: run demo: taking over the writer lock of {holder}: that process is gone\n"


def test_a_seed_beyond_numpys_range_is_refused_before_it_overflows(tmp_path, capsys):
    assert main(["train", "--seed", "99999999999999999999999", "--storage-root", str(tmp_path)]) == 2
    assert capsys.readouterr().err == "grpo train: --seed: Input should be less than or equal to 4294967295\n"


def test_a_mistyped_option_gets_a_did_you_mean(tmp_path, capsys):
    with pytest.raises(SystemExit) as exited:
        main(["train", "--lerning-rate", "0.1", "--storage-root", str(tmp_path)])
    assert exited.value.code == 2
    err = capsys.readouterr().err.splitlines()
    assert err[-1] == "grpo train: error: unrecognized arguments: --lerning-rate 0.1; did you mean --learning-rate?"
    with pytest.raises(SystemExit):  # a prefix of an option is not taken for it, as the config takes no prefixes
        main(["train", "--num-generation", "4", "--storage-root", str(tmp_path)])
    err = capsys.readouterr().err.splitlines()
    assert err[-1] == "grpo train: error: unrecognized arguments: --num-generation 4; did you mean --num-generations?"


def test_a_reader_that_stops_early_gets_no_broken_pipe_traceback(tmp_path):
    """`grpo rollouts RUN | head` printed a BrokenPipeError (issue 30, item 12)."""
    (tmp_path / "runs").mkdir()
    env = {**os.environ, "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    process = subprocess.Popen(
        [sys.executable, "-m", "grpo_flow.flows.cli", "runs", "--storage-root", str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    process.stdout.close()  # the reader is gone before the first line is written
    err = process.stderr.read().decode()
    assert process.wait(timeout=120) == 141 and err == ""


@pytest.mark.slow
def test_a_run_on_relative_paths_resumes_from_another_folder_and_refuses_changed_or_missing_data(
    storage_root, tmp_path
):
    """config.json kept `hf:data.jsonl` as typed, so a resume from another folder failed after 15 s taking
    it for a hub id (item 9); a rewritten data file trained steps 4-5 on other data without a word
    (item 7) (issue 30)."""
    here, elsewhere = tmp_path / "here", tmp_path / "elsewhere"
    here.mkdir()
    elsewhere.mkdir()
    data = here / "data.jsonl"
    data.write_text("".join(f'{{"prompt": "{n}=", "answer": "{n % 10}"}}\n' for n in range(100, 140)))
    env = {"PREFECT_HOME": str(tmp_path / "prefect-home")}
    common = ["--storage-root", str(storage_root), "--no-progress"]
    first = run_cli(
        "train", "--dataset", "hf:data.jsonl", "--reward-funcs", "last_digit", "--max-steps", "1",
        "--accuracy-reward", "last_digit", "--eval-prompts", "4", "--run-id", "paths", *common, env_extra=env, cwd=here,
    )  # fmt: skip
    assert first.returncode == 0, first.stderr[-3000:]
    shown = dict(line.split("  ", 1) for line in summary_lines(first.stdout))
    assert float(shown["held-out accuracy, before RL"]) >= 0  # measured with --accuracy-reward (item 4)
    assert "held-out accuracy, random init" not in shown  # the tiny model's, on last_digit: not this data's
    stored = json.loads((storage_root / "runs" / "paths" / "config.json").read_text())
    assert stored["dataset"] == f"hf:{data}"
    resumed = run_cli(
        "train", "--run-id", "paths", "--resume", "--max-steps", "2", *common, env_extra=env, cwd=elsewhere
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    data.write_text(data.read_text().replace('"100="', '"999="'))
    changed = run_cli(
        "train", "--run-id", "paths", "--resume", "--max-steps", "3", *common, env_extra=env, cwd=elsewhere
    )
    assert changed.returncode == 2
    assert changed.stderr.startswith(f"grpo train: --dataset: {data} changed since run 'paths' last trained on it")
    data.unlink()
    missing = run_cli(
        "train", "--run-id", "paths", "--resume", "--max-steps", "3", *common, env_extra=env, cwd=elsewhere
    )
    assert (missing.returncode, missing.stderr) == (
        2,
        f"grpo train: --dataset: {str(data)!r}: no such file or folder\n",
    )


def test_local_paths_are_stored_absolute_and_a_stored_one_that_is_gone_is_refused(tmp_path, capsys, monkeypatch):
    """`--dataset hf:data.jsonl` and `--model ../tiny-chat` went into config.json as typed, and a resume
    from another folder failed after 15 s taking the file for a hub id (issue 30, item 9)."""
    from grpo_flow.flows import cli

    here = tmp_path / "here"
    (here / "tiny-chat").mkdir(parents=True)
    (here / "tiny-chat" / "config.json").write_text("{}")
    (here / "data.jsonl").write_text('{"prompt": "1=", "answer": "1"}\n{"prompt": "2=", "answer": "2"}\n')
    monkeypatch.chdir(here / "tiny-chat")
    started = []
    monkeypatch.setattr(cli, "train_run", lambda config, *args: started.append(config) or 0)
    monkeypatch.setattr("grpo_flow.flows.quiet.quiet_prefect_run", lambda root: None)
    argv = ["train", "--dataset", "hf:../data.jsonl", "--model", "../tiny-chat", "--reward-funcs", "last_digit"]
    assert main([*argv, "--run-id", "p", "--storage-root", str(tmp_path / "store")]) == 0
    assert (started[0].dataset, started[0].model) == (f"hf:{here / 'data.jsonl'}", str(here / "tiny-chat"))
    from grpo_flow.workers.state.storage import RunStorage

    gone = tmp_path / "gone.jsonl"
    RunStorage(tmp_path / "store", "old").write_config(
        build_config("tiny", {"run_id": "old", "dataset": f"hf:{gone}", "reward_funcs": ["last_digit"]}).model_dump()
    )
    capsys.readouterr()
    assert main(["train", "--run-id", "old", "--resume", "--storage-root", str(tmp_path / "store")]) == 2
    assert capsys.readouterr().err == f"grpo train: --dataset: {str(gone)!r}: no such file or folder\n"


def test_a_python_api_run_that_needs_its_objects_is_refused_at_once_by_resume_eval_and_the_nightly_sweep(
    tmp_path, capsys
):
    """Its resume failed after about 25 s and offered a resume command that could not work (issue 30, item 13)."""
    import time

    from grpo_flow.flows.evaluate import needs_evaluation
    from grpo_flow.workers.state.storage import RunStorage

    fields = {"run_id": "api", "dataset": "registered:abc123", "reward_funcs": ["registered:judge", "last_digit"]}
    storage = RunStorage(tmp_path, "api")
    storage.write_config(build_config("tiny", fields).model_dump(mode="json"))
    held = "a data set given as a Dataset object and reward functions given as objects (judge), which only that"
    started = time.perf_counter()
    assert main(["train", "--run-id", "api", "--resume", "--storage-root", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(
        f"grpo train: --run-id: run 'api' was started from the Python API with {held}"
    )
    assert err.rstrip().endswith(
        "resume it from Python with the same objects: GRPOFlowTrainer(..., run_id='api').train()"
    )
    assert main(["eval", "api", "--storage-root", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(
        f"grpo eval: RUN: run 'api' was started from the Python API with {held}"
    )
    assert time.perf_counter() - started < 5
    assert needs_evaluation(storage) == (None, f"it was started from the Python API with {held} Python process holds")


@pytest.mark.slow
def test_wandb_without_a_login_is_said_once_and_the_summary_counts_what_it_did_not_get(storage_root, tmp_path):
    """Exit 0, no warning, nothing logged to wandb before (issue 30, item 5)."""
    env = {
        "PREFECT_HOME": str(tmp_path / "prefect-home"),
        "HOME": str(tmp_path),  # no ~/.netrc login
        "WANDB_DIR": str(tmp_path),
        "WANDB_API_KEY": "",
        "WANDB_MODE": "online",
    }
    trained = run_cli(
        "train", "--max-steps", "2", "--eval-prompts", "0", "--report-to", "wandb", "--run-id", "unlogged",
        "--storage-root", str(storage_root), "--no-progress", env_extra=env,
    )  # fmt: skip
    assert trained.returncode == 0, trained.stderr[-3000:]
    warnings = [line for line in trained.stderr.splitlines() if line.startswith("grpo-flow: warning: wandb:")]
    assert len(warnings) == 1 and "step 1's metrics were not delivered (UsageError: " in warnings[0], trained.stderr
    shown = {name: value.strip() for name, value in (line.split("  ", 1) for line in summary_lines(trained.stdout))}
    assert shown["wandb"] == "2 step(s) not delivered; all are in metrics/"
    summary = json.loads((storage_root / "runs" / "unlogged" / "summary.json").read_text())
    assert summary["wandb_steps_not_delivered"] == 2


def test_help_shows_the_storage_root_grpo_flow_storage_names():
    """`--help` said `default: grpo-storage` with $GRPO_FLOW_STORAGE set (issue 30, "Also")."""
    shown = run_cli("train", "--help", env_extra={"GRPO_FLOW_STORAGE": "/data/runs", "COLUMNS": "400"})
    line = next(line for line in shown.stdout.splitlines() if line.strip().startswith("--storage-root"))
    assert line.rstrip().endswith("(default: /data/runs)"), line


@pytest.mark.slow
@pytest.mark.parametrize("umask", [0o002])  # group-writable: more than the usual 022 for the run to honour
def test_a_run_under_a_umask_writes_what_it_lets_others_read(tmp_path, umask):
    """config.json, metrics and rollout Parquet, model.safetensors (the built model's and the checkpoint's),
    report.png and the checkpoint folders were 0600/0700 whatever the umask (issue 30, item 10)."""
    root = tmp_path / "store"
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect-home"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    env.pop("WANDB_MODE", None)

    def grpo(*args):
        return subprocess.run(
            [sys.executable, "-m", "grpo_flow.flows.cli", *args],
            capture_output=True,
            text=True,
            env=env,
            timeout=900,
            preexec_fn=lambda: os.umask(umask),
        )

    trained = grpo("train", "--max-steps", "1", "--save-steps", "1", "--eval-prompts", "0", "--run-id", "m",
                   "--storage-root", str(root), "--no-progress")  # fmt: skip
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert grpo("report", "m", "--storage-root", str(root)).returncode == 0
    run = root / "runs" / "m"
    folders = [
        run,
        run / "rollouts" / "step-000001",
        run / "checkpoints" / "step-000001",
        root / "models" / "tiny-qwen2",
    ]
    files = [
        run / "config.json",
        run / "summary.json",
        run / "metrics" / "step-000001.parquet",
        run / "rollouts" / "step-000001" / "shard-00.parquet",
        run / "checkpoints" / "step-000001" / "model" / "model.safetensors",
        root / "models" / "tiny-qwen2" / "model.safetensors",
        run / "report.png",
    ]
    modes = {str(p.relative_to(root)): oct(p.stat().st_mode & 0o777) for p in folders + files}
    expected = {str(p.relative_to(root)): oct(0o777 & ~umask) for p in folders}
    expected |= {str(p.relative_to(root)): oct(0o666 & ~umask) for p in files}
    assert modes == expected
