"""Every weight-sync method from the actor on 2 ranks (ActorGroup, gloo on CPU) to the transformers engine: after
the same step on the same batch, the engine takes the weights the one-process actor's export gives it (compared as
tests/workers/actor/test_sharded_actor.py compares the updates, under SGD), the adapter alone with `lora`."""

from __future__ import annotations


import pytest
import torch

from grpo_flow.schemas.config import GRPOFlowConfig
from grpo_flow.workers.actor.actor import Actor
from grpo_flow.workers.actor.sharded import ActorGroup
from grpo_flow.workers.backends.weight_sync import METHODS, sync_weights
from grpo_flow.workers.data.tiny_model import ensure_tiny_model
from grpo_flow.workers.rollout.transformers_engine import TransformersRolloutEngine
from linear_updates import assert_same_update, rollouts, use_sgd  # tests/linear_updates.py

pytestmark = pytest.mark.slow  # ranks, each a process of its own, and whole runs


@pytest.fixture(scope="module")
def model_path(storage_root):
    return ensure_tiny_model(storage_root)


def config(**fields) -> GRPOFlowConfig:
    return GRPOFlowConfig(
        run_id="sync-ranks",
        learning_rate=1e-3,
        prompts_per_step=2,
        num_generations=4,
        max_completion_length=4,
        **fields,
    )


def engine_weights(actor, method, model_path, run_dir) -> dict[str, torch.Tensor]:
    """The weights a fresh engine holds after one sync from `actor` by `method`."""
    engine = TransformersRolloutEngine(model_path)
    engine.load()
    sync_weights(method, actor, [engine], run_dir)
    assert engine.policy_version == 1
    return {k: v.detach().clone() for k, v in engine.model.state_dict().items()}


def stepped(model_path, use_lora: bool):
    """The one-process actor and the 2-rank group, each a step on from the same start and batch."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setenv("OMP_NUM_THREADS", "1")  # each rank one thread: the machine is shared
        use_sgd(monkeypatch)
        one = Actor(config(use_lora=use_lora), model_path)
        one.load()
        one.step(0, rollouts())
        group = ActorGroup(config(use_lora=use_lora, actor_num_processes=2), model_path)
        group.load()
    try:
        group.step(0, rollouts())
        yield one, group
    finally:
        group.close()


@pytest.fixture(scope="module")
def full(model_path):
    yield from stepped(model_path, use_lora=False)


@pytest.fixture(scope="module")
def lora(model_path):
    yield from stepped(model_path, use_lora=True)


def initial_engine_weights(model_path) -> dict[str, torch.Tensor]:
    engine = TransformersRolloutEngine(model_path)
    engine.load()
    return dict(engine.model.state_dict())


@pytest.mark.parametrize("method", [m for m in METHODS if m != "lora"])
def test_each_method_gives_the_engine_the_one_process_weights(full, model_path, tmp_path, method):
    one, group = full
    expected = engine_weights(one, method, model_path, tmp_path / "one")
    got = engine_weights(group, method, model_path, tmp_path / "two")
    assert sorted(got) == sorted(expected)
    assert_same_update(initial_engine_weights(model_path), expected, got)


@pytest.mark.parametrize("method", METHODS)
def test_each_method_from_a_lora_group(lora, model_path, tmp_path, method):
    """The merged weights by every method but `lora`, which sends the adapter alone (the engine wraps its model in
    peft: the adapter's tensors are what moves)."""
    one, group = lora
    expected = engine_weights(one, method, model_path, tmp_path / "one")
    got = engine_weights(group, method, model_path, tmp_path / "two")
    assert sorted(got) == sorted(expected)
    if method != "lora":
        assert_same_update(initial_engine_weights(model_path), expected, got)
        return
    initial = Actor(config(use_lora=True), model_path)
    initial.load()
    expected, got = ({k.replace(".default", ""): v for k, v in w.items() if "lora_" in k} for w in (expected, got))
    assert_same_update(initial.adapter_state_dict(), expected, got)
