"""The whole `grpo` flow through the Modal wrappers, offline: GRPO_FLOW_MODAL_MODE=local runs the
Modal classes in this process with `.local()` on CPU engines (no Modal account, no GPU, no vLLM)."""

import warnings

import pytest

from flows.grpo import grpo
from schemas.presets import preset_config
from workers.storage import RunStorage


@pytest.mark.parametrize("method", ["direct", "volume"])
def test_a_run_on_the_modal_backend_logs_gpu_seconds_and_sync_bytes(prefect_server, storage_root, monkeypatch, method):
    monkeypatch.setenv("GRPO_FLOW_MODAL_MODE", "local")
    warnings.filterwarnings("ignore", message=".*executing locally and will not have access to the mounted Volume")
    config = preset_config(
        "tiny", run_id=f"modal-local-{method}", storage_root=str(storage_root), backend="modal",
        weight_sync_method=method, max_steps=2, prompts_per_step=4, num_generations=4, num_rollout_workers=2,
        eval_prompts=8, save_steps=1,
    )
    summary = grpo(config)
    assert summary["status"] == "completed"
    storage = RunStorage(storage_root, config.run_id)
    rows = storage.read_metrics().to_pylist()
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["gpu_seconds/actor"] > 0 and r["gpu_seconds/rollout"] > 0 for r in rows)
    assert all(r["synced_version"] == r["step"] and r["sync/bytes"] > 0 for r in rows)
    assert storage.read_rollouts().num_rows == 2 * 4 * 4
    assert storage.complete_checkpoints() == [1, 2]


def test_missing_modal_credentials_stop_the_cli_before_anything_starts(tmp_path, monkeypatch, capsys):
    from flows.cli import main

    for name in ("MODAL_TOKEN_ID", "MODAL_TOKEN_SECRET", "GRPO_FLOW_MODAL_MODE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.modal.toml
    monkeypatch.setenv("MODAL_CONFIG_PATH", str(tmp_path / "absent.toml"))
    assert main(["train", "--backend", "modal", "--storage-root", str(tmp_path / "store")]) == 2
    err = capsys.readouterr().err
    assert "--backend modal" in err and "credentials" in err.lower()
    assert not (tmp_path / "store").exists()
