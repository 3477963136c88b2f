"""Every Python code block of README.md and docs/ runs (or, marked `compile-only`, compiles).

A page's blocks run in order in one namespace, as a reader would paste them into one session,
with `__name__ == "__main__"` as in a script, from a temporary folder with a `grpo-storage` of its
own whose `models/` is the session's (the tiny model is built once). Runs use the tiny model for a few steps.
"""

from __future__ import annotations

import os

import pytest
from docs_markdown import KNOWN_DIRECTIVES, ROOT, code_blocks, doc_files, python_blocks

PAGES = [path for path in doc_files() if python_blocks(path)]
SLOW_PAGES = {"docs/tools.md"}  # its example trains the tiny-tools preset until it uses its tool


def test_directives_are_known_and_stand_before_python_blocks():
    for path in doc_files():
        for block in code_blocks(path):
            if block.directive is None:
                continue
            assert block.directive in KNOWN_DIRECTIVES, (
                f"{block.where}: unknown docs-test directive {block.directive!r}"
            )
            assert block.lang == "python", f"{block.where}: a {block.directive} directive before a {block.lang!r} block"


def test_few_blocks_are_compile_only():
    marked = [block.where for path in PAGES for block in python_blocks(path) if block.directive == "compile-only"]
    assert len(marked) <= 5, f"keep compile-only examples few; runnable ones are tested: {marked}"


def test_every_python_block_compiles():
    for path in PAGES:
        for block in python_blocks(path):
            compile(block.code, block.where, "exec")


@pytest.mark.parametrize(
    "page",
    [
        pytest.param(
            p, id=str(p.relative_to(ROOT)), marks=[pytest.mark.slow] if str(p.relative_to(ROOT)) in SLOW_PAGES else []
        )
        for p in PAGES
    ],
)
def test_the_python_examples_of_a_page_run(page, prefect_server, storage_root, tmp_path, monkeypatch):
    (storage_root / "models").mkdir(exist_ok=True)
    (tmp_path / "grpo-storage").mkdir()
    (tmp_path / "grpo-storage" / "models").symlink_to(storage_root / "models")  # the session's tiny model
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("GRPO_FLOW_STORAGE", raising=False)
    namespace = {"__name__": "__main__"}
    for block in python_blocks(page):
        code = compile(block.code, block.where, "exec")
        if block.directive == "compile-only":
            continue
        try:
            exec(code, namespace)
        except Exception as error:  # name the block, keep the traceback
            raise AssertionError(f"the example at {block.where} raised {type(error).__name__}: {error}") from error
    assert os.getcwd() == str(tmp_path)
