"""Prefect flows: `grpo` (a run) and its per-step subflow `grpo-step`, `evaluate`, `grpo-simple`;
the `grpo` CLI.

Importing this package sets Prefect's task-run recorder to batch its writes, unless the
environment already says otherwise. Prefect 3.8's server records task-run events one SQLite
transaction each by default; a step's ~40 events then hold up the next step's first API call
by about 2 s on every step (benchmarks/orchestration.py --unbatched-recorder: 2.6 s per instant
step; batched: 0.4-0.5 s median). The
variables must be set before Prefect starts its ephemeral server, which is why this happens
at import; for `prefect server start`, export the same variables in its shell.

It also sets, unless already set:
- PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS=120: Prefect waits 20 s for its ephemeral
  server by default, which a busy 2-core machine overran twice (`Timed out while attempting to
  connect to ephemeral Prefect API server`); it answers in ~3-8 s when idle, ~14 s on a fresh database.
- PREFECT_SERVER_ANALYTICS_ENABLED=false: offline, the server's telemetry logs an error at start.
"""

import os

FAST_RECORDER = {
    "PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_BATCH_SIZE": "100",
    "PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_READ_BATCH_SIZE": "100",
    "PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_FLUSH_INTERVAL": "1",
}
SERVER_DEFAULTS = {
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
}
for _name, _value in {**FAST_RECORDER, **SERVER_DEFAULTS}.items():
    os.environ.setdefault(_name, _value)
