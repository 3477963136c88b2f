"""GRPOFlowTrainer: the Python API runs the same flow with reward objects and a Dataset."""

import json
import math

import pytest
from datasets import Dataset

from flows.trainer import GRPOFlowTrainer
from workers.rewards.environments import RewardEnvironment
from workers.state.storage import RunStorage

SEEN_STATES: list[int] = []


def exact_digit(prompts, completions, answer, trainer_state, **kwargs):
    """A module-level function: the config names it `module:function`, usable from any process."""
    SEEN_STATES.append(trainer_state.global_step)
    return [1.0 if c.strip() == a else 0.0 for c, a in zip(completions, answer, strict=True)]


async def only_odd_answers(completions, answer, log_extra, **kwargs):
    log_extra("parity", ["odd" if int(a) % 2 else "even" for a in answer])  # TRL's completions-table column
    return [0.25 if int(a) % 2 else None for a in answer]  # None: does not apply to this sample


class IsDigit(RewardEnvironment):
    def score(self, completion, prompt, **columns):
        return 1.0 if completion.strip().isdigit() else 0.0


def digits_dataset(n=40):
    prompts = [f"{1000 + 37 * i}=" for i in range(n)]
    return Dataset.from_dict({"prompt": prompts, "answer": [p[-2] for p in prompts]})


SMALL = dict(
    max_steps=2,
    prompts_per_step=4,
    num_generations=4,
    num_rollout_workers=1,
    eval_prompts=0,
    max_completion_length=2,
    max_prompt_length=32,
    learning_rate=5e-3,
)


def test_train_runs_the_flow_with_functions_async_functions_and_environments(prefect_server, storage_root):
    SEEN_STATES.clear()
    trainer = GRPOFlowTrainer(
        model="tiny",
        reward_funcs=[exact_digit, only_odd_answers, IsDigit()],
        reward_weights=[1.0, 2.0, 0.5],
        train_dataset=digits_dataset(),
        run_id="api-run",
        storage_root=str(storage_root),
        **SMALL,
    )
    assert trainer.config.reward_funcs == [
        "test_trainer_api:exact_digit",
        "test_trainer_api:only_odd_answers",
        "registered:is_digit",
    ]
    summary = trainer.train()
    assert summary["status"] == "completed" and summary["steps_completed"] == 2
    assert sorted(set(SEEN_STATES)) == [0, 1]  # trainer_state.global_step per step, as TRL passes it

    rows = RunStorage(storage_root, "api-run").read_rollouts().to_pylist()
    assert len(rows) == 2 * 4 * 4
    for row in rows:
        odd = int(row["answer"]) % 2 == 1
        assert (row["reward_only_odd_answers"] == 0.25) if odd else row["reward_only_odd_answers"] is None
        expected = row["reward_exact_digit"] + (0.5 if odd else 0.0) + 0.5 * row["reward_is_digit"]
        assert math.isclose(row["reward"], expected)
        assert json.loads(row["logged_extra"]) == {"parity": "odd" if odd else "even"}
    metrics = RunStorage(storage_root, "api-run").read_metrics().to_pylist()
    assert all(m["time/reward/is_digit_s"] >= 0 and "rewards/exact_digit/std" in m for m in metrics)


def test_bad_api_input_is_refused_before_anything_loads(tmp_path):
    root = tmp_path / "never"
    with pytest.raises(ValueError, match="prompt"):
        GRPOFlowTrainer(
            reward_funcs=[exact_digit], train_dataset=Dataset.from_dict({"question": ["1="]}), storage_root=str(root)
        )
    with pytest.raises(ValueError, match="reward_weights has 1 values but reward_funcs has 2 functions"):
        GRPOFlowTrainer(reward_funcs=[exact_digit, IsDigit()], reward_weights=[1.0], storage_root=str(root))
    with pytest.raises(TypeError, match=r"reward_funcs\[1\]: 42 is neither callable nor a reward environment"):
        GRPOFlowTrainer(reward_funcs=[exact_digit, 42], storage_root=str(root))
    with pytest.raises(ValueError, match="loss_type"):
        GRPOFlowTrainer(reward_funcs=[exact_digit], loss_type="ppo", storage_root=str(root))
    assert not root.exists()


def test_a_reward_that_keeps_failing_fails_the_step_naming_it_and_keeps_the_log(prefect_server, storage_root):
    from workers.rewards.functions import RewardFunctionError

    def breaks_on_answer_7(completions, answer, trainer_state, **kwargs):
        if trainer_state.global_step == 1 and "7" in answer:
            raise KeyError("no score for 7")
        return [0.0] * len(completions)

    dataset = Dataset.from_dict(
        {"prompt": [f"{i}{i % 10}=" for i in range(100, 140)], "answer": [str(i % 10) for i in range(100, 140)]}
    )
    trainer = GRPOFlowTrainer(
        reward_funcs=[breaks_on_answer_7],
        train_dataset=dataset,
        run_id="api-fails",
        storage_root=str(storage_root),
        score_retries=1,
        retry_delay_seconds=0,
        **{**SMALL, "max_steps": 3, "prompts_per_step": 40},
    )
    with pytest.raises(
        RewardFunctionError, match=r"'breaks_on_answer_7' raised on sample \d+ \(prompt_id '.+'\) of step 2"
    ):
        trainer.train()
    storage = RunStorage(storage_root, "api-fails")
    assert storage.logged_steps() == [1] and storage.read_rollouts(1).num_rows == 160
    assert "step 2" in storage.read_summary()["error"]


@pytest.mark.parametrize("dataset", ["registered:9f3a-77", "hf:openai/gsm8k", "hf:./my data/train.jsonl", "last_digit"])
def test_generated_run_ids_are_valid_for_every_kind_of_data_set(dataset):
    import re

    from flows.grpo import new_run_id
    from schemas.config import RUN_ID_PATTERN, GRPOFlowConfig

    run_id = new_run_id(GRPOFlowConfig(dataset=dataset))
    assert re.match(RUN_ID_PATTERN, run_id), run_id
    assert GRPOFlowConfig(dataset=dataset, run_id=run_id).run_id == run_id
