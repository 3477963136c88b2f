"""Prefect cache keys for the stages whose result is a reference to something on disk.

A key is (run uid, session, step, stage, shard, training-config hash) plus the task's
source, so a task that is run again for a stage already done gets its small result (a path)
back instead of doing it again. The run uid is written when the run is created, so a deleted
and recreated run of the same name never hits the old run's cache. The session is fresh at
every start of the run (`prepare_run`), because across starts the files decide, not the
cache: a cache cannot see that a damaged file was moved to quarantine and must be written
again (workers/state/resume.py), nor that the run folder was restored from a backup. (It was
the resume count once; a restored folder counts its resumes again from the backup's number,
so a resume after a restore met the keys of the resume that came after the backup, skipped
the commit of a step that was not on disk and failed with "has no rollouts for step N".)
Stages that return tensors or whole batches are not cached: results are cloudpickled, and
what they produce is on disk anyway.
"""

from __future__ import annotations

from typing import Any

from prefect.cache_policies import TASK_SOURCE, CacheKeyFnPolicy
from prefect.context import TaskRunContext


def step_stage_key(context: TaskRunContext, inputs: dict[str, Any]) -> str:
    config, plan = inputs["config"], inputs["plan"]
    stage = context.task.name
    shard = inputs.get("shard", "")
    return f"{plan.cache_scope}-step{inputs['step']}-{stage}{shard}-{config.training_hash()}"


STEP_STAGE = CacheKeyFnPolicy(cache_key_fn=step_stage_key) + TASK_SOURCE
