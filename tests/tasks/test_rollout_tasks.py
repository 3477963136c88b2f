"""Task logic through `.fn`: deterministic sampling, shards of whole groups, advantages, schema."""

import math

import pyarrow.parquet as pq
import pytest

from grpo_flow.schemas.presets import preset_config
from grpo_flow.schemas.records import RolloutBatch, RunPlan
from grpo_flow.tasks.rollout import compute_advantages, sample_batch, write_rollouts
from grpo_flow.workers.data.loaders import load_task


@pytest.fixture
def config(tmp_path):
    return preset_config("tiny", run_id="tasks", storage_root=str(tmp_path), prompts_per_step=8, num_rollout_workers=2)


def prompt_ids(shards):
    return [row["prompt_id"] for shard in shards for row in shard.rows]


def test_sample_batch_is_a_function_of_seed_and_step(config, plan):
    first = sample_batch.fn(config, plan, 3)
    assert prompt_ids(first) == prompt_ids(sample_batch.fn(config, plan, 3))
    assert prompt_ids(first) != prompt_ids(sample_batch.fn(config, plan, 4))
    other_seed = config.model_copy(update={"seed": config.seed + 1})
    assert prompt_ids(first) != prompt_ids(sample_batch.fn(other_seed, plan, 3))


def test_sample_batch_splits_whole_prompts_across_workers(config, plan):
    shards = sample_batch.fn(config, plan, 1)
    assert [s.shard for s in shards] == [0, 1]
    assert [len(s.rows) for s in shards] == [4, 4]
    assert [s.group_offset for s in shards] == [0, 4]


def test_an_epoch_visits_every_prompt_once(tmp_path):
    small = preset_config(
        "tiny", run_id="epochs", storage_root=str(tmp_path), prompts_per_step=1000, num_rollout_workers=1
    )
    size = len(load_task("last_digit").train)
    plan = RunPlan("epochs", str(tmp_path), "unused", 10, ("last_digit",), ("answer",), size)
    seen = [pid for step in range(1, size // 1000 + 1) for pid in prompt_ids(sample_batch.fn(small, plan, step))]
    assert len(seen) == len(set(seen)) == size


def scored_batch(rewards, offset=0, group_size=4):
    n = len(rewards)
    return RolloutBatch(
        run_id="tasks",
        step=1,
        policy_version=0,
        worker_id="rollout-0",
        prompt_id=[f"p{offset + i // group_size}" for i in range(n)],
        group_index=[offset + i // group_size for i in range(n)],
        sample_index=[i % group_size for i in range(n)],
        prompt=["12="] * n,
        completion=["2"] * n,
        prompt_token_ids=[[1, 2, 3]] * n,
        completion_token_ids=[[4, 5]] * n,
        sampling_logprobs=[[-0.1, -0.2]] * n,
        finish_reason=["stop"] * n,
        extra_columns={"answer": ["2"] * n},
        rewards={"last_digit": list(rewards)},
        reward=list(rewards),
        reward_error=[None] * n,
    )


def test_advantages_span_every_shard_of_the_step(config):
    config = config.model_copy(update={"num_generations": 4})
    batches, stats = compute_advantages(config, [scored_batch([1, 0, 0, 0]), scored_batch([1, 1, 1, 1], offset=1)])
    first, second = batches
    assert first.advantage[0] > 0 and all(a < 0 for a in first.advantage[1:])
    assert math.isclose(sum(first.advantage), 0.0, abs_tol=1e-5)
    assert second.advantage == [0.0] * 4  # a group of ties carries no signal
    assert stats["frac_reward_zero_std"] == 0.5
    assert stats["reward"] == pytest.approx(5 / 8)
    assert stats["rewards/last_digit/mean"] == pytest.approx(5 / 8)


def test_log_metric_values_are_averaged_over_every_call_and_may_not_take_grpo_flows_names(config):
    from grpo_flow.tasks.rollout import check_metric_names
    from grpo_flow.workers.rewards.functions import RewardOutputError

    config = config.model_copy(update={"num_generations": 4})
    first = scored_batch([1, 0, 0, 0]).replace(logged_metrics={"judge/calls": [1.0, 3.0]})
    second = scored_batch([1, 1, 1, 1], offset=1).replace(logged_metrics={"judge/calls": [5.0]})
    _, stats = compute_advantages(config, [first, second])
    assert stats["judge/calls"] == pytest.approx(3.0)  # every value of both shards, as TRL averages them, not the last
    with pytest.raises(RewardOutputError, match=r"logged \['frac_reward_zero_std', 'reward'\] with log_metric"):
        clash = first.replace(logged_metrics={"reward": [123.0], "frac_reward_zero_std": [-1.0]})
        compute_advantages(config, [clash, second])
    with pytest.raises(RewardOutputError, match=r"logged \['loss'\] with log_metric, which the actor's own"):
        check_metric_names({"reward": 1.0, "loss": 2.0}, {"loss": 0.1, "grad_norm": 1.0})


def test_write_rollouts_enforces_the_schema_and_never_overwrites(config, plan):
    batch, _ = compute_advantages(config.model_copy(update={"num_generations": 4}), [scored_batch([1, 0, 1, 0])])
    path = write_rollouts(config, plan, batch[0], 0)
    table = pq.read_table(path)
    assert table.num_rows == 4
    assert table.schema.field("completion_token_ids").type.value_type.bit_width == 32
    assert table.column("reward_last_digit").to_pylist() == [1.0, 0.0, 1.0, 0.0]
    from grpo_flow.workers.state.storage import RunStorage

    storage = RunStorage(plan.storage_root, plan.run_id)
    committed = storage.commit_rollouts(batch[0].step, num_shards=1) / "shard-00.parquet"
    with pytest.raises(FileExistsError):
        write_rollouts(config, plan, batch[0], 0)
    assert pq.read_table(committed).equals(table)


def test_dynamic_sampling_keeps_only_groups_with_a_reward_spread_up_to_the_quota(config):
    from grpo_flow.tasks.rollout import keep_informative_groups

    cfg = config.model_copy(
        update={"num_generations": 2, "prompts_per_step": 4, "num_rollout_workers": 2, "dynamic_sampling": True}
    )

    def shard(rewards, tag):
        n = len(rewards)
        return RolloutBatch(
            run_id="r",
            step=1,
            policy_version=0,
            worker_id="w",
            prompt_id=[f"{tag}{i // 2}" for i in range(n)],
            group_index=[i // 2 for i in range(n)],
            sample_index=[i % 2 for i in range(n)],
            prompt=["p"] * n,
            completion=[f"{tag}{i}" for i in range(n)],
            prompt_token_ids=[[1]] * n,
            completion_token_ids=[[2]] * n,
            sampling_logprobs=[[-0.1]] * n,
            finish_reason=["stop"] * n,
            rewards={"f": rewards},
            reward=rewards,
            extra_columns={"answer": ["0"] * n},
        )

    # shard 0: groups (1,1) tie and (0,1) spread; shard 1: both groups tie
    kept, dropped = keep_informative_groups.fn(
        cfg, [None, None], [shard([1.0, 1.0, 0.0, 1.0], "a"), shard([0.0] * 4, "b")]
    )
    assert dropped == 3 and [len(b) for b in kept] == [2, 0]
    assert kept[0].completion == ["a2", "a3"] and kept[0].group_index == [0, 0]
    # a refill round tops each shard up to its quota of 2 groups, in order, renumbering groups
    kept, dropped = keep_informative_groups.fn(
        cfg, kept, [shard([0.0, 1.0, 1.0, 0.0], "c"), shard([1.0, 0.5, 0.0, 0.0], "d")]
    )
    assert dropped == 1 and [len(b) for b in kept] == [4, 2]
    assert kept[0].completion == ["a2", "a3", "c0", "c1"] and kept[0].group_index == [0, 0, 1, 1]
    assert kept[1].completion == ["d0", "d1"] and kept[1].group_index == [2, 2]
    assert kept[0].rewards["f"] == [0.0, 1.0, 0.0, 1.0]


def test_the_no_reward_warning_is_said_once_however_often_log_rollouts_is_retried(config, plan, monkeypatch, caplog):
    """It was printed once per retry of log-rollouts (three times) (issue 30, "Also")."""
    import logging
    import math

    from grpo_flow.tasks import rollout

    monkeypatch.setattr(rollout, "get_run_logger", lambda: logging.getLogger("grpo_flow.test.no_reward"))
    with caplog.at_level(logging.WARNING, logger="grpo_flow.test.no_reward"):
        for _ in range(3):  # the task's first run and its two retries
            rollout.check_rewards_given(config, plan, 1, {"reward": math.nan})
    assert [r.getMessage()[:44] for r in caplog.records] == ["step 1: no completion got a reward: every re"]
