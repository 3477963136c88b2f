"""The tiny models' format warm start: it teaches the answer's format, not the answer."""

import pytest

from grpo_flow.workers.data.loaders import load_task
from grpo_flow.workers.data.models import resolve_model_path
from grpo_flow.workers.data.tiny_model import TINY_MODELS, read_build_info, tiny_model_path
from grpo_flow.workers.rollout.base import SamplingParams
from grpo_flow.workers.rollout.transformers_engine import TransformersRolloutEngine


@pytest.mark.slow
def test_tiny_reverse_learns_the_answer_format_but_answers_at_chance(storage_root):
    path = resolve_model_path("tiny-reverse", storage_root)  # built on first use, like `tiny`
    assert path == str(tiny_model_path(storage_root, "tiny-reverse")) != str(tiny_model_path(storage_root))
    assert set(TINY_MODELS) == {"tiny", "tiny-reverse"}
    info = read_build_info(path)
    assert info["warm_start_task"] == "reverse_digits"
    assert info["heldout_accuracy_random_init"] == 0.0
    # Exact match at chance: a random order of the prompt's digits is right about 1 time in 100 here.
    assert info["heldout_accuracy_after_warm_start"] <= 0.05

    task = load_task("reverse_digits")
    engine = TransformersRolloutEngine(path)
    engine.load()
    prompts = task.heldout["prompt"][:100]
    result = engine.generate(prompts, SamplingParams(max_tokens=7, greedy=True))
    # The format is learned: digits only, as many as the prompt shows, then end-of-sequence ...
    well_formed = [
        text.isdigit() and len(text) == len(prompt) - 1 and reason == "stop"
        for text, prompt, reason in zip(result.texts, prompts, result.finish_reasons, strict=True)
    ]
    assert sum(well_formed) >= 80
    # ... the answer is not: hardly any completion is the reversed prompt.
    exact = sum(text == answer for text, answer in zip(result.texts, task.heldout["answer"][:100], strict=True))
    assert exact <= 5
