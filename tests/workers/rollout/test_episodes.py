"""Multi-turn episodes as TRL 1.16 plays them: the chat template's tool-call format parsed, tool messages
appended as the template renders them, the model's own tokens masked in, the budget and turn limits."""

import types
from pathlib import Path

import pytest
import trl
from tokenizers import AddedToken

from grpo_flow.workers.data.tiny_model import build_tokenizer
from grpo_flow.workers.data.tiny_tools import DigitTable, build_tools_tokenizer
from grpo_flow.workers.rollout.base import GenerationResult, SamplingParams
from grpo_flow.workers.rollout.episodes import (
    ChatFormat,
    ChatFormatError,
    EpisodeLimits,
    EpisodeStart,
    check_tool_template,
    play_episodes,
    turn_seed,
)
from grpo_flow.workers.tools.calls import run_tool_calls
from grpo_flow.workers.tools.toolbox import Tool

TEMPLATES = Path(trl.__file__).parent / "chat_templates"
QWEN = ["<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
# TRL's templates with the special tokens each uses, and its end-of-turn token.
REAL = {
    "qwen2_5": (QWEN, "<|im_end|>"),
    "qwen3": ([*QWEN, "<think>", "</think>"], "<|im_end|>"),  # not prefix-preserving: TRL's training template
    "qwen3_5_nothink": ([*QWEN, "<think>", "</think>"], "<|im_end|>"),  # XML-style arguments
    "llama3_2": (["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"], "<|eot_id|>"),
    "glm4moe": (
        [
            "[gMASK]",
            "<sop>",
            "<|system|>",
            "<|user|>",
            "<|assistant|>",
            "<|observation|>",
            "<tool_call>",
            "</tool_call>",
            "<arg_key>",
            "</arg_key>",
            "<arg_value>",
            "</arg_value>",
            "<tool_response>",
            "</tool_response>",
            "<think>",
            "</think>",
            "<|endoftext|>",
        ],
        "<|endoftext|>",
    ),  # fmt: skip
}


def weather(city: str, days: int) -> str:
    """The weather.

    Args:
        city: The city.
        days: Days ahead.
    """
    return f"sunny in {city}"


def tokenizer_with(template: str, special: list[str], eos: str):
    """A byte-level tokenizer carrying one of TRL's chat templates and the special tokens it uses."""
    tokenizer = build_tokenizer()
    tokenizer.add_tokens([AddedToken(token, special=True, normalized=False) for token in special])
    tokenizer.eos_token = eos
    tokenizer.chat_template = (TEMPLATES / f"{template}.jinja").read_text()
    return tokenizer


@pytest.mark.parametrize("template", sorted(REAL))
def test_tool_calls_parse_and_tool_messages_render_as_trl_does_on_its_templates(template):
    tokenizer = tokenizer_with(template, *REAL[template])
    chat = ChatFormat(tokenizer, check_tool_template(tokenizer, template))
    prompt = [{"role": "user", "content": "Weather in Paris?"}]
    call = {"type": "function", "function": {"name": "weather", "arguments": {"city": "Paris", "days": 2}}}
    rendered = tokenizer.apply_chat_template(
        prompt + [{"role": "assistant", "content": "", "tool_calls": [call]}],
        tools=[weather],
        chat_template=chat.chat_template,
        return_dict=False,
    )
    prompt_ids = chat.prompt_ids(prompt, [weather], None)
    assert rendered[: len(prompt_ids)] == prompt_ids
    turn = rendered[len(prompt_ids) :]
    if tokenizer.eos_token_id in turn:  # what the model generates: up to its end of turn (GLM's has none)
        turn = turn[: turn.index(tokenizer.eos_token_id) + 1]
    assert chat.parse(turn, prompt_ids, [weather])["tool_calls"] == [call]
    # The tool messages' tokens: exactly TRL's own `_get_tool_suffix_ids`.
    trainer = types.SimpleNamespace(
        processing_class=tokenizer, chat_template=chat.chat_template, chat_template_kwargs={}, _is_vlm=False,
        _tokenizer=tokenizer,
    )  # fmt: skip
    messages = [{"role": "tool", "name": "weather", "content": "sunny in Paris"}]
    assert chat.suffix_ids(messages) == trl.GRPOTrainer._get_tool_suffix_ids(trainer, messages)
    assert "sunny in Paris" in tokenizer.decode(chat.suffix_ids(messages))


def test_qwen3s_template_is_replaced_by_trls_training_template():
    tokenizer = tokenizer_with("qwen3", *REAL["qwen3"])
    assert check_tool_template(tokenizer, "q") == (TEMPLATES / "qwen3_training.jinja").read_text()


@pytest.mark.parametrize(
    "template, message",
    [
        ("llama3", "cannot render tools"),  # drops the assistant's tool_calls
        ("gemma3", "cannot render tools"),  # refuses the tool role
        (None, "has no chat template"),
    ],
)
def test_a_template_that_cannot_carry_tool_calls_is_refused_naming_the_model(template, message):
    tokenizer = build_tokenizer()
    if template is not None:
        tokenizer.chat_template = (TEMPLATES / f"{template}.jinja").read_text()
    with pytest.raises(ChatFormatError) as error:
        check_tool_template(tokenizer, "my/model")
    assert str(error.value).startswith("model: ") and "'my/model'" in str(error.value) and message in str(error.value)


# -- the loop, with a scripted model -----------------------------------------------------------------
class Scripted:
    """A rollout engine that writes scripted turns (text per episode per turn), with log-prob -0.5 per token."""

    def __init__(self, tokenizer, turns):
        self.tokenizer, self.turns, self.calls = tokenizer, turns, []

    def __call__(self, contexts, params):
        turn = len(self.calls)
        self.calls.append((contexts, params))
        ids, reasons = [], []
        for i in range(len(contexts)):
            text = self.turns[turn][i]
            tokens = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            finished = text.endswith(self.tokenizer.eos_token)
            tokens = tokens[: params.max_tokens]
            ids.append(tokens)
            reasons.append("stop" if finished and len(tokens) == len(self.tokenizer(text)["input_ids"]) else "length")
        return GenerationResult(
            [list(c) for c in contexts], ids, [[-0.5] * len(t) for t in ids], reasons, [""] * len(ids), 0.1,
            {"worker_id": "rollout-0", "policy_version": 3},
        )  # fmt: skip


def lookup(digit: int) -> str:
    """Look a digit up.

    Args:
        digit: The digit.
    """
    return "7"


def starts(n, tools=None):
    tools = tools if tools is not None else {"lookup": Tool("lookup", lookup)}
    prompt = [{"role": "user", "content": "35"}]
    return [EpisodeStart(prompt, tools, [t.func for t in tools.values()] or None) for _ in range(n)]


CALL = '<tool_call>lookup {"digit": 5}</tool_call><|im_end|>'


def play(turns, n, limits, tools=None):
    tokenizer = build_tools_tokenizer()
    chat = ChatFormat(tokenizer, check_tool_template(tokenizer, "tiny-tools"))
    engine = Scripted(tokenizer, turns)
    call_tools = lambda requests: run_tool_calls(requests, timeout_s=5, sandbox=False)  # noqa: E731
    params = SamplingParams(temperature=0.7, top_p=0.9, seed=11)
    episodes, extra = play_episodes(engine, chat, starts(n, tools), params, limits, call_tools)
    return tokenizer, chat, engine, episodes, extra


def test_an_episode_masks_in_the_models_tokens_only_and_keeps_its_messages():
    turns = [[CALL, "9<|im_end|>"], ["7<|im_end|>"]]
    tokenizer, chat, engine, (called, direct), extra = play(turns, 2, EpisodeLimits(80))
    first = tokenizer(CALL)["input_ids"]
    suffix = chat.suffix_ids([{"role": "tool", "name": "lookup", "content": "7"}])
    second = tokenizer("7<|im_end|>")["input_ids"]
    assert called.completion_ids == first + suffix + second
    assert called.tool_mask == [1] * len(first) + [0] * len(suffix) + [1] * len(second)
    assert called.logprobs == [-0.5] * len(first) + [0.0] * len(suffix) + [-0.5] * len(second)
    assert [m["role"] for m in called.messages] == ["assistant", "tool", "assistant"]
    assert called.messages[1] == {"role": "tool", "name": "lookup", "content": "7"}
    assert called.messages[2]["content"] == "7" and (called.tool_calls, called.tool_failures) == (1, 0)
    assert direct.tool_mask == [1, 1] and direct.messages == [{"role": "assistant", "content": "9"}]
    assert called.finish_reason == direct.finish_reason == "stop"
    # The second turn continues the token ids as they are: nothing re-tokenized, one completion each.
    (context,), params = engine.calls[1]
    assert context == called.prompt_ids + first + suffix and params.n == 1
    assert params.seed == turn_seed(11, 1) != 11 and engine.calls[0][1].seed == 11
    assert (params.temperature, params.top_p) == (0.7, 0.9) and params.max_tokens == 80 - len(first + suffix)
    assert extra["policy_version"] == 3 and extra["generate_s"] == pytest.approx(0.2)


def test_the_turn_limit_ends_an_episode_with_its_last_calls_unanswered():
    turns = [[CALL], [CALL], ["7<|im_end|>"]]
    _, _, engine, (episode,), _ = play(turns, 1, EpisodeLimits(200, max_tool_calling_iterations=1))
    assert len(engine.calls) == 2 and episode.tool_calls == 1
    assert [m["role"] for m in episode.messages] == ["assistant", "tool", "assistant"]
    assert episode.messages[-1]["tool_calls"] and episode.tool_mask[-1] == 1


def test_tool_results_that_would_overflow_the_budget_are_dropped_as_trl_does():
    turns = [[CALL]]
    tokenizer = build_tools_tokenizer()
    result = ChatFormat(tokenizer).suffix_ids([{"role": "tool", "name": "lookup", "content": "7"}])
    budget = len(tokenizer(CALL)["input_ids"]) + len(result) - 1  # room for the call, not for its result
    _, _, engine, (episode,), _ = play(turns, 1, EpisodeLimits(budget))
    assert len(engine.calls) == 1 and episode.tool_calls == 1  # called (TRL counts it), its result dropped
    assert [m["role"] for m in episode.messages] == ["assistant"] and set(episode.tool_mask) == {1}


def test_the_budget_cuts_a_turn_and_ends_the_episode_as_truncated():
    turns = [["1234567890<|im_end|>"]]
    _, _, _, (episode,), _ = play(turns, 1, EpisodeLimits(4))
    assert len(episode.completion_ids) == 4 and episode.finish_reason == "length"


def test_a_failing_tool_is_a_message_and_the_episode_goes_on():
    def broken(digit: int) -> str:
        """Broken.

        Args:
            digit: The digit.
        """
        raise KeyError(digit)

    turns = [[CALL.replace("lookup", "broken")], ["0<|im_end|>"]]
    _, _, _, (episode,), _ = play(turns, 1, EpisodeLimits(120), tools={"broken": Tool("broken", broken)})
    assert episode.messages[1]["content"] == "{'error': '5'}" and episode.tool_failures == 1
    assert episode.messages[2]["content"] == "0"


def test_the_digit_table_environment_looks_up_its_prompts_last_digit():
    table = DigitTable()
    table.reset(table="9876543210", prompt=[{"role": "user", "content": "52"}], prompt_id="x")
    assert table.lookup() == "7"
