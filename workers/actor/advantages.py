"""Group-relative advantages, as TRL's GRPOTrainer computes them.

    rewards: (B*G,) in group-major order, G = num_generations; NaN = unscorable
    returns: (B*G,) advantages and (B*G,) "reward std is zero" flags

`multi_objective_advantages` handles several reward functions with TRL's two aggregations:
`sum_then_normalize` (weighted sum, then group-relative) and `normalize_then_sum` (each
function normalised within its group, weighted sum, then normalised over the batch).
"""

from __future__ import annotations

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
