"""The data set's columns against the `prompt` column and the reward functions' keyword parameters, checked
before anything loads (flows/checks.py check_data_set, check_reward_columns; issue 34)."""

import pytest
from datasets import Dataset

from grpo_flow.flows.checks import StartCheckError, check_before_start, check_reward_columns
from grpo_flow.schemas.config import GRPOFlowConfig


def exact(completions, answer, **kwargs):
    return [float(c == a) for c, a in zip(completions, answer, strict=True)]


def graded(prompts, completions, answer, *, level, trainer_state=None, weight=1.0, **kwargs):
    return [weight] * len(completions)


def refusal(tmp_path, monkeypatch, dataset, reward="last_digit"):
    monkeypatch.chdir(tmp_path)
    config = GRPOFlowConfig(storage_root=str(tmp_path / "store"), dataset=dataset, reward_funcs=[reward])
    with pytest.raises(StartCheckError) as caught:
        check_before_start(config)
    return caught.value.field, caught.value.message


def test_a_data_set_without_a_prompt_column_is_refused_in_each_local_format(tmp_path, monkeypatch):
    rows = {"question": ["1=", "2="], "answer": ["1", "2"]}
    Dataset.from_dict(rows).to_parquet(tmp_path / "d.parquet")
    Dataset.from_dict(rows).to_csv(tmp_path / "d.csv", index=False)
    Dataset.from_dict(rows).save_to_disk(str(tmp_path / "saved"))
    (tmp_path / "d.jsonl").write_text('{"question": "1=", "answer": "1"}\n')
    for name in ("d.parquet", "d.csv", "saved", "d.jsonl"):
        field, message = refusal(tmp_path, monkeypatch, f"hf:{name}")
        assert field == "dataset"
        assert message == f"'{name}' has no 'prompt' column (columns: question, answer)", name


def test_a_reward_keyword_the_data_set_has_no_column_for_is_refused(tmp_path, monkeypatch):
    (tmp_path / "d.jsonl").write_text('{"prompt": "1=", "solution": "1"}\n')
    # a module name no other test imports: the worker process keeps imported modules
    # a module name no other test in the worker process imports first
    (tmp_path / "column_rewards.py").write_text("def exact(completions, answer, **kwargs):\n    return [0.0]\n")
    field, message = refusal(tmp_path, monkeypatch, "hf:d.jsonl", reward="column_rewards:exact")
    assert (field, message) == (
        "reward_funcs",
        "exact needs the column 'answer', which data set 'd.jsonl' lacks (columns: prompt, solution)",
    )
    (tmp_path / "ok.jsonl").write_text('{"prompt": "1=", "answer": "1"}\n')
    config = GRPOFlowConfig(
        storage_root=str(tmp_path / "store"),
        dataset=f"hf:{tmp_path / 'ok.jsonl'}",
        reward_funcs=["column_rewards:exact"],
    )
    check_before_start(config)  # the column is there


def test_only_required_keywords_that_are_not_trls_own_arguments_need_a_column():
    check_reward_columns({"graded": graded}, ["prompt", "answer", "level"], "d.jsonl")
    with pytest.raises(StartCheckError) as caught:
        check_reward_columns({"exact": exact, "graded": graded}, ["prompt", "prompt_id", "level"], "d.jsonl")
    assert caught.value.message == (
        "exact needs the column 'answer', which data set 'd.jsonl' lacks (columns: prompt, prompt_id, level)"
    )
    with pytest.raises(StartCheckError, match="graded needs the columns 'answer', 'level', which data set"):
        check_reward_columns({"graded": graded}, ["prompt"], "d.jsonl")
    check_reward_columns({"any": lambda **kwargs: [0.0], "builtin": len}, ["prompt"], "d.jsonl")


def test_the_python_api_checks_its_reward_objects_against_train_dataset(tmp_path):
    from grpo_flow.flows.trainer import GRPOFlowTrainer

    data = Dataset.from_dict({"prompt": ["1=", "2="], "solution": ["1", "2"]})
    with pytest.raises(StartCheckError) as caught:
        GRPOFlowTrainer(reward_funcs=[lambda completions, answer, **kw: [0.0]], train_dataset=data,
                        storage_root=str(tmp_path))  # fmt: skip
    assert caught.value.field == "reward_funcs"
    assert caught.value.message == (
        "<lambda> needs the column 'answer', which data set 'train_dataset' lacks (columns: prompt, solution)"
    )
