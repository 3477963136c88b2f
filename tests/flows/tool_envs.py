"""Environments for tests that run multi-turn episodes (named `tool_envs:<Class>`, with tests/flows on
PYTHONPATH for a `grpo train` process). Each answers the tiny-tools model's `lookup(digit)` calls."""

import os

from grpo_flow.workers.data.tiny_tools import DigitTable


class CountingTable(DigitTable):
    """digit_lookup's environment that appends the row's prompt_id to $GRPO_FLOW_TEST_TOOL_CALLS at every
    lookup: a side effect a test in another process reads, to count the calls made for each logged step."""

    def reset(self, prompt_id: str = "", **row) -> None:
        super().reset(**row)
        self.prompt_id = prompt_id

    def lookup(self) -> str:
        """Look this prompt's digit up in its table.

        Returns:
            The digit the table maps it to.
        """
        path = os.environ.get("GRPO_FLOW_TEST_TOOL_CALLS")
        if path:
            with open(path, "a") as calls:
                calls.write(self.prompt_id + "\n")
        return super().lookup()


class RewardingTable:
    """Owns the reward (TRL's get_reward): 1.0 for a rollout that looked something up, 0.0 for one that did not."""

    def reset(self, **row) -> str:
        self.looked_up = 0
        return ""

    def lookup(self) -> str:
        """Look it up."""
        self.looked_up += 1
        return "1"

    def get_reward(self) -> float:
        return 1.0 if self.looked_up else 0.0


class SevenTable(RewardingTable):
    """Every lookup answers 7, and a second tool shows in its rows' prompts only."""

    def lookup(self) -> str:
        """Look it up."""
        self.looked_up += 1
        return "7"

    def peek(self) -> str:
        """Peek at the table."""
        return "no"
