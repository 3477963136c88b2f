"""Single-node ("simple") mode: TRL's own GRPOTrainer loop on the same config, data and rewards.

For users who want TRL's exact behaviour: generation, scoring, batching and the optimizer
loop are all TRL's. grpo-flow adds the storage layout: one metrics Parquet row per step (TRL's
logged names) and checkpoints in the same manifest-last format, so `grpo runs`, pandas and
the evaluation flow read a simple-mode run like any other. Rollouts are not logged (TRL's
loop does not hand them out), and a simple-mode run does not resume.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from grpo_flow.schemas.config import GRPOFlowConfig
from grpo_flow.schemas.records import RunPlan, metrics_table
from grpo_flow.workers.state.storage import RunStorage


def storage_callback(
    storage: RunStorage, config: GRPOFlowConfig, plan: RunPlan, on_row: Callable[[dict[str, Any]], None]
) -> Any:
    """A transformers TrainerCallback writing TRL's logs and our checkpoints into the run's folder (the
    checkpoints in the `grpo` flow's layout: a LoRA run's holds the adapter); `on_row` gets each step's row."""
    import torch
    from transformers import TrainerCallback

    from grpo_flow.workers.actor.actor import save_policy

    lora = config.use_lora

    class StorageCallback(TrainerCallback):
        def __init__(self) -> None:
            self.step_started = time.perf_counter()

        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.step_started = time.perf_counter()

        def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any):
            step = state.global_step
            if not logs or step == 0 or storage.metrics_path(step).exists() or "loss" not in logs:
                return  # the end-of-training summary log repeats no step; a step is logged once
            numbers = {k: float(v) for k, v in logs.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
            row = {
                "run_id": plan.run_id,
                "step": step,
                "policy_version": step,
                "num_completions": config.completions_per_step,
                **numbers,
                "step_s": time.perf_counter() - self.step_started,
            }
            storage.write_metrics(step, metrics_table(row))
            on_row(row)

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            step = state.global_step
            if step % config.save_steps and step != plan.total_steps:
                return

            def write(folder: Path) -> dict[str, Any]:
                save_policy(kwargs["model"], kwargs["processing_class"], folder, config.model, plan.model_path, lora)
                torch.save(kwargs["optimizer"].state_dict(), folder / "optimizer.pt")
                torch.save(kwargs["lr_scheduler"].state_dict(), folder / "scheduler.pt")
                return {"policy_version": step, "mode": "simple", "config_hash": config.training_hash()}

            storage.write_checkpoint(step, write)

    return StorageCallback()


def console_progress(trainer: Any, run_id: str, show_progress: bool) -> None:
    """What the trainer prints: a progress bar over steps with reward and loss, as the `grpo` flow shows,
    or nothing. transformers' own console callbacks print every log dict (PrinterCallback, or the
    progress bar's `write`), which a run prints only to its metrics."""
    from transformers.trainer import DEFAULT_PROGRESS_CALLBACK  # the notebook's bar in a notebook
    from transformers.trainer_callback import PrinterCallback, ProgressCallback
    from tqdm.auto import tqdm

    # The Trainer added one of the two (PrinterCallback when disable_tqdm); removing an absent one does nothing.
    trainer.remove_callback(PrinterCallback)
    trainer.remove_callback(DEFAULT_PROGRESS_CALLBACK)

    class StepProgress(ProgressCallback):
        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.training_bar = tqdm(total=state.max_steps, desc=run_id, unit="step")
            self.current_step = 0

        def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any):
            if self.training_bar is not None and logs and "loss" in logs and "reward" in logs:
                self.training_bar.set_postfix(reward=f"{logs['reward']:.3f}", loss=f"{logs['loss']:.4f}")

    if show_progress:
        trainer.add_callback(StepProgress())


def train_with_trl(
    config: GRPOFlowConfig,
    plan: RunPlan,
    reward_funcs: list[Any],
    train_dataset: Any,
    show_progress: bool = False,
    on_row: Callable[[dict[str, Any]], None] = lambda row: None,
) -> dict[str, Any]:
    """Run GRPOTrainer.train() for the run's steps (with peft's LoRA as the `grpo` flow's actor applies it);
    returns TRL's final training output as numbers."""
    from transformers import AutoModelForCausalLM
    from trl import GRPOTrainer

    from grpo_flow.workers.rollout.base import load_generation_tokenizer
    from grpo_flow.workers.actor.trl_objective import grpo_args, lora_config

    storage = RunStorage.of(plan)
    # The run's own storage holds what it logs; TRL's output_dir (save_strategy "no") holds nothing kept.
    output_dir = tempfile.TemporaryDirectory(prefix="grpo-flow-simple-")
    args = grpo_args(config, output_dir.name)
    args.max_steps = plan.total_steps
    args.logging_steps = 1
    args.report_to = ["wandb"] if config.report_to == "wandb" else []
    tokenizer = load_generation_tokenizer(plan.model_path)
    args.reward_weights = config.reward_weights  # TRL's GRPOConfig field, same rule as ours
    tools: dict[str, Any] = {}
    if config.tools or config.environment_factory:  # TRL plays the episodes itself, with the same objects
        from grpo_flow.workers.tools.toolbox import toolbox_for, trl_tool_arguments

        tools = trl_tool_arguments(toolbox_for(config.tools, config.environment_factory, plan.run_id))
    trainer = GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(plan.model_path),
        reward_funcs=reward_funcs,
        args=args,
        train_dataset=train_dataset,
        processing_class=tokenizer,
        callbacks=[storage_callback(storage, config, plan, on_row)],
        peft_config=lora_config(config) if config.use_lora else None,
        **tools,
    )
    console_progress(trainer, plan.run_id, show_progress)
    with output_dir:
        output = trainer.train()
    return {k: float(v) for k, v in output.metrics.items() if isinstance(v, (int, float))}
