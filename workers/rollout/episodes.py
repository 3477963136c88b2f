"""Multi-turn episodes: model turn, tool calls, tool messages, next model turn, as TRL 1.16's GRPOTrainer
plays them (`_tool_call_loop`), over any rollout engine.

    chat = ChatFormat.load(model_path)                       # the tokenizer, TRL's parser and template checks
    episodes, extra = play_episodes(generate, chat, starts, params, limits, call_tools)

`generate(token_id_prompts, params)` is any rollout engine's `generate` (through `Workers.generate`: every
backend), called once per turn with the episodes still going, one completion each. An episode:

1. The prompt is rendered with the rollout's tools (`apply_chat_template(..., tools=...)`), as TRL does.
2. The model's turn is parsed in the chat template's format (TRL's `parse_response`: the tokenizer's
   `response_template`, or the one TRL ships for the template).
3. Its tool calls run (workers/tools/calls.py); the tool messages are rendered as the template renders
   them after a tool-calling turn (TRL's `_get_tool_suffix_ids`) and appended to the token ids as they
   are: nothing is re-tokenized, so the model's own tokens stay exactly as sampled.
4. Next turn, until a turn calls no tool, `max_tool_calling_iterations` rounds of tool calls have run,
   or the token budget is spent.

The token budget is TRL's: `max_completion_length` covers the whole completion, model and tool tokens
alike, and tool results that would overflow it (or the model's context) are dropped and the episode
ends. `tool_mask` marks the model's own tokens (1) against the tool messages' (0); only the former are
in the loss, and their sampling log-probs ride along for the importance-sampling correction (0.0
elsewhere). Where TRL generates each turn with the whole budget and cuts the result, a turn here is
asked for what is left of it: the same tokens.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from grpo_flow.schemas.records import RolloutBatch
from grpo_flow.workers.rollout.base import GenerationResult, SamplingParams
from grpo_flow.workers.tools.calls import ToolRequest, ToolResult

Generate = Callable[[list[list[int]], SamplingParams], GenerationResult]
CallTools = Callable[[list[ToolRequest]], list[ToolResult]]


class ChatFormatError(ValueError):
    """A model whose chat template cannot carry tool calls; one line, naming the model."""


@dataclass
class ChatFormat:
    """A tokenizer as multi-turn episodes need it: the chat template they render with (TRL's training
    template where the model's own is not prefix-preserving) and a response parser for tool calls."""

    tokenizer: Any
    chat_template: str | None = None  # None: the tokenizer's own
    model_max_length: int | None = None  # the model's context, in tokens (None: not known)

    @classmethod
    def load(cls, model_path: str | Path, model: str | None = None) -> ChatFormat:
        return _load_chat_format(str(model_path), model or str(model_path))

    def prompt_ids(self, prompt: list[dict[str, Any]], tools: list[Any] | None, max_length: int | None) -> list[int]:
        """The prompt rendered with its tools and the generation prompt; truncated from the left past `max_length`."""
        ids = list(
            self.tokenizer.apply_chat_template(
                prompt,
                tools=tools,
                chat_template=self.chat_template,
                add_generation_prompt=True,
                tokenize=True,
                return_dict=False,
            )
        )
        return ids[-max_length:] if max_length is not None and len(ids) > max_length else ids

    def suffix_ids(self, tool_messages: list[dict[str, Any]]) -> list[int]:
        """The tokens the template renders after a tool-calling turn's end-of-turn token: the tool messages
        and the next generation prompt. TRL's `_get_tool_suffix_ids`: the difference between a dummy
        conversation with and without them, its prefix cut at its last EOS."""
        calls = [{"type": "function", "function": {"name": tool_messages[0]["name"], "arguments": {}}}]
        dummy = [{"role": "user", "content": "dummy"}, {"role": "assistant", "content": "", "tool_calls": calls}]
        render = functools.partial(
            self.tokenizer.apply_chat_template, tokenize=True, chat_template=self.chat_template, return_dict=False
        )
        prefix = list(render(dummy, add_generation_prompt=False))
        full = list(render(dummy + tool_messages, add_generation_prompt=True))
        eos = [i for i, token in enumerate(prefix) if token == self.tokenizer.eos_token_id]
        if eos:
            prefix = prefix[: eos[-1] + 1]
        if full[: len(prefix)] != prefix:
            raise ChatFormatError("the chat template renders a tool-calling turn differently once tool messages follow")
        return full[len(prefix) :]

    def parse(self, ids: list[int], prefix: list[int], tools: list[Any] | None) -> dict[str, Any]:
        """A model turn as a message, tool calls parsed (TRL's `parse_response`; malformed calls: plain text)."""
        from trl.chat_template_utils import parse_response

        return parse_response(self.tokenizer, ids, prefix=prefix, tools=tools)


@functools.lru_cache(maxsize=4)
def _load_chat_format(model_path: str, model: str) -> ChatFormat:
    from transformers import AutoConfig

    from grpo_flow.workers.rollout.base import load_generation_tokenizer

    tokenizer = load_generation_tokenizer(model_path)
    template = check_tool_template(tokenizer, model)
    try:
        config = AutoConfig.from_pretrained(model_path)
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        context = getattr(text, "max_position_embeddings", None)
    except (OSError, ValueError):
        context = None
    return ChatFormat(tokenizer, template, context)


def check_tool_template(tokenizer: Any, model: str) -> str | None:
    """The chat template to render episodes with (None: the tokenizer's own), as TRL's GRPOTrainer settles it
    at init: the template must render a whole tool-calling conversation (TRL's `supports_tool_calling`),
    a response parser must read its tool calls (the tokenizer's `response_template`, else TRL's for a
    template it knows), and a template that is not prefix-preserving is replaced by TRL's training one."""
    from trl.chat_template_utils import (
        add_response_schema,
        get_training_chat_template,
        is_chat_template_prefix_preserving,
        supports_tool_calling,
    )

    if tokenizer.chat_template is None:
        raise ChatFormatError(f"model: {model!r} has no chat template; tools need one that renders tool calls")
    if not supports_tool_calling(tokenizer):
        raise ChatFormatError(
            f"model: the chat template of {model!r} cannot render tools (a user -> assistant with tool_calls -> tool "
            "conversation loses the call or the result; TRL's supports_tool_calling); set chat_template to one "
            "that can, e.g. one of TRL's (qwen2_5)"
        )
    if getattr(tokenizer, "response_template", None) is None and getattr(tokenizer, "response_schema", None) is None:
        try:
            add_response_schema(tokenizer)
        except ValueError:
            raise ChatFormatError(
                f"model: no parser for the tool calls of {model!r}'s chat template: its tokenizer has no "
                "response_template and TRL ships none for this template (trl.chat_template_utils.add_response_schema)"
            ) from None
    if is_chat_template_prefix_preserving(tokenizer):
        return None
    try:
        return get_training_chat_template(tokenizer)
    except ValueError:
        raise ChatFormatError(
            f"model: the chat template of {model!r} renders earlier turns differently once tool messages follow, "
            "and TRL has no training template for it (trl.chat_template_utils.get_training_chat_template)"
        ) from None


@dataclass
class EpisodeStart:
    """One rollout to play: its prompt (messages), the tools it may call (by name) and what the chat
    template is given as `tools` (None: none)."""

    prompt: list[dict[str, Any]]
    tools: Mapping[str, Any]
    rendered_tools: list[Any] | None


@dataclass
class Episode:
    prompt_ids: list[int]
    completion_ids: list[int] = field(default_factory=list)
    tool_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    messages: list[dict[str, Any]] = field(
        default_factory=list
    )  # assistant turns and tool messages, as TRL's completions
    finish_reason: str = "stop"
    tool_calls: int = 0
    tool_failures: int = 0
    tool_rounds: int = 0

    def add_model_turn(self, ids: list[int], logprobs: list[float]) -> None:
        self.completion_ids += ids
        self.tool_mask += [1] * len(ids)
        self.logprobs += logprobs

    def add_tool_turn(self, ids: list[int]) -> None:
        self.completion_ids += ids
        self.tool_mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)


@dataclass(frozen=True)
class EpisodeLimits:
    max_completion_length: int  # the whole completion: model and tool tokens (TRL's budget)
    max_tool_calling_iterations: int | None = None  # rounds of tool calls; None: until the budget is spent (TRL)
    max_prompt_length: int | None = None


def turn_seed(seed: int, turn: int) -> int:
    """Turn 0 samples with the shard's own seed (so a run without tool calls samples as before); later
    turns with seeds derived from it."""
    return seed if turn == 0 else int(np.random.SeedSequence([seed, turn]).generate_state(1)[0])


def play_episodes(
    generate: Generate,
    chat: ChatFormat,
    starts: Sequence[EpisodeStart],
    params: SamplingParams,
    limits: EpisodeLimits,
    call_tools: CallTools,
) -> tuple[list[Episode], dict[str, Any]]:
    """Every rollout played to its end; returns the episodes and the first turn's `extra` (worker id, policy
    version) with the generation seconds of all turns."""
    episodes = [Episode(chat.prompt_ids(s.prompt, s.rendered_tools, limits.max_prompt_length)) for s in starts]
    active = list(range(len(starts)))
    extra: dict[str, Any] = {}
    seconds, turn = 0.0, 0
    while active:
        budget = {i: limits.max_completion_length - len(episodes[i].completion_ids) for i in active}
        contexts = [episodes[i].prompt_ids + episodes[i].completion_ids for i in active]
        turn_params = SamplingParams(
            n=1,
            max_tokens=max(budget.values()),
            temperature=params.temperature,
            top_p=params.top_p,
            greedy=params.greedy,
            seed=turn_seed(params.seed, turn),
        )
        result = generate(contexts, turn_params)
        seconds += result.seconds
        extra = extra or dict(result.extra)
        calling: list[int] = []
        for i, context, ids, logprobs, reason in zip(
            active, contexts, result.completion_token_ids, result.sampling_logprobs, result.finish_reasons, strict=True
        ):
            episode = episodes[i]
            if len(ids) >= budget[i]:  # the budget ends the turn (and the episode) where it runs out
                ids, logprobs, reason = ids[: budget[i]], logprobs[: budget[i]], "length"
            episode.add_model_turn(list(ids), list(logprobs))
            message = chat.parse(list(ids), context, starts[i].rendered_tools)
            episode.messages.append(message)
            episode.finish_reason = reason
            rounds_left = limits.max_tool_calling_iterations is None or (
                episode.tool_rounds < limits.max_tool_calling_iterations
            )
            if reason == "stop" and message.get("tool_calls") and rounds_left:
                calling.append(i)
        active = run_tool_round(chat, episodes, starts, calling, limits, call_tools)
        turn += 1
    extra["generate_s"] = seconds
    return episodes, extra


def run_tool_round(
    chat: ChatFormat,
    episodes: list[Episode],
    starts: Sequence[EpisodeStart],
    calling: list[int],
    limits: EpisodeLimits,
    call_tools: CallTools,
) -> list[int]:
    """The tool calls of the episodes in `calling`, all at once; their results appended where the budget and
    the model's context allow (else the episode ends as it is, as TRL drops such results). Returns the
    episodes that go on to another turn."""
    requests: list[ToolRequest] = []
    owners: list[int] = []
    for i in calling:
        for call in episodes[i].messages[-1]["tool_calls"]:
            requests.append(ToolRequest(call, starts[i].tools))
            owners.append(i)
    results = call_tools(requests) if requests else []
    by_episode: dict[int, list[ToolResult]] = {i: [] for i in calling}
    for owner, result in zip(owners, results, strict=True):
        by_episode[owner].append(result)
    going_on = []
    for i in calling:
        episode, answered = episodes[i], by_episode[i]
        episode.tool_calls += len(answered)
        episode.tool_failures += sum(result.failed for result in answered)
        tool_messages = [{"role": "tool", "name": r.name, "content": r.content} for r in answered]
        suffix = chat.suffix_ids(tool_messages)
        length = len(episode.completion_ids) + len(suffix)
        context = chat.model_max_length
        if length > limits.max_completion_length or (
            context is not None and len(episode.prompt_ids) + length >= context
        ):
            continue  # TRL's rule: results that would overflow are dropped, the episode ends here
        episode.messages += tool_messages
        episode.add_tool_turn(suffix)
        episode.tool_rounds += 1
        if length == limits.max_completion_length:  # nothing left for a next turn
            episode.finish_reason = "length"
            continue
        going_on.append(i)
    return going_on


def episode_starts(
    toolbox: Any, rows: Sequence[Mapping[str, Any]], num_generations: int
) -> tuple[list[EpisodeStart], list[Any]]:
    """`num_generations` rollouts of each row (prompt-major), each with its own environment (reset with the
    row, as TRL does per rollout); returns their starts and environments (None without environments)."""
    starts, environments = [], []
    for row in rows:
        for _ in range(num_generations):
            prompt, environment, tools = toolbox.start(row)
            starts.append(EpisodeStart(prompt, tools, toolbox.rendered(tools)))
            environments.append(environment)
    return starts, environments


def disabled_tools(requests: list[ToolRequest]) -> list[ToolResult]:
    """Every call answered with an error, the tools never run: what a policy does when its tools cannot help."""
    from grpo_flow.workers.tools.calls import call_target, error_content

    return [ToolResult(call_target(r)[0], error_content("the tools are disabled"), failed=True) for r in requests]


@dataclass
class EpisodeRunner:
    """What playing a run's episodes takes: its toolbox, chat format, limits and how tools are called."""

    toolbox: Any
    chat: ChatFormat
    limits: EpisodeLimits
    call_tools: CallTools

    @classmethod
    def from_config(cls, config: Any, model_path: str | Path, tools_disabled: bool = False) -> EpisodeRunner:
        from grpo_flow.workers.tools.calls import run_tool_calls
        from grpo_flow.workers.tools.toolbox import toolbox_for

        limits = EpisodeLimits(
            config.max_completion_length, config.max_tool_calling_iterations, config.max_prompt_length
        )
        call_tools: CallTools = (
            disabled_tools
            if tools_disabled
            else functools.partial(run_tool_calls, timeout_s=config.tool_timeout_s, sandbox=config.sandbox_tools)
        )
        toolbox = toolbox_for(config.tools, config.environment_factory, config.run_id)
        return cls(toolbox, ChatFormat.load(model_path, config.model), limits, call_tools)

    def play(
        self, generate: Generate, rows: Sequence[Mapping[str, Any]], num_generations: int, params: SamplingParams
    ) -> tuple[list[Episode], list[EpisodeStart], list[Any], dict[str, Any]]:
        """num_generations episodes of each row: (episodes, starts, environments, the first turn's extra)."""
        starts, environments = episode_starts(self.toolbox, rows, num_generations)
        episodes, extra = play_episodes(generate, self.chat, starts, params, self.limits, self.call_tools)
        return episodes, starts, environments, extra

    def batch(
        self,
        generate: Generate,
        rows: Sequence[dict[str, Any]],
        num_generations: int,
        params: SamplingParams,
        *,
        run_id: str,
        step: int,
        columns: Sequence[str] = (),
        group_offset: int = 0,
    ) -> RolloutBatch:
        """`play` as a RolloutBatch (`RolloutBatch.from_generation`'s groups): each episode's turns as one
        completion, with its tool columns, messages (what reward functions get as completions) and
        environment."""
        episodes, starts, environments, extra = self.play(generate, rows, num_generations, params)
        decode = self.chat.tokenizer.decode
        played = GenerationResult(
            prompt_token_ids=[e.prompt_ids for e in episodes],
            completion_token_ids=[e.completion_ids for e in episodes],
            sampling_logprobs=[e.logprobs for e in episodes],
            finish_reasons=[e.finish_reason for e in episodes],
            texts=[decode(e.completion_ids, skip_special_tokens=True) for e in episodes],
            seconds=extra["generate_s"],
            extra={**extra, "prompt_texts": [decode(e.prompt_ids) for e in episodes]},
        )
        return RolloutBatch.from_generation(
            rows,
            played,
            run_id=run_id,
            step=step,
            columns=columns,
            group_offset=group_offset,
            tool_mask=[e.tool_mask for e in episodes],
            messages=[json.dumps(e.messages, ensure_ascii=False, default=str) for e in episodes],
            tool_calls=[e.tool_calls for e in episodes],
            tool_failures=[e.tool_failures for e in episodes],
            raw_prompt=[start.prompt for start in starts],  # as the toolbox started each episode
            completion_messages=[e.messages for e in episodes],
            environments=environments if self.toolbox.factories is not None else [],
        )


def check_episodes(config: Any, task: Any, model_path: str | Path, reward_names: Sequence[str] = ()) -> list[str]:
    """What a run with tools or environments needs, checked where it starts (prepare_run): the toolbox, the
    data set's prompts and `environment` column, and (for a model on disk) a chat template that carries
    tool calls. Returns the rewards environments add (their class names). One-line ValueErrors."""
    from grpo_flow.workers.tools.toolbox import check_rows, toolbox_for

    toolbox = toolbox_for(config.tools, config.environment_factory, config.run_id)
    check_rows(toolbox, "train", task.train)
    check_rows(toolbox, "heldout", task.heldout)
    if Path(model_path).is_dir():  # a hub model not downloaded yet is checked where it loads
        ChatFormat.load(model_path, config.model)
    for name in toolbox.reward_names:
        if name in reward_names or f"reward_{name}" in task.extra_columns:
            raise ValueError(
                f"environment_factory: the reward of {name} (its get_reward) is named like a reward function or "
                f"the data set column reward_{name}; rename one"
            )
    return toolbox.reward_names
