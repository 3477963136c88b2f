"""The Modal Volume test double (volume_double.py) in place of the run Volume, for the Modal backend's tests."""

import pytest

from grpo_flow.workers.backends import modal_app, modal_backend
from volume_double import VolumeDouble  # tests/workers/backends/volume_double.py


@pytest.fixture
def volume(tmp_path_factory, monkeypatch):
    """The double in place of the run Volume: in each `.local()` container, and for this process's client."""
    double = VolumeDouble(tmp_path_factory.mktemp("volume"))
    monkeypatch.setattr(modal_app, "container_volume", double.container_volume)
    monkeypatch.setattr(modal_backend, "open_volume", lambda name: double)
    return double
