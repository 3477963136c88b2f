"""The config's groups (grpo_flow.schemas.config.CONFIG_GROUPS): every field in exactly one, and the README's
config table lists the same groups with the same fields in the same order as `grpo train --help`."""

import re
from pathlib import Path

from grpo_flow.schemas.config import CONFIG_GROUPS, GRPOFlowConfig, field_group

README = Path(__file__).resolve().parents[2] / "README.md"


def test_every_field_is_in_exactly_one_group():
    grouped = [name for names in CONFIG_GROUPS.values() for name in names]
    assert sorted(grouped) == sorted(GRPOFlowConfig.model_fields)  # a new field needs a group
    assert len(grouped) == len(set(grouped))
    assert field_group("loss_type") == "GRPO objective" and field_group("not_a_field") == "Other"


def test_the_readme_config_table_lists_the_groups_as_the_config_does():
    text = README.read_text()
    table = text[text.index("| group | fields |") :].split("\n\n")[0].splitlines()[2:]
    rows = {}
    for row in table:
        group, fields = [cell.strip() for cell in row.strip("|").split("|")]
        rows[group] = tuple(re.findall(r"`([a-z0-9_]+)`", fields))
    assert rows == CONFIG_GROUPS
    assert list(rows) == list(CONFIG_GROUPS)
