"""Prefect flows: `grpo` (a run) and its per-step subflow `grpo-step`; the `grpo` CLI."""
