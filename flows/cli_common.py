"""What the `grpo` command and its component commands share: the usage error and quiet Prefect.

Its own module so that `flows/cli.py` (which registers the component commands) and
`flows/components.py` (which raises the same error) do not import each other.
"""

from __future__ import annotations

import os
import warnings


class UsageError(Exception):
    """Bad input from the command line: printed as one message, exit status 2."""


def quiet_prefect(verbose: bool) -> None:
    """Keep Prefect's per-task logging out of the progress bar unless asked for."""
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    if not verbose:
        os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        os.environ.setdefault("HF_HUB_VERBOSITY", "error")  # a retry of each hub request was a warning line
        os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
        warnings.filterwarnings("ignore", category=FutureWarning)  # library deprecation notices
