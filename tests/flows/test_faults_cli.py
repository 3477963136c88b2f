"""Faults a user causes in the `grpo train` process, tried on real processes: Ctrl-C (SIGINT to the
process group, as a terminal sends it), SIGTERM, a second signal, and a reward that never returns.

The Ctrl-C test runs on the process's own ephemeral Prefect server, where the old failure was (the
server shared the terminal's process group and died first); the others talk to the session's server.
Waits have generous liveness bounds (before the fix a Ctrl-C took about three minutes); how fast a
run stops is measured by hand (README), not asserted.
"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cli_output import SUMMARY_ROWS, summary_lines  # tests/flows/cli_output.py
from grpo_flow.workers.state.storage import RunStorage, list_runs

HERE = Path(__file__).parent  # fault_rewards.py, the misbehaving reward functions
SMALL = ["--prompts-per-step", "8", "--num-generations", "4", "--num-rollout-workers", "1", "--eval-prompts", "8"]


def cli_env(tmp_path, own_server=False, **extra):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]), **extra}
    env.pop("PREFECT_SERVER_ANALYTICS_ENABLED", None)  # grpo-flow's own defaults must do
    env.pop("WANDB_MODE", None)  # conftest's; with it transformers prints "Running in WANDB offline mode"
    if own_server:  # the user's default: an ephemeral server this process starts
        env.pop("PREFECT_API_URL", None)
        env["PREFECT_HOME"] = str(tmp_path / "prefect-home")
        (tmp_path / "prefect-home").mkdir(exist_ok=True)
    else:
        from prefect.settings import PREFECT_API_URL

        env["PREFECT_API_URL"] = PREFECT_API_URL.value()
    return env


def train_argv(storage_root, run_id, *args):
    flags = ["--run-id", run_id, "--storage-root", str(storage_root), "--no-progress"]
    return [sys.executable, "-m", "grpo_flow.flows.cli", "train", *flags, *args]


def start(argv, env):
    return subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True
    )


def wait_for(condition, seconds=300.0):
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.1)
    return condition()


def server_processes(parent_pid):
    """Ephemeral Prefect servers that `parent_pid` started (flows/ephemeral_server.py's command line)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"grpo_flow.flows.ephemeral_server" in argv and str(parent_pid).encode() in argv:
            found.append(int(entry.name))
    return found


@pytest.mark.slow
def test_ctrl_c_stops_after_the_step_marks_the_run_interrupted_and_it_resumes(prefect_server, storage_root, tmp_path):
    env = cli_env(tmp_path, own_server=True)
    storage = RunStorage(storage_root, "ctrl-c")
    run = start(train_argv(storage_root, "ctrl-c", "--preset", "tiny", "--max-steps", "500", *SMALL), env)
    assert wait_for(lambda: storage.metrics_path(2).exists() or run.poll() is not None)
    assert server_processes(run.pid)  # its own server, in a session of its own
    os.killpg(run.pid, signal.SIGINT)  # what Ctrl-C in a terminal does: the whole foreground group
    out, err = run.communicate(timeout=90)

    assert run.returncode == 130, err
    summary = storage.read_summary()
    last = storage.logged_steps()[-1]
    assert summary["status"] == "interrupted" and summary["interrupted_by"] == "SIGINT"
    assert summary["last_step"] == summary["steps_completed"] == last and last >= 2 and summary["total_steps"] == 500
    resume = f"grpo train --run-id ctrl-c --resume --storage-root {storage_root}"
    assert err.strip().splitlines() == [
        "grpo train: SIGINT: stopping after the step under way (at most 6 s); Ctrl-C again stops at once",
        f"grpo train: run ctrl-c interrupted (SIGINT) after step {last} of 500; resume with: {resume}",
    ]
    assert out.splitlines()[0] == "grpo-flow: run ctrl-c (tiny, last_digit)" and not summary_lines(out)
    assert wait_for(lambda: not server_processes(run.pid), 30)  # the server ended with its run
    assert [(r.run_id, r.status) for r in list_runs(storage_root) if r.run_id == "ctrl-c"] == [
        ("ctrl-c", "interrupted")
    ]

    # The printed command resumes it; a clean run prints only the run line and the summary.
    resumed = subprocess.run(
        [
            *resume.replace("grpo", f"{sys.executable} -m grpo_flow.flows.cli", 1).split(),
            "--max-steps",
            str(last + 1),
            "--no-progress",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert resumed.returncode == 0, resumed.stderr
    assert resumed.stderr == ""
    lines = resumed.stdout.splitlines()
    assert lines[0] == "grpo-flow: resuming run ctrl-c (tiny, last_digit)"
    assert lines[1].startswith("grpo-flow: settings: learning_rate 0.005 (the run's config); ")
    lines = summary_lines(resumed.stdout)
    assert [line.split("  ")[0] for line in lines] == SUMMARY_ROWS
    assert lines[1].split() == ["status", "completed"] and lines[2].split() == [
        "steps",
        f"{last + 1}",
        "/",
        f"{last + 1}",
    ]
    assert storage.read_summary()["status"] == "completed"


@pytest.mark.parametrize("signals", [[signal.SIGTERM], [signal.SIGTERM, signal.SIGINT]], ids=["step-overruns", "twice"])
@pytest.mark.slow
def test_a_step_that_does_not_end_or_a_second_signal_stops_at_once(prefect_server, storage_root, tmp_path, signals):
    run_id = f"at-once-{len(signals)}"
    started = tmp_path / "reward-started"
    env = cli_env(tmp_path, GRPO_TEST_REWARD_SLEEP="120", GRPO_TEST_REWARD_STARTED=str(started))
    argv = train_argv(storage_root, run_id, "--preset", "tiny", "--max-steps", "50", *SMALL)
    run = start([*argv, "--reward-funcs", "fault_rewards:slow_last_digit"], env)
    assert wait_for(lambda: started.exists() or run.poll() is not None)  # step 1's reward is sleeping
    for signum in signals:
        run.send_signal(signum)
        time.sleep(0.5)
    out, err = run.communicate(timeout=90)

    assert run.returncode == 128 + signals[-1], err
    name = signal.Signals(signals[-1]).name
    resume = f"grpo train --run-id {run_id} --resume --storage-root {storage_root}"
    assert err.strip().splitlines()[-1] == f"grpo train: run {run_id} stopped at once ({name}); resume with: {resume}"
    summary = RunStorage(storage_root, run_id).read_summary()
    assert summary["status"] == "interrupted" and summary["stopped_at_once"] is True
    assert summary["last_step"] == 0 and summary["interrupted_by"] == "SIGTERM"


@pytest.mark.slow
def test_a_reward_that_never_returns_fails_the_step_naming_it_and_the_run_resumes(
    prefect_server, storage_root, tmp_path
):
    calls = tmp_path / "calls"
    env = cli_env(tmp_path, GRPO_TEST_REWARD_SLEEP="3600", GRPO_TEST_REWARD_CALLS=str(calls))
    argv = train_argv(storage_root, "hung-reward", "--preset", "tiny", "--max-steps", "2", *SMALL)
    argv += ["--reward-funcs", "fault_rewards:slow_last_digit", "--reward-timeout-s", "1", "--score-retries", "2"]
    hung = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300)

    assert hung.returncode == 1  # the process ends: the blocked call's process was killed
    first, hint = hung.stderr.strip().splitlines()[-2:]
    assert first.startswith(
        "grpo train: run hung-reward failed: RewardTimeoutError: reward function 'slow_last_digit' did not "
        "return within reward_timeout_s=1 s on step 1"
    )
    assert first.endswith("its process was killed")
    assert hint.startswith(f"(resume it with: grpo train --run-id hung-reward --resume --storage-root {storage_root};")
    assert calls.read_text().count("\n") == 1  # not retried: score_retries applies to errors, not timeouts
    assert "RewardTimeoutError" in (storage_root / "logs" / "prefect.log").read_text()  # Prefect's traceback
    storage = RunStorage(storage_root, "hung-reward")
    assert storage.read_summary()["status"] == "failed" and storage.logged_steps() == []

    fixed = {**env, "GRPO_TEST_REWARD_SLEEP": "0"}
    resumed = subprocess.run(
        train_argv(storage_root, "hung-reward", "--resume"), capture_output=True, text=True, env=fixed, timeout=600
    )
    assert resumed.returncode == 0, resumed.stderr
    assert storage.read_summary()["status"] == "completed" and storage.logged_steps() == [1, 2]


@pytest.mark.slow
def test_a_raising_reward_fails_the_run_in_one_line_its_traceback_in_prefects_log(
    prefect_server, storage_root, tmp_path
):
    argv = train_argv(storage_root, "raising-reward", "--preset", "tiny", "--max-steps", "1", *SMALL)
    argv += ["--reward-funcs", "math:sqrt", "--score-retries", "0"]  # math.sqrt takes no keyword arguments
    failed = subprocess.run(argv, capture_output=True, text=True, env=cli_env(tmp_path), timeout=300)

    assert failed.returncode == 1
    first, hint = failed.stderr.strip().splitlines()  # nothing else: the traceback is in Prefect's log
    assert first.startswith(
        "grpo train: run raising-reward failed: RewardFunctionError: reward function 'sqrt' raised on sample 0"
    )
    assert hint.startswith("(resume it with: grpo train --run-id raising-reward --resume")
    assert "Traceback" in (storage_root / "logs" / "prefect.log").read_text()
