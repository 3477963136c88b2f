"""The actor: the policy being trained, its optimizer and TRL's GRPO objective.

A plain class (no Prefect): `load()`, `step(expected_version, rollouts)`,
`policy_state_dict()`, `save_checkpoint(folder)`, `restore(folder)`. `policy_version`
counts the steps applied (after step N it is N; a step is num_iterations optimizer steps on
its batch); every call says which version it expects, so a caller notices an actor that was
replaced or restarted.

With use_lora only peft adapters train; `policy_state_dict()` is then the merged weights (what
a rollout engine runs) and `adapter_state_dict()` the adapter alone.
"""

from __future__ import annotations

import contextlib
import json
import random
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from grpo_flow.schemas.config import GRPOFlowConfig, truncated_sampling_message
from grpo_flow.workers.actor import memory, trl_objective
from grpo_flow.workers.state.resume import BASE_MODEL_FILE, base_model_reference, check_base_model

MODEL_DIR = "model"  # in a checkpoint: a full fine-tune's weights and tokenizer (a save_pretrained folder)
ADAPTER_DIR = "adapter"  # in a LoRA run's checkpoint: the peft adapter and the tokenizer
# In a checkpoint written by N ranks (workers/actor/sharded.py): the optimizer state as torch.distributed.checkpoint
# writes it, a file per rank (one process writes optimizer.pt instead).
OPTIMIZER_SHARDS_DIR = "optimizer"


def save_policy(
    model: Any,
    tokenizer: Any,
    folder: Path,
    model_name: str,
    model_path: str,
    lora: bool,
    state_dict: dict[str, torch.Tensor] | None = None,
) -> None:
    """A checkpoint's weights: a full fine-tune's in `model/`, a folder any loader opens; a LoRA run's adapter
    and tokenizer in `adapter/`, and in `base_model.json` the base model it adapts (name, folder,
    fingerprint), not a copy of it (`grpo export` merges the two). `state_dict`: the model's weights gathered
    from its shards (None: the model's own)."""
    if lora:
        model.save_pretrained(folder / ADAPTER_DIR, state_dict=state_dict)
        tokenizer.save_pretrained(folder / ADAPTER_DIR)
        (folder / BASE_MODEL_FILE).write_text(json.dumps(base_model_reference(model_name, model_path)))
    else:
        model.save_pretrained(folder / MODEL_DIR, state_dict=state_dict)
        tokenizer.save_pretrained(folder / MODEL_DIR)


# The parts of an actor step, each logged as `actor/<phase>_s` (0 where the step skipped it) beside
# `actor/step_s`, the whole of it: the batch's tensors from the logged rows, the old log-probs' forward pass
# (with the IS ratio), the reference model's pass (beta > 0), the loss's forward and backward over the
# micro-batches, and the optimizer (clipping, step, schedule, zeroing).
ACTOR_PHASES = ("prepare", "old_logprobs", "ref_logprobs", "forward_backward", "optimizer")


class PhaseClock:
    """Seconds per phase of one actor step, summed over its passes. On a GPU each reading waits for the
    kernels queued so far, so each phase is charged with its own work rather than the next's."""

    def __init__(self, device: str):
        self.device = device
        self.seconds = dict.fromkeys(ACTOR_PHASES, 0.0)

    def now(self) -> float:
        if self.device.startswith("cuda"):
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    @contextlib.contextmanager
    def phase(self, name: str) -> Any:
        started = self.now()
        try:
            yield
        finally:
            self.seconds[name] += self.now() - started

    def metrics(self) -> dict[str, float]:
        return {f"actor/{name}_s": seconds for name, seconds in self.seconds.items()}


class StaleActorError(RuntimeError):
    """The actor holds a different policy version than the caller expects."""


def pad(rows: list[list[int]], value: int, side: str) -> torch.Tensor:
    width = max(len(r) for r in rows)
    out = torch.full((len(rows), width), value, dtype=torch.long)
    for i, row in enumerate(rows):
        if side == "left":
            out[i, width - len(row) :] = torch.tensor(row, dtype=torch.long)
        else:
            out[i, : len(row)] = torch.tensor(row, dtype=torch.long)
    return out


def loss_inputs(rollouts: pa.Table, pad_token_id: int, mask_truncated: bool = False) -> dict[str, torch.Tensor]:
    """The tensors TRL's objective takes, from logged rollout rows (prompts left padded, completions right).

    `sampling_per_token_logps` (the rollout engine's log-probs) rides along for the IS correction.
    With `mask_truncated`, completions cut off at the length limit leave the loss, as TRL's option.
    Multi-turn rows (a logged `tool_mask`) give TRL's `tool_mask`: the loss, its token count and the IS
    correction cover the model's own tokens only, as in TRL; the tool messages between them are attended
    to, never trained on.
    """
    prompts = rollouts.column("prompt_token_ids").to_pylist()
    completions = rollouts.column("completion_token_ids").to_pylist()
    prompt_ids = pad(prompts, pad_token_id, "left")
    completion_ids = pad(completions, pad_token_id, "right")
    completion_mask = pad([[1] * len(c) for c in completions], 0, "right")
    if mask_truncated:
        truncated = torch.tensor([reason == "length" for reason in rollouts.column("finish_reason").to_pylist()])
        completion_mask = completion_mask * (~truncated).unsqueeze(1).long()
    tool_mask = None
    logged_masks = rollouts.column("tool_mask").to_pylist() if "tool_mask" in rollouts.column_names else []
    if any(mask is not None for mask in logged_masks):  # a single-turn row's null: every token is the model's
        rows = [mask if mask is not None else [1] * len(c) for mask, c in zip(logged_masks, completions, strict=True)]
        tool_mask = pad(rows, 1, "right")  # TRL pads it with 1; the completion mask zeroes the padding
    loss_mask = completion_mask if tool_mask is None else completion_mask * tool_mask
    inputs = {
        "prompt_ids": prompt_ids,
        "prompt_mask": pad([[1] * len(p) for p in prompts], 0, "left"),
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "advantages": torch.tensor(rollouts.column("advantage").to_pylist(), dtype=torch.float32),
        "num_items_in_batch": loss_mask.sum().float(),
    }
    if tool_mask is not None:
        inputs["tool_mask"] = tool_mask
    if "sampling_logprobs" in rollouts.column_names:
        sampled = rollouts.column("sampling_logprobs").to_pylist()
        width = completion_ids.size(1)
        inputs["sampling_per_token_logps"] = torch.tensor(
            [list(row) + [0.0] * (width - len(row)) for row in sampled], dtype=torch.float32
        ).reshape(len(sampled), width)
    return inputs


PER_ROW = (
    "prompt_ids",
    "prompt_mask",
    "completion_ids",
    "completion_mask",
    "advantages",
    "old_per_token_logps",
    "ref_per_token_logps",
    "importance_sampling_ratio",
    "sampling_per_token_logps",
    "tool_mask",
)


def micro_batches(inputs: dict[str, torch.Tensor], max_tokens: int | None) -> list[dict[str, torch.Tensor]]:
    """Rows split in order into micro-batches of at most `max_tokens` padded tokens (one row at least),
    each trimmed to its own padding; `num_items_in_batch` stays the whole batch's. A batch within the
    budget is one micro-batch: the batch itself, untrimmed."""
    rows = inputs["completion_ids"].size(0)
    if max_tokens is None or rows * (inputs["prompt_ids"].size(1) + inputs["completion_ids"].size(1)) <= max_tokens:
        return [inputs]
    prompt_lengths = inputs["prompt_mask"].sum(1).tolist()
    completion_lengths = completion_widths(inputs)
    bounds, start, widest_prompt, widest_completion = [], 0, 0, 0
    for row in range(rows):
        prompt_width = max(widest_prompt, int(prompt_lengths[row]))
        completion_width = max(widest_completion, completion_lengths[row])
        if row > start and (row - start + 1) * (prompt_width + completion_width) > max_tokens:
            bounds.append((start, row))
            start, prompt_width, completion_width = row, int(prompt_lengths[row]), completion_lengths[row]
        widest_prompt, widest_completion = prompt_width, completion_width
    bounds.append((start, rows))
    return cut_rows(inputs, bounds)


def even_micro_batches(inputs: dict[str, torch.Tensor], count: int) -> list[dict[str, torch.Tensor]]:
    """Rows split in order into `count` micro-batches of as equal row counts as can be (at most one row
    apart), each trimmed to its own padding."""
    rows = inputs["completion_ids"].size(0)
    edges = [rows * i // count for i in range(count + 1)]
    return cut_rows(inputs, list(zip(edges[:-1], edges[1:], strict=True)))


def completion_widths(inputs: dict[str, torch.Tensor]) -> list[int]:
    """Each row's completion up to its last token in the mask (1 for a row with none)."""
    return [int(m.nonzero().max()) + 1 if m.any() else 1 for m in inputs["completion_mask"]]


def cut_rows(inputs: dict[str, torch.Tensor], bounds: list[tuple[int, int]]) -> list[dict[str, torch.Tensor]]:
    """The micro-batches of rows [first, last) for each bound, each trimmed to its own padding."""
    rows = inputs["completion_ids"].size(0)
    completion_lengths = completion_widths(inputs)
    parts = []
    for first, last in bounds:
        part = {k: (v[first:last] if k in PER_ROW and v.size(0) == rows else v) for k, v in inputs.items()}
        keep_prompt = int(part["prompt_mask"].sum(1).max())
        keep_completion = max(1, max(completion_lengths[first:last]))
        for key in ("prompt_ids", "prompt_mask"):
            part[key] = part[key][:, part[key].size(1) - keep_prompt :]
        for key in (
            "completion_ids",
            "completion_mask",
            "old_per_token_logps",
            "ref_per_token_logps",
            "sampling_per_token_logps",
            "tool_mask",
        ):
            if key in part:
                part[key] = part[key][:, :keep_completion]
        ratio = part.get("importance_sampling_ratio")
        if ratio is not None and ratio.size(1) > 1:
            part["importance_sampling_ratio"] = ratio[:, :keep_completion]
        parts.append(part)
    return parts


def by_parts(
    compute: Callable[[dict[str, torch.Tensor]], torch.Tensor], parts: list[dict[str, torch.Tensor]], width: int
) -> torch.Tensor:
    """Per-token values (rows x completion tokens) computed one micro-batch at a time, each right-padded with
    zeros to the whole batch's `width`, in row order."""
    return torch.cat(
        [torch.nn.functional.pad(compute(part), (0, width - part["completion_ids"].size(1))) for part in parts]
    )


def sampling_matches_actor(config: GRPOFlowConfig, actor_bf16: bool) -> bool:
    """Whether the rollout engine's log-probs equal the actor's at the same weights, so the IS correction
    has nothing to correct: only the local backend's fp32 transformers engine (the actor's own code on
    the same device; the Ray backend's engines are that engine in other processes). vLLM (any dtype: other kernels), a Modal container's engine (another GPU) and a
    bf16 actor all differ. Decided from the run's config, so a worker that runs elsewhere (a Modal
    container) decides the same as the process that started the run."""
    return config.backend in ("local", "ray") and config.rollout_engine == "transformers" and not actor_bf16


class Actor:
    def __init__(self, config: GRPOFlowConfig, model_path: str | Path, device: str = "cpu"):
        self.config = config
        self.model_path = str(model_path)
        self.device = device
        self.policy_version = 0
        self.model: Any = None
        self.tokenizer: Any = None
        self.objective: Any = None
        self._last_step: tuple[int, dict[str, float]] | None = None  # (version it produced, its metrics)
        # Whether the rollout engine's log-probs equal this actor's at the same weights (see
        # sampling_matches_actor); otherwise the IS correction applies to every step. Set in load().
        self.sampling_matches_actor = False
        # Padded tokens per micro-batch in every pass over a step's rows: the config's, else sized from the
        # device's total memory. Set in load().
        self.max_tokens_per_microbatch = 0

    @property
    def loaded(self) -> bool:
        return self.model is not None

    @property
    def uses_lora(self) -> bool:
        return self.config.use_lora

    def load(self) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.manual_seed(self.config.seed)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        model: Any = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=torch.float32)
        model = model.to(self.device)
        self.objective = trl_objective.make_objective(model, self.tokenizer, self.config)
        self.model = self.objective.model  # the PeftModel with use_lora
        self.sampling_matches_actor = sampling_matches_actor(self.config, bool(self.objective.args.bf16))
        if (
            self.config.top_p < 1
            and self.config.vllm_importance_sampling_correction
            and not self.sampling_matches_actor
        ):
            raise ValueError(
                f"top_p/vllm_importance_sampling_correction: {truncated_sampling_message(self.config.top_p)}"
            )
        self.max_tokens_per_microbatch = self.config.max_tokens_per_microbatch or memory.default_microbatch_tokens(
            self.config, memory.model_info_from_config(model.config.to_dict()), memory.device_total_memory(self.device)
        )
        if self.config.gradient_checkpointing:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.create_optimizer()
        self.model.eval()

    def create_optimizer(self) -> None:
        """TRL's optimizer and scheduler over the model's parameters as they are now."""
        # The scheduler counts optimizer steps: num_iterations per step. max_steps may be -1 (epochs);
        # then it only needs an upper bound for linear/cosine decay.
        steps = self.config.max_steps if self.config.max_steps > 0 else 10**6
        self.objective.optimizer = self.objective.lr_scheduler = None
        self.objective.create_optimizer_and_scheduler(num_training_steps=steps * self.config.num_iterations)

    def _corrects_sampling(self, rollouts: pa.Table) -> bool:
        """The IS correction applies where the sampling log-probs can differ from the actor's: another
        engine's numerics, or rows sampled from older weights than the actor holds."""
        if not self.config.vllm_importance_sampling_correction:
            return False
        if not self.sampling_matches_actor:
            return True
        if "policy_version" not in rollouts.column_names:
            return False
        return any(v != self.policy_version for v in rollouts.column("policy_version").to_pylist())

    def completion_logprobs(
        self, prompt_token_ids: list[list[int]], completion_token_ids: list[list[int]]
    ) -> list[list[float]]:
        """This policy's per-token log-probs of a rollout engine's completions (TRL's code, at the config's
        temperature): what the engine's sampling log-probs are checked against. Completions come as
        engines return them, `n` consecutive ones per prompt."""
        n = len(completion_token_ids) // len(prompt_token_ids)
        table = pa.table(
            {
                "prompt_token_ids": [ids for ids in prompt_token_ids for _ in range(n)],
                "completion_token_ids": completion_token_ids,
                "advantage": [0.0] * len(completion_token_ids),
            }
        )
        inputs = loss_inputs(table, self.tokenizer.pad_token_id)
        parts = self._parts(inputs)
        with torch.no_grad():
            logps = by_parts(
                lambda part: trl_objective.per_token_logprobs(self.objective, self.model, part),
                parts,
                inputs["completion_ids"].size(1),
            )
        return [logps[i, : len(row)].tolist() for i, row in enumerate(completion_token_ids)]

    def step(self, expected_version: int, rollouts: pa.Table) -> dict[str, float]:
        """num_iterations optimizer steps of TRL's GRPO objective on a step's logged rollouts."""
        if self._last_step and self._last_step[0] == expected_version + 1 == self.policy_version:
            # A retry of a step that did finish (the failure came after it): the same answer, no second update.
            return self._last_step[1]
        if expected_version != self.policy_version:
            raise StaleActorError(
                f"actor holds policy version {self.policy_version}, caller expects {expected_version}"
            )
        clock = PhaseClock(self.device)
        started = clock.now()
        config, objective = self.config, self.objective
        with clock.phase("prepare"):
            inputs = loss_inputs(rollouts, self.tokenizer.pad_token_id, config.mask_truncated_completions)
            inputs = {k: v.to(self.device) for k, v in inputs.items()}
            rows, inputs["num_items_in_batch"] = self._batch_totals(inputs)
        sampling = inputs.pop("sampling_per_token_logps", None)
        self.model.train()
        extra: dict[str, float] = {}
        correct = sampling is not None and self._corrects_sampling(rollouts)
        budget, width = self.max_tokens_per_microbatch, inputs["completion_ids"].size(1)
        if config.num_iterations > 1 or correct:  # TRL computes the old log-probs in these cases only
            with clock.phase("old_logprobs"):
                parts = self._parts(inputs)
                inputs["old_per_token_logps"] = by_parts(
                    lambda part: trl_objective.old_logprobs(objective, part), parts, width
                )
        if correct and sampling is not None:
            with clock.phase("old_logprobs"):
                ratio, extra = trl_objective.importance_sampling_ratio(
                    objective, inputs["old_per_token_logps"], sampling, trl_objective.loss_mask(inputs)
                )
            inputs["importance_sampling_ratio"] = ratio
            inputs["sampling_per_token_logps"] = sampling
        if objective.beta != 0.0:
            with clock.phase("ref_logprobs"):
                parts = self._parts(inputs)
                inputs["ref_per_token_logps"] = by_parts(
                    lambda part: trl_objective.reference_logprobs(objective, part), parts, width
                )
        parts = self._parts(inputs)  # the same split, now carrying the log-probs above
        losses, grad_norms, learning_rates = [], [], []
        logged: dict[str, list[float]] = {}
        for _ in range(config.num_iterations):
            loss = torch.zeros((), device=self.device)
            with clock.phase("forward_backward"):
                for part in parts:
                    normalizer = trl_objective.accumulation_normalizer(
                        config.loss_type, part, rows, inputs["num_items_in_batch"]
                    )
                    part_loss, metrics = trl_objective.compute_loss(objective, self.model, part, normalizer)
                    part_loss.backward()
                    loss += part_loss.detach()
                    for name, value in metrics.items():
                        logged.setdefault(name, []).append(value)
            with clock.phase("optimizer"):
                grad_norms.append(self._clip_gradients())
                learning_rates.append(objective.lr_scheduler.get_last_lr()[0])
                objective.optimizer.step()
                objective.lr_scheduler.step()
                objective.optimizer.zero_grad(set_to_none=True)
            losses.append(float(loss))
        self.model.eval()
        self.policy_version += 1
        tokens = int(inputs["completion_mask"].sum()) + int(inputs["prompt_mask"].sum())
        seconds = clock.now() - started
        result = {
            "loss": sum(losses) / len(losses),
            "grad_norm": sum(grad_norms) / len(grad_norms),
            "learning_rate": float(learning_rates[0]),
            "actor/tokens_per_second": tokens * config.num_iterations / seconds,
            "actor/micro_batches": float(len(parts)),
            "actor/max_tokens_per_microbatch": float(budget),
            "actor/step_s": seconds,
            **clock.metrics(),
            **{name: sum(values) / len(values) for name, values in logged.items()},
            **extra,
        }
        self._last_step = (self.policy_version, result)
        return result

    # -- what a sharded actor (workers/actor/sharded.py) does otherwise --------------------------------
    def _parts(self, inputs: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
        """The micro-batches of every pass over a step's rows."""
        return micro_batches(inputs, self.max_tokens_per_microbatch)

    def _batch_totals(self, inputs: dict[str, torch.Tensor]) -> tuple[int, torch.Tensor]:
        """The step's rows and the tokens in its loss (TRL's num_items_in_batch), which the loss normalises by."""
        return inputs["completion_ids"].size(0), trl_objective.loss_mask(inputs).sum().float()

    def _clip_gradients(self) -> float:
        """Gradients clipped to max_grad_norm; their norm before clipping."""
        return float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.max_grad_norm))

    def _module_state(self, module: Any) -> dict[str, torch.Tensor]:
        """A copy of `module`'s state dict, full tensors."""
        return {k: v.detach().clone() for k, v in module.state_dict().items()}

    def _checkpoint_states(self) -> tuple[dict[str, torch.Tensor] | None, dict[str, Any] | None]:
        """The weights a checkpoint saves (None: the model's own) and the optimizer's state dict for optimizer.pt."""
        return None, self.objective.optimizer.state_dict()

    def _full_parameters(self) -> contextlib.AbstractContextManager[bool]:
        """Within it the parameters are whole tensors; it gives whether this process answers with them."""
        return contextlib.nullcontext(True)

    # -- what rollout workers get --------------------------------------------------------------
    def policy_state_dict(self) -> dict[str, torch.Tensor]:
        """The full weights a rollout engine runs (with use_lora: base + adapter deltas, by peft's own
        get_delta_weight; the actor's base weights are never merged in place, so they do not drift)."""
        if not self.uses_lora:
            return self._module_state(self.model)
        from peft.tuners.lora import LoraLayer

        base = self.model.get_base_model()
        weights = {
            name.replace(".base_layer.", "."): tensor
            for name, tensor in self._module_state(base).items()
            if "lora_" not in name
        }
        with torch.no_grad(), self._full_parameters() as answers:
            for name, module in base.named_modules() if answers else ():
                if isinstance(module, LoraLayer):
                    for adapter in module.active_adapters:
                        # peft's LoRA layers define get_delta_weight; the LoraLayer base class does not declare it.
                        delta = module.get_delta_weight(adapter)  # type: ignore[attr-defined]
                        weights[f"{name}.weight"] += delta.to(weights[f"{name}.weight"].dtype)
        return weights

    def adapter_state_dict(self) -> dict[str, torch.Tensor]:
        """The LoRA adapter alone (what a LoRA run sends unless `lora_publish='merged'`)."""
        from peft import get_peft_model_state_dict

        return {k: v.detach().clone() for k, v in get_peft_model_state_dict(self.model).items()}

    def published_weights(self) -> dict[str, torch.Tensor]:
        """What this run publishes to rollout workers: full (merged) weights, or the adapter alone."""
        if self.config.publishes_adapter:
            return self.adapter_state_dict()
        return self.policy_state_dict()

    # -- checkpoints -----------------------------------------------------------------------------
    def save_checkpoint(self, folder: Path) -> dict[str, Any]:
        """Weights (`save_policy`), optimizer, scheduler and RNG states into `folder` (the caller commits it)."""
        weights, optimizer = self._checkpoint_states()
        save_policy(self.model, self.tokenizer, folder, self.config.model, self.model_path, self.uses_lora, weights)
        if optimizer is not None:  # None: each rank wrote its shard (OPTIMIZER_SHARDS_DIR)
            torch.save(optimizer, folder / "optimizer.pt")
        torch.save(self.objective.lr_scheduler.state_dict(), folder / "scheduler.pt")
        rng = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
        torch.save(rng, folder / "rng.pt")
        state = {"policy_version": self.policy_version, "trl_version": trl_objective.TRL_VERSION}
        (folder / "actor_state.json").write_text(json.dumps(state))
        return state

    def restore(self, folder: Path) -> None:
        """Back to a checkpoint's state: weights, optimizer, scheduler, RNG states and policy version.

        Parameters are updated in place, so the optimizer keeps pointing at them.
        """
        if not self.loaded:
            self.load()
        if self.uses_lora:
            from peft import set_peft_model_state_dict
            from safetensors.torch import load_file

            if (folder / BASE_MODEL_FILE).exists():  # recorded by checkpoints that hold no copy of the base model
                check_base_model(json.loads((folder / BASE_MODEL_FILE).read_text()), self.model_path)
            set_peft_model_state_dict(self.model, load_file(folder / ADAPTER_DIR / "adapter_model.safetensors"))
        else:
            from transformers import AutoModelForCausalLM

            saved = AutoModelForCausalLM.from_pretrained(folder / MODEL_DIR, dtype=torch.float32)
            self.model.load_state_dict(saved.state_dict())
        optimizer, scheduler = self.objective.optimizer, self.objective.lr_scheduler
        # What the run's config sets (learning_rate, weight_decay, AdamW's betas and eps) is taken from the
        # config, not the checkpoint, so a change resumed with allow_config_change applies; the moments,
        # step counts and the schedule's position come from the checkpoint.
        configured = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
        self._load_optimizer(folder)
        scheduler.load_state_dict(torch.load(folder / "scheduler.pt", weights_only=True))
        for group, settings in zip(optimizer.param_groups, configured, strict=True):
            group.update(settings)
        if hasattr(scheduler, "lr_lambdas"):  # transformers' schedules: the rate at this position, as step() sets it
            # With max_steps raised on resume, a linear or cosine schedule goes on over the new length (the
            # saved rate was the end of the old one: 0 for linear).
            scheduler.base_lrs = [group["initial_lr"] for group in optimizer.param_groups]
            rates = [
                base * rate(scheduler.last_epoch)
                for rate, base in zip(scheduler.lr_lambdas, scheduler.base_lrs, strict=True)
            ]
            for group, lr in zip(optimizer.param_groups, rates, strict=True):
                group["lr"] = lr
            scheduler._last_lr = rates
        rng = torch.load(folder / "rng.pt", weights_only=False)
        torch.set_rng_state(rng["torch"])
        np.random.set_state(rng["numpy"])
        random.setstate(rng["python"])
        self.policy_version = json.loads((folder / "actor_state.json").read_text())["policy_version"]
        self._last_step = None
        self.model.eval()

    def _load_optimizer(self, folder: Path) -> None:
        """The optimizer's state from optimizer.pt, or whole from the shards N ranks wrote (any N: resharded)."""
        optimizer = self.objective.optimizer
        if not (folder / OPTIMIZER_SHARDS_DIR).is_dir():
            optimizer.load_state_dict(torch.load(folder / "optimizer.pt", weights_only=True))
            return
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

        state = {"optimizer": get_optimizer_state_dict(self.model, optimizer)}
        with warnings.catch_warnings():  # in one process, loading without a process group is the intent
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, checkpoint_id=folder / OPTIMIZER_SHARDS_DIR)
        set_optimizer_state_dict(self.model, optimizer, state["optimizer"])

    def reset(self) -> None:
        """Back to the initial model (a run that has no checkpoint yet)."""
        self.load()
        self.policy_version = 0
        self._last_step = None
