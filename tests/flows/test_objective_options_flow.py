"""The objective's options in a real run: LoRA publishing its adapter, several optimizer steps per
batch, micro-batches, and a checkpoint that resumes."""

from pathlib import Path

from grpo_flow.flows.grpo import grpo
from grpo_flow.schemas.presets import preset_config
from grpo_flow.workers.data.models import resolve_model_path
from grpo_flow.workers.state.storage import RunStorage


def test_a_lora_run_publishes_the_adapter_and_logs_its_size(prefect_server, storage_root):
    config = preset_config(
        "tiny",
        run_id="lora-adapter",
        storage_root=str(storage_root),
        max_steps=2,
        save_steps=1,
        prompts_per_step=4,
        num_generations=4,
        eval_prompts=0,
        use_lora=True,
        lora_r=4,
        lora_publish="adapter",
        num_iterations=2,
        max_tokens_per_microbatch=64,
    )
    assert grpo(config)["status"] == "completed"
    storage = RunStorage(storage_root, config.run_id)
    rows = storage.read_metrics().to_pylist()
    assert [r["step"] for r in rows] == [1, 2]
    model_bytes = (Path(resolve_model_path("tiny", storage_root)) / "model.safetensors").stat().st_size
    for row in rows:
        assert 0 < row["sync/bytes"] < model_bytes / 10  # the adapter, not the model
        assert row["actor/micro_batches"] > 1
    assert (storage.checkpoint_dir(2) / "adapter" / "adapter_model.safetensors").exists()
    assert len(storage.read_rollouts(step=2)) == 16
