"""A rollout engine in its own process, for one-step-off pipelining on the local backend.

`ProcessRolloutEngine` has `TransformersRolloutEngine`'s surface (`load`, `generate`,
`load_state_dict`, `policy_version`, `tokenizer`, `worker_id`, `model`) and forwards each call
to a `TransformersRolloutEngine` in a child process started with `spawn`, limited to
`threads` torch threads. Generating for step t+1 there overlaps the actor's step t in the
parent on another core; threads in one process would contend for the GIL between torch ops.

Weights travel through `torch.multiprocessing`, which moves CPU tensors through shared memory
rather than pickling their bytes. The child exits when the parent's end of its pipe closes,
so a killed parent leaves no engine behind.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp

from grpo_flow.workers.rollout import channel
from grpo_flow.workers.rollout.channel import EngineProcessError

__all__ = ["EngineProcessError", "ProcessRolloutEngine"]


def _serve(conn: Any, model_path: str, worker_id: str, threads: int, device: str = "cpu") -> None:
    import torch

    from grpo_flow.workers.rollout.transformers_engine import TransformersRolloutEngine

    torch.set_num_threads(threads)
    channel.serve(conn, TransformersRolloutEngine(model_path, worker_id=worker_id, device=device))


class ProcessRolloutEngine:
    def __init__(self, model_path: str | Path, worker_id: str = "rollout-0", threads: int = 1, device: str = "cpu"):
        self.model_path = str(model_path)
        self.worker_id = worker_id
        self.threads = threads
        self.device = device  # the actor's (the local backend's `device`): its weights arrive on it
        self.policy_version = 0
        self.tokenizer: Any = None
        self._loaded = False
        self._lock = threading.Lock()  # one call in flight per process
        self._process: Any = None
        self._conn: Any = None

    @property
    def model(self) -> Any:
        """Truthy once loaded (callers check `engine.model is not None`, as for the in-process engine)."""
        return True if self._loaded else None

    def _start(self) -> None:
        context = mp.get_context("spawn")
        self._conn, child = context.Pipe()
        self._process = context.Process(
            target=_serve,
            args=(child, self.model_path, self.worker_id, self.threads, self.device),
            daemon=True,
            name=f"grpo-flow-{self.worker_id}",
        )
        self._process.start()
        child.close()

    def _call(self, method: str, *args: Any) -> Any:
        with self._lock:
            if self._process is None or not self._process.is_alive():
                self._start()
            try:
                return channel.call(self._conn, self.worker_id, method, *args)
            except channel.EngineCallError:
                raise
            except EngineProcessError:
                self._process = None
                raise

    def load(self) -> None:
        from grpo_flow.workers.rollout.base import load_generation_tokenizer

        self._call("load")
        self.tokenizer = load_generation_tokenizer(self.model_path)
        self.policy_version = 0
        self._loaded = True

    def load_state_dict(self, state_dict: dict[str, Any], version: int, adapter_config: Any = None) -> None:
        self._call("load_state_dict", state_dict, version, adapter_config)
        self.policy_version = version

    def recreate(self, model_path: str | Path, version: int) -> None:
        self._call("recreate", str(model_path), version)
        self.policy_version = version

    def generate(self, prompts: list[Any], params: Any, max_prompt_length: int | None = None) -> Any:
        return self._call("generate", prompts, params, max_prompt_length)

    def kill(self) -> None:
        """End the engine process at once, even mid-call (nothing it holds is the truth: a run's state is on disk)."""
        process = self._process
        if process is not None and process.is_alive():
            process.kill()

    def close(self) -> None:
        if self._process is not None and self._process.is_alive():
            try:
                self._call(channel.CLOSE)
            except EngineProcessError:
                pass
            self._process.join(timeout=10)
        self._process = None
        self._loaded = False
