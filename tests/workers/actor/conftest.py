"""The actor tests' model: the project's tiny Qwen2 (workers/data/tiny_model.py) without its format warm start,
which these tests do not need and which takes minutes on a shared CPU: the same architecture and tokenizer, from
its build seed. A test file that needs the warm-started model defines its own `model_path`."""

import pytest

from grpo_flow.workers.data.tiny_model import build_model, build_tokenizer


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-qwen2-untrained")
    tokenizer = build_tokenizer()
    build_model(tokenizer).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
