"""The Modal backend's `.local()` workers on a Volume that behaves like one (volume_double.py): each
container has its own view, and sees another's writes only after that one's commit and its own reload.

The flow's run folder is elsewhere (as on the user's machine): a checkpoint the actor wrote lives on the
Volume, and resume, healing and pruning must find it there.
"""

import pytest
import torch

from grpo_flow.schemas.presets import preset_config
from grpo_flow.schemas.records import RunPlan
from grpo_flow.tasks import train
from grpo_flow.workers.backends import modal_app
from grpo_flow.workers.backends.modal_backend import ModalHandle, ModalPlacement
from grpo_flow.workers.backends.workers import Workers
from grpo_flow.workers.data.loaders import load_task
from grpo_flow.workers.data.tiny_model import ensure_tiny_model
from grpo_flow.workers.rollout.base import SamplingParams
from grpo_flow.workers.state.storage import RunStorage
from test_modal_app import rollouts_table  # tests/workers/backends/test_modal_app.py
from volume_double import VolumeDouble  # tests/workers/backends/volume_double.py

# `.local()` warns that no Volume is mounted; the double stands in for it.
pytestmark = pytest.mark.filterwarnings("ignore:.*executing locally.*:UserWarning")
RUN = "modal-volume"
CHECKPOINTS = f"runs/{RUN}/checkpoints"


@pytest.fixture(scope="module")
def model_path(storage_root):
    return str(ensure_tiny_model(storage_root))


def test_the_double_shows_a_write_only_after_the_writers_commit_and_the_readers_reload(tmp_path):
    volume = VolumeDouble(tmp_path)
    writer, reader = (volume.container_volume("v", volume.mount(name)) for name in ("writer", "reader"))
    (writer.root / "a.txt").write_text("one")
    reader.reload()
    assert not (reader.root / "a.txt").exists()  # not committed
    writer.commit()
    assert not (reader.root / "a.txt").exists()  # committed, not reloaded
    reader.reload()
    assert (reader.root / "a.txt").read_text() == "one"
    (reader.root / "b.txt").write_text("two")
    reader.commit()
    (writer.root / "a.txt").unlink()
    writer.commit()  # the writer's removal; the reader's file stays (last writer wins, file by file)
    assert sorted(entry.path for entry in volume.listdir("/")) == ["b.txt"]


def plan_of(config):
    return RunPlan(
        run_id=RUN,
        storage_root=config.storage_root,
        model_path="unused",
        total_steps=4,
        reward_names=("last_digit",),
        extra_columns=("answer",),
        num_train_prompts=len(load_task("last_digit").train),
    )


def actor_weights(workers):
    """The weights the actor's container holds (Modal forwards attribute access to the `.local()` instance)."""
    return {k: v.clone() for k, v in workers.actor.instance.server.actor.model.state_dict().items()}


def new_actor_container(workers, volume, model_path):
    """What Modal does when the actor's container is lost: a new one, the Volume mounted as committed."""
    placement = workers.placement
    instance = placement.worker_app.actor_cls(
        config_json=modal_app.worker_config_json(placement.config),
        model_path=model_path,
        device="cpu",
        storage_root=volume.mount("actor"),
    )
    return ModalHandle(placement, instance, "actor", "actor", 1)


def test_resume_healing_and_pruning_find_the_checkpoint_the_actor_wrote_on_the_volume(
    model_path, tmp_path, volume, monkeypatch
):
    config = preset_config("tiny", run_id=RUN, storage_root=str(tmp_path / "local"), save_total_limit=1)
    storage, plan = RunStorage(config.storage_root, RUN), plan_of(config)

    def modal_workers():
        placement = ModalPlacement(
            config, model_path, mode="local", rollout_device="cpu", actor_device="cpu", mount=volume.mount
        )
        return Workers(config, model_path, placement).start()

    workers = modal_workers()
    monkeypatch.setattr(train.backends, "run_workers", lambda *args: workers)
    prompts = load_task("last_digit").train.select(range(4))["prompt"]
    result = workers.generate(0, 0, prompts, SamplingParams(n=4, max_tokens=2, seed=1), 32)
    table = rollouts_table(result, 4)
    workers.actor_step(0, table)
    workers.sync_weights()
    train.save_checkpoint.fn(config, plan, 1)
    at_1 = actor_weights(workers)

    # The actor wrote checkpoints/step-N on the Volume and committed it; no staging name is left there.
    assert volume.exists(f"{CHECKPOINTS}/step-000001/manifest.json")
    assert [entry.path for entry in volume.listdir(CHECKPOINTS)] == [f"{CHECKPOINTS}/step-000001"]
    assert storage.verify_checkpoint(1)["policy_version"] == 1  # the flow's folder: a pointer, committed
    assert not (storage.checkpoint_dir(1) / "optimizer.pt").exists()

    workers.actor_step(1, table)
    at_2 = actor_weights(workers)
    # Healing: the actor's container is lost; the new one restores step 1 from the Volume and steps again.
    workers.actor = new_actor_container(workers, volume, model_path)
    workers.actor_step(1, table)
    assert all(torch.equal(at_2[k], v) for k, v in actor_weights(workers).items())
    workers.close()

    # Resume: new containers, the actor restored from the Volume's checkpoint.
    workers = modal_workers()
    assert workers.restore(storage, 1) == 1
    assert all(torch.equal(at_1[k], v) for k, v in actor_weights(workers).items())

    # Pruning (save_total_limit 1) removes the Volume's copy with the flow's.
    workers.actor_step(1, table)
    workers.sync_weights()
    train.save_checkpoint.fn(config, plan, 2)
    assert storage.checkpoint_steps() == [2]
    assert [entry.path for entry in volume.listdir(CHECKPOINTS)] == [f"{CHECKPOINTS}/step-000002"]
    workers.close()
