"""The whole `grpo` flow through the Modal wrappers, offline: GRPO_FLOW_MODAL_MODE=local runs the
Modal classes in this process with `.local()` on CPU engines (no Modal account, no GPU, no vLLM)."""

import warnings

import pytest

from grpo_flow.flows.grpo import grpo
from grpo_flow.workers import backends
from grpo_flow.schemas.presets import preset_config
from grpo_flow.workers.state.storage import RunStorage
from grpo_flow.workers.state.faults import injected


@pytest.mark.parametrize("method", ["direct", "volume"])
def test_a_run_on_the_modal_backend_logs_gpu_seconds_and_sync_bytes(prefect_server, storage_root, monkeypatch, method):
    monkeypatch.setenv("GRPO_FLOW_MODAL_MODE", "local")
    warnings.filterwarnings("ignore", message=".*executing locally and will not have access to the mounted Volume")
    config = preset_config(
        "tiny",
        run_id=f"modal-local-{method}",
        storage_root=str(storage_root),
        backend="modal",
        weight_sync_method=method,
        max_steps=2,
        prompts_per_step=4,
        num_generations=4,
        num_rollout_workers=2,
        eval_prompts=8,
        save_steps=1,
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
    from grpo_flow.flows.cli import main

    for name in ("MODAL_TOKEN_ID", "MODAL_TOKEN_SECRET", "GRPO_FLOW_MODAL_MODE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.modal.toml
    monkeypatch.setenv("MODAL_CONFIG_PATH", str(tmp_path / "absent.toml"))
    assert main(["train", "--backend", "modal", "--storage-root", str(tmp_path / "store")]) == 2
    err = capsys.readouterr().err
    assert "--backend modal" in err and "credentials" in err.lower()
    assert not (tmp_path / "store").exists()


def test_a_failed_modal_run_resumes_from_its_checkpoint_and_ends_where_an_unbroken_run_ends(
    prefect_server, storage_root, monkeypatch
):
    """Through the Modal wrappers: the actor worker restores the checkpoint, the rollout workers get its
    weights, the logged step after it is replayed, and the final weights equal an unbroken run's."""
    import torch
    from safetensors.torch import load_file

    monkeypatch.setenv("GRPO_FLOW_MODAL_MODE", "local")
    warnings.filterwarnings("ignore", message=".*executing locally and will not have access to the mounted Volume")
    fields = dict(
        storage_root=str(storage_root),
        backend="modal",
        weight_sync_method="volume",
        max_steps=4,
        save_steps=2,
        prompts_per_step=2,
        num_generations=4,
        eval_prompts=0,
    )
    unbroken = preset_config("tiny", run_id="modal-unbroken", **fields)
    assert grpo(unbroken)["status"] == "completed"

    broken = preset_config("tiny", run_id="modal-resumed", **fields)
    with pytest.raises(Exception, match="injected failure at stage 'actor' of step 4"):
        with injected("actor@4"):
            grpo(broken)
    backends.release(broken.run_id)  # as a new process would: fresh Modal containers
    summary = grpo(broken)
    assert summary["status"] == "completed" and summary["steps_completed"] == 4

    storage = RunStorage(storage_root, broken.run_id)
    assert storage.logged_steps() == [1, 2, 3, 4]
    assert [r["step"] for r in storage.read_metrics().to_pylist()] == [1, 2, 3, 4]
    ours = load_file(storage.checkpoint_dir(4) / "model" / "model.safetensors")
    reference = load_file(RunStorage(storage_root, unbroken.run_id).checkpoint_dir(4) / "model" / "model.safetensors")
    for name in reference:
        torch.testing.assert_close(ours[name], reference[name], atol=1e-6, rtol=0)
