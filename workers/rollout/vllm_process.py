"""A vLLM rollout engine in its own process, started from the vLLM environment's interpreter.

`VLLMProcessEngine` has the vLLM engine's surface (`load`, `generate`, `load_state_dict`,
`reload_weights_from`, `load_lora_adapter`, `recreate`, `sleep`, `wake_up`, `policy_version`,
`tokenizer`, `worker_id`, `model`) and forwards each call over a socket pair to a
`VLLMRolloutEngine` in `<python> -m grpo_flow.workers.rollout.vllm_server` (see that module for why a
separate interpreter). The weight-sync methods of `grpo_flow.workers.backends.weight_sync` therefore
work on it unchanged. Weights in memory travel as safetensors bytes over the socket (a format
both sides read whatever their torch versions); files stay files (the engine reads the path).

The child sees only grpo-flow's `workers` package on its path (a symlink in a private folder),
never this environment's site-packages. vLLM runs in the child's own process
(VLLM_ENABLE_V1_MULTIPROCESSING=0 unless set: one process per engine, and on CPU an engine
start of 8 s instead of 19 s, see the README), its threads unbound on CPU so several engines
share the cores. Its output goes to `log_path` when given; a dead engine's error quotes the
end of it.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import socket
import subprocess
import tempfile
import threading
from collections.abc import Mapping
from dataclasses import asdict
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from grpo_flow.workers.rollout import channel
from grpo_flow.workers.rollout.channel import EngineCallError, EngineProcessError
from grpo_flow.workers.rollout.vllm_engine import VLLMOptions, VLLMSetupError, complete_tied_weights
from grpo_flow.workers.state.lock import pid_alive
from grpo_flow.workers.state.source import stage_package

SERVER_MODULE = "grpo_flow.workers.rollout.vllm_server"
SOURCE_PREFIX = "grpo-flow-vllm-src-"  # then the owning process's id: <prefix><pid>-<random>
_SOURCE_LOCK = threading.Lock()
_SOURCE_DIR: str | None = None


def source_dir() -> str:
    """A private folder holding `grpo_flow` with only its `workers` (links): the child's whole sys.path addition."""
    global _SOURCE_DIR
    with _SOURCE_LOCK:
        if _SOURCE_DIR is None:
            remove_orphaned_source_dirs()
            folder = tempfile.mkdtemp(prefix=f"{SOURCE_PREFIX}{os.getpid()}-")
            stage_package(folder, ["workers"])
            atexit.register(shutil.rmtree, folder, ignore_errors=True)
            _SOURCE_DIR = folder
        return _SOURCE_DIR


def remove_orphaned_source_dirs() -> None:
    """Folders of processes that were killed (no atexit ran: a SIGKILLed Ray actor, a killed run)."""
    for folder in Path(tempfile.gettempdir()).glob(f"{SOURCE_PREFIX}*-*"):
        pid = folder.name.removeprefix(SOURCE_PREFIX).split("-", 1)[0]
        if pid.isdigit() and not pid_alive(int(pid)):
            shutil.rmtree(folder, ignore_errors=True)


def child_environment(threads: int | None, extra: Mapping[str, str] | None, logging_to_file: bool) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = source_dir()
    # `python -m` puts the working directory first on sys.path: a `grpo_flow/` folder there would be
    # imported instead of ours. Python 3.11+ leaves it out with this set (older ones ignore it).
    env["PYTHONSAFEPATH"] = "1"
    env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    if not logging_to_file:
        env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    env.update(extra or {})
    return env


class VLLMProcessEngine:
    def __init__(
        self,
        model_path: str | Path,
        worker_id: str = "rollout-0",
        options: VLLMOptions | None = None,
        *,
        python: str,
        threads: int | None = None,
        env: Mapping[str, str] | None = None,
        log_path: str | Path | None = None,
    ) -> None:
        self.model_path = str(model_path)
        self.worker_id = worker_id
        self.options = options or VLLMOptions()
        self.python = python
        self.threads = threads
        self.env = dict(env or {})
        self.log_path = Path(log_path) if log_path else None
        self.policy_version = 0
        self.tokenizer: Any = None
        self._loaded = False
        self._lock = threading.Lock()  # one call in flight per engine
        self._process: subprocess.Popen | None = None
        self._conn: Connection | None = None

    # -- process -------------------------------------------------------------------------------------
    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    def alive(self) -> bool:
        return self._process is not None and self._process.poll() is None

    @property
    def model(self) -> Any:
        """Truthy while a loaded engine process lives (a killed one reads as not loaded, so it is restarted)."""
        return True if self._loaded and self.alive() else None

    def _start(self) -> None:
        if not (os.path.isfile(self.python) and os.access(self.python, os.X_OK)):
            raise VLLMSetupError(
                f"vllm_python: no Python at {self.python}; create the vLLM environment with `grpo setup-vllm`"
            )
        parent, child = socket.socketpair()
        log = open(self.log_path, "ab") if self.log_path else None  # noqa: SIM115 - the child keeps it
        try:
            self._process = subprocess.Popen(
                [self.python, "-m", SERVER_MODULE, str(child.fileno()), str(os.getpid())],
                pass_fds=(child.fileno(),),
                env=child_environment(self.threads, self.env, log is not None),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT if log else None,
                start_new_session=False,
            )
        finally:
            child.close()
            if log:
                log.close()
        self._conn = Connection(parent.detach())
        self._call_unlocked("create", self.model_path, self.worker_id, asdict(self.options))

    def _log_tail(self, lines: int = 15) -> str:
        if not self.log_path or not self.log_path.exists():
            return ""
        tail = self.log_path.read_text(errors="replace").splitlines()[-lines:]
        return f"\nlast lines of {self.log_path}:\n" + "\n".join(tail)

    def _call_unlocked(self, method: str, *args: Any, **kwargs: Any) -> Any:
        assert self._conn is not None
        try:
            return channel.call(self._conn, self.worker_id, method, *args, **kwargs)
        except EngineCallError as error:
            if error.error_type == VLLMSetupError.__name__:  # a clear refusal: its message alone
                raise VLLMSetupError(str(error).split(": ", 2)[-1].split("\n", 1)[0]) from None
            raise
        except EngineProcessError as error:
            self._discard()
            raise EngineProcessError(f"{error}{self._log_tail()}") from error

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            if not self.alive():
                self._discard()
                raise EngineProcessError(f"rollout engine process {self.worker_id} is not running{self._log_tail()}")
            return self._call_unlocked(method, *args, **kwargs)

    def _discard(self) -> None:
        """Forget a dead (or ending) process; the next load() starts a new one."""
        self._loaded = False
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        if self._process is not None and self._process.poll() is None:
            self._process.kill()
            self._process.wait(timeout=30)
        self._process = None

    # -- the engine's surface ------------------------------------------------------------------------
    def load(self) -> None:
        """Start the process and engine on the initial model; a running engine goes back to the initial weights."""
        from grpo_flow.workers.rollout.base import load_generation_tokenizer

        with self._lock:
            if not self.alive():
                self._discard()
                self._start()
            self._call_unlocked("load")
        if self.tokenizer is None:
            self.tokenizer = load_generation_tokenizer(self.model_path)
        self.policy_version = 0
        self._loaded = True

    def generate(self, prompts: list[Any], params: Any, max_prompt_length: int | None = None) -> Any:
        return self._call("generate", list(prompts), params, max_prompt_length)

    def load_state_dict(self, weights: Mapping[str, Any] | bytes, version: int, adapter_config: Any = None) -> None:
        """The actor's weights (or, with `adapter_config`, its LoRA adapter) in memory, as safetensors bytes."""
        if not isinstance(weights, (bytes, bytearray)):
            from safetensors.torch import save

            weights = save(complete_tied_weights(weights, False))
        if adapter_config is not None:
            # Plain JSON values: the engine's environment has no peft to unpickle its enums and classes with.
            raw = adapter_config if isinstance(adapter_config, dict) else adapter_config.to_dict()
            adapter_config = json.loads(json.dumps(raw, default=lambda v: sorted(v) if isinstance(v, set) else str(v)))
        self._call("load_state_dict", bytes(weights), version, adapter_config)
        self.policy_version = version

    def reload_weights_from(self, path: str | Path, version: int) -> None:
        self._call("reload_weights_from", str(path), version)
        self.policy_version = version

    def load_lora_adapter(self, folder: str | Path, version: int) -> None:
        self._call("load_lora_adapter", str(folder), version)
        self.policy_version = version

    def recreate(self, model_path: str | Path, version: int) -> None:
        self._call("recreate", str(model_path), version)
        self.policy_version = version

    def sleep(self, level: int = 1) -> None:
        self._call("sleep", level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        self._call("wake_up", tags)

    def close(self) -> None:
        """End the engine and its process (waits for it; kills it if it does not end)."""
        with self._lock:
            if self.alive() and self._conn is not None:
                try:
                    channel.call(self._conn, self.worker_id, channel.CLOSE)
                    assert self._process is not None
                    self._process.wait(timeout=60)
                except (EngineProcessError, subprocess.TimeoutExpired):
                    pass
            self._discard()

    shutdown = close
