"""What a run is doing in its first minutes, said in a few plain lines: fetching or converting the
model, building the tiny model, the held-out evaluations.

    say("building the tiny model (once)")      # a worker, anywhere in the run's process
    with shown_phases(sys.stderr): ...         # `grpo train` with progress: `grpo-flow: building ...`

The lines go to the `grpo_flow.phase` logger, which does not propagate: nothing prints them
unless asked (a run with --no-progress, a test, the Python API without progress stay silent).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import TextIO

PHASE_LOGGER = logging.getLogger("grpo_flow.phase")
PHASE_LOGGER.propagate = False  # never into Prefect's handlers, the root's or its log file
PHASE_LOGGER.setLevel(logging.INFO)


class _BesideBars(logging.StreamHandler):
    """Written with tqdm.write: above a progress bar on a terminal, not through it."""

    def emit(self, record: logging.LogRecord) -> None:
        from tqdm import tqdm

        tqdm.write(self.format(record), file=self.stream)
        self.flush()


def say(message: str) -> None:
    PHASE_LOGGER.info(message)


@contextlib.contextmanager
def shown_phases(stream: TextIO | None) -> Iterator[None]:
    """Print each phase line to `stream` (None: print nothing) for the block."""
    if stream is None:
        yield
        return
    handler = _BesideBars(stream)
    handler.setFormatter(logging.Formatter("grpo-flow: %(message)s"))
    PHASE_LOGGER.addHandler(handler)
    try:
        yield
    finally:
        PHASE_LOGGER.removeHandler(handler)
