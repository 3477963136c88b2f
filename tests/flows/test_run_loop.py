"""flows/run_loop.py's progress: a bar on a terminal, plain lines on a file or pipe."""

import io

from grpo_flow.flows.run_loop import StepProgress
from grpo_flow.schemas.records import RunPlan


def plan(first_step=1, total_steps=20):
    return RunPlan(
        run_id="progress",
        storage_root="/nowhere",
        model_path="tiny",
        total_steps=total_steps,
        reward_names=("last_digit",),
        extra_columns=(),
        num_train_prompts=10,
        first_step=first_step,
    )


def row(step):
    return {"step": step, "reward": 0.5, "loss": 0.01}


def shown(progress, steps):
    for step in steps:
        progress.update(step, row(step))
    progress.close()


def test_a_file_or_pipe_gets_a_line_every_few_steps_and_no_carriage_returns():
    stream = io.StringIO()
    shown(StepProgress(plan(), show=True, stream=stream), range(1, 21))
    lines = stream.getvalue().splitlines()
    assert "\r" not in stream.getvalue()
    assert [line.split()[2] for line in lines] == [f"{s}/20" for s in (2, 4, 6, 8, 10, 12, 14, 16, 18, 20)]
    assert lines[-1].startswith("progress: step 20/20  reward 0.500  loss 0.0100")


def test_every_n_steps_as_configured_and_always_the_last_one_of_a_resumed_run():
    stream = io.StringIO()
    shown(StepProgress(plan(first_step=8, total_steps=12), show=True, every=3, stream=stream), range(8, 13))
    assert [line.split()[2] for line in stream.getvalue().splitlines()] == ["10/12", "12/12"]


def test_a_terminal_gets_a_bar_and_no_progress_asked_for_prints_nothing():
    terminal = io.StringIO()
    shown(StepProgress(plan(total_steps=3), show=True, stream=terminal, terminal=True), range(1, 4))
    assert "\r" in terminal.getvalue() and "3/3" in terminal.getvalue()
    quiet = io.StringIO()
    shown(StepProgress(plan(total_steps=3), show=False, stream=quiet, terminal=False), range(1, 4))
    assert quiet.getvalue() == ""
