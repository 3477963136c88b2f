"""The one typed config of a grpo-flow run.

It is the `grpo` flow's parameter, so Prefect validates deployment parameters against it
and draws its form from it. Option names are TRL's `GRPOConfig` names wherever TRL has the
option; the help texts say where we differ. Cross-field rules live in validators whose
messages quote the bad values, so a bad run fails here, before any model loads.
"""

from __future__ import annotations

import hashlib
import json
import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

# Every loss TRL 1.16's GRPOTrainer implements; the actor delegates the objective to TRL.
LossType = Literal["grpo", "dapo", "dr_grpo", "bnpo", "cispo", "sapo", "luspo", "vespo"]
ScaleRewards = Literal["group", "batch", "none"]
ImportanceSamplingMode = Literal["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]
Backend = Literal["local", "modal", "ray"]
WeightSyncMethod = Literal["reload", "volume", "direct", "checkpoint", "lora"]
# GPU types Modal accepts in `gpu=` (https://modal.com/docs/guide/gpu); a count is given separately.
MODAL_GPU_TYPES = ("T4", "L4", "A10G", "A10", "L40S", "A100", "A100-40GB", "A100-80GB", "H100", "H100!", "H200", "B200")

LORA_OPTIONS = ("lora_r", "lora_alpha", "lora_dropout", "lora_target_modules", "lora_publish")
TASK_NAMES = ("last_digit", "gsm8k", "math", "math500", "mbpp")  # workers/data/loaders.py builds each
RUN_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"

# Fields that do not change what a run computes; everything else is part of the config hash.
NON_TRAINING_FIELDS = frozenset(
    {
        "run_id",
        "storage_root",
        "max_steps",
        "save_steps",
        "report_to",
        "wandb_project",
        "backend",
        "actor_gpu",
        "actor_gpu_count",
        "rollout_gpu",
        "weight_sync_method",
        "gpu_memory_utilization",
        "modal_volume",
        "modal_secrets",
        "detach",
        "ray_address",
        "actor_gpus",
        "rollout_gpus",
        "actor_cpus",
        "rollout_cpus",
        "save_total_limit",
        "keep_checkpoint_every",
        "generate_retries",
        "score_retries",
        "actor_retries",
        "retry_delay_seconds",
        "eval_prompts",
        "reward_concurrency",
        "gradient_checkpointing",
        "max_tokens_per_microbatch",
        "step_subflows",
    }
)


class GRPOFlowConfig(BaseModel):
    """Everything a run needs, validated once at the edge (CLI, Python API, Prefect parameters)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    # Where the run lives
    run_id: str | None = Field(
        default=None,
        pattern=RUN_ID_PATTERN,
        description="Name of the run under `<storage_root>/runs/`. Generated from the data set and time if unset.",
    )
    storage_root: str = Field(
        default="grpo-storage",
        description="Folder (or, with the Modal backend, Volume path) holding runs, models and caches. With the Ray "
        "backend, a folder on a filesystem every node of the cluster mounts at the same path.",
    )
    backend: Backend = Field(
        default="local",
        description="Where the GPU workers run: `local` (this process), `modal` (Modal GPUs) or `ray` (Ray actors "
        "on a Ray cluster: `ray_address`, else RAY_ADDRESS, else a local Ray instance).",
    )

    # Model and data
    model: str = Field(
        default="tiny",
        min_length=1,
        description="Hugging Face model id or local path; `tiny` is the project's own offline model.",
    )
    dataset: str = Field(
        default="last_digit",
        description="Task: `last_digit` (synthetic, offline), or from the Hugging Face hub `gsm8k` (openai/gsm8k), "
        "`math` (MATH), `math500` (MATH train, MATH-500 held out), `mbpp` (MBPP, code with tests); or "
        "`hf:<hub id or local path>`, any data set with a `prompt` column. (The Python API registers its "
        "Dataset objects as `registered:<fingerprint>`.)",
    )
    reward_funcs: list[str] = Field(
        default_factory=list,
        description="Reward functions by built-in name or `module:function` import path. "
        "Empty means the data set's default rewards.",
    )
    reward_weights: list[float] | None = Field(
        default=None,
        description="Weights for each reward function. If `None`, all rewards are weighted equally with weight "
        "`1.0` (TRL's rule).",
    )

    # Optimisation (TRL names)
    learning_rate: float = Field(default=1e-6, gt=0, description="The initial learning rate for AdamW.")
    lr_scheduler_type: Literal["constant", "linear", "cosine", "constant_with_warmup"] = Field(
        default="linear", description="Learning-rate schedule, as in transformers' TrainingArguments."
    )
    warmup_steps: int = Field(default=0, ge=0, description="Linear warmup over this many optimizer steps.")
    weight_decay: float = Field(default=0.0, ge=0, description="AdamW weight decay.")
    max_grad_norm: float = Field(default=1.0, gt=0, description="Maximum gradient norm (for gradient clipping).")
    gradient_checkpointing: bool = Field(
        default=False, description="Recompute activations in the backward pass: less memory, more compute."
    )
    max_tokens_per_microbatch: int | None = Field(
        default=None,
        ge=1,
        description="Gradient accumulation: split each optimizer step into micro-batches of at most this many "
        "padded prompt+completion tokens (at least one completion each). The update equals the whole batch's. "
        "None: one micro-batch.",
    )
    use_lora: bool = Field(default=False, description="Train LoRA adapters (peft) instead of every weight.")
    lora_r: int | None = Field(default=None, ge=1, description="LoRA rank (default 16 with use_lora).")
    lora_alpha: int | None = Field(default=None, ge=1, description="LoRA alpha (default 32 with use_lora).")
    lora_dropout: float | None = Field(default=None, ge=0, lt=1, description="LoRA dropout (default 0.0).")
    lora_target_modules: list[str] | None = Field(
        default=None, description="Modules that get adapters (default: every linear layer, peft's `all-linear`)."
    )
    lora_publish: Literal["merged", "adapter"] | None = Field(
        default=None,
        description="What rollout workers get with use_lora: `merged` weights (default) or the `adapter` alone.",
    )
    bf16: bool | None = Field(
        default=None,
        description="bf16 mixed precision (autocast) for the actor, TRL's option. None: on with a CUDA GPU, off on "
        "CPU, where bf16 is slower and makes the actor's log-probs drift from the rollout engine's fp32 ones. "
        "(TRL defaults to on everywhere.)",
    )
    max_steps: int = Field(
        default=-1,
        description="Number of training steps. If `-1`, derived from `num_train_epochs` and the data set size.",
    )
    num_train_epochs: float = Field(
        default=1.0, gt=0, description="Passes over the training prompts, used when `max_steps` is -1."
    )
    seed: int = Field(default=42, ge=0, description="Seed for sampling prompts, generation and initialisation.")

    # GRPO (TRL names)
    num_generations: int = Field(default=8, ge=2, description="Completions sampled per prompt (group size).")
    prompts_per_step: int = Field(
        default=8,
        ge=1,
        description="Prompts per training step; a step trains on prompts_per_step x num_generations "
        "completions. (TRL derives this from its batch sizes.)",
    )
    loss_type: LossType = Field(default="dapo", description="Loss formulation, as TRL's GRPOConfig.loss_type.")
    beta: float = Field(default=0.0, ge=0, description="KL coefficient; 0.0 loads no reference model.")
    epsilon: float = Field(default=0.2, gt=0, description="Epsilon value for clipping.")
    epsilon_high: float | None = Field(
        default=None, gt=0, description="Upper-bound epsilon for clipping; defaults to `epsilon`."
    )
    scale_rewards: ScaleRewards = Field(
        default="group", description="Reward scaling for advantages: `group`, `batch` or `none` (as TRL)."
    )
    multi_objective_aggregation: Literal["sum_then_normalize", "normalize_then_sum"] = Field(
        default="sum_then_normalize",
        description="How several reward functions combine into one advantage, as TRL: weighted sum then group "
        "normalisation, or each function normalised within its group, then the weighted sum normalised over the batch.",
    )
    delta: float | None = Field(
        default=None, gt=1, description="Upper clip of the importance ratio for two-sided clipping (TRL's delta)."
    )
    sapo_temperature_neg: float = Field(
        default=1.05, gt=0, description="SAPO's temperature for tokens with non-positive advantage (loss_type sapo)."
    )
    sapo_temperature_pos: float = Field(
        default=1.0, gt=0, description="SAPO's temperature for tokens with positive advantage (loss_type sapo)."
    )
    vespo_k_pos: float = Field(
        default=2.0, description="VESPO's power exponent for positive advantages (loss_type vespo), as TRL."
    )
    vespo_lambda_pos: float = Field(
        default=3.0, description="VESPO's decay factor for positive advantages (loss_type vespo), as TRL."
    )
    vespo_k_neg: float = Field(
        default=3.0, description="VESPO's power exponent for negative advantages (loss_type vespo), as TRL."
    )
    vespo_lambda_neg: float = Field(
        default=2.0, description="VESPO's decay factor for negative advantages (loss_type vespo), as TRL."
    )
    off_policy_mask_threshold: float | None = Field(
        default=None,
        gt=0,
        description="Off-policy sequence masking (DeepSeek-V3.2, TRL's option): sequences with negative advantage "
        "whose KL from the sampling policy exceeds this are left out of the loss. None: off.",
    )
    use_bias_correction_kl: bool = Field(
        default=True,
        description="Multiply the KL term by the importance ratio (the unbiased reverse-KL gradient), as TRL; "
        "acts when beta > 0.",
    )
    importance_sampling_level: Literal["token", "sequence"] = Field(
        default="token", description="Importance ratio per token, or one per sequence (GSPO), as TRL."
    )
    num_iterations: int = Field(
        default=1, ge=1, description="Optimizer steps on each generated batch (GRPO's mu), against its old log-probs."
    )
    mask_truncated_completions: bool = Field(
        default=False, description="Leave completions cut off at max_completion_length out of the loss (TRL's option)."
    )
    top_entropy_quantile: float = Field(
        default=1.0, gt=0, le=1, description="Train only on the tokens in this top entropy quantile (1.0: all tokens)."
    )
    vllm_importance_sampling_correction: bool = Field(
        default=True,
        description="Correct for the rollout engine's sampling log-probs differing from the actor's (a separate "
        "engine such as vLLM, or stale weights), with TRL's truncated/masked importance sampling. Applied whenever "
        "the two can differ; the local transformers engine at the actor's own version is exact, so it is skipped "
        "there.",
    )
    vllm_importance_sampling_mode: ImportanceSamplingMode = Field(
        default="sequence_mask",
        description="TRL's IS correction mode: ratios per token or sequence, truncated or masked.",
    )
    vllm_importance_sampling_clip_min: float | None = Field(
        default=None, ge=0, description="Lower bound of the IS correction ratio (None: no lower bound)."
    )
    vllm_importance_sampling_clip_max: float | None = Field(
        default=3.0, gt=0, description="Upper bound of the IS correction ratio."
    )

    # Generation (TRL names)
    max_prompt_length: int | None = Field(
        default=512, ge=1, description="Prompts longer than this many tokens are truncated from the left."
    )
    max_completion_length: int = Field(default=256, ge=1, description="Maximum length of the generated completion.")
    temperature: float = Field(default=1.0, gt=0, description="Temperature for sampling.")
    top_p: float = Field(default=1.0, gt=0, le=1, description="Nucleus sampling probability mass, in (0, 1].")

    # Workers and schedule
    num_rollout_workers: int = Field(
        default=1, ge=1, description="Rollout workers; each step's groups are split evenly across them."
    )
    step_subflows: bool = Field(
        default=True,
        description="Run each step as its own Prefect subflow (`<run>-step-N`). Off: the step's tasks run in the "
        "run's own flow run, which saves Prefect's per-subflow cost (about 0.2-0.4 s a step on a SQLite-backed "
        "server, and its occasional 2 s lock retries) for runs whose steps are short; the UI then lists every "
        "step's tasks under the run. Training is the same either way.",
    )
    dynamic_sampling: bool = Field(
        default=False,
        description="Drop groups whose rewards all tie (zero advantage, no learning signal) and refill the step "
        "from further prompts, as DAPO's dynamic sampling.",
    )
    dynamic_sampling_max_rounds: int = Field(
        default=2, ge=1, description="Extra generation rounds dynamic sampling may spend refilling a step."
    )
    reward_concurrency: int = Field(
        default=4, ge=1, description="Most rollout shards scored at once (the reward map's concurrency bound)."
    )
    max_staleness: int = Field(
        default=0,
        ge=0,
        le=1,
        description="0: on-policy. 1: one-step-off pipelining, generation of step t+1 (with the weights before "
        "step t) overlaps the actor's step t; its rows get the IS correction. Local rollout workers then run in "
        "their own processes.",
    )
    sync_weights_every: int = Field(
        default=1, ge=1, description="Publish the actor's weights to the rollout workers every N steps."
    )
    save_steps: int = Field(default=50, ge=1, description="Write a checkpoint every N steps (and at the last step).")
    save_total_limit: int | None = Field(
        default=None, ge=1, description="Keep only the newest N checkpoints (TRL's name); None keeps all."
    )
    keep_checkpoint_every: int | None = Field(
        default=None,
        ge=1,
        description="With save_total_limit, also keep every checkpoint whose step is a multiple of M.",
    )

    # Retries of transient failures (per task run; a failure that persists fails the step)
    generate_retries: int = Field(default=2, ge=0, description="Retries of a rollout shard's generation.")
    score_retries: int = Field(default=2, ge=0, description="Retries of a rollout shard's reward scoring.")
    actor_retries: int = Field(
        default=1, ge=0, description="Retries of the actor step (safe: the actor checks the policy version it holds)."
    )
    retry_delay_seconds: float = Field(default=1.0, ge=0, description="Delay between retries.")

    # Modal backend (the seeds' option names); ignored by the local backend
    actor_gpu: str = Field(
        default="A100", description=f"Modal GPU type of the actor: one of {', '.join(MODAL_GPU_TYPES)}."
    )
    actor_gpu_count: int = Field(default=1, ge=1, le=8, description="GPUs for the actor container.")
    rollout_gpu: str = Field(default="A10G", description="Modal GPU type of each vLLM rollout worker.")
    weight_sync_method: WeightSyncMethod = Field(
        default="reload",
        description="How rollout workers get new weights: `reload` (vLLM sleep/wake_up/reload_weights), `volume` "
        "(safetensors on the volume, engine reload), `direct` (in memory through Modal calls), `checkpoint` (full "
        "save, engine re-created), `lora` (adapter only).",
    )
    max_model_len: int | None = Field(default=None, ge=16, description="vLLM max_model_len; None: prompt + completion.")
    gpu_memory_utilization: float = Field(default=0.9, gt=0, le=1, description="vLLM gpu_memory_utilization.")
    modal_volume: str = Field(default="grpo-flow", min_length=1, description="Modal Volume holding the storage root.")
    modal_secrets: list[str] = Field(
        default_factory=list, description="Modal Secrets by name, e.g. `huggingface-secret`, `wandb-secret`."
    )
    detach: bool = Field(default=False, description="Keep the Modal app running if the local client disconnects.")

    # Ray backend; ignored by the others
    ray_address: str | None = Field(
        default=None,
        min_length=1,
        description="Ray cluster to run on, as `ray start --head` prints it (`HOST:PORT`, or `auto`). None: the "
        "RAY_ADDRESS environment variable, else a local Ray instance started for the run.",
    )
    actor_gpus: float | None = Field(
        default=None,
        ge=0,
        description="GPUs of the actor's Ray actor (fractions share a GPU). None: 1 on a cluster with GPUs, else 0.",
    )
    rollout_gpus: float | None = Field(
        default=None,
        ge=0,
        description="GPUs of each rollout engine's Ray actor. None: 1 on a cluster with GPUs, else 0.",
    )
    actor_cpus: float = Field(default=1.0, gt=0, description="CPUs of the actor's Ray actor (fractions allowed).")
    rollout_cpus: float = Field(
        default=1.0, gt=0, description="CPUs of each rollout engine's Ray actor (fractions allowed)."
    )

    # Evaluation and logging
    eval_prompts: int = Field(
        default=200, ge=0, description="Held-out prompts scored greedily at the start and end of a run (0 = skip)."
    )
    report_to: Literal["none", "wandb"] = Field(default="none", description="Where metrics go besides Parquet.")
    wandb_project: str = Field(default="grpo-flow", description="wandb project when `report_to='wandb'`.")

    @field_validator("dataset")
    @classmethod
    def _check_dataset(cls, value: str) -> str:
        if value in TASK_NAMES or (value.startswith(("hf:", "registered:")) and len(value.split(":", 1)[1]) > 0):
            return value
        raise ValueError(f"unknown task {value!r}; known: {', '.join(TASK_NAMES)}, or hf:<hub id or path>")

    @model_validator(mode="after")
    def _check_cross_field_rules(self) -> GRPOFlowConfig:
        if self.prompts_per_step % self.num_rollout_workers:
            raise ValueError(
                f"prompts_per_step ({self.prompts_per_step}) must split into whole groups across "
                f"num_rollout_workers ({self.num_rollout_workers})"
            )
        if self.epsilon_high is not None and self.epsilon_high < self.epsilon:
            raise ValueError(f"epsilon_high ({self.epsilon_high}) must be >= epsilon ({self.epsilon})")
        if self.max_steps == 0 or self.max_steps < -1:
            raise ValueError(f"max_steps ({self.max_steps}) must be a positive number of steps, or -1")
        if self.reward_weights is not None and self.reward_funcs and len(self.reward_weights) != len(self.reward_funcs):
            raise ValueError(
                f"reward_weights has {len(self.reward_weights)} values but reward_funcs has "
                f"{len(self.reward_funcs)} functions"
            )
        if self.loss_type == "luspo" and self.importance_sampling_level != "sequence":
            raise ValueError("loss_type 'luspo' needs importance_sampling_level 'sequence' (TRL's rule)")
        if self.loss_type == "vespo" and self.importance_sampling_level != "token":
            raise ValueError("loss_type 'vespo' needs importance_sampling_level 'token' (TRL's rule)")
        if (
            self.vllm_importance_sampling_clip_min is not None
            and self.vllm_importance_sampling_clip_max is not None
            and self.vllm_importance_sampling_clip_min > self.vllm_importance_sampling_clip_max
        ):
            raise ValueError(
                f"vllm_importance_sampling_clip_min ({self.vllm_importance_sampling_clip_min}) must be <= "
                f"vllm_importance_sampling_clip_max ({self.vllm_importance_sampling_clip_max})"
            )
        lora_options = [name for name in LORA_OPTIONS if getattr(self, name) is not None]
        if lora_options and not self.use_lora:
            raise ValueError(f"{', '.join(lora_options)}: LoRA options given without use_lora")
        for name in ("actor_gpu", "rollout_gpu"):
            if getattr(self, name) not in MODAL_GPU_TYPES:
                raise ValueError(
                    f"{name}: unknown Modal GPU type {getattr(self, name)!r}; known: {', '.join(MODAL_GPU_TYPES)}"
                )
        return self

    @property
    def completions_per_step(self) -> int:
        return self.prompts_per_step * self.num_generations

    def total_steps(self, num_train_prompts: int) -> int:
        """max_steps, or the steps that `num_train_epochs` passes over the prompts take (TRL's rule)."""
        if self.max_steps > 0:
            return self.max_steps
        return max(1, math.ceil(self.num_train_epochs * num_train_prompts / self.prompts_per_step))

    def training_hash(self) -> str:
        """Hash of the fields that change what a run computes (cache keys, resume checks)."""
        fields = self.model_dump(exclude=set(NON_TRAINING_FIELDS))
        return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]


def describe_validation_error(error: ValidationError) -> str:
    """One line per problem, each naming the field: `max_steps: Input should be a valid integer`."""
    lines = []
    for item in error.errors():
        field = ".".join(str(part) for part in item["loc"]) or "config"
        message = item["msg"].removeprefix("Value error, ")
        lines.append(f"{field}: {message}")
    return "\n".join(lines)
