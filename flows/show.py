"""How `grpo rollouts` and `grpo runs` show a run on the terminal.

    rows = chosen_rollouts(table.to_pylist(), min_reward=0.5, sort="advantage", limit=8)
    print("\n".join(group_lines(rows, reward_names(table.column_names))))
    print("\n".join(run_table(list_runs(root), root)))

A step's rollouts are shown a group at a time: the prompt once, then each of its completions with
its total reward, each reward function's score (the `reward_<name>` columns) and its advantage.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from typing import Any

NOT_REWARDS = ("reward_error",)  # a `reward_` column that is no reward function's score


def reward_names(columns: Sequence[str]) -> list[str]:
    """The reward functions whose scores a rollouts table holds, in column order."""
    return [c.removeprefix("reward_") for c in columns if c.startswith("reward_") and c not in NOT_REWARDS]


def _number(value: Any) -> float:
    """A score for comparing: None and NaN (no score) sort below every number."""
    return -math.inf if value is None or (isinstance(value, float) and math.isnan(value)) else float(value)


def chosen_rollouts(
    rows: list[dict[str, Any]],
    min_reward: float | None = None,
    max_reward: float | None = None,
    sort: str | None = None,
    limit: int | None = None,
) -> list[dict[str, Any]]:
    """The rows whose total reward lies in [min_reward, max_reward] (a row without one is left out when a
    bound is given), highest `sort` key first (`length`: completion tokens), the first `limit` of them."""
    if min_reward is not None:
        rows = [r for r in rows if _number(r["reward"]) >= min_reward]
    if max_reward is not None:
        rows = [r for r in rows if -math.inf < _number(r["reward"]) <= max_reward]
    if sort is not None:
        column = "completion_tokens" if sort == "length" else sort
        rows = sorted(rows, key=lambda r: _number(r[column]), reverse=True)
    return rows[:limit] if limit is not None else rows


def _score(value: Any) -> str:
    return "none" if _number(value) == -math.inf else f"{value:.3f}"


def _indented(text: str, prefix: str) -> list[str]:
    return [prefix + line for line in (text.splitlines() or [""])]


def completion_lines(row: dict[str, Any], names: Sequence[str]) -> list[str]:
    """One completion: its scores on one line, then its text (each turn, for a multi-turn episode)."""
    parts = ", ".join(f"{name} {_score(row.get('reward_' + name))}" for name in names)
    head = (
        f"  [{row['sample_index']}] reward {_score(row['reward'])}"
        + (f" ({parts})" if parts and list(names) != ["reward"] else "")
        + f"  advantage {row['advantage']:+.3f}  {row['completion_tokens']} tokens, {row['finish_reason']}"
    )
    if row.get("tool_calls"):
        head += f", {row['tool_calls']} tool call(s), {row['tool_failures']} failed"
    turns = json.loads(row["messages"]) if row.get("messages") else None
    if not turns:
        return [head, *_indented(row["completion"], "      ")]
    lines = [head]
    for turn in turns:
        calls = [f"{c['function']['name']}({c['function'].get('arguments')})" for c in turn.get("tool_calls") or []]
        text = str(turn.get("content") or "") + (f" -> calls {', '.join(calls)}" if calls else "")
        lines += _indented(f"{turn['role']}: {text}", "      ")
    return lines


def group_lines(rows: list[dict[str, Any]], names: Sequence[str]) -> list[str]:
    """Each group's prompt once, then its completions in the order given; groups in order of first appearance."""
    groups: dict[int, list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault(row["group_index"], []).append(row)
    lines: list[str] = []
    for index, members in groups.items():
        lines += [f"group {index}, prompt:", *_indented(members[0]["prompt"], "    ")]
        for row in members:
            lines += completion_lines(row, names)
        lines.append("")
    return lines


def _accuracy(summary: dict[str, Any]) -> str:
    """The newest held-out accuracy the run's summary has: after RL, else before it."""
    for key in ("final_eval_accuracy", "initial_eval_accuracy"):
        value = summary.get(key)
        if isinstance(value, (int, float)) and math.isfinite(value):
            return f"{value:.3f}"
    return "-"


def _short(name: str) -> str:
    """A model or data set as a column shows it: an absolute path by its last part."""
    prefix = "hf:" if name.startswith("hf:") else ""
    path = name.removeprefix(prefix)
    return prefix + os.path.basename(path.rstrip("/")) if os.path.isabs(path) else name


def run_table(runs: Sequence[Any], root: str) -> list[str]:
    """`grpo runs`: a line per run with its status, model, data set, steps and last held-out accuracy."""
    from grpo_flow.workers.state.storage import DamagedRunFileError, RunStorage

    table = [("run", "status", "model", "dataset", "steps", "accuracy")]
    notes = []
    for run in runs:
        storage = RunStorage(root, run.run_id)
        try:
            config = storage.effective_config()
        except DamagedRunFileError:
            config = {}
        summary = storage.read_summary() or {}
        last = "-" if run.last_step is None else str(run.last_step)
        total = summary.get("total_steps") or config.get("max_steps")
        steps = f"{last}/{total}" if total else last
        model, dataset = _short(str(config.get("model", "?"))), _short(str(config.get("dataset", "?")))
        table.append((run.run_id, run.status, model, dataset, steps, _accuracy(summary)))
        notes.append(f"  damaged: {len(run.damaged)} file(s), see below" if run.damaged else "")
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)) for row in table]
    return [lines[0].rstrip()] + [(line + note).rstrip() for line, note in zip(lines[1:], notes, strict=True)]
