"""wandb, when a run asks for it (`report_to='wandb'`); one wandb run per grpo-flow run."""

from __future__ import annotations

from typing import Any

from schemas.config import GRPOFlowConfig

_RUNS: dict[str, Any] = {}


def wandb_log(config: GRPOFlowConfig, run_id: str, step: int, row: dict[str, Any]) -> None:
    import wandb

    if run_id not in _RUNS:
        _RUNS[run_id] = wandb.init(
            project=config.wandb_project, name=run_id, id=run_id, resume="allow", config=config.model_dump(mode="json")
        )
    numbers = {k: v for k, v in row.items() if isinstance(v, (int, float)) and k != "step"}
    _RUNS[run_id].log(numbers, step=step, commit=True)  # a step's row is complete when logged


def wandb_finish(run_id: str) -> None:
    run = _RUNS.pop(run_id, None)
    if run is not None:
        run.finish()
