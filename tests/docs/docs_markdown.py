"""The code blocks and command lines of the docs (README.md and docs/**/*.md), for the tests in tests/docs/.

A fenced block may be preceded (blank lines aside) by a directive comment:

    <!-- docs-test: compile-only (needs Modal credentials) -->

`compile-only` marks a Python block that needs what CI lacks (a GPU, Modal, the Hugging Face hub):
it is compiled, not run. Keep such blocks few.
"""

from __future__ import annotations

import importlib.util
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
README = ROOT / "README.md"

FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})(?P<info>[^`]*)$")
DIRECTIVE = re.compile(r"<!--\s*docs-test:\s*(?P<what>[a-z-]+)(?P<why>[^>]*)-->")
PYTHON = {"python", "py", "python3"}
SHELL = {"bash", "sh", "shell", "console"}
KNOWN_DIRECTIVES = {"compile-only"}


@dataclass
class Block:
    path: Path
    line: int  # of the opening fence, 1-based
    lang: str
    code: str
    directive: str | None

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def doc_files() -> list[Path]:
    return [README, *sorted(DOCS.rglob("*.md"))]


def closes(line: str, fence: str) -> bool:
    """A closing fence: the opening's character only, at least as many."""
    stripped = line.strip()
    return len(stripped) >= len(fence) and set(stripped) == {fence[0]}


def code_blocks(path: Path) -> list[Block]:
    """Every fenced block of a markdown file, with its language and the directive before it."""
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        indent, fence = opening.group("indent"), opening.group("fence")
        lang = opening.group("info").strip().split(" ")[0].lower()
        body = []
        j = i + 1
        while j < len(lines) and not closes(lines[j], fence):
            body.append(lines[j][len(indent) :] if lines[j].startswith(indent) else lines[j].lstrip())
            j += 1
        k = i - 1
        while k >= 0 and not lines[k].strip():
            k -= 1
        found = DIRECTIVE.search(lines[k]) if k >= 0 else None
        blocks.append(Block(path, i + 1, lang, "\n".join(body) + "\n", found.group("what") if found else None))
        i = j + 1
    return blocks


def python_blocks(path: Path) -> list[Block]:
    return [block for block in code_blocks(path) if block.lang in PYTHON]


# -- command lines ---------------------------------------------------------------------------------


@dataclass
class Command:
    block: Block
    text: str  # the logical line as written (continuations joined)
    argv: list[str]  # one command of it, environment assignments removed


def logical_lines(code: str) -> list[str]:
    """Lines with `\\` continuations joined."""
    out: list[str] = []
    pending = ""
    for line in code.splitlines():
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        out.append(pending + line)
        pending = ""
    if pending:
        out.append(pending)
    return out


SEPARATORS = {"&&", "||", ";", "|", "&", ";;", "(", ")"}
ENV_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")


def commands(block: Block) -> list[Command]:
    """Each simple command of a shell block: split at `&&`, `;`, `|`, comments dropped, leading
    `NAME=value` assignments removed."""
    found = []
    for line in logical_lines(block.code):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        lexer.commenters = "#"
        tokens = list(lexer)
        current: list[str] = []
        for token in [*tokens, ";"]:
            if token in SEPARATORS:
                while current and ENV_ASSIGNMENT.match(current[0]):
                    current.pop(0)
                if current:
                    found.append(Command(block, line.strip(), current))
                current = []
            else:
                current.append(token)
    return found


def shell_commands(path: Path) -> list[Command]:
    return [command for block in code_blocks(path) if block.lang in SHELL for command in commands(block)]


def grpo_argv(argv: list[str]) -> list[str] | None:
    """The arguments after `grpo` (or `python -m grpo_flow`), or None for another command."""
    if argv[0] == "grpo":
        return argv[1:]
    if argv[:3] in (["python", "-m", "grpo_flow"], ["python3", "-m", "grpo_flow"]):
        return argv[3:]
    return None


MODULE_RUN = re.compile(r"python3? -m ((?:grpo_flow|benchmarks)(?:\.[A-Za-z_][A-Za-z0-9_]*)*)")


def module_exists(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False
