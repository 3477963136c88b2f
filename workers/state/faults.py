"""Fault injection for testing fault tolerance: fail, or die with SIGKILL, at a chosen stage of a step.

A spec is `stage@step` (raise), `stage@step:kill` (SIGKILL this process, as a preempted
machine would), for example `generate@5:kill`, or `stage@step:hang` (stop there, holding
everything, until killed: a second process can then meet a live writer). It comes from the `grpo` flow's `fail_at`
parameter or from the GRPO_FLOW_FAIL_AT environment variable. Stages, in step order:
generate, score, actor (rollouts are logged, the actor has not stepped), checkpoint (files
staged, not committed), checkpointed (just committed), metrics.
"""

from __future__ import annotations

import os
import signal
import time

STAGES = ("generate", "score", "actor", "checkpoint", "checkpointed", "metrics")
ENV_VAR = "GRPO_FLOW_FAIL_AT"


class InjectedFault(RuntimeError):
    """The failure a `fail_at` spec asked for."""


MODES = ("", "kill", "hang")


def parse_fail_at(spec: str) -> tuple[str, int, str]:
    """`generate@5:kill` -> ("generate", 5, "kill"); a bad spec is a ValueError naming fail_at."""
    target, _, mode = spec.partition(":")
    stage, _, step = target.partition("@")
    if stage not in STAGES or not step.isdigit() or mode not in MODES:
        raise ValueError(
            f"fail_at: {spec!r} is not 'stage@step', 'stage@step:kill' or 'stage@step:hang' with a stage in {STAGES}"
        )
    return stage, int(step), mode


def maybe_fail(stage: str, step: int, spec: str | None = None) -> None:
    spec = spec or os.environ.get(ENV_VAR)
    if not spec:
        return
    wanted_stage, wanted_step, mode = parse_fail_at(spec)
    if (wanted_stage, wanted_step) != (stage, step):
        return
    if mode == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    while mode == "hang":
        time.sleep(60)
    raise InjectedFault(f"injected failure at stage {stage!r} of step {step} (fail_at={spec!r})")
