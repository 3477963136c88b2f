"""bf16 sampling with the importance-sampling correction: with `vllm_dtype` bfloat16 the run's vLLM engine samples
in bfloat16 while the actor trains in fp32. The step's logged sampling log-probs (its rollout Parquet) are the
ones the engine returned, they differ from the fp32 actor's, and the actor's IS ratio is taken against them.

One bfloat16 engine start, through the local backend as a run starts it; the step's stages as the flow calls
them (generate, score, advantages, write and commit, actor step) without Prefect. The model is the tiny
architecture at hidden size 384 (head_dim 192): a bfloat16 engine of the 64-wide tiny model (head_dim 32) dies
during its start on the CI machine's CPU (docs/vllm.md, "Known problem").
"""

from __future__ import annotations

import math

import pytest
import torch

from grpo_flow.schemas.presets import preset_config
from grpo_flow.schemas.records import RunPlan
from grpo_flow.tasks.rollout import commit_rollouts, compute_advantages, generate, sample_batch, score, write_rollouts
from grpo_flow.tasks.train import actor_step
from grpo_flow.workers import backends
from grpo_flow.workers.actor.actor import Actor
from grpo_flow.workers.data.loaders import load_task
from grpo_flow.workers.data.tiny_model import build_model, build_tokenizer
from grpo_flow.workers.rollout.vllm_process import VLLMProcessEngine
from grpo_flow.workers.state.storage import RunStorage

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bf16-model")
    tokenizer = build_tokenizer()
    build_model(tokenizer, hidden_size=384, layers=1).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def test_bf16_sampling_logs_the_engines_logprobs_and_the_is_ratio_uses_them(model_path, tmp_path, monkeypatch):
    config = preset_config(
        "tiny",
        run_id="bf16-sampling",
        storage_root=str(tmp_path),
        model=model_path,
        rollout_engine="vllm",
        vllm_dtype="bfloat16",
        num_rollout_workers=1,
        prompts_per_step=4,
        num_generations=4,
        max_completion_length=6,
        eval_prompts=0,
        vllm_importance_sampling_mode="token_mask",
        vllm_importance_sampling_clip_min=None,
        vllm_importance_sampling_clip_max=None,  # nothing masked: the ratio as computed
    )
    returned = []  # what the engine returned, as its caller got it
    engine_dtypes = []
    original = VLLMProcessEngine.generate

    def recorded(self, *args, **kwargs):
        engine_dtypes.append(self.options.dtype)
        result = original(self, *args, **kwargs)
        returned.append(result)
        return result

    monkeypatch.setattr(VLLMProcessEngine, "generate", recorded)
    plan = RunPlan(
        config.run_id, str(tmp_path), model_path, 1, ("last_digit",), ("answer",), len(load_task("last_digit").train)
    )
    backends.start_workers(config, model_path)
    try:
        (shard,) = sample_batch.fn(config, plan, 1)
        batch = score.fn(config, plan, generate.fn(config, plan, shard, 0))
        (scored,), _ = compute_advantages(config, [batch])
        write_rollouts(config, plan, scored, 0)
        commit_rollouts(config, plan, 1)
        metrics = actor_step.fn(config, plan, 1, 0)
    finally:
        backends.release(config.run_id)

    assert engine_dtypes == ["bfloat16"]
    (result,) = returned
    logged = RunStorage(str(tmp_path), config.run_id).read_rollouts(1)
    assert logged.column("completion_token_ids").to_pylist() == result.completion_token_ids
    sampled = logged.column("sampling_logprobs").to_pylist()  # float32 in the Parquet
    engine = [torch.tensor(row, dtype=torch.float32).tolist() for row in result.sampling_logprobs]
    assert sampled == engine

    fp32 = Actor(config, model_path)  # the run's actor before its step: the same initial weights
    fp32.load()
    prompts = logged.column("prompt_token_ids").to_pylist()[:: config.num_generations]
    ours = fp32.completion_logprobs(prompts, logged.column("completion_token_ids").to_pylist())
    gaps = [a - s for row_a, row_s in zip(ours, sampled, strict=True) for a, s in zip(row_a, row_s, strict=True)]
    assert max(abs(g) for g in gaps) > 1e-3  # bfloat16's gap (an fp32 engine's is under 1e-4: test_vllm_real.py)
    # TRL's ratio per token is exp(actor - sampling): taken against the logged log-probs, not the actor's own
    assert metrics["sampling/sampling_logp_difference/mean"] == pytest.approx(
        sum(abs(g) for g in gaps) / len(gaps), rel=1e-3
    )
    assert metrics["sampling/importance_sampling_ratio/mean"] == pytest.approx(
        sum(math.exp(g) for g in gaps) / len(gaps), rel=1e-4
    )
    assert metrics["sampling/importance_sampling_ratio/mean"] != pytest.approx(1.0, abs=1e-6)
