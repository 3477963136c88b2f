"""Actor-side tasks (tasks/train.py): a checkpoint that cannot be written leaves nothing behind."""

import errno
from types import SimpleNamespace

import pytest
from prefect.states import Failed

from grpo_flow.schemas.presets import preset_config
from grpo_flow.tasks import train
from grpo_flow.workers.state.storage import RunStorage, StorageFullError


@pytest.fixture
def config(tmp_path):
    return preset_config("tiny", run_id="ckpt", storage_root=str(tmp_path))


def workers_failing_with(error):
    """Workers whose actor fails halfway through writing its checkpoint, as the actor writes one."""

    def save_checkpoint(storage, version, extra):
        def write(folder):
            (folder / "model.safetensors").write_bytes(b"half a file")
            raise error

        return storage.write_checkpoint(version, write)

    return SimpleNamespace(save_checkpoint=save_checkpoint)


@pytest.mark.parametrize(
    "error",
    [
        OSError(errno.ENOSPC, "No space left on device"),
        RuntimeError("Error while serializing: I/O error: No space left on device (os error 28)"),  # safetensors'
    ],
)
def test_a_full_disk_fails_the_checkpoint_naming_it_and_removes_the_partial_folder(config, plan, monkeypatch, error):
    monkeypatch.setattr(train.backends, "run_workers", lambda *args: workers_failing_with(error))
    with pytest.raises(StorageFullError, match="no space left on the device while writing the checkpoint of step 4"):
        train.save_checkpoint.fn(config, plan, 4)
    checkpoints = RunStorage(config.storage_root, "ckpt").run_dir / "checkpoints"
    assert list(checkpoints.iterdir()) == []  # no staging folder left for a resume to trip over
    with pytest.raises(StorageFullError) as caught:
        train.save_checkpoint.fn(config, plan, 4)
    assert not train.not_a_full_disk(None, None, Failed(data=caught.value))  # not retried: still full


def test_another_failure_also_removes_the_partial_folder_and_is_retried(config, plan, monkeypatch):
    monkeypatch.setattr(train.backends, "run_workers", lambda *args: workers_failing_with(ValueError("boom")))
    with pytest.raises(ValueError, match="boom") as caught:
        train.save_checkpoint.fn(config, plan, 4)
    assert list((RunStorage(config.storage_root, "ckpt").run_dir / "checkpoints").iterdir()) == []
    assert train.not_a_full_disk(None, None, Failed(data=caught.value))
