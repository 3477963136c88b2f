"""The embedded backend: the actor in this process; rollout engines here or in child processes.

Engines: transformers in this process (on-policy), or each in a child process of this interpreter
(one-step-off pipelining, so the next step's generation really overlaps the actor step); with
rollout_engine='vllm', each a vLLM engine in a process of the vLLM environment
(`vllm_env.local_engine`), taking the actor's weights by the run's weight_sync_method. The servers
(workers/backends/servers.py) are called directly; `Workers` does the rest.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from grpo_flow.schemas.config import GRPOFlowConfig
from grpo_flow.workers.actor.sharded import ActorGroup
from grpo_flow.workers.backends import vllm_env
from grpo_flow.workers.backends.servers import STATE_DICT, ActorServer, RolloutServer
from grpo_flow.workers.backends.workers import Handle, Placement
from grpo_flow.workers.rollout.process_engine import ProcessRolloutEngine
from grpo_flow.workers.rollout.transformers_engine import GENERATION_LOCK, TransformersRolloutEngine
from grpo_flow.workers.state.storage import RunStorage


class InProcess:
    """A server in this process: a verb is a method call."""

    def __init__(self, server: Any, name: str) -> None:
        self.server, self.name = server, name

    def call(self, verb: str, *args: Any) -> Any:
        return getattr(self.server, verb)(*args)


class LocalPlacement(Placement):
    """Every worker in this process (engines possibly in child processes it starts)."""

    def __init__(self, config: GRPOFlowConfig, model_path: str | Path, device: str = "cpu") -> None:
        super().__init__(config, model_path)
        self.device = device
        # Healing never runs beside an in-process generation: both use torch's global RNG.
        self.heal_lock = GENERATION_LOCK
        self.uses_vllm = config.rollout_engine == "vllm"
        self.servers: list[RolloutServer] = []
        self.actor: ActorServer | None = None

    def engine(self, index: int) -> Any:
        """Engine `index` as this backend places it; on CPU the cores are shared out between the engines
        (vLLM engines generate their shards at once) and, when pipelined, the actor."""
        config, worker_id = self.config, f"rollout-{index}"
        pipelined = 1 if config.max_staleness else 0
        threads = max(1, (os.cpu_count() or 2) // (config.num_rollout_workers + pipelined))
        if self.uses_vllm:
            log_dir = RunStorage(config.storage_root, config.run_id or "unnamed").local_run_dir / "logs"
            return vllm_env.local_engine(config, self.model_path, index, threads, log_dir, gpu=self.device == "cuda")
        if config.max_staleness:
            return ProcessRolloutEngine(self.model_path, worker_id=worker_id, threads=threads, device=self.device)
        return TransformersRolloutEngine(self.model_path, worker_id=worker_id, device=self.device)

    def start(self) -> tuple[Handle, list[Handle]]:
        config = self.config
        if config.max_staleness:
            torch.set_num_threads(max(1, (os.cpu_count() or 2) // (config.num_rollout_workers + 1)))
        config_json = config.model_dump_json()
        actor = self.actor = ActorServer(config_json, self.model_path, device=self.device)

        def rollout(index: int) -> RolloutServer:
            server = RolloutServer(config_json, self.model_path, index, self.device, engine=self.engine(index))
            self.servers.append(server)
            return server

        indices = range(config.num_rollout_workers)
        if self.uses_vllm:  # separate processes: their starts (imports, engine build) overlap
            with ThreadPoolExecutor(max_workers=len(indices)) as pool:
                servers = list(pool.map(rollout, indices))
        else:
            servers = [rollout(i) for i in indices]
        return InProcess(actor, "actor"), [InProcess(s, f"rollout-{i}") for i, s in enumerate(servers)]

    def weights_method(self) -> str:
        """In memory for transformers engines; by the run's method (`lora` for adapters) for vLLM's processes."""
        if not self.uses_vllm:
            return STATE_DICT
        return self.config.sync_method

    def engine_pid(self, index: int) -> int | None:
        return getattr(self.servers[index].engine, "pid", None) if index < len(self.servers) else None

    def kill(self) -> None:
        for server in self.servers:
            if isinstance(server.engine, ProcessRolloutEngine):
                server.engine.kill()

    def close(self) -> None:
        for server in self.servers:
            server.shutdown()
        if self.actor is not None and isinstance(self.actor.actor, ActorGroup):
            self.actor.actor.close()  # its rank processes
