"""Helpers of the crash tests: a run directory for daemons started as processes, starting and
SIGKILLing them, waiting on the bus."""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import orjson

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


class Daemons:
    """Daemon processes of one run, each as `gyre run`'s supervisor starts it; logs append to
    `<run_dir>/logs/<name>.log` across restarts."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.procs: dict[str, subprocess.Popen] = {}
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("GYRE_NATS")}
        self.env.update(HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1",
                        PYTHONPATH=str(ROOT))

    def start(self, name: str, module: str | None = None, *extra: str) -> subprocess.Popen:
        with open(self.run_dir / "logs" / f"{name}.log", "ab") as log:
            proc = subprocess.Popen([sys.executable, "-m", module or f"handlers.{name}", "--run-dir",
                                     str(self.run_dir), "--log-json", *extra], cwd=ROOT, stdout=log,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=self.env,
                                    start_new_session=True)
        self.procs[name] = proc
        return proc

    def kill9(self, name: str) -> int:
        """SIGKILL daemon `name` (the process only, as a crash would: its children are on
        their own); returns its exit status."""
        proc = self.procs[name]
        proc.send_signal(signal.SIGKILL)
        return proc.wait(30)

    def log(self, name: str) -> str:
        return (self.run_dir / "logs" / f"{name}.log").read_text(errors="replace")

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-2500:]}"
                         for p in sorted((self.run_dir / "logs").glob("*.log")))

    def alive(self) -> None:
        dead = [(n, p.returncode) for n, p in self.procs.items() if p.poll() is not None]
        assert not dead, f"daemons died: {dead}\n{self.logs()}"

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 30
        for p in self.procs.values():
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


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
