"""Workers that return instantly, for measuring what is left of a step without them: Prefect
task runs, serialization and storage.

    with instant_workers():
        grpo(config)        # the real `grpo` flow, its `grpo-step` subflows and their tasks

`instant_workers()` swaps `grpo_flow.workers.backends.run_workers` and `grpo_flow.workers.backends.release` (which
every task calls through the module, so nothing else changes) for a backend with the same
surface as `grpo_flow.workers.backends.local.LocalWorkers`:

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
`RayWorkers` with `InstantActorWorker` / `InstantRolloutWorker` (workers/backends/ray_app.py's
wrappers around the instant classes), so every call crosses Ray as a real run's does, the weights
(`checkpoint_bytes` of them) included. What a step costs then, less the local instant step, is
what Ray adds.
"""

from __future__ import annotations

import contextlib
import json
import random
from pathlib import Path
from typing import Any, Iterator

from grpo_flow.schemas.config import GRPOFlowConfig
from grpo_flow.workers.backends.registry import RunWorkers
from grpo_flow.workers.backends.ray_app import ActorWorker, RolloutWorker
from grpo_flow.workers.rollout.base import GenerationResult, SamplingParams
from grpo_flow.workers.state.storage import RunStorage
from grpo_flow.workers.state.resume import replay_actor_to

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

    def step(self, expected_version: int, rollouts: Any) -> dict[str, float]:
        if self._last_step and self._last_step[0] == expected_version + 1 == self.policy_version:
            return self._last_step[1]
        if expected_version != self.policy_version:
            raise RuntimeError(f"actor holds policy version {self.policy_version}, caller expects {expected_version}")
        self.policy_version += 1
        metrics = {  # the real actor's keys (dapo, beta 0), so a metrics row is as wide
            "loss": 0.0,
            "grad_norm": 0.0,
            "learning_rate": self.config.learning_rate,
            "actor/tokens_per_second": 0.0,
            "actor/micro_batches": 1.0,
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


class InstantWorkers:
    """`grpo_flow.workers.backends.local.LocalWorkers`' surface, with nothing behind it."""

    def __init__(self, config: GRPOFlowConfig, checkpoint_bytes: int):
        self.config = config
        self.actor = InstantActor(config, checkpoint_bytes)
        self.rollout = [InstantRolloutEngine(f"rollout-{i}") for i in range(config.num_rollout_workers)]
        self.last_sync: dict[str, float] = {}
        self.rollout_version = 0

    def sync_weights(self) -> int:
        self.rollout_version = self.actor.policy_version
        for engine in self.rollout:
            engine.policy_version = self.rollout_version
        self.last_sync = {"bytes": float(self.actor.checkpoint_bytes)}
        return self.rollout_version

    def restore(self, storage: RunStorage, checkpoint_step: int | None) -> int:
        if checkpoint_step is None:
            self.actor.reset()
            version = 0
        else:
            manifest = storage.verify_checkpoint(checkpoint_step)
            self.actor.restore(storage.checkpoint_dir(checkpoint_step))
            version = manifest.get("rollout_policy_version", self.actor.policy_version)
        self.rollout_version = version
        for engine in self.rollout:
            engine.policy_version = version
        return version

    def save_rollout_weights(self, folder: Path) -> dict[str, int]:
        return {"rollout_policy_version": self.rollout_version}

    def ensure_actor_version(self, version: int, storage: RunStorage) -> None:
        if self.actor.policy_version != version:
            replay_actor_to(self.actor, version, storage)

    def ensure_rollout_version(self, index: int, version: int, storage: RunStorage) -> InstantRolloutEngine:
        engine = self.rollout[index]
        engine.policy_version = version
        return engine


CHECKPOINT_BYTES = 16384


class InstantActorWorker(ActorWorker):
    """workers/backends/ray_app.py's actor wrapper around an instant actor."""

    def __init__(self, config_json: str, model_path: str, device: str = "cpu") -> None:
        self.actor = InstantActor(GRPOFlowConfig.model_validate_json(config_json), CHECKPOINT_BYTES)  # type: ignore[assignment]


class InstantRolloutWorker(RolloutWorker):
    """workers/backends/ray_app.py's rollout wrapper around an instant engine."""

    def __init__(self, config_json: str, model_path: str, worker_index: int, device: str = "cpu") -> None:
        self.engine = InstantRolloutEngine(f"rollout-{worker_index}")

    def initial(self) -> int:
        self.engine.policy_version = 0
        return 0


_WORKERS: RunWorkers[Any] = RunWorkers()


@contextlib.contextmanager
def instant_workers(checkpoint_bytes: int = CHECKPOINT_BYTES, ray: bool = False) -> Iterator[RunWorkers[Any]]:
    """Inside the block, every run's workers are instant ones (whatever `config.backend` says); with
    `ray`, in Ray actors of the run's Ray cluster (`config.ray_address`, RAY_ADDRESS or a local instance)."""
    from grpo_flow.workers import backends

    if ray and checkpoint_bytes != CHECKPOINT_BYTES:
        raise ValueError(f"instant Ray workers publish {CHECKPOINT_BYTES} bytes of weights")

    def run_workers(config: GRPOFlowConfig, model_path: Any) -> Any:
        def build() -> Any:
            if ray:
                from grpo_flow.workers.backends.ray_backend import RayWorkers

                return RayWorkers(config, model_path, worker_classes=(InstantActorWorker, InstantRolloutWorker))
            return InstantWorkers(config, checkpoint_bytes)

        return _WORKERS.get(config.run_id, build)

    def release(config: GRPOFlowConfig, run_id: str) -> None:
        _WORKERS.release(run_id)

    saved = backends.run_workers, backends.release
    backends.run_workers, backends.release = run_workers, release
    try:
        yield _WORKERS
    finally:
        backends.run_workers, backends.release = saved
        # Workers a run left behind (the direct steps are not released by a flow's end): Ray ones hold
        # their placement group's CPUs until closed, and the next run on the cluster would wait for them.
        _WORKERS.release_all()


def instant_model_dir(folder: Path) -> str:
    """A model 'path' for instant runs: an empty folder (nothing loads it)."""
    folder.mkdir(parents=True, exist_ok=True)
    return str(folder)
