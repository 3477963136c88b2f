"""The one place grpo-flow touches TRL internals: the GRPO objective is TRL's own code.

The actor builds a real `trl.GRPOTrainer` around its policy, never runs its training loop,
and calls `compute_loss(model, inputs)` with the tensors TRL's `_generate_and_score_completions`
would have produced: prompt_ids/prompt_mask (left padded), completion_ids/completion_mask
(right padded), advantages (B,), num_items_in_batch. Every loss_type, clipping rule, KL
term and metric name is therefore TRL's. `tests/workers/test_trl_objective.py` pins this
coupling: if a TRL upgrade changes the inputs it expects, that test fails.
"""

from __future__ import annotations

import tempfile
from typing import Any

import torch

from schemas.config import GRPOFlowConfig

TRL_VERSION = "1.16.0"


def grpo_args(config: GRPOFlowConfig, output_dir: str) -> Any:
    """TRL's GRPOConfig for our config: the same option names, one optimizer step per batch."""
    from trl import GRPOConfig

    on_gpu = torch.cuda.is_available()
    return GRPOConfig(
        output_dir=output_dir,
        use_cpu=not on_gpu,
        bf16=on_gpu if config.bf16 is None else config.bf16,
        report_to="none",
        save_strategy="no",
        seed=config.seed,
        learning_rate=config.learning_rate,
        lr_scheduler_type=config.lr_scheduler_type,
        warmup_steps=config.warmup_steps,
        weight_decay=config.weight_decay,
        max_grad_norm=config.max_grad_norm,
        per_device_train_batch_size=config.completions_per_step,
        gradient_accumulation_steps=1,
        num_generations=config.num_generations,
        max_completion_length=config.max_completion_length,
        temperature=config.temperature,
        top_p=config.top_p,
        loss_type=config.loss_type,
        beta=config.beta,
        epsilon=config.epsilon,
        epsilon_high=config.epsilon_high,
        scale_rewards=config.scale_rewards,
    )


def make_objective(model: Any, tokenizer: Any, config: GRPOFlowConfig) -> Any:
    """A GRPOTrainer used only for its objective (and its optimizer and scheduler factory)."""
    from datasets import Dataset
    from trl import GRPOTrainer

    def unused_reward(completions: list, **kwargs: Any) -> list[float]:  # rewards are scored by grpo-flow
        return [0.0] * len(completions)

    objective = GRPOTrainer(
        model=model,
        reward_funcs=unused_reward,
        args=grpo_args(config, tempfile.mkdtemp(prefix="grpo-flow-trl-")),
        train_dataset=Dataset.from_dict({"prompt": [""]}),
        processing_class=tokenizer,
    )
    objective.current_gradient_accumulation_steps = 1
    return objective


@torch.no_grad()
def reference_logprobs(objective: Any, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """Per-token log-probs of the completions under TRL's frozen reference model (loaded when beta > 0)."""
    input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
    attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    logps, _, _ = objective._get_per_token_logps_and_entropies(
        objective.ref_model, input_ids, attention_mask, inputs["completion_ids"].size(1)
    )
    return logps


def compute_loss(objective: Any, model: Any, inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
    """TRL's GRPO loss on one batch, and the metrics TRL logged while computing it (means)."""
    if objective.beta != 0.0:
        inputs = {**inputs, "ref_per_token_logps": reference_logprobs(objective, inputs)}
    mode = "train" if objective.model.training else "eval"  # where TRL files the metrics it logs
    objective._metrics[mode].clear()
    loss = objective.compute_loss(model, inputs)
    metrics = {name: sum(values) / len(values) for name, values in objective._metrics[mode].items() if values}
    objective._metrics[mode].clear()
    return loss, metrics
