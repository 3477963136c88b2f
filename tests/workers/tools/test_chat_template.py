"""`chat_template`: a model whose own template cannot render tools (the tiny one has none; SmolLM2's
drops them) plays tool-calling episodes with one of TRL's templates."""

import json
import shutil

import pytest

from grpo_flow.schemas.config import GRPOFlowConfig
from grpo_flow.schemas.config import trl_chat_templates
from grpo_flow.workers.data.models import resolve_model_path
from grpo_flow.workers.rollout.base import GenerationResult, SamplingParams
from grpo_flow.workers.rollout.episodes import ChatFormatError, EpisodeRunner

TOOL = "tests.workers.tools.fixture_tools:add"


def scripted(tokenizer, turns):
    """A `generate` that answers each turn with the next text of `turns`, as token ids."""

    def generate(contexts, params):
        text = turns.pop(0)
        ids = [tokenizer(text, add_special_tokens=False)["input_ids"] for _ in contexts]
        return GenerationResult(contexts, ids, [[0.0] * len(i) for i in ids], ["stop"] * len(ids), [text] * len(ids))

    return generate


def test_trls_templates_are_listed_and_a_name_or_file_is_taken(tmp_path):
    assert {"qwen2_5", "llama3_2"} <= set(trl_chat_templates())
    template = tmp_path / "mine.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    assert GRPOFlowConfig(chat_template=str(template)).chat_template == str(template.resolve())
    with pytest.raises(ValueError, match="'qwen9' is neither a template file nor one of TRL's templates: cohere"):
        GRPOFlowConfig(chat_template="qwen9")


def long_context_tiny(storage_root, folder):
    """The tiny model with a context long enough for qwen2_5's tools preamble (rotary positions: no weights change)."""
    shutil.copytree(resolve_model_path("tiny", storage_root), folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 2048}))
    return str(folder)


def test_the_tiny_model_plays_a_tool_episode_with_trls_qwen2_5_template(storage_root, tmp_path):
    model = long_context_tiny(storage_root, tmp_path / "tiny-long")
    config = GRPOFlowConfig(
        model=model,
        chat_template="qwen2_5",
        tools=[TOOL],
        sandbox_tools=False,
        max_prompt_length=2048,
        storage_root=str(tmp_path),
    )
    with pytest.raises(ChatFormatError, match="has no chat template"):  # the model's own: none
        EpisodeRunner.from_config(config, model)
    runner = EpisodeRunner.from_config(config, resolve_model_path(model, tmp_path, config.chat_template))
    call = {"name": "add", "arguments": {"a": 2, "b": 3}}
    turns = [f"<tool_call>\n{json.dumps(call)}\n</tool_call><|im_end|>", "It is 5.<|im_end|>"]
    rows = [{"prompt": [{"role": "user", "content": "What is 2 + 3?"}]}]
    episodes, *_ = runner.play(scripted(runner.chat.tokenizer, turns), rows, 1, SamplingParams(n=1, max_tokens=200))
    (episode,) = episodes
    assert episode.tool_calls == 1 and episode.tool_failures == 0
    assert [m["role"] for m in episode.messages] == ["assistant", "tool", "assistant"]
    assert episode.messages[1]["content"] == "5"
    assert "<|im_start|>system" in runner.chat.tokenizer.decode(episode.prompt_ids)  # qwen2_5's tools preamble
