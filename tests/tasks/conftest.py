"""The tasks' tests share one RunPlan shape: each test file's `config` fixture names the run."""

import pytest

from grpo_flow.schemas.records import RunPlan
from grpo_flow.workers.data.loaders import load_task


@pytest.fixture
def plan(config):
    return RunPlan(
        run_id=config.run_id,
        storage_root=config.storage_root,
        model_path="unused",
        total_steps=10,
        reward_names=("last_digit",),
        extra_columns=("answer",),
        num_train_prompts=len(load_task("last_digit").train),
    )
