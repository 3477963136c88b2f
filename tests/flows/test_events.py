"""A step's event labels, and which of them grpo serve's guard automation matches, by Prefect's own server-side
trigger matching (tests/flows/test_automations.py runs the guard on a real server)."""

import math
from datetime import datetime, timezone
from uuid import uuid4

import pytest

from grpo_flow.deployments.automations import guard_automation
from grpo_flow.flows import events


def emitted(monkeypatch, row: dict, max_kl: float | None = None) -> dict:
    """The event step_completed emits for `row`, as Prefect's emit_event receives it."""
    calls: list[dict] = []
    monkeypatch.setattr("prefect.events.emit_event", lambda **event: calls.append(event))
    events.step_completed("r1", row, max_kl)
    (event,) = calls
    return event


@pytest.mark.parametrize(
    "reward, kl, max_kl, guard",
    [
        (0.5, 0.1, None, "ok"),
        (0.5, 9.0, None, "ok"),  # no limit: any KL is fine
        (0.5, 0.1, 0.2, "ok"),
        (0.5, 0.2, 0.2, "ok"),  # at the limit is not above it
        (0.5, 0.3, 0.2, "kl-above-limit"),
        (0.5, math.nan, 0.2, "kl-above-limit"),
        (0.5, None, 0.2, "ok"),  # beta 0: TRL computes no KL
        (math.nan, 0.3, 0.2, "reward-nan"),
    ],
)
def test_a_steps_labels_say_what_a_guard_stops_it_for(monkeypatch, reward, kl, max_kl, guard):
    row = {"step": 4, "reward": reward} | ({"kl": kl} if kl is not None else {})
    event = emitted(monkeypatch, row, max_kl)
    assert event["event"] == "grpo.step.completed"
    assert event["resource"]["prefect.resource.id"] == "grpo.run.r1"
    assert event["resource"]["grpo.guard"] == guard and event["resource"]["grpo.step"] == "4"
    assert event["resource"]["grpo.reward.finite"] == str(math.isfinite(reward)).lower()
    assert event["payload"]["reward"] == (reward if math.isfinite(reward) else None)  # JSON has no NaN


@pytest.mark.parametrize("guard, cancels", [("ok", False), ("reward-nan", True), ("kl-above-limit", True)])
def test_the_guard_matches_a_deployment_runs_tripped_step(guard, cancels):
    from prefect.server.events.schemas.automations import EventTrigger
    from prefect.server.events.schemas.events import ReceivedEvent

    trigger = EventTrigger.model_validate(guard_automation().trigger.model_dump())
    now = datetime.now(timezone.utc)

    def event(related: list[dict]) -> ReceivedEvent:
        resource = {"prefect.resource.id": "grpo.run.r1", "grpo.guard": guard}
        return ReceivedEvent(
            event="grpo.step.completed", resource=resource, related=related, payload={}, id=uuid4(), occurred=now
        )

    deployment = {"prefect.resource.id": "prefect.deployment.d1", "prefect.resource.role": "deployment"}
    assert trigger.covers(event([deployment])) is cancels
    assert trigger.covers(event([])) is False  # a `grpo train` run: no deployment to cancel it for
