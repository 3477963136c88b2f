"""The automations `grpo serve` creates, on a real server: a deployment run killed mid-run is resumed
with no command typed (grpo-resume); a run that fails on bad input is not, nor one cancelled by hand;
a run whose reward turns NaN at step 3 is cancelled there (grpo-guard)."""

import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_real_server import (
    client_env,
    flow_run_log,
    page_text,
    prefect_client,
    running_prefect_server,
    stop,
    wait_for_deployments,
)
from train_cli import assert_same_weights, final_weights  # tests/flows/train_cli.py

from grpo_flow.deployments.automations import GUARD_AUTOMATION, RESUME_AUTOMATION, set_up_automations
from grpo_flow.workers.state.storage import RunStorage

# On PostgreSQL, as a production server runs; the UI of the guarded run in headless Chromium.
pytestmark = [pytest.mark.slow, pytest.mark.postgres, pytest.mark.browser]
HERE = Path(__file__).parent  # fault_rewards.py, for the flow runs `grpo serve` starts


def automations_named(url: str, name: str) -> list:
    with prefect_client(url) as client:
        return client.read_automations_by_name(name)


def flow_runs_named(url: str, name: str) -> list:
    """The flow runs called `name` (a run id), oldest first."""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName

    with prefect_client(url) as client:
        runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[name])))
    return sorted(runs, key=lambda run: run.created)


def states(url: str, name: str) -> list[str]:
    return [run.state.type.value for run in flow_runs_named(url, name)]


def status(storage: RunStorage) -> str | None:
    """summary.json's status; None while there is none (a run under way, or killed)."""
    return (storage.read_summary() or {}).get("status")


def stored_events(url: str, resource: str, until: dict[str, int]) -> dict[str, int]:
    """How many events of each kind the server has stored for `resource`, once they reach `until` (or after
    60 s): the server stores events in batches, a little after the automations have acted on them."""
    deadline = time.monotonic() + 60
    while True:
        with prefect_client(url) as client:
            body = {"filter": {"resource": {"id": [resource]}}, "limit": 50}
            events = client.request("POST", "/events/filter", json=body).json()["events"]
        counts = {kind: sum(e["event"] == kind for e in events) for kind in until}
        if counts == until or time.monotonic() > deadline:
            return counts
        time.sleep(1)


def test_a_killed_deployment_run_is_resumed_by_the_automation(tmp_path, storage_root):
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from grpo_flow.workers.data.tiny_model import ensure_tiny_model

    from grpo_flow.deployments.local_server import local_postgres

    model, store = str(ensure_tiny_model(storage_root)), tmp_path / "store"
    with local_postgres() as database_url, running_prefect_server(tmp_path / "server-home", database_url) as url:
        env = client_env(url, tmp_path / "client-home")
        log = open(tmp_path / "serve.log", "w")
        serve = subprocess.Popen(
            [sys.executable, "-m", "grpo_flow.flows.cli", "serve", "--storage-root", str(store)]
            # Its four runs at once (the grpo-gpu limit and evaluate/checkpoint: test_real_server.py)
            + ["--max-auto-resumes", "2", "--no-checkpoint-eval", "--gpu-slots", "0"],
            env={
                **env,
                "PREFECT_RUNNER_POLL_FREQUENCY": "2",
                "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE), env.get("PYTHONPATH")])),
            },
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            wait_for_deployments(url, serve, tmp_path / "serve.log")
            # Serving again replaces the automation rather than adding a second one.
            with temporary_settings(updates={PREFECT_API_URL: url}):
                assert set_up_automations(True, 2) is None
            (automation,) = automations_named(url, RESUME_AUTOMATION)
            assert automation.actions[0].parameters["auto_resume_limit"] == 2
            assert len(automations_named(url, GUARD_AUTOMATION)) == 1

            small = {"model": model, "max_steps": 3, "prompts_per_step": 8, "num_generations": 4, "eval_prompts": 0}
            with prefect_client(url) as client:
                tiny = client.read_deployment_by_name("grpo/tiny")
                # Bad input: fails before anything loads, so it is not resumed.
                bad = {**small, "run_id": "auto-bad", "prompts_per_step": 6, "num_rollout_workers": 4}
                client.create_flow_run_from_deployment(tiny.id, parameters=bad)
                # SIGKILLed in step 2's scoring, as a preempted machine would be; step 1 is checkpointed.
                killed = {**small, "run_id": "auto-kill", "save_steps": 1, "fail_at": "score@2:kill"}
                client.create_flow_run_from_deployment(tiny.id, parameters=killed)
                # The same run, never killed: the weights the resumed one must end with.
                client.create_flow_run_from_deployment(tiny.id, parameters={**small, "run_id": "auto-unbroken"})
                # Held in step 2 until it is cancelled, as a user would from the UI.
                held = {**small, "run_id": "auto-cancel", "save_steps": 1, "fail_at": "metrics@2:hang"}
                cancelled = client.create_flow_run_from_deployment(tiny.id, parameters=held)
                # Its reward NaN from step 3: the guard cancels it before its last step.
                nan = {
                    **small,
                    "run_id": "auto-nan",
                    "max_steps": 12,
                    "reward_funcs": ["fault_rewards:none_from_step_3"],
                    "max_no_reward_steps": 10,  # so that the run does not fail on its own first
                }
                client.create_flow_run_from_deployment(tiny.id, parameters=nan)

            storage, held_storage = RunStorage(store, "auto-kill"), RunStorage(store, "auto-cancel")
            deadline = time.monotonic() + 600
            while not held_storage.checkpoint_committed(1):
                assert time.monotonic() < deadline, (tmp_path / "serve.log").read_text()[-5000:]
                time.sleep(1)
            done = subprocess.run(
                [sys.executable, "-m", "prefect", "flow-run", "cancel", str(cancelled.id)],
                env=env,
                capture_output=True,
                text=True,
                timeout=120,
            )
            assert done.returncode == 0, done.stdout + done.stderr
            # Until the killed run's second flow run has completed and the held one is cancelled.
            wanted = (["CRASHED", "COMPLETED"], ["CANCELLED"], ["CANCELLED"], ["COMPLETED"])
            names = ("auto-kill", "auto-cancel", "auto-nan", "auto-unbroken")
            while tuple(states(url, name) for name in names) != wanted:
                assert time.monotonic() < deadline, (tmp_path / "serve.log").read_text()[-5000:]
                time.sleep(2)
        finally:
            stop(serve)
            log.close()

        # Cancelled by hand while held in a step: stopped at once after the grace, recorded as cancelled.
        assert (status(storage), status(held_storage)) == ("completed", "cancelled")
        summary = storage.read_summary()
        assert summary["resumed_from_step"] == 1 and summary["steps_completed"] == 3
        assert storage.logged_steps() == [1, 2, 3] and storage.resume_count() == 1
        assert_same_weights(final_weights(storage, 3), final_weights(RunStorage(store, "auto-unbroken"), 3))
        first, second = flow_runs_named(url, "auto-kill")
        assert second.deployment_id == tiny.id
        assert second.parameters["run_id"] == "auto-kill" and second.parameters["auto_resume_limit"] == 2
        assert "fail_at" not in second.parameters  # the deployment's own parameters, and the run id
        held_summary = held_storage.read_summary()
        assert held_summary["interrupted_by"] == "SIGTERM" and held_summary["stopped_at_once"] is True
        assert held_storage.logged_steps() == [1]
        assert states(url, "auto-cancel") == ["CANCELLED"]  # not resumed
        (bad_run,) = flow_runs_named(url, "auto-bad")
        assert bad_run.state.type.value == "FAILED" and "prompts_per_step" in bad_run.state.message
        # The guard: cancelled (once, not resumed) after step 3, the first whose reward is NaN, and
        # before its last step; every logged row kept.
        guarded = RunStorage(store, "auto-nan")
        summary = guarded.read_summary()
        # Between two steps, as Ctrl-C stops a run, naming the automation and the step that tripped it.
        assert summary["status"] == "cancelled" and "stopped_at_once" not in summary
        assert "automation grpo-guard" in summary["cancelled_by"]
        assert (summary["guard"], summary["guard_step"]) == ("reward-nan", 3)
        (guarded_run,) = flow_runs_named(url, "auto-nan")
        said = [
            line
            for line in flow_run_log(url, guarded_run.id, until="step 3: reward-nan")
            if line.startswith("cancelled (")
        ]
        assert len(said) == 1 and "automation grpo-guard" in said[0] and said[0].endswith("step 3: reward-nan")
        rewards = guarded.read_metrics()["reward"].to_pylist()
        assert 3 <= len(rewards) < 12 and guarded.logged_steps() == list(range(1, len(rewards) + 1))
        assert [r is None or math.isnan(r) for r in rewards[:3]] == [False, False, True]
        # What a user sees of it in the UI: its step lines and the cancel, and its step events.
        ui = url.removesuffix("/api")
        run_page = page_text(f"{ui}/runs/flow-run/{guarded_run.id}")
        assert "auto-nan: step 3/12" in run_page and said[0] in run_page, run_page[:3000]
        wanted_events = {"grpo.step.completed": len(rewards), "grpo.run.finished": 1}
        assert stored_events(url, "grpo.run.auto-nan", until=wanted_events) == wanted_events
        for _ in range(3):  # on a loaded machine the feed's request may outlast one render's time budget
            feed = page_text(f"{ui}/events?resource=grpo.run.auto-nan")
            steps_seen = feed.count("grpo.step.completed Resource grpo.run.auto-nan")
            if steps_seen == len(rewards) and "grpo.run.finished Resource grpo.run.auto-nan" in feed:
                break
        assert steps_seen == len(rewards) and "grpo.run.finished Resource grpo.run.auto-nan" in feed, feed[:3000]
