"""The actor: the policy being trained, its optimizer and TRL's GRPO objective.

A plain class (no Prefect): `load()`, `step(expected_version, rollouts)`,
`policy_state_dict()`, `save_checkpoint(folder)`, `restore(folder)`. `policy_version`
counts the optimizer steps applied (after step N it is N); every call says which version it
expects, so a caller notices an actor that was replaced or restarted.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from schemas.config import GRPOFlowConfig
from workers import trl_objective


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


def loss_inputs(rollouts: pa.Table, pad_token_id: int) -> dict[str, torch.Tensor]:
    """The tensors TRL's objective takes, from logged rollout rows (prompts left padded, completions right)."""
    prompts = rollouts.column("prompt_token_ids").to_pylist()
    completions = rollouts.column("completion_token_ids").to_pylist()
    prompt_ids = pad(prompts, pad_token_id, "left")
    completion_ids = pad(completions, pad_token_id, "right")
    completion_mask = pad([[1] * len(c) for c in completions], 0, "right")
    return {
        "prompt_ids": prompt_ids,
        "prompt_mask": pad([[1] * len(p) for p in prompts], 0, "left"),
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "advantages": torch.tensor(rollouts.column("advantage").to_pylist(), dtype=torch.float32),
        "num_items_in_batch": completion_mask.sum().float(),
    }


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

    @property
    def loaded(self) -> bool:
        return self.model is not None

    def load(self) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.manual_seed(self.config.seed)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=torch.float32).to(self.device)
        self.objective = trl_objective.make_objective(self.model, self.tokenizer, self.config)
        # max_steps may be -1 (epochs); the scheduler only needs an upper bound for linear/cosine decay.
        self.total_steps = self.config.max_steps if self.config.max_steps > 0 else 10**6
        self.objective.create_optimizer_and_scheduler(num_training_steps=self.total_steps)

    def step(self, expected_version: int, rollouts: pa.Table) -> dict[str, float]:
        """One optimizer step of TRL's GRPO objective on a step's logged rollouts."""
        if self._last_step and self._last_step[0] == expected_version + 1 == self.policy_version:
            # A retry of a step that did finish (the failure came after it): the same answer, no second update.
            return self._last_step[1]
        if expected_version != self.policy_version:
            raise StaleActorError(f"actor holds policy version {self.policy_version}, caller expects {expected_version}")
        started = time.perf_counter()
        inputs = {k: v.to(self.device) for k, v in loss_inputs(rollouts, self.tokenizer.pad_token_id).items()}
        optimizer, scheduler = self.objective.optimizer, self.objective.lr_scheduler
        self.model.train()
        loss, metrics = trl_objective.compute_loss(self.objective, self.model, inputs)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.max_grad_norm)
        learning_rate = scheduler.get_last_lr()[0]
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        self.model.eval()
        self.policy_version += 1
        tokens = int(inputs["completion_mask"].sum()) + int(inputs["prompt_mask"].sum())
        seconds = time.perf_counter() - started
        result = {
            "loss": float(loss.detach()),
            "grad_norm": float(grad_norm),
            "learning_rate": float(learning_rate),
            "actor/tokens_per_second": tokens / seconds,
            **metrics,
        }
        self._last_step = (self.policy_version, result)
        return result

    def policy_state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    def save_checkpoint(self, folder: Path) -> dict[str, Any]:
        """Weights, tokenizer, optimizer, scheduler and RNG states into `folder` (the caller commits it)."""
        self.model.save_pretrained(folder / "model")
        self.tokenizer.save_pretrained(folder / "model")
        torch.save(self.objective.optimizer.state_dict(), folder / "optimizer.pt")
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
        from transformers import AutoModelForCausalLM

        if not self.loaded:
            self.load()
        saved = AutoModelForCausalLM.from_pretrained(folder / "model", dtype=torch.float32)
        self.model.load_state_dict(saved.state_dict())
        self.objective.optimizer.load_state_dict(torch.load(folder / "optimizer.pt", weights_only=True))
        self.objective.lr_scheduler.load_state_dict(torch.load(folder / "scheduler.pt", weights_only=True))
        rng = torch.load(folder / "rng.pt", weights_only=False)
        torch.set_rng_state(rng["torch"])
        np.random.set_state(rng["numpy"])
        random.setstate(rng["python"])
        self.policy_version = json.loads((folder / "actor_state.json").read_text())["policy_version"]
        self._last_step = None
        self.model.eval()

    def reset(self) -> None:
        """Back to the initial model (a run that has no checkpoint yet)."""
        self.load()
        self.policy_version = 0
        self._last_step = None
