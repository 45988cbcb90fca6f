"""Shared fixtures: a real nats-server with JetStream on a free port, fresh store."""
from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from pathlib import Path

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


@pytest.fixture
def sandbox_dir():
    """A fresh directory the sandbox uid may traverse (0711: the setuid fallback needs
    traversable ancestors, which /tmp's sticky root is not), removed afterwards."""
    path = Path(tempfile.mkdtemp(prefix="gyre-test-"))
    os.chmod(path, 0o711)
    yield path
    shutil.rmtree(path, ignore_errors=True)
