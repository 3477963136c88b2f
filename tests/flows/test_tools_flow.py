"""Multi-turn runs with tools and environments, end to end: what is logged, what trains, what resumes.

The model is `tiny-tools` (workers/data/tiny_tools.py: the tiny Qwen2 with a chat template that renders
tools, warm-started on the call format only), on `digit_lookup` or small data sets of the same shape.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
from safetensors.torch import load_file

from grpo_flow.flows.grpo import grpo
from grpo_flow.schemas.presets import preset_config
from grpo_flow.workers.data.models import ensure_builtin_model
from grpo_flow.workers.rollout.episodes import ChatFormat
from grpo_flow.workers.state.storage import RunStorage

HERE = Path(__file__).parent  # tool_envs.py
SMALL = dict(prompts_per_step=4, num_generations=4, num_rollout_workers=2, eval_prompts=0, save_steps=2)


@pytest.fixture(scope="module")
def tools_model(storage_root):
    """tiny-tools, built once in the session's storage root (where `--model tiny-tools` finds it)."""
    return ensure_builtin_model(storage_root, "tiny-tools")


def run(storage_root, run_id, **fields):
    config = preset_config("tiny-tools", run_id=run_id, storage_root=str(storage_root), **{**SMALL, **fields})
    summary = grpo(config)
    assert summary["status"] == "completed", summary.get("error")
    return RunStorage(storage_root, run_id)


def rollouts(storage: RunStorage) -> pd.DataFrame:
    """The run's rollout log, as a user reads it: pandas on the Parquet files."""
    return pd.concat(pd.read_parquet(path) for path in sorted((storage.run_dir / "rollouts").rglob("*.parquet")))


def spans(mask: list[int]) -> list[tuple[int, int, int]]:
    """(value, start, end) of each run of equal values."""
    out, start = [], 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            out.append((mask[start], start, i))
            start = i
    return out


def check_episode_rows(table: pd.DataFrame, model_path: Path) -> int:
    """Every logged episode: tool-mask 0 exactly on the tool messages as the chat template renders them,
    1 on the model's turns (which parse back to the logged assistant messages); returns the tool calls."""
    chat = ChatFormat.load(model_path)
    calls = 0
    for row in table.itertuples():
        ids, mask = list(row.completion_token_ids), list(row.tool_mask)
        messages = json.loads(row.messages)
        logprobs = list(row.sampling_logprobs)
        assert len(ids) == len(mask) == len(logprobs)
        assert all(lp == 0.0 for lp, m in zip(logprobs, mask, strict=True) if not m) and all(
            lp < 0 for lp, m in zip(logprobs, mask, strict=True) if m
        )
        turns = spans(mask)
        assistants = [m for m in messages if m["role"] == "assistant"]
        tool_rounds = [[m] for m in messages if m["role"] == "tool"]  # one call per turn for this model
        assert [value for value, _, _ in turns] == [1, 0] * len(tool_rounds) + [1] * (
            len(assistants) > len(tool_rounds)
        )
        for (_, start, end), tool_messages in zip([t for t in turns if t[0] == 0], tool_rounds, strict=True):
            assert ids[start:end] == chat.suffix_ids(tool_messages)  # nothing but the tool's message
        context = list(row.prompt_token_ids)
        for (_, start, end), message in zip([t for t in turns if t[0] == 1], assistants, strict=True):
            assert chat.parse(ids[start:end], context + ids[:start], None).get("tool_calls") == message.get(
                "tool_calls"
            )
        assert row.tool_calls == sum(len(m.get("tool_calls") or []) for m in assistants)
        calls += row.tool_calls
    return calls


def test_a_multi_turn_run_logs_episodes_with_the_models_tokens_masked_in(prefect_server, storage_root, tools_model):
    storage = run(storage_root, "tools-episodes", max_steps=2)
    table = rollouts(storage)
    assert len(table) == 2 * 16 and table.tool_mask.notna().all() and table.messages.notna().all()
    assert check_episode_rows(table, tools_model) > 0  # the warm start calls its tool most of the time
    metrics = storage.read_metrics().to_pylist()
    assert all(0 < m["tools/call_frequency"] <= 1 for m in metrics)
    # completions/mean_length counts the model's own tokens, as TRL's does.
    step1 = table[table.step == 1]
    assert metrics[0]["completions/mean_length"] == pytest.approx(step1.tool_mask.map(sum).mean())

    shown = subprocess.run(
        [sys.executable, "-m", "grpo_flow.flows.cli", "rollouts", "tools-episodes", "--json", "--storage-root", str(storage_root)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert shown.returncode == 0, shown.stderr
    rows = [json.loads(line) for line in shown.stdout.splitlines()[1:]]
    assert all(row["turns"][0]["role"] == "assistant" for row in rows)
    assert any([t["role"] for t in row["turns"]] == ["assistant", "tool", "assistant"] for row in rows)


@pytest.mark.parametrize("mode", ["dynamic_sampling", "one_step_off"])
@pytest.mark.slow
def test_episodes_with_dynamic_sampling_and_one_step_off_pipelining(prefect_server, storage_root, tools_model, mode):
    fields = {"dynamic_sampling": True} if mode == "dynamic_sampling" else {"max_staleness": 1}
    storage = run(storage_root, f"tools-{mode.replace('_', '-')}", max_steps=2, **fields)
    table = rollouts(storage)
    assert table.tool_mask.notna().all() and check_episode_rows(table, tools_model) >= 0
    if mode == "one_step_off":
        assert (table[table.step == 2].staleness == 1).all()


def lookup_data(path: Path, environments: list[str] | None = None) -> str:
    """A data set in digit_lookup's shape (chat prompts, a hidden table), optionally with an `environment` column."""
    rows = []
    for i in range(40):
        row = {"prompt": [{"role": "user", "content": str(i % 10)}], "table": "0123456789", "answer": str(i % 10)}
        if environments:
            row["environment"] = environments[i % len(environments)]
        rows.append(row)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return f"hf:{path}"


def test_an_environment_that_owns_the_reward_needs_no_reward_function(
    prefect_server, storage_root, tools_model, tmp_path, monkeypatch
):
    monkeypatch.syspath_prepend(str(HERE))
    storage = run(
        storage_root,
        "tools-env-reward",
        max_steps=1,
        dataset=lookup_data(tmp_path / "lookup.jsonl"),
        environment_factory="tool_envs:RewardingTable",
        reward_funcs=[],
    )
    table = rollouts(storage)
    assert "reward_RewardingTable" in table.columns  # TRL names the reward after the class, weight 1
    looked_up = table.messages.map(lambda m: any(t["role"] == "tool" for t in json.loads(m)))
    assert table.reward_RewardingTable.tolist() == [1.0 if x else 0.0 for x in looked_up]
    assert table.reward.tolist() == table.reward_RewardingTable.tolist()


def test_a_dict_of_environments_is_chosen_per_row(prefect_server, storage_root, tools_model, tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(HERE))
    storage = run(
        storage_root,
        "tools-env-dict",
        max_steps=1,
        dataset=lookup_data(tmp_path / "two.jsonl", ["one", "seven"]),
        environment_factory="one=tool_envs:RewardingTable,seven=tool_envs:SevenTable",
        reward_funcs=["final_answer"],
    )
    table = rollouts(storage)
    for row in table.itertuples():
        answers = [t["content"] for t in json.loads(row.messages) if t["role"] == "tool"]
        assert set(answers) <= {"1" if row.environment == "one" else "7"}
        assert ("peek" in row.prompt) == (row.environment == "seven")  # only its own environment's tools
        # Each environment's reward scores its own rows (TRL: exact class), None (NaN) elsewhere.
        assert pd.isna(row.reward_SevenTable) == (row.environment == "one")
        assert pd.isna(row.reward_RewardingTable) == (row.environment == "seven")


# -- SIGKILL mid-step, resume: the same weights, no tool called twice for a logged step ----------------
KILL_RUN = [
    "--preset", "tiny-tools", "--max-steps", "4", "--save-steps", "2", "--prompts-per-step", "4",
    "--num-generations", "4", "--eval-prompts", "0", "--environment-factory", "tool_envs:CountingTable",
]  # fmt: skip


def train(storage_root, run_id, calls: Path, *args, fail_at=None):
    from prefect.settings import PREFECT_API_URL

    env = {
        **os.environ,
        "PREFECT_API_URL": PREFECT_API_URL.value(),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
        "GRPO_FLOW_TEST_TOOL_CALLS": str(calls),
    }
    env.pop("GRPO_FLOW_FAIL_AT", None)
    if fail_at:
        env["GRPO_FLOW_FAIL_AT"] = fail_at
    argv = [sys.executable, "-m", "grpo_flow.flows.cli", "train", "--run-id", run_id]
    argv += ["--storage-root", str(storage_root), "--no-progress", *args]
    return subprocess.run(argv, capture_output=True, text=True, env=env, timeout=900)


def calls_per_step(storage: RunStorage, calls: Path) -> dict[int, int]:
    """Tool calls counted by the environment's side effect, by the step whose prompts they were for."""
    table = storage.read_rollouts(columns=["step", "prompt_id"]).to_pandas()
    step_of = dict(zip(table.prompt_id, table.step, strict=True))
    counted: dict[int, int] = {}
    for prompt_id in calls.read_text().split() if calls.exists() else []:
        counted[step_of[prompt_id]] = counted.get(step_of[prompt_id], 0) + 1
    return counted


@pytest.fixture(scope="module")
def unbroken_tool_run(prefect_server, storage_root, tools_model, tmp_path_factory):
    """The run both kill points are compared with, and the tool calls it made."""
    baseline = tmp_path_factory.mktemp("tools-kill") / "baseline.calls"
    done = train(storage_root, "tools-kill-base", baseline, *KILL_RUN)
    assert done.returncode == 0, done.stderr[-3000:]
    return RunStorage(storage_root, "tools-kill-base"), baseline


@pytest.mark.slow
@pytest.mark.parametrize("fail_at, redone", [("actor@3:kill", set()), ("score@3:kill", {3})])
def test_a_killed_multi_turn_run_resumes_to_the_same_weights_without_calling_tools_again(
    unbroken_tool_run, storage_root, tmp_path, fail_at, redone
):
    """actor@3: step 3's rollouts are logged, the actor has not stepped; score@3: its tools ran, nothing is
    logged. Either way the resumed run ends with the unbroken run's weights, and a logged step's tools never
    run again (only step 3 of score@3, never logged before the kill, calls them a second time)."""
    unbroken, baseline = unbroken_tool_run

    run_id = f"tools-kill-{fail_at[:5]}"
    before, after = tmp_path / "before.calls", tmp_path / "after.calls"
    killed = train(storage_root, run_id, before, *KILL_RUN, fail_at=fail_at)
    assert killed.returncode == -9, killed.stderr[-3000:]
    resumed = train(storage_root, run_id, after, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    storage = RunStorage(storage_root, run_id)

    weights = [load_file(s.checkpoint_dir(4) / "model" / "model.safetensors") for s in (storage, unbroken)]
    assert all((weights[0][k] == weights[1][k]).all() for k in weights[1])
    expected = calls_per_step(unbroken, baseline)
    assert sum(expected.values()) > 0
    counted_before, counted_after = calls_per_step(storage, before), calls_per_step(storage, after)
    assert set(counted_after) == {4} | redone  # nothing logged before the kill was played again
    total = {step: counted_before.get(step, 0) + counted_after.get(step, 0) for step in expected}
    assert total == {step: n * (2 if step in redone else 1) for step, n in expected.items()}
    assert (
        rollouts(storage)
        .reset_index(drop=True)[["step", "completion", "advantage"]]
        .equals(rollouts(unbroken).reset_index(drop=True)[["step", "completion", "advantage"]])
    )


# -- every backend and engine plays episodes --------------------------------------------------------------
def test_episodes_through_the_modal_wrappers(prefect_server, storage_root, tools_model, monkeypatch):
    import warnings

    monkeypatch.setenv("GRPO_FLOW_MODAL_MODE", "local")
    warnings.filterwarnings("ignore", message=".*executing locally and will not have access to the mounted Volume")
    storage = run(storage_root, "tools-modal-local", max_steps=2, backend="modal", weight_sync_method="direct")
    assert check_episode_rows(rollouts(storage), tools_model) > 0


@pytest.mark.ray
def test_episodes_on_ray_actors(prefect_server, storage_root, tools_model, ray_cluster):
    fields = dict(backend="ray", ray_address=ray_cluster.address, ray_actor_cpus=1.0, ray_rollout_cpus=0.5)
    storage = run(storage_root, "tools-ray", max_steps=2, **fields)
    assert check_episode_rows(rollouts(storage), tools_model) > 0


@pytest.mark.vllm
@pytest.mark.slow
def test_episodes_with_the_vllm_engine(prefect_server, storage_root, tools_model):
    """vLLM's turns get the IS correction (its sampling log-probs, model tokens only)."""
    storage = run(storage_root, "tools-vllm", max_steps=2, rollout_engine="vllm", num_rollout_workers=1)
    table = rollouts(storage)
    assert check_episode_rows(table, tools_model) > 0
    assert all(key in storage.read_metrics().column_names for key in ("sampling/importance_sampling_ratio/mean",))


# -- the preset learns ----------------------------------------------------------------------------------
@pytest.mark.slow
def test_the_tiny_tools_preset_learns_to_use_its_tool(prefect_server, storage_root, tools_model):
    """The bar: held-out accuracy (greedy episodes, 200 prompts) rises by at least 0.5 from the warm start's
    guess (about 0.3), and the trained policy with its tool disabled stays a guess (at most 0.2). The first
    40 of the preset's 120 steps, its first checkpoint: held-out accuracy is 1.00 there already (docs/tools.md)."""
    import torch

    from grpo_flow.workers.data.loaders import load_task
    from grpo_flow.workers.rollout.episodes import EpisodeRunner
    from grpo_flow.workers.rollout.heldout import heldout_accuracy
    from grpo_flow.workers.rollout.transformers_engine import TransformersRolloutEngine

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a model this small runs faster on one thread on a shared machine
    try:
        config = preset_config("tiny-tools", run_id="tiny-tools-learns", storage_root=str(storage_root), max_steps=40)
        summary = grpo(config)
    finally:
        torch.set_num_threads(threads)
    assert summary["status"] == "completed"
    assert summary["final_eval_accuracy"] - summary["initial_eval_accuracy"] >= 0.5, summary
    final = RunStorage(storage_root, config.run_id).checkpoint_dir(config.max_steps) / "model"
    engine = TransformersRolloutEngine(final)
    engine.load()
    disabled = EpisodeRunner.from_config(config, final, tools_disabled=True)
    task = load_task(config.dataset)
    assert heldout_accuracy(engine, task, 200, config.max_completion_length, episodes=disabled) <= 0.2
