"""Rollout engines: the policy's copies that generate completions, all with one surface.

`load()`, `generate(prompts, SamplingParams, max_prompt_length) -> GenerationResult`,
`load_state_dict(weights, version, adapter_config)`, `policy_version`.

- `base`: the records every engine shares (no torch): `SamplingParams`, `GenerationResult`.
- `transformers_engine`: transformers `generate` (CPU, or GPU without vLLM).
- `process_engine`: the transformers engine in a child process (one-step-off pipelining).
- `vllm_engine`: vLLM.
- `heldout`: greedy held-out accuracy of an engine on a task.

Imports torch and transformers (vLLM lazily); from grpo-flow, `grpo_flow.workers.data` and
`grpo_flow.workers.rewards` (held-out scoring) only.
"""
