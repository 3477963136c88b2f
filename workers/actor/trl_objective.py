"""The one place grpo-flow touches TRL internals: the GRPO objective is TRL's own code.

The actor builds a real `trl.GRPOTrainer` around its policy (with peft's LoRA when asked),
never runs its training loop, and calls `compute_loss(model, inputs)` with the tensors TRL's
`_generate_and_score_completions` would have produced: prompt_ids/prompt_mask (left padded),
completion_ids/completion_mask (right padded), advantages (B,), num_items_in_batch, and when
they apply old_per_token_logps, ref_per_token_logps and importance_sampling_ratio. Every
loss_type, clipping rule, KL term and metric name is therefore TRL's.

Two things TRL computes inline in `_generate_and_score_completions`, with no function to call,
are rebuilt here from the same formulas: the vLLM importance-sampling ratio (with its
sampling/* metrics) and the micro-batch normaliser. `tests/workers/actor/test_trl_parity.py` runs
TRL's own trainer next to the actor for every loss type and option and compares the loss and
the weights, so a TRL upgrade that changes any of this fails there.
"""

from __future__ import annotations

import math
import tempfile
from typing import Any

import torch

from grpo_flow.schemas.config import GRPOFlowConfig

TRL_VERSION = "1.16.0"


def device_options(config: GRPOFlowConfig, device: str | None = None) -> dict[str, Any]:
    """TRL's use_cpu, and bf16 (None: on with a CUDA GPU), for a policy on `device` (the actor's; None:
    config.device, `auto` meaning a CUDA GPU when torch sees one). They follow where the policy is, not
    whether the machine has a GPU: a CPU actor on a CUDA machine was handed to TRL with use_cpu=False."""
    if device is None:
        device = "cuda" if config.device == "cuda" or (config.device == "auto" and torch.cuda.is_available()) else "cpu"
    on_gpu = device.startswith("cuda")
    return {"use_cpu": not on_gpu, "bf16": on_gpu if config.bf16 is None else config.bf16}


def grpo_args(config: GRPOFlowConfig, output_dir: str, device: str | None = None) -> Any:
    """TRL's GRPOConfig for our config: the same option names, one optimizer step per batch, on the
    policy's `device` (`device_options`)."""
    from trl import GRPOConfig

    return GRPOConfig(
        output_dir=output_dir,
        **device_options(config, device),
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
        delta=config.delta,
        sapo_temperature_neg=config.sapo_temperature_neg,
        sapo_temperature_pos=config.sapo_temperature_pos,
        vespo_k_pos=config.vespo_k_pos,
        vespo_lambda_pos=config.vespo_lambda_pos,
        vespo_k_neg=config.vespo_k_neg,
        vespo_lambda_neg=config.vespo_lambda_neg,
        off_policy_mask_threshold=config.off_policy_mask_threshold,
        use_bias_correction_kl=config.use_bias_correction_kl,
        scale_rewards=config.scale_rewards,
        multi_objective_aggregation=config.multi_objective_aggregation,
        importance_sampling_level=config.importance_sampling_level,
        num_iterations=config.num_iterations,
        mask_truncated_completions=config.mask_truncated_completions,
        max_tool_calling_iterations=config.max_tool_calling_iterations,
        top_entropy_quantile=config.top_entropy_quantile,
        vllm_importance_sampling_correction=config.vllm_importance_sampling_correction,
        vllm_importance_sampling_mode=config.vllm_importance_sampling_mode,
        vllm_importance_sampling_clip_min=config.vllm_importance_sampling_clip_min,
        vllm_importance_sampling_clip_max=config.vllm_importance_sampling_clip_max,
        # By transformers' new name: TRL's default `gradient_checkpointing=True` (the old name) made
        # transformers warn at every construction, and left args saying "on" for a model that is not.
        activation_checkpointing=config.gradient_checkpointing,
    )


def lora_config(config: GRPOFlowConfig) -> Any:
    """peft's LoraConfig from the run's LoRA options (the defaults the config's help texts state)."""
    from peft import LoraConfig

    return LoraConfig(
        r=config.lora_r or 16,
        lora_alpha=config.lora_alpha or 32,
        lora_dropout=config.lora_dropout or 0.0,
        target_modules=config.lora_target_modules or "all-linear",
        task_type="CAUSAL_LM",
    )


def make_objective(model: Any, tokenizer: Any, config: GRPOFlowConfig) -> Any:
    """A GRPOTrainer used only for its objective (and its optimizer and scheduler factory).

    With use_lora, TRL wraps the policy in peft (`objective.model` is then the PeftModel) and
    uses the base model, adapters disabled, as the KL reference.
    """
    from datasets import Dataset
    from trl import GRPOTrainer

    def unused_reward(completions: list, **kwargs: Any) -> list[float | None]:  # rewards are scored by grpo-flow
        return [0.0] * len(completions)

    # The trainer never saves or reports (save_strategy "no", report_to "none"): its output_dir only has to
    # exist while it is built.
    with tempfile.TemporaryDirectory(prefix="grpo-flow-trl-") as output_dir:
        objective = GRPOTrainer(
            model=model,
            reward_funcs=unused_reward,
            args=grpo_args(config, output_dir, device=next(model.parameters()).device.type),
            train_dataset=Dataset.from_dict({"prompt": [""]}),
            processing_class=tokenizer,
            peft_config=lora_config(config) if config.use_lora else None,
        )
    objective.current_gradient_accumulation_steps = 1
    return objective


def per_token_logprobs(objective: Any, model: Any, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """Per-token log-probs of the completions under `model`, by TRL's own forward (temperature applied)."""
    input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
    attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    logps, _, _ = objective._get_per_token_logps_and_entropies(
        model, input_ids, attention_mask, inputs["completion_ids"].size(1)
    )
    return logps


@torch.no_grad()
def old_logprobs(objective: Any, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """The policy's log-probs before this step's updates (num_iterations > 1 and the IS correction need them)."""
    if not objective.args.gradient_checkpointing:
        return per_token_logprobs(objective, objective.model, inputs)
    from trl.models.utils import disable_gradient_checkpointing

    with disable_gradient_checkpointing(objective.model, objective.args.gradient_checkpointing_kwargs):
        return per_token_logprobs(objective, objective.model, inputs)


@torch.no_grad()
def reference_logprobs(objective: Any, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """Per-token log-probs under TRL's KL reference: its frozen copy, or (LoRA) the base with adapters off."""
    if objective.ref_model is not None:
        return per_token_logprobs(objective, objective.ref_model, inputs)
    from trl.trainer.utils import use_adapter

    model = objective.accelerator.unwrap_model(objective.model)
    with use_adapter(model, adapter_name="ref" if "ref" in model.peft_config else None):
        return per_token_logprobs(objective, objective.model, inputs)


def importance_sampling_ratio(
    objective: Any, old: torch.Tensor, sampling: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, dict[str, float]]:
    """TRL's vLLM importance-sampling correction (its formula in `_generate_and_score_completions`).

    old: the actor's log-probs of the sampled tokens; sampling: the rollout engine's. Returns the
    ratio ((B, T) for token modes, (B, 1) for sequence modes) and TRL's sampling/* metrics.
    """
    mode = objective.vllm_importance_sampling_mode
    low, high = objective.vllm_importance_sampling_clip_min, objective.vllm_importance_sampling_clip_max
    diff = torch.nan_to_num((old - sampling) * mask, nan=0.0)
    sequence_level = mode in ("sequence_mask", "sequence_truncate")
    ratio = torch.exp(diff.sum(dim=-1, keepdim=True) if sequence_level else diff)
    if mode.endswith("_truncate"):
        ratio = torch.clamp(ratio, min=low, max=high)
    else:
        low = -math.inf if low is None else low
        high = math.inf if high is None else high
        ratio = ratio.masked_fill((ratio < low) | (ratio > high), 0.0)
    delta = torch.abs(old - sampling)[mask.bool()]
    delta = delta[~torch.isnan(delta)]
    flat = ratio.flatten() if sequence_level else ratio[mask.bool()]
    metrics = {
        "sampling/sampling_logp_difference/mean": float(delta.mean()) if delta.numel() else 0.0,
        "sampling/sampling_logp_difference/max": float(delta.max()) if delta.numel() else 0.0,
        "sampling/importance_sampling_ratio/min": float(flat.min()) if flat.numel() else 0.0,
        "sampling/importance_sampling_ratio/mean": float(flat.mean()) if flat.numel() else 0.0,
        "sampling/importance_sampling_ratio/max": float(flat.max()) if flat.numel() else 0.0,
    }
    return ratio, metrics


def loss_mask(inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """The tokens in the loss: TRL's `completion_mask * tool_mask` (multi-turn), else the completion mask."""
    mask = inputs["completion_mask"]
    return mask if "tool_mask" not in inputs else mask * inputs["tool_mask"]


def accumulation_normalizer(loss_type: str, part: dict[str, torch.Tensor], rows: int, tokens: torch.Tensor) -> float:
    """The `current_gradient_accumulation_steps` that makes a micro-batch's loss its exact share of the whole
    batch's (`rows` sequences, `tokens` in the loss: on N ranks, all ranks' together), for micro-batches of
    unequal size (TRL assumes equal ones): per-sequence means scale by the sequence count, bnpo by the token
    count; dapo/cispo/vespo already divide by `num_items_in_batch`."""
    if loss_type in ("cispo", "dapo", "vespo"):
        return 1.0
    if loss_type == "bnpo":
        return float(tokens.clamp(min=1.0)) / float(loss_mask(part).sum().clamp(min=1.0))
    return rows / part["completion_ids"].size(0)


def compute_loss(
    objective: Any, model: Any, inputs: dict[str, torch.Tensor], accumulation: float = 1.0
) -> tuple[torch.Tensor, dict[str, float]]:
    """TRL's GRPO loss on one (micro-)batch, and the metrics TRL logged while computing it (means)."""
    if objective.beta != 0.0 and "ref_per_token_logps" not in inputs:
        inputs = {**inputs, "ref_per_token_logps": reference_logprobs(objective, inputs)}
    # TRL multiplies in the correction only on its vLLM path; we apply it whenever the ratio is given.
    objective.use_vllm = "importance_sampling_ratio" in inputs
    objective.current_gradient_accumulation_steps = accumulation
    mode = "train" if objective.model.training else "eval"  # where TRL files the metrics it logs
    objective._metrics[mode].clear()
    loss = objective.compute_loss(model, inputs)
    metrics = {name: sum(values) / len(values) for name, values in objective._metrics[mode].items() if values}
    objective._metrics[mode].clear()
    return loss, metrics
