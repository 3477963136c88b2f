"""`digit_lookup`, a task that needs its tool, and `tiny-tools`, the tiny model that learns it.

The task: the prompt is one to three digits (`35`); every prompt has a hidden table of its own (ten
random digits, its `table` column, never shown to the model), and the answer is what the table maps
the prompt's last digit to. Only the tool can read the table: `DigitTable`, a TRL environment
(`environment_factory`), takes the row in `reset(table=..., prompt=...)` and offers one tool,
`lookup()`, which reads the entry the prompt asks about. Without it an answer is a guess (1 in 10);
held-out rows have tables of their own, so nothing can be memorised.

The model is the project's tiny Qwen2 (workers/data/tiny_model.py) with a compact chat template that
renders tools, tool calls and tool responses: GLM-4's one-token role markers (`<|user|>`,
`<|assistant|>`, `<|tool|>`, the tool's answer right after its marker), Qwen2.5's call tags, a call
as `<tool_call>lookup {}</tool_call>` (the name, then the arguments as JSON, as GLM-4 and Llama 3
write them). Its tokenizer ships a `response_template`, the parser transformers' `parse_response`
(and TRL's) reads tool calls with, as recent hub models ship one.

Format warm start (as `tiny`'s, only the format): 90 % of the conversations call `lookup`, get its
answer, then answer with any digit the conversation shows (the prompt's or the tool's, as `tiny`
answers with any digit of its prompt); 10 % answer at once with any digit. Held-out accuracy after it
is about 0.3. RL teaches when to call (always) and which digit to say (the tool's). The tiny model
could not learn to copy a key from the prompt into a call's arguments in a warm start of seconds, so
the environment holds the key: `lookup` takes no argument, as an environment's tools act on the task
it was reset with.
"""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

from grpo_flow.workers.state.storage import build_once

TASK_NAME = "digit_lookup"
DIGIT_LOOKUP_SEED = 20261126  # fixed: the data set is the same for every run, whatever the run's seed
CONTEXT = 128  # positions: the longest conversation is about 60 tokens
# GLM-4's one-token role markers (a role is one token, so the tool's answer sits right before the model's
# next turn), Qwen2.5's call tags, and Qwen's end of turn (the tokenizer's EOS).
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>", "<|tool|>")
TOOL_TOKENS = ("<tool_call>", "</tool_call>")

# The tools as `name(parameters)` on one line instead of Qwen2.5's long system text; a call as
# `<tool_call>name {arguments}</tool_call>` (the name, then the arguments as JSON, as GLM-4 and Llama 3 write
# them). One line of Jinja with no whitespace control: nothing is rendered but what it spells out.
CHAT_TEMPLATE = (
    "{% if tools %}<|system|>tools:"
    "{% for tool in tools %} {{ (tool.function or tool).name }}"
    "({{ ((tool.function or tool).parameters.properties or {}).keys() | join(',') }}){% endfor %}{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'assistant' %}<|assistant|>{{ message.content or '' }}"
    "{% for call in message.tool_calls or [] %}{% set call = call.function or call %}"
    "<tool_call>{{ call.name }} {{ call.arguments | tojson }}</tool_call>"
    "{% endfor %}<|im_end|>"
    "{% elif message.role == 'tool' %}<|tool|>{{ message.content }}"
    "{% else %}<|{{ message.role }}|>{{ message.content }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

# transformers' response template (what `tokenizer.parse_response` reads), in the form of TRL's for Llama 3 and
# GLM-4: the name after the opening tag, the arguments as JSON.
RESPONSE_TEMPLATE: dict[str, Any] = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|assistant|>",
    "fields": {
        "tool_calls": {
            "open_pattern": r"<tool_call>(?P<name>[A-Za-z_][A-Za-z0-9_]*) ",
            "close_pattern": r"</tool_call>\s*",
            "repeats": True,
            "content": "json",
            "transform": {"type": "function", "function": {"name": "{name}", "arguments": "{content}"}},
        },
        "content": {"close_pattern": r"<\|im_end\|>\s*", "content": "text"},
    },
}


class DigitTable:
    """The `digit_lookup` environment (TRL's environment_factory contract): one per rollout, `reset` with the
    row's columns; its public method `lookup` is the tool. It holds the question (the prompt's last digit)
    and the prompt's hidden table, as an environment holds its task's state."""

    def __init__(self) -> None:
        self.table, self.key = "", 0

    def reset(self, table: str = "", prompt: Any = None, **row: Any) -> None:
        """The prompt's hidden table and the digit it asks about; nothing is added to the prompt."""
        self.table = table
        text = prompt[-1]["content"] if isinstance(prompt, list) else str(prompt or "")
        digits = [c for c in text if c.isdigit()]
        self.key = int(digits[-1]) if digits else 0

    def lookup(self) -> str:
        """Look this prompt's digit up in its table.

        Returns:
            The digit the table maps it to.
        """
        return self.table[self.key]


ENVIRONMENT = f"{__name__}:DigitTable"


def digit_lookup_rows(count: int, rng: random.Random) -> list[dict[str, Any]]:
    """Prompts of 1 to 3 digits, each with a table of ten random digits of its own and the answer: what the
    table maps the prompt's last digit to. Prompts repeat across rows (there are 1,110), tables do not."""
    rows: list[dict[str, Any]] = []
    for _ in range(count):
        digits = "".join(str(rng.randrange(10)) for _ in range(rng.randint(1, 3)))
        table = "".join(str(rng.randrange(10)) for _ in range(10))
        rows.append({"prompt": [{"role": "user", "content": digits}], "table": table, "answer": table[int(digits[-1])]})
    return rows


def build_digit_lookup(num_train: int = 4000, num_heldout: int = 500) -> Any:
    """The `digit_lookup` task (offline, fixed seed; held-out rows have tables no train row has), scored by
    the built-in `final_answer` reward."""
    from datasets import Dataset

    from grpo_flow.workers.data.loaders import DEFAULT_REWARDS, TaskData

    rng = random.Random(DIGIT_LOOKUP_SEED)
    splits = {}
    for split, count in (("train", num_train), ("heldout", num_heldout)):
        rows = digit_lookup_rows(count, rng)
        for i, row in enumerate(rows):
            row["prompt_id"] = f"{TASK_NAME}-{split}-{i:05d}"
        splits[split] = Dataset.from_list(rows)
    return TaskData(
        TASK_NAME,
        splits["train"],
        splits["heldout"],
        DEFAULT_REWARDS[TASK_NAME],
        "final_answer",
    )


def build_tools_tokenizer() -> Any:
    """The tiny model's byte-level tokenizer, with the role and tool markers as single tokens, the compact chat
    template and the response template."""
    from tokenizers import AddedToken

    from grpo_flow.workers.data.tiny_model import build_tokenizer

    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": list(ROLE_TOKENS)})
    tokenizer.add_tokens([AddedToken(token, special=False, normalized=False) for token in TOOL_TOKENS])
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.response_template = RESPONSE_TEMPLATE
    return tokenizer


DIRECT_ANSWERS = 0.1  # of the warm start's conversations; the others call the tool


def warm_start_conversation(row: dict[str, Any], rng: random.Random) -> list[dict[str, Any]]:
    """The format, drawn at random: an answer at once (any digit), or a call of the tool, its answer, then an
    answer among the digits the conversation shows (as `tiny`'s: a digit of the prompt)."""
    digits = row["prompt"][-1]["content"]
    if rng.random() < DIRECT_ANSWERS:
        return [{"role": "assistant", "content": str(rng.randrange(10))}]
    result = row["table"][int(digits[-1])]
    call = {"type": "function", "function": {"name": "lookup", "arguments": {}}}
    return [
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "name": "lookup", "content": result},
        {"role": "assistant", "content": rng.choice(digits + result)},
    ]


def assistant_spans(tokenizer: Any, messages: list[dict[str, Any]], tools: list[Any]) -> tuple[list[int], list[int]]:
    """Token ids of a rendered conversation and a 0/1 mask over the assistant turns' own tokens: what
    follows the template's `<|assistant|>`, up to and with the turn's end-of-turn token."""
    ids: list[int] = tokenizer.apply_chat_template(messages, tools=tools, return_dict=False)
    mask = [0] * len(ids)
    for k, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start = len(
            tokenizer.apply_chat_template(messages[:k], tools=tools, add_generation_prompt=True, return_dict=False)
        )
        end = ids.index(tokenizer.eos_token_id, start) + 1
        mask[start:end] = [1] * (end - start)
    return ids, mask


def tools_warm_start(
    model: Any,
    tokenizer: Any,
    rows: list[dict[str, Any]],
    steps: int = 600,
    batch_size: int = 32,
    seed: int = 0,
    pool: int = 2048,
) -> float:
    """Supervised steps on conversations in the format (`warm_start_conversation`), loss on the model's turns;
    batches drawn from `pool` conversations rendered once."""
    from grpo_flow.workers.data.tiny_model import supervised_steps

    rng = random.Random(seed)
    tools = [DigitTable().lookup]
    rendered = [
        assistant_spans(tokenizer, row["prompt"] + warm_start_conversation(row, rng), tools)
        for row in (rng.choice(rows) for _ in range(pool))
    ]
    return supervised_steps(model, tokenizer, lambda: rng.sample(rendered, batch_size), steps)


def build_tools_model(tokenizer: Any, seed: int = 0) -> Any:
    """The tiny Qwen2 (same shape and initialisation as `tiny`), with CONTEXT positions."""
    from grpo_flow.workers.data.tiny_model import build_model

    model = build_model(tokenizer, seed=seed)
    model.config.max_position_embeddings = CONTEXT  # rotary: no table of positions to resize
    return model


def ensure_tiny_tools_model(folder: str | os.PathLike) -> Path:
    """The `tiny-tools` model in `folder`, built (once, atomically) if it is not there yet, with its
    warm start's held-out accuracy with the tool and with it disabled in build_info.json."""
    return build_once(Path(folder), build_tiny_tools_model)


def build_tiny_tools_model(folder: Path) -> dict[str, Any]:
    from grpo_flow.workers.state.phase import say

    say(f"building the tiny model 'tiny-tools' into {folder.parent} (once: a warm start on digit_lookup)")
    task = build_digit_lookup()
    tokenizer = build_tools_tokenizer()
    model = build_tools_model(tokenizer)
    loss = tools_warm_start(model, tokenizer, list(task.train))
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return {
        "architecture": "Qwen2ForCausalLM",
        "parameters": sum(p.numel() for p in model.parameters()),
        "warm_start_task": TASK_NAME,
        "warm_start_loss": loss,
        **warm_start_accuracy(folder, task),
    }


def warm_start_accuracy(folder: Path, task: Any, limit: int = 200) -> dict[str, float]:
    """Greedy held-out accuracy of the warm-started model (multi-turn episodes, as a run measures it), with
    its tool and with the tool disabled, and how often it calls the tool."""
    import functools

    from grpo_flow.workers.rollout.episodes import ChatFormat, EpisodeLimits, EpisodeRunner, disabled_tools
    from grpo_flow.workers.rollout.heldout import heldout_accuracy
    from grpo_flow.workers.rollout.transformers_engine import TransformersRolloutEngine
    from grpo_flow.workers.tools.calls import run_tool_calls
    from grpo_flow.workers.tools.toolbox import build_toolbox

    engine = TransformersRolloutEngine(folder)
    engine.load()
    toolbox = build_toolbox([], ENVIRONMENT, None)
    chat = ChatFormat(engine.tokenizer, None, CONTEXT)
    limits = EpisodeLimits(max_completion_length=32, max_tool_calling_iterations=1)
    with_tool = EpisodeRunner(toolbox, chat, limits, functools.partial(run_tool_calls, timeout_s=10, sandbox=False))
    without = EpisodeRunner(toolbox, chat, limits, disabled_tools)
    return {
        "heldout_accuracy_with_tool": heldout_accuracy(engine, task, limit, 32, episodes=with_tool),
        "heldout_accuracy_tool_disabled": heldout_accuracy(engine, task, limit, 32, episodes=without),
    }
