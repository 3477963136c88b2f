"""Group-relative advantages, as TRL's GRPOTrainer computes them.

    rewards: (B*G,) in group-major order, G = num_generations; NaN = unscorable
    returns: (B*G,) advantages and (B*G,) "reward std is zero" flags

`step_advantages` applies it to a step's per-function scores with a run's options, and
`reward_stats` gives the step's reward statistics under TRL's metric names.
`multi_objective_advantages` handles several reward functions with TRL's two aggregations:
`sum_then_normalize` (weighted sum, then group-relative) and `normalize_then_sum` (each
function normalised within its group, weighted sum, then normalised over the batch).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from trl.trainer.utils import nanstd


def group_advantages(
    rewards: torch.Tensor, num_generations: int, scale_rewards: str
) -> tuple[torch.Tensor, torch.Tensor]:
    grouped = rewards.view(-1, num_generations)
    mean = torch.nanmean(grouped, dim=1).repeat_interleave(num_generations)
    if scale_rewards in ("group", "none"):
        std = nanstd(grouped, dim=1).repeat_interleave(num_generations)
    elif scale_rewards == "batch":
        std = nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
    else:
        raise ValueError(f"scale_rewards: unknown value {scale_rewards!r}; use 'group', 'batch' or 'none'")
    advantages = rewards - mean
    if scale_rewards != "none":
        advantages = advantages / (std + 1e-4)
    # An unscorable completion (every reward None) gets no credit either way.
    advantages = torch.nan_to_num(advantages, nan=0.0)
    return advantages, torch.isclose(std, torch.zeros_like(std))


def multi_objective_advantages(
    rewards_per_func: torch.Tensor,
    weights: torch.Tensor,
    num_generations: int,
    scale_rewards: str,
    aggregation: str = "sum_then_normalize",
) -> tuple[torch.Tensor, torch.Tensor]:
    """rewards_per_func: (B*G, K), NaN where a function returned None; weights: (K,)."""
    unscorable = torch.isnan(rewards_per_func).all(dim=1)
    if aggregation == "sum_then_normalize":
        rewards = (rewards_per_func * weights.unsqueeze(0)).nansum(dim=1)
        rewards[unscorable] = torch.nan
        return group_advantages(rewards, num_generations, scale_rewards)
    if aggregation != "normalize_then_sum":
        raise ValueError(f"multi_objective_aggregation: unknown value {aggregation!r}")
    grouped = rewards_per_func.view(-1, num_generations, rewards_per_func.size(1))
    normalised = (grouped - torch.nanmean(grouped, dim=1, keepdim=True)) / (nanstd(grouped, dim=1, keepdim=True) + 1e-4)
    rewards = (normalised.view_as(rewards_per_func) * weights.unsqueeze(0)).nansum(dim=1)
    rewards[unscorable] = torch.nan
    std = nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
    advantages = torch.nan_to_num((rewards - torch.nanmean(rewards)) / (std + 1e-4), nan=0.0)
    return advantages, torch.isclose(std, torch.zeros_like(std))


def step_advantages(config: Any, per_function: dict[str, list[float | None]]) -> tuple[torch.Tensor, torch.Tensor]:
    """TRL's advantages from each reward function's scores (None: not applicable), weighted and
    aggregated by the run's reward_weights and multi_objective_aggregation. Columns past the reward
    functions' are environments' rewards (get_reward), weight 1 as in TRL."""
    matrix = torch.tensor(
        [[math.nan if s is None else s for s in scores] for scores in per_function.values()], dtype=torch.float32
    ).T
    given = list(config.reward_weights or [])
    weights = torch.tensor(given + [1.0] * (matrix.size(1) - len(given)), dtype=torch.float32)
    return multi_objective_advantages(
        matrix, weights, config.num_generations, config.scale_rewards, config.multi_objective_aggregation
    )


def reward_stats(
    rewards: torch.Tensor,
    std_is_zero: torch.Tensor,
    reward_columns: dict[str, list[float | None]],
    lengths: list[int],
    finish_reasons: list[str],
) -> dict[str, float]:
    """A step's reward and completion statistics, under TRL's metric names."""
    rewarded = rewards[~rewards.isnan()]  # a step where no completion got a reward has none
    stats = {
        "reward": float(torch.nanmean(rewards)),
        "reward_std": float(rewarded.std()) if rewarded.numel() > 1 else 0.0,
        "frac_reward_zero_std": float(std_is_zero.float().mean()),
        "completions/mean_length": float(np.mean(lengths)),
        "completions/max_length": float(np.max(lengths)),
        "completions/clipped_ratio": float(np.mean([reason == "length" for reason in finish_reasons])),
    }
    for name, column in reward_columns.items():
        scores = torch.tensor([np.nan if s is None else s for s in column], dtype=torch.float64)
        applied = scores[~scores.isnan()]
        stats[f"rewards/{name}/mean"] = float(torch.nanmean(scores))
        stats[f"rewards/{name}/std"] = float(applied.std()) if applied.numel() > 1 else 0.0
    return stats
