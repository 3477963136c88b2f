"""Run state: everything a run knows, on its storage root, and how a run resumes from it.

- `storage`: the run folder's files, each written atomically (config, Parquet rollouts and
  metrics, checkpoints with manifests, quarantine of damaged files).
- `resume`: where a run stands on disk and what resuming it means (config changes, replay).
- `lock`: one writer per run (a lock on the run folder naming its holder; a lease on Volumes).
- `verify`: every step and checkpoint of a run checked byte for byte (`grpo verify`).
- `faults`: fault injection (`stage@step[:kill]`) for testing recovery.
- `tracking`: wandb, for runs that report to it.
- `source`: grpo-flow's own code laid out for other interpreters (vLLM environment, Ray, Modal).

Imports pyarrow (and wandb lazily); from grpo-flow, `schemas` only. No torch, no Prefect.
"""
