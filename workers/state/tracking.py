"""wandb, when a run asks for it (`report_to='wandb'`); one wandb run per grpo-flow run."""

from __future__ import annotations

import os
from typing import Any

from grpo_flow.schemas.config import GRPOFlowConfig

_RUNS: dict[str, Any] = {}


def wandb_dir() -> str | None:
    """WANDB_DIR as it is now: wandb reads its environment once per process, at the first init."""
    return os.environ.get("WANDB_DIR")


def wandb_log(config: GRPOFlowConfig, run_id: str, step: int, row: dict[str, Any]) -> None:
    import wandb

    if run_id not in _RUNS:
        _RUNS[run_id] = wandb.init(
            project=config.wandb_project,
            name=run_id,
            id=run_id,
            resume="allow",
            config=config.model_dump(mode="json"),
            dir=wandb_dir(),
        )
    numbers = {k: v for k, v in row.items() if isinstance(v, (int, float)) and k != "step"}
    _RUNS[run_id].log(numbers, step=step, commit=True)  # a step's row is complete when logged


def wandb_finish(run_id: str) -> None:
    run = _RUNS.pop(run_id, None)
    if run is not None:
        run.finish()
