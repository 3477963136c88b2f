"""Rewards: how completions are scored.

- `functions`: reward functions called as TRL calls them, the built-ins, and the scoring of a
  rollout shard (weights, `None` = does not apply, errors naming the function and sample).
- `environments`: reward environments (`score` / `score_batch`, sync or async) as TRL reward
  functions: math answers, code tests, an LLM judge, format rewards.
- `sandbox`: untrusted code in a separate process with limits (kernel namespaces where they work);
  `modal_sandbox`: the same in a Modal Sandbox.
- `task`: the task a run trains and evaluates on, its accuracy reward resolved (`run_task`).
- `deadline`: user code (rewards under `reward_timeout_s`, tools not sandboxed) in a long-lived process
  of its own, killed past its deadline; `workers.tools` uses it too.

Imports no model library (`modal` only in `modal_sandbox`); from grpo-flow, `schemas` and
`grpo_flow.workers.data` (answer parsing, data sets) only.
"""
