"""`python -m grpo_flow ...` is the `grpo` command."""

import sys

from grpo_flow.flows.cli import main

if __name__ == "__main__":
    sys.exit(main())
