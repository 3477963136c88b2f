"""The deployments, built once for `grpo serve` and for the work-pool helper.

    grpo/tiny  grpo/smol-math  grpo/gsm8k  grpo/math  grpo/mbpp    a run from the preset (deployments/grpo.py)
    evaluate/nightly                                flows/evaluate.py's sweep, cron 02:00
    evaluate/checkpoint                             one checkpoint, on every grpo.checkpoint.saved

Each deployment's parameters are visible defaults (`prefect deployment inspect grpo/tiny`):
`preset` and `storage_root` for the grpo ones; `storage_root`, `k` and `prompts` for the
nightly evaluation. `storage_root` is made absolute here, because a flow run may start in
another working directory (a process worker's).

The nightly schedule: cron `0 2 * * *` in UTC unless told otherwise, by option or by the
environment (GRPO_FLOW_NIGHTLY_CRON, GRPO_FLOW_NIGHTLY_TZ, an IANA name such as
Europe/Berlin); Prefect's scheduler evaluates the cron in that time zone, daylight saving
included.

Entrypoints are module paths (`grpo_flow.deployments.grpo.grpo_preset`, `grpo_flow.flows.evaluate.evaluate`),
not file paths relative to where `grpo serve` was started, so a flow run finds its code from
any working directory where grpo-flow is installed.

Stopping (Ctrl-C, SIGTERM) is bounded: Prefect pauses the schedules on the way out, and with the
server gone its client retries each call for minutes, while its SIGTERM handler waits on the same
client. Here the pause gets `PAUSE_TIMEOUT_S`, the whole stop `STOP_GRACE_S`, and a second signal
ends the process at once.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import threading
import warnings
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from prefect.deployments.runner import RunnerDeployment
from prefect.schedules import Cron
from prefect.types.entrypoint import EntrypointType

from grpo_flow.schemas.presets import PRESETS
from grpo_flow.workers.state.location import absolute_root

NIGHTLY_CRON = "0 2 * * *"
NIGHTLY_TIMEZONE = "UTC"
CRON_ENV = "GRPO_FLOW_NIGHTLY_CRON"
TIMEZONE_ENV = "GRPO_FLOW_NIGHTLY_TZ"
GRPO_PRESETS = ("tiny", "smol-math", "gsm8k", "math", "mbpp")  # the deployments `grpo/<preset>`
PAUSE_TIMEOUT_S = 10.0
STOP_GRACE_S = 20.0


class DeploymentSettingsError(ValueError):
    """A bad time zone or cron string, named before anything is registered; `option` is the
    command-line option that sets it (`--timezone`, `--nightly-cron`)."""

    def __init__(self, option: str, message: str):
        super().__init__(f"{option}: {message}")
        self.option = option


def nightly_schedule(cron: str | None = None, timezone: str | None = None) -> tuple[str, str]:
    """(cron, time zone) from the arguments, else the environment, else 02:00 UTC; both checked."""
    cron = cron or os.environ.get(CRON_ENV) or NIGHTLY_CRON
    timezone = timezone or os.environ.get(TIMEZONE_ENV) or NIGHTLY_TIMEZONE
    try:
        ZoneInfo(timezone)
    except (ZoneInfoNotFoundError, ValueError):
        raise DeploymentSettingsError(
            "--timezone", f"{timezone!r} is not an IANA time zone (e.g. UTC, Europe/Berlin)"
        ) from None
    try:
        Cron(cron, timezone=timezone)
    except ValueError as error:
        raise DeploymentSettingsError("--nightly-cron", f"{cron!r} is not a valid cron string: {error}") from None
    return cron, timezone


def grpo_deployments(storage_root: str | os.PathLike, max_kl: float | None = None) -> list[RunnerDeployment]:
    """`grpo/<preset>` for each preset in GRPO_PRESETS (that exists in schemas/presets.py); `max_kl`, when
    given, is each one's guard_max_kl (the grpo-guard automation's KL limit)."""
    from grpo_flow.deployments.grpo import grpo_preset

    root = absolute_root(storage_root)
    deployments = []
    for preset in GRPO_PRESETS:
        if preset not in PRESETS:
            continue
        values = PRESETS[preset]
        deployments.append(
            grpo_preset.to_deployment(
                name=preset,
                parameters={"preset": preset, "storage_root": root}
                | ({"guard_max_kl": max_kl} if max_kl is not None else {}),
                description=f"GRPO run from the `{preset}` preset ({values['model']} on {values['dataset']}). "
                "Override any config field: `prefect deployment run grpo/" + preset + " --param max_steps=3`.",
                tags=["grpo", preset],
                entrypoint_type=EntrypointType.MODULE_PATH,
            )
        )
    return deployments


def nightly_deployment(
    storage_root: str | os.PathLike,
    cron: str | None = None,
    timezone: str | None = None,
    k: int | None = None,
    prompts: int | None = None,
) -> RunnerDeployment:
    """`evaluate/nightly`: the `evaluate` flow with no run id, on a cron schedule in a time zone."""
    from grpo_flow.flows.evaluate import DEFAULT_K, evaluate

    cron, timezone = nightly_schedule(cron, timezone)
    parameters: dict[str, object] = {"storage_root": absolute_root(storage_root), "k": k or DEFAULT_K}
    if prompts is not None:
        parameters["prompts"] = prompts
    return evaluate.to_deployment(
        name="nightly",
        schedules=[Cron(cron, timezone=timezone)],
        parameters=parameters,
        description=f"pass@k of every run whose newest checkpoint is newer than its last evaluation "
        f"(cron {cron!r}, {timezone}).",
        tags=["evaluate", "nightly"],
        entrypoint_type=EntrypointType.MODULE_PATH,
    )


def checkpoint_deployment(
    storage_root: str | os.PathLike, k: int | None = None, prompts: int | None = None, on_checkpoint: bool = True
) -> RunnerDeployment:
    """`evaluate/checkpoint`: the `evaluate` flow on one checkpoint. With `on_checkpoint`, a deployment trigger
    runs it for every `grpo.checkpoint.saved` of a grpo deployment run, on the run, step and storage root the
    event names (flows/events.py), one evaluation at a time. Its automation belongs to the deployment: serving
    again without the trigger removes it."""
    from prefect.events import DeploymentEventTrigger

    from grpo_flow.flows.evaluate import DEFAULT_K, evaluate
    from grpo_flow.flows.events import CHECKPOINT_SAVED

    parameters: dict[str, object] = {"storage_root": absolute_root(storage_root), "k": k or DEFAULT_K}
    if prompts is not None:
        parameters["prompts"] = prompts
    trigger = DeploymentEventTrigger(
        expect={CHECKPOINT_SAVED},
        match_related={"prefect.resource.role": "deployment"},  # runs that `grpo serve` started
        parameters={
            **parameters,
            "run_id": "{{ event.payload.run_id }}",
            "checkpoint": "{{ event.payload.step }}",
            "storage_root": "{{ event.payload.storage_root }}",
        },
    )
    return evaluate.to_deployment(
        name="checkpoint",
        parameters=parameters,
        triggers=[trigger] if on_checkpoint else [],
        concurrency_limit=1,  # checkpoints saved close together are evaluated one after another
        description="pass@k of one checkpoint (`--param run_id=... --param checkpoint=N`)"
        + (", run for every checkpoint a grpo deployment run saves." if on_checkpoint else "."),
        tags=["evaluate", "checkpoint"],
        entrypoint_type=EntrypointType.MODULE_PATH,
    )


def build_deployments(
    storage_root: str | os.PathLike,
    cron: str | None = None,
    timezone: str | None = None,
    k: int | None = None,
    prompts: int | None = None,
    evaluate_checkpoints: bool = True,
    max_kl: float | None = None,
) -> list[RunnerDeployment]:
    """Every deployment of the project, for one storage root."""
    nightly = nightly_deployment(storage_root, cron, timezone, k, prompts)  # checks cron and zone first
    checkpoint = checkpoint_deployment(storage_root, k, prompts, evaluate_checkpoints)
    return [*grpo_deployments(storage_root, max_kl), nightly, checkpoint]


def serve_deployments(
    storage_root: str | os.PathLike,
    cron: str | None = None,
    timezone: str | None = None,
    k: int | None = None,
    prompts: int | None = None,
    limit: int | None = None,
    evaluate_checkpoints: bool = True,
    max_kl: float | None = None,
) -> None:
    """Register every deployment with the server in PREFECT_API_URL and run their flow runs in
    subprocesses of this one until interrupted (Prefect's `serve`, with a bounded stop: see the module
    docstring). On shutdown the schedules are paused, so no run is scheduled that nothing would pick up."""
    from prefect.exceptions import TerminationSignal
    from prefect.flows import _display_serve_start_message  # what prefect.serve prints

    deployments = build_deployments(storage_root, cron, timezone, k, prompts, evaluate_checkpoints, max_kl)
    runner = bounded_runner()(pause_on_shutdown=True, limit=limit)
    for deployment in deployments:
        runner.add_deployment(deployment)
    _display_serve_start_message(*deployments)
    signal.signal(signal.SIGINT, runner.handle_sigint)
    try:
        asyncio.run(runner.start())  # the runner sets its own SIGTERM handler, `handle_sigterm`
    except (KeyboardInterrupt, TerminationSignal):
        pass


def bounded_runner() -> Any:
    """Prefect's Runner, whose stop cannot hang on a server that has gone away (made on first use:
    importing the runner costs a second that `grpo serve`'s checks must not pay)."""
    import anyio
    from prefect.runner import Runner

    class BoundedRunner(Runner):
        stop_requested = False

        def handle_sigint(self, signum: int, frame: Any) -> None:
            self._stop_within_grace(signum)
            raise KeyboardInterrupt

        def handle_sigterm(self, *args: Any, **kwargs: Any) -> None:
            self._stop_within_grace(signal.SIGTERM)
            # Prefect's handler calls its async-dispatched `stop()` inside the runner's running loop, which
            # hands back `astop()` unawaited (a RuntimeWarning at every SIGTERM); the `sys.exit` after it is
            # what stops the runner, by cancelling `start()`. Prefect's bug: its one warning is dropped.
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", "coroutine 'Runner.astop' was never awaited", RuntimeWarning)
                super().handle_sigterm(*args, **kwargs)

        def _stop_within_grace(self, signum: int) -> None:
            """The first signal starts the clock; a second one, or the end of the grace, exits at once."""
            if self.stop_requested:
                os._exit(128 + signum)
            self.stop_requested = True
            threading.Thread(target=give_up_after, args=(STOP_GRACE_S, 128 + signum), daemon=True).start()

        async def _pause_schedules(self) -> None:
            with anyio.move_on_after(PAUSE_TIMEOUT_S) as scope:
                await super()._pause_schedules()
            if scope.cancelled_caught:
                print(
                    f"grpo serve: the Prefect server did not answer within {PAUSE_TIMEOUT_S:g} s, so the "
                    "deployments' schedules may still be active; pause them with `prefect deployment pause`",
                    file=sys.stderr,
                    flush=True,
                )

    return BoundedRunner


def give_up_after(seconds: float, status: int) -> None:
    threading.Event().wait(seconds)
    print(f"grpo serve: not stopped after {seconds:g} s (the Prefect server is gone?); exiting", file=sys.stderr)
    sys.stderr.flush()
    os._exit(status)
