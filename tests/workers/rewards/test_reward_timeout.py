"""reward_timeout_s: a reward call past its deadline fails the step naming the function and the step, and
the process it ran in is killed, whatever the call was doing (a Python loop that swallows exceptions, an
await, a call blocked in C); within the deadline it scores and logs as without one."""

import asyncio
import multiprocessing
import os
import threading
import time

import pytest

from grpo_flow.workers.rewards.environments import RewardEnvironment, as_reward_function
from grpo_flow.workers.rewards.functions import RewardFunctionError, RewardTimeoutError, score_batch

from test_rewards_scoring import batch


def wait_for(condition, seconds=10.0):
    """Poll until `condition()` holds (a liveness bound, not a timing assertion)."""
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.05)
    return condition()


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def killed_past_the_deadline(name, func, tmp_path):
    """Score with `func`, which writes its pid to `tmp_path / "pid"` and never returns: the step fails naming
    it, and its process is gone."""
    said = rf"'{name}' did not return within reward_timeout_s=0.3 s on step 1 \(1 completions\); its process was killed"
    with pytest.raises(RewardTimeoutError, match=said):
        score_batch(batch(["0"], ["0"]), {name: func}, None, timeout_s=0.3)
    pid = int((tmp_path / "pid").read_text())
    assert pid != os.getpid() and not alive(pid)
    assert not multiprocessing.active_children()


def test_a_python_loop_that_swallows_every_exception_is_killed(tmp_path):
    def retries_forever(completions, **kwargs):
        (tmp_path / "pid").write_text(str(os.getpid()))
        while True:
            try:
                time.sleep(0.01)
            except BaseException:  # nothing raised inside the call can stop it
                pass

    killed_past_the_deadline("retries_forever", retries_forever, tmp_path)


def test_a_call_blocked_in_c_is_killed(tmp_path):
    def blocked(completions, **kwargs):
        (tmp_path / "pid").write_text(str(os.getpid()))
        threading.Event().wait()  # a lock wait: Python cannot interrupt it
        return [0.0] * len(completions)

    killed_past_the_deadline("blocked", blocked, tmp_path)


@pytest.mark.parametrize("kind", ["function", "environment"])
def test_an_async_function_or_environment_is_killed(tmp_path, kind):
    async def waits(completions, **kwargs):
        (tmp_path / "pid").write_text(str(os.getpid()))
        await asyncio.sleep(3600)

    class SlowJudge(RewardEnvironment):
        async def score(self, completion, prompt, **columns):
            return await waits([completion])

    func = waits if kind == "function" else as_reward_function(SlowJudge(), "waits")
    killed_past_the_deadline("waits", func, tmp_path)


def test_a_failure_in_the_calls_process_names_the_sample_with_its_traceback():
    def fails_on_one(completions, **kwargs):
        if "1" in completions:
            raise ValueError("cannot score '1'")
        return [0.0] * len(completions)

    with pytest.raises(RewardFunctionError, match=r"'fails_on_one' raised on sample 1 .* ValueError: cannot") as info:
        score_batch(batch(["0", "1"], ["0", "0"]), {"fails_on_one": fails_on_one}, None, timeout_s=30)
    assert 'raise ValueError("cannot score' in str(info.value)  # the line in the call's own process


def test_a_call_whose_process_dies_fails_the_step():
    def exits(completions, **kwargs):
        os._exit(3)

    with pytest.raises(RewardFunctionError, match=r"ended without an answer \(exit status 3\)"):
        score_batch(batch(["0"], ["0"]), {"exits": exits}, None, timeout_s=30)


def test_within_the_timeout_scores_and_logs_are_as_without_one():
    def quick(completions, answer, log_metric, log_extra, **kwargs):
        log_metric("seen", len(completions))
        log_extra("verdict", ("right" if c == a else "wrong" for c, a in zip(completions, answer, strict=True)))
        return [1.0 if c == a else 0.0 for c, a in zip(completions, answer, strict=True)]

    timed = score_batch(batch(["0", "1"], ["0", "0"]), {"quick": quick}, None, timeout_s=30)
    untimed = score_batch(batch(["0", "1"], ["0", "0"]), {"quick": quick}, None)
    assert timed.rewards == untimed.rewards == {"quick": [1.0, 0.0]}
    assert timed.logged_metrics == untimed.logged_metrics == {"seen": [2.0]}
    assert timed.logged_extra == untimed.logged_extra and '"right"' in timed.logged_extra[0]


def test_a_timeout_is_not_retried():
    from prefect.states import Failed

    from grpo_flow.tasks.rollout import worth_retrying

    assert not worth_retrying(None, None, Failed(data=RewardTimeoutError("slow")))
    assert worth_retrying(None, None, Failed(data=ValueError("transient")))
