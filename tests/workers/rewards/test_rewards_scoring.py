"""Rewards are called as TRL calls them; bad scores are errors that name the function and sample."""

import json
import math
import textwrap

import pytest

from grpo_flow.schemas.records import RolloutBatch
from grpo_flow.workers.data.loaders import clear_task_cache, extract_final_number, gsm8k_answer, gsm8k_rows, load_task
from grpo_flow.workers.rewards.functions import (
    check_scores,
    gsm8k_accuracy,
    last_digit,
    resolve_reward_funcs,
    reverse_digits,
    reverse_digits_partial,
    score_batch,
)


def batch(completions, answers):
    n = len(completions)
    return RolloutBatch(
        run_id="r",
        step=1,
        policy_version=0,
        worker_id="w",
        prompt_id=["p"] * n,
        group_index=[0] * n,
        sample_index=list(range(n)),
        prompt=["35060="] * n,
        completion=completions,
        prompt_token_ids=[[1]] * n,
        completion_token_ids=[[2, 3]] * n,
        sampling_logprobs=[[-0.1, -0.1]] * n,
        finish_reason=["stop"] * n,
        extra_columns={"answer": answers},
    )


def test_builtin_rewards():
    assert last_digit(completions=["0", " 0 ", "00", "6"], answer=["0"] * 4) == [1.0, 1.0, 0.0, 0.0]
    messages = [[{"role": "assistant", "content": "so #### 1,234"}]]
    assert gsm8k_accuracy(completions=["The answer is 42.", "#### 41"], answer=["42", "42"]) == [1.0, 0.0]
    assert gsm8k_accuracy(completions=messages, answer=["1234"]) == [1.0]


def test_reward_functions_get_trl_arguments_and_dataset_columns(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        textwrap.dedent("""
        calls = []
        def shaped(prompts, completions, completion_ids, answer, **kwargs):
            calls.append((prompts, completions, completion_ids, answer))
            return [None if c == "skip" else float(len(c)) for c in completions]
    """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    funcs = resolve_reward_funcs(["last_digit", "my_rewards:shaped"])
    assert list(funcs) == ["last_digit", "shaped"]
    scored = score_batch(batch(["0", "skip", "12"], ["0", "0", "2"]), funcs, [2.0, 0.5])
    import my_rewards

    prompts, completions, ids, answer = my_rewards.calls[0]
    assert completions == ["0", "skip", "12"] and answer == ["0", "0", "2"] and ids == [[2, 3]] * 3
    assert scored.rewards == {"last_digit": [1.0, 0.0, 0.0], "shaped": [1.0, None, 2.0]}
    # TRL's rule: a function that returns None for a sample is left out of that sample's sum
    assert scored.reward == [2.0 * 1 + 0.5 * 1, 0.0, 0.5 * 2]


def test_a_sample_no_function_applies_to_has_no_reward(tmp_path, monkeypatch):
    (tmp_path / "none_rewards.py").write_text("def never(completions, **kw):\n    return [None] * len(completions)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    scored = score_batch(batch(["1"], ["1"]), resolve_reward_funcs(["none_rewards:never"]), None)
    assert math.isnan(scored.reward[0])


@pytest.mark.parametrize(
    "scores, message",
    [
        ([1.0], "returned 1 scores for 2 completions"),
        ([1.0, float("nan")], "returned nan for sample 1"),
        ([float("inf"), 1.0], "returned inf for sample 0"),
        (["1", 1.0], "returned '1' for sample 0"),
        ({"a": 1.0, "b": 0.0}, "returned a dict; expected a list of 2 scores"),
        (None, "returned a NoneType; expected a list of 2 scores"),
    ],
)
def test_bad_scores_name_the_function_and_sample(scores, message):
    with pytest.raises(ValueError, match=f"reward function 'mine' {message}"):
        check_scores("mine", scores, 2)


def test_scores_are_taken_in_every_shape_trl_takes():
    import numpy as np
    import torch

    assert check_scores("mine", np.array([1.0, 0.5]), 2) == [1.0, 0.5]
    assert check_scores("mine", torch.tensor([0.0, 1.0]), 2) == [0.0, 1.0]
    assert check_scores("mine", (s for s in [0.25, None]), 2)[0] == 0.25  # a generator
    assert check_scores("mine", [True, False], 2) == [1.0, 0.0]  # `[c == a for ...]`, as TRL takes it
    with pytest.raises(ValueError, match=r"'mine' returned a numpy.ndarray of shape \(2, 1\); expected a list"):
        check_scores("mine", np.zeros((2, 1)), 2)


def test_wrong_scores_are_not_retried_as_they_are_the_same_every_time():
    from prefect.states import Failed

    from grpo_flow.tasks.rollout import worth_retrying
    from grpo_flow.workers.rewards.functions import RewardOutputError

    with pytest.raises(RewardOutputError) as caught:
        check_scores("mine", [1.0], 2)
    assert not worth_retrying(None, None, Failed(data=caught.value))


def test_two_rewards_of_one_name_are_refused_not_one_dropped(tmp_path, monkeypatch):
    for module in ("moda", "modb"):
        (tmp_path / f"{module}.py").write_text(
            "def exact(completions, **kwargs):\n    return [1.0] * len(completions)\n"
        )
    (tmp_path / "broken.py").write_text("def f(:\n")
    (tmp_path / "needs_key.py").write_text("import os\nKEY = os.environ['NO_SUCH_KEY_FOR_TEST']\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError, match=r"reward_funcs\[1\]: 'modb:exact' and 'moda:exact' share the name 'exact'"):
        resolve_reward_funcs(["moda:exact", "modb:exact"])
    (tmp_path / "modc.py").write_text("def last_digit(completions, **kwargs):\n    return [0.0] * len(completions)\n")
    with pytest.raises(ValueError, match=r"reward_funcs\[1\]: 'last_digit' and 'modc:last_digit' share"):
        resolve_reward_funcs(["modc:last_digit", "last_digit"])  # the built-in is not replaced
    with pytest.raises(ValueError, match=r"importing 'broken' for 'broken:f' raised SyntaxError: .*line 1\)$"):
        resolve_reward_funcs(["broken:f"])
    with pytest.raises(ValueError, match=r"importing 'needs_key' for 'needs_key:f' raised KeyError: 'NO_SUCH_KEY"):
        resolve_reward_funcs(["needs_key:f"])


@pytest.mark.parametrize(
    "name, message",
    [
        ("nonsense", r"reward_funcs\[0\]: 'nonsense' is neither"),
        ("no_module_here:f", r"reward_funcs\[0\]: cannot import"),
        ("math:pi", r"reward_funcs\[0\]: 'math:pi' is neither callable"),
    ],
)
def test_unknown_reward_names_are_errors(name, message):
    with pytest.raises(ValueError, match=message):
        resolve_reward_funcs([name])


def test_last_digit_task_is_fixed_and_its_splits_disjoint():
    task = load_task("last_digit")
    assert set(task.train["prompt"]).isdisjoint(task.heldout["prompt"])
    for prompt, answer in zip(task.heldout["prompt"][:50], task.heldout["answer"][:50], strict=True):
        assert prompt.endswith("=") and prompt[-2] == answer
    clear_task_cache()
    assert load_task("last_digit").train["prompt"][:20] == task.train["prompt"][:20]


def test_reverse_digits_rewards_exact_and_per_position():
    completions = ["06053", " 06053\n", "06050", "0605", "060533", "35060", "", "abc"]
    answer = ["06053"] * len(completions)
    assert reverse_digits(completions=completions, answer=answer) == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    partial = reverse_digits_partial(completions=completions, answer=answer)
    # Positions right over the longer string: a wrong, a missing and an extra digit each cost 1/5 or 1/6.
    assert partial == pytest.approx([1.0, 1.0, 4 / 5, 4 / 5, 5 / 6, 1 / 5, 0.0, 0.0])
    assert resolve_reward_funcs(["reverse_digits", "reverse_digits_partial"]) == {
        "reverse_digits": reverse_digits,
        "reverse_digits_partial": reverse_digits_partial,
    }


def test_gsm8k_rows_from_hub_format():
    from datasets import Dataset

    hub = Dataset.from_dict(
        {
            "question": ["Tom has 3 apples and buys 1,231 more. How many?"],
            "answer": ["3 + 1231 = <<3+1231=1234>>1234\n#### 1,234"],
        }
    )
    rows = gsm8k_rows(hub, "gsm8k-test")
    assert rows[0]["answer"] == "1234" and rows[0]["prompt_id"] == "gsm8k-test-00000"
    assert rows[0]["prompt"][0]["role"] == "user" and "####" in rows[0]["prompt"][0]["content"]
    with pytest.raises(ValueError, match="no '####'"):
        gsm8k_answer("no marker here")
    assert extract_final_number("first 3, then 4.5 and finally 1,000.") == "1000"
    assert extract_final_number("#### -7") == "-7" and extract_final_number("none") is None


def test_conversational_prompts_and_completions_reach_rewards_as_messages():
    from grpo_flow.workers.rewards.functions import reward_inputs

    seen = {}

    def capture(prompts, completions, **kwargs):
        seen.update(prompts=prompts, completions=completions, state=kwargs["trainer_state"])
        return [1.0] * len(completions)

    conversational = [{"role": "user", "content": "2+2?"}]
    b = batch(["4", "5"], ["4", "4"]).replace(raw_prompt=[conversational, conversational])
    from grpo_flow.workers.rewards.functions import RewardTrainerState

    score_batch(b, {"capture": capture}, None, RewardTrainerState(global_step=3, max_steps=10, epoch=0.5))
    assert seen["prompts"] == [conversational, conversational]
    assert seen["completions"] == [[{"role": "assistant", "content": "4"}], [{"role": "assistant", "content": "5"}]]
    assert seen["state"].global_step == 3
    assert reward_inputs(batch(["x"], ["0"]))[1] == ["x"]  # plain data: strings


def test_async_rewards_numpy_scores_log_metric_and_per_function_time():
    import numpy as np

    async def later(completions, log_metric, **kwargs):
        log_metric("judge/calls", len(completions))
        return [None, np.float32(0.5)]

    scored = score_batch(batch(["a", "b"], ["0", "0"]), {"later": later}, None)
    assert scored.rewards["later"] == [None, 0.5] and math.isnan(scored.reward[0])
    assert scored.logged_metrics == {"judge/calls": [2.0]} and scored.reward_seconds["later"] >= 0


def test_log_extra_values_land_per_row_as_json_and_a_wrong_count_names_the_function():
    from grpo_flow.workers.rewards.functions import RewardFunctionError

    def judged(completions, log_extra, **kwargs):
        log_extra("verdict", [f"saw {c}" for c in completions])
        log_extra("length", [len(c) for c in completions])
        return [1.0] * len(completions)

    def quiet(completions, **kwargs):
        return [0.0] * len(completions)

    scored = score_batch(batch(["a", "bb"], ["0", "0"]), {"judged": judged}, None)
    assert [json.loads(row) for row in scored.logged_extra] == [
        {"verdict": "saw a", "length": 1},
        {"verdict": "saw bb", "length": 2},
    ]
    assert score_batch(batch(["a", "bb"], ["0", "0"]), {"quiet": quiet}, None).logged_extra == [None, None]

    def short(completions, log_extra, **kwargs):
        log_extra("verdict", ["only one"])
        return [1.0] * len(completions)

    with pytest.raises(
        RewardFunctionError, match="'short' logged 1 values for log_extra column 'verdict' in a batch of 2"
    ):
        score_batch(batch(["a", "bb"], ["0", "0"]), {"short": short}, None)


def test_a_raising_reward_names_the_function_the_sample_and_the_traceback():
    from grpo_flow.workers.rewards.functions import RewardFunctionError

    def picky(completions, **kwargs):
        return [1.0 / (c != "boom") for c in completions]

    b = batch(["ok", "ok", "boom"], ["0"] * 3).replace(prompt_id=["p0", "p1", "p2"])
    with pytest.raises(RewardFunctionError) as raised:
        score_batch(b, {"picky": picky}, None)
    message = str(raised.value)
    assert "reward function 'picky' raised on sample 2 (prompt_id 'p2') of step 1: ZeroDivisionError" in message
    assert "Traceback" in message and '1.0 / (c != "boom")' in message


def test_reward_environment_objects_resolve_from_module_paths(tmp_path, monkeypatch):
    (tmp_path / "my_envs.py").write_text(
        textwrap.dedent("""
        from grpo_flow.workers.rewards.environments import RewardEnvironment
        class Echo(RewardEnvironment):
            async def score(self, completion, prompt, answer, **columns):
                return 1.0 if completion == answer else 0.0
        echo = Echo()
        not_a_reward = 42
    """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    funcs = resolve_reward_funcs(["my_envs:echo"])
    assert score_batch(batch(["0", "1"], ["0", "0"]), funcs, None).rewards["echo"] == [1.0, 0.0]
    with pytest.raises(ValueError, match=r"reward_funcs\[0\]: 'my_envs:not_a_reward' is neither callable"):
        resolve_reward_funcs(["my_envs:not_a_reward"])


def test_a_reward_that_edits_its_inputs_changes_neither_the_log_nor_the_next_reward():
    """Each call gets its own copies of the completions, prompts and columns (issue 30, item 6)."""
    conversational = [{"role": "user", "content": "2+2?"}]
    seen = []

    def vandal(prompts, completions, answer, **kwargs):
        scores = [1.0] * len(completions)
        completions[0] = "Z"
        prompts[0][0]["content"] = "edited"
        answer.clear()
        completions.clear()
        return scores

    def reader(prompts, completions, answer, **kwargs):
        seen.append((prompts, completions, answer))
        return [0.5] * len(completions)

    b = batch(["4", "5"], ["4", "4"]).replace(raw_prompt=[conversational, conversational])
    scored = score_batch(b, {"vandal": vandal, "reader": reader}, None)
    assert scored.completion == ["4", "5"] and scored.extra_columns["answer"] == ["4", "4"]
    assert scored.raw_prompt == [[{"role": "user", "content": "2+2?"}]] * 2
    prompts, completions, answer = seen[0]
    assert completions == [[{"role": "assistant", "content": "4"}], [{"role": "assistant", "content": "5"}]]
    assert prompts[0][0]["content"] == "2+2?" and answer == ["4", "4"]
    assert scored.rewards == {"vandal": [1.0, 1.0], "reader": [0.5, 0.5]}


def test_sys_exit_in_a_reward_or_at_its_import_is_an_error_naming_it(tmp_path, monkeypatch):
    """sys.exit(3) in a reward, or when its module is imported, ended the run with exit 3 and no word
    (issue 30, item 12)."""
    from grpo_flow.workers.rewards.functions import RewardFunctionError

    def quits(completions, **kwargs):
        raise SystemExit(3)

    with pytest.raises(RewardFunctionError) as raised:
        score_batch(batch(["4", "5"], ["4", "4"]), {"quits": quits}, None)
    assert (
        str(raised.value).splitlines()[0]
        == "reward function 'quits' called sys.exit(3) on sample 0 (prompt_id 'p') of step 1"
    )
    (tmp_path / "quits_at_import.py").write_text("import sys\nsys.exit(3)\ndef score(completions, **kwargs): ...\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(
        ValueError,
        match=r"^reward_funcs\[0\]: importing 'quits_at_import' for 'quits_at_import:score' called sys.exit\(3\)$",
    ):
        resolve_reward_funcs(["quits_at_import:score"])


def test_a_score_too_large_for_a_float_names_its_reward():
    from grpo_flow.workers.rewards.functions import RewardOutputError

    with pytest.raises(
        RewardOutputError,
        match=r"^reward function 'huge' returned 10000000000000000000\.\.\. \(401 characters\) for sample 1;",
    ):
        check_scores("huge", [1, 10**400], 2)
