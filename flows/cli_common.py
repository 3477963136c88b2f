"""What the `grpo` command and its component commands share: the usage error and quiet Prefect.

Its own module so that `flows/cli.py` (which registers the component commands) and
`flows/components.py` (which raises the same error) do not import each other.
"""

from __future__ import annotations

import os
import warnings
from typing import Any


class UsageError(Exception):
    """Bad input from the command line: printed as one message, exit status 2."""


def quiet_prefect(verbose: bool) -> None:
    """Keep Prefect's per-task logging out of the progress bar unless asked for. Its console handler alone
    is quieted: the records still reach the API handler, so a run on a server keeps its log tab."""
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    if not verbose:
        os.environ.setdefault("PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL", "WARNING")
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        os.environ.setdefault("HF_HUB_VERBOSITY", "error")  # a retry of each hub request was a warning line
        os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
        warnings.filterwarnings("ignore", category=FutureWarning)  # library deprecation notices


def reach(storage_root: str) -> None:
    """A URL storage root's store answers (StorageURLError naming the URL otherwise: exit 2, one line)."""
    from grpo_flow.workers.state.location import check_reachable, is_url

    if is_url(storage_root):
        check_reachable(storage_root, write=False)


def named_run(storage_root: str, run_id: str, label: str = "RUN") -> Any:
    """The `RunStorage` of an existing run that a command's RUN argument names: a run id, as `--run-id`
    takes it, so that no path (`../elsewhere`) reaches a folder outside the storage root."""
    from grpo_flow.schemas.config import check_run_id
    from grpo_flow.workers.state.storage import RunStorage

    try:
        check_run_id(run_id)
    except ValueError as error:
        raise UsageError(f"{label}: {error}") from None
    reach(storage_root)
    storage = RunStorage(storage_root, run_id)
    if not storage.exists():
        raise UsageError(f"{label}: no run {run_id!r} under {os.path.join(storage_root, 'runs')}")
    return storage
