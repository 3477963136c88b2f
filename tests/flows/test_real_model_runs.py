"""`grpo train --preset smol-math` on the real model (SmolLM2-135M-Instruct), short: 2 steps of 4 prompts x 4
completions of at most 16 tokens, transformers engine, LoRA as the preset has it.

- completions that stop at EOS with pad == eos: on the logged rows, the EOS is in the loss exactly once and
  nothing after it; a completion cut at the length limit has no EOS;
- the logged prompts went through the chat template once;
- the run's checkpoint loads in plain transformers and generates;
- a run SIGKILLed mid-step and resumed ends with bitwise the unbroken run's weights.
"""

from __future__ import annotations


import pytest
import torch
from safetensors.torch import load_file

from grpo_flow.workers.actor.actor import loss_inputs
from grpo_flow.workers.state.storage import RunStorage
from train_cli import final_weights, train_cli  # tests/flows/train_cli.py

pytestmark = [pytest.mark.real_model, pytest.mark.slow]

RUN = [
    "--preset",
    "smol-math",
    "--max-steps",
    "2",
    "--save-steps",
    "1",
    "--prompts-per-step",
    "4",
    "--num-generations",
    "4",
    "--max-completion-length",
    "16",
    "--eval-prompts",
    "0",
]
SYSTEM_PROMPT = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


@pytest.fixture(scope="module")
def unbroken(prefect_server, storage_root, smollm2_path):
    done = train_cli(storage_root, "smol-unbroken", *RUN, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return RunStorage(storage_root, "smol-unbroken")


@pytest.fixture(scope="module")
def tokenizer(smollm2_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_path)


def test_eos_is_in_the_loss_once_and_a_length_cut_has_none_on_logged_rows(unbroken, tokenizer):
    rows = unbroken.read_rollouts()
    eos = tokenizer.eos_token_id
    assert tokenizer.pad_token_id == eos
    reasons = rows.column("finish_reason").to_pylist()
    completions = rows.column("completion_token_ids").to_pylist()
    assert {"stop", "length"} <= set(reasons)  # both kinds occur in these 32 completions
    for tokens, reason in zip(completions, reasons, strict=True):
        if reason == "stop":
            assert tokens[-1] == eos and tokens.count(eos) == 1
        else:
            assert len(tokens) == 16 and eos not in tokens
    # What the actor trains on: padded with pad == eos, the mask covers each completion's own tokens only.
    inputs = loss_inputs(rows, tokenizer.pad_token_id)
    in_loss = (inputs["completion_ids"] == eos) & inputs["completion_mask"].bool()
    assert in_loss.sum(1).tolist() == [1 if reason == "stop" else 0 for reason in reasons]
    assert inputs["completion_mask"].sum(1).tolist() == [len(tokens) for tokens in completions]
    for row, tokens in enumerate(completions):  # nothing after the EOS is in the loss
        assert not inputs["completion_mask"][row, len(tokens) :].any()


def test_the_logged_prompts_went_through_the_chat_template_once(unbroken, tokenizer):
    start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    for ids in unbroken.read_rollouts(columns=["prompt_token_ids"]).column("prompt_token_ids").to_pylist():
        text = tokenizer.decode(ids)
        assert ids[0] == start and ids[1] != start and ids.count(start) == 3
        assert text.count(SYSTEM_PROMPT) == 1 and text.endswith("<|im_start|>assistant\n")


def test_the_runs_exported_checkpoint_loads_in_plain_transformers_and_generates(unbroken, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpo_flow.workers.actor.export import export_model

    folder = tmp_path / "exported"
    export_model(unbroken.checkpoint_dir(2), unbroken.root, folder)  # the adapter merged into smollm2-135m
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    messages = [{"role": "user", "content": "What is 2 + 3? Answer with just the number."}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    output = model.generate(**ids, max_new_tokens=8, do_sample=False)
    assert tokenizer.decode(output[0, ids["input_ids"].shape[1] :], skip_special_tokens=True).strip()


def test_a_run_killed_mid_step_resumes_to_the_unbroken_runs_weights(unbroken, storage_root):
    killed = train_cli(storage_root, "smol-killed", *RUN, fail_at="actor@2:kill", timeout=900)
    assert killed.returncode == -9, killed.stderr[-3000:]  # SIGKILL: nothing ran after it
    storage = RunStorage(storage_root, "smol-killed")
    assert storage.latest_valid_checkpoint() == 1
    resumed = train_cli(storage_root, "smol-killed", "--resume", timeout=900)
    assert resumed.returncode == 0 and "resuming run" in resumed.stdout, resumed.stderr[-3000:]
    ours, theirs = final_weights(storage, 2), final_weights(unbroken, 2)
    assert ours.keys() == theirs.keys()
    for name in ours:
        assert torch.equal(ours[name], theirs[name]), (
            f"{name} differs by {float((ours[name] - theirs[name]).abs().max())}"
        )
    ours, theirs = (
        load_file(s.checkpoint_dir(2) / "adapter" / "adapter_model.safetensors") for s in (storage, unbroken)
    )
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[name], theirs[name]) for name in ours)


def test_test_rollout_sends_a_chat_model_a_conversation(storage_root, smollm2_path):
    """`grpo test-rollout --prompt TEXT` on a chat model: given the bare string, SmolLM2 ended its turn at once."""
    from grpo_flow.flows.components import chat_if_templated
    from grpo_flow.schemas.presets import preset_config

    smol = preset_config("smol-math", storage_root=str(storage_root))
    assert chat_if_templated(["What is 4 + 5?"], smol) == [[{"role": "user", "content": "What is 4 + 5?"}]]
    tiny = preset_config("tiny", storage_root=str(storage_root))  # no chat template: the text as it is
    assert chat_if_templated(["35060="], tiny) == ["35060="]
