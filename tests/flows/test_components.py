"""The component commands (the seeds' test_rollout_fn, test_reward_fn, list_checkpoints_fn, clear_cache)."""

import json
import shutil
import warnings

import pytest

from grpo_flow.flows.cli import main
from grpo_flow.workers.data.tiny_model import ensure_tiny_model


def json_lines(text):
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def test_test_rollout_generates_n_completions_per_prompt(storage_root, capsys):
    code = main(
        [
            "test-rollout",
            "--storage-root",
            str(storage_root),
            "--prompt",
            "12 + 7 =",
            "--prompt",
            "3 + 4 =",
            "--n",
            "3",
            "--max-tokens",
            "5",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    rows = json_lines(out)
    assert [r["prompt"] for r in rows] == [0, 0, 0, 1, 1, 1]
    assert all(1 <= r["tokens"] <= 5 and r["finish_reason"] in ("stop", "length") for r in rows)
    assert all(r["mean_logprob"] <= 0 for r in rows)
    assert "local transformers engine" in out


def test_test_rollout_through_the_modal_rollout_worker(storage_root, capsys, monkeypatch):
    monkeypatch.setenv("GRPO_FLOW_MODAL_MODE", "local")
    warnings.filterwarnings("ignore", message=".*executing locally and will not have access to the mounted Volume")
    code = main(
        ["test-rollout", "--backend", "modal", "--storage-root", str(storage_root), "--n", "2", "--max-tokens", "4"]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    assert "Modal RolloutWorker (.local(), CPU, transformers)" in out and len(json_lines(out)) == 2


def test_test_rollout_names_a_bad_option(storage_root, capsys):
    assert main(["test-rollout", "--preset", "huge", "--storage-root", str(storage_root)]) == 2
    assert "--preset: unknown preset 'huge'" in capsys.readouterr().err


def test_test_reward_calls_the_function_as_a_run_does(tmp_path, monkeypatch, capsys):
    (tmp_path / "component_rewards.py").write_text(
        "def mentions_answer(prompts, completions, answer, trainer_state, log_metric, log_extra, **kwargs):\n"
        "    log_metric('seen_step', trainer_state.global_step)\n"
        "    log_extra('checked', ['yes' for _ in completions])\n"
        "    return [1.0 if str(a) in c else 0.0 for c, a in zip(completions, answer)]\n"
        "def not_for_me(completions, **kwargs):\n"
        "    return [None for _ in completions]\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    code = main(
        [
            "test-reward",
            "component_rewards:mentions_answer",
            "component_rewards:not_for_me",
            "math_accuracy",
            "--completion",
            "so it is \\boxed{19}",
            "--column",
            "answer=19",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    assert "mentions_answer: 1.0000" in out
    assert "not_for_me: None (not applicable)" in out
    assert "math_accuracy: 1.0000" in out
    assert "logged seen_step: 1.0" in out
    assert 'logged extra: {"checked": "yes"}' in out
    assert "reward (sum, weight 1 each): 2.0000" in out


def test_test_reward_shows_the_failing_function_and_refuses_bad_names(tmp_path, monkeypatch, capsys):
    (tmp_path / "broken_rewards.py").write_text("def broken(completions, **kwargs):\n    raise KeyError('answer')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(Exception, match="reward function 'broken' raised on sample 0"):
        main(["test-reward", "broken_rewards:broken", "--completion", "x"])
    assert main(["test-reward", "no_such_reward", "--completion", "x"]) == 2
    assert "neither a built-in reward" in capsys.readouterr().err
    assert main(["test-reward", "math_accuracy", "--completion", "x", "--column", "oops"]) == 2
    assert "--column: 'oops' is not name=value" in capsys.readouterr().err


def test_test_reward_passes_column_values_as_text_and_json_ones_typed(tmp_path, monkeypatch, capsys):
    (tmp_path / "typed_rewards.py").write_text(
        "def exact(completions, answer, **kwargs):\n"
        "    return [1.0 if c.strip() == a else 0.0 for c, a in zip(completions, answer)]\n"
        "def is_int(completions, answer, **kwargs):\n"
        "    return [1.0 if isinstance(a, int) else 0.0 for a in answer]\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["test-reward", "typed_rewards:exact", "--completion", "56", "--column", "answer=56"]) == 0
    assert "exact: 1.0000" in capsys.readouterr().out  # the string "56", as a JSONL string column gives it
    assert main(["test-reward", "typed_rewards:is_int", "--completion", "x", "--column-json", "answer=56"]) == 0
    assert "is_int: 1.0000" in capsys.readouterr().out
    assert main(["test-reward", "typed_rewards:is_int", "--completion", "x", "--column-json", "answer={"]) == 2
    assert "--column-json: answer: '{' is not JSON" in capsys.readouterr().err


def test_test_reward_says_a_wrong_length_in_one_line(tmp_path, monkeypatch, capsys):
    (tmp_path / "long_rewards.py").write_text("def twice(completions, **kwargs):\n    return [1.0, 1.0]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["test-reward", "long_rewards:twice", "--completion", "x"]) == 1
    err = capsys.readouterr().err
    assert err == "grpo test-reward: reward function 'twice' returned 2 scores for 1 completions\n"


@pytest.mark.slow
def test_checkpoints_lists_each_with_its_verification(prefect_server, tmp_path, capsys):
    from grpo_flow.flows.grpo import grpo
    from grpo_flow.schemas.presets import preset_config
    from grpo_flow.workers.state.storage import RunStorage

    config = preset_config(
        "tiny",
        run_id="listed",
        storage_root=str(tmp_path),
        max_steps=2,
        save_steps=1,
        prompts_per_step=2,
        num_generations=2,
        eval_prompts=0,
    )
    grpo(config)
    storage = RunStorage(tmp_path, "listed")
    (storage.checkpoint_dir(1) / "optimizer.pt").write_bytes(b"torn")  # damage the first
    capsys.readouterr()
    assert main(["checkpoints", "listed", "--storage-root", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "2 checkpoint(s)" in lines[0]
    first, second = lines[2].split(), lines[3].split()
    assert first[:2] == ["1", "damaged"] and "optimizer.pt is 4 bytes, its manifest says" in lines[2]
    assert second[:2] == ["2", "ok"] and second[3] == "2"  # policy version 2
    assert main(["checkpoints", "nobody", "--storage-root", str(tmp_path)]) == 2


@pytest.mark.slow
def test_clear_cache_deletes_the_cached_model_which_the_next_use_rebuilds(tmp_path, capsys, monkeypatch):
    path = ensure_tiny_model(tmp_path)
    assert main(["clear-cache", "--model", "tiny", "--storage-root", str(tmp_path), "--dry-run"]) == 0
    assert "would delete" in capsys.readouterr().out and path.exists()
    assert main(["clear-cache", "--model", "tiny", "--storage-root", str(tmp_path)]) == 0
    assert "deleted" in capsys.readouterr().out and not path.exists()
    assert ensure_tiny_model(tmp_path) == path and path.exists()

    hub = tmp_path / "hub"
    (hub / "models--Org--Model" / "blobs").mkdir(parents=True)
    (hub / "models--Org--Model" / "blobs" / "x").write_bytes(b"0" * 10)
    monkeypatch.setattr("grpo_flow.flows.components.hub_cache_dir", lambda: hub)
    assert main(["clear-cache", "--model", "Org/Model", "--storage-root", str(tmp_path)]) == 0
    assert not (hub / "models--Org--Model").exists()
    assert main(["clear-cache", "--model", "Org/Other", "--storage-root", str(tmp_path)]) == 0
    assert "nothing cached for Org/Other" in capsys.readouterr().out
    shutil.rmtree(tmp_path / "models")


def test_a_reward_module_in_the_working_directory_is_found_by_the_grpo_script(tmp_path):
    """`grpo` is an installed script: unlike `python -m`, it does not put the working directory on
    sys.path, so `myrewards:score` beside the data failed with `No module named 'myrewards'` (issue 30, item 3)."""
    import subprocess
    import sys
    from pathlib import Path

    (tmp_path / "grpo_flow_test_myrewards.py").write_text(
        "def score(completions, **kwargs):\n    return [float(len(c)) for c in completions]\n"
    )
    grpo = [str(Path(sys.executable).with_name("grpo"))]
    found = subprocess.run(
        [*grpo, "test-reward", "grpo_flow_test_myrewards:score", "--completion", "abc"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert found.returncode == 0, found.stderr
    assert found.stdout.startswith("score: 3.0000")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    missing = subprocess.run(
        [*grpo, "test-reward", "grpo_flow_test_myrewards:score", "--completion", "abc"],
        cwd=elsewhere,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert missing.returncode == 2
    assert f"the working directory {elsewhere}; a module elsewhere needs PYTHONPATH" in missing.stderr


def test_test_rollout_on_modal_without_credentials_is_one_line(tmp_path, capsys, monkeypatch):
    """It printed a traceback, after building the model (issue 30, item 12)."""
    for name in ("MODAL_TOKEN_ID", "MODAL_TOKEN_SECRET", "GRPO_FLOW_MODAL_MODE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MODAL_CONFIG_PATH", str(tmp_path / "no-modal.toml"))
    root = tmp_path / "store"
    assert main(["test-rollout", "--backend", "modal", "--storage-root", str(root)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(
        "grpo test-rollout: --backend modal: backend 'modal': no Modal credentials"
    )
    assert not (root / "models").exists()
