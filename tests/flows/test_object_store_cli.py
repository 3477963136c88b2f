"""A run whose storage root is an S3 URL, from the command line, against a real S3 API on loopback (moto's
server, tests/conftest.py): trained, killed and resumed, read back by every `grpo` command and by pandas,
guarded by its lock object, with nothing written to a local folder named after the URL."""

import os
import subprocess
import sys
import time

import pandas as pd
import pytest
import s3fs

from grpo_flow.workers.state.lock import RunLock
from grpo_flow.workers.state.storage import RunStorage
from train_cli import assert_same_weights, cli_env, final_weights, train_argv  # tests/flows/train_cli.py

pytestmark = pytest.mark.slow

SMALL = ["--prompts-per-step=8", "--num-generations=4", "--num-rollout-workers=2", "--eval-prompts=0"]
RUN = ["--preset", "tiny", "--max-steps", "5", "--save-steps", "2", "--save-total-limit", "2", *SMALL]


def train(root: str, run_id: str, *args: str, cwd, fail_at: str | None = None) -> subprocess.CompletedProcess:
    argv = train_argv(root, run_id, *args)
    return subprocess.run(argv, capture_output=True, text=True, env=cli_env(fail_at), cwd=cwd, timeout=900)


def bucket() -> s3fs.S3FileSystem:
    """The S3 server's file system as this process sees it now (s3fs caches listings per instance)."""
    fs = s3fs.S3FileSystem()
    fs.invalidate_cache()
    return fs


def grpo_command(*argv: str, cwd) -> subprocess.CompletedProcess:
    """Any other `grpo` command, in its own process."""
    argv_ = [sys.executable, "-m", "grpo_flow.flows.cli", *argv]
    return subprocess.run(argv_, capture_output=True, text=True, env=cli_env(), cwd=cwd, timeout=300)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """The commands' working folder: a URL taken as a path would leave an `s3:` folder in it."""
    return tmp_path_factory.mktemp("cwd")


@pytest.fixture(scope="module")
def unbroken(prefect_server, s3_root, workdir):
    done = train(s3_root, "unbroken", *RUN, cwd=workdir)
    assert done.returncode == 0, done.stderr[-3000:]
    return RunStorage(s3_root, "unbroken")


def test_a_run_on_s3_keeps_every_file_in_the_bucket_and_none_in_a_local_folder(unbroken, s3_root, workdir):
    assert unbroken.rollout_steps() == [1, 2, 3, 4, 5]
    assert unbroken.logged_steps() == [1, 2, 3, 4, 5]
    assert unbroken.complete_checkpoints() == [4, 5]  # pruned on the bucket: the newest two
    assert unbroken.read_summary()["status"] == "completed"
    fs = bucket()
    keys = fs.find(s3_root.removeprefix("s3://") + "/runs/unbroken")
    assert not [key for key in keys if "writer.lock" in key or ".tmp" in key]  # released; no temporary names
    assert os.listdir(workdir) == []  # no `s3:` folder, no ./grpo-storage


def test_pandas_reads_the_rollouts_straight_from_the_bucket(unbroken, s3_root, s3_server):
    frame = pd.read_parquet(f"{s3_root}/runs/unbroken/rollouts", storage_options={"endpoint_url": s3_server})
    assert len(frame) == unbroken.read_rollouts().num_rows == 5 * 8 * 4
    assert sorted(frame["step"].unique()) == [1, 2, 3, 4, 5]


def test_duckdb_reads_the_rollouts_straight_from_the_bucket(unbroken, s3_root, s3_server):
    """Through the bucket's fsspec client registered with DuckDB (its httpfs extension is fetched from the
    network, which these machines lack), as docs/run-files.md shows."""
    import duckdb
    import s3fs

    connection = duckdb.connect()
    connection.register_filesystem(s3fs.S3FileSystem(endpoint_url=s3_server))
    query = f"select count(*), count(distinct step) from read_parquet('{s3_root}/runs/unbroken/rollouts/*/*.parquet')"
    assert connection.execute(query).fetchall() == [(unbroken.read_rollouts().num_rows, 5)]


def test_verify_rollouts_report_runs_and_eval_work_on_the_url(unbroken, s3_root, workdir, tmp_path):
    runs = grpo_command("runs", "--storage-root", s3_root, cwd=workdir)
    assert runs.returncode == 0 and "unbroken" in runs.stdout and "completed" in runs.stdout, runs.stderr
    verify = grpo_command("verify", "unbroken", "--storage-root", s3_root, cwd=workdir)
    assert verify.returncode == 0, verify.stderr
    assert "5 step(s) of rollouts" in verify.stdout and "2 checkpoint(s)" in verify.stdout
    rollouts = grpo_command(
        "rollouts", "unbroken", "--step", "3", "--limit", "2", "--storage-root", s3_root, cwd=workdir
    )
    assert rollouts.returncode == 0 and rollouts.stdout.strip(), rollouts.stderr
    report = grpo_command("report", "unbroken", "--storage-root", s3_root, cwd=workdir)
    assert report.returncode == 0, report.stderr
    assert bucket().exists(s3_root.removeprefix("s3://") + "/runs/unbroken/report.png")
    evaluated = grpo_command("eval", "unbroken", "--k", "2", "--prompts", "4", "--storage-root", s3_root, cwd=workdir)
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    assert unbroken.evaluated_steps() == [5]
    assert os.listdir(workdir) == []


def test_a_run_killed_mid_step_resumes_from_the_bucket_to_the_unbroken_runs_weights(unbroken, s3_root, workdir):
    killed = train(s3_root, "killed", *RUN, cwd=workdir, fail_at="generate@4:kill")
    assert killed.returncode == -9, killed.stderr[-3000:]
    storage = RunStorage(s3_root, "killed")
    assert storage.latest_valid_checkpoint() == 2
    resumed = train(s3_root, "killed", "--resume", cwd=workdir)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_same_weights(final_weights(storage, 5), final_weights(unbroken, 5))
    columns = ["step", "completion", "advantage"]
    assert storage.read_rollouts(columns=columns).equals(unbroken.read_rollouts(columns=columns))
    assert storage.uncommitted() == []


def test_a_second_writer_of_an_s3_run_is_refused_naming_the_first(unbroken, s3_root, workdir):
    with RunLock(unbroken.run_dir, command="a test holding the run"):
        started = time.perf_counter()
        refused = train(s3_root, "unbroken", "--resume", "--max-steps", "6", cwd=workdir)
        print(f"refused in {time.perf_counter() - started:.2f} s")  # benchmarks' figure, not asserted
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert f"pid {os.getpid()}" in refused.stderr and "a test holding the run" in refused.stderr
    assert unbroken.logged_steps() == [1, 2, 3, 4, 5]


def test_a_damaged_object_is_named_by_verify_and_moved_aside(unbroken, s3_root, workdir):
    fs = bucket()
    base = s3_root.removeprefix("s3://") + "/runs"
    for key in fs.find(f"{base}/unbroken"):
        fs.copy(key, key.replace("/unbroken/", "/damaged/", 1))
    shard = f"{base}/damaged/rollouts/step-000002/shard-01.parquet"
    fs.pipe_file(shard, fs.cat_file(shard)[:-100])  # truncated, as a copy cut short leaves it
    verify = grpo_command("verify", "damaged", "--storage-root", s3_root, cwd=workdir)
    assert verify.returncode == 1, verify.stderr
    assert "rollouts/step-000002/shard-01.parquet" in verify.stdout
    fs = bucket()
    assert not fs.exists(shard) and fs.ls(f"{base}/damaged/quarantine")
