"""Parity with TRL: grpo-flow's actor against TRL's own GRPOTrainer, one optimizer step (or num_iterations).

Both sides get the same prompts, completions, rewards and initial weights. TRL's generation is replaced by
fixed completions (`_generate_single_turn` patched on the trainer instance) and its rewards come from reward
functions that look the fixed rewards up; TRL then runs its own loop (`trainer.train()`): sampler, advantages,
old/ref log-probs, IS correction, loss, clipping, optimizer and scheduler. grpo-flow's side is the Actor fed
the rollouts table its flow would log, with advantages from the flow's own `step_advantages`.

TRL's GRPOConfig is built here from the option values, not with `grpo_flow.workers.actor.trl_objective.grpo_args`, so a wrong
mapping there fails these tests. The loss, every weight after the step, TRL's advantages and the metrics both
sides log under the same name must agree. A TRL upgrade that changes behaviour fails here.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pytest
import torch

from grpo_flow.schemas.config import GRPOFlowConfig
from grpo_flow.workers.actor.advantages import step_advantages
from grpo_flow.workers.actor.actor import Actor

PROMPTS = ["6900=", "026773=", "468="]  # different lengths: left padding matters
NUM_GENERATIONS = 4
MAX_COMPLETION_LENGTH = 4
SEED = 7
TEMPERATURE = 0.9
# Shared by both sides, passed under TRL's names. The linear schedule makes the second of num_iterations
# optimizer steps use half the rate, so the scheduler's step count is checked too.
COMMON = dict(
    learning_rate=1e-3,
    lr_scheduler_type="linear",
    warmup_steps=0,
    weight_decay=0.0,
    max_grad_norm=0.5,
    seed=SEED,
    num_generations=NUM_GENERATIONS,
    max_completion_length=MAX_COMPLETION_LENGTH,
    temperature=TEMPERATURE,
)
LOSS_ATOL, LOSS_RTOL = 1e-6, 1e-5
# Weights: Adam's first update is lr * g / (|g| + 1e-8), about lr * sign(g). Where a gradient nearly cancels
# (|g| ~ 1e-8), float noise in its sum (TRL shuffles the rows, so its sums run in another order) moves that
# update by a visible fraction of lr: seen up to 2.3e-3 x lr on a few of the ~60k weights on an Intel Xeon, and
# 1.4e-2 x lr on one weight on an AMD EPYC (other BLAS kernels, other sums). Allowed: 5e-2 x lr. A wrong
# objective moves updates by about lr (Adam's update is about lr * sign(g)); the loss is compared tightly above.
WEIGHT_ATOL_PER_LR, WEIGHT_RTOL = 5e-2, 1e-5
METRIC_ATOL, METRIC_RTOL = 1e-5, 1e-4


@dataclass
class Case:
    options: dict[str, Any] = field(default_factory=dict)  # TRL option names, given to both sides
    vllm_is: bool = False  # TRL's vLLM IS correction on (use_vllm set on the instance); sampling log-probs differ
    two_rewards: bool = False  # two reward functions (reward_weights, multi_objective_aggregation apply)

    @property
    def num_iterations(self) -> int:
        return self.options.get("num_iterations", 1)

    @property
    def settings(self) -> dict[str, Any]:
        """Every option both sides get (TRL's names): the common ones, overridden by the case's."""
        return {**COMMON, **self.options}


CASES = {
    "grpo": Case({"loss_type": "grpo"}),
    "dapo": Case({"loss_type": "dapo"}),
    "dr_grpo": Case({"loss_type": "dr_grpo"}),
    "bnpo": Case({"loss_type": "bnpo"}),
    "cispo": Case({"loss_type": "cispo"}),  # epsilon_high = epsilon: the ratio cap (0.2) binds
    "cispo_epsilon_high": Case({"loss_type": "cispo", "epsilon_high": 5.0, "num_iterations": 2}),
    "sapo": Case({"loss_type": "sapo"}),
    "luspo": Case({"loss_type": "luspo", "importance_sampling_level": "sequence"}),
    "vespo": Case({"loss_type": "vespo"}),
    # Their coefficients act on the importance ratio, so off-policy (num_iterations=2) is where they show.
    "sapo_temperatures": Case(
        {
            "loss_type": "sapo",
            "sapo_temperature_neg": 2.0,
            "sapo_temperature_pos": 0.5,
            "num_iterations": 2,
            "epsilon": 0.02,
        }
    ),
    "vespo_coefficients": Case(
        {
            "loss_type": "vespo",
            "vespo_k_pos": 1.0,
            "vespo_lambda_pos": 1.5,
            "vespo_k_neg": 4.0,
            "vespo_lambda_neg": 1.0,
            "num_iterations": 2,
            "epsilon": 0.02,
        }
    ),
    # Every loss again off-policy: the second optimizer step reuses the batch, so ratios differ from 1.
    **{
        f"{loss}_num_iterations_2": Case({"loss_type": loss, "num_iterations": 2, "epsilon": 0.02})
        for loss in ("grpo", "dapo", "dr_grpo", "sapo", "vespo")
    },  # bnpo = dapo with one micro-batch
    "luspo_num_iterations_2": Case(
        {"loss_type": "luspo", "importance_sampling_level": "sequence", "num_iterations": 2, "epsilon": 0.02}
    ),
    # beta > 0: TRL loads a frozen reference. At the first optimizer step the policy is the reference, so the KL
    # term and its gradient vanish; the second step (num_iterations=2) is where beta acts.
    "beta": Case({"loss_type": "grpo", "beta": 0.1, "num_iterations": 2}),
    "beta_without_bias_correction_kl": Case(
        {"loss_type": "grpo", "beta": 0.1, "num_iterations": 2, "use_bias_correction_kl": False}
    ),
    # Masks negative-advantage sequences that drifted from the sampling policy; the first step's update makes
    # them drift in the second.
    "off_policy_mask_threshold": Case(
        {
            "loss_type": "grpo",
            "off_policy_mask_threshold": 1e-4,
            "num_iterations": 2,
            "epsilon": 0.02,
            "learning_rate": 1e-2,
        }
    ),
    "off_policy_mask_threshold_is": Case(
        {
            "loss_type": "grpo",
            "off_policy_mask_threshold": 1e-4,
            "vllm_importance_sampling_correction": True,
            "vllm_importance_sampling_mode": "token_truncate",
            "vllm_importance_sampling_clip_min": None,
            "vllm_importance_sampling_clip_max": 3.0,
        },
        vllm_is=True,
    ),
    "gspo_sequence_level": Case(
        {"loss_type": "grpo", "importance_sampling_level": "sequence", "num_iterations": 2, "epsilon": 0.01}
    ),
    "epsilon_high": Case({"loss_type": "dapo", "epsilon": 0.01, "epsilon_high": 0.03, "num_iterations": 2}),
    # delta caps the ratio of negative-advantage tokens whose probability rose in the first optimizer step. It binds
    # here: without it TRL's loss is 0.021 instead of 2e-6.
    "delta_two_sided": Case(
        {"loss_type": "grpo", "epsilon": 0.001, "delta": 1.002, "num_iterations": 2, "learning_rate": 1e-2}
    ),
    "mask_truncated_completions": Case({"loss_type": "dapo", "mask_truncated_completions": True}),
    "top_entropy_quantile": Case({"loss_type": "grpo", "top_entropy_quantile": 0.5}),
    "scale_rewards_batch": Case({"loss_type": "grpo", "scale_rewards": "batch"}),
    "scale_rewards_none": Case({"loss_type": "dapo", "scale_rewards": "none"}),
    "normalize_then_sum": Case(
        {"loss_type": "grpo", "multi_objective_aggregation": "normalize_then_sum", "reward_weights": [1.0, 0.5]},
        two_rewards=True,
    ),
    "sum_then_normalize": Case(
        {"loss_type": "grpo", "multi_objective_aggregation": "sum_then_normalize", "reward_weights": [0.7, 2.0]},
        two_rewards=True,
    ),
    **{
        f"is_{mode}": Case(
            {
                "loss_type": "grpo",
                "vllm_importance_sampling_correction": True,
                "vllm_importance_sampling_mode": mode,
                **bounds,
            },
            vllm_is=True,
        )
        for mode, bounds in {
            "token_truncate": {"vllm_importance_sampling_clip_min": None, "vllm_importance_sampling_clip_max": 1.3},
            "token_mask": {"vllm_importance_sampling_clip_min": 0.8, "vllm_importance_sampling_clip_max": 1.3},
            "sequence_truncate": {"vllm_importance_sampling_clip_min": 0.8, "vllm_importance_sampling_clip_max": 1.25},
            "sequence_mask": {"vllm_importance_sampling_clip_min": 0.8, "vllm_importance_sampling_clip_max": 1.25},
        }.items()
    },
    "is_sequence_mask_dapo_num_iterations_2": Case(
        {
            "loss_type": "dapo",
            "num_iterations": 2,
            "vllm_importance_sampling_correction": True,
            "vllm_importance_sampling_mode": "sequence_mask",
            "vllm_importance_sampling_clip_min": 0.8,
            "vllm_importance_sampling_clip_max": 1.25,
        },
        vllm_is=True,
    ),
    "is_token_mask_vespo": Case(
        {
            "loss_type": "vespo",
            "vllm_importance_sampling_correction": True,
            "vllm_importance_sampling_mode": "token_mask",
            "vllm_importance_sampling_clip_min": 0.8,
            "vllm_importance_sampling_clip_max": 1.3,
        },
        vllm_is=True,
    ),
}


# -- the fixed step: prompts, completions, rewards, sampling log-probs ----------------------------------------
@dataclass
class Step:
    prompt_ids: list[list[int]]  # per prompt
    completions: list[list[list[int]]]  # [prompt][generation] -> token ids
    rewards: list[list[list[float]]]  # [prompt][generation] -> one reward per function
    sampling_logprobs: list[list[list[float]]]  # [prompt][generation] -> per token
    eos: int

    def rows(self):
        for p, prompt in enumerate(self.prompt_ids):
            for g in range(NUM_GENERATIONS):
                yield p, g, prompt, self.completions[p][g]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Both sides run in this process with the same settings; one thread is several times faster for a model
    this small on a shared machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def initial_weights(model_path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def tokenizer(model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


@torch.no_grad()
def own_logprobs(model, prompt: list[int], completion: list[int]) -> list[float]:
    """The model's log-probs of a completion's tokens at TEMPERATURE (one unpadded sequence)."""
    ids = torch.tensor([prompt + completion])
    logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float() / TEMPERATURE
    return torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(completion).unsqueeze(1)).squeeze(1).tolist()


@pytest.fixture(scope="module")
def step(model_path, tokenizer) -> Step:
    """Completions of 1-4 tokens: most end in EOS ("stop"); every third has 4 digits and no EOS ("length").
    Distinct within a group; rewards fixed at random (two functions); sampling log-probs = the model's own
    minus per-token noise, so TRL's vLLM IS ratio is not 1 (some sequences and tokens fall outside the bounds)."""
    from transformers import AutoModelForCausalLM

    rng = random.Random(SEED)
    digits = [tokenizer(d, add_special_tokens=False)["input_ids"][0] for d in "0123456789"]
    eos = tokenizer.eos_token_id
    # How TRL tokenizes plain-text prompts (`_tokenize_prompts`).
    prompt_ids = tokenizer(text=PROMPTS)["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    completions, rewards, sampling = [], [], []
    for p, prompt in enumerate(prompt_ids):
        group: list[list[int]] = []
        while len(group) < NUM_GENERATIONS:
            if (p * NUM_GENERATIONS + len(group)) % 3 == 2:
                completion = [rng.choice(digits) for _ in range(MAX_COMPLETION_LENGTH)]
            else:
                completion = [rng.choice(digits) for _ in range(rng.randrange(MAX_COMPLETION_LENGTH))] + [eos]
            if completion not in group:
                group.append(completion)
        completions.append(group)
        rewards.append([[round(rng.uniform(0, 1), 3), float(rng.choice([0, 1]))] for _ in group])
        sampling.append([[lp - rng.uniform(-0.35, 0.35) for lp in own_logprobs(model, prompt, c)] for c in group])
    assert any(c[-1] != eos for group in completions for c in group) and any(
        c[-1] == eos for group in completions for c in group
    )
    return Step(prompt_ids, completions, rewards, sampling, eos)


# -- grpo-flow's side -----------------------------------------------------------------------------------------
def rollouts_table(step: Step, config: GRPOFlowConfig, num_functions: int) -> pa.Table:
    """The rollouts table the flow logs for this step: group-major rows, the flow's own advantages."""
    rows = list(step.rows())
    per_function = {f"reward_{k}": [step.rewards[p][g][k] for p, g, _, _ in rows] for k in range(num_functions)}
    advantages, _ = step_advantages(config, per_function)
    return pa.table(
        {
            "prompt_token_ids": [prompt for _, _, prompt, _ in rows],
            "completion_token_ids": [completion for _, _, _, completion in rows],
            "sampling_logprobs": [step.sampling_logprobs[p][g] for p, g, _, _ in rows],
            "advantage": advantages.tolist(),
            "finish_reason": ["stop" if completion[-1] == step.eos else "length" for _, _, _, completion in rows],
            "policy_version": [0] * len(rows),
        }
    )


def run_grpo_flow(model_path, step: Step, case: Case):
    options = case.settings
    if not case.vllm_is:
        # TRL without vLLM applies no IS correction; grpo-flow's equivalent is the option off.
        options["vllm_importance_sampling_correction"] = False
    config = GRPOFlowConfig(run_id="trl-parity", prompts_per_step=len(PROMPTS), max_steps=1, **options)
    table = rollouts_table(step, config, 2 if case.two_rewards else 1)
    actor = Actor(config, model_path)
    actor.load()
    # Whether the rollout engine's log-probs can differ from the actor's (vLLM; TRL's use_vllm): then the
    # IS correction applies. The local fp32 engine's equal the actor's, and load() says so.
    actor.sampling_matches_actor = not case.vllm_is
    metrics = actor.step(0, table)
    weights = {k: v.detach().clone() for k, v in actor.model.state_dict().items()}
    return metrics, weights, table


# -- TRL's side -----------------------------------------------------------------------------------------------
def run_trl(model_path, tokenizer, step: Step, case: Case, output_dir):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    prompt_by_ids = {tuple(ids): p for p, ids in enumerate(step.prompt_ids)}
    lookup = {(PROMPTS[p], tuple(c)): (p, g) for p, g, _, c in step.rows()}

    def fixed_generation(prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        """TRL's sampler repeats each prompt num_generations times in a row: hand out that prompt's completions."""
        assert num_generations == NUM_GENERATIONS and images is None
        handed: dict[int, int] = {}
        completion_ids, logprobs = [], []
        for ids in prompt_ids:
            p = prompt_by_ids[tuple(ids)]
            g = handed[p] = handed.get(p, -1) + 1
            completion_ids.append(list(step.completions[p][g]))
            logprobs.append(list(step.sampling_logprobs[p][g]))
        assert sorted(handed.values()) == [NUM_GENERATIONS - 1] * len(PROMPTS), "a step must use every prompt once"
        return completion_ids, (logprobs if case.vllm_is else None)

    def reward_function(k):
        def reward(prompts, completions, completion_ids, **kwargs):
            return [
                step.rewards[p][g][k]
                for p, g in (lookup[(pr, tuple(c))] for pr, c in zip(prompts, completion_ids, strict=True))
            ]

        reward.__name__ = f"reward_{k}"
        return reward

    args = GRPOConfig(
        output_dir=str(output_dir),
        use_cpu=True,
        bf16=False,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        logging_steps=case.num_iterations,  # one log entry: metrics averaged over the step's optimizer steps
        max_steps=case.num_iterations,
        per_device_train_batch_size=len(PROMPTS) * NUM_GENERATIONS,
        gradient_accumulation_steps=1,
        **case.settings,
    )
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[reward_function(k) for k in range(2 if case.two_rewards else 1)],
        args=args,
        train_dataset=Dataset.from_dict({"prompt": PROMPTS}),  # exactly the step's prompts: one batch uses all
        processing_class=tokenizer,
    )
    assert (trainer.ref_model is not None) == (case.options.get("beta", 0.0) != 0.0)
    trainer._generate_single_turn = fixed_generation
    if case.vllm_is:
        trainer.use_vllm = True  # TRL applies its IS correction on the vLLM path only; generation stays fixed

    batches = []
    score = trainer._generate_and_score_completions

    def recording_score(inputs):
        output = score(inputs)
        batches.append(output)
        return output

    trainer._generate_and_score_completions = recording_score
    result = trainer.train()
    assert len(batches) == 1, "num_iterations steps must reuse one generation batch"
    logged = next(entry for entry in trainer.state.log_history if "entropy" in entry)
    weights = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    return result.training_loss, weights, logged, batches[0]


def trl_advantages_by_row(batch) -> dict[tuple, float]:
    """TRL's advantages keyed by (prompt ids, completion ids), whatever order its sampler chose."""
    out = {}
    for prompt, prompt_mask, completion, advantage in zip(
        batch["prompt_ids"].tolist(),
        batch["prompt_mask"].tolist(),
        batch["completion_ids"].tolist(),
        batch["advantages"].tolist(),
        strict=True,
    ):
        prompt = tuple(t for t, m in zip(prompt, prompt_mask, strict=True) if m)
        out[(prompt, tuple(completion))] = advantage
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_actor_step_matches_trl(name, model_path, tokenizer, step, initial_weights, tmp_path):
    case = CASES[name]
    metrics, ours, table = run_grpo_flow(model_path, step, case)
    trl_loss, theirs, logged, batch = run_trl(model_path, tokenizer, step, case, tmp_path)

    # Same advantages (TRL pads completions on the right with the pad token; rows matched by content).
    pad_id = tokenizer.pad_token_id
    trl_adv = trl_advantages_by_row(batch)
    width = max(len(c) for c in table.column("completion_token_ids").to_pylist())
    for prompt, completion, advantage in zip(
        table.column("prompt_token_ids").to_pylist(),
        table.column("completion_token_ids").to_pylist(),
        table.column("advantage").to_pylist(),
        strict=True,
    ):
        key = (tuple(prompt), tuple(completion + [pad_id] * (width - len(completion))))
        assert advantage == pytest.approx(trl_adv[key], abs=1e-6), f"advantage of {key}"

    # Same loss.
    assert metrics["loss"] == pytest.approx(trl_loss, abs=LOSS_ATOL, rel=LOSS_RTOL), (metrics["loss"], trl_loss)

    # Same weights after the step (which moved them by about lr, far beyond the tolerance).
    lr = case.settings["learning_rate"]
    assert ours.keys() == theirs.keys()
    moved = max(float((theirs[k] - initial_weights[k]).abs().max()) for k in theirs)
    assert moved > 0.5 * lr, f"TRL's step barely moved the weights ({moved})"
    for key in theirs:
        torch.testing.assert_close(
            ours[key], theirs[key], atol=WEIGHT_ATOL_PER_LR * lr, rtol=WEIGHT_RTOL, msg=lambda m, key=key: f"{key}: {m}"
        )

    # Same values under the metric names both log (TRL's log: means over the step's optimizer steps; the loss
    # there is rounded, the learning rate is the one after the step, grad_norm the last step's only).
    skip = {"loss", "learning_rate"} | ({"grad_norm"} if case.num_iterations > 1 else set())
    shared = sorted((set(metrics) & set(logged)) - skip)
    assert "entropy" in shared
    if case.settings.get("beta", 0.0):
        assert "kl" in shared
    if case.vllm_is:
        assert {"sampling/importance_sampling_ratio/mean", "sampling/sampling_logp_difference/mean"} <= set(shared)
    mismatched = {
        k: (metrics[k], logged[k])
        for k in shared
        if not math.isclose(metrics[k], logged[k], abs_tol=METRIC_ATOL, rel_tol=METRIC_RTOL)
    }
    assert not mismatched, f"metrics differ (grpo-flow, TRL): {mismatched}"
