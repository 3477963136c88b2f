"""Multi-turn rows in the loss: only the model's own tokens (tool_mask 1) train, as TRL's tool_mask; tool
and environment tokens are attended to and nothing else."""

import pyarrow as pa
import pytest
import torch

from grpo_flow.schemas.config import GRPOFlowConfig
from grpo_flow.workers.actor import trl_objective
from grpo_flow.workers.actor.actor import loss_inputs, micro_batches
from grpo_flow.workers.data.tiny_model import build_model, build_tokenizer

# Two episodes (model tokens, then three tool tokens, then model tokens) and one single-turn row.
COMPLETIONS = [[5, 6, 7, 8, 9, 10, 2], [11, 12, 13, 14, 15], [16, 17]]
MASKS = [[1, 1, 0, 0, 0, 1, 1], [1, 0, 0, 0, 1], None]


def rows(sampling=None):
    return pa.table(
        {
            "prompt_token_ids": [[40, 41, 42], [43, 44], [45]],
            "completion_token_ids": COMPLETIONS,
            "sampling_logprobs": sampling or [[-1.0] * len(c) for c in COMPLETIONS],
            "advantage": [1.0, -0.5, 0.7],
            "finish_reason": ["stop", "length", "stop"],
            "policy_version": [0, 0, 0],
            "tool_mask": pa.array(MASKS, type=pa.list_(pa.int8())),
        }
    )


def test_logged_masks_become_trls_tool_mask_and_the_token_count():
    inputs = loss_inputs(rows(), pad_token_id=0)
    assert inputs["tool_mask"].tolist() == [[1, 1, 0, 0, 0, 1, 1], [1, 0, 0, 0, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1]]
    assert inputs["num_items_in_batch"] == 4 + 2 + 2  # model tokens only (padding is out by the completion mask)
    truncated = loss_inputs(rows(), pad_token_id=0, mask_truncated=True)
    assert truncated["num_items_in_batch"] == 4 + 2
    single = loss_inputs(rows().drop_columns(["tool_mask"]), pad_token_id=0)
    assert "tool_mask" not in single and single["num_items_in_batch"] == 14


def test_micro_batches_carry_the_tool_mask_with_their_rows():
    inputs = loss_inputs(rows(), pad_token_id=0)
    parts = micro_batches(inputs, max_tokens=12)
    assert len(parts) == 3
    assert [p["tool_mask"].tolist() for p in parts] == [[m] for m in [[1, 1, 0, 0, 0, 1, 1], [1, 0, 0, 0, 1], [1, 1]]]


@pytest.fixture(scope="module")
def objective(tmp_path_factory):
    torch.set_num_threads(1)
    tokenizer = build_tokenizer()
    model = build_model(tokenizer)
    config = GRPOFlowConfig(model="unused", num_generations=3, prompts_per_step=1, loss_type="grpo")
    return trl_objective.make_objective(model, tokenizer, config)


def scoring_gradient(objective, inputs):
    """The loss's gradient with respect to the last hidden state that scores each completion token (the
    final norm's output at the position before it: nothing else reads it)."""
    captured = {}

    def keep(module, args, output):
        output.retain_grad()
        captured["hidden"] = output

    hook = objective.model.model.norm.register_forward_hook(keep)
    try:
        loss, _ = trl_objective.compute_loss(objective, objective.model, inputs)
        loss.backward()
    finally:
        hook.remove()
        objective.model.zero_grad(set_to_none=True)
    width = inputs["prompt_ids"].size(1)
    return captured["hidden"].grad[:, width - 1 : -1].abs().sum(-1)


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "bnpo"])
def test_tool_tokens_get_no_gradient_and_model_tokens_do(objective, loss_type):
    objective.loss_type = loss_type
    inputs = loss_inputs(rows(), pad_token_id=0)
    inputs["old_per_token_logps"] = trl_objective.old_logprobs(objective, inputs)
    gradient = scoring_gradient(objective, inputs)
    mask = inputs["tool_mask"] * inputs["completion_mask"]
    assert torch.all(gradient[mask == 0] == 0)
    assert torch.all(gradient[mask == 1] > 0)


def test_the_is_correction_reads_the_models_tokens_only(objective):
    objective.loss_type = "dapo"
    objective.vllm_importance_sampling_mode = "sequence_mask"
    losses = []
    for tool_logprob in (0.0, -30.0):  # what the sampling log-probs say at tool positions must not matter
        sampling = [
            [-1.0 if m is None or m[i] else tool_logprob for i in range(len(c))]
            for c, m in zip(COMPLETIONS, MASKS, strict=True)
        ]
        inputs = loss_inputs(rows(sampling), pad_token_id=0)
        inputs["old_per_token_logps"] = trl_objective.old_logprobs(objective, inputs)
        ratio, metrics = trl_objective.importance_sampling_ratio(
            objective,
            inputs["old_per_token_logps"],
            inputs["sampling_per_token_logps"],
            trl_objective.loss_mask(inputs),
        )
        inputs["importance_sampling_ratio"] = ratio
        losses.append((float(trl_objective.compute_loss(objective, objective.model, inputs)[0].detach()), metrics))
    assert losses[0] == losses[1]
