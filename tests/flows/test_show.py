"""`grpo rollouts` a group at a time, filtered and sorted; `grpo runs` with model, data, steps and accuracy."""

import json

from grpo_flow.flows.show import chosen_rollouts, group_lines, reward_names


def row(group, sample, reward, advantage, tokens, completion="42", **extra):
    return {
        "group_index": group,
        "sample_index": sample,
        "prompt": f"What is {group} + 40?",
        "completion": completion,
        "reward": reward,
        "reward_correct": reward,
        "reward_short": 0.5,
        "advantage": advantage,
        "completion_tokens": tokens,
        "finish_reason": "stop",
        **extra,
    }


ROWS = [row(0, 0, 1.0, 0.5, 3), row(0, 1, 0.0, -0.5, 9), row(1, 0, 0.5, 0.0, 5), row(1, 1, None, 0.0, 1)]


def test_reward_functions_are_the_reward_columns_but_the_error():
    assert reward_names(["reward", "reward_error", "reward_correct", "reward_short", "advantage"]) == [
        "correct",
        "short",
    ]


def test_each_prompt_is_shown_once_then_its_completions_with_every_score():
    lines = group_lines(ROWS, ["correct", "short"])
    assert [line for line in lines if line.startswith("group")] == ["group 0, prompt:", "group 1, prompt:"]
    assert sum("What is 0 + 40?" in line for line in lines) == 1
    assert lines[2] == "  [0] reward 1.000 (correct 1.000, short 0.500)  advantage +0.500  3 tokens, stop"
    assert lines[3] == "      42"
    assert "  [1] reward none (correct none, short 0.500)  advantage +0.000  1 tokens, stop" in lines


def test_filters_by_reward_and_sorts_highest_first():
    assert [(r["group_index"], r["sample_index"]) for r in chosen_rollouts(ROWS, min_reward=0.5)] == [(0, 0), (1, 0)]
    assert [r["reward"] for r in chosen_rollouts(ROWS, max_reward=0.5)] == [0.0, 0.5]  # no score: left out
    assert [r["advantage"] for r in chosen_rollouts(ROWS, sort="advantage")] == [0.5, 0.0, 0.0, -0.5]
    assert [r["completion_tokens"] for r in chosen_rollouts(ROWS, sort="length", limit=2)] == [9, 5]
    assert [r["reward"] for r in chosen_rollouts(ROWS, sort="reward")][:3] == [1.0, 0.5, 0.0]


def test_an_episode_is_shown_turn_by_turn():
    turns = [
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "add", "arguments": {"a": 2}}}]},
        {"role": "tool", "content": "42"},
        {"role": "assistant", "content": "42"},
    ]
    episode = row(0, 0, 1.0, 0.0, 12, messages=json.dumps(turns), tool_calls=1, tool_failures=0)
    lines = group_lines([episode], ["correct"])
    assert lines[2].endswith("12 tokens, stop, 1 tool call(s), 0 failed")
    assert lines[3:6] == [
        "      assistant:  -> calls add({'a': 2})",
        "      tool: 42",
        "      assistant: 42",
    ]
