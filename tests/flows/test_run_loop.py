"""flows/run_loop.py's progress: a bar on a terminal, plain lines on a file or pipe."""

import io

from grpo_flow.flows.run_loop import StepProgress, duration_text
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


def test_a_duration_reads_in_seconds_minutes_or_hours():
    assert [duration_text(s) for s in (0, 42.4, 59.6, 185, 3599, 7620, 90000)] == [
        "0 s",
        "42 s",
        "1 min 00 s",
        "3 min 05 s",
        "59 min 59 s",
        "2 h 07 min",
        "25 h 00 min",
    ]


def test_the_eta_is_the_steps_left_times_the_mean_of_the_recent_steps():
    """Ten slow steps (the first ones compile, warm caches), then 2 s steps: the ETA follows the recent ones."""
    times = iter([0.0, *(10.0 * s for s in range(1, 11)), *(100.0 + 2.0 * s for s in range(1, 11))])
    stream = io.StringIO()
    progress = StepProgress(plan(), show=True, every=5, stream=stream, clock=lambda: next(times))
    shown(progress, range(1, 21))
    lines = stream.getvalue().splitlines()
    assert lines[0].endswith("10.00 s/step  ETA 2 min 30 s")  # step 5: 15 steps left x 10 s
    assert lines[2].endswith("2.00 s/step  ETA 10 s")  # step 15: 5 left x the last 5 steps' 2 s
    assert lines[3].endswith("2.00 s/step")  # the last step: nothing left
