"""Only what the user asked for on the terminal: Prefect's console logs and its server's output go to
a log file, `<storage_root>/logs/prefect.log`.

    log_path = quiet_prefect_run(storage_root)   # `grpo train` (without --verbose), GRPOFlowTrainer.train()
    with quiet_libraries(): ...                  # no transformers progress bars or advisory warnings
    keep_completed_states_out()                  # the grpo flow: no "Finished in state Completed()" per task

Prefect logs every task run to the console (about a dozen lines a step), a failed run's traceback
several times over, and at exit whatever its background services hit. The Prefect UI and
`prefect flow-run logs` still get every line (the API handler is left alone); the terminal shows the
progress bar, the summary, one line per error, and warnings meant for the user: a log record with
`extra={USER_FACING: True}` (the no-reward warning, say) is printed as `grpo-flow: warning: ...`.

The routing lasts for the rest of the process, because Prefect's noise comes at exit too.
`--verbose` (or not calling this) keeps Prefect's console as it is.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import warnings
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path

from grpo_flow.tasks.observability import USER_FACING
from grpo_flow.workers.state.location import local_root

_FILE_HANDLERS: dict[Path, logging.Handler] = {}


class _UserFacing(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return bool(getattr(record, USER_FACING, False))


class _ToStderr(logging.StreamHandler):
    """Writes to whatever sys.stderr is when a record comes (a test harness may have replaced it since)."""

    @property  # type: ignore[override]
    def stream(self) -> object:
        return sys.stderr

    @stream.setter
    def stream(self, value: object) -> None:
        pass


_USER_HANDLER = _ToStderr()
_USER_HANDLER.addFilter(_UserFacing())
_USER_HANDLER.setFormatter(logging.Formatter("grpo-flow: warning: %(message)s"))


def log_path_for(storage_root: str | os.PathLike) -> Path:
    return local_root(storage_root) / "logs" / "prefect.log"


def quiet_prefect_run(storage_root: str | os.PathLike) -> Path:
    """Route Prefect's console logs to the storage root's log file and start the ephemeral server
    writing there too (in a session of its own: see flows/ephemeral_server.py); returns the file."""
    from grpo_flow.flows.ephemeral_server import start_ephemeral_server

    path = log_path_for(storage_root)
    route_prefect_console(path)
    start_ephemeral_server(path)
    return path


def route_prefect_console(path: Path) -> None:
    """Every Prefect handler that writes to the terminal is replaced by one that appends to `path`."""
    # Prefect installs its console handlers (setup_logging) when prefect.main is imported, which
    # a bare `import prefect` does not; routing them before that would be undone by it.
    import prefect.main  # noqa: F401

    path = path.resolve()
    if path not in _FILE_HANDLERS:
        path.parent.mkdir(parents=True, exist_ok=True)
        handler = logging.FileHandler(path, encoding="utf-8")
        handler.setFormatter(logging.Formatter("%(asctime)s | %(levelname)-7s | %(name)s - %(message)s"))
        _FILE_HANDLERS[path] = handler
        with open(path, "a", encoding="utf-8") as log:
            started = datetime.now(timezone.utc).isoformat(timespec="seconds")
            log.write(f"---- {started} pid {os.getpid()}: {' '.join(sys.argv)}\n")
    to_file = _FILE_HANDLERS[path]
    loggers = [logging.getLogger()] + [
        logger for logger in logging.root.manager.loggerDict.values() if isinstance(logger, logging.Logger)
    ]
    for logger in loggers:
        for existing in list(logger.handlers):
            if _writes_to_terminal(existing) or existing in _FILE_HANDLERS.values():
                logger.removeHandler(existing)
                logger.addHandler(to_file)
    root = logging.getLogger()
    if _USER_HANDLER not in root.handlers:
        root.addHandler(_USER_HANDLER)


class _CompletedStates(logging.Filter):
    """Drops Prefect's INFO line "Finished in state Completed()" of each task run and step subflow run: a
    dozen a step, they would bury the run's one line per step in the UI's log tab. Any other state is kept,
    and every line when the logger is set to DEBUG."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno != logging.INFO or logging.getLogger(record.name).isEnabledFor(logging.DEBUG):
            return True
        if record.name == "prefect.flow_runs" and getattr(record, "flow_name", None) != "grpo-step":
            return True
        return not record.getMessage().startswith("Finished in state Completed(")


_COMPLETED_STATES = _CompletedStates()


def keep_completed_states_out() -> None:
    """Install the filter above on Prefect's task and flow run loggers, once a process."""
    for name in ("prefect.task_runs", "prefect.flow_runs"):
        logger = logging.getLogger(name)
        if _COMPLETED_STATES not in logger.filters:
            logger.addFilter(_COMPLETED_STATES)


def _writes_to_terminal(handler: logging.Handler) -> bool:
    """Prefect's console handlers (its `console`, and the `debug` one of prefect._internal)."""
    return (
        isinstance(handler, logging.StreamHandler)
        and not isinstance(handler, logging.FileHandler)
        and type(handler).__module__.startswith("prefect.")
    )


@contextlib.contextmanager
def quiet_libraries() -> Iterator[None]:
    """No transformers or datasets progress bars ("Loading weights", "Map"), no transformers advisory
    warnings, no hub-client retry warnings and no library FutureWarnings, for the block; then as before."""
    from huggingface_hub.utils import logging as hub_logging
    from transformers.utils import logging as hf_logging

    from grpo_flow.workers.data.loaders import without_progress_bars

    bars = hf_logging.is_progress_bar_enabled()
    verbosity, hub_verbosity = hf_logging.get_verbosity(), hub_logging.get_verbosity()
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    hub_logging.set_verbosity_error()  # the hub client logs each retry of a request as a warning
    try:
        with warnings.catch_warnings(), without_progress_bars():
            warnings.filterwarnings("ignore", category=FutureWarning)
            yield
    finally:
        hf_logging.set_verbosity(verbosity)
        hub_logging.set_verbosity(hub_verbosity)
        if bars:
            hf_logging.enable_progress_bar()
