"""benchmarks/learning.py's plumbing on a few steps: both sides run, train on the same prompts, are
scored by the same held-out code, and the JSON (merged across invocations) and PNG are written.
No learning and no time is asserted: figures come from running the benchmark."""

import json

import pytest

from benchmarks.learning import eval_steps, main

KEYS = {"trl_gain", "grpo_flow_gain", "trl_final", "grpo_flow_final", "trl_wall_s", "grpo_flow_wall_s"}


@pytest.mark.slow
def test_learning_benchmark_writes_both_sides_figures_and_the_plot(prefect_server, storage_root, tmp_path):
    out, png = tmp_path / "learning.json", tmp_path / "learning.png"
    out.write_text(json.dumps({"another_task": {"kept": True}}))
    common = ["--tasks", "last_digit", "--steps", "2", "--eval-every", "1", "--eval-prompts", "8"]
    common += ["--storage-root", str(storage_root), "--json", str(out), "--png", str(png)]
    main([*common, "--seeds", "1"])
    # A second invocation: its seed joins the first's, with TRL's sampling control beside TRL.
    main([*common, "--seeds", "1", "--first-seed", "1", "--sides", "trl", "trl_resampled"])

    written = json.loads(out.read_text())
    assert written["another_task"] == {"kept": True}
    result = written["last_digit"]
    assert KEYS | {f"{k}_sd" for k in KEYS} <= set(result)
    assert result["seeds"] == [0, 1] and result["trl_final_sd"] >= 0
    assert result["same_prompts_every_step"] is True
    assert result["config_differences"] == {}
    assert [run["sampling_seed"] for run in result["runs"]["trl_resampled"]] == [1001]
    assert {"trl_vs_grpo_flow_final_gap", "trl_vs_trl_resampled_final_gap"} <= set(result)
    assert {side: [run["seed"] for run in runs] for side, runs in result["runs"].items()} == {
        "trl": [0, 1],
        "grpo_flow": [0],
        "trl_resampled": [1],
    }
    for side in ("trl", "grpo_flow", "trl_resampled"):
        for run in result["runs"][side]:
            assert [point[0] for point in run["curve"]] == [0, 1, 2]
            assert run["curve"][0][2] == result["start_accuracy"]  # one start model, scored once
            assert len(run["train_reward"]) == 2 and run["wall_s"] > 0
        assert result[f"{side}_gain"] == pytest.approx(result[f"{side}_final"] - result["start_accuracy"])
    assert png.stat().st_size > 10_000


@pytest.mark.slow
def test_the_tool_task_runs_trl_with_the_same_environment_and_prompts(prefect_server, storage_root, tmp_path):
    """digit_lookup: TRL's GRPOTrainer gets the preset's environment_factory and turn limit; both sides train
    on the same prompts (compared by prompt_id) and are scored by the same greedy episodes."""
    out = tmp_path / "tools.json"
    main(["--tasks", "digit_lookup", "--steps", "2", "--eval-every", "1", "--eval-prompts", "8", "--seeds", "1"]
         + ["--storage-root", str(storage_root), "--json", str(out)])  # fmt: skip
    result = json.loads(out.read_text())["digit_lookup"]
    assert result["preset"] == "tiny-tools" and result["same_prompts_every_step"] is True
    assert result["config_differences"] == {}  # max_tool_calling_iterations included
    for side in ("trl", "grpo_flow"):
        (run,) = result["runs"][side]
        assert [point[0] for point in run["curve"]] == [0, 1, 2] and len(run["train_reward"]) == 2


def test_learning_benchmark_refuses_bad_options_before_loading_anything(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["--tasks", "gsm8k"])
    assert exited.value.code == 2
    assert "--tasks: unknown task 'gsm8k'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--seeds", "0"])
    assert "--seeds: must be at least 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--sides", "trl", "verl"])
    assert "--sides: unknown side 'verl'" in capsys.readouterr().err


def test_evaluation_steps_end_with_the_last_step():
    assert eval_steps(60, 5) == list(range(5, 61, 5))
    assert eval_steps(7, 3) == [3, 6, 7]
