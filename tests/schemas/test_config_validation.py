"""The config is checked once, at the edge: every bad value is refused with the field's name."""

import pytest
from pydantic import ValidationError

from grpo_flow.schemas.config import GRPOFlowConfig, describe_validation_error
from grpo_flow.schemas.presets import PRESETS, preset_config


def problems(**fields) -> str:
    with pytest.raises(ValidationError) as caught:
        GRPOFlowConfig(**fields)
    return describe_validation_error(caught.value)


@pytest.mark.parametrize(
    "fields, expected",
    [
        ({"loss_type": "ppo"}, "loss_type: Input should be 'grpo', 'dapo'"),
        ({"beta": -0.1}, "beta: Input should be greater than or equal to 0"),
        ({"num_generations": 1}, "num_generations: Input should be greater than or equal to 2"),
        ({"learning_rate": 0}, "learning_rate: Input should be greater than 0"),
        ({"top_p": 1.5}, "top_p: Input should be less than or equal to 1"),
        ({"run_id": "../escape"}, "run_id: '../escape' is not a run id (1 to 128 letters, digits"),
        ({"scale_rewards": "std"}, "scale_rewards: Input should be 'group', 'batch' or 'none'"),
        ({"max_steps": "abc"}, "max_steps: Input should be a valid integer"),
        ({"no_such_field": 1}, "no_such_field: not a grpo-flow option (see GRPOFlowConfig)"),
        ({"num_generation": 4}, "num_generation: not a grpo-flow option (did you mean num_generations?)"),
        ({"per_device_train_batch_size": 8}, "per_device_train_batch_size: not a grpo-flow option (a step takes"),
        ({"reward_weights": [float("nan")]}, "reward_weights.0: Input should be a finite number"),
        ({"learning_rate": float("inf")}, "learning_rate: Input should be a finite number"),
        (
            {"prompts_per_step": 6, "num_rollout_workers": 4},
            "prompts_per_step/num_rollout_workers: prompts_per_step (6) must split into whole groups across "
            "num_rollout_workers (4)",
        ),
        ({"epsilon": 0.3, "epsilon_high": 0.2}, "epsilon_high/epsilon: epsilon_high (0.2) must be >= epsilon (0.3)"),
        ({"max_steps": 0}, "max_steps: max_steps (0) must be a positive number of steps, or -1"),
        (
            {"reward_funcs": ["last_digit"], "reward_weights": [1.0, 2.0]},
            "reward_weights/reward_funcs: reward_weights has 2 values but reward_funcs has 1 functions",
        ),
        ({"backend": "modal", "modal_rollout_gpu": "Z80"}, "modal_rollout_gpu: unknown Modal GPU type 'Z80'"),
        (
            {"backend": "ray", "rollout_engine": "vllm", "vllm_mode": "colocate"},
            "vllm_mode/backend: vllm_mode 'colocate' needs the local backend: on Ray each rollout engine is a Ray "
            "actor of its own",
        ),
        (
            {"actor_num_processes": 2, "rollout_engine": "vllm", "device": "cuda"},
            "actor_num_processes/vllm_mode/device: vllm_mode 'colocate' on CUDA GPUs would put the vLLM engines on "
            "GPU 0, beside rank 0 of the actor's 2 FSDP ranks; use vllm_mode 'server' (the engines on GPUs 2 "
            "onward) or actor_num_processes 1",
        ),
    ],
)
def test_bad_values_are_refused_naming_the_field(fields, expected):
    assert problems(**fields).startswith(expected)


def test_vllm_engines_on_ray_are_accepted_each_on_its_own_device():
    """The Ray backend runs vLLM engines (it refused them before), one per Ray actor: vllm_mode 'server'."""
    config = GRPOFlowConfig(backend="ray", rollout_engine="vllm")
    assert config.resolved_vllm_mode == "server"
    assert GRPOFlowConfig(rollout_engine="vllm").resolved_vllm_mode == "colocate"  # the local backend's default


def test_vllm_engines_with_an_actor_of_several_ranks_are_accepted_where_they_have_a_device_of_their_own():
    """Colocated on the CPU an engine process only shares the cores with the ranks; in server mode each engine has
    a GPU past the ranks'. Colocated on a CUDA GPU is refused (above)."""
    for fields in ({"device": "cpu"}, {"device": "cuda", "vllm_mode": "server"}, {"backend": "ray"}):
        config = GRPOFlowConfig(actor_num_processes=2, rollout_engine="vllm", **fields)
        assert config.colocates_vllm_with_ranks == (config.resolved_vllm_mode == "colocate")


def test_defaults_are_trl_defaults_where_trl_has_the_option():
    from trl import GRPOConfig

    ours, theirs = GRPOFlowConfig(), GRPOConfig(output_dir="unused", use_cpu=True)
    for name in (
        "learning_rate",
        "num_generations",
        "loss_type",
        "beta",
        "epsilon",
        "epsilon_high",
        "scale_rewards",
        "temperature",
        "top_p",
        "max_grad_norm",
    ):
        assert getattr(ours, name) == getattr(theirs, name), name


def test_every_preset_is_valid_and_overridable():
    for name in PRESETS:
        assert preset_config(name).model == PRESETS[name]["model"]
    assert preset_config("tiny", max_steps=3).max_steps == 3
    with pytest.raises(KeyError, match="known presets: gsm8k, math, mbpp, reverse, smol-math, tiny"):
        preset_config("huge")


def test_training_hash_follows_training_fields_only():
    base = GRPOFlowConfig()
    assert base.training_hash() == GRPOFlowConfig(run_id="x", max_steps=7, storage_root="/else").training_hash()
    assert base.training_hash() != GRPOFlowConfig(learning_rate=2e-6).training_hash()


def test_total_steps_follows_trl_rule():
    assert GRPOFlowConfig(max_steps=5).total_steps(1000) == 5
    assert GRPOFlowConfig(max_steps=-1, num_train_epochs=2, prompts_per_step=8).total_steps(100) == 25
