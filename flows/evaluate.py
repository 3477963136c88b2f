"""The `evaluate` flow: pass@k of a run's checkpoint on held-out prompts.

    evaluate(run_id="my-run")                  the run's newest valid checkpoint
    evaluate(run_id="my-run", checkpoint=40)   a named one
    evaluate()                                 every run under the storage root whose newest valid
                                               checkpoint is newer than its last evaluation (the
                                               `evaluate/nightly` deployment); the rest are skipped

One flow with an optional run id, because Prefect names a deployment `<flow>/<deployment>`:
the nightly deployment is `evaluate/nightly` only if the sweep is the flow named `evaluate`.
The sweep evaluates each run in a child flow run of its own (named `eval-<run>-step-N`), so a
run that fails is one red child, and the others are still evaluated; the sweep then fails,
naming it.

What is measured, on the first `prompts` held-out prompts (the same ones the run's own greedy
evaluation uses), with the checkpoint's weights (`checkpoints/step-NNNNNN/model`):

- k completions per prompt, sampled at the run's temperature and top_p (TransformersRolloutEngine,
  SamplingParams n=k), each scored 0/1 by the data set's accuracy reward;
- pass@j for j = 1, 2, 4, ... up to k (and k itself), with the unbiased estimator of Chen et al.
  2021: per prompt 1 - C(n-c, j) / C(n, j) for n samples of which c are correct, averaged over
  prompts. pass@1 is therefore the mean sampled accuracy, not greedy accuracy;
- greedy accuracy as well (one more completion per prompt, `greedy=False` leaves it out): it is
  the figure the run's summary reports as `final_eval_accuracy`, so the two can be compared;
- mean reward (the run's own reward functions and weights, as in training) and mean completion
  length (tokens) of the sampled completions.

Results: `runs/<id>/eval/step-NNNNNN.parquet`, one row per completion (mode `sample` or `greedy`,
prompt_id, sample_index, prompt, completion, completion_tokens, finish_reason, reward, one
`reward_<function>` column per function, correct, and the data set's answer columns), with the
summary as JSON in the file's schema metadata (key `grpo_flow.eval`; `read_eval_summary`). A file
is never overwritten: it is linked into place, which fails if one exists, and a checkpoint that
has one is read back instead of evaluated again (`force=True` evaluates it again, and moves
the earlier file to `eval/superseded/` once the new one is made). Also: a Prefect table artifact `eval-<run>`
(one row per evaluated checkpoint of the run), and wandb when the run's config has
report_to=wandb (metrics `eval/...` against `eval/checkpoint_step`).
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.runtime import flow_run

from grpo_flow.schemas.config import GRPOFlowConfig, check_run_id
from grpo_flow.schemas.records import REWARD_PREFIX, RolloutBatch
from grpo_flow.tasks.observability import artifact_key
from grpo_flow.workers.state.storage import (
    EVAL_METADATA_KEY,
    DamagedRunFileError,
    RunStorage,
    atomic_write,
    clean_stale_temps,
    is_remote,
    list_runs,
    move,
    read_eval_summary,
)
from grpo_flow.workers.state.storage import eval_metric_names as metric_names
from grpo_flow.workers.state.resume import held_by_the_python_api
from grpo_flow.workers.state.tracking import wandb_dir

__all__ = ["EVAL_METADATA_KEY", "metric_names", "read_eval_summary"]  # kept importable from here
DEFAULT_K = 8
DEFAULT_PROMPTS = 100  # when the run's own eval_prompts is 0
PROMPTS_PER_BATCH = 16  # prompts per generate call: k completions each


class EvaluationError(ValueError):
    """A run or checkpoint cannot be evaluated as asked (unknown run, no valid checkpoint, bad k)."""


def default_storage_root() -> str:
    """The CLI's rule: $GRPO_FLOW_STORAGE, else ./grpo-storage (read at call time, not import time)."""
    return os.environ.get("GRPO_FLOW_STORAGE", "grpo-storage")


# -- pass@k ------------------------------------------------------------------------------------------
def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k for one prompt with n samples of which c are correct (Chen et al. 2021):
    1 - C(n-c, k) / C(n, k), computed as a product so it stays exact for large n."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n; got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - float(np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def pass_k_values(k: int) -> list[int]:
    """1, 2, 4, ... below k, and k: the curve without evaluating every j."""
    values = {k}
    j = 1
    while j < k:
        values.add(j)
        j *= 2
    return sorted(values)


def evaluation_refusal(config: GRPOFlowConfig, run_id: str) -> str | None:
    """Why the run's checkpoints cannot be evaluated (known once its data set loads, before any model), or None."""
    from grpo_flow.workers.rewards.task import run_task

    if config.tools or config.environment_factory:  # single turns would score a policy that needs its tools
        return (
            f"run {run_id!r} trains multi-turn episodes with tools, which grpo eval does not play yet; its held-out "
            f"accuracy is in its summary (eval_prompts), or, from a checkout: python -m benchmarks.tools_accuracy {run_id}"
        )
    if len(run_task(config).heldout) == 0:
        return (
            f"run {run_id!r} holds out no prompts: its data set has no test or validation split, and without an "
            "accuracy_reward a run holds none of its prompts out (start it with --accuracy-reward)"
        )
    return None


# -- eval files ----------------------------------------------------------------------------------------
def supersede(storage: RunStorage, step: int) -> Path:
    """Move a checkpoint's stored evaluation to eval/superseded/ (never deleted), so it can be made again."""
    path = storage.eval_path(step)
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    target = path.parent / "superseded" / f"{path.stem}.{stamp}.parquet"
    move(path, target)
    return target


def write_once(path: Path, table: pa.Table) -> Path:
    """Write `table` to `path` unless a file is there (atomic, and refused if `path` exists even when two
    evaluations race)."""
    if not is_remote(path):  # an object store has no temporary names
        path.parent.mkdir(parents=True, exist_ok=True)
        clean_stale_temps([path.parent])  # what an evaluation killed mid-write left
    try:
        atomic_write(path, lambda tmp: pq.write_table(table, tmp), exclusive=True)
    except FileExistsError:
        raise FileExistsError(f"an evaluation is already stored at {path}; it is never overwritten") from None
    return path


def resolve_checkpoint(storage: RunStorage, checkpoint: int | None) -> int:
    """The named checkpoint (verified against its manifest) or the newest valid one."""
    if not storage.exists():
        raise EvaluationError(f"no run {storage.run_id!r} under {storage.root / 'runs'}")
    if checkpoint is None:
        step = storage.latest_valid_checkpoint()
        if step is None:
            raise EvaluationError(f"run {storage.run_id!r} has no valid checkpoint yet")
        return step
    if checkpoint not in storage.checkpoint_steps():
        steps = storage.checkpoint_steps()
        raise EvaluationError(
            f"run {storage.run_id!r} has no checkpoint of step {checkpoint}; checkpoints: {steps or 'none'}"
        )
    from grpo_flow.workers.state.storage import DamagedCheckpointError

    try:
        storage.verify_checkpoint(checkpoint)
    except DamagedCheckpointError as error:
        raise EvaluationError(str(error)) from None
    return checkpoint


# -- the measurement -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class EvalSettings:
    """What one evaluation measures; recorded with its results."""

    k: int
    prompts: int
    temperature: float
    top_p: float
    max_tokens: int
    seed: int
    greedy: bool


def settings_for(
    config: GRPOFlowConfig, k: int, prompts: int | None, temperature: float | None, seed: int, greedy: bool
) -> EvalSettings:
    if k < 1:
        raise EvaluationError(f"k: must be at least 1, got {k}")
    if prompts is not None and prompts < 1:
        raise EvaluationError(f"prompts: must be at least 1, got {prompts}")
    return EvalSettings(
        k=k,
        prompts=prompts or config.eval_prompts or DEFAULT_PROMPTS,
        temperature=config.temperature if temperature is None else temperature,
        top_p=config.top_p,
        max_tokens=config.max_completion_length,
        seed=seed,
        greedy=greedy,
    )


def _batch_rows(batch: RolloutBatch, mode: str, correct: list[bool | None]) -> list[dict[str, Any]]:
    rows = []
    for i in range(len(batch)):
        reward = batch.reward[i]
        row = {
            "run_id": batch.run_id,
            "step": batch.step,
            "mode": mode,
            "prompt_id": batch.prompt_id[i],
            "sample_index": batch.sample_index[i],
            "prompt": batch.prompt[i],
            "completion": batch.completion[i],
            "completion_tokens": len(batch.completion_token_ids[i]),
            "finish_reason": batch.finish_reason[i],
            "reward": None if reward is None or math.isnan(reward) else reward,
            **{REWARD_PREFIX + name: scores[i] for name, scores in batch.rewards.items()},
            "correct": correct[i],
            **{name: values[i] for name, values in batch.extra_columns.items()},
        }
        rows.append(row)
    return rows


def summarize(rows: list[dict[str, Any]], settings: EvalSettings) -> dict[str, float]:
    """pass@j for each j of `pass_k_values(k)`, greedy accuracy, mean reward and completion length."""
    sampled = [r for r in rows if r["mode"] == "sample"]
    metrics: dict[str, float] = {}
    per_prompt: dict[str, list[bool | None]] = {}
    for row in sampled:
        per_prompt.setdefault(row["prompt_id"], []).append(row["correct"])
    defined = all(c is not None for results in per_prompt.values() for c in results) and per_prompt
    for j in pass_k_values(settings.k):
        metrics[f"pass@{j}"] = (
            float(np.mean([pass_at_k(len(r), sum(map(bool, r)), j) for r in per_prompt.values()]))
            if defined
            else math.nan
        )
    greedy = [r["correct"] for r in rows if r["mode"] == "greedy"]
    metrics["greedy_accuracy"] = (
        float(np.mean([bool(c) for c in greedy])) if greedy and all(c is not None for c in greedy) else math.nan
    )
    rewards = [r["reward"] for r in sampled if r["reward"] is not None]
    metrics["mean_reward"] = float(np.mean(rewards)) if rewards else math.nan
    metrics["mean_completion_length"] = (
        float(np.mean([r["completion_tokens"] for r in sampled])) if sampled else math.nan
    )
    return metrics


def checkpoint_files(storage: RunStorage, step: int) -> Path:
    """The checkpoint's folder with its model's files; for a run on the Modal backend, those files fetched
    from the Volume into `<storage_root>/cache` (the Modal client is imported only then)."""
    if storage.remote:
        return storage.local_checkpoint(step)
    folder = storage.checkpoint_dir(step)
    if (folder / "model").is_dir() or (folder / "adapter").is_dir():
        return folder
    from grpo_flow.workers.backends.modal_backend import checkpoint_model_files

    return checkpoint_model_files(folder, storage.root / "cache")


def checkpoint_engine(storage: RunStorage, step: int, device: str) -> Any:
    """A transformers engine running the checkpoint's policy: its weights, or with use_lora its base model
    with the adapter on top (the checkpoint holds no full weights then)."""
    from grpo_flow.workers.actor.actor import ADAPTER_DIR, MODEL_DIR
    from grpo_flow.workers.actor.export import base_model_path, is_adapter_checkpoint
    from grpo_flow.workers.backends.weight_sync import WeightPayload, apply_weights
    from grpo_flow.workers.rollout.transformers_engine import TransformersRolloutEngine

    folder = checkpoint_files(storage, step)
    adapter = is_adapter_checkpoint(folder)
    model = base_model_path(folder, storage.root) if adapter else folder / MODEL_DIR
    engine = TransformersRolloutEngine(model, worker_id="eval", device=device)
    engine.load()
    if adapter:
        apply_weights(engine, WeightPayload("lora", step, path=str(folder / ADAPTER_DIR)))
    return engine


@task(name="evaluate-checkpoint", retries=1, retry_delay_seconds=5, cache_policy=NO_CACHE)
def evaluate_checkpoint(
    run_id: str,
    storage_root: str,
    step: int,
    k: int,
    prompts: int | None,
    temperature: float | None,
    seed: int,
    greedy: bool,
    force: bool = False,
) -> dict[str, Any]:
    """Sample, score and store one checkpoint's evaluation; returns its summary.

    Not cached: the eval file is the record. Safe to retry: nothing is stored until the file is
    linked into place, and a retry that finds the file reads it back. `force`: the checkpoint is
    evaluated again, and a stored evaluation is moved to eval/superseded/ when the new one is written.
    """
    from grpo_flow.workers.backends import local_device
    from grpo_flow.workers.rewards.task import run_task
    from grpo_flow.workers.rewards.functions import RewardTrainerState, resolve_reward_funcs, score_batch
    from grpo_flow.workers.rollout.base import SamplingParams
    from grpo_flow.workers.rollout.heldout import accuracy_reward, answered, correct, greedy_batch

    storage = RunStorage(storage_root, run_id)
    path = storage.eval_path(step)
    if path.exists() and not force:
        return {**read_eval_summary(path), "already_evaluated": True}
    started = time.perf_counter()
    config = GRPOFlowConfig(**storage.effective_config())
    if (refusal := evaluation_refusal(config, run_id)) is not None:  # before the model loads
        raise EvaluationError(refusal)
    settings = settings_for(config, k, prompts, temperature, seed, greedy)
    task_data = run_task(config)
    heldout = list(task_data.heldout.select(range(min(settings.prompts, len(task_data.heldout)))))
    funcs = resolve_reward_funcs(config.reward_funcs or list(task_data.default_rewards), run_id)
    accuracy = accuracy_reward(task_data)
    state = RewardTrainerState(
        global_step=step,
        max_steps=config.total_steps(len(task_data.train)),
        epoch=step * config.prompts_per_step / max(1, len(task_data.train)),
    )
    engine = checkpoint_engine(storage, step, local_device(config))
    columns = list(task_data.extra_columns)
    rows: list[dict[str, Any]] = []
    for start in range(0, len(heldout), PROMPTS_PER_BATCH):
        chunk = heldout[start : start + PROMPTS_PER_BATCH]
        params = SamplingParams(
            n=settings.k,
            max_tokens=settings.max_tokens,
            temperature=settings.temperature,
            top_p=settings.top_p,
            seed=int(np.random.SeedSequence([settings.seed, start]).generate_state(1)[0]),
        )
        result = answered(engine, engine.generate([row["prompt"] for row in chunk], params, config.max_prompt_length))
        batches = {"sample": RolloutBatch.from_generation(chunk, result, run_id=run_id, step=step, columns=columns)}
        if settings.greedy:  # the run's own held-out accuracy, measured as the run measures it
            batches["greedy"] = greedy_batch(
                engine, chunk, settings.max_tokens, config.max_prompt_length, run_id=run_id, step=step, columns=columns
            )
        for mode, batch in batches.items():
            scored = score_batch(batch, funcs, config.reward_weights, state)  # training's scorer
            rows += _batch_rows(scored, mode, correct(scored, accuracy, state))
    summary = {
        "run_id": run_id,
        "checkpoint_step": step,
        "dataset": config.dataset,
        "model": config.model,
        "accuracy_reward": task_data.accuracy_reward,
        "reward_funcs": list(funcs),
        "num_prompts": len(heldout),
        "samples_per_prompt": settings.k,
        **{f"setting_{name}": value for name, value in vars(settings).items()},
        **summarize(rows, settings),
        "eval_seconds": time.perf_counter() - started,
        "evaluated_at": datetime.now(timezone.utc).isoformat(),
        "path": str(path),
    }
    table = pa.Table.from_pylist(rows)
    table = table.replace_schema_metadata({EVAL_METADATA_KEY: json.dumps(summary).encode()})
    if force and path.exists():  # only now: an evaluation that fails leaves the stored one where it was
        supersede(storage, step)
    try:
        write_once(path, table)
    except FileExistsError:  # another evaluation of the same checkpoint finished first: keep its file
        return {**read_eval_summary(path), "already_evaluated": True}
    return {**summary, "already_evaluated": False}


@task(name="publish-evaluation", retries=2, retry_delay_seconds=2, cache_policy=NO_CACHE)
def publish_evaluation(run_id: str, storage_root: str, summary: dict[str, Any]) -> None:
    """A table artifact with every evaluated checkpoint of the run, and wandb when the run reports there."""
    from prefect.artifacts import create_table_artifact

    storage = RunStorage(storage_root, run_id)
    history = []
    for step in storage.evaluated_steps():
        stored = read_eval_summary(storage.eval_path(step))
        history.append({"checkpoint_step": step, **{name: stored[name] for name in metric_names(stored)}})
    create_table_artifact(
        key=artifact_key("eval", run_id),
        table=history,
        description=f"Held-out evaluation of run {run_id}: one row per evaluated checkpoint "
        f"(k={summary['samples_per_prompt']}, {summary['num_prompts']} prompts)",
    )
    config = GRPOFlowConfig(**storage.effective_config())
    if config.report_to == "wandb":
        try:
            wandb_log_evaluation(config, run_id, summary)
        except Exception as error:
            # The eval file is the record and is already stored; failing here would not bring the
            # wandb entry back (the nightly sweep skips an evaluated checkpoint), so say it and go on.
            get_run_logger().warning(
                "run %s: evaluation not logged to wandb: %s: %s", run_id, type(error).__name__, error
            )


def wandb_log_evaluation(config: GRPOFlowConfig, run_id: str, summary: dict[str, Any]) -> None:
    """Log to the run's own wandb run (id = run id), against `eval/checkpoint_step`: wandb drops a
    `step=` lower than the run's last, and evaluation comes after training has logged its steps."""
    import wandb

    run = wandb.init(
        project=config.wandb_project,
        id=run_id,
        name=run_id,
        resume="allow",
        reinit="create_new",
        config=config.model_dump(mode="json"),
        dir=wandb_dir(),
    )
    try:
        run.define_metric("eval/checkpoint_step")
        run.define_metric("eval/*", step_metric="eval/checkpoint_step")
        numbers = {f"eval/{name}": summary[name] for name in metric_names(summary)}
        run.log({"eval/checkpoint_step": summary["checkpoint_step"], **numbers})
    finally:
        run.finish()


# -- the flow ------------------------------------------------------------------------------------------
def evaluate_run_name() -> str:
    parameters = flow_run.parameters
    run_id, checkpoint = parameters.get("run_id"), parameters.get("checkpoint")
    if run_id is None:
        return f"nightly-{datetime.now(timezone.utc):%Y%m%d-%H%M}"
    return f"eval-{run_id}" + (f"-step-{checkpoint}" if checkpoint is not None else "")


def needs_evaluation(storage: RunStorage) -> tuple[int | None, str]:
    """(checkpoint to evaluate, or None with the reason to skip the run)."""
    try:
        config = storage.effective_config()
    except DamagedRunFileError as error:  # one run's damaged record skips that run, not the sweep
        return None, str(error)
    held = held_by_the_python_api(config)
    if held:
        return None, f"it was started from the Python API with {held}, which only that Python process holds"
    dataset = str(config.get("dataset", "")).removeprefix("hf:")
    if str(config.get("dataset", "")).startswith("hf:") and os.path.isabs(dataset) and not os.path.exists(dataset):
        return None, f"its data set {dataset} no longer exists"
    if str(config.get("dataset", "")).startswith("hf:") and not config.get("accuracy_reward"):
        return None, "it names no accuracy_reward, so its held-out accuracy and pass@k cannot be measured"
    newest = storage.latest_valid_checkpoint()
    if newest is None:
        return None, "no valid checkpoint"
    done = storage.evaluated_steps()
    if done and newest <= done[-1]:
        return None, f"checkpoint {newest} is not newer than its last evaluation ({done[-1]})"
    return newest, ""


def evaluate_all(
    storage_root: str, k: int, prompts: int | None, temperature: float | None, seed: int, greedy: bool
) -> dict[str, Any]:
    """The sweep: each run that needs it in a child `evaluate` flow run; the others skipped, with why."""
    logger = get_run_logger()
    evaluated: dict[str, dict[str, Any]] = {}
    skipped: dict[str, str] = {}
    failed: dict[str, str] = {}
    for info in list_runs(storage_root):
        storage = RunStorage(storage_root, info.run_id)
        step, reason = needs_evaluation(storage)
        if step is None:
            skipped[info.run_id] = reason
            logger.info("skipping run %s: %s", info.run_id, reason)
            continue
        state = evaluate(
            run_id=info.run_id,
            storage_root=storage_root,
            checkpoint=step,
            k=k,
            prompts=prompts,
            temperature=temperature,
            seed=seed,
            greedy=greedy,
            return_state=True,
        )
        if state.is_completed():
            evaluated[info.run_id] = state.result()
        else:
            failed[info.run_id] = state.message or state.name or "failed"
    from prefect.artifacts import create_table_artifact

    table = [
        {
            "run_id": run,
            "action": "evaluated",
            "checkpoint_step": s["checkpoint_step"],
            **{name: s[name] for name in metric_names(s)},
        }
        for run, s in evaluated.items()
    ]
    table += [{"run_id": run, "action": "skipped", "reason": why} for run, why in skipped.items()]
    table += [{"run_id": run, "action": "failed", "reason": why} for run, why in failed.items()]
    create_table_artifact(key="evaluate-nightly", table=table, description=f"Nightly evaluation of {storage_root}")
    outcome = {"storage_root": storage_root, "evaluated": evaluated, "skipped": skipped, "failed": failed}
    if failed:
        raise RuntimeError(f"evaluation failed for runs {sorted(failed)}: " + "; ".join(failed.values()))
    return outcome


@flow(name="evaluate", flow_run_name=evaluate_run_name, validate_parameters=True)
def evaluate(
    run_id: str | None = None,
    storage_root: str | None = None,
    checkpoint: int | None = None,
    k: int = DEFAULT_K,
    prompts: int | None = None,
    temperature: float | None = None,
    seed: int = 0,
    greedy: bool = True,
    force: bool = False,
) -> dict[str, Any]:
    """Evaluate a run's checkpoint on held-out prompts, or, with no run id, every run that needs it.

    Args:
        run_id: The run to evaluate; None evaluates every run under the storage root whose newest
            valid checkpoint is newer than its last evaluation.
        storage_root: Folder holding `runs/`; None: $GRPO_FLOW_STORAGE, else ./grpo-storage.
        checkpoint: Checkpoint step to evaluate (needs run_id); None: the newest valid one.
        k: Completions sampled per prompt; pass@1 ... pass@k are reported.
        prompts: Held-out prompts (the first N); None: the run's eval_prompts, or 100 if it is 0.
        temperature: Sampling temperature; None: the run's.
        seed: Seed of the sampling.
        greedy: Also measure greedy accuracy (one more completion per prompt).
        force: Evaluate again a checkpoint that has a stored evaluation (moved to eval/superseded/).
    """
    storage_root = storage_root or default_storage_root()
    if run_id is None:
        if checkpoint is not None:
            raise EvaluationError("checkpoint: needs run_id (the nightly sweep evaluates each run's newest)")
        return evaluate_all(storage_root, k, prompts, temperature, seed, greedy)
    try:
        check_run_id(run_id)  # a name under the storage root, never a path out of it
    except ValueError as error:
        raise EvaluationError(f"run_id: {error}") from None
    storage = RunStorage(storage_root, run_id)
    step = resolve_checkpoint(storage, checkpoint)
    summary = evaluate_checkpoint(run_id, storage_root, step, k, prompts, temperature, seed, greedy, force)
    if summary["already_evaluated"]:
        get_run_logger().info("checkpoint %d of run %s was already evaluated: %s", step, run_id, summary["path"])
    else:
        publish_evaluation(run_id, storage_root, summary)
    return summary
