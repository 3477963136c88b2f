"""A rollout shard goes to Parquet with its explicit Arrow schema and comes back unchanged."""

import math

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from grpo_flow.schemas.records import RolloutBatch, metrics_table, rollout_schema


def batch(n=4):
    return RolloutBatch(
        run_id="r",
        step=3,
        policy_version=2,
        worker_id="rollout-1",
        prompt_id=[f"p{i // 2}" for i in range(n)],
        group_index=[i // 2 for i in range(n)],
        sample_index=[i % 2 for i in range(n)],
        prompt=["35060="] * n,
        completion=["0", "6", "0", ""][:n],
        prompt_token_ids=[[18, 20, 15, 21, 15, 28]] * n,
        completion_token_ids=[[15, 257], [21, 257], [15, 257], [15, 15]][:n],
        sampling_logprobs=[[-0.5, -0.01], [-2.25, -0.02], [-0.5, -0.01], [-0.75, -3.5]][:n],
        finish_reason=["stop", "stop", "stop", "length"][:n],
        extra_columns={"answer": ["0"] * n},
        rewards={"last_digit": [1.0, 0.0, 1.0, None][:n]},
        reward=[1.0, 0.0, 1.0, math.nan][:n],
        reward_error=[None] * n,
        advantage=[0.7, -0.7, 0.7, 0.0][:n],
        generate_s=0.25,
        score_s=0.001,
    )


def test_roundtrip_keeps_schema_and_values(tmp_path):
    schema = rollout_schema(["last_digit"], {"answer": pa.string()})
    table = batch().to_table(schema)
    pq.write_table(table, tmp_path / "shard.parquet")
    back = pq.read_table(tmp_path / "shard.parquet")
    assert back.schema.equals(schema)
    rows = back.to_pylist()
    assert rows[1]["completion_token_ids"] == [21, 257]
    assert rows[1]["sampling_logprobs"] == [-2.25, pytest.approx(-0.02)]
    assert rows[3]["reward_last_digit"] is None  # "does not apply" stays distinguishable from 0
    assert [r["completion_tokens"] for r in rows] == [2, 2, 2, 2]
    assert [r["prompt_tokens"] for r in rows] == [6] * 4
    assert {r["policy_version"] for r in rows} == {2} and {r["step"] for r in rows} == {3}
    assert back.schema.field("step").type == pa.int32()
    assert back.schema.field("prompt_token_ids").type == pa.list_(pa.int32())
    assert back.schema.field("sampling_logprobs").type == pa.list_(pa.float32())


def test_a_missing_or_short_column_is_an_error():
    schema = rollout_schema(["last_digit", "format"], {"answer": pa.string()})
    with pytest.raises(ValueError, match="lacks columns \\['reward_format'\\]"):
        batch().to_table(schema)
    short = batch().replace(advantage=[0.0])
    with pytest.raises(ValueError, match="advantage"):
        short.to_table(rollout_schema(["last_digit"], {"answer": pa.string()}))


def test_a_dataset_column_may_not_shadow_a_rollout_field():
    with pytest.raises(ValueError, match="clash"):
        rollout_schema(["last_digit"], {"reward": pa.float64()})


def test_metrics_row_types():
    table = metrics_table(
        {"run_id": "r", "step": 1, "policy_version": 1, "num_completions": 8, "loss": 0.5, "clip_ratio/high_mean": 0.0}
    )
    assert table.schema.field("step").type == pa.int32()
    assert table.schema.field("clip_ratio/high_mean").type == pa.float64()
    with pytest.raises(ValueError, match="lacks"):
        metrics_table({"loss": 1.0})
