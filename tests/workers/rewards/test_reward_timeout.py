"""reward_timeout_s: each reward runs in a long-lived process of its own (workers/rewards/deadline.py), where it keeps
its state; past its deadline that process is killed, whatever the call is doing, the step fails naming the
function and the step, and the next call starts a fresh process."""

import asyncio
import os
import threading
import time

import pytest

from grpo_flow.workers.rewards.environments import RewardEnvironment, as_reward_function
from grpo_flow.workers.rewards.functions import (
    RewardFunctionError,
    RewardRefusedError,
    RewardTimeoutError,
    score_batch,
)

from test_rewards_scoring import batch


def spins(completions, **kwargs):
    while True:  # pure Python
        pass


def swallows_everything(completions, **kwargs):
    while True:
        try:
            time.sleep(0.01)
        except BaseException:  # noqa: S110  (what no exception sent into a thread could get past)
            pass


def blocked_in_c(completions, **kwargs):
    threading.Event().wait()  # a lock wait, which Python cannot interrupt
    return [0.0] * len(completions)


async def waits(completions, **kwargs):
    await asyncio.sleep(3600)


class SlowJudge(RewardEnvironment):
    async def score(self, completion, prompt, **columns):
        await asyncio.sleep(3600)


def process_is_gone(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.mark.parametrize(
    "name, func",
    [
        ("spins", spins),
        ("swallows_everything", swallows_everything),
        ("blocked_in_c", blocked_in_c),
        ("waits", waits),
        ("slow_judge", as_reward_function(SlowJudge(), "slow_judge")),
    ],
)
def test_a_call_past_the_timeout_is_killed_with_its_process(name, func, tmp_path):
    pid_file = tmp_path / "pid"

    def records_its_process(**kwargs):
        pid_file.write_text(str(os.getpid()))
        return func(**kwargs)

    with pytest.raises(
        RewardTimeoutError, match=rf"'{name}' did not return within reward_timeout_s=0.3 s on step 1 .* was killed"
    ):
        score_batch(batch(["0", "1"], ["0", "0"]), {name: records_its_process}, None, timeout_s=0.3)
    pid = int(pid_file.read_text())
    assert pid != os.getpid()
    assert process_is_gone(pid)  # killed and reaped: nothing left behind


def test_a_reward_blocked_in_c_fails_its_step_and_the_next_call_runs_in_a_fresh_process():
    def sleeps_once(completions, **kwargs):
        if completions[0] == "hang":
            time.sleep(3600)  # in C: only a kill ends it
        return [float(os.getpid())] * len(completions)

    funcs = {"sleeps_once": sleeps_once}
    first = score_batch(batch(["0"], ["0"]), funcs, None, timeout_s=30).rewards["sleeps_once"][0]
    with pytest.raises(RewardTimeoutError, match=r"'sleeps_once' did not return within reward_timeout_s=1 s on step 1"):
        score_batch(batch(["hang"], ["0"]), funcs, None, timeout_s=1)
    after = score_batch(batch(["0"], ["0"]), funcs, None, timeout_s=30).rewards["sleeps_once"][0]
    assert after not in (first, float(os.getpid()))  # a new process, not this one
    assert process_is_gone(int(first))


class Counter:
    """A stateful reward: it counts its calls in its own attribute."""

    def __init__(self):
        self.calls = 0

    def __call__(self, completions, **kwargs):
        self.calls += 1
        return [float(self.calls)] * len(completions)


def test_a_stateful_reward_keeps_its_state_from_call_to_call():
    funcs = {"counter": Counter()}
    counts = [score_batch(batch(["0"], ["0"]), funcs, None, timeout_s=30).rewards["counter"][0] for _ in range(3)]
    assert counts == [1.0, 2.0, 3.0]
    assert funcs["counter"].calls == 0  # counted in its process, not in this one


class Scale:
    def __init__(self, factor):
        self.factor = factor

    def score(self, completions, **kwargs):
        return [self.factor] * len(completions)


def test_methods_of_two_instances_are_two_rewards_each_in_its_own_process():
    funcs = {"once": Scale(1.0).score, "twice": Scale(2.0).score}  # one function, two instances
    for _ in range(2):
        scored = score_batch(batch(["0"], ["0"]), funcs, None, timeout_s=30)
        assert scored.rewards == {"once": [1.0], "twice": [2.0]}


def test_a_reward_that_cannot_be_sent_to_its_process_is_refused_in_one_line():
    lock = threading.Lock()

    def holds_a_lock(completions, **kwargs):
        with lock:
            return [0.0] * len(completions)

    with pytest.raises(RewardRefusedError) as refused:
        score_batch(batch(["0"], ["0"]), {"holds_a_lock": holds_a_lock}, None, timeout_s=30)
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith("reward function 'holds_a_lock' cannot be sent to the process")
    assert "cannot pickle '_thread.lock' object" in message
    assert message.endswith("reward_timeout_s=None runs it in the flow's process")
    untimed = score_batch(batch(["0"], ["0"]), {"holds_a_lock": holds_a_lock}, None)
    assert untimed.rewards == {"holds_a_lock": [0.0]}  # in this process, as TRL calls it


def test_within_the_timeout_scores_and_logs_are_as_without_one():
    expected = {"0": 1.0}  # a closure over a local: sent by value

    def quick(completions, answer, log_metric, log_extra, **kwargs):
        log_metric("seen", len(completions))
        log_extra("pid", [os.getpid()] * len(completions))
        return (expected.get(c, 0.0) for c in completions)  # a generator: made a list before it comes back

    timed = score_batch(batch(["0", "1"], ["0", "0"]), {"quick": quick}, None, timeout_s=30)
    untimed = score_batch(batch(["0", "1"], ["0", "0"]), {"quick": quick}, None)
    assert timed.rewards == untimed.rewards == {"quick": [1.0, 0.0]}
    assert timed.logged_metrics == untimed.logged_metrics == {"seen": [2.0]}
    assert f'"pid": {os.getpid()}' not in timed.logged_extra[0]  # it ran in another process...
    assert f'"pid": {os.getpid()}' in untimed.logged_extra[0]


def test_an_error_in_the_process_names_the_sample_with_its_traceback():
    def fails_on_one(completions, **kwargs):
        if "1" in completions:
            raise ValueError("cannot score 1")
        return [0.0] * len(completions)

    with pytest.raises(RewardFunctionError, match=r"'fails_on_one' raised on sample 1 .* cannot score 1") as error:
        score_batch(batch(["0", "1"], ["0", "0"]), {"fails_on_one": fails_on_one}, None, timeout_s=30)
    assert 'raise ValueError("cannot score 1")' in str(error.value)  # the process's traceback


def test_a_timeout_or_a_refusal_is_not_retried():
    from prefect.states import Failed

    from grpo_flow.tasks.rollout import worth_retrying

    assert not worth_retrying(None, None, Failed(data=RewardTimeoutError("slow")))
    assert not worth_retrying(None, None, Failed(data=RewardRefusedError("holds a lock")))
    assert worth_retrying(None, None, Failed(data=ValueError("transient")))
