"""Helpers of the crash tests: a run directory for daemons started as processes, starting and
SIGKILLing them (`gyre bench chaos`'s supervisor), waiting on the bus."""
from __future__ import annotations

import asyncio
import time
from pathlib import Path

import orjson

from handlers.bench.chaos import Supervisor

ROOT = Path(__file__).resolve().parents[1]


def make_run_dir(path: Path, run: str, server, recipe) -> Path:
    """A run directory as `gyre run` writes it (config.json, nats.json, key_secret, logs/),
    for daemons joined with `--run-dir` to `server` (no owner pid: it never ends)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "logs").mkdir(exist_ok=True)
    (path / "config.json").write_bytes(orjson.dumps(recipe.to_dict()))
    (path / "nats.json").write_bytes(orjson.dumps({"run": run, "url": server.url, "token": server.token}))
    (path / "key_secret").write_text("ab" * 32)
    (path / "engine_token").write_text("cd" * 16)
    return path


class Daemons(Supervisor):
    """`gyre bench chaos`'s supervisor, restarting only when told (`start`), with what a test
    asserts on: `alive()` and every daemon's log tail."""

    def __init__(self, run_dir: Path) -> None:
        super().__init__(run_dir)
        self.env["PYTHONPATH"] = str(ROOT)

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-2500:]}"
                         for p in sorted((self.run_dir / "logs").glob("*.log")))

    def alive(self) -> None:
        dead = [(n, p.returncode) for n, p in self.procs.items() if p.poll() is not None]
        assert not dead, f"daemons died: {dead}\n{self.logs()}"


async def until(predicate, what: str, timeout_s: float = 60.0, every_s: float = 0.1, check=None):
    """Await until `await predicate()` (or `predicate()`) is truthy; returns its value."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return value
        if check is not None:
            check()
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(every_s)
