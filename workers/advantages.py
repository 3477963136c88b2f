"""Group-relative advantages, as TRL computes them (sum_then_normalize).

    rewards: (B*G,) in group-major order, G = num_generations; NaN = unscorable
    returns: (B*G,) advantages and (B*G,) "group std is zero" flags
"""

from __future__ import annotations

import torch
from trl.trainer.utils import nanstd


def group_advantages(rewards: torch.Tensor, num_generations: int, scale_rewards: str) -> tuple[torch.Tensor, torch.Tensor]:
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
