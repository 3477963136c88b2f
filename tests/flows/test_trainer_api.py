"""GRPOFlowTrainer: the Python API runs the same flow with reward objects and a Dataset."""

import json
import math

import pytest
from datasets import Dataset

from grpo_flow.flows.trainer import GRPOFlowTrainer
from grpo_flow.workers.rewards.environments import RewardEnvironment
from grpo_flow.workers.state.storage import RunStorage


def exact_digit(prompts, completions, answer, trainer_state, log_metric, **kwargs):
    """A module-level function: the config names it `module:function`, usable from any process."""
    log_metric("seen_global_step", trainer_state.global_step)  # TRL's logging hook, from any process
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
    assert [m["seen_global_step"] for m in metrics] == [0, 1]  # trainer_state.global_step per step, as TRL passes it


def test_bad_api_input_is_refused_before_anything_loads(tmp_path):
    root = tmp_path / "never"
    with pytest.raises(ValueError, match="prompt"):
        GRPOFlowTrainer(
            reward_funcs=[exact_digit], train_dataset=Dataset.from_dict({"question": ["1="]}), storage_root=str(root)
        )
    with pytest.raises(ValueError, match="reward_weights: 1 values but reward_funcs has 2 functions"):
        GRPOFlowTrainer(reward_funcs=[exact_digit, IsDigit()], reward_weights=[1.0], storage_root=str(root))
    with pytest.raises(TypeError, match=r"reward_funcs\[1\]: 42 is neither callable nor a reward environment"):
        GRPOFlowTrainer(reward_funcs=[exact_digit, 42], storage_root=str(root))
    with pytest.raises(ValueError, match="loss_type"):
        GRPOFlowTrainer(reward_funcs=[exact_digit], loss_type="ppo", storage_root=str(root))
    assert not root.exists()


def test_a_reward_that_keeps_failing_fails_the_step_naming_it_and_keeps_the_log(prefect_server, storage_root):
    from grpo_flow.workers.rewards.functions import RewardFunctionError

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

    from grpo_flow.schemas.config import new_run_id
    from grpo_flow.schemas.config import RUN_ID_PATTERN, GRPOFlowConfig

    run_id = new_run_id(GRPOFlowConfig(dataset=dataset))
    assert re.match(RUN_ID_PATTERN, run_id), run_id
    assert GRPOFlowConfig(dataset=dataset, run_id=run_id).run_id == run_id


def test_nothing_is_held_out_when_evaluation_is_off(tmp_path):
    three = Dataset.from_dict({"prompt": ["11=", "22=", "33="], "answer": ["1", "2", "3"]})
    off = GRPOFlowTrainer(reward_funcs=[exact_digit], train_dataset=three, eval_prompts=0, storage_root=str(tmp_path))
    assert (off.task.train.num_rows, off.task.heldout.num_rows) == (3, 0)  # a 3-prompt data set trains on 3
    on = GRPOFlowTrainer(
        reward_funcs=[exact_digit],
        train_dataset=digits_dataset(40),
        accuracy_reward="exact_digit",
        storage_root=str(tmp_path),
    )
    assert (on.task.train.num_rows, on.task.heldout.num_rows) == (36, 4)  # 10 % of the prompts, for evaluation
    assert on.task.accuracy_function is exact_digit
    assert off.config.dataset != on.config.dataset  # what trains differs, so a resume sees the change
    # Without a reward that says right or wrong, no accuracy can be measured: nothing is held out for one.
    unscored = GRPOFlowTrainer(reward_funcs=[exact_digit], train_dataset=digits_dataset(40), storage_root=str(tmp_path))
    assert (unscored.task.train.num_rows, unscored.task.heldout.num_rows) == (40, 0)
    with pytest.raises(ValueError, match="accuracy_reward: eval_dataset is scored by accuracy_reward"):
        GRPOFlowTrainer(reward_funcs=[exact_digit], train_dataset=three, eval_dataset=three, storage_root=str(tmp_path))
    with pytest.raises(ValueError, match=r"accuracy_reward: 'exact' is neither one of reward_funcs \(exact_digit\)"):
        GRPOFlowTrainer(
            reward_funcs=[exact_digit], train_dataset=three, accuracy_reward="exact", storage_root=str(tmp_path)
        )


def test_held_out_accuracy_is_measured_with_the_users_accuracy_reward(prefect_server, storage_root, caplog):
    import logging

    caplog.set_level(logging.INFO, logger="grpo_flow.phase")
    trainer = GRPOFlowTrainer(
        reward_funcs=[exact_digit],
        accuracy_reward="exact_digit",
        train_dataset=digits_dataset(),
        run_id="api-accuracy",
        storage_root=str(storage_root),
        **{**SMALL, "eval_prompts": 200},
    )
    summary = trainer.train()
    assert 0.0 <= summary["initial_eval_accuracy"] <= 1.0 and 0.0 <= summary["final_eval_accuracy"] <= 1.0
    said = [r.getMessage() for r in caplog.records if r.name == "grpo_flow.phase" and "held-out" in r.getMessage()]
    assert said == [  # what is held out of 40 prompts (10 %), not eval_prompts
        "evaluating on 4 held-out prompts before training",
        "evaluating on 4 held-out prompts after training",
    ]


def test_api_mistakes_get_one_line_naming_the_argument(tmp_path):
    import pandas as pd
    from datasets import DatasetDict

    root = str(tmp_path / "never")
    frame = pd.DataFrame({"prompt": ["1="], "answer": ["1"]})
    with pytest.raises(ValueError, match=r"^train_dataset: a DataFrame, not a datasets.Dataset; convert it with"):
        GRPOFlowTrainer(reward_funcs=[exact_digit], train_dataset=frame, storage_root=root)
    split = DatasetDict({"train": digits_dataset()})
    with pytest.raises(ValueError, match=r"^train_dataset: a DatasetDict.*dataset\['train'\]"):
        GRPOFlowTrainer(reward_funcs=[exact_digit], train_dataset=split, storage_root=root)
    with pytest.raises(
        ValueError, match=r"^reward_funcs: 'test_trainer_api:last_digit' and 'last_digit' share the name 'last_digit'"
    ):
        GRPOFlowTrainer(reward_funcs=["last_digit", last_digit], storage_root=root)
    with pytest.raises(ValueError) as caught:
        GRPOFlowTrainer(reward_funcs=[exact_digit], num_generation=4, per_device_train_batch_size=8, storage_root=root)
    assert str(caught.value).splitlines() == [
        "num_generation: not a grpo-flow option (did you mean num_generations?)",
        "per_device_train_batch_size: not a grpo-flow option (a step takes prompts_per_step x num_generations "
        "completions)",
    ]


def test_a_column_named_like_a_reward_column_is_refused_before_the_model_loads(prefect_server, storage_root):
    dataset = digits_dataset().add_column("reward_exact_digit", ["x"] * 40)
    trainer = GRPOFlowTrainer(
        reward_funcs=[exact_digit], train_dataset=dataset, run_id="api-clash", storage_root=str(storage_root), **SMALL
    )
    with pytest.raises(ValueError, match=r"dataset: columns \['reward_exact_digit'\] clash with the reward columns"):
        trainer.train()
    assert not RunStorage(storage_root, "api-clash").config_path.exists()  # refused before the run was written


def last_digit(completions, **kwargs):
    """Shares its name with the built-in reward."""
    return [0.0] * len(completions)


def never_applies(completions, **kwargs):
    return [None] * len(completions)


def test_a_reward_that_never_applies_warns_at_the_first_step_and_fails_after_n(prefect_server, storage_root, caplog):
    from grpo_flow.tasks.observability import USER_FACING
    from grpo_flow.tasks.rollout import NoRewardError

    trainer = GRPOFlowTrainer(
        reward_funcs=[never_applies],
        train_dataset=digits_dataset(),
        run_id="api-no-reward",
        storage_root=str(storage_root),
        max_no_reward_steps=3,
        **{**SMALL, "max_steps": 5},
    )
    with pytest.raises(
        NoRewardError, match=r"steps 1-3: no completion got a reward: every reward function \(never_applies\)"
    ):
        trainer.train()
    warnings = [r for r in caplog.records if getattr(r, USER_FACING, False)]
    assert [r.getMessage() for r in warnings] == [
        "step 1: no completion got a reward: every reward function (never_applies) returned None for every sample; "
        "the run fails after 3 such steps in a row"
    ]
    storage = RunStorage(storage_root, "api-no-reward")
    assert storage.logged_steps() == [1, 2]  # the failing step is not logged: a fixed function scores it again
    assert "step 3" in storage.read_summary()["error"]


API_SCRIPT = """
from datasets import Dataset
from grpo_flow.flows.trainer import GRPOFlowTrainer

def exact(completions, answer, **kwargs):
    return [1.0 if c.strip() == a else 0.0 for c, a in zip(completions, answer)]

prompts = [f"{1000 + 37 * i}=" for i in range(200)]
dataset = Dataset.from_dict({"prompt": prompts, "answer": [p[-2] for p in prompts]})
trainer = GRPOFlowTrainer(model="tiny", reward_funcs=[exact], train_dataset=dataset,
                          max_steps=3, prompts_per_step=8, num_generations=4,
                          max_completion_length=2, learning_rate=5e-3, eval_prompts=0)
summary = trainer.train()
print("trained:", summary["status"], summary["steps_completed"])
"""


@pytest.mark.slow
def test_a_python_api_run_prints_only_what_the_script_prints(storage_root, tmp_path):
    """The README's example as a script, on its own ephemeral Prefect server, as a user runs it."""
    import os
    import subprocess
    import sys

    (tmp_path / "grpo-storage").symlink_to(storage_root)  # the config's default root: the built tiny model
    (tmp_path / "prefect-home").mkdir()
    (tmp_path / "train.py").write_text(API_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "PREFECT_SERVER_ANALYTICS_ENABLED")}
    env.pop("WANDB_MODE", None)  # conftest's; with it transformers prints "Running in WANDB offline mode"
    env["PREFECT_HOME"] = str(tmp_path / "prefect-home")
    done = subprocess.run(
        [sys.executable, "train.py"], cwd=tmp_path, capture_output=True, text=True, env=env, timeout=600
    )
    assert (done.returncode, done.stdout, done.stderr) == (0, "trained: completed 3\n", "")


def test_the_api_stores_local_paths_absolute_and_refuses_a_dataset_object_it_does_not_hold(tmp_path, monkeypatch):
    """A relative path named something else from another folder (issue 30, item 9); a `registered:` data set
    named without its object failed after the flow had started (item 13)."""
    (tmp_path / "data.jsonl").write_text('{"prompt": "1=", "answer": "1"}\n{"prompt": "2=", "answer": "2"}\n')
    monkeypatch.chdir(tmp_path)
    trainer = GRPOFlowTrainer(reward_funcs=["last_digit"], dataset="hf:data.jsonl", storage_root="store")
    assert trainer.config.dataset == f"hf:{tmp_path / 'data.jsonl'}"
    scored = GRPOFlowTrainer(
        reward_funcs=["last_digit"], dataset="hf:data.jsonl", accuracy_reward="last_digit", storage_root="store"
    )
    assert scored.config.accuracy_reward == "last_digit"  # held out and scored as `grpo train --accuracy-reward`
    with pytest.raises(ValueError, match=r"^dataset: 'registered:abc' names a Dataset object that only the Python"):
        GRPOFlowTrainer(reward_funcs=["last_digit"], dataset="registered:abc", storage_root="store")


def test_the_process_of_a_reward_under_reward_timeout_s_ends_with_its_run(prefect_server, storage_root):
    import os

    from grpo_flow.workers.rewards import deadline

    def reports_its_pid(completions, log_metric, **kwargs):
        import os

        log_metric("reward_pid", os.getpid())
        return [0.0] * len(completions)

    trainer = GRPOFlowTrainer(
        reward_funcs=[reports_its_pid],
        train_dataset=digits_dataset(),
        run_id="api-deadline",
        storage_root=str(storage_root),
        reward_timeout_s=120,
        **SMALL,
    )
    assert trainer.train()["status"] == "completed"
    (pid,) = {m["reward_pid"] for m in RunStorage(storage_root, "api-deadline").read_metrics().to_pylist()}
    assert pid != os.getpid()  # scored in the deadline process, the same one for both steps
    with pytest.raises(ProcessLookupError):
        os.kill(int(pid), 0)  # killed and reaped at the run's end, not kept for the rest of the session
    assert not deadline._KEPT
