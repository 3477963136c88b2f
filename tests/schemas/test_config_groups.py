"""The config's groups (grpo_flow.schemas.config.CONFIG_GROUPS), drawn from each field's metadata: every field
in exactly one (the config reference, docs/reference/config.md, and `grpo train --help` are drawn from them),
and the fields that do not change training (NON_TRAINING_FIELDS) marked on the field itself."""

from grpo_flow.schemas.config import (
    CONFIG_GROUPS,
    GROUPS,
    NON_TRAINING_FIELDS,
    GRPOFlowConfig,
    field_group,
    field_metadata,
)


def test_every_field_is_in_exactly_one_group():
    grouped = [name for names in CONFIG_GROUPS.values() for name in names]
    assert sorted(grouped) == sorted(GRPOFlowConfig.model_fields)  # a new field needs a group
    assert len(grouped) == len(set(grouped))
    assert field_group("loss_type") == "GRPO objective" and field_group("not_a_field") == "Other"


def test_groups_and_training_come_from_each_fields_metadata():
    assert {field_metadata(name)["group"] for name in GRPOFlowConfig.model_fields} == set(GROUPS)
    assert list(CONFIG_GROUPS) == list(GROUPS) and CONFIG_GROUPS["Run"][0] == "run_id"
    assert field_metadata("storage_root")["training"] is False and "storage_root" in NON_TRAINING_FIELDS
    assert "training" not in field_metadata("learning_rate") and "learning_rate" not in NON_TRAINING_FIELDS
    assert field_metadata("run_id")["pattern"]  # the Prefect form's check stays beside the metadata
