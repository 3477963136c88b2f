"""Conversational prompts against the model's chat template, checked before any model loads
(workers/rollout/base.py check_chat_prompts, called by prepare_run)."""

import pytest

from grpo_flow.workers.data.tiny_model import build_tokenizer
from grpo_flow.workers.rollout.base import check_chat_prompts

# A template that refuses roles it does not know, as most chat templates do.
STRICT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('bad role ' + m['role']) }}{% endif %}{{ m['content'] }}{% endfor %}"
)


def chat(*roles):
    return [{"role": role, "content": "hi"} for role in roles]


def test_messages_for_a_tokenizer_without_a_chat_template_are_named():
    tokenizer = build_tokenizer()  # the tiny model's: no chat template
    assert tokenizer.chat_template is None
    check_chat_prompts(lambda: pytest.fail("loaded a tokenizer"), "tiny", {"train": ["12=", "34="]})  # none needed
    with pytest.raises(ValueError, match=r"^dataset: train row 1 is a list of messages, but the tokenizer of model"):
        check_chat_prompts(lambda: tokenizer, "tiny", {"train": ["12=", chat("user")]})


def test_a_role_the_template_refuses_is_named_with_its_split_and_row():
    tokenizer = build_tokenizer()
    tokenizer.chat_template = STRICT_TEMPLATE
    check_chat_prompts(lambda: tokenizer, "chat", {"train": [chat("system", "user"), chat("user")]})
    with pytest.raises(ValueError, match=r"dataset: heldout row 2: .* refuses its messages \(roles \['banana'\]\)"):
        check_chat_prompts(
            lambda: tokenizer,
            "chat",
            {"train": [chat("user")], "heldout": [chat("user"), chat("user"), chat("banana")]},
        )


def test_string_prompts_on_a_chat_model_get_a_warning_with_trls_rule():
    """A chat model given plain strings saw them untemplated, silently (issue 34)."""
    from grpo_flow.workers.rollout.base import string_prompts_warning

    tokenizer = build_tokenizer()
    tokenizer.chat_template = STRICT_TEMPLATE
    warning = string_prompts_warning("raw", "12=", lambda: tokenizer, "my-chat-model")
    assert warning == (
        "dataset: the prompts are plain strings and model 'my-chat-model' has a chat template; as in TRL, a string "
        "prompt goes to the model as raw text, without the template (only a list of messages is rendered with it): "
        "--string-prompts user_message (string_prompts='user_message') sends each as a user message"
    )
    assert string_prompts_warning("raw", "12=", build_tokenizer, "tiny") is None  # no chat template
    not_loaded = lambda: pytest.fail("loaded a tokenizer")  # noqa: E731
    assert string_prompts_warning("user_message", "12=", not_loaded, "m") is None
    assert string_prompts_warning("raw", chat("user"), not_loaded, "m") is None


@pytest.mark.parametrize("preset", ["tiny", "reverse", "tiny-tools", "smol-math"])
def test_the_offline_presets_get_no_string_prompts_warning(preset):
    """Their chat models get messages (smol_math, digit_lookup); the tiny models (`tiny`, `tiny-reverse`),
    saved with build_tokenizer's tokenizer, have no chat template."""
    from grpo_flow.schemas.presets import preset_config
    from grpo_flow.workers.data.tiny_model import TINY_MODELS
    from grpo_flow.workers.rewards.task import run_task
    from grpo_flow.workers.rollout.base import string_prompts_warning

    config = preset_config(preset)
    prompt = run_task(config).train[0]["prompt"]

    def load():
        assert config.model in TINY_MODELS, "only a string prompt loads the tokenizer"
        return build_tokenizer()

    assert string_prompts_warning(config.string_prompts, prompt, load, config.model) is None
