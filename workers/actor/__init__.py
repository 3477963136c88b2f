"""The actor: the policy being trained and TRL's GRPO objective.

- `actor.Actor`: policy, optimizer and scheduler, one GRPO step per call, checkpoints.
- `trl_objective`: the only code that touches TRL's internals (a `GRPOTrainer` whose loop never
  runs; its `compute_loss` is the objective), pinned by tests/workers/actor/test_trl_parity.py.
- `advantages`: group-relative advantages, as TRL computes them (pure functions).
- `simple_mode`: TRL's own `GRPOTrainer.train()` loop on the same config, data and rewards.

Imports torch, transformers, trl and peft; from grpo-flow, `schemas`, `grpo_flow.workers.rollout.base`
(tokenizer loading) and `grpo_flow.workers.state` (run files). Knows nothing of where it runs.
"""
