"""Fault injection for testing fault tolerance: fail, or die with SIGKILL, at a chosen stage of a step.

A spec is `stage@step` (raise), `stage@step:kill` (SIGKILL this process, as a preempted
machine would), for example `generate@5:kill`, or `stage@step:hang` (stop there, holding
everything, until killed: a second process can then meet a live writer). It comes from one place:
the GRPO_FLOW_FAIL_AT environment variable (`grpo train --fail-at`, a deployment's worker), or
`with injected(spec):` around a run in this process. Stages, in step order:
generate, score, actor (rollouts are logged, the actor has not stepped), checkpoint (files
staged, not committed), checkpointed (just committed), metrics. One more, `engine@step`, kills
not this process but rollout worker 0's engine process (an engine with a `pid`: the vLLM
engine) just before it generates that step, once per process: the run must heal itself (the
shard's retry restarts the engine).
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator

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


def fail_at() -> str | None:
    """The spec in force, checked (a bad one is a ValueError naming fail_at)."""
    spec = os.environ.get(ENV_VAR) or None
    if spec:
        parse_fail_at(spec)
    return spec


@contextlib.contextmanager
def injected(spec: str) -> Iterator[None]:
    """`spec` in force inside the block (for this process and the engine processes it starts)."""
    parse_fail_at(spec)
    saved = os.environ.get(ENV_VAR)
    os.environ[ENV_VAR] = spec
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(ENV_VAR, None)
        else:
            os.environ[ENV_VAR] = saved


def maybe_fail(stage: str, step: int) -> None:
    spec = fail_at()
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


def maybe_kill_engine(step: int, shard: int, pid: int | None) -> None:
    """SIGKILL rollout worker 0's engine process (`pid`) at `engine@step` (once): a crashed engine mid-step."""
    spec = fail_at()
    if not spec or shard != 0 or pid is None:
        return
    wanted_stage, wanted_step, _ = parse_fail_at(spec)
    if (wanted_stage, wanted_step) != ("engine", step) or step in _ENGINES_KILLED:
        return
    _ENGINES_KILLED.add(step)
    os.kill(pid, signal.SIGKILL)
