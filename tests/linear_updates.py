"""SGD for tests that check two ways of computing a step give the same update (micro-batches, gradient
checkpointing, 2 ranks): SGD's update, momentum included, is linear in the gradients, so float rounding in how the gradient's
sum was split stays at rounding size. Adam's first update is lr * g / (|g| + eps), about lr * sign(g): where a
gradient nearly cancels, a rounding-size difference that flips its sign moves the weight by up to 2 * lr, and
whether it flips depends on the processor's summation kernels."""

from __future__ import annotations

import random
from typing import Any

import pyarrow as pa
import torch

from grpo_flow.workers.actor import sharded, trl_objective

# A wrong objective (another normaliser, a dropped micro-batch) changes the update by a visible fraction of itself;
# summation order changes the gradient by float32 rounding (~1e-7 of it).
UPDATE_RTOL = 1e-3
# The weights themselves round when the update is added: one float32 step of each weight either way.
WEIGHT_RTOL = 2 * torch.finfo(torch.float32).eps


def use_sgd(monkeypatch: Any) -> None:
    """Every actor built from here on, in this process and in an ActorGroup's rank processes, steps with SGD at
    the config's learning rate (TRL's trainer builds it: `optimizer_cls_and_kwargs`). Momentum gives it a state
    that checkpoints must carry, as Adam's."""
    monkeypatch.setattr(trl_objective, "make_objective", sgd_objective_factory(trl_objective.make_objective))
    monkeypatch.setattr(sharded, "serve_rank", serve_rank_with_sgd)


def sgd_objective_factory(make_objective: Any) -> Any:
    def make(model: Any, tokenizer: Any, config: Any) -> Any:
        objective = make_objective(model, tokenizer, config)
        objective.optimizer_cls_and_kwargs = (torch.optim.SGD, {"lr": config.learning_rate, "momentum": 0.9})
        return objective

    return make


def serve_rank_with_sgd(*args: Any) -> None:
    """A rank's process (spawned: it imports this module afresh) with SGD, then the rank's own loop."""
    trl_objective.make_objective = sgd_objective_factory(trl_objective.make_objective)
    sharded.serve_rank(*args)


def assert_same_update(before: dict[str, torch.Tensor], a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    """`b` moved from `before` as `a` did, within UPDATE_RTOL of the largest update; the update is far beyond
    the weights' rounding, so the check sees it."""
    assert before.keys() <= a.keys() <= b.keys(), (a.keys() - before.keys(), b.keys() - a.keys())  # a tied lm_head
    largest = max(float((a[name] - before[name]).abs().max()) for name in before)
    scale = max(float(w.abs().max()) for w in before.values())
    assert largest > 100 * WEIGHT_RTOL * scale, f"the step barely moved the weights ({largest})"
    for name in a:
        torch.testing.assert_close(b[name], a[name], atol=UPDATE_RTOL * largest, rtol=WEIGHT_RTOL, msg=name)


def rollouts(rows: int = 8) -> pa.Table:
    """A step's rows for two ways of computing it: prompts and completions of different lengths (padding on both
    sides), advantages of both signs."""
    rng = random.Random(0)
    return pa.table(
        {
            "prompt_token_ids": [[rng.randrange(3, 20) for _ in range(rng.randrange(2, 6))] for _ in range(rows)],
            "completion_token_ids": [[rng.randrange(3, 20) for _ in range(rng.randrange(1, 5))] for _ in range(rows)],
            "advantage": [rng.uniform(-1, 1) for _ in range(rows)],
        }
    )
