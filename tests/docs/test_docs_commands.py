"""Every command line the docs show is one the code still takes.

- `grpo ...` and `python -m grpo_flow ...` in shell blocks are parsed by the real parser
  (`make_parser()`); a `grpo train` line's options must also make a valid config.
- `python -m grpo_flow.X` (or `benchmarks.X`) anywhere in the docs names a module that exists; in shell blocks, each
  `--option` it is given must appear in that module's `--help`.
"""

from __future__ import annotations

import contextlib
import io
import subprocess
import sys
from functools import cache

import pytest
from docs_markdown import MODULE_RUN, ROOT, doc_files, grpo_argv, module_exists, shell_commands

PAGES = doc_files()
IDS = [str(p.relative_to(ROOT)) for p in PAGES]


def parse(argv: list[str]):
    """The parser's namespace, or an AssertionError with argparse's own message."""
    from grpo_flow.flows.cli import make_parser

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            return make_parser().parse_args(argv)
    except SystemExit as exit:
        if exit.code == 0:  # --help
            return None
        raise AssertionError(err.getvalue().strip().splitlines()[-1]) from None


def check_train_options(args) -> None:
    """The options of a `grpo train` line make a config (a renamed value of a Literal fails here)."""
    from grpo_flow.flows.cli import build_config, parse_overrides, starting_preset

    overrides = parse_overrides(args)
    build_config(starting_preset(args.preset, overrides), overrides)
    if args.fail_at:
        from grpo_flow.workers.state.faults import parse_fail_at

        parse_fail_at(args.fail_at)


def test_the_docs_show_grpo_commands():
    lines = [c for path in PAGES for c in shell_commands(path) if grpo_argv(c.argv) is not None]
    assert len(lines) > 40  # the extractor finds them (a broken one would pass every test below)
    assert any(c.argv[:2] == ["grpo", "train"] for c in lines)


@pytest.mark.parametrize("page", PAGES, ids=IDS)
def test_every_grpo_command_parses(page):
    problems = []
    for command in shell_commands(page):
        argv = grpo_argv(command.argv)
        if argv is None:
            continue
        where = f"{command.block.where}: {command.text}"
        brackets = [token for token in argv if token.startswith("[") or token.endswith("]")]
        if brackets:
            problems.append(f"{where}: write a concrete example, not {brackets}")
            continue
        try:
            args = parse(argv)
            if args is not None and args.command == "train":
                check_train_options(args)
        except Exception as error:
            problems.append(f"{where}: {type(error).__name__}: {error}")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("page", PAGES, ids=IDS)
def test_every_grpo_flow_module_named_exists(page):
    text = page.read_text(encoding="utf-8")
    missing = sorted({name for name in MODULE_RUN.findall(text) if not module_exists(name)})
    assert not missing, f"{page.relative_to(ROOT)} names modules that do not exist: {missing}"


@cache
def module_help(module: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert done.returncode == 0, f"python -m {module} --help failed:\n{done.stderr[-2000:]}"
    return done.stdout


@pytest.mark.parametrize("page", PAGES, ids=IDS)
def test_module_options_exist(page):
    problems = []
    for command in shell_commands(page):
        argv = command.argv
        module = argv[2] if len(argv) > 2 and argv[0].startswith("python") and argv[1] == "-m" else ""
        if not module.startswith(("grpo_flow.", "benchmarks.")):
            continue
        options = [token.split("=")[0] for token in argv[3:] if token.startswith("--")]
        if not options:
            continue
        shown = module_help(argv[2])
        problems += [f"{command.block.where}: {argv[2]} has no {option}" for option in options if option not in shown]
    assert not problems, "\n".join(problems)
