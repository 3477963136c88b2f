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
