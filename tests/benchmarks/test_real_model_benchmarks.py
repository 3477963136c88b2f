"""The benchmarks' real-model options (`--model smollm2-135m`, task `smol_math`) on a step or two: TRL and
grpo-flow run the same work (the same prompts at every step, no GRPOConfig option apart, TRL given the
preset's LoRA), and the options are checked before anything loads. No timings are asserted."""

from __future__ import annotations

import json

import pytest

from benchmarks import engines, memory, vs_trl


@pytest.mark.real_model
@pytest.mark.slow
def test_vs_trl_runs_trl_and_grpo_flow_on_the_smol_math_work(prefect_server, storage_root, smollm2_path, tmp_path):
    """At a smaller shape than the work's own (the shape options reach both sides alike), one step."""
    out = tmp_path / "vs_trl.json"
    argv = ["--model", "smollm2-135m", "--steps", "1", "--sides", "trl", "grpo_flow"]
    argv += ["--prompts-per-step", "2", "--num-generations", "2", "--max-completion-length", "8"]
    vs_trl.main([*argv, "--storage-root", str(storage_root), "--json", str(out)])
    result = json.loads(out.read_text())
    assert result["same_prompts_every_step"] is True and result["config_differences"] == {}
    assert result["work"]["prompts_per_step"] == 2 and result["work"]["num_generations"] == 2
    assert set(result["sides"]) == {"trl", "grpo_flow"}
    for name, side in result["sides"].items():
        assert side["steps"] == 1 and 0 < side["tokens_per_step"] <= 2 * 2 * 8
        assert side["prompts_per_step"] == [2] and side["completions_per_step"] == [4], name
        assert 0 < side["longest_completion"] <= 8, name
        assert side["generate_s"] > 0 and side["generate_tokens_per_s"] > 0
        assert 0 < side["generate_share"] < 1 and 0 < side["train_share"] < 1
        assert side["generate_share"] + side["train_share"] <= 1
    breakdown = result["sides"]["grpo_flow"]["actor_phases"]  # the actor's step broken down, for grpo-flow's side
    assert all(seconds >= 0 for seconds in breakdown.values()) and breakdown["loss forward and backward"] > 0
    assert result["ratio_transformers"] > 0 and "ratio_vllm" not in result


def test_vs_trl_refuses_an_unknown_side_or_no_steps_before_loading(capsys):
    with pytest.raises(SystemExit) as stopped:
        vs_trl.main(["--model", "smollm2-135m", "--sides", "trl", "verl"])
    assert stopped.value.code == 2
    assert "--sides: unknown side 'verl'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        vs_trl.main(["--model", "smollm2-135m", "--steps", "0"])
    assert "--steps: must be at least 1" in capsys.readouterr().err


def test_engines_refuses_a_completion_length_the_real_model_run_does_not_hold(capsys):
    with pytest.raises(SystemExit) as stopped:
        engines.main(["--model", "smollm2-135m", "--max-tokens", "1000"])
    assert stopped.value.code == 2
    assert "--max-tokens: 1 to 512" in capsys.readouterr().err


def test_memory_knows_the_real_model_and_refuses_others(capsys):
    with pytest.raises(SystemExit) as stopped:
        memory.main(["--models", "tiny,llama-7b"])
    assert stopped.value.code == 2
    assert "smollm2-135m" in capsys.readouterr().err


@pytest.mark.real_model
def test_memory_measures_the_smol_math_step_shape(smollm2_path):
    """4 prompts x 8 completions of 16 tokens, after smol_math's longest chat-rendered prompt."""
    rows, prompt_tokens, completion_tokens = memory.real_model_shape(str(smollm2_path))
    assert rows == 32 and completion_tokens == 16
    assert 40 < prompt_tokens <= 128  # the system prompt and the question, within the preset's limit
