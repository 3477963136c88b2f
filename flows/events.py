"""The Prefect events a run emits, from its flow process (docs/events.md lists their payloads).

    grpo.run.started        when the loop starts (a resumed run emits it again)
    grpo.step.completed     every step: its metrics row, as logged in metrics/step-N.parquet
    grpo.checkpoint.saved   every checkpoint: step, path, policy version, run id, storage root
    grpo.run.finished       completed, or stopped between steps (summary.json's status)
    grpo.run.failed         a step failed: the error and the step

The resource is the run, `grpo.run.<run_id>`. They are emitted in the `grpo` flow run's own context
(never inside a step subflow), so Prefect relates each to that flow run, its flow and its deployment.
Emitting only queues the event for Prefect's events worker, which sends it in the background: an
event never changes what is trained, and with no server listening it is dropped.

JSON has no NaN: a non-finite number is sent as null. A step's resource carries the labels an
automation's trigger can match on (they match strings, not numbers): `grpo.reward.finite` (`true` or
`false`) and `grpo.guard`, what a guard should stop the run for: `reward-nan`, `kl-above-limit` (its `kl`
above the run's guard_max_kl) or `ok`.
"""

from __future__ import annotations

import math
from typing import Any

RUN_STARTED = "grpo.run.started"
STEP_COMPLETED = "grpo.step.completed"
CHECKPOINT_SAVED = "grpo.checkpoint.saved"
RUN_FINISHED = "grpo.run.finished"
RUN_FAILED = "grpo.run.failed"


def run_resource(run_id: str) -> dict[str, str]:
    """The resource every event of a run is about."""
    return {"prefect.resource.id": f"grpo.run.{run_id}", "prefect.resource.name": run_id}


def json_value(value: Any) -> Any:
    """A payload value JSON can carry: non-finite floats as None, anything unknown as its text."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, dict):
        return {str(key): json_value(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_value(item) for item in value]
    return str(value)


def emit(event: str, run_id: str, payload: dict[str, Any], labels: dict[str, str] | None = None) -> None:
    """Queue `event` about run `run_id` (Prefect adds the flow run, flow and deployment it runs under)."""
    from prefect.events import emit_event

    emit_event(event=event, resource={**run_resource(run_id), **(labels or {})}, payload=json_value(payload))


GUARD_LABEL = "grpo.guard"
GUARD_TRIPPED = ("reward-nan", "kl-above-limit")


def guard_verdict(row: dict[str, Any], max_kl: float | None = None) -> str:
    """What a guard should stop the run for at this step: `reward-nan`, `kl-above-limit` or `ok`."""
    reward, kl = row.get("reward"), row.get("kl")
    if not (isinstance(reward, (int, float)) and math.isfinite(reward)):
        return GUARD_TRIPPED[0]
    above = max_kl is not None and isinstance(kl, (int, float)) and not kl <= max_kl  # a NaN KL is above too
    return GUARD_TRIPPED[1] if above else "ok"


def step_completed(run_id: str, row: dict[str, Any], max_kl: float | None = None) -> None:
    """`grpo.step.completed` with the step's metrics row, labelled for the guards (see above)."""
    verdict = guard_verdict(row, max_kl)
    finite = verdict != GUARD_TRIPPED[0]  # the reward: a NaN reward is the first thing a guard stops for
    labels = {"grpo.step": str(row["step"]), "grpo.reward.finite": str(finite).lower()}
    emit(STEP_COMPLETED, run_id, row, {**labels, GUARD_LABEL: verdict})
