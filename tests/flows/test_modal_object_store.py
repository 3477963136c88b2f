"""The Modal backend on an S3 storage root (moto's server, tests/conftest.py), offline: GRPO_FLOW_MODAL_MODE=local
runs the Modal classes with `.local()`, and each worker is handed the URL, as a container is. The actor writes
and commits its checkpoints on the bucket, the weights travel in the calls, and nothing of the run lands in a
local folder named after the URL or on a Volume."""

import os

import pytest
import s3fs

from grpo_flow.flows.grpo import grpo
from grpo_flow.schemas.presets import preset_config
from grpo_flow.workers import backends
from grpo_flow.workers.backends.modal_backend import VOLUME_CHECKPOINT_POINTER
from grpo_flow.workers.state.faults import injected
from grpo_flow.workers.state.location import local_root
from grpo_flow.workers.state.storage import MANIFEST, STEP_MANIFEST, RunStorage
from train_cli import assert_same_weights, final_weights  # tests/flows/train_cli.py

# `.local()` warns that no Volume is mounted: on a URL root none is used for the run's files.
pytestmark = pytest.mark.filterwarnings("ignore:.*executing locally.*:UserWarning")
FIELDS = dict(
    backend="modal",
    max_steps=4,
    save_steps=2,
    prompts_per_step=2,
    num_generations=4,
    num_rollout_workers=2,
    eval_prompts=0,
)


@pytest.fixture(scope="module")
def on_modal(s3_root, storage_root, tmp_path_factory):
    """The Modal backend's `.local()` workers, the session's tiny model (built once, in its cache), and a working
    folder of its own: a URL taken as a path would leave an `s3:` folder in it."""
    workdir = tmp_path_factory.mktemp("cwd")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("GRPO_FLOW_MODAL_MODE", "local")
        patch.setenv("GRPO_FLOW_CACHE", str(storage_root))
        patch.chdir(workdir)
        yield workdir


@pytest.fixture(scope="module")
def unbroken(prefect_server, on_modal, s3_root):
    config = preset_config("tiny", run_id="modal-s3-unbroken", storage_root=s3_root, **FIELDS)
    assert grpo(config)["status"] == "completed"
    return RunStorage(s3_root, config.run_id)


@pytest.mark.slow
def test_a_modal_run_on_s3_keeps_every_file_in_the_bucket_and_none_in_a_local_folder(unbroken, s3_root, on_modal):
    assert unbroken.rollout_steps() == unbroken.logged_steps() == [1, 2, 3, 4]
    assert unbroken.complete_checkpoints() == [2, 4]
    assert unbroken.read_summary()["status"] == "completed"
    rows = unbroken.read_metrics().to_pylist()
    assert all(r["gpu_seconds/actor"] > 0 and r["synced_version"] == r["step"] and r["sync/bytes"] > 0 for r in rows)
    fs = s3fs.S3FileSystem()
    fs.invalidate_cache()
    run = s3_root.removeprefix("s3://") + "/runs/modal-s3-unbroken"
    keys = {key.removeprefix(run + "/") for key in fs.find(run)}
    # The actor's checkpoint on the bucket is the run's: its weights and optimizer, not a pointer to a Volume.
    for step in ("step-000002", "step-000004"):
        assert {f"checkpoints/{step}/{name}" for name in (MANIFEST, "model/model.safetensors", "optimizer.pt")} <= keys
        assert f"checkpoints/{step}/{VOLUME_CHECKPOINT_POINTER}" not in keys
    assert {
        "config.json",
        "summary.json",
        f"rollouts/step-000004/{STEP_MANIFEST}",
        "metrics/step-000004.parquet",
    } <= keys
    assert not [key for key in keys if "weights/" in key or ".tmp" in key or "writer.lock" in key]
    # `reload`, the default, became `direct`: no weight file in the folder the `.local()` workers share here,
    # which containers would not share.
    assert not (local_root(s3_root) / "runs" / "modal-s3-unbroken" / "weights").exists()
    assert os.listdir(on_modal) == []  # no `s3:` folder, no ./grpo-storage


@pytest.mark.slow
def test_a_failed_modal_run_on_s3_resumes_from_the_actors_checkpoint_to_the_unbroken_runs_weights(
    unbroken, s3_root, on_modal
):
    broken = preset_config("tiny", run_id="modal-s3-resumed", storage_root=s3_root, **FIELDS)
    with pytest.raises(Exception, match="injected failure at stage 'actor' of step 4"):
        with injected("actor@4"):
            grpo(broken)
    backends.release(broken.run_id)  # as a new process would: fresh Modal containers
    storage = RunStorage(s3_root, broken.run_id)
    assert storage.complete_checkpoints() == [2]
    summary = grpo(broken)
    assert summary["status"] == "completed" and summary["resumed_from_step"] == 2 and summary["steps_completed"] == 4
    assert storage.logged_steps() == [1, 2, 3, 4]
    assert_same_weights(final_weights(storage, 4), final_weights(unbroken, 4))
    assert storage.uncommitted() == []
    assert os.listdir(on_modal) == []


def test_a_file_weight_sync_on_s3_is_refused_by_the_cli_naming_the_option(s3_root, capsys):
    from grpo_flow.flows.cli import main

    argv = ["train", "--preset", "tiny", "--backend", "modal", "--storage-root", s3_root]
    assert main([*argv, "--weight-sync-method", "volume"]) == 2
    err = capsys.readouterr().err
    assert "--weight-sync-method: 'volume' hands weights over as files" in err and "use 'direct'" in err


def test_an_actor_container_without_the_buckets_credentials_stops_at_its_start_naming_the_url(
    s3_root, monkeypatch, tmp_path
):
    """As a container whose Secret is missing: no AWS_* variables, no ~/.aws. It stops before its model loads."""
    from grpo_flow.workers.backends.modal_app import build_worker_app, worker_config_json
    from grpo_flow.workers.state.location import StorageURLError

    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(name)
    for name in ("AWS_SHARED_CREDENTIALS_FILE", "AWS_CONFIG_FILE"):
        monkeypatch.setenv(name, str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    root = f"{s3_root}/without-credentials"  # a URL of its own: each is probed once per process
    config = preset_config("tiny", run_id="modal-s3-refused", storage_root=root, backend="modal")
    actor = build_worker_app(config).actor_cls(
        config_json=worker_config_json(config), model_path="no-model-loads", device="cpu", storage_root=root
    )
    s3fs.S3FileSystem.clear_instance_cache()  # s3fs keeps one client per set of arguments, not per environment
    try:
        with pytest.raises(StorageURLError, match=rf"'{root}' cannot be written: .*credentials"):
            actor.ready.local()
    finally:
        s3fs.S3FileSystem.clear_instance_cache()


@pytest.mark.slow
def test_a_modal_run_on_s3_moves_to_the_local_backend_at_its_resume(unbroken, s3_root, on_modal):
    """The bucket holds the whole run: started on Modal, resumed here, it ends with the unbroken Modal run's
    weights within 1e-5 (a bias off by 3e-6), not bitwise: the Modal backend corrects for its engines' log-probs (importance
    sampling, `engine_logprobs_can_differ`) and the local one does not, so the steps after the move round apart."""
    import torch

    moved = preset_config("tiny", run_id="modal-s3-moved", storage_root=s3_root, **FIELDS)
    with pytest.raises(Exception, match="injected failure at stage 'actor' of step 4"):
        with injected("actor@4"):
            grpo(moved)
    backends.release(moved.run_id)
    summary = grpo(moved.model_copy(update={"backend": "local"}))
    assert summary["status"] == "completed" and summary["resumed_from_step"] == 2
    ours, reference = final_weights(RunStorage(s3_root, moved.run_id), 4), final_weights(unbroken, 4)
    for name in reference:
        torch.testing.assert_close(ours[name], reference[name], atol=1e-5, rtol=0)
