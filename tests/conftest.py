"""Shared fixtures: a real nats-server with JetStream on a free port, fresh store."""
from __future__ import annotations

import uuid

import pytest

from bus.server import NatsServer


@pytest.fixture
def nats_server(tmp_path):
    """A private JetStream server for one test: `.url`, `.token`."""
    server = NatsServer.start(tmp_path / "nats")
    yield server
    server.stop()


@pytest.fixture
def run_id():
    """A fresh run id, so streams and consumers never collide between tests."""
    return "t" + uuid.uuid4().hex[:10]
