"""The ephemeral server `grpo train` starts: on its in-memory database the event persister is off,
and the run's task runs, states and artifacts are still recorded (flows/__init__.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Runs in a fresh interpreter, so `import flows` meets an environment with no Prefect server or database.
SCRIPT = r"""
import json, sys, time
from grpo_flow import flows
from grpo_flow.flows.ephemeral_server import start_ephemeral_server
from prefect import flow, task
from prefect.artifacts import create_markdown_artifact
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

start_ephemeral_server(sys.argv[1])

@task(name="stage")
def stage(x):
    create_markdown_artifact("a step", key="a-step")
    return x + 1

@flow(name="recorded")
def recorded():
    return [stage(i) for i in range(10)]  # 30 events: a persister stores a batch every 20

state = recorded(return_state=True)
run_id = state.state_details.flow_run_id
with get_client(sync_client=True) as client:
    for _ in range(60):  # the task-run recorder writes at least once a second
        task_runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run_id])))
        if len(task_runs) == 10 and all(t.state_name == "Completed" for t in task_runs):
            break
        time.sleep(0.5)
    time.sleep(2)  # a persister would have stored 20 of them by now
    events = client.request("POST", "/events/filter", json={"limit": 50}).json()
    artifacts = client.read_artifacts()
print(json.dumps({
    "ephemeral_only": flows.EPHEMERAL_ONLY,
    "task_runs": sorted({(t.name.split("-")[0], t.state_name) for t in task_runs}) + [len(task_runs)],
    "artifacts": sorted({a.key for a in artifacts}),
    "events": events["total"],
}))
"""


@pytest.mark.slow
def test_in_memory_server_records_runs_without_an_event_store(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(PREFECT_HOME=str(tmp_path / "home"), PREFECT_SERVER_ANALYTICS_ENABLED="false")
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path / "server.log")],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.splitlines()[-1])
    assert seen["ephemeral_only"] == {
        "PREFECT_API_DATABASE_CONNECTION_URL": "sqlite+aiosqlite:///:memory:",
        "PREFECT_SERVER_SERVICES_EVENT_PERSISTER_ENABLED": "false",
    }
    assert seen["task_runs"] == [["stage", "Completed"], 10]  # the recorder works from the same events
    assert seen["artifacts"] == ["a-step"]
    assert seen["events"] == 0  # none stored: the persister is off


def test_a_database_of_ones_own_keeps_the_event_persister(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env["PREFECT_API_DATABASE_CONNECTION_URL"] = f"sqlite+aiosqlite:///{tmp_path / 'prefect.db'}"
    code = "from grpo_flow import flows; import json, os; print(json.dumps([flows.EPHEMERAL_ONLY, os.environ.get(flows.EVENT_PERSISTER)]))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert json.loads(done.stdout) == [{}, None]


def test_a_prefect_server_start_of_ours_keeps_prefects_event_persister(monkeypatch, tmp_path):
    from grpo_flow import flows
    from grpo_flow.deployments.local_server import server_environment

    monkeypatch.setattr(flows, "EPHEMERAL_ONLY", {flows.EVENT_PERSISTER: "false"})
    monkeypatch.setenv(flows.EVENT_PERSISTER, "false")  # as `import flows` leaves it in this process
    env = server_environment(tmp_path / "home")
    assert flows.EVENT_PERSISTER not in env
    assert env["PREFECT_API_DATABASE_CONNECTION_URL"].endswith("prefect.db")


def test_a_child_process_knows_what_its_parents_import_set(tmp_path):
    """pytest-xdist's workers, `grpo serve`'s flow runs: a process started by one that imported `flows`
    inherits the in-memory database and the event persister off, and still counts them as that import's
    (so a `prefect server start` it makes keeps the persister)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "GRPO_FLOW_EPHEMERAL"))}
    code = "from grpo_flow import flows; import json, os; print(json.dumps(flows.EPHEMERAL_ONLY))"
    parent = (
        "import os, subprocess, sys; from grpo_flow import flows; subprocess.run([sys.executable, '-c', sys.argv[1]])"
    )
    done = subprocess.run(
        [sys.executable, "-c", parent, code], capture_output=True, text=True, env=env, cwd=ROOT, timeout=120
    )
    assert json.loads(done.stdout) == {
        "PREFECT_API_DATABASE_CONNECTION_URL": "sqlite+aiosqlite:///:memory:",
        "PREFECT_SERVER_SERVICES_EVENT_PERSISTER_ENABLED": "false",
    }
