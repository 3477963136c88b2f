"""MkDocs hooks: the reference pages are generated from the code at every build, so they cannot drift.

- `<!-- generated: config-reference -->` becomes every field of `grpo_flow.schemas.config.GRPOFlowConfig`
  (type, default, allowed values, bounds, description), grouped by `CONFIG_GROUPS`.
- `<!-- generated: presets -->` becomes the table of `grpo_flow.schemas.presets.PRESETS`.
- `<!-- generated: cli-reference -->` becomes every subcommand and option of `grpo_flow.flows.cli.make_parser()`.
- `<!-- generated: packages -->` becomes the module map: each package's and module's docstring summary.
- `<!-- generated: markers -->` becomes the table of pytest markers declared in `pyproject.toml`.
- `benchmarks/learning.png` and `benchmarks/learning-smol-math.png` are published under `assets/` for the
  benchmarks page.

The functions are plain, so tests/docs can call them too.
"""

from __future__ import annotations

import argparse
import html
import re
import sys
import types
import typing
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # document this checkout's grpo_flow, whatever else is installed
    sys.path.insert(0, str(REPO))
MARKER = re.compile(r"<!--\s*generated:\s*([a-z-]+)\s*-->")
EXTRA_FILES = {
    "assets/learning.png": REPO / "benchmarks" / "learning.png",
    "assets/learning-smol-math.png": REPO / "benchmarks" / "learning-smol-math.png",
}


# -- markdown helpers ----------------------------------------------------------------------------


def text(value: str) -> str:
    """Prose for a table cell: HTML-escaped, with `|`, `*` and `_` escaped, except inside `code` spans."""
    parts = re.split(r"(`[^`]*`)", value.replace("\n", " "))
    out = []
    for part in parts:
        if part.startswith("`") and part.endswith("`") and len(part) > 1:
            out.append(part)  # the tables extension leaves pipes inside code spans alone
        else:
            out.append(html.escape(part, quote=False).replace("|", "\\|").replace("*", "\\*").replace("_", "\\_"))
    return "".join(out)


def code(value: Any) -> str:
    """A value as a code span (a backtick inside is doubled around)."""
    shown = str(value)
    return f"`` {shown} ``" if "`" in shown else f"`{shown}`"


# -- the config ------------------------------------------------------------------------------------


def type_name(annotation: Any) -> str:
    """`int`, `float | None`, `list[str]`, `Literal[...]` as `str`; the allowed values are listed apart."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(arg) for arg in typing.get_args(annotation))
    if origin is typing.Literal:
        return "str"
    if origin is list:
        return f"list[{', '.join(type_name(arg) for arg in typing.get_args(annotation))}]"
    if annotation is type(None):
        return "None"
    return getattr(annotation, "__name__", str(annotation))


def allowed_values(annotation: Any) -> list[str]:
    """The values of every Literal (or Enum) in the annotation, in order."""
    found: list[str] = []
    for arg in [annotation, *typing.get_args(annotation)]:
        if typing.get_origin(arg) is typing.Literal:
            found += [str(value) for value in typing.get_args(arg)]
        elif isinstance(arg, type) and issubclass(arg, __import__("enum").Enum):
            found += [str(member.value) for member in arg]
        elif typing.get_origin(arg) is list:
            found += allowed_values(typing.get_args(arg)[0])
    return found


def bounds(field: Any) -> list[str]:
    symbols = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<", "min_length": "length >=", "max_length": "length <="}
    found = []
    for rule in field.metadata:
        for key, symbol in symbols.items():
            if getattr(rule, key, None) is not None:
                found.append(f"{symbol} {getattr(rule, key)}")
        if getattr(rule, "pattern", None):
            found.append(f"matches {code(rule.pattern)}")
    return found


def default_text(field: Any) -> str:
    if field.default_factory is not None:
        return code(field.default_factory())
    if field.default is None:
        return "`None`"
    return code(field.default)


def config_fields() -> dict[str, list[str]]:
    """Group -> field names, as `grpo train --help` groups them; fields no group names go under "Other"."""
    from grpo_flow.schemas.config import GRPOFlowConfig, field_group

    groups: dict[str, list[str]] = {}
    for name in GRPOFlowConfig.model_fields:
        groups.setdefault(field_group(name), []).append(name)
    from grpo_flow.schemas.config import CONFIG_GROUPS

    order = [*CONFIG_GROUPS, "Other"]
    return {group: groups[group] for group in order if group in groups}


def config_reference() -> str:
    from grpo_flow.schemas.config import NON_TRAINING_FIELDS, GRPOFlowConfig

    lines = []
    for group, names in config_fields().items():
        lines += [f"## {group}", "", "| field | type and default | description |", "|---|---|---|"]
        for name in names:
            field = GRPOFlowConfig.model_fields[name]
            flag = "--" + name.replace("_", "-")
            kind = [f"{code(type_name(field.annotation))}", f"default {default_text(field)}"]
            values = allowed_values(field.annotation)
            if values:
                kind.append("one of " + ", ".join(code(value) for value in values))
            kind += [code(rule) if not rule.startswith("matches") else rule for rule in bounds(field)]
            notes = text(field.description or "")
            if name not in NON_TRAINING_FIELDS:
                notes += " *Changes training: a resume refuses a new value without `--allow-config-change`.*"
            anchor = f'<a id="{name}"></a>'
            lines.append(f"| {anchor}{code(name)}<br>{code(flag)} | {'<br>'.join(kind)} | {notes} |")
        lines.append("")
    return "\n".join(lines)


def presets_table() -> str:
    from grpo_flow.schemas.presets import PRESETS

    names = list(PRESETS)
    fields: list[str] = []
    for preset in PRESETS.values():
        fields += [field for field in preset if field not in fields]
    lines = ["| field | " + " | ".join(code(name) for name in names) + " |", "|---|" + "---|" * len(names)]
    for field in fields:
        cells = [code(PRESETS[name][field]) if field in PRESETS[name] else "" for name in names]
        lines.append(f"| [{code(field)}](#{field}) | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


# -- the CLI ---------------------------------------------------------------------------------------


def subcommands(parser: argparse.ArgumentParser) -> dict[str, tuple[argparse.ArgumentParser, str]]:
    """name -> (its parser, its one-line help), in the order `grpo --help` lists them."""
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    helps = {choice.dest: choice.help or "" for choice in action._choices_actions}
    return {name: (sub, helps.get(name, "")) for name, sub in action.choices.items()}


def option_row(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    formatter = parser._get_formatter()
    if action.option_strings:
        metavar = formatter._format_args(action, action.dest.upper()) if action.nargs != 0 else ""
        name = ", ".join(action.option_strings) + (f" {metavar}" if metavar else "")
    else:
        name = formatter._format_args(action, action.dest)
    help_text = formatter._expand_help(action) if action.help else ""
    if action.choices and not action.option_strings == ["-h", "--help"] and "{" not in name:
        help_text += f" (one of {', '.join(map(str, action.choices))})"
    if action.option_strings and action.default not in (None, False, argparse.SUPPRESS) and "default" not in help_text:
        help_text += f" (default: {action.default})"
    return f"| {code(name)} | {text(help_text)} |"


def cli_reference() -> str:
    from grpo_flow.flows.cli import make_parser

    parser = make_parser()
    lines = ["## grpo", "", "```text", parser.format_usage().strip(), "```", ""]
    if parser.description:
        lines += [text(parser.description), ""]
    lines += ["| command | what it does |", "|---|---|"]
    commands = subcommands(parser)
    for name, (_, help_text) in commands.items():
        lines.append(f"| [`grpo {name}`](#grpo-{name}) | {text(help_text)} |")
    lines.append("")
    for name, (sub, help_text) in commands.items():
        lines += [f"## grpo {name}", "", "```text", sub.format_usage().strip(), "```", ""]
        lines += [text(sub.description or help_text), ""]
        for group in sub._action_groups:
            actions = [a for a in group._group_actions if a.help is not argparse.SUPPRESS and a.dest != "help"]
            if not actions:
                continue
            title = group.title or "options"
            linked = " Each is the config field of that name: see the [config reference](config.md)."
            lines += [f"**{text(title)}**" + (linked if "config fields" in title else ""), ""]
            lines += ["| option | help |", "|---|---|"]
            lines += [option_row(sub, action) for action in actions]
            lines.append("")
    return "\n".join(lines)


# -- the layout and the test markers -----------------------------------------------------------------

# The packages in the order the docs present them: the bottom layer first, then workers by role
# (the order of grpo_flow/workers/__init__.py, each importing only those after it), then up.
PACKAGES = [
    "schemas",
    "workers",
    "workers/backends",
    "workers/actor",
    "workers/rollout",
    "workers/rewards",
    "workers/data",
    "workers/state",
    "tasks",
    "flows",
    "deployments",
    "benchmarks",
]


def summary(path: Path) -> str:
    """The first paragraph of a module's docstring, on one line ("" without one)."""
    import ast

    doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
    return " ".join(doc.split("\n\n")[0].split())


def packages() -> str:
    lines = []
    for package in PACKAGES:
        folder = REPO / package
        dotted = ("" if package == "benchmarks" else "grpo_flow.") + package.replace("/", ".")  # not installed
        lines += [f"### `{dotted}`", "", text(summary(folder / "__init__.py")) or "", ""]
        modules = [path for path in sorted(folder.glob("*.py")) if path.name != "__init__.py"]
        if modules:
            lines += ["| module | what it holds |", "|---|---|"]
            lines += [f"| `{path.stem}` | {text(summary(path))} |" for path in modules]
            lines.append("")
    return "\n".join(lines)


def markers() -> str:
    """The markers of `[tool.pytest.ini_options]` in pyproject.toml, as `name: description` lines."""
    config = (REPO / "pyproject.toml").read_text(encoding="utf-8")
    block = re.search(r"^markers\s*=\s*\[(.*?)^\]", config, re.DOTALL | re.MULTILINE)
    entries = re.findall(r'"([^"]+)"', block.group(1)) if block else []
    lines = ["| marker | what it marks |", "|---|---|"]
    for entry in entries:
        name, _, description = entry.partition(":")
        lines.append(f"| `{name.strip()}` | {text(description.strip())} |")
    return "\n".join(lines) + "\n"


GENERATORS = {
    "config-reference": config_reference,
    "presets": presets_table,
    "cli-reference": cli_reference,
    "packages": packages,
    "markers": markers,
}


def expand(markdown: str) -> str:
    return MARKER.sub(lambda match: GENERATORS[match.group(1)](), markdown)


# -- MkDocs events ---------------------------------------------------------------------------------


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    return expand(markdown)


def on_files(files: Any, config: Any) -> Any:
    from mkdocs.structure.files import File

    for dest, source in EXTRA_FILES.items():
        files.append(File.generated(config, dest, abs_src_path=str(source)))
    return files
