"""Every preset's first step with the network unreachable (issue 30, item 1): the offline presets train a
step from their built-in models (smollm2-135m from the cached copy tests/conftest.py prepares), and the hub
presets are refused at once, in one line naming the model. `grpo train --preset reverse` used to fail here:
every model name but `tiny` was taken for a hub id."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest

from grpo_flow.schemas.presets import PRESETS
from grpo_flow.workers.data.models import BUILTIN_MODELS

# One step, as small as each preset allows.
FIRST_STEP = ["--max-steps", "1", "--prompts-per-step", "1", "--num-generations", "2", "--eval-prompts", "0"]
ONE_WORKER = ["--num-rollout-workers", "1"]


def closed_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def offline_env(tmp_path) -> dict[str, str]:
    """No hub (offline, an empty hub cache) and a package index where nothing listens."""
    from prefect.settings import PREFECT_API_URL

    env = {k: v for k, v in os.environ.items() if k.lower() not in ("https_proxy", "http_proxy", "all_proxy")}
    env.pop("GRPO_FLOW_FAIL_AT", None)
    return {
        **env,
        "HF_HUB_OFFLINE": "1",
        "HF_HOME": str(tmp_path / "hf-home"),
        "PIP_INDEX_URL": f"http://127.0.0.1:{closed_port()}/simple/",
        "PREFECT_API_URL": PREFECT_API_URL.value(),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    }


@pytest.mark.slow
@pytest.mark.real_model
@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_every_presets_first_step_with_the_network_unreachable(
    preset, prefect_server, storage_root, smollm2_path, tmp_path
):
    argv = [sys.executable, "-m", "grpo_flow.flows.cli", "train", "--preset", preset, "--run-id", f"offline-{preset}"]
    argv += ["--storage-root", str(storage_root), "--no-progress", *FIRST_STEP, "--max-completion-length", "4"]
    argv += ONE_WORKER if PRESETS[preset]["num_rollout_workers"] > 1 else []
    offline = PRESETS[preset]["model"] in BUILTIN_MODELS
    started = time.monotonic()
    done = subprocess.run(argv, capture_output=True, text=True, env=offline_env(tmp_path), timeout=900)
    if offline:
        assert done.returncode == 0, done.stderr[-3000:]
        assert "completed" in done.stdout and re.search(r"steps\s+1 / 1", done.stdout), done.stdout
    else:
        assert done.returncode == 2 and time.monotonic() - started < 30, done.stderr[-3000:]
        line = done.stderr.strip()
        assert len(line.splitlines()) == 1, line
        assert (
            f"--model: '{PRESETS[preset]['model']}' is not in the Hugging Face cache and HF_HUB_OFFLINE is set" in line
        )
