"""What counts as a change of training fields when a run is resumed."""

import json

import pytest

from grpo_flow.schemas.presets import preset_config
from grpo_flow.workers.state.resume import (
    BASE_MODEL_FILE,
    BaseModelChangedError,
    base_model_reference,
    changed_training_fields,
    check_base_model_unchanged,
)
from grpo_flow.workers.state.storage import RunStorage


def stored_by_an_older_version(config, *missing):
    """The config as a run started by a grpo-flow without `missing` fields stored it."""
    stored = config.model_dump(mode="json")
    for name in missing:
        del stored[name]
    return stored


def test_a_field_an_older_run_lacks_counts_as_its_default():
    config = preset_config("tiny")
    stored = stored_by_an_older_version(
        config, "use_bias_correction_kl", "sapo_temperature_neg", "off_policy_mask_threshold"
    )
    assert changed_training_fields(stored, config) == {}


def test_a_field_an_older_run_lacks_set_to_another_value_is_a_change():
    config = preset_config("tiny")
    stored = stored_by_an_older_version(config, "use_bias_correction_kl", "off_policy_mask_threshold")
    changed = config.model_copy(update={"use_bias_correction_kl": False, "off_policy_mask_threshold": 0.5})
    assert changed_training_fields(stored, changed) == {
        "use_bias_correction_kl": (True, False),
        "off_policy_mask_threshold": (None, 0.5),
    }


def test_changes_to_fields_that_do_not_alter_training_are_not_listed():
    config = preset_config("tiny")
    stored = config.model_dump(mode="json")
    assert changed_training_fields(stored, config.model_copy(update={"max_steps": 99, "save_steps": 7})) == {}
    assert changed_training_fields(stored, config.model_copy(update={"learning_rate": 0.5})) == {
        "learning_rate": (config.learning_rate, 0.5)
    }


def test_a_resume_to_fewer_steps_than_the_run_has_trained_is_refused(tmp_path):
    import pytest

    from grpo_flow.schemas.records import metrics_table
    from grpo_flow.workers.state.resume import ResumeError, check_config_change, check_max_steps
    from grpo_flow.workers.state.storage import RunStorage

    config = preset_config("tiny", run_id="r", storage_root=str(tmp_path), max_steps=30)
    storage = RunStorage(tmp_path, "r")
    storage.write_config(config.model_dump(mode="json"))
    for step in range(1, 31):
        storage.write_metrics(
            step, metrics_table({"run_id": "r", "step": step, "policy_version": step, "num_completions": 1})
        )
    message = r"max_steps: 5 is below the last step of run 'r', 30 .*give max_steps 30 or more"
    with pytest.raises(ResumeError, match=message):
        check_config_change(storage, config.model_copy(update={"max_steps": 5}), allow_config_change=True)
    with pytest.raises(ResumeError, match=message):
        check_max_steps(storage, 5)  # a total from num_train_epochs is checked the same way
    check_config_change(storage, config, allow_config_change=False)  # 30 itself, and more, are fine
    check_config_change(storage, config.model_copy(update={"max_steps": 40}), allow_config_change=False)


def test_a_changed_local_data_file_is_refused_on_resume_unless_allowed(tmp_path):
    """The CLI's `hf:` files are fingerprinted as the Python API's data sets are (issue 30, item 7)."""
    import pytest

    from grpo_flow.workers.state.resume import (
        ResumeError,
        ResumePoint,
        check_config_change,
        data_fingerprint,
        record_resume,
    )
    from grpo_flow.workers.state.storage import RunStorage

    data = tmp_path / "data.jsonl"
    data.write_text('{"prompt": "1=", "answer": "1"}\n')
    config = preset_config("tiny", dataset=f"hf:{data}", reward_funcs=["last_digit"], run_id="r")
    storage = RunStorage(tmp_path / "store", "r")
    storage.write_config(config.model_dump(mode="json"), dataset_sha256=data_fingerprint(config.dataset))
    assert check_config_change(storage, config, allow_config_change=False) == {}
    data.write_text('{"prompt": "2=", "answer": "2"}\n')
    with pytest.raises(ResumeError, match=rf"^dataset: {data} changed since run 'r' last trained on it \(sha256 "):
        check_config_change(storage, config, allow_config_change=False)
    changes = check_config_change(storage, config, allow_config_change=True)
    assert list(changes) == ["dataset content (sha256)"]
    record_resume(storage, config, ResumePoint(None, (), 1), changes)
    assert check_config_change(storage, config, allow_config_change=False) == {}  # trained on the new file since


def test_turning_evaluation_off_on_an_hf_data_set_that_holds_prompts_out_is_a_training_change(tmp_path):
    """eval_prompts decides which of its prompts train there (issue 30, item 4)."""
    import pytest

    from grpo_flow.workers.state.resume import ResumeError, check_config_change
    from grpo_flow.workers.state.storage import RunStorage

    fields = dict(dataset="hf:someone/data", reward_funcs=["last_digit"], run_id="r")
    scored = preset_config("tiny", accuracy_reward="last_digit", **fields)
    storage = RunStorage(tmp_path, "r")
    storage.write_config(scored.model_dump(mode="json"))
    with pytest.raises(ResumeError, match=r"\(eval_prompts: 200 -> 0\)"):
        check_config_change(storage, scored.model_copy(update={"eval_prompts": 0}), allow_config_change=False)
    assert check_config_change(storage, scored.model_copy(update={"eval_prompts": 50}), False) == {}
    unscored = preset_config("tiny", **{**fields, "run_id": "u"})
    RunStorage(tmp_path, "u").write_config(unscored.model_dump(mode="json"))
    assert check_config_change(RunStorage(tmp_path, "u"), unscored.model_copy(update={"eval_prompts": 0}), False) == {}


def test_a_resume_refuses_a_lora_run_whose_base_model_changed(tmp_path):
    """The newest checkpoint names the base model its adapter was trained on; another one is refused before
    anything loads, naming the model field."""
    base = tmp_path / "base"
    base.mkdir()
    (base / "config.json").write_text("{}")
    (base / "model.safetensors").write_bytes(b"weights")
    (base / "tokenizer.json").write_text("{}")
    storage = RunStorage(tmp_path / "root", "lora")
    folder = storage.checkpoint_dir(2)
    folder.mkdir(parents=True)
    (folder / BASE_MODEL_FILE).write_text(json.dumps(base_model_reference("tiny", str(base))))
    check_base_model_unchanged(storage)
    (base / "tokenizer.json").write_text('{"other": 1}')  # not part of the weights
    check_base_model_unchanged(storage)
    (base / "model.safetensors").write_bytes(b"other weights")
    with pytest.raises(BaseModelChangedError, match=r"^model: this LoRA checkpoint's adapter was trained on 'tiny'"):
        check_base_model_unchanged(storage)
