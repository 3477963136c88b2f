"""Test-wide settings: offline, quiet, one temporary Prefect server for the session."""

import os

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import pytest  # noqa: E402

import flows  # noqa: E402,F401  as every use of grpo-flow: Prefect's recorder batched (flows/__init__.py)


@pytest.fixture(scope="session")
def prefect_server():
    """A temporary Prefect server and database for the whole session (Prefect's own test harness)."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


@pytest.fixture(scope="session")
def storage_root(tmp_path_factory):
    """One storage root per session, so the tiny model is built once."""
    return tmp_path_factory.mktemp("grpo-storage")
