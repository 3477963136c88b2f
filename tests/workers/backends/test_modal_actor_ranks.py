"""The Modal actor class with actor_num_processes=2 (modal_actor_gpu_count=2: one container, a GPU a rank), its
methods run with `.local()` as tests/workers/backends/test_modal_app.py runs them: `@modal.enter` starts the
container's 2 ranks as it does on a GPU box (here gloo ranks on CPU), a step and a checkpoint go through rank 0,
and the container's exit ends the ranks."""

import multiprocessing

import pyarrow as pa
import pytest

from grpo_flow.schemas.presets import preset_config
from grpo_flow.workers.backends.modal_app import build_worker_app, worker_config_json
from grpo_flow.workers.data.tiny_model import ensure_tiny_model
from grpo_flow.workers.state.storage import RunStorage

pytestmark = pytest.mark.filterwarnings("ignore:.*executing locally.*:UserWarning")  # no Volume mounted: meant


def rank_processes() -> list[multiprocessing.Process]:
    return [p for p in multiprocessing.active_children() if p.name.startswith("actor-rank-")]


@pytest.mark.slow
def test_the_two_gpu_actor_class_runs_two_ranks_in_its_container(storage_root, tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # each rank one thread: the machine is shared
    model_path = str(ensure_tiny_model(storage_root))  # the session's tiny model
    config = preset_config(
        "tiny",
        run_id="modal-ranks",
        storage_root=str(tmp_path),
        backend="modal",
        actor_num_processes=2,
        modal_actor_gpu="H100",
        modal_actor_gpu_count=2,
    )
    worker_app = build_worker_app(config)
    assert worker_app.options["ActorWorker"]["gpu"] == "H100:2"  # the container Modal gives the 2 ranks
    actor = worker_app.actor_cls(
        config_json=worker_config_json(config), model_path=model_path, device="cpu", storage_root=str(tmp_path)
    )
    assert actor.ready.local()["policy_version"] == 0
    ranks = rank_processes()
    assert sorted(p.name for p in ranks) == ["actor-rank-0", "actor-rank-1"]
    rollouts = pa.table(
        {
            "prompt_token_ids": [[5, 6, 7], [8, 9]] * 4,
            "completion_token_ids": [[3, 4], [5, 6, 7]] * 4,
            "advantage": [1.0, -1.0, 0.5, -0.5] * 2,
        }
    )
    metrics = actor.step.local(0, rollouts)
    assert metrics["loss"] != 0 and metrics["grad_norm"] > 0
    saved = actor.save_checkpoint.local(1, 1, {})
    files = set(saved["manifest"]["files"])
    assert {"model/model.safetensors", "optimizer/__0_0.distcp", "optimizer/__1_0.distcp"} <= files  # a shard a rank
    assert RunStorage(tmp_path, "modal-ranks").verify_checkpoint(1) == saved["manifest"]
    actor.server.close()  # what ActorWorker.stop runs as the container exits (`.local()` gets no exit)
    assert not rank_processes() and all(p.exitcode == 0 for p in ranks)
