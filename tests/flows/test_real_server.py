"""With PREFECT_API_URL set, a run is recorded by that server (a local `prefect server start`)."""

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from unittest import mock

import httpx
import pytest

pytestmark = pytest.mark.slow  # every test here talks to a `prefect server start` of its own


@contextlib.contextmanager
def running_prefect_server(home, database_url=None):
    """`prefect server start` on a free local port with its own home and database (a SQLite file
    in `home` unless `database_url` says otherwise); yields its API URL."""
    from grpo_flow.deployments.local_server import prefect_server

    # A deployment run held by its concurrency limit (evaluate/checkpoint's) is tried again after 2 s, not 30.
    quick_slots = {"PREFECT_SERVER_DEPLOYMENTS_CONCURRENCY_SLOT_WAIT_SECONDS": "2"}
    with (
        mock.patch.dict(os.environ, quick_slots),
        prefect_server(home, database_url, log=os.path.join(home, "server.log")) as url,
    ):
        yield url


@pytest.fixture(scope="module")
def real_server(tmp_path_factory):
    """One `prefect server start` for this module's tests (starting one costs ~15 s)."""
    with running_prefect_server(tmp_path_factory.mktemp("real-server-home")) as url:
        yield url


@pytest.fixture(scope="module")
def tiny_model(storage_root) -> str:
    """The session's tiny model (built once); each test's runs and storage root are its own."""
    from grpo_flow.workers.data.tiny_model import ensure_tiny_model

    return str(ensure_tiny_model(storage_root))


def client_env(url: str, home) -> dict[str, str]:
    return {
        **os.environ,
        "PREFECT_API_URL": url,
        "PREFECT_HOME": str(home),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    }


def train_on_server(url: str, model: str, tmp_path, run_id: str) -> None:
    """`grpo train` of two tiny steps, recorded by the server at `url`."""
    argv = ["train", "--model", model, "--max-steps", "2", "--prompts-per-step", "8", "--num-generations", "4"]
    argv += ["--run-id", run_id, "--eval-prompts", "8", "--storage-root", str(tmp_path / "store"), "--no-progress"]
    done = subprocess.run(
        [sys.executable, "-m", "grpo_flow.flows.cli", *argv],
        env=client_env(url, tmp_path / "client-home"),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]


def test_a_run_is_recorded_by_the_server_in_prefect_api_url(real_server, tiny_model, tmp_path):
    train_on_server(real_server, tiny_model, tmp_path, "on-server")
    names = ["on-server", "on-server-step-1", "on-server-step-2"]
    runs = httpx.post(
        f"{real_server}/flow_runs/filter", json={"flow_runs": {"name": {"any_": names}}}, timeout=10
    ).json()
    by_name = {run["name"]: run for run in runs}
    assert set(names) == set(by_name)
    assert all(by_name[name]["state_type"] == "COMPLETED" for name in names)
    assert by_name["on-server-step-1"]["parent_task_run_id"] is not None  # a subflow of the run
    # Quiet on the terminal, yet the run's log tab has its one line per step.
    step_lines = [
        line for line in flow_run_log(real_server, by_name["on-server"]["id"], until="step 2/2") if ": step " in line
    ]
    assert [line.split()[2] for line in step_lines] == ["1/2", "2/2"]


def page_text(url: str) -> str:
    """The text of a Prefect UI page as headless Chromium renders it. The window is tall because the UI
    renders a list's rows only once they are on screen; the virtual-time budget lets its requests end."""
    rendered = subprocess.run(
        ["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=30000"]
        + ["--window-size=1400,3000", "--dump-dom", url],
        capture_output=True,
        text=True,
        timeout=180,
    )
    html = re.sub(r"<script.*?</script>|<style.*?</style>", " ", rendered.stdout, flags=re.S)
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", html))


# -- deployments on a real server: `grpo serve`, `prefect deployment run`, a process work pool ---------
GRPO_DEPLOYMENTS = {"grpo/tiny", "grpo/smol-math", "grpo/gsm8k", "grpo/math", "grpo/mbpp", "evaluate/nightly"}
GRPO_DEPLOYMENTS |= {"evaluate/checkpoint"}


@contextlib.contextmanager
def prefect_client(url: str):
    """A client of the server at `url`, whatever Prefect settings the test session has."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(updates={PREFECT_API_URL: url}), get_client(sync_client=True) as client:
        yield client


def served_deployments(url: str) -> set[str]:
    """The deployments a runner has polled for scheduled runs (the server sets `last_polled` then)."""
    with prefect_client(url) as client:
        flows = {f.id: f.name for f in client.read_flows()}
        return {f"{flows[d.flow_id]}/{d.name}" for d in client.read_deployments() if d.last_polled is not None}


def wait_for_deployments(url: str, serve: subprocess.Popen, log_path) -> None:
    """Until `grpo serve`'s runner polls every grpo deployment (it must stay up; 120 s at most). Registered is
    not enough: the deployments exist before its runner starts, and a Ctrl-C then ends it before any pause."""
    deadline = time.monotonic() + 120
    while not GRPO_DEPLOYMENTS <= served_deployments(url):
        assert serve.poll() is None, Path(log_path).read_text()[-3000:]
        assert time.monotonic() < deadline, "grpo serve polled for no deployments within 120 s"
        time.sleep(1)


def start_deployment_run(env: dict[str, str], name: str, *params: str) -> subprocess.Popen:
    """`prefect deployment run NAME --param k=v ... --watch`, as a user types it: exit 0 when Completed."""
    argv = [sys.executable, "-m", "prefect", "deployment", "run", name]
    for param in params:
        argv += ["--param", param]
    argv += ["--watch", "--watch-interval", "2", "--watch-timeout", "300"]
    return subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for_run(process: subprocess.Popen) -> subprocess.CompletedProcess:
    stdout, stderr = process.communicate(timeout=400)
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


def deployment_run(env: dict[str, str], name: str, *params: str) -> subprocess.CompletedProcess:
    return wait_for_run(start_deployment_run(env, name, *params))


def artifacts(url: str, key: str) -> list:
    """Every version of an artifact key, oldest first."""
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    with prefect_client(url) as client:
        found = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])))
    assert found, f"no artifact {key!r} on the server"
    return sorted(found, key=lambda a: a.created)


def artifact(url: str, key: str):
    """The newest version of an artifact key."""
    return artifacts(url, key)[-1]


def artifact_steps(url: str, key: str) -> list[int]:
    """The step of each version of a run's step artifact (its heading: "## Run `ID`, step N")."""
    return [int(re.search(r"^## Run `[^`]+`, step (\d+)$", a.data, re.M).group(1)) for a in artifacts(url, key)]


def step_flow_runs(url: str, run_id: str, steps: int) -> list[tuple[str, str]]:
    """(name, state) of the run's `grpo-step` subflow runs, in the order they started."""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName

    names = [f"{run_id}-step-{step}" for step in range(1, steps + 1)]
    with prefect_client(url) as client:
        runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=names)))
    return [(r.name, r.state.type.value) for r in sorted(runs, key=lambda r: r.start_time or r.created)]


def run_events(url: str, run_id: str, until: str = "grpo.run.finished", timeout_s: float = 60.0) -> list:
    """The run's `grpo.*` events, oldest first, once `until` is among them (the server stores events in
    the background, so they may come a moment after the flow run ends)."""
    from prefect.events.filters import EventFilter, EventOrder, EventResourceFilter

    query = EventFilter(resource=EventResourceFilter(id=[f"grpo.run.{run_id}"]), order=EventOrder.ASC)
    deadline = time.monotonic() + timeout_s
    while True:
        with prefect_client(url) as client:
            found = client.read_events(query, limit=50).events
        if any(e.event == until for e in found) or time.monotonic() > deadline:
            return found
        time.sleep(1)


def related_ids(event, role: str) -> list[str]:
    return [r.id for r in event.related if r.role == role]


def completed_runs_of(url: str, deployment_id, names: set[str], timeout_s: float = 300.0) -> set[str]:
    """The names among `names` of the deployment's completed flow runs, once all are (or at the deadline)."""
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId

    deadline = time.monotonic() + timeout_s
    while True:
        with prefect_client(url) as client:
            runs = client.read_flow_runs(
                deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[deployment_id]))
            )
        done = {run.name for run in runs if run.state.is_completed()} & names
        if done == names or time.monotonic() > deadline:
            return done
        time.sleep(2)


def flow_run_log(url: str, flow_run_id, until: str, timeout_s: float = 30.0) -> list[str]:
    """The messages of a flow run's log tab (its own and its task runs' lines), once a line has `until` (a
    flow run's process sends its log lines in batches, the last ones as it exits: after its final state)."""
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    deadline = time.monotonic() + timeout_s
    while True:
        with prefect_client(url) as client:
            logs = client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])))
        messages = [log.message for log in sorted(logs, key=lambda log: log.timestamp)]
        if any(until in message for message in messages) or time.monotonic() > deadline:
            return messages
        time.sleep(1)


def stop(process: subprocess.Popen) -> None:
    """SIGTERM to the process group (Prefect shuts the runner down on it), SIGKILL if it lingers."""
    try:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=10)
    except ProcessLookupError:
        pass


def test_served_deployments_run_fail_resume_and_evaluate_nightly(real_server, tiny_model, tmp_path):
    """`grpo serve`, then `prefect deployment run` as a user types it: a run, a run failed at step 2
    on purpose and resumed there, the nightly evaluation by hand; checked on disk and through the API."""
    from grpo_flow.flows.evaluate import read_eval_summary
    from grpo_flow.workers.state.storage import RunStorage, eval_metric_names

    url, store = real_server, tmp_path / "store"
    env = client_env(url, tmp_path / "client-home")
    log = open(tmp_path / "serve.log", "w")
    serve = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "grpo_flow.flows.cli",
            "serve",
            "--storage-root",
            str(store),
            "--timezone",
            "Europe/Berlin",
            "--eval-k",
            "4",
            "--eval-prompts",
            "16",
            "--no-auto-resume",  # the failed run below is resumed by hand (test_automations.py: by the automation)
        ],
        # The runner looks for scheduled work every 10 s by default; every 2 s here.
        env={**env, "PREFECT_RUNNER_POLL_FREQUENCY": "2"},
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        wait_for_deployments(url, serve, tmp_path / "serve.log")
        with prefect_client(url) as client:
            tiny = client.read_deployment_by_name("grpo/tiny")

        # A run from the tiny preset, overridden field by field; started with another that fails at step 2 on
        # purpose (below), which grpo serve's grpo-gpu limit (one slot) runs before or after it, never beside.
        small = [f"model={tiny_model}", "max_steps=3", "prompts_per_step=8", "num_generations=4", "eval_prompts=0"]
        failing = ["run_id=dep-resume", "save_steps=1", "score_retries=0", "fail_at=score@2"]
        failing_run = start_deployment_run(env, "grpo/tiny", *small, *failing)
        done = deployment_run(env, "grpo/tiny", *small, "run_id=dep-run")
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        storage = RunStorage(store, "dep-run")  # the storage root `grpo serve` gave its deployments
        assert storage.read_metrics()["step"].to_pylist() == [1, 2, 3]
        rollouts = storage.read_rollouts()
        assert rollouts.num_rows == 3 * 8 * 4 and sorted(set(rollouts["step"].to_pylist())) == [1, 2, 3]
        assert storage.read_config()["learning_rate"] == 5e-3  # the rest is the tiny preset's
        summary = artifact(url, "grpo-summary-dep-run")
        assert summary.type == "markdown" and '"status": "completed"' in summary.data
        with prefect_client(url) as client:
            flow_run = client.read_flow_run(summary.flow_run_id)
        assert flow_run.name == "dep-run" and flow_run.deployment_id == tiny.id
        assert flow_run.state.is_completed()
        # Per step a markdown artifact with its metrics and three completions; a progress artifact.
        steps = artifacts(url, "grpo-step-dep-run")
        assert artifact_steps(url, "grpo-step-dep-run") == [1, 2, 3] and {a.type for a in steps} == {"markdown"}
        assert all(a.data.count("Completion:") == 3 and "| reward |" in a.data for a in steps)
        reward = storage.read_metrics()["reward"].to_pylist()[-1]
        assert f"| reward | {reward:.6g} |" in steps[-1].data
        progress = artifact(url, "grpo-progress-dep-run")
        assert progress.type == "progress" and float(progress.data) == 100.0 and progress.description == "step 3 / 3"
        # Its events, in order, about the run, related to its flow run and deployment; step payloads are
        # the metrics rows, the checkpoint's payload names it (tiny saves every 20 steps, and at the last).
        events = run_events(url, "dep-run")
        steps = ["grpo.step.completed"] * 3
        assert [e.event for e in events] == ["grpo.run.started", *steps, "grpo.checkpoint.saved", "grpo.run.finished"]
        assert all(related_ids(e, "flow-run") == [f"prefect.flow-run.{flow_run.id}"] for e in events)
        assert all(related_ids(e, "deployment") == [f"prefect.deployment.{tiny.id}"] for e in events)
        metrics = storage.read_metrics().to_pylist()
        assert [e.payload for e in events if e.event == "grpo.step.completed"] == metrics
        assert [e.resource["grpo.reward.finite"] for e in events if e.event == "grpo.step.completed"] == ["true"] * 3
        saved = [e.payload for e in events if e.event == "grpo.checkpoint.saved"]
        path, root = str(storage.checkpoint_dir(3)), str(store.absolute())
        assert saved == [{"step": 3, "path": path, "policy_version": 3, "run_id": "dep-run", "storage_root": root}]
        assert storage.checkpoint_committed(3)
        assert events[0].payload["total_steps"] == 3 and events[-1].payload["status"] == "completed"
        # Its log tab: one line per step with the step's numbers, no "Finished in state Completed()".
        run_log = flow_run_log(url, flow_run.id, until="step 3/3")
        step_lines = [line for line in run_log if line.startswith("dep-run: step ")]
        assert [line.split()[2] for line in step_lines] == ["1/3", "2/3", "3/3"], run_log
        for line, row in zip(step_lines, metrics, strict=True):
            assert f"reward {row['reward']:.3f}" in line and line.endswith(f"  {row['step_s']:.2f} s")
            assert f"last_digit {row['rewards/last_digit/mean']:.3f}" in line
        finished = [line for line in run_log if line.startswith("Finished in state")]
        assert finished == ["Finished in state Completed()"], run_log  # the run's own, once

        # The run that failed at step 2 on purpose, then the same deployment with its run id resumes it.
        done = wait_for_run(failing_run)
        assert done.returncode == 1 and "Failed" in done.stdout, done.stdout[-3000:]
        resumed = RunStorage(store, "dep-resume")
        assert resumed.read_summary()["status"] == "failed" and resumed.read_summary()["failed_step"] == 2
        failed = run_events(url, "dep-resume", until="grpo.run.failed")
        assert [e.event for e in failed][-1] == "grpo.run.failed" and failed[-1].payload["failed_step"] == 2
        # One slot: one run's loop from start to end, then the other's.
        first, second = sorted([(events[0].occurred, events[-1].occurred), (failed[0].occurred, failed[-1].occurred)])
        assert first[1] <= second[0], (first, second)
        with prefect_client(url) as client:
            gpu = client.read_global_concurrency_limit_by_name("grpo-gpu")
        assert (gpu.limit, gpu.active_slots) == (1, 0)
        assert resumed.logged_steps() == [1]
        done = deployment_run(env, "grpo/tiny", "run_id=dep-resume")
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        final = resumed.read_summary()
        assert final["status"] == "completed" and final["resumed_from_step"] == 1 and final["steps_completed"] == 3
        assert [p.name for p in (resumed.run_dir / "resumes").iterdir()] == ["resume-001.json"]
        assert resumed.logged_steps() == [1, 2, 3] and resumed.read_rollouts().num_rows == 3 * 8 * 4
        # Step 1 ran once; the second flow run started at step 2.
        assert step_flow_runs(url, "dep-resume", 3) == [
            ("dep-resume-step-1", "COMPLETED"),
            ("dep-resume-step-2", "FAILED"),
            ("dep-resume-step-2", "COMPLETED"),
            ("dep-resume-step-3", "COMPLETED"),
        ]
        assert artifact_steps(url, "grpo-step-dep-resume") == [1, 2, 3]
        first, second = artifacts(url, "grpo-progress-dep-resume")  # one per flow run
        assert (first.description, second.description) == ("step 1 / 3", "step 3 / 3")
        with prefect_client(url) as client:
            runs = [client.read_flow_run(a.flow_run_id) for a in artifacts(url, "grpo-summary-dep-resume")]
        assert [(r.name, r.state.type.value, r.deployment_id) for r in runs] == [
            ("dep-resume", "FAILED", tiny.id),
            ("dep-resume", "COMPLETED", tiny.id),
        ]

        # The nightly evaluation: registered on its cron in its time zone; run once by hand.
        with prefect_client(url) as client:
            nightly = client.read_deployment_by_name("evaluate/nightly")
            (schedule,) = client.read_deployment_schedules(nightly.id)
        assert (schedule.schedule.cron, schedule.schedule.timezone, schedule.active, nightly.paused) == (
            "0 2 * * *",
            "Europe/Berlin",
            True,
            False,
        )
        # evaluate/checkpoint, started by the server for each grpo.checkpoint.saved: every checkpoint scored.
        with prefect_client(url) as client:
            on_checkpoint = client.read_deployment_by_name("evaluate/checkpoint")
        wanted = {"eval-dep-run-step-3", "eval-dep-resume-step-1", "eval-dep-resume-step-2", "eval-dep-resume-step-3"}
        assert completed_runs_of(url, on_checkpoint.id, wanted) == wanted
        for run_id in ("dep-run", "dep-resume"):
            evaluated = read_eval_summary(RunStorage(store, run_id).eval_path(3))
            assert evaluated["samples_per_prompt"] == 4 and evaluated["num_prompts"] == 16
            assert 0.0 <= evaluated["pass@1"] <= evaluated["pass@4"] <= 1.0
            tables = artifacts(url, f"eval-{run_id}")
            assert {t.type for t in tables} == {"table"} and any('"checkpoint_step": 3' in t.data for t in tables)
        # The same scores as `grpo eval` of that checkpoint with the same k and prompts.
        served = read_eval_summary(RunStorage(store, "dep-run").eval_path(3))
        argv = ["eval", "dep-run", "--checkpoint", "3", "--k", "4", "--prompts", "16", "--force"]
        again = subprocess.run(
            [sys.executable, "-m", "grpo_flow.flows.cli", *argv, "--storage-root", str(store)],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert again.returncode == 0, again.stderr[-3000:]
        by_hand = read_eval_summary(RunStorage(store, "dep-run").eval_path(3))
        assert {m: by_hand[m] for m in eval_metric_names(served)} == {m: served[m] for m in eval_metric_names(served)}
        # The nightly sweep, by hand: both runs' newest checkpoints are scored already.
        done = deployment_run(env, "evaluate/nightly", "prompts=16")
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        nightly_table = artifact(url, "evaluate-nightly").data
        assert nightly_table.count('"action": "skipped"') == 2 and "not newer than its last evaluation" in nightly_table
    finally:
        stop(serve)
        log.close()
    assert serve.returncode is not None  # `grpo serve` and the flow runs it started are gone


def test_deployments_on_a_process_work_pool_run_on_a_worker(real_server, tmp_path):
    url, store = real_server, tmp_path / "store"
    env = client_env(url, tmp_path / "client-home")
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "grpo_flow.deployments.work_pool",
            "--pool",
            "grpo-test-pool",
            "--storage-root",
            str(store),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    with prefect_client(url) as client:
        assert client.read_work_pool("grpo-test-pool").type == "process"
        flows = {f.id: f.name for f in client.read_flows()}
        pooled = {f"{flows[d.flow_id]}/{d.name}": d for d in client.read_deployments()}
        assert GRPO_DEPLOYMENTS <= set(pooled)
        assert all(pooled[name].work_pool_name == "grpo-test-pool" for name in GRPO_DEPLOYMENTS)
        run = client.create_flow_run_from_deployment(pooled["evaluate/nightly"].id)
    # A process worker picks the run up once, runs it from the module entrypoint, and exits.
    worker = subprocess.Popen(
        [sys.executable, "-m", "prefect", "worker", "start", "--pool", "grpo-test-pool", "--run-once"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = worker.communicate(timeout=300)
    finally:
        stop(worker)
    with prefect_client(url) as client:
        state = client.read_flow_run(run.id).state
    assert state.is_completed(), output[-3000:]


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_serve_stops_promptly_once_its_server_is_gone(tmp_path, signum):
    """With the server gone, Prefect's pause of the schedules at shutdown retried for minutes; `grpo serve`
    now gives it a few seconds, says the schedules may still be active, and ends."""
    with running_prefect_server(tmp_path / "gone-home") as url:
        env = client_env(url, tmp_path / "client-home")
        log = open(tmp_path / "serve.log", "w")
        serve = subprocess.Popen(
            [sys.executable, "-m", "grpo_flow.flows.cli", "serve", "--storage-root", str(tmp_path / "store")],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        wait_for_deployments(url, serve, tmp_path / "serve.log")
    try:  # the server is stopped now
        serve.send_signal(signum)
        serve.wait(timeout=60)  # its grace is 20 s
    finally:
        stop(serve)
        log.close()
    output = (tmp_path / "serve.log").read_text()
    if signum == signal.SIGINT:  # Prefect pauses the schedules on Ctrl-C (its SIGTERM handler skips it)
        assert "schedules may still be active" in output, output[-3000:]
    # Prefect's SIGTERM handler drops the coroutine of its own stop (deployments/serve.py handle_sigterm).
    assert "never awaited" not in output and "tracemalloc" not in output, output[-3000:]
