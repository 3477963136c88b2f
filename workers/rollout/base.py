"""What every rollout engine shares: sampling parameters, the result record, prompt encoding.

No torch here: the Prefect side (tasks, flows) imports these records without loading a model
library, and every engine (transformers, the out-of-process one, vLLM) returns the same
`GenerationResult`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, cast

# Text, a conversation, or token ids taken as they are (a multi-turn episode's next turn: workers/rollout/episodes.py).
Prompt = str | list[dict[str, str]] | list[int]


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    greedy: bool = False
    seed: int = 0


@dataclass
class GenerationResult:
    """Prompt-major: completions [i*n, (i+1)*n) belong to prompt i."""

    prompt_token_ids: list[list[int]]
    completion_token_ids: list[list[int]]
    sampling_logprobs: list[list[float]]
    finish_reasons: list[str]
    texts: list[str]
    seconds: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)


class RolloutEngine(Protocol):
    """What every rollout engine offers (transformers in this process, transformers in a child process,
    vLLM in this process or in a process of the vLLM environment). Engines are plain classes: the backends
    decide where they run (workers/backends/servers.py).

    `model` is None until `load()` and after the engine's process died; `policy_version` names the
    weights it holds (0: the initial model). Weight sync's file methods (workers/backends/weight_sync.py)
    use `recreate` and, on vLLM engines, `reload_weights_from`, `load_lora_adapter`, `sleep`, `wake_up`.
    """

    worker_id: str
    policy_version: int
    tokenizer: Any

    @property
    def model(self) -> Any: ...

    def load(self) -> None:
        """The initial model (version 0), whatever the engine held before; a dead engine process starts again."""
        ...

    def generate(
        self, prompts: list[Prompt], params: SamplingParams, max_prompt_length: int | None = None
    ) -> GenerationResult: ...

    def load_state_dict(self, weights: Any, version: int, adapter_config: Any = None) -> None:
        """The actor's weights (or, with a peft `adapter_config`, its LoRA adapter) in memory, as `version`."""
        ...

    def recreate(self, model_path: str | Path, version: int) -> None:
        """A fresh engine on a saved model folder (the `checkpoint` weight sync)."""
        ...

    def close(self) -> None:
        """End what the engine runs (its process, its memory); `load()` starts it again."""
        ...


def encode_prompt(tokenizer: Any, prompt: Prompt, max_prompt_length: int | None) -> list[int]:
    """Token ids of a plain or conversational prompt (chat template), truncated from the left; token ids
    are taken as they are."""
    if isinstance(prompt, list) and all(isinstance(token, int) for token in prompt) and prompt:
        ids = cast(list[int], prompt)
    elif isinstance(prompt, str):
        ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    else:
        ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True, return_dict=False)
    if max_prompt_length is not None and len(ids) > max_prompt_length:
        ids = ids[-max_prompt_length:]
    return list(ids)


def check_chat_prompts(load_tokenizer: Callable[[], Any], model: str, splits: dict[str, Any]) -> None:
    """Conversational prompts need the model's chat template, and the template must take their
    messages: checked on one prompt of each sequence of roles, so a problem is named (split, row)
    before any model loads, not at generation. The tokenizer is loaded at the first such prompt:
    plain-text data needs none."""
    seen: set[tuple[str, ...]] = set()
    tokenizer = None
    for split, prompts in splits.items():
        for row, prompt in enumerate(prompts):
            if isinstance(prompt, str):
                continue
            if tokenizer is None:
                tokenizer = load_tokenizer()
            if tokenizer.chat_template is None:
                raise ValueError(
                    f"dataset: {split} row {row} is a list of messages, but the tokenizer of model {model!r} has "
                    "no chat template; give plain-text prompts, or a model with a chat template"
                )
            roles = tuple(str(message.get("role")) for message in prompt)
            if roles in seen:
                continue
            seen.add(roles)
            try:
                tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
            except Exception as error:
                reason = " ".join(str(error).split())
                raise ValueError(
                    f"dataset: {split} row {row}: the chat template of model {model!r} refuses its messages "
                    f"(roles {list(roles)}): {type(error).__name__}: {reason}"
                ) from None


def string_prompts_warning(
    string_prompts: str, prompt: Prompt, load_tokenizer: Callable[[], Any], model: str
) -> str | None:
    """What a user of a chat model with plain-string prompts is told at the start, under TRL's rule
    (`string_prompts` raw): that the strings go untemplated, and the option that templates them. None for
    message prompts, `user_message`, or a model without a chat template. `prompt`: the data set's first;
    the tokenizer is loaded only for a string one."""
    if string_prompts != "raw" or not isinstance(prompt, str) or load_tokenizer().chat_template is None:
        return None
    return (
        f"dataset: the prompts are plain strings and model {model!r} has a chat template; as in TRL, a string "
        "prompt goes to the model as raw text, without the template (only a list of messages is rendered with "
        "it): --string-prompts user_message (string_prompts='user_message') sends each as a user message"
    )


def load_generation_tokenizer(model_path: str | Path) -> Any:
    """The model's tokenizer as generation needs it: prompts padded on the left, a pad token (EOS if none)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path, padding_side="left")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer
