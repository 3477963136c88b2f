"""The actor on 2 ranks (workers/actor/sharded.py, gloo on CPU) against the one-process actor on the same batch:
the same loss and the same updated weights for loss types whose normalisers differ (dapo: the global token
count; grpo: per-sequence means; dr_grpo: rows x max_completion_length), full fine-tune and LoRA; and the
refusals of actor_num_processes a run cannot have."""

from __future__ import annotations

import os
import signal

import pyarrow as pa
import pytest
import torch

from grpo_flow.flows import checks
from grpo_flow.flows.checks import StartCheckError, check_device
from grpo_flow.schemas.config import GRPOFlowConfig
from grpo_flow.workers.actor.actor import Actor
from grpo_flow.workers.actor.sharded import ActorGroup, RankExited
from grpo_flow.workers.backends import vllm_env
from linear_updates import assert_same_update, rollouts, use_sgd  # tests/linear_updates.py

LEARNING_RATE = 1e-3
# The two sides sum the same terms in another order (each rank's share, then across ranks): the loss agrees to
# float32 rounding, and the updates are compared under SGD (tests/linear_updates.py); a wrong normaliser moves
# the loss by the ratio of the normalisers. The loss sums terms of order 1 that nearly cancel (advantages of both
# signs), so its rounding is absolute too (seen: 7.5e-9 on a loss of -1.2e-4).
LOSS_RTOL, LOSS_ATOL = 1e-5, 1e-7


def config(**fields) -> GRPOFlowConfig:
    defaults = {"prompts_per_step": 2, "num_generations": 4, "max_completion_length": 4}
    return GRPOFlowConfig(run_id="sharded", learning_rate=LEARNING_RATE, **{**defaults, **fields})


@pytest.mark.parametrize(
    "loss_type, use_lora",
    [
        pytest.param(loss, lora, id=f"{loss}-{'lora' if lora else 'full'}", marks=[] if case == 0 else pytest.mark.slow)
        for case, (loss, lora) in enumerate(
            (loss, lora) for lora in (False, True) for loss in ("dapo", "grpo", "dr_grpo")
        )
    ],
)  # dapo-full in the fast tier
def test_two_ranks_step_as_one_process(model_path, monkeypatch, loss_type, use_lora):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # each rank one thread: the machine is shared
    use_sgd(monkeypatch)
    one = Actor(config(loss_type=loss_type, use_lora=use_lora), model_path)
    one.load()
    expected = one.step(0, rollouts())
    expected_weights = one.published_weights()
    group = ActorGroup(config(loss_type=loss_type, use_lora=use_lora, actor_num_processes=2), model_path)
    group.load()
    try:
        got = group.step(0, rollouts())
        weights = group.published_weights()
    finally:
        group.close()
    assert group.policy_version == 1
    assert got["loss"] == pytest.approx(expected["loss"], rel=LOSS_RTOL)
    assert got["grad_norm"] == pytest.approx(expected["grad_norm"], rel=LOSS_RTOL)
    assert sorted(weights) == sorted(expected_weights)
    initial = Actor(config(use_lora=use_lora), model_path)
    initial.load()
    assert_same_update(initial.published_weights(), expected_weights, weights)


@pytest.mark.slow
def test_a_rank_that_died_between_calls_fails_the_next_one_naming_it_and_a_new_group_answers(model_path, monkeypatch):
    """Rank 0 SIGKILLed while the group is idle: the next call cannot reach it, ends rank 1 and starts two new
    ranks on the initial model (what `Workers` heals by restore and replay: tests/flows/test_actor_processes_flow.py
    kills a rank mid-step)."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    group = ActorGroup(config(actor_num_processes=2), model_path)
    group.load()
    try:
        group.step(0, rollouts())
        dead, survivor = group.processes
        os.kill(dead.pid, signal.SIGKILL)
        with pytest.raises(RankExited, match=rf"^actor rank 0 exited \(code {-signal.SIGKILL}\) under 'step'"):
            group.step(1, rollouts())
        assert not survivor.is_alive() and len(group.processes) == 2 and group.policy_version == 0
        assert group.step(0, rollouts())["loss"] != 0
    finally:
        group.close()


def test_steps_that_do_not_split_across_the_ranks_are_refused():
    with pytest.raises(ValueError, match=r"actor_num_processes/prompts_per_step/num_generations: completions_per_step"):
        config(prompts_per_step=1, num_generations=3, actor_num_processes=2)


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"backend": "modal", "modal_actor_gpu_count": 1}, "actor_num_processes/modal_actor_gpu_count: "),
        ({"backend": "ray", "ray_actor_gpus": 1}, "actor_num_processes/ray_actor_gpus: "),
        ({"rollout_engine": "vllm", "device": "cuda"}, "actor_num_processes/vllm_mode/device: "),
    ],
)
def test_backends_that_cannot_give_the_ranks_are_refused_naming_the_fields(fields, message):
    with pytest.raises(ValueError, match=message):
        config(actor_num_processes=2, **fields)
    config(actor_num_processes=1, **fields)  # one process: what runs today


def test_on_ray_the_actor_bundle_holds_a_gpu_a_rank_on_one_node():
    """The actor's Ray actor starts its ranks as child processes: its bundle takes a GPU a rank (none on a CPU
    cluster: gloo ranks), and a cluster with no node of that many GPUs is refused naming the field."""
    from grpo_flow.workers.backends.ray_backend import RayNotReadyError, check_resources, plan_bundles

    ray = config(backend="ray", actor_num_processes=2)
    assert plan_bundles(ray, cluster_gpus=8)[0]["GPU"] == 2
    assert "GPU" not in plan_bundles(ray, cluster_gpus=0)[0]
    assert "GPU" not in plan_bundles(config(backend="ray", actor_num_processes=2, ray_actor_gpus=0), 8)[0]
    check_resources(ray, [{"CPU": 8, "GPU": 2}, {"CPU": 8, "GPU": 1}], "here")  # the actor on the first node
    with pytest.raises(
        RayNotReadyError, match=r"^actor_num_processes: the actor's 2 ranks run on one node, a GPU each"
    ):
        check_resources(ray, [{"CPU": 8, "GPU": 1}] * 4, "here")  # 4 GPUs, but none with another on its node


def test_more_ranks_than_cuda_gpus_are_refused_before_anything_loads(monkeypatch):
    monkeypatch.setattr(vllm_env, "has_cuda", lambda: True)
    monkeypatch.setattr(vllm_env, "cuda_device_count", lambda: 1)
    with pytest.raises(StartCheckError) as caught:
        check_device(config(device="cuda", actor_num_processes=2))
    assert (caught.value.field, caught.value.message) == (
        "actor_num_processes",
        "2 ranks need a CUDA GPU each; this machine has 1",
    )
    check_device(config(device="cpu", actor_num_processes=2))  # CPU ranks: as many as asked
    assert checks.check_device(config(device="cuda")) is None


def second_batch() -> pa.Table:
    table = rollouts(16).slice(8, 8)
    return table.set_column(2, "advantage", pa.array([-a for a in table.column("advantage").to_pylist()]))


def assert_same_step(before: dict, got: tuple[dict, dict], expected: tuple[dict, dict]) -> None:
    """The same loss and the same update from the weights `before` the step."""
    (metrics, weights), (expected_metrics, expected_weights) = got, expected
    assert metrics["loss"] == pytest.approx(expected_metrics["loss"], rel=LOSS_RTOL, abs=LOSS_ATOL)
    assert_same_update(before, expected_weights, weights)


def assert_same_step_bitwise(got: tuple[dict, dict], expected: tuple[dict, dict]) -> None:
    (metrics, weights), (expected_metrics, expected_weights) = got, expected
    assert metrics["loss"] == expected_metrics["loss"]
    for name, tensor in expected_weights.items():
        assert torch.equal(weights[name], tensor), name


@pytest.mark.slow
def test_checkpoints_resume_under_either_number_of_processes(model_path, tmp_path, monkeypatch):
    """2 ranks write the optimizer state a shard per rank (torch.distributed.checkpoint) and the weights gathered
    (a transformers folder, as one process writes them): a checkpoint written by 2 ranks resumes under 1 and under 2 (bitwise as the unbroken
    2-rank actor), one written by 1 process under 2; a reset goes back to the initial model. SGD with momentum:
    the optimizer state a resume must restore, in an update linear in the gradients."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    use_sgd(monkeypatch)
    one_folder, two_folder = tmp_path / "one", tmp_path / "two"
    one_folder.mkdir(), two_folder.mkdir()
    one = Actor(config(), model_path)
    one.load()
    first = one.step(0, rollouts())
    one.save_checkpoint(one_folder)
    before = one.published_weights()
    unbroken = (one.step(1, second_batch()), one.published_weights())
    two = ActorGroup(config(actor_num_processes=2), model_path)
    two.load()
    try:
        two.step(0, rollouts())
        two.save_checkpoint(two_folder)
        assert not (two_folder / "optimizer.pt").exists()
        assert {p.name for p in (two_folder / "optimizer").iterdir()} >= {".metadata", "__0_0.distcp", "__1_0.distcp"}
        unbroken_two = (two.step(1, second_batch()), two.published_weights())
        assert_same_step(before, unbroken_two, unbroken)
        two.restore(one_folder)  # written by 1 process
        assert two.policy_version == 1
        assert_same_step(before, (two.step(1, second_batch()), two.published_weights()), unbroken)
        two.restore(two_folder)
        assert_same_step_bitwise((two.step(1, second_batch()), two.published_weights()), unbroken_two)
        two.reset()  # a run healed before its first checkpoint: the initial model
        assert two.policy_version == 0
        assert two.step(0, rollouts())["loss"] == pytest.approx(first["loss"], rel=LOSS_RTOL)
    finally:
        two.close()
    resumed = Actor(config(), model_path)
    resumed.restore(two_folder)  # written by 2 ranks
    assert_same_step(before, (resumed.step(1, second_batch()), resumed.published_weights()), unbroken)


@pytest.mark.slow
def test_ranks_with_unequal_micro_batches_step_as_one_process(model_path, monkeypatch):
    """Rank 0's rows are long and split into a micro-batch each under the token budget; rank 1's short rows fit
    in one, so it splits them to as many (every forward and backward meets the other rank's collectives).
    Two iterations: the old log-probs' pass too."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    use_sgd(monkeypatch)
    long_rows, short_rows = [[5, 6, 7, 8, 9]] * 4, [[5, 6]] * 4
    table = pa.table(
        {
            "prompt_token_ids": long_rows + short_rows,
            "completion_token_ids": [[3, 4, 5, 6]] * 4 + [[7]] * 4,
            "advantage": [1.0, -0.5, 0.25, -1.0, 0.5, -0.25, 1.0, -1.0],
        }
    )
    fields = {"loss_type": "grpo", "max_tokens_per_microbatch": 12, "num_iterations": 2}
    one = Actor(config(**fields), model_path)
    one.load()
    before = one.published_weights()
    expected = (one.step(0, table), one.published_weights())
    two = ActorGroup(config(actor_num_processes=2, **fields), model_path)
    two.load()
    try:
        got = (two.step(0, table), two.published_weights())
    finally:
        two.close()
    assert expected[0]["actor/micro_batches"] == 5 and got[0]["actor/micro_batches"] == 4
    assert_same_step(before, got, expected)


@pytest.mark.slow
def test_rows_that_do_not_split_evenly_step_as_one_process(model_path, monkeypatch):
    """A step dynamic sampling could not fill may hold rows that do not split across the ranks: shares a row
    apart, and the loss still the whole batch's (counts all-reduced, gradients summed)."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    use_sgd(monkeypatch)
    table = rollouts(7)
    one = Actor(config(loss_type="grpo"), model_path)
    one.load()
    before = one.published_weights()
    expected = (one.step(0, table), one.published_weights())
    two = ActorGroup(config(loss_type="grpo", actor_num_processes=2), model_path)
    two.load()
    try:
        assert_same_step(before, (two.step(0, table), two.published_weights()), expected)
    finally:
        two.close()
