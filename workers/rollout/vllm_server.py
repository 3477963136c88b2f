"""A vLLM rollout engine's own process: run by the vLLM environment's Python, not grpo-flow's.

    <vllm_python> -m grpo_flow.workers.rollout.vllm_server FD PARENT_PID

vLLM cannot share an environment with Prefect (their fastapi ranges do not meet), so the
local backend starts each vLLM engine with the interpreter `vllm_python` names
(`vllm_process.VLLMProcessEngine`), with only grpo-flow's `workers` package on its path.
This module and what it imports (`channel`, `vllm_engine`, `base`) need the standard library
and what vLLM brings (torch, transformers, safetensors); nothing else of grpo-flow's.

FD is this process's end of a socket pair; requests arrive as `channel` requests. The first
is `create(model_path, worker_id, options)`; every later one is a `VLLMRolloutEngine` method.
The process ends when the parent closes its end or dies: a watcher thread exits it within
half a second of the parent's death (even mid-generate), and the serving loop ends on EOF.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

from grpo_flow.workers.rollout import channel
from grpo_flow.workers.rollout.vllm_engine import VLLMOptions, VLLMRolloutEngine

PARENT_POLL_S = 0.5


def die_with_parent(parent_pid: int) -> None:
    """Exit this process when its parent process is gone (it is then re-parented: getppid changes).

    Not PR_SET_PDEATHSIG: the kernel sends that signal when the *thread* that started the child
    exits, and the local backend starts engines from pool threads (the startup pool, Prefect's task
    threads healing an engine), so engines were SIGKILLed moments after they started, at their first
    generate or weight load."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(PARENT_POLL_S)
        os._exit(0)

    if os.getppid() != parent_pid:  # the parent died before we got here
        os._exit(0)
    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


class EngineHost:
    """What the socket talks to: `create` builds the engine; other names are the engine's methods."""

    def __init__(self) -> None:
        self.engine: VLLMRolloutEngine | None = None

    def create(self, model_path: str, worker_id: str, options: dict[str, Any]) -> dict[str, Any]:
        self.engine = VLLMRolloutEngine(model_path, worker_id=worker_id, options=VLLMOptions(**options))
        return {"pid": os.getpid()}

    def policy_version(self) -> int:
        assert self.engine is not None
        return self.engine.policy_version

    def __getattr__(self, name: str) -> Any:
        if self.engine is None:
            raise RuntimeError(f"{name}: no engine yet (the first request must be create)")
        return getattr(self.engine, name)


def main(argv: list[str]) -> int:
    fd, parent_pid = int(argv[1]), int(argv[2])
    die_with_parent(parent_pid)
    host = EngineHost()
    try:
        channel.serve(Connection(fd), host)
    finally:
        if host.engine is not None:
            host.engine.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
