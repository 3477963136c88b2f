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
