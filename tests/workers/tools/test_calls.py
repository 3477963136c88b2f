"""Tool calls: whatever goes wrong becomes the tool's message (TRL's `{'error': ...}`), never a failed step."""

import os
import threading
import time

import pytest

from grpo_flow.workers.tools.calls import ToolRequest, run_tool_calls, tool_content
from grpo_flow.workers.tools.toolbox import Tool, build_toolbox

HERE = "fixture_tools"
NAMES = ["add", "shout", "explode", "hang", "spin", "as_dict", "nothing", "image_blocks"]


def call(name, **arguments):
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


@pytest.fixture(scope="module")
def tools():
    return {t.name: t for t in build_toolbox([f"{HERE}:{n}" for n in NAMES], None, None).tools}


@pytest.mark.parametrize(
    ("sandbox", "timeout_s"), [(False, None), (False, 20), (True, 20)], ids=["here", "own-process", "sandbox"]
)
def test_each_kind_of_failure_is_a_tool_message(tools, sandbox, timeout_s):
    requests = [
        call("add", a=2, b=3),  # fine, returns an int: str() of it, as TRL
        call("explode", reason="boom"),  # raises
        call("add", a=1),  # a missing argument
        call("add", a=1, b=2, c=3),  # an unexpected one
        call("as_dict", key="k"),  # not text: str() of it
        call("nothing"),
        call("image_blocks"),  # TRL's multimodal content: refused, episodes are text
        call("no_such_tool"),
        {"type": "code_interpreter", "name": "x"},  # not a function call
        {"type": "function", "function": {"name": "add", "arguments": "[1, 2]"}},  # arguments not an object
    ]
    results = run_tool_calls([ToolRequest(r, tools) for r in requests], timeout_s=timeout_s, sandbox=sandbox)
    assert [r.content for r in results[:2]] == ["5", "{'error': 'exploded: boom'}"]
    assert [r.failed for r in results] == [False, True, True, True, False, False, True, True, True, True]
    assert "missing 1 required positional argument: 'b'" in results[2].content
    assert "unexpected keyword argument 'c'" in results[3].content
    assert results[4].content == "{'k': [1, 2]}" and results[5].content == "None"
    assert "grpo-flow takes text only" in results[6].content
    assert results[7].content == "{'error': 'Tool no_such_tool not found.'}"  # TRL's message
    assert results[8].content == "{'error': 'Unsupported tool call type: code_interpreter'}"
    assert "must be an object" in results[9].content
    assert [r.name for r in results[:2]] == ["add", "explode"]


def test_a_hanging_sandboxed_tool_is_killed_at_the_timeout(tools):
    started = time.monotonic()
    (result,) = run_tool_calls([ToolRequest(call("hang", seconds=60), tools)], timeout_s=1.5, sandbox=True)
    assert time.monotonic() - started < 20
    assert result.failed and result.content == "{'error': 'Tool hang did not return within 1.5 s'}"


def test_a_tool_busy_in_python_is_killed_with_its_process_at_the_timeout(tools):
    started = time.monotonic()
    (result,) = run_tool_calls([ToolRequest(call("spin", seconds=60), tools)], timeout_s=0.5, sandbox=False)
    assert time.monotonic() - started < 5
    assert result.failed and "did not return within 0.5 s" in result.content


def sleeps(seconds: float) -> str:
    """Sleeps (in C), then says which process it ran in.

    Args:
        seconds: How long.
    """
    time.sleep(seconds)
    return str(os.getpid())


def test_a_tool_blocked_in_c_is_killed_and_the_next_call_runs_in_a_fresh_process(tools):
    tools = {**tools, "sleeps": Tool("sleeps", sleeps)}
    (before,) = run_tool_calls([ToolRequest(call("sleeps", seconds=0), tools)], timeout_s=20, sandbox=False)
    started = time.monotonic()
    results = run_tool_calls(
        [ToolRequest(call("sleeps", seconds=30), tools), ToolRequest(call("add", a=1, b=1), tools)],
        timeout_s=0.5,
        sandbox=False,
    )
    assert time.monotonic() - started < 5
    assert results[0].failed and results[0].content == "{'error': 'Tool sleeps did not return within 0.5 s'}"
    assert results[1].content == "2"  # the turn goes on
    with pytest.raises(ProcessLookupError):  # the blocked call's process was killed, not left behind
        os.kill(int(before.content), 0)
    (after,) = run_tool_calls([ToolRequest(call("sleeps", seconds=0), tools)], timeout_s=20, sandbox=False)
    assert after.content != before.content and int(before.content) != os.getpid()


class Counter:
    """An environment whose tool changes its state: the change must outlive the call's process."""

    def __init__(self):
        self.calls, self.pids = 0, []

    def bump(self, by: int) -> str:
        """Count.

        Args:
            by: how much
        """
        self.calls += by
        self.pids.append(os.getpid())
        return str(self.calls)


def test_an_environments_state_and_a_closures_answer_come_back_from_the_tools_process():
    counter, suffix = Counter(), "!"
    tools = {"bump": Tool("bump", counter.bump), "shout": Tool("shout", lambda text: text.upper() + suffix)}
    requests = [ToolRequest(call("bump", by=2), tools), ToolRequest(call("bump", by=3), tools)]
    requests.append(ToolRequest(call("shout", text="a"), tools))
    results = run_tool_calls(requests, timeout_s=20, sandbox=False)
    assert [r.content for r in results] == ["2", "5", "A!"]
    assert counter.calls == 5 and len(set(counter.pids)) == 1 and counter.pids[0] != os.getpid()


def test_a_tool_that_cannot_be_sent_to_its_process_is_a_tool_message():
    lock = threading.Lock()
    tools = {"locked": Tool("locked", lambda: str(lock.locked()))}
    (result,) = run_tool_calls([ToolRequest(call("locked"), tools)], timeout_s=20, sandbox=False)
    assert result.failed and "Tool locked cannot be sent to the process that runs it" in result.content
    assert "cannot pickle '_thread.lock' object" in result.content


def test_sandboxed_tools_cannot_reach_the_network_or_write_outside():
    import fixture_tools  # noqa: F401  (importable here; the sandbox imports it by path)

    program = ToolRequest(call("shout", text="ok"), {"shout": build_toolbox([f"{HERE}:shout"], None, None).tools[0]})
    (result,) = run_tool_calls([program], timeout_s=None, sandbox=True)  # the sandbox's own limit
    assert result.content == "OK" and not result.failed


class Browser:
    """An environment holding what cannot be pickled (a lock standing in for a socket or a browser)."""

    def __init__(self):
        self.session, self.pages = threading.Lock(), []

    def visit(self, url: str) -> str:
        """Visit.

        Args:
            url: where
        """
        self.pages.append((url, os.getpid()))
        return f"{url}: {len(self.pages)}"

    async def title(self) -> str:
        """The page's title."""
        return self.pages[-1][0].upper()


def test_without_a_timeout_tools_and_methods_are_called_here_as_trl_calls_them():
    import asyncio

    browser, seen = Browser(), []
    tools = {"visit": Tool("visit", browser.visit), "title": Tool("title", browser.title)}
    tools["remember"] = Tool("remember", lambda text: seen.append(text) or "ok")  # a closure over this process
    requests = [call("visit", url="a"), call("visit", url="b"), call("title"), call("remember", text="x")]
    results = run_tool_calls([ToolRequest(r, tools) for r in requests], timeout_s=None, sandbox=False)
    assert [r.content for r in results] == ["a: 1", "b: 2", "B", "ok"] and not any(r.failed for r in results)
    assert browser.pages == [("a", os.getpid()), ("b", os.getpid())] and seen == ["x"]

    async def from_a_running_loop():  # an async tool awaited from a thread whose event loop runs
        return run_tool_calls([ToolRequest(call("title"), tools)], timeout_s=None, sandbox=False)

    assert asyncio.run(from_a_running_loop())[0].content == "B"


def test_tool_content_is_trls_text():
    assert tool_content("x") == "x" and tool_content(3) == "3" and tool_content([1, 2]) == "[1, 2]"
    assert tool_content([{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]) == "ab"


def test_a_tool_module_in_a_folder_the_sandbox_hides_is_imported_there(tmp_path, monkeypatch):
    """A project under the home or temp dir (both hidden in the sandbox): its folder, found on the
    import path, stays visible to the sandboxed program."""
    (tmp_path / "project_tools.py").write_text(
        'def loud(text: str) -> str:\n    """Shout.\n\n    Args:\n        text: what to shout\n    """\n'
        "    return text.upper() + '!'\n"
    )
    for path in (tmp_path, tmp_path / "project_tools.py"):
        path.chmod(0o755)
    monkeypatch.syspath_prepend(str(tmp_path))
    tool = build_toolbox(["project_tools:loud"], None, None).tools[0]
    (result,) = run_tool_calls([ToolRequest(call("loud", text="hi"), {"loud": tool})], timeout_s=20, sandbox=True)
    assert (result.content, result.failed) == ("HI!", False)
