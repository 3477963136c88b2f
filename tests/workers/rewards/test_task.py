"""The task a run trains on, with its accuracy reward resolved (workers/rewards/task.py)."""

from grpo_flow.schemas.config import GRPOFlowConfig
from grpo_flow.workers.rewards.task import run_task


def test_an_hf_data_set_holds_prompts_out_only_for_an_accuracy_reward_as_the_python_api_does(tmp_path, monkeypatch):
    """The CLI held 10 % of an `hf:` data set out and never trained on it, yet with no accuracy reward its
    held-out accuracy and pass@k were nan; the Python API held nothing out then (issue 30, item 4)."""

    path = tmp_path / "digits.jsonl"
    path.write_text("".join(f'{{"prompt": "{n}=", "answer": "{n % 10}"}}\n' for n in range(100, 140)))
    (tmp_path / "grpo_flow_test_scoring.py").write_text(
        "def exact(completions, answer, **kwargs):\n    return [float(c == a) for c, a in zip(completions, answer)]\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))

    def task(**fields):
        return run_task(GRPOFlowConfig(dataset=f"hf:{path}", reward_funcs=["last_digit"], **fields))

    unscored = task()
    assert (len(unscored.train), len(unscored.heldout), unscored.accuracy_reward) == (40, 0, None)
    scored = task(accuracy_reward="last_digit")
    assert (len(scored.train), len(scored.heldout), scored.accuracy_reward) == (36, 4, "last_digit")
    assert (len(task(accuracy_reward="last_digit", eval_prompts=0).heldout)) == 0  # evaluation off
    by_path = run_task(
        GRPOFlowConfig(dataset=f"hf:{path}", reward_funcs=["grpo_flow_test_scoring:exact"], accuracy_reward="exact")
    )
    assert by_path.accuracy_reward == "exact" and by_path.accuracy_function(completions=["1"], answer=["1"]) == [1.0]
    assert set(by_path.heldout["prompt_id"]) == set(scored.heldout["prompt_id"])  # the same prompts held out
