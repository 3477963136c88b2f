"""What the flow tests that run `grpo train` in a process of its own share: the run on the session's
Prefect server, with or without an injected fault, and the comparison of its final weights."""

import os
import subprocess
import sys

import torch
from safetensors.torch import load_file

from grpo_flow.workers.state.storage import RunStorage


def cli_env(fail_at: str | None = None) -> dict[str, str]:
    """This process's environment, pointed at the session's Prefect server, with `fail_at` injected or none."""
    from prefect.settings import PREFECT_API_URL

    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value(), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    env.pop("GRPO_FLOW_FAIL_AT", None)
    if fail_at:
        env["GRPO_FLOW_FAIL_AT"] = fail_at
    return env


def train_argv(storage_root, run_id: str, *args: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "grpo_flow.flows.cli",
        "train",
        "--run-id",
        run_id,
        "--storage-root",
        str(storage_root),
        "--no-progress",
        *args,
    ]


def train_cli(storage_root, run_id: str, *args: str, fail_at: str | None = None, timeout: float = 600):
    """`grpo train` in a process of its own, on the session's Prefect server."""
    argv = train_argv(storage_root, run_id, *args)
    return subprocess.run(argv, capture_output=True, text=True, env=cli_env(fail_at), timeout=timeout)


def final_weights(storage: RunStorage, step: int) -> dict[str, torch.Tensor]:
    """The trained weights of the run's checkpoint at `step` (a LoRA run's: its adapter), checked against its
    manifest first."""
    storage.verify_checkpoint(step)
    folder = storage.local_checkpoint(step)
    if (folder / "adapter").is_dir():
        return load_file(folder / "adapter" / "adapter_model.safetensors")
    return load_file(folder / "model" / "model.safetensors")


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    """Bitwise the same tensors, or the first that differs and by how much."""
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), f"{name} differs by {float((a[name] - b[name]).abs().max())}"
