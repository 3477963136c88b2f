"""Every weight-sync method, on CPU, between the real actor and the transformers rollout engine.

After the actor takes one optimizer step, an engine still holding the initial weights samples
tokens whose log-probs differ from the actor's; after a sync by any method, the engine's
sampling log-probs equal the actor's log-probs of the same tokens (within 1e-4).
"""

import json

import pyarrow as pa
import pytest
import torch

from grpo_flow.schemas.presets import preset_config
from grpo_flow.workers.actor.actor import Actor, loss_inputs
from grpo_flow.workers.data.loaders import load_task
from grpo_flow.workers.rollout.base import SamplingParams
from grpo_flow.workers.rollout.transformers_engine import TransformersRolloutEngine
from grpo_flow.workers.data.tiny_model import ensure_tiny_model
from grpo_flow.workers.backends.weight_sync import (
    METHODS,
    WeightSyncError,
    apply_weights,
    check_weight_sync_config,
    export_weights,
    sync_weights,
    version_dir,
)

MATCH = 1e-4  # the parity bound of tests/workers/actor/test_trl_objective.py
DIFFER = 1e-3  # one optimizer step at the tiny preset's learning rate moves log-probs well past this


@pytest.fixture(scope="module")
def model_path(storage_root):
    return ensure_tiny_model(storage_root)


def prompts(count=6, offset=0):
    return load_task("last_digit").train.select(range(offset, offset + count))["prompt"]


def rollouts_table(result, n, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return pa.table(
        {
            "prompt_token_ids": [ids for ids in result.prompt_token_ids for _ in range(n)],
            "completion_token_ids": result.completion_token_ids,
            "sampling_logprobs": result.sampling_logprobs,
            "advantage": torch.randn(len(result.texts), generator=generator).tolist(),
        }
    )


def new_engine(model_path):
    engine = TransformersRolloutEngine(model_path)
    engine.load()
    return engine


def take_one_step(actor, model_path):
    """One optimizer step on rollouts sampled from the initial policy."""
    result = new_engine(model_path).generate(prompts(), SamplingParams(n=4, max_tokens=3, temperature=1.0, seed=1))
    actor.step(0, rollouts_table(result, n=4))
    assert actor.policy_version == 1


def max_logprob_gap(actor, engine):
    """Largest |engine sampling log-prob - actor log-prob| over freshly sampled tokens (temperature 1)."""
    result = engine.generate(prompts(8, offset=20), SamplingParams(n=4, max_tokens=3, temperature=1.0, seed=7))
    inputs = loss_inputs(rollouts_table(result, n=4), actor.tokenizer.pad_token_id)
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
    mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    with torch.no_grad():
        actor_logps, _, _ = actor.objective._get_per_token_logps_and_entropies(
            actor.model, ids, mask, inputs["completion_ids"].size(1)
        )
    completion_mask = inputs["completion_mask"].bool()
    sampled = torch.zeros_like(actor_logps)
    for i, row in enumerate(result.sampling_logprobs):
        sampled[i, : len(row)] = torch.tensor(row)
    return float((actor_logps - sampled)[completion_mask].abs().max())


@pytest.fixture(scope="module")
def trained_actor(model_path):
    """The full-model actor after one optimizer step (policy version 1)."""
    actor = Actor(preset_config("tiny", run_id="sync"), model_path)
    actor.load()
    take_one_step(actor, model_path)
    return actor


@pytest.mark.parametrize("method", ["reload", "volume", "direct", "checkpoint"])
def test_each_method_gives_the_engine_the_new_policy(trained_actor, model_path, tmp_path, method):
    engine = new_engine(model_path)
    assert max_logprob_gap(trained_actor, engine) > DIFFER  # the engine still holds the initial policy

    report = sync_weights(method, trained_actor, [engine], tmp_path / "runs" / "sync")

    assert max_logprob_gap(trained_actor, engine) < MATCH
    assert engine.policy_version == 1
    assert report["method"] == method and report["version"] == 1
    assert report["bytes"] > 0 and report["seconds"] >= report["apply_s"] >= 0


def test_one_export_reaches_every_engine(trained_actor, model_path, tmp_path):
    engines = [new_engine(model_path), new_engine(model_path)]
    report = sync_weights("volume", trained_actor, engines, tmp_path)
    assert all(max_logprob_gap(trained_actor, e) < MATCH for e in engines)
    assert report["bytes"] == 2 * (version_dir(tmp_path, 1) / "model.safetensors").stat().st_size


def test_the_halves_run_apart_as_on_modal(trained_actor, model_path, tmp_path):
    """Export on the actor's side, apply on the engine's: the payload is all that travels."""
    payload = export_weights("direct", trained_actor, tmp_path)
    assert payload.path is None and isinstance(payload.data, bytes) and payload.nbytes == len(payload.data)
    engine = new_engine(model_path)
    report = apply_weights(engine, payload)
    assert report["version"] == 1 and report["bytes"] == payload.nbytes
    assert max_logprob_gap(trained_actor, engine) < MATCH
    assert sync_weights("direct", trained_actor, [new_engine(model_path)], tmp_path)["version"] == 1


def test_volume_writes_a_versioned_folder_atomically_and_once(trained_actor, tmp_path):
    first = export_weights("volume", trained_actor, tmp_path)
    folder = version_dir(tmp_path, 1)
    assert first.path == str(folder / "model.safetensors")
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "model.safetensors", "version.json"]
    assert json.loads((folder / "version.json").read_text()) == {"policy_version": 1}
    mtime = (folder / "model.safetensors").stat().st_mtime_ns
    again = export_weights("volume", trained_actor, tmp_path)  # a retried export reuses the folder
    assert again.path == first.path and (folder / "model.safetensors").stat().st_mtime_ns == mtime
    assert not [p for p in folder.parent.iterdir() if p.name.startswith(".")]  # no staging left behind


def test_checkpoint_is_a_loadable_model_folder(trained_actor, tmp_path):
    payload = export_weights("checkpoint", trained_actor, tmp_path)
    assert payload.path == str(version_dir(tmp_path, 1, "checkpoint"))
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(payload.path)
    actor_state = trained_actor.model.state_dict()
    assert all(torch.equal(v, actor_state[k]) for k, v in model.state_dict().items())


def test_lora_without_an_adapter_is_a_clear_error(trained_actor, model_path, tmp_path):
    with pytest.raises(WeightSyncError, match="weight_sync_method='lora'.*use_lora"):
        sync_weights("lora", trained_actor, [new_engine(model_path)], tmp_path)
    with pytest.raises(WeightSyncError, match="weight_sync_method='lora' needs use_lora=True"):
        check_weight_sync_config(preset_config("tiny", weight_sync_method="lora"))
    check_weight_sync_config(preset_config("tiny", weight_sync_method="volume"))  # fine


def test_unknown_method_is_refused(trained_actor, tmp_path):
    with pytest.raises(WeightSyncError, match="unknown method 'nccl'"):
        export_weights("nccl", trained_actor, tmp_path)
    assert METHODS == ("reload", "volume", "direct", "checkpoint", "lora")


def lora_actor(model_path):
    """The actor training a peft LoRA adapter on its attention projections."""
    actor = Actor(
        preset_config(
            "tiny",
            run_id="lora",
            learning_rate=5e-2,
            use_lora=True,
            lora_r=4,
            lora_alpha=8,
            lora_target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
        ),
        model_path,
    )
    actor.load()
    return actor


def test_lora_sends_only_the_adapter_and_the_engine_follows(model_path, tmp_path):
    pytest.importorskip("peft")
    actor = lora_actor(model_path)
    take_one_step(actor, model_path)
    engine = new_engine(model_path)
    assert max_logprob_gap(actor, engine) > MATCH

    report = sync_weights("lora", actor, [engine], tmp_path)
    assert max_logprob_gap(actor, engine) < MATCH
    folder = version_dir(tmp_path, 1, "lora")
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in folder.iterdir()}
    assert not any(p.name == "model.safetensors" for p in folder.iterdir())
    full_model_bytes = sum(t.numel() * t.element_size() for t in actor.model.get_base_model().state_dict().values())
    assert report["bytes"] < full_model_bytes / 2

    # A second step and sync replaces the adapter's tensors in the already wrapped engine.
    result = engine.generate(prompts(), SamplingParams(n=4, max_tokens=3, temperature=1.0, seed=2))
    actor.step(1, rollouts_table(result, n=4, seed=1))
    assert max_logprob_gap(actor, engine) > MATCH
    sync_weights("lora", actor, [engine], tmp_path)
    assert max_logprob_gap(actor, engine) < MATCH and engine.policy_version == 2


@pytest.mark.parametrize("method", ["checkpoint", "volume", "direct"])
def test_full_weight_methods_send_the_merged_weights_of_a_lora_actor(model_path, tmp_path, method):
    actor = lora_actor(model_path)
    take_one_step(actor, model_path)
    engine = new_engine(model_path)
    assert max_logprob_gap(actor, engine) > MATCH
    sync_weights(method, actor, [engine], tmp_path)
    assert max_logprob_gap(actor, engine) < MATCH


@pytest.mark.parametrize(
    ("overrides", "adapter", "method"),
    [
        ({"use_lora": True}, True, "lora"),  # the default: the engines hold the base model already
        ({"use_lora": True, "lora_publish": "merged"}, False, "reload"),
        ({"use_lora": True, "lora_publish": "merged", "weight_sync_method": "lora"}, True, "lora"),
        ({}, False, "reload"),
    ],
)
def test_a_lora_run_publishes_the_adapter_unless_merged_is_asked_for(model_path, overrides, adapter, method):
    config = preset_config("tiny", **overrides)
    assert (config.publishes_adapter, config.sync_method) == (adapter, method)
    actor = Actor(config, model_path)
    actor.load()
    published = actor.published_weights()
    expected = actor.adapter_state_dict() if adapter else actor.policy_state_dict()
    assert published.keys() == expected.keys()
