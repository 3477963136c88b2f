"""What `grpo train` and GRPOFlowTrainer check before anything loads (flows/checks.py)."""

import pytest
from huggingface_hub import constants

from grpo_flow.flows.checks import StartCheckError, check_before_start
from grpo_flow.schemas.config import GRPOFlowConfig

HUB_MODEL = "someone/not-a-cached-model"


@pytest.fixture
def unreachable_hub(tmp_path, monkeypatch):
    """An empty hub cache, and a hub endpoint where nothing listens."""
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # the discard port: nothing answers
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    for name in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
    return tmp_path / "hub"


def config(tmp_path, **fields):
    return GRPOFlowConfig(storage_root=str(tmp_path / "storage"), reward_funcs=["last_digit"], **fields)


def test_a_hub_model_that_is_not_cached_and_cannot_be_downloaded_is_refused_at_once(tmp_path, unreachable_hub):
    with pytest.raises(StartCheckError) as caught:
        check_before_start(config(tmp_path, model=HUB_MODEL))
    assert caught.value.field == "model"
    assert caught.value.message.startswith(f"{HUB_MODEL!r} is not in the Hugging Face cache and 127.0.0.1 cannot be")
    assert "hf download someone/not-a-cached-model" in caught.value.message


def test_offline_mode_refuses_an_uncached_model_and_takes_a_cached_one(tmp_path, unreachable_hub, monkeypatch):
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(StartCheckError, match="is not in the Hugging Face cache and HF_HUB_OFFLINE is set"):
        check_before_start(config(tmp_path, model=HUB_MODEL))
    # The hub cache's layout: refs/main names the snapshot that holds the files.
    repo = unreachable_hub / "models--someone--not-a-cached-model"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0" * 40)
    (repo / "snapshots" / ("0" * 40)).mkdir(parents=True)
    (repo / "snapshots" / ("0" * 40) / "config.json").write_text("{}")
    check_before_start(config(tmp_path, model=HUB_MODEL))  # loads from the cache, offline too


def test_behind_a_proxy_the_hub_is_not_probed(tmp_path, unreachable_hub, monkeypatch):
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.invalid:3128")
    check_before_start(config(tmp_path, model=HUB_MODEL))  # the proxy may reach what this machine cannot


def test_a_data_file_is_checked_before_a_run_starts_and_a_missing_one_is_no_hub_id(tmp_path, monkeypatch):
    """`hf:missing.jsonl` was taken for a hub id and failed after 16-38 s (issue 30, item 12)."""
    import time

    monkeypatch.chdir(tmp_path)
    (tmp_path / "bad.jsonl").write_text('{"prompt": "1=", "answer": "1"}\n{"prompt": "2=" "answer": "2"}\n')
    (tmp_path / "empty.jsonl").write_text("\n")
    started = time.perf_counter()
    for dataset, message in (
        ("hf:missing.jsonl", "'missing.jsonl': no such file"),
        ("hf:bad.jsonl", "'bad.jsonl': line 2 is not JSON (Expecting ',' delimiter, column 17)"),
        ("hf:empty.jsonl", "'empty.jsonl': the file is empty (no rows)"),
    ):
        with pytest.raises(StartCheckError) as caught:
            check_before_start(config(tmp_path, dataset=dataset))
        assert (caught.value.field, caught.value.message) == ("dataset", message)
    assert time.perf_counter() - started < 2


def test_an_accuracy_reward_is_checked_before_a_run_starts(tmp_path):
    (tmp_path / "d.jsonl").write_text('{"prompt": "1=", "answer": "1"}\n{"prompt": "2=", "answer": "2"}\n')
    data = f"hf:{tmp_path / 'd.jsonl'}"
    check_before_start(config(tmp_path, dataset=data, accuracy_reward="last_digit"))
    check_before_start(config(tmp_path, dataset=data, accuracy_reward="gsm8k_accuracy"))  # any built-in
    with pytest.raises(
        StartCheckError, match=r"^accuracy_reward: 'nope' is not one of reward_funcs \(last_digit\), and"
    ):
        check_before_start(config(tmp_path, dataset=data, accuracy_reward="nope"))
    with pytest.raises(StartCheckError, match="^accuracy_reward: is for hf: data sets; 'last_digit' scores held-out"):
        check_before_start(config(tmp_path, accuracy_reward="last_digit"))


def test_a_step_that_cannot_fit_the_memory_available_is_refused_before_anything_loads(tmp_path, monkeypatch):
    from transformers import LlamaConfig

    from grpo_flow.workers.actor import memory

    model = tmp_path / "model"
    LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9).save_pretrained(
        model
    )
    monkeypatch.setattr(memory, "machine_memory", lambda: (24 * memory.GIB, 1 * memory.GIB))
    with pytest.raises(StartCheckError) as caught:
        check_before_start(config(tmp_path, model=str(model)))
    assert caught.value.field == "use_lora"
    assert caught.value.message.startswith("a step needs about ")
    assert "1.0 GiB is available; shrink it with use_lora, gradient_checkpointing, fewer completions per step" in (
        caught.value.message
    )
    monkeypatch.setattr(memory, "machine_memory", lambda: (24 * memory.GIB, 20 * memory.GIB))
    check_before_start(config(tmp_path, model=str(model)))
