"""Reward functions that misbehave on purpose, for tests that run `grpo train` as a real process
(named `fault_rewards:<function>`, with tests/flows on PYTHONPATH)."""

import os
import time
from pathlib import Path


def slow_last_digit(completions, answer, **kwargs):
    """last_digit's score after sleeping $GRPO_TEST_REWARD_SLEEP seconds (none when unset). A sleep is
    a C call Python cannot interrupt: with a large value, a reward that never returns. Each call appends
    a line to $GRPO_TEST_REWARD_CALLS and creates $GRPO_TEST_REWARD_STARTED, when they are set."""
    if os.environ.get("GRPO_TEST_REWARD_CALLS"):
        with open(os.environ["GRPO_TEST_REWARD_CALLS"], "a") as calls:
            calls.write("called\n")
    if os.environ.get("GRPO_TEST_REWARD_STARTED"):
        Path(os.environ["GRPO_TEST_REWARD_STARTED"]).touch()
    time.sleep(float(os.environ.get("GRPO_TEST_REWARD_SLEEP", "0")))
    return [1.0 if c.strip() == a else 0.0 for c, a in zip(completions, answer, strict=True)]


def never_applies(completions, **kwargs):
    """None for every sample: "does not apply" to anything."""
    return [None] * len(completions)


def none_from_step_3(completions, answer, trainer_state, **kwargs):
    """last_digit's score in steps 1 and 2, then None for every sample: from step 3 no function applies
    to any completion, so the step's reward is NaN."""
    if trainer_state.global_step >= 2:  # global_step is the step before this one
        return [None] * len(completions)
    return [1.0 if c.strip() == a else 0.0 for c, a in zip(completions, answer, strict=True)]
