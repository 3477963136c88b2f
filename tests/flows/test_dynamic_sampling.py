"""Dynamic sampling in a real run: tied groups are dropped, refills come from further prompts."""

from flows.grpo import grpo
from schemas.presets import preset_config
from workers.state.storage import RunStorage


def test_logged_groups_all_carry_signal_and_the_filtered_count_is_logged(prefect_server, storage_root):
    config = preset_config(
        "tiny",
        run_id="dynamic-sampling",
        storage_root=str(storage_root),
        max_steps=2,
        prompts_per_step=8,
        num_generations=4,
        num_rollout_workers=2,
        eval_prompts=0,
        dynamic_sampling=True,
        dynamic_sampling_max_rounds=2,
    )
    assert grpo(config)["status"] == "completed"
    storage = RunStorage(storage_root, config.run_id)
    rows = storage.read_metrics().to_pylist()
    assert all(r["dynamic_sampling/filtered_groups"] > 0 for r in rows)  # the tiny model ties often at the start
    table = storage.read_rollouts().to_pandas()
    for row in rows:
        step_rows = table[table.step == row["step"]]
        kept = int(row["dynamic_sampling/kept_groups"])
        assert len(step_rows) == kept * 4 and 0 < kept <= 8
        spread = step_rows.groupby("group_index").reward.agg(lambda r: r.max() - r.min())
        assert (spread > 0).all()
        assert step_rows.groupby("group_index").size().eq(4).all()
