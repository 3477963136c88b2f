"""Bad tools, environments and templates are refused by `grpo train` before anything loads or is
written, in one line naming what is wrong (and by the Python API, the same way)."""

from pathlib import Path

import pytest
import trl

from grpo_flow.flows.checks import StartCheckError
from grpo_flow.flows.cli import main
from grpo_flow.flows.trainer import GRPOFlowTrainer

TOOLS = str(Path(__file__).parents[1] / "workers" / "tools")  # fixture_tools.py


@pytest.fixture
def fixture_tools(monkeypatch):
    monkeypatch.syspath_prepend(TOOLS)


@pytest.mark.parametrize(
    "argv, expected",
    [
        (
            ["--tools", "fixture_tools:untyped"],
            "grpo train: --tools[0] (untyped): Argument a is missing a type hint in function untyped",
        ),
        (
            ["--tools", "fixture_tools:undocumented"],
            "grpo train: --tools[0] (undocumented): undocumented: it has no docstring",
        ),
        (
            ["--tools", "fixture_tools:add", "fixture_tools:add"],
            "grpo train: --tools[1]: 'fixture_tools:add' and 'fixture_tools:add' are both called 'add'",
        ),
        (
            ["--tools", "fixture_tools:add", "--environment-factory", "fixture_tools:Clashing"],
            "grpo train: --environment-factory: Clashing.add and the tool 'add' share a name",
        ),
        (["--environment-factory", "fixture_tools:NoReset"], "grpo train: --environment-factory: NoReset has no reset"),
        (
            ["--max-tool-calling-iterations", "0"],
            "grpo train: --max-tool-calling-iterations: Input should be greater than or equal to 1",
        ),
        (["--tools", "not a path"], "grpo train: --tools: tools[0]: 'not a path' is not a 'module:function'"),
        (
            ["--preset", "tiny", "--max-tool-calling-iterations", "2"],
            "grpo train: --max-tool-calling-iterations/--tools: max_tool_calling_iterations given without tools",
        ),
        (["--preset", "tiny", "--tools", "fixture_tools:add"], "grpo train: --model: 'tiny' has no chat template"),
    ],
)
def test_bad_tool_input_exits_2_in_one_line_and_writes_nothing(tmp_path, capsys, fixture_tools, argv, expected):
    root = tmp_path / "store"
    preset = [] if "--preset" in argv else ["--preset", "tiny-tools"]
    assert main(["train", *preset, *argv, "--storage-root", str(root)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(expected), err
    assert len(err.splitlines()) == 1 and not root.exists()


def test_a_local_model_whose_template_cannot_render_tools_is_refused(tmp_path, capsys, fixture_tools):
    from grpo_flow.workers.data.tiny_model import build_tokenizer

    model = tmp_path / "model"
    tokenizer = build_tokenizer()
    tokenizer.chat_template = (Path(trl.__file__).parent / "chat_templates" / "llama3.jinja").read_text()
    tokenizer.save_pretrained(model)
    (model / "config.json").write_text("{}")  # a saved model folder; its weights are never read
    argv = ["train", "--preset", "tiny-tools", "--model", str(model), "--tools", "fixture_tools:add"]
    assert main([*argv, "--storage-root", str(tmp_path / "store")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("grpo train: --model: the chat template of") and "cannot render tools" in err


def test_the_python_api_takes_trls_tools_and_environments_and_refuses_the_same(tmp_path, fixture_tools):
    import fixture_tools as module

    def local(x: int) -> int:
        """Not importable from elsewhere.

        Args:
            x: A number.
        """
        return x

    trainer = GRPOFlowTrainer(
        model="tiny-tools",
        dataset="digit_lookup",
        tools=[module.add, local],
        environment_factory={"count": module.Counter},
        storage_root=str(tmp_path),
    )
    assert trainer.config.tools == ["fixture_tools:add", "registered:local"]
    assert trainer.config.environment_factory == {"count": "fixture_tools:Counter"}
    assert trainer.tool_objects == {"local": local}
    with pytest.raises(StartCheckError, match=r"^tools\[0\] \(untyped\): Argument a is missing a type hint"):
        GRPOFlowTrainer(model="tiny-tools", dataset="digit_lookup", tools=[module.untyped], storage_root=str(tmp_path))


def test_tools_resolve_from_the_working_directory_as_rewards_do(tmp_path):
    """`grpo` is an installed script: the folder it runs in is not on its import path unless grpo-flow puts it there."""
    import subprocess
    import sys

    (tmp_path / "mytools.py").write_text(
        "def multiply(a: int, b: int) -> int:\n"
        '    """Multiply two integers.\n\n    Args:\n        a: The first.\n        b: The second.\n    """\n'
        "    return a * b\n"
    )
    grpo = Path(sys.executable).with_name("grpo")
    done = subprocess.run(
        [str(grpo), "train", "--preset", "tiny", "--tools", "mytools:multiply", "--storage-root", "store"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    # The tool imported and checked; the next check refuses the model (no template), before anything loads.
    assert done.returncode == 2 and done.stderr.startswith("grpo train: --model: 'tiny' has no chat template"), (
        done.stderr
    )
