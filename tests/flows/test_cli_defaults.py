"""What `grpo train` starts from: a preset, TRL's defaults for a model of your own, and the data set
checked before anything loads (issue 34)."""

import json
import shutil

import pytest

from grpo_flow.flows.cli import build_config, make_parser, parse_overrides, starting_preset
from grpo_flow.schemas.presets import PRESETS
from cli_output import run_cli as cli  # tests/flows/cli_output.py

# TRL's GRPOConfig defaults that grpo-flow's fields share (the others are listed in docs/quickstart.md).
TRL_DEFAULTS = ("learning_rate", "num_generations", "max_completion_length", "temperature", "loss_type", "beta")


def config_for(*argv):
    args = make_parser().parse_args(["train", *argv])
    overrides = parse_overrides(args)
    return build_config(starting_preset(args.preset, overrides), overrides)


def trl_defaults():
    from trl import GRPOConfig

    theirs = GRPOConfig(output_dir="unused", use_cpu=True)
    return {name: getattr(theirs, name) for name in TRL_DEFAULTS}


def test_a_model_of_your_own_starts_from_trls_defaults_not_the_tiny_preset(tmp_path):
    """`--model smollm2-135m` without --preset ran with the tiny preset's learning rate (0.005), a full
    fine-tune and 2-token completions."""
    mine = tmp_path / "my-model"
    mine.mkdir()
    (mine / "config.json").write_text("{}")
    for model in (str(mine), "smollm2-135m", "Qwen/Qwen2.5-0.5B-Instruct"):
        config = config_for("--model", model)
        assert {name: getattr(config, name) for name in TRL_DEFAULTS} == trl_defaults(), model
        assert config.use_lora is False and config.max_steps == -1


def test_the_python_api_starts_a_model_of_your_own_from_trls_defaults_too(tmp_path):
    from datasets import Dataset

    from grpo_flow.flows.trainer import GRPOFlowTrainer

    mine = tmp_path / "my-model"
    mine.mkdir()
    (mine / "config.json").write_text("{}")
    data = Dataset.from_dict({"prompt": ["1=", "2="], "answer": ["1", "2"]})
    trainer = GRPOFlowTrainer(
        model=str(mine), reward_funcs=["last_digit"], train_dataset=data, storage_root=str(tmp_path)
    )
    assert {name: getattr(trainer.config, name) for name in TRL_DEFAULTS} == trl_defaults()


def test_the_tiny_models_without_a_preset_start_from_the_tiny_preset_and_a_preset_wins():
    tiny = {name: PRESETS["tiny"][name] for name in ("learning_rate", "max_completion_length")}
    for argv in ((), ("--model", "tiny"), ("--model", "tiny-reverse"), ("--model", "tiny", "--dataset", "hf:x.jsonl")):
        config = config_for(*argv)
        assert {name: getattr(config, name) for name in tiny} == tiny, argv
    assert config_for("--model", "tiny-tools").model == "tiny-tools"
    smol = config_for("--preset", "smol-math", "--model", "/elsewhere/model")
    assert (smol.learning_rate, smol.use_lora) == (5e-4, True)


def test_a_preset_s_lora_is_dropped_when_lora_is_turned_off_on_the_command_line(tmp_path):
    config = config_for("--preset", "smol-math", "--use-lora", "false")
    assert config.use_lora is False and config.lora_r is None and config.lora_target_modules is None
    refused = cli("train", "--preset", "tiny", "--lora-r", "8", "--storage-root", str(tmp_path))
    assert refused.returncode == 2
    assert refused.stderr.strip() == "grpo train: --lora-r: LoRA options given without use_lora"


@pytest.mark.parametrize(
    "rows, reward, expected",
    [
        (
            '{"question": "1=", "answer": "1"}\n',
            "exact",
            "--dataset: '{data}' has no 'prompt' column (columns: question, answer)",
        ),
        (
            '{"prompt": "1=", "solution": "1"}\n{"prompt": "2=", "solution": "2", "level": 1}\n',
            "exact",
            "--reward-funcs: exact needs the column 'answer', which data set '{data}' lacks "
            "(columns: prompt, solution, level)",
        ),
    ],
    ids=["no-prompt-column", "no-column-for-a-reward-keyword"],
)
def test_bad_data_is_refused_before_anything_loads(tmp_path, rows, reward, expected):
    """Both were found about 30 s in, with a traceback (a ValueError; a TypeError at the first step)."""
    data = tmp_path / "data.jsonl"
    data.write_text(rows)
    (tmp_path / "my_rewards.py").write_text(
        "def exact(completions, answer, **kwargs):\n    return [float(c == a) for c, a in zip(completions, answer)]\n"
    )
    store = tmp_path / "store"
    refused = cli(
        "train", "--dataset", "hf:data.jsonl", "--reward-funcs", f"my_rewards:{reward}", "--storage-root", str(store),
        cwd=tmp_path,
    )  # fmt: skip
    assert refused.returncode == 2
    assert refused.stderr.strip() == "grpo train: " + expected.format(data=data)
    assert not store.exists()  # no model, no run, no Prefect server


@pytest.mark.slow
def test_a_run_on_a_model_of_your_own_has_trls_defaults_and_says_so(storage_root, tmp_path):
    """The whole path: the tiny model saved under another folder (so not `tiny`), no --preset. The run trains
    with TRL's defaults, its start line says where each setting came from, and a reward that gives every
    completion the same score gets exactly one no-signal warning, after the third step."""
    from grpo_flow.workers.data.models import resolve_model_path

    mine = tmp_path / "my-model"
    shutil.copytree(resolve_model_path("tiny", storage_root), mine)
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{n}=", "answer": str(n % 10)}) + "\n" for n in range(100, 140)))
    (tmp_path / "flat_rewards.py").write_text("def same(completions, **kwargs):\n    return [1.0] * len(completions)\n")
    store = tmp_path / "store"
    trained = cli(
        "train", "--model", str(mine), "--dataset", "hf:data.jsonl", "--reward-funcs", "flat_rewards:same",
        "--max-steps", "4", "--eval-prompts", "0", "--run-id", "own-model", "--storage-root", str(store),
        "--no-progress", cwd=tmp_path, env_extra={"PREFECT_HOME": str(tmp_path / "prefect-home")},
    )  # fmt: skip
    assert trained.returncode == 0, trained.stderr[-3000:]
    stored = json.loads((store / "runs" / "own-model" / "config.json").read_text())
    assert {name: stored[name] for name in TRL_DEFAULTS} == trl_defaults()
    settings = (
        "grpo-flow: settings: learning_rate 1e-06 (default); LoRA off (every weight trains) (default); "
        "max_completion_length 512 (default); rollout_engine transformers (default); "
        "prompts x generations 8 x 8 (default); peak memory ~"
    )
    line = trained.stdout.splitlines()[1]
    assert line.startswith(settings) and line.endswith(" GiB (estimate)"), line
    warnings = [line for line in trained.stderr.splitlines() if "no learning signal" in line]
    assert warnings == [
        "grpo-flow: warning: steps 1-3: no learning signal: 0 % of groups had rewards that differ "
        "(frac_reward_zero_std 1.0), so every advantage is 0 and the policy does not move; try more completions "
        "per prompt (--num-generations), a softer reward that gives partial credit, or a higher --temperature"
    ]


@pytest.mark.slow
def test_string_prompts_on_a_chat_model_get_one_warning_or_go_as_user_messages(storage_root, tmp_path):
    """A chat model (the tiny model given a chat template) got plain-string prompts untemplated, TRL's rule,
    silently: the run now says so once at its start; `--string-prompts user_message` templates them, as if
    the data held messages."""
    from transformers import AutoTokenizer

    from grpo_flow.workers.data.models import resolve_model_path
    from grpo_flow.workers.state.storage import RunStorage

    chat_model = tmp_path / "chat-model"
    shutil.copytree(resolve_model_path("tiny", storage_root), chat_model)
    tokenizer = AutoTokenizer.from_pretrained(chat_model)
    tokenizer.chat_template = (
        "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    tokenizer.save_pretrained(chat_model)
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{n}=", "answer": str(n % 10)}) + "\n" for n in range(100, 120)))
    (tmp_path / "flat_rewards.py").write_text("def same(completions, **kwargs):\n    return [1.0] * len(completions)\n")
    common = [
        "train", "--model", str(chat_model), "--dataset", "hf:data.jsonl", "--reward-funcs", "flat_rewards:same",
        "--max-steps", "1", "--prompts-per-step", "2", "--num-generations", "2", "--max-completion-length", "2",
        "--eval-prompts", "0", "--storage-root", str(tmp_path / "store"), "--no-progress",
    ]  # fmt: skip
    env = {"PREFECT_HOME": str(tmp_path / "prefect-home")}
    raw = cli(*common, "--run-id", "strings-raw", cwd=tmp_path, env_extra=env)
    assert raw.returncode == 0, raw.stderr[-3000:]
    warned = [line for line in raw.stderr.splitlines() if line.startswith("grpo-flow: warning: ")]
    assert warned == [
        f"grpo-flow: warning: dataset: the prompts are plain strings and model '{chat_model}' has a chat template; "
        "as in TRL, a string prompt goes to the model as raw text, without the template (only a list of messages "
        "is rendered with it): --string-prompts user_message (string_prompts='user_message') sends each as a user "
        "message"
    ]
    wrapped = cli(
        *common, "--run-id", "strings-wrapped", "--string-prompts", "user_message", cwd=tmp_path, env_extra=env
    )
    assert wrapped.returncode == 0, wrapped.stderr[-3000:]
    assert "grpo-flow: warning" not in wrapped.stderr
    prompts = {
        run: RunStorage(tmp_path / "store", run).read_rollouts(1, columns=["prompt"])["prompt"].to_pylist()
        for run in ("strings-raw", "strings-wrapped")
    }
    assert all(prompt.endswith("=") and "<|" not in prompt for prompt in prompts["strings-raw"])
    assert all(p.startswith("<|user|>") and p.endswith("=<|assistant|>") for p in prompts["strings-wrapped"])
