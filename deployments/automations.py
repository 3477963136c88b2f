"""The Prefect automations `grpo serve` creates, by name, replacing an older one of the same name.

    grpo-resume    a `grpo/<preset>` deployment run that crashes (its process killed, the machine
                   lost), or whose loop fails at a step (`grpo.run.failed`), starts a new run of the
                   same deployment with the same run id: it resumes from the run's last checkpoint,
                   as `grpo train --resume` does.

    grpo-guard     a `grpo.step.completed` of a grpo deployment run whose reward is not finite (NaN:
                   no reward function applied to any completion), or whose KL is above the run's
                   guard_max_kl (`grpo serve --max-kl`), cancels that flow run. `grpo serve`
                   then ends it with SIGTERM during the next step: the run is recorded `interrupted`
                   after the step that tripped the guard, whose rows are kept, and is not resumed.

Beside them, `grpo serve --gpu-slots N` (default 1) sets the global concurrency limit `grpo-gpu`: each
grpo deployment run holds one of its N slots from its first step to its end (deployments/grpo.py), so
two runs started together take the machine's accelerators one after the other; 0 removes the limit.

A run that fails on bad input emits no `grpo.run.failed` (it fails before its loop starts) and ends
Failed, not Crashed, so it is never resumed. The automation passes `auto_resume_limit` with the run
id; the resumed run counts the run's resumes (`resumes/`, resumes by hand included) and refuses to
start once there were that many, so a run that crashes every time is resumed at most K times.

The server's automations service matches the events and runs the action: nothing here runs in the
flow process.
"""

from __future__ import annotations

import contextlib
from typing import Any

GPU_LIMIT = "grpo-gpu"
RESUME_AUTOMATION = "grpo-resume"
GUARD_AUTOMATION = "grpo-guard"
DEFAULT_MAX_RESUMES = 3


def resume_automation(max_resumes: int) -> Any:
    """`grpo-resume`, which resumes a crashed or failed grpo deployment run at most `max_resumes` times."""
    from prefect.automations import Automation
    from prefect.events.actions import RunDeployment
    from prefect.events.schemas.automations import EventTrigger, Posture

    trigger = EventTrigger(
        expect={"prefect.flow-run.Crashed", "grpo.run.failed"},
        # A run of the `grpo` flow (not its grpo-step subflows) started from a deployment.
        match_related=[
            {"prefect.resource.role": "flow", "prefect.resource.name": "grpo"},
            {"prefect.resource.role": "deployment"},
        ],
        posture=Posture.Reactive,
        threshold=1,
    )
    # The flow run is named after its run id, and grpo.run.failed's resource is the run: either
    # way the event's resource name is the run id.
    action = RunDeployment(
        source="inferred", parameters={"run_id": "{{ event.resource.name }}", "auto_resume_limit": max_resumes}
    )
    return Automation(
        name=RESUME_AUTOMATION,
        description=f"Resume a crashed or failed grpo deployment run from its last checkpoint (at most "
        f"{max_resumes} times). Created by `grpo serve`.",
        trigger=trigger,
        actions=[action],
    )


def guard_automation() -> Any:
    """`grpo-guard`, which cancels a grpo deployment run at a step whose reward is NaN or whose KL is above
    the run's guard_max_kl."""
    from prefect.automations import Automation
    from prefect.events.actions import CancelFlowRun
    from prefect.events.schemas.automations import EventTrigger, Posture

    from grpo_flow.flows.events import GUARD_LABEL, GUARD_TRIPPED

    trigger = EventTrigger(
        expect={"grpo.step.completed"},
        match={GUARD_LABEL: list(GUARD_TRIPPED)},  # the label flows/events.py puts on the step's resource
        match_related={"prefect.resource.role": "deployment"},
        posture=Posture.Reactive,
        threshold=1,
    )
    # The action cancels the flow run the event is related to: the run's own (events are emitted there).
    return Automation(
        name=GUARD_AUTOMATION,
        description="Cancel a grpo deployment run at a step whose reward is NaN or whose KL is above its "
        "guard_max_kl (`grpo serve --max-kl`). Created by `grpo serve`.",
        trigger=trigger,
        actions=[CancelFlowRun()],
    )


def put_automation(automation: Any) -> None:
    """Create `automation`, or replace the one of the same name (so serving again changes nothing)."""
    from prefect.automations import Automation

    try:
        existing = Automation.read(name=automation.name)
    except ValueError:  # none of that name
        automation.create()
        return
    automation.id = existing.id
    automation.update()


def delete_automation(name: str) -> None:
    """Remove the automation `name`, if there is one (`grpo serve --no-auto-resume`)."""
    from prefect.automations import Automation

    try:
        Automation.read(name=name).delete()
    except ValueError:
        pass


def set_up_automations(auto_resume: bool, max_resumes: int, nan_guard: bool = True) -> str | None:
    """The automations as the options ask; returns a one-line warning when the server refuses them."""
    wanted = {RESUME_AUTOMATION: auto_resume, GUARD_AUTOMATION: nan_guard}
    try:
        for name, on in wanted.items():
            if not on:
                delete_automation(name)
            else:
                put_automation(resume_automation(max_resumes) if name == RESUME_AUTOMATION else guard_automation())
    except Exception as error:  # an old server or one without the permission: training works without it
        return f"could not set up automation {name} ({first_line(error)}); runs are neither resumed nor guarded automatically"
    return None


def set_gpu_slots(slots: int) -> str | None:
    """The `grpo-gpu` limit with `slots` slots (none with 0); returns a one-line warning when the server
    refuses it."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    try:
        with get_client(sync_client=True) as client:
            if slots:
                client.upsert_global_concurrency_limit_by_name(GPU_LIMIT, slots)
            else:
                with contextlib.suppress(ObjectNotFound):
                    client.delete_global_concurrency_limit_by_name(GPU_LIMIT)
    except Exception as error:
        return f"could not set the {GPU_LIMIT} concurrency limit ({first_line(error)}); runs may share the accelerators"
    return None


def first_line(error: Exception) -> str:
    """What a server's refusal says, in one line (its class name when it says nothing)."""
    return (str(error).strip().splitlines() or [type(error).__name__])[0]
