"""Fault injection for testing fault tolerance: fail, or die with SIGKILL, at a chosen stage of a step.

A spec is `stage@step` (raise), `stage@step:kill` (SIGKILL this process, as a preempted
machine would), for example `generate@5:kill`, or `stage@step:hang` (stop there, holding
everything, until killed: a second process can then meet a live writer). It comes from the `grpo` flow's `fail_at`
parameter or from the GRPO_FLOW_FAIL_AT environment variable. Stages, in step order:
generate, score, actor (rollouts are logged, the actor has not stepped), checkpoint (files
staged, not committed), checkpointed (just committed), metrics. One more, `engine@step`, kills
not this process but rollout worker 0's engine process (an engine with a `pid`: the vLLM
engine) just before it generates that step, once per process: the run must heal itself (the
shard's retry restarts the engine).
"""

from __future__ import annotations

import os
import signal
import time

STAGES = ("generate", "score", "actor", "checkpoint", "checkpointed", "metrics", "engine")
ENV_VAR = "GRPO_FLOW_FAIL_AT"
_ENGINES_KILLED: set[int] = set()  # steps whose engine kill already happened in this process


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


def maybe_kill_engine(step: int, shard: int, engine: object, spec: str | None = None) -> None:
    """SIGKILL rollout worker 0's engine process at `engine@step` (once): a crashed engine mid-step."""
    spec = spec or os.environ.get(ENV_VAR)
    if not spec or shard != 0:
        return
    wanted_stage, wanted_step, _ = parse_fail_at(spec)
    pid = getattr(engine, "pid", None)
    if (wanted_stage, wanted_step) != ("engine", step) or step in _ENGINES_KILLED or pid is None:
        return
    _ENGINES_KILLED.add(step)
    os.kill(pid, signal.SIGKILL)
