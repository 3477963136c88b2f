"""benchmarks/vs_trl.py's shape options (`--max-completion-length`, `--prompts-per-step`, `--num-generations`):
they reach both sides alike, the defaults keep the work's own shape, and a bad value is refused before anything
loads. The real-model smoke run (test_real_model_benchmarks.py) checks the shape in what each side did, and
grpo-flow's actor time broken down. No timings are asserted."""

from __future__ import annotations

import argparse

import pytest

from benchmarks import vs_trl
from benchmarks.learning import SHARED_FIELDS
from grpo_flow.workers.actor.actor import ACTOR_PHASES

SHAPE = ("--max-completion-length", "12", "--prompts-per-step", "2", "--num-generations", "3")


def parsed(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    vs_trl.options(parser)
    return parser.parse_args(list(argv))


def test_the_shape_options_reach_both_sides_of_the_real_model_work(tmp_path):
    shaped = vs_trl.shape(parsed("--model", "smollm2-135m", "--max-completion-length", "128", "--num-generations", "4"))
    assert shaped == {"max_completion_length": 128, "num_generations": 4}
    spec = vs_trl.real_spec(2, shaped)  # TRL's side
    config = vs_trl.real_config("model", 2, tmp_path, "vllm", shaped)  # grpo-flow's side
    assert spec["fields"] == {k: v for k, v in config.model_dump().items() if k in SHARED_FIELDS} | {"seed": 7}
    assert config.max_completion_length == 128 and config.num_generations == 4 and config.prompts_per_step == 4
    assert len(spec["order"]) == 2 * config.prompts_per_step  # the prompts of both steps, in the run's order
    colocate = vs_trl.real_colocate(spec)  # TRL's colocated vLLM holds the preset's prompt and the longer completion
    assert colocate["vllm_max_model_length"] == config.max_prompt_length + 128


def test_without_shape_options_each_work_keeps_its_own_shape(tmp_path):
    args = parsed()
    assert vs_trl.shape(args) == {}
    assert vs_trl.tiny_spec()["fields"] == vs_trl.WORK
    config = vs_trl.tiny_config("model", 3, tmp_path, work=vs_trl.WORK | vs_trl.shape(args))
    assert (config.max_completion_length, config.prompts_per_step, config.num_generations) == (8, 8, 8)
    preset = vs_trl.real_config("model", 2, tmp_path, "transformers", vs_trl.shape(args))
    assert (preset.max_completion_length, preset.prompts_per_step, preset.num_generations) == (16, 4, 8)


def test_the_vllm_variants_sample_in_bf16_or_one_step_off_and_nothing_else(tmp_path):
    plain, bf16, one_off = (
        vs_trl.real_config("model", 2, tmp_path, "vllm", {}, side).model_dump()
        for side in ("grpo_flow_vllm", "grpo_flow_vllm_bf16", "grpo_flow_vllm_async")
    )
    assert bf16.pop("vllm_dtype") == "bfloat16" and plain.pop("vllm_dtype") in (None, "float32")
    assert not bf16["bf16"] and bf16["vllm_importance_sampling_correction"] is True  # the actor stays fp32
    assert one_off.pop("max_staleness") == 1 and plain.pop("max_staleness") == bf16.pop("max_staleness") == 0
    runs = {d.pop("run_id") for d in (plain, bf16, one_off)}
    assert len(runs) == 3  # each side a run of its own
    one_off.pop("vllm_dtype")
    assert plain == bf16 == one_off


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--num-generations", "1"], "--num-generations: must be at least 2, got 1"),
        (["--prompts-per-step", "0"], "--prompts-per-step: must be at least 1, got 0"),
        (["--max-completion-length", "57"], "--max-completion-length: at most 56 with --model random-qwen2"),
    ],
)
def test_a_bad_shape_is_refused_before_anything_loads(argv, message, capsys):
    with pytest.raises(SystemExit) as stopped:
        vs_trl.main(argv)
    assert stopped.value.code == 2
    assert message in capsys.readouterr().err


def test_the_actor_breakdown_reads_every_phase_the_actor_logs():
    assert sorted(vs_trl.ACTOR_PHASE_COLUMNS.values()) == sorted(f"actor/{phase}_s" for phase in ACTOR_PHASES)


def test_the_report_holds_each_shape_to_its_own_target():
    assert vs_trl.targets({"max_completion_length": 16}) == {"transformers": 1.0, "vllm": 1.0}
    assert vs_trl.targets({"max_completion_length": 128}) == {"vllm": 0.8}


def test_the_report_prints_a_target_only_for_the_sides_the_shape_has_one_for(capsys):
    work = {"prompts_per_step": 4, "num_generations": 8, "max_completion_length": 128, "learning_rate": 5e-4}
    work |= {"loss_type": "dapo", "seed": 7}
    result = {"work": work, "sides": {}, "steps": 6, "trl_generation": "transformers generate"}
    result |= {"same_prompts_every_step": True, "config_differences": []}
    for key, ratio in (("transformers", 0.87), ("vllm", 0.92)):
        result |= {f"ratio_{key}": ratio, f"generate_tokens_per_s_ratio_{key}": 1.0}
    vs_trl.print_real_report(result)
    lines = capsys.readouterr().out.splitlines()
    assert any(line.startswith("grpo-flow, transformers / ") and "target" not in line for line in lines)
    assert any(line.startswith("grpo-flow, vLLM / ") and "(target <= 0.8: NOT met)" in line for line in lines)
