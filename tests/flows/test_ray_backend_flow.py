"""The `grpo` flow on the Ray backend, against a real local Ray cluster (the `ray_cluster` fixture in
tests/conftest.py: `ray start --head` on the loopback address, 2 CPUs, stopped at the end).

The tiny preset's run on Ray is the reference: it must learn, and a run whose rollout engine and
then actor are killed with SIGKILL mid-run, and a run killed whole and resumed, must both end
with its weights at their last step (20 of its 50), bit for bit. With rollout_engine='vllm' (an
engine process of the vLLM environment per rollout actor) a short run whose engine process and
then rollout actor are killed ends with the weights of the same run unbroken, and leaves no engine
process behind.
"""

import os
import signal
import sys
import time
from collections import Counter

import pyarrow as pa
import pyarrow.compute as pc
import pytest
import torch
from safetensors.torch import load_file

from grpo_flow.flows.grpo import grpo
from grpo_flow.schemas.presets import preset_config
from grpo_flow.workers.state.lock import pid_alive
from grpo_flow.workers.state.storage import RunStorage
from train_cli import train_cli as cli, assert_same_weights  # tests/flows/train_cli.py

# The tiny preset on 2 CPUs: the actor gets one, the two rollout engines half of one each.
RAY = dict(backend="ray", ray_actor_cpus=1.0, ray_rollout_cpus=0.5)
RAY_CLI = ["--backend", "ray", "--ray-actor-cpus", "1", "--ray-rollout-cpus", "0.5"]
# The killed runs stop at step 20, where the unbroken run has a checkpoint too (one every 10 steps): the
# tiny preset's learning rate is constant and each step's prompts depend on (seed, step) only, so a run's
# first 20 steps do not depend on its length. A kill needs a checkpoint before it and steps after it, no more.
SAVE_STEPS, SHORT = 10, 20


def ray_config(cluster, storage_root, run_id, **overrides):
    fields = {**RAY, **overrides}
    return preset_config("tiny", run_id=run_id, storage_root=str(storage_root), ray_address=cluster.address, **fields)


def final_weights(storage: RunStorage, step: int = 50) -> dict[str, torch.Tensor]:
    storage.verify_checkpoint(step)
    return load_file(storage.checkpoint_dir(step) / "model" / "model.safetensors")


def first_steps(rows: pa.Table, steps: int) -> pa.Table:
    """The rows of steps 1 to `steps`, in their order."""
    return rows.filter(pc.less_equal(rows["step"], steps))


@pytest.fixture(scope="module")
def unbroken(prefect_server, storage_root, ray_cluster):
    summary = grpo(ray_config(ray_cluster, storage_root, "ray-unbroken", save_steps=SAVE_STEPS))
    return summary, RunStorage(storage_root, "ray-unbroken")


@pytest.mark.ray
@pytest.mark.slow
def test_the_tiny_preset_learns_on_ray_actors(unbroken, ray_cluster):
    summary, storage = unbroken
    assert summary["status"] == "completed" and summary["steps_completed"] == 50
    gain = summary["final_eval_accuracy"] - summary["initial_eval_accuracy"]
    assert gain >= 0.3, summary
    rows = storage.read_metrics().to_pylist()
    assert all(r["synced_version"] == r["step"] and r["sync/bytes"] > 0 for r in rows)
    assert set(storage.read_rollouts(columns=["worker_id"]).column("worker_id").to_pylist()) == {
        "rollout-0",
        "rollout-1",
    }
    assert not ray_cluster.named_actors("grpo-flow/ray-unbroken/")  # the run's end stopped its Ray actors
    assert not (storage.run_dir / "weights").exists()  # reload: weights went through the object store, no files


@pytest.mark.ray
@pytest.mark.slow
def test_an_engine_and_then_the_actor_killed_mid_run_heal_and_the_run_ends_with_the_unbroken_weights(
    unbroken, ray_cluster, storage_root, monkeypatch
):
    """SIGKILL rollout-1's process as it is asked to generate step 5, and the actor's while it takes step
    15: Ray restarts each process, the backend restores what it must hold (the published weights from the
    object store; checkpoint 10 plus the logged steps 11-14), and the step goes on."""
    from grpo_flow.workers.backends import ray_backend

    calls: Counter = Counter()
    kill_at = {("rollout-1", "generate"): 5, ("actor", "step"): 15}
    killed: list[tuple[str, int]] = []
    original = ray_backend.RayHandle.call

    def call(self, method, *args):
        calls[(self.name, method)] += 1
        if kill_at.get((self.name, method)) == calls[(self.name, method)]:
            pid = original(self, "ready")["pid"]  # the worker's own answer (the dashboard's state API is off in tests)
            if self.name == "actor":  # a step lasts long enough to be killed while the call is in flight
                ref = getattr(self.handle, method).remote(*args)
                os.kill(pid, signal.SIGKILL)
            else:  # a tiny model's generate can answer before a signal lands: killed, gone, then asked
                os.kill(pid, signal.SIGKILL)
                deadline = time.monotonic() + 30
                while pid_alive(pid) and time.monotonic() < deadline:  # a zombie counts as gone
                    time.sleep(0.05)
                ref = getattr(self.handle, method).remote(*args)
            killed.append((self.name, pid))
            return self.ray.get(ref)
        return original(self, method, *args)

    monkeypatch.setattr(ray_backend.RayHandle, "call", call)
    summary = grpo(ray_config(ray_cluster, storage_root, "ray-killed", save_steps=SAVE_STEPS, max_steps=SHORT))

    assert summary["status"] == "completed" and [name for name, _ in killed] == ["rollout-1", "actor"]
    for _, pid in killed:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    # The engine took the published weights again; the actor restored checkpoint 10 and replayed 11-14.
    assert calls[("rollout-1", "load_weights")] >= 1 and calls[("rollout-1", "generate")] >= SHORT + 1
    assert calls[("actor", "restore")] >= 1 and calls[("actor", "step")] >= SHORT + 1 + 4
    storage = RunStorage(storage_root, "ray-killed")
    assert storage.logged_steps() == list(range(1, SHORT + 1))
    assert_same_weights(final_weights(storage, SHORT), final_weights(unbroken[1], SHORT))
    ours = storage.read_rollouts(columns=["step", "completion", "advantage"])
    assert ours.equals(first_steps(unbroken[1].read_rollouts(columns=["step", "completion", "advantage"]), SHORT))


# -- vLLM engines on Ray actors -------------------------------------------------------------------------------
VLLM_RUN = dict(
    rollout_engine="vllm",
    num_rollout_workers=1,
    ray_rollout_cpus=1.0,
    prompts_per_step=8,
    num_generations=4,
    max_steps=5,
    save_steps=2,
    eval_prompts=0,
)


def vllm_engines(cluster) -> list[int]:
    """Live vLLM engine processes (`-m grpo_flow.workers.rollout.vllm_server`) of the test cluster: they inherit its
    marker from the Ray worker that started them, so other sessions' engines on this machine are not counted."""
    found = []
    for pid in cluster.processes():
        try:
            cmdline = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
        except OSError:
            continue
        if b"grpo_flow.workers.rollout.vllm_server" in cmdline:
            found.append(pid)
    return found


def gone(pid: int, wait_s: float = 10.0) -> bool:
    """The process ended within `wait_s` (an engine's parent watch polls every 0.5 s)."""
    import time

    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            return True
        if state == "Z":  # ended, not reaped yet by whoever adopted it
            return True
        time.sleep(0.2)
    return False


@pytest.mark.ray
@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_engines_on_ray_actors_generate_and_heal_when_the_engine_or_its_actor_is_killed(
    prefect_server, ray_cluster, storage_root, monkeypatch
):
    """rollout_engine='vllm' on the Ray backend: the rollout actor's engine is a vLLM engine process of the
    vLLM environment. SIGKILL that engine process while it generates step 2 (the actor sees its engine die,
    the backend starts another and loads the published weights), then the rollout actor's own process while
    it generates step 4 (Ray restarts it; the engine process it started ends itself): the run completes,
    with the same final weights as an unbroken run of the same seed, and no engine process outlives it.
    The unbroken run syncs through Ray's object store (`reload`), the killed one through versioned files on
    the storage root (`volume`): both reach the vLLM engine, with the same weights."""
    from grpo_flow.workers.backends import ray_backend

    unbroken = grpo(ray_config(ray_cluster, storage_root, "ray-vllm-unbroken", **VLLM_RUN))
    assert unbroken["status"] == "completed"

    calls: Counter = Counter()
    answers: list[dict] = []
    killed: list[int] = []
    original = ray_backend.RayHandle.call

    def call(self, method, *args):
        calls[(self.name, method)] += 1
        kill = {2: "engine_pid", 4: "pid"}.get(calls[(self.name, method)]) if method == "generate" else None
        if kill is None:
            return original(self, method, *args)
        answers.append(original(self, "ready"))  # the worker's own answer: its process, its engine's process
        ref = getattr(self.handle, method).remote(*args)
        os.kill(answers[-1][kill], signal.SIGKILL)  # while the call is in flight
        killed.append(answers[-1][kill])
        return self.ray.get(ref)

    monkeypatch.setattr(ray_backend.RayHandle, "call", call)
    summary = grpo(ray_config(ray_cluster, storage_root, "ray-vllm-killed", weight_sync_method="volume", **VLLM_RUN))

    assert summary["status"] == "completed" and summary["steps_completed"] == 5
    # The rollouts came from vLLM engines in processes of their own, a new one after each kill.
    assert [a["engine"] for a in answers] == ["VLLMProcessEngine"] * 2
    engine_pids = [a["engine_pid"] for a in answers]
    assert None not in engine_pids and engine_pids[0] != engine_pids[1]
    storage = RunStorage(storage_root, "ray-vllm-killed")
    log = (storage.run_dir / "logs" / "rollout-0.log").read_text()
    assert log.count("Initializing a V1 LLM engine") == 3  # the first engine, one after each kill
    assert calls[("rollout-0", "load_weights")] >= 2  # each new engine took the published weights
    assert storage.logged_steps() == list(range(1, 6))
    unbroken_storage = RunStorage(storage_root, "ray-vllm-unbroken")
    assert not (unbroken_storage.run_dir / "weights").exists()  # reload: the object store, no files
    assert sorted(p.name for p in (storage.run_dir / "weights").glob("v*")) == [f"v{v:06d}" for v in range(1, 6)]
    assert_same_weights(final_weights(storage, 5), final_weights(unbroken_storage, 5))
    # Neither the killed engine, nor the one whose actor process was killed, nor the run's last one lives on.
    assert all(gone(pid) for pid in [*killed, *engine_pids])
    assert not vllm_engines(ray_cluster)


@pytest.mark.ray
@pytest.mark.slow
def test_a_run_killed_whole_resumes_on_the_cluster_to_the_unbroken_weights(unbroken, ray_cluster, storage_root):
    """The `grpo train` process (the Ray driver) SIGKILLs itself before the actor takes step 15; Ray ends
    the actors it owned; `grpo train --resume` starts new ones, restores checkpoint 10, replays the logged
    steps 11-15 and goes on."""
    killed = cli(
        storage_root,
        "ray-resumed",
        "--preset",
        "tiny",
        *RAY_CLI,
        "--ray-address",
        ray_cluster.address,
        "--save-steps",
        str(SAVE_STEPS),
        "--max-steps",
        str(SHORT),
        fail_at="actor@15:kill",
    )
    assert killed.returncode == -9, killed.stderr[-3000:]
    storage = RunStorage(storage_root, "ray-resumed")
    assert storage.latest_valid_checkpoint() == 10 and storage.rollout_steps()[-1] == 15
    resumed = cli(storage_root, "ray-resumed", "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming run" in resumed.stdout
    assert_same_weights(final_weights(storage, SHORT), final_weights(unbroken[1], SHORT))
    assert not ray_cluster.named_actors("grpo-flow/ray-resumed/")  # the killed driver's actors went with it


# -- bad input: refused before anything starts, exit 2 -------------------------------------------------
def unused_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize("source", ["--ray-address", "RAY_ADDRESS"])
def test_no_cluster_at_the_address_is_refused_naming_it(tmp_path, monkeypatch, capsys, source):
    from grpo_flow.flows.cli import main

    address = f"127.0.0.1:{unused_port()}"
    argv = ["train", "--backend", "ray", "--storage-root", str(tmp_path / "store")]
    if source == "RAY_ADDRESS":
        monkeypatch.setenv("RAY_ADDRESS", address)
    else:
        argv += ["--ray-address", address]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"no Ray cluster at {address}" in err and ("ray_address" if source == "--ray-address" else source) in err
    assert "ray start --head" in err
    assert not (tmp_path / "store").exists()


@pytest.mark.ray
def test_more_gpus_than_the_cluster_has_are_refused_naming_the_resource(ray_cluster, tmp_path, capsys):
    from grpo_flow.flows.cli import main

    argv = ["train", *RAY_CLI, "--ray-address", ray_cluster.address, "--storage-root", str(tmp_path / "s")]
    assert main([*argv, "--ray-rollout-gpus", "1"]) == 2
    err = capsys.readouterr().err
    assert "ray_actor_gpus/ray_rollout_gpus: the run asks for 2 GPU" in err and "has 0 GPU in all" in err
    assert main([*argv, "--ray-actor-cpus", "3", "--ray-rollout-cpus", "0.5"]) == 2
    assert "has 2 CPU in all" in capsys.readouterr().err
    assert not (tmp_path / "s").exists()


@pytest.mark.ray
def test_vllm_engines_without_vllm_on_the_nodes_are_refused_naming_the_field(ray_cluster, tmp_path, capsys):
    """Each node that can hold a rollout engine is asked (a task on it) before anything starts; sleep mode
    is refused when the engines get no GPU."""
    from grpo_flow.flows.cli import main

    python = tmp_path / "none" / "bin" / "python"
    argv = ["train", *RAY_CLI, "--ray-address", ray_cluster.address, "--storage-root", str(tmp_path / "s")]
    assert main([*argv, "--rollout-engine", "vllm", "--vllm-python", str(python)]) == 2
    err = capsys.readouterr().err
    assert f"vllm_python: no vLLM environment at {python} on " in err and "every node" in err
    assert "grpo setup-vllm" in err and "vLLM installed in the workers' environment" in err
    assert main([*argv, "--rollout-engine", "vllm", "--vllm-enable-sleep-mode", "true"]) == 2
    assert "vllm_enable_sleep_mode: vLLM's sleep mode needs a CUDA GPU" in capsys.readouterr().err
    assert not (tmp_path / "s").exists()


def test_without_ray_installed_the_backend_names_the_install_command(tmp_path, monkeypatch, capsys):
    from grpo_flow.flows.cli import main

    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    assert main(["train", "--backend", "ray", "--storage-root", str(tmp_path / "store")]) == 2
    assert 'pip install -e ".[ray]"' in capsys.readouterr().err
    assert not (tmp_path / "store").exists()
