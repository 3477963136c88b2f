"""A run whose actor is 2 ranks (actor_num_processes=2, the local backend, gloo on CPU) through the unchanged
flow: it completes, samples what the one-process run samples, and ends with its weights; and a run whose rank 1
is SIGKILLed mid-step heals (a new group, the logged steps replayed) and ends with the unbroken 2-rank run's."""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal

import pytest
import torch
from safetensors.torch import load_file

from grpo_flow.flows.grpo import grpo
from grpo_flow.schemas.presets import preset_config
from grpo_flow.workers.actor.sharded import ActorGroup
from grpo_flow.workers.backends import release
from grpo_flow.workers.state.storage import RunStorage
from grpo_flow.workers.actor.actor import OPTIMIZER_SHARDS_DIR
from linear_updates import assert_same_update, use_sgd  # tests/linear_updates.py
from train_cli import assert_same_weights, train_cli as cli  # tests/flows/train_cli.py
from train_cli import final_weights as final_weights_of

pytestmark = pytest.mark.slow  # ranks, each a process of its own, and whole runs

STEPS = 3


def run(storage_root, processes: int, name: str = "", **fields) -> RunStorage:
    config = preset_config(
        "tiny",
        run_id=f"actor-processes-{processes}{name}",
        storage_root=str(storage_root),
        max_steps=STEPS,
        prompts_per_step=4,
        num_generations=4,
        save_steps=STEPS,
        eval_prompts=0,
        actor_num_processes=processes,
        **fields,
    )
    try:
        assert grpo(config)["status"] == "completed"
    finally:
        release(config.run_id)  # the ranks end with the run's workers
    return RunStorage(storage_root, config.run_id)


def final_weights(storage: RunStorage) -> dict[str, torch.Tensor]:
    return load_file(storage.checkpoint_dir(STEPS) / "model" / "model.safetensors")


def calm(monkeypatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # each rank one thread: the machine is shared


@pytest.fixture(scope="module")
def unbroken(prefect_server, storage_root):
    """The 2-rank run with its own optimizer (AdamW), which the ranks of another backend or a healed group use."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        calm(monkeypatch)
        return run(storage_root, 2, "-unbroken")


def assert_same_run(got: RunStorage, expected: RunStorage) -> None:
    """The same completions sampled and the same final weights, bit for bit."""
    assert got.read_rollouts(columns=["completion"]).equals(expected.read_rollouts(columns=["completion"]))
    weights = final_weights(expected)
    for name, tensor in final_weights(got).items():
        assert torch.equal(tensor, weights[name]), name


def test_a_two_rank_actor_runs_the_flow_and_ends_with_the_one_process_weights(
    prefect_server, storage_root, monkeypatch
):
    calm(monkeypatch)
    use_sgd(monkeypatch)  # the runs' updates compared as tests/workers/actor/test_sharded_actor.py does
    one, two = run(storage_root, 1), run(storage_root, 2)
    assert two.complete_checkpoints() == [STEPS]
    assert two.read_rollouts(columns=["completion"]).equals(one.read_rollouts(columns=["completion"]))
    initial = load_file(storage_root / "models" / "tiny-qwen2" / "model.safetensors")
    assert_same_update(initial, final_weights(one), final_weights(two))


def test_a_rank_killed_mid_step_heals_and_the_run_ends_with_the_unbroken_weights(
    unbroken, storage_root, monkeypatch, caplog
):
    """Rank 1 SIGKILLed once the ranks have the second step: rank 0 would wait on it in the step's collectives.
    The group notices, ends rank 0, starts two new ranks and refuses the step (RankExited); Workers heals the
    actor (no checkpoint yet: the initial model, then step 1 replayed from its logged rollouts) and the step
    runs again. Bitwise equal to the unbroken run: the same ranks run the same steps on the same rollouts,
    each rank's share and gloo's reduction order unchanged, so the replay repeats every operation."""
    calm(monkeypatch)
    killed: list[int] = []
    steps = []
    answer = ActorGroup._answer

    def killing_answer(self, verb):
        steps.append(verb == "step")
        if sum(steps) == 2 and verb == "step" and not killed:
            killed.append(self.processes[1].pid)
            os.kill(killed[0], signal.SIGKILL)
        return answer(self, verb)

    monkeypatch.setattr(ActorGroup, "_answer", killing_answer)
    with caplog.at_level(logging.WARNING, logger="grpo_flow.workers"):
        healed = run(storage_root, 2, "-rank-killed")
    assert killed
    assert f"actor rank 1 exited (code {-signal.SIGKILL}) under 'step'" in caplog.text
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("actor-rank-")]
    assert_same_run(healed, unbroken)


@pytest.mark.ray
@pytest.mark.slow
def test_on_ray_the_actor_server_runs_its_two_ranks_and_ends_with_the_local_weights(
    unbroken, storage_root, ray_cluster, monkeypatch
):
    """The actor's Ray actor starts its 2 ranks as child processes on its node (gloo on a CPU cluster): the run
    samples what the local 2-rank run samples and ends with its weights, bit for bit (the same ranks' steps); its
    Ray actors end with the run."""
    calm(monkeypatch)
    ray = dict(backend="ray", ray_address=ray_cluster.address, ray_actor_cpus=1.0, ray_rollout_cpus=0.5)
    assert_same_run(run(storage_root, 2, "-ray", **ray), unbroken)
    assert not ray_cluster.named_actors("grpo-flow/actor-processes-2-ray/")


# The `unbroken` run's fields, checkpointed every step: the kill at step 2 finds checkpoint 1 and step 2's logged
# rollouts (replayed), and the resumed run generates step 3 afresh. Checkpoints do not change what a run trains.
KILL_RUN = ["--preset", "tiny", "--max-steps", str(STEPS), "--save-steps", "1", "--actor-num-processes", "2"]
KILL_RUN += ["--prompts-per-step", "4", "--num-generations", "4", "--eval-prompts", "0"]


@pytest.mark.slow
def test_a_two_rank_run_killed_whole_resumes_to_the_unbroken_weights_and_under_one_process(
    unbroken, storage_root, monkeypatch
):
    """`grpo train --actor-num-processes 2` SIGKILLed in step 2's actor call (its rollouts logged, the ranks not
    stepped), its ranks gone with it: resumed under 2 ranks it ends bit for bit with the unbroken 2-rank run;
    resumed under 1 process (a checkpoint's optimizer shards read whole, then the run goes on unsharded) it
    completes from the same checkpoint."""
    calm(monkeypatch)  # the ranks of `grpo train` on one thread each, as the unbroken run's
    for run_id, resume_with in (("ranks-kill-2", []), ("ranks-kill-1", ["--actor-num-processes", "1"])):
        killed = cli(storage_root, run_id, *KILL_RUN, fail_at="actor@2:kill")
        assert killed.returncode == -9, killed.stderr[-3000:]  # SIGKILL: nothing ran after it
        storage = RunStorage(storage_root, run_id)
        assert storage.latest_valid_checkpoint() == 1
        assert len(list((storage.checkpoint_dir(1) / OPTIMIZER_SHARDS_DIR).glob("*.distcp"))) == 2  # a file a rank
        resumed = cli(storage_root, run_id, "--resume", *resume_with)
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        summary = storage.read_summary()
        assert (summary["status"], summary["resumed_from_step"]) == ("completed", 1)
        assert storage.logged_steps() == [1, 2, 3]
    resumed_2 = RunStorage(storage_root, "ranks-kill-2")
    assert_same_weights(final_weights_of(resumed_2, STEPS), final_weights_of(unbroken, STEPS))
    rows = ["step", "completion", "advantage"]
    assert resumed_2.read_rollouts(columns=rows).equals(unbroken.read_rollouts(columns=rows))
