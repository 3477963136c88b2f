"""A run whose groups' rewards all tie says so once (flows/run_loop.py no_signal_warning); the metric it reads,
TRL's `frac_reward_zero_std`, is in the step row and the step's UI artifact."""

from grpo_flow.flows.run_loop import no_signal_warning
from grpo_flow.tasks.observability import step_markdown


def rows(*fractions, first=1):
    return [{"step": first + i, "frac_reward_zero_std": f} for i, f in enumerate(fractions)]


def test_every_group_tied_in_the_first_k_steps_warns_once_at_the_kth():
    tied = rows(1.0, 1.0, 1.0, 1.0)
    said = [no_signal_warning(tied[:n], 3) for n in range(1, 5)]
    assert said[0] is None and said[1] is None and said[3] is None  # once: as the third row comes
    assert said[2] is not None and said[2].startswith("steps 1-3: no learning signal: 0 % of groups had rewards")
    assert "--num-generations" in said[2] and "softer reward" in said[2] and "--temperature" in said[2]
    assert no_signal_warning(rows(1.0, first=7), 1).startswith("step 7: no learning signal")  # a resumed run


def test_one_group_with_signal_or_k_zero_says_nothing():
    assert no_signal_warning(rows(1.0, 0.875, 1.0), 3) is None
    assert no_signal_warning(rows(1.0, 1.0, 1.0), 0) is None
    assert no_signal_warning([{"step": 1}, {"step": 2}, {"step": 3}], 3) is None  # no metric, no claim


def test_the_metric_is_among_the_artifact_s_headline_metrics():
    text = step_markdown("r", 1, {"step": 1, "reward": 0.5, "frac_reward_zero_std": 0.25, "loss": 0.1}, [])
    lines = text.splitlines()
    assert lines.index("| frac_reward_zero_std | 0.25 |") == lines.index("| reward | 0.5 |") + 1
