"""The flow behind the `grpo/<preset>` deployments: a preset plus any config field as its own parameter.

Why a wrapper: the `grpo` flow (flows/grpo.py) takes one parameter, `config`, the whole
GRPOFlowConfig. A Prefect server merges a deployment's parameters with a run's parameters
*shallowly* (`{**deployment.parameters, **run.parameters}`, server/api/deployments.py), and
`prefect deployment run` refuses a `--param` whose name is not one of the flow's parameters.
So against the `grpo` flow itself, `--param max_steps=3` is refused and
`--param config='{"max_steps": 3}'` replaces the whole preset with `{"max_steps": 3}`.

`grpo_preset` (Prefect flow name `grpo`, so deployments read `grpo/tiny`) takes instead:

- `preset`: the starting point (each deployment sets its own: `tiny`, `smol-math`, `gsm8k`, `math`, `mbpp`);
- every GRPOFlowConfig field as a parameter of its own, default None = "the preset's value",
  so `--param max_steps=3 --param run_id=my-run` works, and the UI draws a form field for each;
- `config`: a JSON object of config fields merged over the preset and the single fields (a
  partial config, or a whole one: `--params '{"config": {...}}'`). It is also the way to set an
  optional field to None (`--param config='{"epsilon_high": null}'`);
- `allow_config_change`: as the `grpo` flow's; `fail_at`: a testing aid, a fault injected into this
  flow run alone (workers/state/faults.py);
- `auto_resume_limit`: set by the `grpo-resume` automation (deployments/automations.py) on the run
  it starts: the run refuses to start when it was resumed that many times already.

Precedence: preset < single fields < `config`. The deployment itself sets one single field,
`storage_root` (deployments/serve.py), and an explicit `config` object must be able to win
over it. With no storage root anywhere, $GRPO_FLOW_STORAGE applies, as for `grpo train`.
A run id that already exists under the storage root is resumed from its own config
(config.json and resumes) with only the fields given applied, exactly like
`grpo train --run-id ID`; the preset is then ignored.

The body is the `grpo` flow's own function (`grpo.fn`), run inside this flow run, so a
deployment run records the same tasks, step subflows and artifacts as `grpo train`, under a
flow run named after the run id; the wrapper copies the `grpo` flow's retries, timeout and
state hooks.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import re
import typing
from collections.abc import Iterator
from typing import Any, Literal, Optional

from prefect import Flow, get_run_logger
from prefect.runtime import flow_run
from pydantic import Field, ValidationError

from grpo_flow.deployments.automations import GPU_LIMIT
from grpo_flow.flows.grpo import grpo
from grpo_flow.flows.interrupt import record_stopped_at_once, run_until_cancelled
from grpo_flow.schemas.config import new_run_id
from grpo_flow.schemas.config import GRPOFlowConfig, describe_validation_error
from grpo_flow.schemas.presets import PRESETS
from grpo_flow.workers.state.faults import injected
from grpo_flow.workers.state.resume import ResumeError, check_config_change, config_for_resume
from grpo_flow.workers.state.storage import RunStorage

GPU_LEASE_S = 60.0

# Parameters of the wrapper that are not config fields.
OWN_PARAMETERS = ("preset", "config", "allow_config_change", "fail_at", "auto_resume_limit")


class DeploymentConfigError(ValueError):
    """The parameters of a deployment run do not make a valid config (the message names the fields)."""


def resolve_config(preset: str, overrides: dict[str, Any], allow_config_change: bool = False) -> GRPOFlowConfig:
    """The config a deployment run trains with: a new run from the preset plus overrides, or an
    existing run (its run id under its storage root) from its own config plus overrides.

    Raises DeploymentConfigError naming the bad fields; refuses a change to a training field of
    an existing run unless `allow_config_change` (the ResumeError's message says so).
    """
    if preset not in PRESETS:
        raise DeploymentConfigError(f"preset: unknown preset {preset!r}; known presets: {', '.join(sorted(PRESETS))}")
    unknown = sorted(set(overrides) - set(GRPOFlowConfig.model_fields))
    if unknown:
        raise DeploymentConfigError(f"config: unknown fields {unknown}")
    storage_root = (
        overrides.get("storage_root")
        or PRESETS[preset].get("storage_root")
        or GRPOFlowConfig.model_fields["storage_root"].default
    )
    run_id = overrides.get("run_id")
    try:
        if run_id and RunStorage(storage_root, run_id).exists():
            storage = RunStorage(storage_root, run_id)
            config = config_for_resume(storage, overrides)
            check_config_change(storage, config, allow_config_change)
            return config
        return GRPOFlowConfig(**{**PRESETS[preset], **overrides})
    except ValidationError as error:
        # Each problem names its fields (`max_steps: ...`, `epsilon_high/epsilon: ...`); one that names
        # none is described as `config: ...`.
        problems = [line.removeprefix("config: ") for line in describe_validation_error(error).splitlines()]
        raise DeploymentConfigError("invalid config: " + "; ".join(problems)) from None
    except ResumeError as error:
        raise DeploymentConfigError(str(error)) from None


def split_parameters(parameters: dict[str, Any]) -> tuple[str, dict[str, Any], bool, str | None]:
    """(preset, config overrides, allow_config_change, fail_at) from the flow run's parameters.

    A config field left at None means "the preset's value": Prefect passes every parameter of
    the signature when the flow is called from Python, and JSON has no other way to leave one out.
    """
    preset = parameters.get("preset") or "tiny"
    partial = dict(parameters.get("config") or {})
    fields = {name: value for name, value in parameters.items() if name not in OWN_PARAMETERS and value is not None}
    overrides = {**fields, **partial}
    if "storage_root" not in overrides and os.environ.get("GRPO_FLOW_STORAGE"):
        overrides["storage_root"] = os.environ["GRPO_FLOW_STORAGE"]
    return preset, overrides, bool(parameters.get("allow_config_change")), parameters.get("fail_at")


def deployment_run_name() -> str:
    """The flow run is named after the run id (as `grpo train` names it), so the UI and storage agree."""
    parameters = flow_run.parameters
    config = parameters.get("config") or {}
    # Same precedence as split_parameters: the `config` object wins over the single field.
    run_id = (config.get("run_id") if isinstance(config, dict) else None) or parameters.get("run_id")
    return run_id or f"grpo-{parameters.get('preset') or 'tiny'}-new-run"


def _rename_flow_run(name: str) -> None:
    """Give a run whose id was generated in the body its id as flow run name (best effort: cosmetic)."""
    from prefect.client.orchestration import get_client

    try:
        with get_client(sync_client=True) as client:
            client.update_flow_run(flow_run.get_id(), name=name)
    except Exception as error:  # never fail a run over its display name
        logging.getLogger("grpo_flow.deployments").warning("could not rename flow run to %s: %s", name, error)


def check_auto_resume_limit(config: GRPOFlowConfig, limit: int | None) -> None:
    """A run started by the grpo-resume automation stops there once the run was resumed `limit` times."""
    if limit is None or config.run_id is None:
        return
    resumes = RunStorage(config.storage_root, config.run_id).resume_count()
    if resumes >= limit:
        raise DeploymentConfigError(
            f"auto_resume_limit: run {config.run_id} was resumed {resumes} times already (limit {limit}); "
            f"not resumed again automatically: resume it by hand with `--param run_id={config.run_id}`"
        )


def _grpo_preset(**parameters: Any) -> dict[str, Any]:
    """A GRPO run from a preset plus overrides (or the rest of an existing run); returns its summary."""
    preset, overrides, allow_config_change, fail_at = split_parameters(parameters)
    logger = get_run_logger()
    config = resolve_config(preset, overrides, allow_config_change)
    check_auto_resume_limit(config, parameters.get("auto_resume_limit"))
    if config.run_id is None:
        config = config.model_copy(update={"run_id": new_run_id(config)})
        _rename_flow_run(config.run_id)
    origin = (
        "its own config (resuming)" if RunStorage(config.storage_root, config.run_id).exists() else f"preset {preset}"
    )
    logger.info("run %s from %s; fields given: %s", config.run_id, origin, sorted(overrides) or "none")
    with gpu_slot(logger), injected(fail_at) if fail_at else contextlib.nullcontext():
        return run_until_cancelled(
            lambda: grpo.fn(config, show_progress=False, allow_config_change=allow_config_change),
            cancel_reason,
            lambda: record_stopped_at_once(config),
        )


def cancel_reason() -> str | None:
    """Why this flow run is being cancelled: its Cancelling state's message, an automation named by its
    name. None when it is not (a bare SIGTERM) or the server cannot say."""
    from prefect.client.orchestration import get_client

    try:
        with get_client(sync_client=True) as client:
            state = client.read_flow_run(flow_run.get_id()).state
            if state is None or not state.is_cancelling():
                return None
            message = state.message or "cancelled"
            if (found := re.search(r"Automation ([0-9a-f-]{36})", message)) and (
                automation := client.read_automation(found.group(1))
            ):
                message = message.replace(found.group(0), f"automation {automation.name}")
            return message
    except Exception:  # the server gone: stop as for any SIGTERM
        return None


@contextlib.contextmanager
def gpu_slot(logger: Any) -> Iterator[None]:
    """One slot of the server's `grpo-gpu` limit (deployments/automations.py) for the whole run, waited for
    as long as it takes; nothing when the server has no such limit. Its lease outlives a killed run by at
    most GPU_LEASE_S, so a resumed run does not wait long for the slot its crashed self held."""
    from prefect.client.orchestration import get_client
    from prefect.concurrency.sync import concurrency
    from prefect.exceptions import ObjectNotFound

    try:
        with get_client(sync_client=True) as client:
            limit = client.read_global_concurrency_limit_by_name(GPU_LIMIT)
    except ObjectNotFound:
        yield
        return
    if limit.active_slots >= limit.limit:
        logger.info("waiting for a %s slot (%d of %d taken)", GPU_LIMIT, limit.active_slots, limit.limit)
    with concurrency(GPU_LIMIT, occupy=1, lease_duration=GPU_LEASE_S):
        yield


def _optional(annotation: Any, metadata: list[Any]) -> Any:
    """`T | None`, keeping the field's constraints (ge, pattern, ...) on T so the parameter schema has them.

    An optional field (`X | None`) gets its constraints on X: pydantic cannot put them on a union.
    """
    args = typing.get_args(annotation)
    if type(None) in args:
        rest = [arg for arg in args if arg is not type(None)]
        if len(rest) != 1 or not metadata:
            return annotation
        annotation = rest[0]
    inner = typing.Annotated[(annotation, *metadata)] if metadata else annotation
    return Optional[inner]  # noqa: UP045 - built at run time from a type object


def deployment_signature() -> inspect.Signature:
    """preset, config, one keyword per GRPOFlowConfig field (default None), allow_config_change, fail_at.

    Built from the config model, so a field added to GRPOFlowConfig is a deployment parameter at
    once. Defaults are pydantic Fields so the descriptions reach the parameter schema (the UI form);
    Prefect unwraps them to their defaults when the flow is called from Python.
    """
    keyword = inspect.Parameter.KEYWORD_ONLY
    presets = Literal[tuple(sorted(PRESETS))]  # type: ignore[valid-type]
    parameters = [
        inspect.Parameter(
            "preset",
            keyword,
            annotation=presets,
            default=Field("tiny", description="Preset the run starts from (schemas/presets.py)."),
        ),
        inspect.Parameter(
            "config",
            keyword,
            annotation=Optional[dict[str, Any]],  # noqa: UP045
            default=Field(
                None,
                description="Config fields as one JSON object, merged over the preset and "
                "over the single fields below.",
            ),
        ),
    ]
    for name, field in GRPOFlowConfig.model_fields.items():
        description = f"{field.description or name} (default: the preset's value)"
        parameters.append(
            inspect.Parameter(
                name,
                keyword,
                annotation=_optional(field.annotation, list(field.metadata)),
                # Checks kept in the schema rather than the type (run_id's pattern) reach the server too.
                default=Field(None, description=description, json_schema_extra=field.json_schema_extra),
            )
        )
    parameters += [
        inspect.Parameter(
            "allow_config_change",
            keyword,
            annotation=bool,
            default=Field(False, description="Resume even if a field that alters training differs from the run's."),
        ),
        inspect.Parameter(
            "fail_at",
            keyword,
            annotation=Optional[str],  # noqa: UP045
            default=Field(
                None, description="Testing aid: `stage@step` or `stage@step:kill` (workers/state/faults.py)."
            ),
        ),
        inspect.Parameter(
            "auto_resume_limit",
            keyword,
            annotation=Optional[int],  # noqa: UP045
            default=Field(
                None,
                ge=0,
                description="Set by the grpo-resume automation: do not start if the run was resumed this many times.",
            ),
        ),
    ]
    return inspect.Signature(parameters, return_annotation=dict[str, Any])


_grpo_preset.__signature__ = deployment_signature()  # type: ignore[attr-defined]
_grpo_preset.__name__ = _grpo_preset.__qualname__ = "grpo_preset"  # the module attribute: entrypoints find it

# Prefect flow name `grpo`: deployments are `grpo/<preset>`, runs sit beside `grpo train`'s in the UI.
grpo_preset: Flow = Flow(
    fn=_grpo_preset,
    name=grpo.name,
    description="A GRPO run from a preset plus per-field overrides, or the rest of an existing run.",
    flow_run_name=deployment_run_name,
    # Validated in the body by GRPOFlowConfig (messages name the field); the server validates
    # types against the parameter schema before a run is created.
    validate_parameters=False,
    retries=grpo.retries,
    retry_delay_seconds=grpo.retry_delay_seconds,
    timeout_seconds=grpo.timeout_seconds,
    persist_result=grpo.persist_result,
    log_prints=grpo.log_prints,
    on_completion=list(grpo.on_completion_hooks),
    on_failure=list(grpo.on_failure_hooks),
    on_cancellation=list(grpo.on_cancellation_hooks),
    on_crashed=list(grpo.on_crashed_hooks),
    on_running=list(grpo.on_running_hooks),
)
