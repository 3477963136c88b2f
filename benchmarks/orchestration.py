"""Orchestration overhead: the real step DAG with workers that return instantly, against real
steps of the tiny preset, in one invocation.

    python -m benchmarks.orchestration [--steps 30] [--real-steps 5] [--database ephemeral|sqlite|postgres]
                                 [--tiny-model DIR] [--backend local|ray] [--json FILE]

Instant side: the `grpo` flow, its `grpo-step` subflows and every task in them, on the tiny
preset's config (32 prompts x 8 generations, 2 rollout shards, completions of 2 tokens, a
checkpoint every 20 steps), with the workers swapped for ones that answer at once
(benchmarks/instant_workers.py). What is left is Prefect (task and subflow runs, their API
calls, parameter and result handling), serialization (RolloutBatch records between tasks,
Arrow tables), reward scoring (`last_digit`, cheap) and storage (Parquet rollouts and metrics,
checkpoint manifest). Real side: the same config with the real local workers on the tiny
preset's model (the one `grpo train --preset tiny` built, if `--tiny-model` or the default
storage root has it; otherwise the same architecture randomly initialised, which costs the
same per step).

A step's cost is the time from the start of its `grpo-step` subflow to the start of the next
(so the parent flow's work between steps counts); the first step of each side is a warm-up
and is left out of the medians. For the real steps, the workers' own time (generate, score,
actor, weight sync, as each step logs them) is subtracted from the step's time: the rest
(`real_step_rest_ms`) is what orchestration and logging add to a real step, which can be less
than the instant step time: while a real worker computes, Prefect's server records the
previous tasks on another core, whereas back-to-back instant steps wait for it. The instant run is then continued for as many steps by the same
task functions called directly, without Prefect: what serialization, scoring and storage alone
cost (`no_prefect_ms_per_step`). The instant run is also repeated with `step_subflows` off, each
step's tasks running in the run's own flow run (`no_subflows_ms_per_step`). Also measured, as a floor: Prefect alone, i.e. subflows that
each run the same number of no-op tasks as a step does. JSON keys: `orchestration_ms_per_step`,
`tiny_step_ms`, `share_of_tiny_step`, and the rest of the table. Targets (issue 8):
orchestration <= 50 ms per step and <= 5 % of the tiny preset's step time.

Part of a step's orchestration time is Prefect's own server digesting the step's task-run
events (three per task run) while the next subflow's API calls queue behind it; the table shows
the API requests per step and their latency. Importing `flows` sets the server's task-run
recorder to write up to 100 events per transaction (flows/__init__.py); `--unbatched-recorder`
starts the ephemeral server with Prefect's defaults instead (one event per transaction), to show
what that setting buys.

`--backend ray` also runs the instant steps (in the flow, then directly without Prefect) and the
real steps with the workers as Ray actors (the Ray backend, on the cluster RAY_ADDRESS names, else
a local Ray instance started here on the loopback address; the actor gets 1 CPU, each engine half
of one), and prints what Ray adds per step against the local backend in this same invocation:
`ray_adds_no_prefect_ms_per_step` (the step's task bodies without Prefect: Ray's calls, the
prompts and completions through its serialization, the weights through its object store),
`ray_adds_ms_per_step` (the same in the flow), `ray_real_adds_ms_per_step` (real tiny steps, where
the engines and the actor also compute on the CPUs their placement gives them instead of this
process's threads), their ratios, and the Ray instant step's timed worker calls
(`ray_instant_stage_ms`: `time/actor_s` and `time/sync_s` as the step logs them, measured around
Ray's round trips; `time/generate_s` is the engine's own).

`--profile N` also runs the instant side under cProfile (main thread only; mapped tasks run
on Prefect's worker threads) and prints the N functions with the most cumulative time.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import statistics
import tempfile
import time
from pathlib import Path
from collections.abc import Iterator
from typing import Any

from benchmarks import harness
from benchmarks.steps import ApiCounter, StepClock, default_tiny_model, median_of, run_steps_directly, save_random_model

PREFECT_DEFAULT_RECORDER = {  # Prefect 3.8's own defaults, which `import flows` overrides
    "PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_BATCH_SIZE": "1",
    "PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_READ_BATCH_SIZE": "1",
    "PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_FLUSH_INTERVAL": "5",
}
WORK_COLUMNS = ("time/generate_s", "time/score_s", "time/actor_s", "time/sync_s")
TASKS_PER_STEP = 9  # sample, 2 x generate, 2 x score, log-rollouts, actor, sync, log-metrics


# The Ray runs' placement on a 2-CPU machine: the actor one CPU, each of the two engines half of one.
RAY_FIELDS = {"backend": "ray", "ray_actor_cpus": 1.0, "ray_rollout_cpus": 0.5}


def tiny_config(model: str, storage_root: str, run_id: str, steps: int, ray: bool = False) -> Any:
    from grpo_flow.schemas.presets import preset_config

    fields = RAY_FIELDS if ray else {}
    return preset_config(
        "tiny", model=model, storage_root=storage_root, run_id=run_id, max_steps=steps, eval_prompts=0, **fields
    )


def run_flow_timed(config: Any, direct_steps: int = 0) -> dict[str, Any]:
    from grpo_flow.flows.grpo import grpo
    from grpo_flow.workers.state.storage import RunStorage

    counter = ApiCounter()
    clock = StepClock(counter)
    started = time.perf_counter()
    with counter.watch(), clock.watch():
        summary = grpo(config)
    wall = time.perf_counter() - started
    if summary.get("status") != "completed":
        raise RuntimeError(f"run {config.run_id} did not complete: {summary.get('error')}")
    metrics = RunStorage(config.storage_root, config.run_id).read_metrics().to_pylist()
    in_subflow = {row["step"]: row["step_s"] for row in metrics}
    stages = {k: statistics.median(row.get(k) or 0.0 for row in metrics[1:] or metrics) for k in WORK_COLUMNS}
    per_step, subflow = clock.intervals(), clock.subflow_seconds()
    # The workers' own time in a step, as the step logs it; the rest is orchestration and logging.
    work = {row["step"]: sum(row.get(k) or 0.0 for k in WORK_COLUMNS) for row in metrics}
    rest = {step: per_step[step] - work[step] for step in per_step if step in work}
    steady = list(range(2, config.max_steps + 1)) or [1]
    direct = {}
    if direct_steps:  # the same run continued by the same task functions without Prefect
        from grpo_flow.workers.backends import release

        release(config.run_id)
        more = config.model_copy(update={"max_steps": config.max_steps + direct_steps})
        try:
            direct = run_steps_directly(more, clock.plan, config.max_steps + 1, more.max_steps)
        finally:
            # No flow ends these steps: release their workers here (Ray ones hold the placement group's
            # CPUs, and the next Ray run would wait for them until its placement timeout).
            release(more.run_id)
    return {
        "steps": config.max_steps,
        "wall_s": wall,
        "median_direct_step_s": statistics.median(list(direct.values())[1:]) if direct else None,
        "median_step_s": median_of(per_step, steady),
        "mean_step_s": statistics.mean(per_step[s] for s in steady),
        "first_step_s": per_step[1],
        "median_in_subflow_s": median_of(in_subflow, steady),
        "median_work_s": median_of(work, steady),
        "median_rest_s": median_of(rest, steady),
        "median_subflow_call_s": median_of(subflow, steady),
        "per_step_s": [per_step[s] for s in sorted(per_step)],
        "median_stage_s": stages,
        "max_step_s": max(per_step[s] for s in steady),
        "steps_over_3x_median": sum(per_step[s] > 3 * median_of(per_step, steady) for s in steady),
        "steady_steps": len(steady),
        "api_per_step": clock.counted,
    }


def run_instant(
    workdir: Path, steps: int, profile: int, step_subflows: bool = True, ray: bool = False
) -> dict[str, Any]:
    from benchmarks.instant_workers import instant_model_dir, instant_workers

    run_id = ("instant" if step_subflows else "instant-no-subflows") + ("-ray" if ray else "")
    model = instant_model_dir(workdir / "instant-model")
    config = tiny_config(model, str(workdir / "storage"), run_id, steps, ray=ray)
    config = config.model_copy(update={"step_subflows": step_subflows})
    with instant_workers(ray=ray):
        if not step_subflows:
            return run_flow_timed(config)
        if not profile:
            return run_flow_timed(config, direct_steps=steps)
        import cProfile
        import pstats

        profiler = cProfile.Profile()
        result = profiler.runcall(run_flow_timed, config, steps)
        print(f"\ncProfile of the instant run (main thread), top {profile} by cumulative time:")
        pstats.Stats(profiler).sort_stats("cumulative").print_stats(profile)
        return result


@contextlib.contextmanager
def server(database: str, workdir: Path) -> Iterator[None]:
    """The Prefect API the benchmark talks to: the ephemeral server (nothing to start), or
    `prefect server start` on a SQLite file or on a local PostgreSQL."""
    if database == "ephemeral":
        yield
        return
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from grpo_flow.deployments.local_server import local_postgres, prefect_server

    with contextlib.ExitStack() as stack:
        database_url = stack.enter_context(local_postgres()) if database == "postgres" else None
        url = stack.enter_context(prefect_server(workdir / "prefect-home", database_url))
        os.environ["PREFECT_API_URL"] = url  # what a user's shell would say; read again by each flow
        stack.enter_context(temporary_settings(updates={PREFECT_API_URL: url}))
        try:
            yield
        finally:
            os.environ.pop("PREFECT_API_URL", None)


def run_real(workdir: Path, steps: int, model: str | None, ray: bool = False) -> dict[str, Any]:
    from grpo_flow.workers.backends import release

    if model is None:
        model = str(workdir / "tiny-architecture")
        save_random_model(Path(model))
    config = tiny_config(model, str(workdir / "storage"), "real-ray" if ray else "real", steps, ray=ray)
    try:
        return {**run_flow_timed(config), "model": model}
    finally:
        release(config.run_id)


def run_prefect_floor(steps: int, tasks_per_step: int) -> dict[str, float]:
    """Prefect alone: a flow of `steps` subflows, each running `tasks_per_step` no-op tasks, and as
    many empty subflows; the per-task figure is the difference over the task count."""
    from prefect import flow, task
    from prefect.cache_policies import NO_CACHE
    from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings

    @task(name="noop", cache_policy=NO_CACHE)
    def noop(i: int) -> int:
        return i

    @flow(name="noop-step", persist_result=False, validate_parameters=False)
    def noop_step(count: int) -> int:
        return sum(noop(i) for i in range(count))

    @flow(name="noop-run", validate_parameters=False)
    def noop_run() -> dict[str, float]:
        # One kind after the other, start to next start: a subflow's API calls wait for the server to
        # record the task runs before it, so alternating kinds would bill one kind for the other.
        medians = {}
        with temporary_settings(updates={PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}):  # as flows/grpo.py does
            for kind, count in (("empty", 0), ("full", tasks_per_step)):
                starts = []
                for _ in range(steps + 1):
                    starts.append(time.perf_counter())
                    noop_step(count)
                intervals = [b - a for a, b in itertools.pairwise(starts)]
                medians[kind] = statistics.median(intervals[1:] or intervals)
        empty, full = medians["empty"], medians["full"]
        return {"subflow_s": empty, "subflow_with_tasks_s": full, "task_s": (full - empty) / tasks_per_step}

    return noop_run()


WALK_SHAPES = {  # one rollout shard: rows, prompt tokens, completion tokens
    "tiny preset shard (128 rows, 7+2 tokens)": (128, 7, 2),
    "gsm8k preset shard (64 rows, 200+512 tokens)": (64, 200, 512),
}


def synthetic_batch(rows: int, prompt_tokens: int, completion_tokens: int) -> Any:
    from grpo_flow.schemas.records import RolloutBatch

    return RolloutBatch(
        run_id="walk",
        step=1,
        policy_version=0,
        worker_id="rollout-0",
        prompt_id=[str(i) for i in range(rows)],
        group_index=[i // 8 for i in range(rows)],
        sample_index=[i % 8 for i in range(rows)],
        prompt=["p" * prompt_tokens] * rows,
        completion=["c" * completion_tokens] * rows,
        prompt_token_ids=[[1] * prompt_tokens for _ in range(rows)],
        completion_token_ids=[[2] * completion_tokens for _ in range(rows)],
        sampling_logprobs=[[-1.0] * completion_tokens for _ in range(rows)],
        finish_reason=["length"] * rows,
        rewards={"last_digit": [0.0] * rows},
        reward=[0.0] * rows,
        reward_error=[None] * rows,
        advantage=[0.0] * rows,
    )


def parameter_walk_ms(repeats: int = 3) -> dict[str, dict[str, float]]:
    """What Prefect does to a task's parameters before it runs: resolve futures and states nested
    anywhere in them, and collect upstream task-run inputs; both walk every element of a
    RolloutBatch (a dataclass of per-row lists). `quote(...)` (Prefect's annotation) skips the walk."""
    from prefect.utilities.annotations import quote
    from prefect.utilities.collections import visit_collection
    from prefect.utilities.engine import collect_task_run_inputs_sync, resolve_to_final_result

    def walks(value: Any) -> None:
        visit_collection(
            value,
            visit_fn=resolve_to_final_result,
            return_data=True,
            max_depth=-1,
            remove_annotations=True,
            context={"parameter_name": "batch"},
        )
        collect_task_run_inputs_sync(value)

    out = {}
    for name, shape in WALK_SHAPES.items():
        batch = synthetic_batch(*shape)
        out[name] = {}
        for label, value in (("as passed now", batch), ("quote(batch)", quote(batch))):
            started = time.perf_counter()
            for _ in range(repeats):
                walks(value)
            out[name][label] = 1000 * (time.perf_counter() - started) / repeats
    return out


def print_report(result: dict[str, Any], args: argparse.Namespace) -> None:
    instant, flat, real, floor = (result[k] for k in ("instant", "instant_no_subflows", "real", "prefect_floor"))
    ms = 1000.0
    print("\nOrchestration overhead: the tiny preset's step DAG with instant workers vs real tiny steps")
    print(f"(Prefect server: {result['database']})")
    print(f"(instant: {instant['steps']} steps, real: {real['steps']} steps; first step of each left out)\n")
    rows = [
        ("instant workers: per step (start to next start)", instant["median_step_s"] * ms, "orchestration_ms_per_step"),
        ("  of which inside the grpo-step subflow body", instant["median_in_subflow_s"] * ms, ""),
        ("  subflow call (body + subflow run start/end)", instant["median_subflow_call_s"] * ms, ""),
        ("  first step (warm-up, not counted)", instant["first_step_s"] * ms, ""),
        (
            "  mean per step",
            instant["mean_step_s"] * ms,
            "orchestration_mean_ms_per_step",
        ),
        ("instant workers, step_subflows off: per step", flat["median_step_s"] * ms, "no_subflows_ms_per_step"),
        ("  mean per step", flat["mean_step_s"] * ms, "no_subflows_mean_ms_per_step"),
        (
            "same tasks' bodies called without Prefect: per step",
            instant["median_direct_step_s"] * ms,
            "no_prefect_ms_per_step",
        ),
        ("real tiny preset: per step", real["median_step_s"] * ms, "tiny_step_ms"),
        ("  of which inside the grpo-step subflow body", real["median_in_subflow_s"] * ms, ""),
        ("  workers (generate, score, actor, sync; as logged)", real["median_work_s"] * ms, ""),
        ("  the rest: orchestration and logging in a real step", real["median_rest_s"] * ms, "real_step_rest_ms"),
        ("Prefect alone: an empty subflow", floor["subflow_s"] * ms, ""),
        (f"Prefect alone: a subflow of {TASKS_PER_STEP} no-op tasks", floor["subflow_with_tasks_s"] * ms, ""),
        ("Prefect alone: one no-op task run", floor["task_s"] * ms, ""),
    ]
    print(f"{'':<52}{'ms (median)':>12}")
    for name, value, key in rows:
        print(f"{name:<52}{value:>12.1f}" + (f"   [{key}]" if key else ""))
    api = instant["api_per_step"]
    if api:
        print(
            f"\nPrefect API per step (instant run): {api['requests']:.1f} HTTP requests taking {api['request_ms']:.0f} ms "
            f"in all (waited for by the flow or not), {api['events']:.1f} events sent"
        )
        for endpoint, count in api["requests_by_endpoint"].items():
            print(f"  {count:5.1f} x {endpoint:<44}{api['request_ms_by_endpoint'][endpoint]:>8.1f} ms")
        print("  events: " + ", ".join(f"{k} {v:.1f}" for k, v in api["events_by_kind"].items()))
    print("\nPrefect's parameter walks (resolve + collect inputs) for one task taking one rollout shard, ms:")
    for name, by_label in result["parameter_walk_ms"].items():
        print(f"  {name:<50}" + "   ".join(f"{label} {ms:7.2f}" for label, ms in by_label.items()))
    empty = floor["subflow_s"] * ms
    print(
        f"\nstalls (instant steps over 3 x the median): {instant['steps_over_3x_median']} of {instant['steady_steps']} "
        f"with subflows (longest {instant['max_step_s'] * ms:.0f} ms, {result['max_over_median']:.2f} x the median; "
        f"target: none over 3 x), {flat['steps_over_3x_median']} of {flat['steady_steps']} without; "
        f"mean / median {result['mean_over_median']:.2f} (target <= 1.2)"
    )
    print(
        f"issue 16 targets: instant step <= empty subflow + 100 ms ({empty + 100:.0f} ms): "
        f"{'met' if instant['median_step_s'] * ms <= empty + 100 else 'NOT met'}; "
        f"subflows off <= 100 ms: {'met' if flat['median_step_s'] * ms <= 100 else 'NOT met'}"
    )
    if "ray_adds_ms_per_step" in result:
        ray_instant, ray_real = result["ray_instant"], result["ray_real"]
        print("\nThe Ray backend: the same steps with the workers as Ray actors, in this invocation (ms, median)")
        ray_rows = [
            ("instant workers, local backend: per step", instant["median_step_s"] * ms, ""),
            ("instant workers as Ray actors: per step", ray_instant["median_step_s"] * ms, "ray_instant_ms_per_step"),
            ("  Ray adds per step", result["ray_adds_ms_per_step"], "ray_adds_ms_per_step"),
            ("same tasks without Prefect, local backend: per step", instant["median_direct_step_s"] * ms, ""),
            (
                "same tasks without Prefect, Ray actors: per step",
                ray_instant["median_direct_step_s"] * ms,
                "ray_no_prefect_ms_per_step",
            ),
            ("  Ray adds per step", result["ray_adds_no_prefect_ms_per_step"], "ray_adds_no_prefect_ms_per_step"),
        ]
        for stage, seconds in ray_instant["median_stage_s"].items():
            ray_rows.append((f"  {stage} (instant, through Ray)", seconds * ms, ""))
        ray_rows += [
            ("real tiny preset, local backend: per step", real["median_step_s"] * ms, ""),
            ("real tiny preset on Ray actors: per step", ray_real["median_step_s"] * ms, "ray_real_step_ms"),
            ("  Ray adds per real step", result["ray_real_adds_ms_per_step"], "ray_real_adds_ms_per_step"),
        ]
        for name, value, key in ray_rows:
            print(f"{name:<52}{value:>12.1f}" + (f"   [{key}]" if key else ""))
        print(
            f"ratio, Ray to local: instant steps {result['ray_instant_ratio']:.2f}x, without Prefect "
            f"{result['ray_no_prefect_ratio']:.2f}x, real steps {result['ray_real_ratio']:.2f}x"
        )
    print(
        f"\norchestration share of the tiny step: {100 * result['share_of_tiny_step']:.1f} %   "
        f"(targets: <= 50 ms per step: {'met' if result['orchestration_ms_per_step'] <= 50 else 'NOT met'}; "
        f"<= 5 %: {'met' if result['share_of_tiny_step'] <= 0.05 else 'NOT met'})"
    )


def options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=int, default=30, help="steps with instant workers (default 30)")
    parser.add_argument("--real-steps", type=int, default=5, help="real tiny-preset steps (default 5)")
    parser.add_argument("--floor-steps", type=int, default=10, help="subflows for the Prefect-alone floor (default 10)")
    parser.add_argument(
        "--tiny-model",
        default=None,
        help="the tiny preset's built model folder (default: grpo-storage/models/tiny-qwen2 if built, "
        "else the same architecture randomly initialised)",
    )
    parser.add_argument(
        "--unbatched-recorder",
        action="store_true",
        help="ephemeral server's task-run recorder writes one event per transaction (Prefect's default; "
        "importing flows makes it up to 100)",
    )
    parser.add_argument(
        "--database",
        choices=("ephemeral", "sqlite", "postgres"),
        default="ephemeral",
        help="ephemeral: the ephemeral server as `grpo train` uses it (in-memory SQLite, flows/__init__.py); "
        "sqlite: `prefect server start` on a SQLite file; postgres: `prefect server start` on a local "
        "PostgreSQL (deployments/local_server.py, needs the postgres extra)",
    )
    parser.add_argument("--profile", type=int, default=0, metavar="N", help="cProfile the instant run; print the top N")
    parser.add_argument(
        "--backend",
        choices=["local", "ray"],
        default="local",
        help="ray: also run the instant and real steps on Ray actors (RAY_ADDRESS, else a local Ray instance) "
        "and print what Ray adds per step against the local backend",
    )


def check(args: argparse.Namespace) -> str | None:
    short = [name for name in ("steps", "real_steps", "floor_steps") if getattr(args, name) < 2]
    if short:
        return f"--{short[0].replace('_', '-')} must be at least 2 (the first step is a warm-up)"
    return None


def measure(args: argparse.Namespace) -> dict[str, Any]:
    if args.backend == "ray" and not os.environ.get("RAY_ADDRESS"):
        # The local Ray instance serves this process alone: its processes listen on the loopback address
        # (Ray maps 127.0.0.1 to the machine's outward address unless this is 0; read when Ray is imported).
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    if args.unbatched_recorder:  # read by the ephemeral server when it starts (at the first flow run)
        os.environ.update(PREFECT_DEFAULT_RECORDER)
    model = args.tiny_model or default_tiny_model()
    with tempfile.TemporaryDirectory(prefix="grpo-flow-orchestration-") as tmp, server(args.database, Path(tmp)):
        workdir = Path(tmp)
        instant = run_instant(workdir, args.steps, args.profile)
        flat = run_instant(workdir, args.steps, 0, step_subflows=False)
        floor = run_prefect_floor(args.floor_steps, TASKS_PER_STEP)
        real = run_real(workdir, args.real_steps, model)
        ray = None
        if args.backend == "ray":
            ray = (run_instant(workdir, args.steps, 0, ray=True), run_real(workdir, args.real_steps, model, ray=True))
    result = {
        "database": args.database,
        "parameter_walk_ms": parameter_walk_ms(),
        "orchestration_ms_per_step": instant["median_step_s"] * 1000,
        "tiny_step_ms": real["median_step_s"] * 1000,
        "share_of_tiny_step": instant["median_step_s"] / real["median_step_s"],
        "orchestration_mean_ms_per_step": instant["mean_step_s"] * 1000,
        "no_subflows_ms_per_step": flat["median_step_s"] * 1000,
        "no_subflows_mean_ms_per_step": flat["mean_step_s"] * 1000,
        "steps_over_3x_median": instant["steps_over_3x_median"],
        "no_subflows_steps_over_3x_median": flat["steps_over_3x_median"],
        "max_step_ms": instant["max_step_s"] * 1000,
        "max_over_median": instant["max_step_s"] / instant["median_step_s"],
        "mean_over_median": instant["mean_step_s"] / instant["median_step_s"],
        "in_subflow_ms": instant["median_in_subflow_s"] * 1000,
        "no_prefect_ms_per_step": instant["median_direct_step_s"] * 1000,
        "real_step_rest_ms": real["median_rest_s"] * 1000,
        "real_step_rest_share": real["median_rest_s"] / real["median_step_s"],
        "prefect_empty_subflow_ms": floor["subflow_s"] * 1000,
        "prefect_noop_task_ms": floor["task_s"] * 1000,
        "prefect_noop_step_ms": floor["subflow_with_tasks_s"] * 1000,
        "recorder_batch_size": int(os.environ.get("PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_BATCH_SIZE", "1")),
        "targets": {"orchestration_ms_per_step": 50.0, "share_of_tiny_step": 0.05},
        "api_requests_per_step": (instant["api_per_step"] or {}).get("requests"),
        "api_events_per_step": (instant["api_per_step"] or {}).get("events"),
        "instant": instant,
        "instant_no_subflows": flat,
        "real": real,
        "prefect_floor": floor,
    }
    return result | (ray_figures(instant, real, *ray) if ray else {})


def ray_figures(instant: dict, real: dict, ray_instant: dict, ray_real: dict) -> dict[str, Any]:
    """What the Ray backend adds against the local one, in ms per step and as ratios."""
    ms = 1000.0
    return {
        "ray_instant_ms_per_step": ray_instant["median_step_s"] * ms,
        "ray_adds_ms_per_step": (ray_instant["median_step_s"] - instant["median_step_s"]) * ms,
        "ray_instant_ratio": ray_instant["median_step_s"] / instant["median_step_s"],
        "ray_instant_stage_ms": {k: v * ms for k, v in ray_instant["median_stage_s"].items()},
        "ray_no_prefect_ms_per_step": ray_instant["median_direct_step_s"] * ms,
        "ray_adds_no_prefect_ms_per_step": (ray_instant["median_direct_step_s"] - instant["median_direct_step_s"]) * ms,
        "ray_no_prefect_ratio": ray_instant["median_direct_step_s"] / instant["median_direct_step_s"],
        "ray_real_step_ms": ray_real["median_step_s"] * ms,
        "ray_real_adds_ms_per_step": (ray_real["median_step_s"] - real["median_step_s"]) * ms,
        "ray_real_ratio": ray_real["median_step_s"] / real["median_step_s"],
        "ray_instant": ray_instant,
        "ray_real": ray_real,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    return harness.main(__doc__, measure, print_report, argv, options=options, check=check)


if __name__ == "__main__":
    main()
