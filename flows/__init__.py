"""Prefect flows: `grpo` (a run) and its per-step subflow `grpo-step`, `evaluate`, `grpo-simple`;
the `grpo` CLI.

Importing this package sets these in the environment, unless it already says otherwise; both
must be set before Prefect starts its ephemeral server (at the first flow run), which is why this
happens at import.

- The task-run recorder batches its writes (up to 100 events a transaction, at least once a
  second). With Prefect's default of one transaction per event, the next step's first API call
  waits for the recorder to catch up. For a `prefect server start`, export the same variables in
  its shell (deployments/local_server.py does).
- With no PREFECT_API_URL (the ephemeral server) and no database of your own, the ephemeral
  server keeps its database in memory. On a SQLite file, the server creates a subflow's tracking
  task run in a transaction that reads before it writes; SQLite fails it at once ("database is
  locked", HTTP 503, retried by the client after a fixed delay) whenever another of the server's
  connections committed in between. For an in-memory database Prefect keeps a pool of exactly
  one connection, so the server's transactions run one after another and none can fail another.
  The ephemeral server's records then last as long as the process (the run's storage root keeps
  everything; the UI needs `prefect server start` anyway). Set PREFECT_API_DATABASE_CONNECTION_URL
  to keep them.
- On that in-memory database the server's event persister is off
  (PREFECT_SERVER_SERVICES_EVENT_PERSISTER_ENABLED=false, unless set): it stores every event for
  an event feed that nothing can open and that ends with the process, and its CPU comes out of
  the step's torch threads on a small machine. Task runs, flow runs, states and artifacts are
  recorded as usual (the task-run recorder reads the same events from the server's message bus).
- PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS=120: Prefect's default wait for its ephemeral
  server is shorter than a fresh database takes to start on a busy small machine.
- PREFECT_SERVER_ANALYTICS_ENABLED=false: offline, the server's telemetry logs an error at start.
"""

import json
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
EPHEMERAL_DATABASE = "sqlite+aiosqlite:///:memory:"
EVENT_PERSISTER = "PREFECT_SERVER_SERVICES_EVENT_PERSISTER_ENABLED"
DATABASE_VARIABLES = ("PREFECT_API_DATABASE_CONNECTION_URL", "PREFECT_SERVER_DATABASE_CONNECTION_URL")

for _name, _value in {**FAST_RECORDER, **SERVER_DEFAULTS}.items():
    os.environ.setdefault(_name, _value)
# What this import set for the ephemeral server on the in-memory database alone: a `prefect server
# start` of ours (deployments/local_server.py) leaves these out of its environment.
# A child process inherits them: EPHEMERAL_MARK names them, so that they stay this import's there too
# (not settings of the user's own) and a `prefect server start` the child makes leaves them out as well.
EPHEMERAL_MARK = "GRPO_FLOW_EPHEMERAL_ONLY"
EPHEMERAL_ONLY: dict[str, str] = {
    name: value
    for name, value in json.loads(os.environ.get(EPHEMERAL_MARK) or "{}").items()
    if os.environ.get(name) == value  # a value changed since is the user's
}
if not os.environ.get("PREFECT_API_URL") and not any(
    os.environ.get(name) for name in DATABASE_VARIABLES if name not in EPHEMERAL_ONLY
):
    EPHEMERAL_ONLY["PREFECT_API_DATABASE_CONNECTION_URL"] = EPHEMERAL_DATABASE
    if EVENT_PERSISTER not in os.environ or EVENT_PERSISTER in EPHEMERAL_ONLY:
        EPHEMERAL_ONLY[EVENT_PERSISTER] = "false"
    os.environ.update(EPHEMERAL_ONLY)
if EPHEMERAL_ONLY:
    os.environ[EPHEMERAL_MARK] = json.dumps(EPHEMERAL_ONLY)


def ephemeral_database_in_memory() -> bool:
    """Whether this process's Prefect API is the ephemeral server on the in-memory database, whose
    writes cannot collide (see above). Read from the environment, as the ephemeral server is
    started with it (Prefect's settings object keeps what it saw when Prefect was imported)."""
    from prefect.settings import get_current_settings

    settings = get_current_settings()
    url = os.environ.get("PREFECT_API_DATABASE_CONNECTION_URL") or os.environ.get(
        "PREFECT_SERVER_DATABASE_CONNECTION_URL"
    )
    return settings.api.url is None and ":memory:" in (url or "")
