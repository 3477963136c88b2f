"""Data: the tasks a run trains on, and the project's own tiny model.

- `loaders`: tasks as two `datasets.Dataset` splits (train, held out): the synthetic
  `last_digit` and the hub sets (gsm8k, math, math500, mbpp), each loader taking its `load`
  function so tests hand it local fixtures; any data set with a `prompt` column.
- `tiny_model`: the tiny Qwen2 model and byte-level tokenizer, built once under the storage
  root with a format-only warm start, loaded with `from_pretrained` like a hub model.

Imports `datasets`, transformers and torch; from grpo-flow, `schemas`, and (only to record the
tiny model's held-out accuracy when it is built) `grpo_flow.workers.rollout`.
"""
