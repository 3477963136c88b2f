"""Workers that return instantly, for measuring what is left of a step without them: Prefect
task runs, serialization and storage.

    with instant_workers():
        grpo(config)        # the real `grpo` flow, its `grpo-step` subflows and their tasks

`instant_workers()` swaps `grpo_flow.workers.backends.placement` (which `start_workers` calls
through the module, so nothing else changes) for the local backend's placement with instant
workers in its servers:

- rollout engines answer `generate` at once with completions of the requested length, drawn
  from the seed (digits, so the `last_digit` reward spreads and advantages are not all zero),
  byte-level prompt token ids and made-up sampling log-probs: the same row count and roughly
  the same row width as the tiny preset's real engine produces;
- the actor's `step` counts the policy version up and returns a metrics dict shaped like the
  real actor's, without reading the tensors;
- a checkpoint is a constant, small set of files (`checkpoint_bytes` of weights, a state file),
  so the manifest, checksums, rename and pruning run as they do for a real checkpoint.

Reward functions are the real ones: scoring is part of the DAG (and `last_digit` is cheap).
No model is loaded: the config's `model` can be any folder, `instant_model_dir()` makes one.

`instant_workers(ray=True)` puts the same instant workers in Ray actors instead: the Ray backend's
placement running `InstantActorServer` / `InstantRolloutServer` (the servers around the instant
classes), so every call crosses Ray as a real run's does, the weights
(`checkpoint_bytes` of them) included. What a step costs then, less the local instant step, is
what Ray adds. The production classes are composed, not given hooks: the actor server builds its
actor by the name `Actor` in its module, which is swapped for the instant one while it is made.
"""

from __future__ import annotations

import contextlib
import json
import random
from pathlib import Path
from typing import Any, Iterator

from grpo_flow.schemas.config import GRPOFlowConfig
from grpo_flow.workers.actor.actor import StaleActorError
from grpo_flow.workers.backends import servers
from grpo_flow.workers.backends.local import InProcess, LocalPlacement
from grpo_flow.workers.backends.servers import ActorServer, RolloutServer
from grpo_flow.workers.backends.workers import Handle
from grpo_flow.workers.rollout.base import GenerationResult, SamplingParams

EOS_ID = 257  # the tiny tokenizer's <|im_end|>: 256 byte tokens, then pad, then eos
DIGIT_IDS = {str(d): 48 + d for d in range(10)}  # the tiny tokenizer is byte-level


class InstantTokenizer:
    """Only what the generate task may touch (it uses `prompt_texts` from `extra` instead)."""

    def batch_decode(self, rows: list[list[int]], **kwargs: Any) -> list[str]:
        return [bytes(i for i in row if i < 256).decode(errors="replace") for row in rows]


class InstantRolloutEngine:
    def __init__(self, worker_id: str):
        self.worker_id = worker_id
        self.policy_version = 0
        self.model: Any = object()  # "loaded"
        self.tokenizer = InstantTokenizer()

    def load(self) -> None:
        self.policy_version = 0

    def recreate(self, model_path: Any, version: int) -> None:
        self.policy_version = version

    def close(self) -> None:
        pass

    def load_state_dict(self, weights: Any, version: int, adapter_config: Any = None) -> None:
        self.policy_version = version

    def generate(
        self, prompts: list[Any], params: SamplingParams, max_prompt_length: int | None = None
    ) -> GenerationResult:
        rng = random.Random(params.seed)
        prompt_ids = [list(str(p).encode())[-(max_prompt_length or 10**9) :] for p in prompts]
        completion_ids, logprobs, texts, reasons = [], [], [], []
        for _ in prompts:
            for _ in range(params.n):
                digits = "".join(str(rng.randrange(10)) for _ in range(max(1, params.max_tokens - 1)))
                ids = [DIGIT_IDS[d] for d in digits][: params.max_tokens]
                stops = len(ids) < params.max_tokens
                if stops:
                    ids.append(EOS_ID)
                completion_ids.append(ids)
                logprobs.append([-2.3] * len(ids))
                texts.append(digits)
                reasons.append("stop" if stops else "length")
        return GenerationResult(
            prompt_token_ids=prompt_ids,
            completion_token_ids=completion_ids,
            sampling_logprobs=logprobs,
            finish_reasons=reasons,
            texts=texts,
            seconds=0.0,
            extra={"prompt_texts": [str(p) for p in prompts]},
        )


class InstantActor:
    def __init__(self, config: GRPOFlowConfig, checkpoint_bytes: int):
        self.config = config
        self.checkpoint_bytes = checkpoint_bytes
        self.policy_version = 0
        self.loaded = True
        self._last_step: tuple[int, dict[str, float]] | None = None

    def load(self) -> None:
        pass

    def step(self, expected_version: int, rollouts: Any) -> dict[str, float]:
        if self._last_step and self._last_step[0] == expected_version + 1 == self.policy_version:
            return self._last_step[1]
        if expected_version != self.policy_version:
            raise StaleActorError(
                f"actor holds policy version {self.policy_version}, caller expects {expected_version}"
            )
        self.policy_version += 1
        metrics = {  # the real actor's keys (dapo, beta 0), so a metrics row is as wide
            "loss": 0.0,
            "grad_norm": 0.0,
            "learning_rate": self.config.learning_rate,
            "actor/tokens_per_second": 0.0,
            "actor/micro_batches": 1.0,
            "actor/max_tokens_per_microbatch": 512.0,
            "entropy": 0.0,
            "clip_ratio/low_mean": 0.0,
            "clip_ratio/low_min": 0.0,
            "clip_ratio/high_mean": 0.0,
            "clip_ratio/high_max": 0.0,
            "clip_ratio/region_mean": 0.0,
        }
        self._last_step = (self.policy_version, metrics)
        return metrics

    def published_weights(self) -> dict[str, Any]:
        import torch

        return {"weight": torch.zeros(self.checkpoint_bytes // 4)}  # float32: checkpoint_bytes in all

    def save_checkpoint(self, folder: Path) -> dict[str, Any]:
        (folder / "model").mkdir(parents=True, exist_ok=True)
        (folder / "model" / "model.safetensors").write_bytes(bytes(self.checkpoint_bytes))
        state = {"policy_version": self.policy_version, "trl_version": "instant"}
        (folder / "actor_state.json").write_text(json.dumps(state))
        return state

    def restore(self, folder: Path) -> None:
        self.policy_version = json.loads((folder / "actor_state.json").read_text())["policy_version"]
        self._last_step = None

    def reset(self) -> None:
        self.policy_version = 0
        self._last_step = None


CHECKPOINT_BYTES = 16384


@contextlib.contextmanager
def instant_actor(checkpoint_bytes: int) -> Iterator[None]:
    """Inside the block, an `ActorServer` made builds an instant actor instead of loading the model."""
    saved = servers.Actor
    servers.Actor = lambda config, model_path, device="cpu": InstantActor(config, checkpoint_bytes)  # type: ignore
    try:
        yield
    finally:
        servers.Actor = saved


class InstantActorServer(ActorServer):
    """The actor server around an instant actor (what the Ray backend starts as the actor)."""

    def __init__(self, config_json: str, model_path: str, device: str = "cpu") -> None:
        with instant_actor(CHECKPOINT_BYTES):
            super().__init__(config_json, model_path, device)


class InstantRolloutServer(RolloutServer):
    """A rollout server around an instant engine."""

    def __init__(self, config_json: str, model_path: str, worker_index: int, device: str = "cpu") -> None:
        engine = InstantRolloutEngine(f"rollout-{worker_index}")
        super().__init__(config_json, model_path, worker_index, device, engine=engine)


class InstantPlacement(LocalPlacement):
    """The local backend with instant workers in this process."""

    def __init__(self, config: GRPOFlowConfig, model_path: Any, checkpoint_bytes: int) -> None:
        super().__init__(config, model_path)
        self.checkpoint_bytes = checkpoint_bytes

    def start(self) -> tuple[Handle, list[Handle]]:
        config_json = self.config.model_dump_json()
        with instant_actor(self.checkpoint_bytes):
            actor = ActorServer(config_json, self.model_path)
        self.servers = [
            RolloutServer(config_json, self.model_path, i, engine=InstantRolloutEngine(f"rollout-{i}"))
            for i in range(self.config.num_rollout_workers)
        ]
        return InProcess(actor, "actor"), [InProcess(s, f"rollout-{i}") for i, s in enumerate(self.servers)]


@contextlib.contextmanager
def instant_workers(checkpoint_bytes: int = CHECKPOINT_BYTES, ray: bool = False) -> Iterator[None]:
    """Inside the block, every run's workers are instant ones (whatever `config.backend` says); with
    `ray`, in Ray actors of the run's Ray cluster (`config.ray_address`, RAY_ADDRESS or a local instance)."""
    from grpo_flow.workers import backends

    if ray and checkpoint_bytes != CHECKPOINT_BYTES:
        raise ValueError(f"instant Ray workers publish {CHECKPOINT_BYTES} bytes of weights")

    def placement(config: GRPOFlowConfig, model_path: Any) -> Any:
        if ray:
            from grpo_flow.workers.backends.ray_backend import RayPlacement

            class InstantRayPlacement(RayPlacement):
                worker_classes = (InstantActorServer, InstantRolloutServer)

            return InstantRayPlacement(config, model_path)
        return InstantPlacement(config, model_path, checkpoint_bytes)

    saved = backends.placement
    backends.placement = placement
    try:
        yield
    finally:
        backends.placement = saved
        # Workers a run left behind (the direct steps are not released by a flow's end): Ray ones hold
        # their placement group's CPUs until closed, and the next run on the cluster would wait for them.
        backends.release_all()


def instant_model_dir(folder: Path) -> str:
    """A model 'path' for instant runs: the tiny byte-level tokenizer alone (the run's start reads it to check
    prompts; no weights, nothing loads a model)."""
    from grpo_flow.workers.data.tiny_model import build_tokenizer

    folder.mkdir(parents=True, exist_ok=True)
    build_tokenizer().save_pretrained(folder)
    return str(folder)
