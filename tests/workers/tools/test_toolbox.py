"""A run's tools and environments, resolved and checked as TRL 1.16's GRPOTrainer takes them."""

import pytest

from grpo_flow.workers.tools.toolbox import (
    ToolError,
    build_toolbox,
    check_rows,
    environment_reward_funcs,
    register_tool_objects,
)

HERE = "fixture_tools"  # tests/workers/tools/fixture_tools.py, on sys.path as pytest runs this file


def test_tools_resolve_from_paths_with_their_names_and_paths():
    toolbox = build_toolbox([f"{HERE}:add", f"{HERE}:shout"], None, None)
    assert [(t.name, t.path) for t in toolbox.tools] == [("add", f"{HERE}:add"), ("shout", f"{HERE}:shout")]
    assert toolbox.tools[0].func(a=2, b=3) == 5
    assert toolbox.factories is None and toolbox.reward_names == []


@pytest.mark.parametrize(
    "entries, message",
    [
        ([f"{HERE}:undocumented"], "tools[0] (undocumented): undocumented: it has no docstring"),
        ([f"{HERE}:untyped"], "tools[0] (untyped):"),
        ([f"{HERE}:add", f"{HERE}:add"], "tools[1]: 'fixture_tools:add' and 'fixture_tools:add' are both called 'add'"),
        ([f"{HERE}:missing"], "tools[0]: cannot import 'fixture_tools:missing'"),
        ([f"{HERE}:Counter"], "tools[0]: 'fixture_tools:Counter' is not a function"),
    ],
)
def test_bad_tools_are_refused_in_one_line_naming_the_entry(entries, message):
    with pytest.raises(ToolError) as error:
        build_toolbox(entries, None, None)
    assert str(error.value).startswith(message), str(error.value)
    assert "\n" not in str(error.value)


def test_untyped_tool_is_refused_for_its_type_hints():
    with pytest.raises(ToolError, match="type hint"):
        build_toolbox([f"{HERE}:untyped"], None, None)


@pytest.mark.parametrize(
    "tools, factory, message",
    [
        ([], f"{HERE}:NoReset", "environment_factory: NoReset has no reset method"),
        ([f"{HERE}:add"], f"{HERE}:Clashing", "environment_factory: Clashing.add and the tool 'add' share a name"),
        ([], {"a": f"{HERE}:Counter", "b": f"{HERE}:NoReset"}, "environment_factory['b']: NoReset has no reset"),
    ],
)
def test_bad_environments_are_refused_in_one_line(tools, factory, message):
    with pytest.raises(ToolError) as error:
        build_toolbox(tools, factory, None)
    assert str(error.value).startswith(message), str(error.value)


def test_an_environment_rollout_gets_a_fresh_reset_instance_its_methods_and_the_observation():
    toolbox = build_toolbox([f"{HERE}:add"], f"{HERE}:Counter", None)
    row = {"prompt_id": "p1", "prompt": [{"role": "user", "content": "count"}], "answer": "1"}
    prompt, first, tools = toolbox.start(row)
    _, second, _ = toolbox.start(row)
    assert first is not second and first.prompt_id == "p1"
    assert prompt == [{"role": "user", "content": "count (counter ready)"}]  # reset's text, appended (TRL)
    assert row["prompt"][0]["content"] == "count"  # the data set's row is left as it was
    assert sorted(tools) == ["add", "bump"] and tools["bump"].path is None  # methods run in this process
    assert toolbox.reward_names == ["Counter"]


def test_an_environment_that_owns_the_reward_scores_only_its_own_rollouts():
    toolbox = build_toolbox([], {"count": f"{HERE}:Counter", "plain": f"{HERE}:Clashing"}, None)
    rows = [{"prompt": [{"role": "user", "content": "x"}], "environment": e} for e in ("count", "plain", "count")]
    environments = [toolbox.start(row)[1] for row in rows]
    environments[2].bump(by=3)
    ((name, func),) = environment_reward_funcs(toolbox).items()
    assert name == "Counter"
    assert func(environments=environments) == [0.0, None, 3.0]  # TRL's rule: None for other classes


def test_a_dict_of_environments_is_chosen_per_row_with_only_its_tools():
    toolbox = build_toolbox([f"{HERE}:shout"], {"count": f"{HERE}:Counter", "other": f"{HERE}:Clashing"}, None)
    _, environment, tools = toolbox.start({"prompt": [{"role": "user", "content": "x"}], "environment": "count"})
    assert type(environment).__name__ == "Counter" and sorted(tools) == ["bump", "shout"]
    _, environment, tools = toolbox.start({"prompt": [{"role": "user", "content": "x"}], "environment": "other"})
    assert type(environment).__name__ == "Clashing" and sorted(tools) == ["add", "shout"]


def test_rows_need_chat_prompts_and_with_several_environments_an_environment_column():
    single = build_toolbox([f"{HERE}:add"], None, None)
    with pytest.raises(ToolError, match="dataset: train row 0 is plain text"):
        check_rows(single, "train", [{"prompt": "2+3="}])
    several = build_toolbox([], {"count": f"{HERE}:Counter"}, None)
    chat = [{"role": "user", "content": "x"}]
    with pytest.raises(ToolError, match="every row needs an 'environment' column"):
        check_rows(several, "train", [{"prompt": chat}])
    with pytest.raises(ToolError, match="heldout row 1 has environment='game'"):
        check_rows(
            several, "heldout", [{"prompt": chat, "environment": "count"}, {"prompt": chat, "environment": "game"}]
        )
    check_rows(several, "train", [{"prompt": chat, "environment": "count"}])


def test_python_objects_are_registered_per_run():
    def double(x: int) -> int:
        """Double it.

        Args:
            x: The number.
        """
        return 2 * x

    with pytest.raises(ToolError, match="registered by the Python API in another process"):
        build_toolbox(["registered:double"], None, "run-a")
    register_tool_objects("run-a", {"double": double})
    toolbox = build_toolbox(["registered:double"], None, "run-a")
    assert toolbox.tools[0].name == "double" and toolbox.tools[0].path is None
    assert build_toolbox(["registered:double"], None, None, objects={"double": double}).tools[0].func(x=2) == 4
