"""The config's groups (grpo_flow.schemas.config.CONFIG_GROUPS): every field in exactly one (the config
reference, docs/reference/config.md, and `grpo train --help` are drawn from them)."""

from grpo_flow.schemas.config import CONFIG_GROUPS, GRPOFlowConfig, field_group


def test_every_field_is_in_exactly_one_group():
    grouped = [name for names in CONFIG_GROUPS.values() for name in names]
    assert sorted(grouped) == sorted(GRPOFlowConfig.model_fields)  # a new field needs a group
    assert len(grouped) == len(set(grouped))
    assert field_group("loss_type") == "GRPO objective" and field_group("not_a_field") == "Other"
