"""TRL's side of the benchmarks that run TRL's GRPOTrainer against grpo-flow (vs_trl, learning):
one way to configure it, so both compare against the same TRL set-up.

The GRPO fields are given in grpo-flow's names (`prompts_per_step` is TRL's generation batch
divided by `num_generations`); everything else is what a CPU comparison needs: fp32 (TRL's
GRPOConfig turns bf16 autocast on by default, which on CPU triples the step), no saving, no
logging, no progress bar, no activation checkpointing (TRL's GRPOConfig turns it on by default
and recomputes activations in the backward; grpo-flow's `gradient_checkpointing` is off unless
asked, so the two sides do the same computation). One optimizer step per generation batch (gradient_accumulation_steps
1, steps_per_generation 1), as grpo-flow's one actor step per training step.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def grpo_config(
    output_dir: str | Path,
    *,
    steps: int,
    seed: int,
    prompts_per_step: int,
    num_generations: int,
    max_completion_length: int,
    temperature: float,
    top_p: float,
    learning_rate: float,
    loss_type: str,
    beta: float,
    lr_scheduler_type: str = "constant",
    **more: Any,
) -> Any:
    """TRL's GRPOConfig for `steps` optimizer steps of `prompts_per_step x num_generations` completions."""
    from trl import GRPOConfig

    return GRPOConfig(
        output_dir=str(output_dir),
        use_cpu=True,
        bf16=False,
        report_to="none",
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        max_steps=steps,
        per_device_train_batch_size=prompts_per_step * num_generations,
        gradient_accumulation_steps=1,
        num_generations=num_generations,
        max_completion_length=max_completion_length,
        temperature=temperature,
        top_p=top_p,
        learning_rate=learning_rate,
        lr_scheduler_type=lr_scheduler_type,
        loss_type=loss_type,
        beta=beta,
        seed=seed,
        **{checkpointing_option(GRPOConfig): False, **more},
    )


def checkpointing_option(config_class: Any) -> str:
    """transformers' name for activation checkpointing: `activation_checkpointing` since it was renamed (the
    old name warns there), `gradient_checkpointing` in older releases (the vLLM environment's)."""
    import dataclasses

    names = {option.name for option in dataclasses.fields(config_class)}
    return "activation_checkpointing" if "activation_checkpointing" in names else "gradient_checkpointing"


def grpo_trainer(
    model_path: str,
    reward_funcs: Any,
    args: Any,
    train_dataset: Any,
    callbacks: list | None = None,
    peft_config: Any = None,
    **tools: Any,
) -> Any:
    """TRL's GRPOTrainer on a local model folder, loaded in fp32 with its tokenizer padding on the left;
    `peft_config`: peft's LoraConfig with LoRA (TRL wraps the model); `tools`: its `tools=` and
    `environment_factory=`, when the task has them."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, PrinterCallback
    from trl import GRPOTrainer

    trainer = GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32),
        reward_funcs=reward_funcs,
        args=args,
        train_dataset=train_dataset,
        processing_class=AutoTokenizer.from_pretrained(model_path, padding_side="left"),
        callbacks=callbacks,
        peft_config=peft_config,
        **tools,
    )
    # With the progress bar off, transformers prints every log dict (the end-of-training summary): noise
    # between the benchmarks' own lines.
    trainer.remove_callback(PrinterCallback)
    return trainer
