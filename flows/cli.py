"""`grpo`: train a run, list runs, read a run's rollouts; serve the deployments, evaluate, plot.

    grpo train --preset tiny [--max-steps 3 --loss-type grpo --storage-root DIR --run-id ID ...]
    grpo train --run-id ID [--resume] [--max-steps 80] [--allow-config-change]   (resume a run)
    grpo runs [--storage-root DIR]
    grpo rollouts RUN_ID [--step N] [--limit K] [--storage-root DIR]
    grpo serve [--storage-root DIR] [--timezone TZ] [--nightly-cron CRON]   (needs PREFECT_API_URL)
    grpo eval RUN [--checkpoint STEP] [--k K] [--prompts N] [--storage-root DIR]
    grpo report RUN [--out FILE.png] [--storage-root DIR]

Every config field is an option spelled `--field-name`. Bad input (an unknown preset, a bad
value, an unknown run) exits with status 2 and a message naming what is wrong, before
anything is written.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import typing
from typing import Any

from pydantic import ValidationError

from flows.cli_common import UsageError, quiet_prefect
from schemas.config import GRPOFlowConfig, describe_validation_error
from schemas.presets import PRESETS

DEFAULT_STORAGE_ROOT = os.environ.get("GRPO_FLOW_STORAGE", "grpo-storage")


def is_list_field(annotation: Any) -> bool:
    return typing.get_origin(annotation) is list or any(
        typing.get_origin(arg) is list for arg in typing.get_args(annotation)
    )


def add_config_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("config fields (override the preset)")
    for name, field in GRPOFlowConfig.model_fields.items():
        flag = "--" + name.replace("_", "-")
        help_text = (field.description or "").replace("%", "%%")
        if is_list_field(field.annotation):
            group.add_argument(flag, dest=name, nargs="+", metavar="VALUE", help=help_text)
        else:
            group.add_argument(flag, dest=name, metavar="VALUE", help=help_text)


def parse_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The options given, as strings for pydantic to convert; `none` means None for optional fields."""
    overrides = {}
    for name in GRPOFlowConfig.model_fields:
        value = getattr(args, name, None)
        if value is None:
            continue
        overrides[name] = None if isinstance(value, str) and value.lower() in ("none", "null") else value
    return overrides


def build_config(preset: str, overrides: dict[str, Any]) -> GRPOFlowConfig:
    if preset not in PRESETS:
        raise UsageError(f"--preset: unknown preset {preset!r}; known presets: {', '.join(sorted(PRESETS))}")
    try:
        return GRPOFlowConfig(**{**PRESETS[preset], **overrides})
    except ValidationError as error:
        raise UsageError(
            "invalid config:\n" + "\n".join(map(cli_spelling, describe_validation_error(error).splitlines()))
        ) from None


def cli_spelling(line: str) -> str:
    """`max_steps: msg` as `  --max-steps: msg`, the way the option was typed."""
    field, _, message = line.partition(": ")
    if field in GRPOFlowConfig.model_fields:
        return f"  --{field.replace('_', '-')}: {message}"
    return f"  {line}"


def command_train(args: argparse.Namespace) -> int:
    overrides = parse_overrides(args)
    quiet_prefect(args.verbose)  # before Prefect is first imported: its settings are read then
    from workers.state.storage import RunStorage

    check_storage_root(args.storage_root)
    existing = overrides.get("run_id") and RunStorage(args.storage_root, overrides["run_id"]).exists()
    if args.resume and not existing:
        where = os.path.join(args.storage_root, "runs")
        raise UsageError(
            f"--resume: no run {overrides.get('run_id')!r} under {where}"
            if overrides.get("run_id")
            else "--resume needs --run-id"
        )
    if existing:
        config = resume_config(RunStorage(args.storage_root, overrides["run_id"]), overrides, args)
    else:
        config = build_config(args.preset or "tiny", overrides)
    from flows.grpo import new_run_id

    if config.run_id is None:
        config = config.model_copy(update={"run_id": new_run_id(config)})
    from workers.backends import check_backend_ready

    try:
        check_backend_ready(config)
    except Exception as error:  # missing Modal credentials or secret, no Ray cluster or too few GPUs: say which
        raise UsageError(f"--backend {config.backend}: {error}") from error
    if args.fail_at:
        from workers.state.faults import parse_fail_at

        try:
            parse_fail_at(args.fail_at)
        except ValueError as error:
            raise UsageError(f"--{error}") from error
    if args.simple_mode:
        if existing:
            raise UsageError(f"--simple-mode: run {config.run_id!r} exists; simple mode does not resume")
        return run_simple_mode(config, args)
    from flows.grpo import grpo

    what = "resuming run" if existing else "run"
    print(f"grpo-flow: {what} {config.run_id} ({config.model}, {config.dataset})", flush=True)
    try:
        summary = grpo(
            config,
            show_progress=not args.no_progress,
            allow_config_change=args.allow_config_change,
            fail_at=args.fail_at,
        )
    except Exception as error:  # the flow already recorded it; say it in one line unless asked for more
        if args.verbose:
            raise
        print(f"grpo train: run {config.run_id} failed: {type(error).__name__}: {error}", file=sys.stderr)
        print(
            f"(resume it with: grpo train --run-id {config.run_id} --storage-root {config.storage_root}; "
            "add --verbose for the traceback)",
            file=sys.stderr,
        )
        return 1
    print_summary(summary)
    return 0


def run_simple_mode(config: GRPOFlowConfig, args: argparse.Namespace) -> int:
    """TRL's own GRPOTrainer loop in the `grpo-simple` flow, writing to the same storage layout."""
    from flows.simple import grpo_simple

    print(f"grpo-flow: run {config.run_id} in simple mode (TRL's GRPOTrainer loop)", flush=True)
    try:
        summary = grpo_simple(config)
    except Exception as error:
        if args.verbose:
            raise
        print(f"grpo train: run {config.run_id} failed: {type(error).__name__}: {error}", file=sys.stderr)
        return 1
    print(
        f"run {summary['run_id']}: {summary['status']}, {summary['steps_completed']} steps, "
        f"mean reward over the last 5 steps {summary['final_reward']:.3f}; "
        f"storage {os.path.join(summary['storage'], 'runs', summary['run_id'])}"
    )
    return 0


def resume_config(storage: Any, overrides: dict[str, Any], args: argparse.Namespace) -> GRPOFlowConfig:
    """The run's own config with the options given applied; a change to training needs --allow-config-change."""
    from workers.state.resume import ResumeError, check_config_change, config_for_resume

    if args.preset:
        print(
            f"grpo train: run {storage.run_id!r} exists; --preset is ignored, its config.json is used", file=sys.stderr
        )
    try:
        config = config_for_resume(storage, overrides)
        check_config_change(storage, config, args.allow_config_change)
    except ValidationError as error:
        raise UsageError(
            "invalid config:\n" + "\n".join(map(cli_spelling, describe_validation_error(error).splitlines()))
        ) from None
    except ResumeError as error:
        raise UsageError(str(error)) from error
    return config


def check_storage_root(root: str) -> None:
    """The nearest existing folder of the storage root must be writable (nothing is created here)."""
    path = os.path.abspath(root)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    if not os.path.isdir(path) or not os.access(path, os.W_OK):
        raise UsageError(f"--storage-root: {root!r} is not a writable folder")


def print_summary(summary: dict[str, Any]) -> None:
    rows = [
        ("run", summary["run_id"]),
        ("status", summary["status"]),
        ("steps", f"{summary['steps_completed']} / {summary['total_steps']}"),
    ]
    if "model_heldout_accuracy_random_init" in summary:
        rows.append(("held-out accuracy, random init", f"{summary['model_heldout_accuracy_random_init']:.3f}"))
        rows.append(
            ("held-out accuracy, after warm start", f"{summary['model_heldout_accuracy_after_warm_start']:.3f}")
        )
    rows += [
        ("held-out accuracy, before RL", f"{summary['initial_eval_accuracy']:.3f}"),
        ("held-out accuracy, after RL", f"{summary['final_eval_accuracy']:.3f}"),
        ("mean reward, last 5 steps", f"{summary['final_reward']:.3f}"),
        ("wall time", f"{summary['wall_seconds']:.1f} s"),
        ("storage", os.path.join(summary["storage"], "runs", summary["run_id"])),
    ]
    width = max(len(name) for name, _ in rows)
    print("\n".join(f"{name:<{width}}  {value}" for name, value in rows))


def command_runs(args: argparse.Namespace) -> int:
    from workers.state.storage import list_runs

    runs = list_runs(args.storage_root)
    if not runs:
        print(f"no runs under {os.path.join(args.storage_root, 'runs')}")
        return 0
    print(f"{'run':<40} {'status':<11} last step")
    for run in runs:
        print(f"{run.run_id:<40} {run.status:<11} {'-' if run.last_step is None else run.last_step}")
    return 0


def command_rollouts(args: argparse.Namespace) -> int:
    from workers.state.storage import RunStorage

    storage = RunStorage(args.storage_root, args.run_id)
    if not storage.exists():
        raise UsageError(f"RUN_ID: no run {args.run_id!r} under {os.path.join(args.storage_root, 'runs')}")
    steps = storage.logged_steps()
    if not steps:
        raise UsageError(f"RUN_ID: run {args.run_id!r} has no logged steps yet")
    step = steps[-1] if args.step is None else args.step
    if step not in steps:
        raise UsageError(f"--step: run {args.run_id!r} has no step {step}; logged steps are {steps[0]}..{steps[-1]}")
    columns = ["group_index", "sample_index", "prompt", "completion", "reward", "advantage", "finish_reason"]
    rows = storage.read_rollouts(step, columns=columns).slice(0, args.limit).to_pylist()
    print(f"run {args.run_id}, step {step}: {len(rows)} of its completions")
    for row in rows:
        print(json.dumps(row, ensure_ascii=False))
    return 0


# -- serve, eval, report ---------------------------------------------------------------------------
def command_serve(args: argparse.Namespace) -> int:
    """Register grpo/<preset> and evaluate/nightly with the server in PREFECT_API_URL and run them."""
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")  # before Prefect reads its settings
    from prefect.settings import PREFECT_API_URL

    from deployments.serve import GRPO_PRESETS, DeploymentSettingsError, nightly_schedule, serve_deployments

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
    try:
        cron, timezone = nightly_schedule(args.nightly_cron, args.timezone)
    except DeploymentSettingsError as error:
        raise UsageError(str(error)) from error
    names = ", ".join([f"grpo/{preset}" for preset in GRPO_PRESETS if preset in PRESETS] + ["evaluate/nightly"])
    print(
        f"grpo serve: {names} on {api_url}; evaluate/nightly at cron {cron!r} ({timezone}); "
        f"storage root {os.path.abspath(args.storage_root)}",
        flush=True,
    )
    serve_deployments(args.storage_root, cron, timezone, args.eval_k, args.eval_prompts, args.limit)
    return 0


def command_eval(args: argparse.Namespace) -> int:
    """Evaluate a run's newest (or a named) checkpoint: pass@1 and pass@k on held-out prompts."""
    quiet_prefect(args.verbose)
    from flows.evaluate import EvaluationError, resolve_checkpoint
    from workers.state.storage import RunStorage

    if args.k < 1:
        raise UsageError(f"--k: must be at least 1, got {args.k}")
    if args.prompts is not None and args.prompts < 1:
        raise UsageError(f"--prompts: must be at least 1, got {args.prompts}")
    storage = RunStorage(args.storage_root, args.run_id)
    if not storage.exists():
        raise UsageError(f"RUN: no run {args.run_id!r} under {os.path.join(args.storage_root, 'runs')}")
    try:
        step = resolve_checkpoint(storage, args.checkpoint)
    except EvaluationError as error:
        raise UsageError(f"{'--checkpoint' if args.checkpoint is not None else 'RUN'}: {error}") from error
    from flows.evaluate import evaluate

    print(f"grpo-flow: evaluating run {args.run_id}, checkpoint {step} (k={args.k})", flush=True)
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
        )
    except Exception as error:  # the flow run recorded it; one line unless asked for more
        if args.verbose:
            raise
        print(f"grpo eval: run {args.run_id} failed: {type(error).__name__}: {error}", file=sys.stderr)
        return 1
    print_eval_summary(summary)
    return 0


def print_eval_summary(summary: dict[str, Any]) -> None:
    from flows.evaluate import metric_names

    rows = [
        ("run", summary["run_id"]),
        ("checkpoint", str(summary["checkpoint_step"])),
        ("held-out prompts x samples", f"{summary['num_prompts']} x {summary['samples_per_prompt']}"),
    ]
    rows += [(name.replace("_", " "), f"{summary[name]:.4f}") for name in metric_names(summary)]
    rows.append(
        ("results", summary["path"] + ("  (already evaluated; read back)" if summary.get("already_evaluated") else ""))
    )
    width = max(len(name) for name, _ in rows)
    print("\n".join(f"{name:<{width}}  {value}" for name, value in rows))


def command_report(args: argparse.Namespace) -> int:
    """A PNG of reward, loss, KL and completion length per step (and evaluations, when there are any)."""
    from flows.report import ReportError, write_report

    try:
        report = write_report(args.storage_root, args.run_id, args.out)
    except ReportError as error:
        raise UsageError(f"RUN: {error}") from error
    except ImportError as error:
        print(f"grpo report: needs matplotlib ({error}); install it with: pip install matplotlib", file=sys.stderr)
        return 1
    print(f"wrote {report.path}: {', '.join(report.panels)} over {report.steps} steps")
    return 0


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="grpo", description="GRPO as a Prefect workflow around GPU workers.")
    commands = parser.add_subparsers(dest="command", required=True)

    train = commands.add_parser("train", help="start a run from a preset plus overrides")
    train.add_argument("--preset", default=None, help=f"one of: {', '.join(sorted(PRESETS))} (default: tiny)")
    train.add_argument("--resume", action="store_true", help="require --run-id to name an existing run, and resume it")
    train.add_argument(
        "--allow-config-change", action="store_true", help="resume even if a field that alters training changed"
    )
    train.add_argument(
        "--simple-mode",
        action="store_true",
        help="run TRL's own GRPOTrainer loop (same config, data, rewards and storage layout; no resume)",
    )
    train.add_argument("--fail-at", default=None, metavar="STAGE@STEP[:kill]", help="testing aid: fail on purpose")
    train.add_argument("--no-progress", action="store_true", help="no progress bar")
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
    rollouts.add_argument("--storage-root", default=DEFAULT_STORAGE_ROOT)
    rollouts.set_defaults(handler=command_rollouts)

    serve = commands.add_parser(
        "serve", help="register grpo/<preset> and evaluate/nightly with the Prefect server and run them"
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
    evaluate.add_argument("--storage-root", default=DEFAULT_STORAGE_ROOT)
    evaluate.add_argument("--verbose", action="store_true", help="show Prefect's task logs and tracebacks")
    evaluate.set_defaults(handler=command_eval)

    report = commands.add_parser("report", help="PNG of reward, loss, KL and completion length per step")
    report.add_argument("run_id", metavar="RUN")
    report.add_argument("--out", default=None, metavar="FILE.png", help="output file (default: <run>/report.png)")
    report.add_argument("--storage-root", default=DEFAULT_STORAGE_ROOT)
    report.set_defaults(handler=command_report)

    from flows.components import add_component_commands

    add_component_commands(commands, DEFAULT_STORAGE_ROOT)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    if args.command == "train" and args.storage_root is None:
        args.storage_root = DEFAULT_STORAGE_ROOT
    try:
        return args.handler(args)
    except UsageError as error:
        print(f"grpo {args.command}: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
