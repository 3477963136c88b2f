"""reward_timeout_s: a reward call past its deadline fails the step naming the function and the step,
and the thread it ran on is stopped (Python code), cancelled (async) or left as a daemon (a C call)."""

import asyncio
import threading
import time

import pytest

from grpo_flow.workers.rewards.environments import RewardEnvironment, as_reward_function
from grpo_flow.workers.rewards.functions import RewardTimeoutError, score_batch

from test_rewards_scoring import batch


def reward_threads():
    return [t for t in threading.enumerate() if t.name == "grpo-flow-reward"]


def wait_for(condition, seconds=10.0):
    """Poll until `condition()` holds (a liveness bound, not a timing assertion)."""
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.05)
    return condition()


def test_a_python_loop_past_the_timeout_is_stopped_and_its_thread_ends():
    def spins(completions, **kwargs):
        while True:  # pure Python: the exception sent to the thread lands at the next instruction
            pass

    with pytest.raises(RewardTimeoutError, match=r"'spins' did not return within reward_timeout_s=0.3 s on step 1"):
        score_batch(batch(["0", "1"], ["0", "0"]), {"spins": spins}, None, timeout_s=0.3)
    assert wait_for(lambda: not reward_threads())


def test_an_except_exception_loop_cannot_swallow_the_stop():
    def retries_forever(completions, **kwargs):
        while True:
            try:
                time.sleep(0.01)
            except Exception:  # the stop is a BaseException: not caught here
                pass

    with pytest.raises(RewardTimeoutError, match="its thread was stopped"):
        score_batch(batch(["0"], ["0"]), {"retries_forever": retries_forever}, None, timeout_s=0.3)
    assert wait_for(lambda: not reward_threads())


def test_an_async_function_and_an_async_environment_are_cancelled():
    cancelled = []

    async def waits(completions, **kwargs):
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            cancelled.append("function")
            raise

    class SlowJudge(RewardEnvironment):
        async def score(self, completion, prompt, **columns):
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                cancelled.append("environment")
                raise

    for name, func in (("waits", waits), ("slow_judge", as_reward_function(SlowJudge(), "slow_judge"))):
        with pytest.raises(RewardTimeoutError, match=rf"'{name}' did not return .* it was cancelled"):
            score_batch(batch(["0"], ["0"]), {name: func}, None, timeout_s=0.3)
    assert cancelled == ["function", "environment"]
    assert wait_for(lambda: not reward_threads())


def test_a_call_blocked_in_c_is_named_and_left_on_a_daemon_thread():
    release = threading.Event()

    def blocked(completions, **kwargs):
        release.wait()  # a lock wait: Python cannot interrupt it
        return [0.0] * len(completions)

    with pytest.raises(RewardTimeoutError, match="left running as a daemon thread"):
        score_batch(batch(["0"], ["0"]), {"blocked": blocked}, None, timeout_s=0.3)
    left = reward_threads()
    assert len(left) == 1 and left[0].daemon  # daemon: it cannot keep the process alive
    release.set()
    assert wait_for(lambda: not reward_threads())


def test_within_the_timeout_scores_are_as_without_one():
    def quick(completions, answer, log_metric, **kwargs):
        log_metric("seen", len(completions))
        return [1.0 if c == a else 0.0 for c, a in zip(completions, answer, strict=True)]

    timed = score_batch(batch(["0", "1"], ["0", "0"]), {"quick": quick}, None, timeout_s=30)
    untimed = score_batch(batch(["0", "1"], ["0", "0"]), {"quick": quick}, None)
    assert timed.rewards == untimed.rewards == {"quick": [1.0, 0.0]}
    assert timed.logged_metrics == {"seen": [2.0]}


def test_a_timeout_is_not_retried():
    from prefect.states import Failed

    from grpo_flow.tasks.rollout import worth_retrying

    assert not worth_retrying(None, None, Failed(data=RewardTimeoutError("slow")))
    assert worth_retrying(None, None, Failed(data=ValueError("transient")))
