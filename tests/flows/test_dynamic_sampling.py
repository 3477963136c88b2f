"""Dynamic sampling in a real run: tied groups are dropped, refills come from further prompts."""

import time

from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName, TaskRunFilter, TaskRunFilterName

from grpo_flow.flows.grpo import grpo
from grpo_flow.schemas.presets import preset_config
from grpo_flow.workers.state.storage import RunStorage


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
        generate_retries=4,  # not the tasks' own default (2), so a refill that ignored them would show
        score_retries=3,
        retry_delay_seconds=0.5,
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

    # Refill rounds are task runs of their own, with the run's retry policy, like the first round's.
    rounds = sum(int(r["dynamic_sampling/rounds"]) for r in rows)
    assert rounds > 0
    expected = 2 * (len(rows) + rounds)  # two shards a round
    policies = {}
    for _ in range(240):  # the server records task runs from their events: about a second, far more under load
        policies = {
            name: retry_policies(config.run_id, [r["step"] for r in rows], name) for name in ("generate", "score")
        }
        if all(len(p) == expected for p in policies.values()):
            break
        time.sleep(0.5)
    assert policies == {"generate": [(4, 0.5)] * expected, "score": [(3, 0.5)] * expected}


def retry_policies(run_id: str, steps: list[int], task_name: str) -> list[tuple[int, float]]:
    """(retries, retry delay) of each `task_name` task run in the run's step subflows (named exactly: another
    test's run, `tools-dynamic-sampling`, shares the server and this name as a suffix)."""
    with get_client(sync_client=True) as client:
        task_runs = client.read_task_runs(
            flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[f"{run_id}-step-{n}" for n in steps])),
            task_run_filter=TaskRunFilter(name=TaskRunFilterName(like_=f"{task_name}-")),
        )
    return [(t.empirical_policy.retries, t.empirical_policy.retry_delay) for t in task_runs]
