"""Tools and environments the tests import by path (`tests.workers.tools.fixture_tools:name`), as a user's
module would be imported: by the run, and by the sandbox."""

import os
import time


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first number.
        b: The second number.
    """
    return a + b


def shout(text: str) -> str:
    """Say it loudly.

    Args:
        text: What to say.
    """
    return text.upper()


def explode(reason: str) -> str:
    """Always fails.

    Args:
        reason: Why.
    """
    raise RuntimeError(f"exploded: {reason}")


def hang(seconds: float) -> str:
    """Sleeps (blocked in C, which no Python-level stop reaches).

    Args:
        seconds: How long.
    """
    time.sleep(seconds)
    return "woke up"


def spin(seconds: float) -> str:
    """Busy in Python.

    Args:
        seconds: How long.
    """
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass
    return "done"


def as_dict(key: str) -> dict:
    """Returns a dict, not text.

    Args:
        key: The key.
    """
    return {key: [1, 2]}


def nothing() -> None:
    """Returns None."""
    return None


def image_blocks() -> list:
    """Returns TRL's multimodal content with an image in it."""
    return [{"type": "text", "text": "look"}, {"type": "image", "image": "..."}]


def undocumented(a: int) -> int:
    return a


def untyped(a):
    """No type hints.

    Args:
        a: Something.
    """
    return a


class Counter:
    """An environment that counts its calls in a file named by $GRPO_FLOW_TEST_TOOL_CALLS (a side effect a
    test in another process can read) and owns its reward."""

    def __init__(self) -> None:
        self.calls = 0
        self.prompt_id = ""

    def reset(self, prompt_id: str = "", **row) -> str:
        self.calls = 0
        self.prompt_id = prompt_id
        return " (counter ready)"

    def bump(self, by: int) -> str:
        """Count up.

        Args:
            by: How much.
        """
        self.calls += by
        path = os.environ.get("GRPO_FLOW_TEST_TOOL_CALLS")
        if path:
            with open(path, "a") as handle:
                handle.write(self.prompt_id + "\n")
        return str(self.calls)

    def get_reward(self) -> float:
        return float(self.calls)


class NoReset:
    def look(self, x: int) -> int:
        """Look.

        Args:
            x: At this.
        """
        return x


class Clashing:
    def reset(self, **row) -> None:
        return None

    def add(self, a: int, b: int) -> int:
        """Also add.

        Args:
            a: One.
            b: Two.
        """
        return a + b
