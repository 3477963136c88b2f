"""A LoRA run's checkpoints hold its adapter, its weight syncs move the adapter alone, and `grpo export`
turns a checkpoint (LoRA or full) into a folder `AutoModelForCausalLM.from_pretrained` loads."""

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from grpo_flow.flows.cli import main
from grpo_flow.flows.grpo import grpo
from grpo_flow.schemas.presets import preset_config
from grpo_flow.workers.actor.actor import Actor
from grpo_flow.workers.data.models import resolve_model_path
from grpo_flow.workers.state.storage import RunStorage
from same_samples import assert_same_samples  # tests/same_samples.py

SMALL = dict(max_steps=2, save_steps=1, prompts_per_step=4, num_generations=4, eval_prompts=0)


def run(storage_root, run_id, **overrides):
    config = preset_config("tiny", run_id=run_id, storage_root=str(storage_root), **SMALL, **overrides)
    assert grpo(config)["status"] == "completed"
    return config, RunStorage(storage_root, run_id)


@pytest.fixture(scope="module")
def lora_run(prefect_server, storage_root):
    """lora_publish left unset: the default for a LoRA run."""
    return run(storage_root, "export-lora", use_lora=True, lora_r=4, lora_alpha=8, learning_rate=5e-2)


@pytest.fixture(scope="module")
def full_run(prefect_server, storage_root):
    return run(storage_root, "export-full")


def export(storage_root, *argv):
    return main(["export", *argv, "--storage-root", str(storage_root)])


def test_a_lora_checkpoint_is_its_adapter_and_the_sync_moves_the_adapter(lora_run, storage_root):
    config, storage = lora_run
    base = Path(resolve_model_path("tiny", storage_root))
    base_bytes = sum(p.stat().st_size for p in base.glob("*.safetensors"))
    for step in (1, 2):
        folder = storage.checkpoint_dir(step)
        assert not (folder / "model").exists()
        assert sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) < base_bytes
    adapter = load_file(storage.checkpoint_dir(2) / "adapter" / "adapter_model.safetensors")
    adapter_bytes = sum(t.numel() * t.element_size() for t in adapter.values())
    assert [row["sync/bytes"] for row in storage.read_metrics().to_pylist()] == [adapter_bytes, adapter_bytes]


def test_export_merges_a_lora_checkpoint_into_its_base_model(lora_run, storage_root, tmp_path, capsys):
    config, storage = lora_run
    assert export(storage_root, "export-lora", "--output", str(tmp_path / "merged")) == 0
    assert "checkpoint 2, its LoRA adapter merged into the base model" in capsys.readouterr().out
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).state_dict()
    actor = Actor(config, resolve_model_path("tiny", storage_root))
    actor.restore(storage.checkpoint_dir(2))
    policy = actor.policy_state_dict()
    assert exported.keys() == policy.keys()
    for name in policy:
        torch.testing.assert_close(exported[name], policy[name], atol=1e-6, rtol=0, msg=name)
    assert AutoTokenizer.from_pretrained(tmp_path / "merged").encode("12 3")

    assert export(storage_root, "export-lora", "--step", "1", "--output", str(tmp_path / "step-1")) == 0
    first = AutoModelForCausalLM.from_pretrained(tmp_path / "step-1", dtype=torch.float32).state_dict()
    assert not torch.equal(
        first["model.layers.0.self_attn.q_proj.weight"], policy["model.layers.0.self_attn.q_proj.weight"]
    )


def test_grpo_eval_runs_a_lora_checkpoint_as_its_base_model_with_the_adapter(lora_run, storage_root, tmp_path):
    from grpo_flow.flows.evaluate import checkpoint_engine
    from grpo_flow.workers.data.loaders import load_task
    from grpo_flow.workers.rollout.base import SamplingParams
    from grpo_flow.workers.rollout.transformers_engine import TransformersRolloutEngine

    _, storage = lora_run
    assert export(storage_root, "export-lora", "--output", str(tmp_path / "merged")) == 0
    merged = TransformersRolloutEngine(tmp_path / "merged")
    merged.load()
    adapter = checkpoint_engine(storage, 2, "cpu")
    prompts = load_task("last_digit").heldout.select(range(4))["prompt"]
    assert_same_samples(adapter, merged, prompts, SamplingParams(n=2, max_tokens=4, temperature=1.0, seed=7))


def test_a_modal_runs_lora_checkpoint_is_fetched_from_its_volume_and_exported_the_same(
    lora_run, storage_root, tmp_path, monkeypatch
):
    import shutil

    import grpo_flow.workers.backends.modal_backend as modal_backend
    from test_evaluate import as_modal_checkpoint  # tests/flows/test_evaluate.py

    _, storage = lora_run
    modal_root = tmp_path / "modal-root"
    shutil.copytree(storage.run_dir, modal_root / "runs" / "export-lora")
    volume = as_modal_checkpoint(modal_root / "runs" / "export-lora", 2)
    assert any("/adapter/" in name for name in volume.files) and not (storage.checkpoint_dir(2) / "model").exists()
    monkeypatch.setattr(modal_backend, "open_volume", lambda name: volume)
    assert main(["export", "export-lora", "--output", str(tmp_path / "modal"), "--storage-root", str(modal_root)]) == 0
    assert export(storage_root, "export-lora", "--output", str(tmp_path / "local")) == 0
    ours, theirs = (load_file(tmp_path / name / "model.safetensors") for name in ("modal", "local"))
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_export_of_a_full_fine_tune_is_its_weights_as_they_are(full_run, storage_root, tmp_path):
    _, storage = full_run
    assert export(storage_root, "export-full", "--output", str(tmp_path / "out")) == 0
    saved = load_file(storage.checkpoint_dir(2) / "model" / "model.safetensors")
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).state_dict()
    assert all(torch.equal(exported[name], saved[name]) for name in saved)
    assert AutoTokenizer.from_pretrained(tmp_path / "out").encode("12 3")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["export-full", "--step", "7"], "--step: run 'export-full' has no checkpoint of step 7; checkpoints: [1, 2]"),
        (["nope"], "RUN_ID: no run 'nope'"),
        (["../../outside"], "RUN_ID: '../../outside' is not a run id"),
        (["export-full", "--output", "{tmp}"], "exists; name a folder that does not exist yet"),
    ],
)
def test_export_refuses_bad_input_in_one_line(full_run, storage_root, tmp_path, capsys, argv, message):
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    if "--output" not in argv:
        argv += ["--output", str(tmp_path / "out")]
    assert export(storage_root, *argv) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
