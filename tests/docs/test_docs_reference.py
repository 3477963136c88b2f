"""The README's size, and that the docs cover what the code offers: the generated reference pages
(docs/hooks.py) list every config field and CLI option, every public name has its API entry,
and the hand-written pages name every built-in reward, task and preset."""

from __future__ import annotations

import argparse
import importlib.util
import re

import pytest
from docs_markdown import DOCS, README, ROOT

README_MAX_LINES = 300


@pytest.fixture(scope="module")
def hooks():
    spec = importlib.util.spec_from_file_location("docs_hooks", DOCS / "hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_readme_is_a_front_page():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; at most {README_MAX_LINES}"


def test_every_readme_link_into_docs_exists():
    text = README.read_text(encoding="utf-8")
    targets = re.findall(r"\]\((docs/[^)#]+)", text)
    assert targets
    assert [t for t in targets if not (ROOT / t).exists()] == []


def test_every_generated_marker_has_a_generator(hooks):
    for path in DOCS.rglob("*.md"):
        for name in hooks.MARKER.findall(path.read_text(encoding="utf-8")):
            assert name in hooks.GENERATORS, f"{path.relative_to(ROOT)}: no generator for {name!r}"


def test_the_config_reference_lists_every_field_with_its_flag_and_values(hooks):
    from grpo_flow.schemas.config import GRPOFlowConfig

    page = hooks.config_reference()
    for name, field in GRPOFlowConfig.model_fields.items():
        assert f'<a id="{name}"></a>`{name}`<br>`--{name.replace("_", "-")}`' in page
        for value in hooks.allowed_values(field.annotation):
            assert f"`{value}`" in page
    assert "one of `grpo`, `dapo`" in page  # loss_type's Literal, in order


def test_the_presets_table_lists_every_preset_and_field(hooks):
    from grpo_flow.schemas.presets import PRESETS

    table = hooks.presets_table()
    for name, values in PRESETS.items():
        assert f"`{name}`" in table.splitlines()[0]
        for field in values:
            assert f"[`{field}`](#{field})" in table


def test_the_cli_reference_lists_every_command_and_option(hooks):
    from grpo_flow.flows.cli import make_parser

    page = hooks.cli_reference()
    for name, (sub, _) in hooks.subcommands(make_parser()).items():
        assert f"## grpo {name}\n" in page
        for action in sub._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            for option in action.option_strings:
                assert f"`{option}" in page, f"grpo {name} {option}"


def test_every_public_name_has_an_api_entry():
    import grpo_flow

    page = (DOCS / "reference" / "api.md").read_text(encoding="utf-8")
    for name in grpo_flow.__all__:
        assert f"::: grpo_flow.{name}" in page or f"`{name}`" in page, f"docs/reference/api.md lacks {name}"


def test_the_data_page_names_every_built_in_reward_and_task():
    from grpo_flow.schemas.config import TASK_NAMES
    from grpo_flow.workers.rewards.functions import BUILTIN_REWARDS

    page = (DOCS / "data-and-rewards.md").read_text(encoding="utf-8")
    rewards = section(page, "## Built-in rewards")
    assert [name for name in BUILTIN_REWARDS if f"| `{name}` |" not in rewards] == []
    tasks = section(page, "## From the command line")
    assert [name for name in TASK_NAMES if f"| `{name}` |" not in tasks] == []


def section(page: str, heading: str) -> str:
    start = page.index(heading + "\n")
    end = page.find("\n## ", start + len(heading))
    return page[start : end if end > 0 else None]


def test_the_readme_names_every_preset():
    from grpo_flow.schemas.presets import PRESETS

    text = README.read_text(encoding="utf-8")
    assert [name for name in PRESETS if f"`{name}`" not in text] == []


def test_the_module_map_covers_every_module(hooks):
    page = hooks.packages()
    for package in hooks.PACKAGES:
        for path in (ROOT / package).glob("*.py"):
            if path.name != "__init__.py":
                assert f"| `{path.stem}` |" in page
    linked = {path.name for path in (ROOT / "grpo_flow").iterdir() if path.is_symlink()}
    assert linked == {package for package in hooks.PACKAGES if "/" not in package} - {"benchmarks"}  # not installed
