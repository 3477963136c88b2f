"""wandb, when a run asks for it (`report_to='wandb'`); one wandb run per grpo-flow run.

A tracker never fails a run: the metrics Parquet is the record. Each step's row is delivered or
counted as not delivered (`undelivered(run_id)`, in the run's summary), and the first failure is
said once, for the console. A wandb that cannot start (no login) is not tried again for the run.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from grpo_flow.schemas.config import GRPOFlowConfig

_RUNS: dict[str, Any] = {}


@dataclass
class Delivery:
    """What became of a run's rows in this process: how many were not delivered, and why the first was not."""

    undelivered: int = 0
    first_failure: str | None = None
    cannot_start: bool = False


_DELIVERY: dict[str, Delivery] = {}


def undelivered(run_id: str) -> int:
    """Rows of the run that wandb did not get in this process."""
    return _DELIVERY[run_id].undelivered if run_id in _DELIVERY else 0


def wandb_dir() -> str | None:
    """WANDB_DIR as it is now: wandb reads its environment once per process, at the first init."""
    return os.environ.get("WANDB_DIR")


def wandb_log(config: GRPOFlowConfig, run_id: str, step: int, row: dict[str, Any]) -> str | None:
    """Send a step's row to the run's wandb run. Returns None when delivered; otherwise the row is counted
    as not delivered, and the first failure of the run comes back as a line to show (later ones: "")."""
    delivery = _DELIVERY.setdefault(run_id, Delivery())
    try:
        if delivery.cannot_start:
            raise RuntimeError(delivery.first_failure)
        import wandb

        if run_id not in _RUNS:
            try:
                _RUNS[run_id] = wandb.init(
                    project=config.wandb_project,
                    name=run_id,
                    id=run_id,
                    resume="allow",
                    config=config.model_dump(mode="json"),
                    dir=wandb_dir(),
                )
            except Exception:
                delivery.cannot_start = True
                raise
        numbers = {k: v for k, v in row.items() if isinstance(v, (int, float)) and k != "step"}
        _RUNS[run_id].log(numbers, step=step, commit=True)  # a step's row is complete when logged
        return None
    except Exception as error:  # a tracker must not fail the run: the Parquet row is the record
        delivery.undelivered += 1
        if delivery.first_failure is not None:
            return ""
        delivery.first_failure = " ".join(f"{type(error).__name__}: {error}".split())
        return (
            f"wandb: step {step}'s metrics were not delivered ({delivery.first_failure}); the run goes on, its "
            "metrics are in metrics/*.parquet, and the summary counts the steps wandb did not get"
        )


def wandb_finish(run_id: str) -> None:
    _DELIVERY.pop(run_id, None)
    run = _RUNS.pop(run_id, None)
    if run is not None:
        try:
            run.finish()
        except Exception:  # what was not sent is counted already; the run's outcome is not wandb's
            pass
