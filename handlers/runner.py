"""Runner daemon: one confined, unmodified harness process per dispatched execution.

Consumes `execution.dispatched` (durable `runner-v1`, work queue) with `concurrency`
executions at once. Per execution:
1. seed `<run_dir>/workspaces/<execution>/` from its task (failure → `execution.finished`
   status `no_workspace`, workspace '');
2. write the harness's files into `<run_dir>/homes/<execution>/` (its HOME), hand both
   to the sandbox uid;
3. publish `execution.started`, start the harness confined (gyre.env.sandbox) with the proxy's
   base URL and the execution's key (gyre.env.harness.execution_key) in its environment, its
   stdout+stderr in `<run_dir>/logs/executions/<execution>.log`; in its own network
   namespace, where the proxy's port on 127.0.0.1 is relayed (handlers/sandbox_relay.py) to
   the runner's Unix socket and from there to the proxy, and nothing else is reachable;
4. wait at most the event's `timeout_s`, then kill the whole sandbox (status `timeout`);
5. keep the workspace, record the outcome in `<run_dir>/runner/<execution>.json`, publish
   `execution.finished` (status `ok` / `timeout` / `harness_error`, exit code, duration);
   exit code 125 with confinement is the relay's "could not set up the sandbox's network"
   (the harness never started): `harness_error`.

The sandbox uid must be able to read the harness interpreter (`Config.python`) and its
installation: a runner that finds it cannot (a checkout inside a 0700 directory under the
setuid fallback) stops at start with a message naming the path and the fix; a harness
installation it cannot read fails that execution (`harness_error`) with the same message.
A host where harnesses cannot be confined at all (no working bubblewrap, and as root no
network namespace: a container without CAP_SYS_ADMIN) stops the runner at start, naming
the fix (`gyre.env.sandbox.resolve_mode`).

Restart (kill -9): the runner keeps nothing in memory that a successor needs: its state is
the work queue and `<run_dir>` (workspaces/, runner/ records). Its harnesses die with it
(bwrap's `--die-with-parent`; in the `setuid` and `none` modes they may outlive it). Every
`execution.dispatched` it had not acked comes back after `runner-v1`'s ack_wait (60 s) and
takes the path below: finished and recorded → its record republished; cut short → reported
as below, never relaunched; not yet started → launched. Dispatches it never received are
launched as usual. Cost: executions cut short are not trained, and a restart delays their
`execution.finished` by up to the ack_wait (tests/test_crash_daemons.py).

Idempotent under redelivery: a recorded execution re-publishes its recorded
`execution.finished` (same event id, deduplicated); an execution whose workspace exists
without a record was cut short by a runner restart (its harness died with the runner):
it is reported `harness_error` (`timeout` in a resumed run, so the evaluator scores its
preserved workspace: handlers.resume), never relaunched, so the proxy never sees two harnesses
behind one execution id. On shutdown the running harnesses are killed and their messages
given back (they come back as `harness_error` through the same path).
"""
from __future__ import annotations

import asyncio
import dataclasses
import os
import shutil
import signal
import sys
import tempfile
import time
import urllib.parse
from pathlib import Path

import aiohttp
import structlog

import schemas
from bus import Bus, Retry
from gyre.config import RunnerSettings, fields_of
from gyre.env import harness as harnesses
from gyre.env.sandbox import (
    Launch, Network, SandboxConfig, base_env, confine, own_tree, resolve_mode, unreachable_ancestor, unreadable,
)
from gyre.env.tasks import Task, load_tasks, seed_workspace, task_index, write_files
from handlers import sandbox_relay
from handlers.daemon import FatalError, RunContext, connected, daemon_main
from handlers.proxy.http import serving_proxy, url_in
from handlers.resume import resumed
from schemas import ids

log = structlog.get_logger()


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Config(RunnerSettings):
    """The runner's settings: the recipe's (`RunnerSettings`: concurrency) and its own.
    run, nats_url, nats_token: the bus (`handlers.daemon.BusSettings`; the token never
    reaches a harness)."""

    run: str
    nats_url: str
    nats_token: str | None
    run_dir: Path
    """The run directory (workspaces/, homes/, logs/executions/, runner/ inside)."""
    tasks: str
    """Task set the dispatched task ids refer to: the recipe's `tasks.set` (bundled name or JSONL path)."""
    key_secret: str
    """Hex HMAC secret of execution keys (shared with the proxy), non-empty."""
    proxy_url: str = ""
    """The proxy's base URL without /v1, loopback http only; '' = read `url` from
    <run_dir>/proxy.json (waiting for the proxy to write it)."""
    model: str = "gyre"
    """Model name the harness asks the proxy for."""
    python: str = sys.executable
    """Interpreter of the harness environment (mini-swe-agent is `<its bin>/mini`)."""
    sandbox: SandboxConfig = SandboxConfig()
    """Confinement (uid, mode, extra read-only paths)."""
    proxy_wait_s: float = 60.0
    """Seconds to wait for a proxy of the run to answer before failing the execution (`harness_error`)."""
    context_tokens: int = 0
    """The policy's context window in tokens, passed to harnesses that take one
    (`LaunchRequest.context_tokens`): the recipe's `engine.max_context_tokens`; 0 = not known."""
    cut_short: str = "harness_error"
    """The status of an execution whose harness died with a previous runner (a workspace and
    no record): `harness_error` (excluded), or `timeout` in a resumed run (handlers.resume:
    scored on its preserved workspace, partial credit)."""

    def __post_init__(self) -> None:
        RunnerSettings.__post_init__(self)
        if self.context_tokens < 0:
            raise ValueError(f"runner context_tokens must be >= 0 (0 = not known), got {self.context_tokens}")
        try:
            secret = bytes.fromhex(self.key_secret)
        except ValueError:
            raise ValueError("runner key_secret must be hex") from None
        if not secret:
            raise ValueError("runner key_secret must be non-empty (execution keys are HMACs of it)")
        if self.cut_short not in ("harness_error", "timeout"):
            raise ValueError(f"runner cut_short must be harness_error or timeout, got {self.cut_short!r}")
        if self.proxy_url and not self.proxy_url.startswith(("http://127.0.0.1", "http://localhost", "http://[::1]")):
            raise ValueError(f"runner proxy_url must be a loopback http URL, got {self.proxy_url!r}")


def config_from_context(ctx: RunContext, _args=None) -> Config:
    r = ctx.recipe
    return Config(**fields_of(r.harness, RunnerSettings), run=ctx.run, nats_url=ctx.nats_url,
                  nats_token=ctx.nats_token, run_dir=ctx.run_dir, tasks=r.tasks.set, key_secret=ctx.key_secret.hex(),
                  proxy_url=os.environ.get("GYRE_PROXY_URL", ""), context_tokens=r.engine.max_context_tokens,
                  cut_short="timeout" if resumed() else "harness_error")


@dataclasses.dataclass(frozen=True, slots=True)
class Paths:
    """Where one execution's files live (all absolute)."""

    workspace: Path
    home: Path
    log: Path
    record: Path

    @classmethod
    def of(cls, run_dir: Path, execution: str) -> "Paths":
        run_dir = Path(run_dir).resolve()
        return cls(workspace=run_dir / "workspaces" / execution, home=run_dir / "homes" / execution,
                   log=run_dir / "logs" / "executions" / f"{execution}.log", record=run_dir / "runner" / f"{execution}.json")


def finished_event(run: str, info: schemas.ExecutionInfo, status: str, workspace: str,
                   exit_code: int | None = None, duration_s: float = 0.0) -> schemas.ExecutionFinished:
    """The `execution.finished` fact of one execution (id `<run>:<execution>:finished`)."""
    return schemas.ExecutionFinished(event_id=ids.finished(run, info.execution), info=info, status=status,
                                     workspace=workspace, exit_code=exit_code, duration_s=round(max(duration_s, 0.0), 3))


class Runner:
    """Launches harnesses for `execution.dispatched` events; see the module docstring."""

    def __init__(self, cfg: Config, bus: Bus, tasks: dict[str, Task], stop: asyncio.Event | None = None) -> None:
        self.cfg = cfg
        self.bus = bus
        self.tasks = tasks
        self.stop = stop
        self.secret = bytes.fromhex(cfg.key_secret)
        self.running: set[str] = set()
        root = Path(cfg.run_dir).resolve()
        # workspaces/ and homes/ are traversable (not listable) so the setuid fallback's uid
        # can reach its own directory; the rest stays private to gyre.
        for sub, mode in (("workspaces", 0o711), ("homes", 0o711), ("logs/executions", 0o700), ("runner", 0o700)):
            (root / sub).mkdir(parents=True, exist_ok=True)
            os.chmod(root / sub, mode)
        try:
            self.mode, warning = resolve_mode(cfg.sandbox)
        except RuntimeError as exc:  # no way to confine harnesses here: say why and how to fix it, once
            raise FatalError(str(exc)) from None
        if warning:
            log.warning("runner.sandbox.weak", mode=self.mode, reason=warning)
        else:
            log.info("runner.sandbox", mode=self.mode, uid=cfg.sandbox.uid)
        sb = cfg.sandbox
        if self.mode in ("bwrap", "setuid") and os.geteuid() == 0:
            installation = harnesses.python_installation(cfg.python)
            problem = unreadable([cfg.python, *installation], sb.uid, sb.gid,
                                 binds=installation if self.mode == "bwrap" else None)
            if problem:
                raise FatalError(f"the harness interpreter cannot run in the sandbox: {problem}")
        self.relay: sandbox_relay.ProxyRelay | None = None
        self._relay_lock = asyncio.Lock()
        self._relay_dir = ""
        self._proxy_address: tuple[str, int] | None = None  # the proxy's, as last seen answering

    async def close(self) -> None:
        """Stop the harnesses' relay to the proxy (harnesses still running lose it)."""
        if self.relay is not None:
            await self.relay.close()
            self.relay = None
        if self._relay_dir:
            shutil.rmtree(self._relay_dir, ignore_errors=True)
            self._relay_dir = ""

    async def sandbox_network(self, proxy_url: str) -> tuple[Network | None, str]:
        """(the sandbox's network, the URL the harness is given): the proxy's port on the
        sandbox's own 127.0.0.1, relayed to this runner's Unix socket, then to the proxy; in
        mode `none` (no namespace) nothing and the proxy's own URL."""
        parts = urllib.parse.urlsplit(proxy_url)
        self._proxy_address = (parts.hostname or "127.0.0.1", parts.port or 80)
        if self.mode == "none":
            return None, proxy_url
        async with self._relay_lock:
            if self.relay is None:
                # A short private path: a Unix socket's path is limited to 107 bytes.
                self._relay_dir = tempfile.mkdtemp(prefix="gyre-relay-")
                os.chmod(self._relay_dir, 0o711)  # the setuid fallback's uid connects to the socket inside
                sb = self.cfg.sandbox
                relay = sandbox_relay.ProxyRelay(os.path.join(self._relay_dir, "proxy.sock"), self._target,
                                                 owner=(sb.uid, sb.gid) if os.geteuid() == 0 else None)
                await relay.start()
                self.relay = relay
        script = os.path.abspath(sandbox_relay.__file__)
        network = Network(port=self._proxy_address[1], socket=self.relay.path,
                          relay=(sys.executable, "-I", "-S", script),
                          readonly=(*harnesses.python_installation(sys.executable), script))
        return network, f"http://127.0.0.1:{self._proxy_address[1]}"

    def _target(self) -> tuple[str, int] | None:
        """Where a relayed connection goes: the proxy's address now (`cfg.proxy_url`, else
        <run_dir>/proxy.json's `url`, else the last one seen answering)."""
        url = self.cfg.proxy_url or url_in(Path(self.cfg.run_dir) / "proxy.json")
        if not url:
            return self._proxy_address
        parts = urllib.parse.urlsplit(url)
        return parts.hostname or "127.0.0.1", parts.port or 80

    async def handle(self, event: schemas.Event) -> None:
        if not isinstance(event, schemas.ExecutionDispatched):
            return
        info = event.info
        elog = log.bind(execution=info.execution, task=info.task, harness=info.harness)
        paths = Paths.of(self.cfg.run_dir, info.execution)
        if paths.record.exists():
            recorded = schemas.decode(schemas.ExecutionFinished.NAME, paths.record.read_bytes())
            await self.bus.publish(recorded)
            elog.info("runner.execution.already_finished", status=recorded.status)
            return
        if info.execution in self.running:
            elog.warning("runner.execution.redelivered_while_running")
            return
        if paths.workspace.exists():
            # A previous runner process died mid-execution; its harness died with it.
            await self.bus.publish(schemas.ExecutionStarted(event_id=ids.started(self.cfg.run, info.execution),
                                                            info=info, workspace=str(paths.workspace)))
            status = self.cfg.cut_short
            await self._finish(finished_event(self.cfg.run, info, status, str(paths.workspace)), paths, elog,
                               reason="runner restarted during the execution" if status == "harness_error" else
                               "the run was resumed after its harness died with the machine: scored as timed out")
            return
        self.running.add(info.execution)
        try:
            await self._execute(event, paths, elog)
        finally:
            self.running.discard(info.execution)

    async def _execute(self, event: schemas.ExecutionDispatched, paths: Paths, elog) -> None:
        info = event.info
        task = self.tasks.get(info.task)
        try:
            if task is None:
                raise KeyError(f"task {info.task!r} is not in task set {self.cfg.tasks!r}")
            profile = harnesses.get_profile(info.harness)
            seed_workspace(task, paths.workspace)
        except (KeyError, OSError, ValueError) as exc:
            await self._finish(finished_event(self.cfg.run, info, "no_workspace", ""), paths, elog, reason=str(exc))
            return
        started = time.monotonic()
        try:
            launch = await self._prepare(event, task, profile, paths)
        except (OSError, ValueError, RuntimeError) as exc:
            await self._publish_started(info, paths)
            await self._finish(finished_event(self.cfg.run, info, "harness_error", str(paths.workspace)), paths, elog,
                               reason=f"could not prepare the harness: {exc}")
            return
        await self._publish_started(info, paths)
        status, exit_code = await self._launch(launch, event.timeout_s, paths, elog)
        event_out = finished_event(self.cfg.run, info, status, str(paths.workspace), exit_code,
                                   time.monotonic() - started)
        await self._finish(event_out, paths, elog)

    async def _publish_started(self, info: schemas.ExecutionInfo, paths: Paths) -> None:
        await self.bus.publish(schemas.ExecutionStarted(event_id=ids.started(self.cfg.run, info.execution), info=info,
                                                        workspace=str(paths.workspace)))

    async def _prepare(self, event: schemas.ExecutionDispatched, task: Task, profile, paths: Paths) -> Launch:
        network, proxy_url = await self.sandbox_network(await self._proxy_url())
        req = harnesses.LaunchRequest(
            execution=event.info.execution, task=task, workspace=paths.workspace, home=paths.home,
            proxy_url=proxy_url, api_key=harnesses.execution_key(self.secret, event.info.execution),
            model=self.cfg.model, max_calls=event.max_calls, python=self.cfg.python,
            context_tokens=self.cfg.context_tokens)
        cmd = profile(req)
        paths.home.mkdir(parents=True, exist_ok=True)
        write_files(paths.home, cmd.files)
        sb = self.cfg.sandbox
        own_tree(paths.workspace, sb.uid, sb.gid)
        own_tree(paths.home, sb.uid, sb.gid)
        if self.mode == "setuid":
            blocked = unreachable_ancestor(paths.workspace, sb.uid, sb.gid)
            if blocked:
                raise RuntimeError(f"{blocked} is not traversable by uid {sb.uid} (setuid sandbox); "
                                   "install bubblewrap or make the run directory's ancestors o+x")
        env = base_env(home=paths.home, path_dirs=cmd.path_dirs, extra=cmd.env)
        return confine(cmd.argv, cwd=paths.workspace, env=env, cfg=sb, writable=[paths.home], readonly=cmd.readonly,
                       network=network)

    async def _proxy_url(self) -> str:
        """The proxy's base URL (`cfg.proxy_url`, or `url` in <run_dir>/proxy.json, read
        again while waiting: a restarted proxy may have moved) once a proxy of this run
        answers `/health` there. Raises RuntimeError after `proxy_wait_s` without one: the
        execution is then `harness_error`, which the evaluator excludes, instead of a
        harness that fails on a refused connection and is scored as a 0 reward; Retry
        when the runner is stopping."""
        path = Path(self.cfg.run_dir) / "proxy.json"
        deadline = time.monotonic() + self.cfg.proxy_wait_s
        async with aiohttp.ClientSession() as session:
            while True:
                url = self.cfg.proxy_url or url_in(path)
                if url and await serving_proxy(session, url, self.cfg.run):
                    return url
                if self.stop is not None and self.stop.is_set():  # the proxy has gone first
                    raise Retry(1.0, "runner stopping")
                if time.monotonic() > deadline:
                    where = f"at {url}" if url else f"in {path}"
                    raise RuntimeError(f"no proxy of run {self.cfg.run} answered {where} within "
                                       f"{self.cfg.proxy_wait_s}s: is the proxy up?")
                await asyncio.sleep(0.2)

    async def _launch(self, launch: Launch, timeout_s: float, paths: Paths, elog) -> tuple[str, int | None]:
        """Run the confined harness; returns (status, exit code).

        Raises Retry when the runner is stopping (the harness is killed; the message comes
        back after a restart and is then reported `harness_error`)."""
        paths.log.parent.mkdir(parents=True, exist_ok=True)
        with open(paths.log, "ab") as out:
            try:
                proc = await asyncio.create_subprocess_exec(*launch.argv, stdout=out, stderr=asyncio.subprocess.STDOUT,
                                                            **launch.popen_kwargs())
            except OSError as exc:
                elog.error("runner.harness.spawn_failed", error=str(exc))
                return "harness_error", None
            elog.info("runner.harness.started", pid=proc.pid, mode=launch.mode, timeout_s=timeout_s)
            outcome = await wait_or_kill(proc, timeout_s, self.stop)
            if outcome == "stopped":
                elog.warning("runner.harness.killed_on_shutdown")
                raise Retry(1.0, "runner stopping")
            if outcome == "timeout":
                elog.info("runner.harness.timeout", timeout_s=timeout_s)
            status = harness_status(outcome, launch.mode, proc.returncode)
            if status != outcome:
                elog.error("runner.sandbox.failed", exit_code=proc.returncode, log=str(paths.log))
            return status, proc.returncode

    async def _finish(self, event: schemas.ExecutionFinished, paths: Paths, elog, reason: str = "") -> None:
        paths.record.parent.mkdir(parents=True, exist_ok=True)
        tmp = paths.record.with_suffix(".tmp")
        tmp.write_bytes(schemas.encode(event))
        tmp.replace(paths.record)
        await self.bus.publish(event)
        log_fn = elog.warning if reason else elog.info
        log_fn("runner.execution.finished", status=event.status, exit_code=event.exit_code,
               duration_s=event.duration_s, reason=reason or None)


def harness_status(outcome: str, mode: str, exit_code: int | None) -> str:
    """The `execution.finished` status of a harness that ended with `outcome` (`ok` or
    `timeout`, from `wait_or_kill`): `harness_error` when its confinement could not be set
    up (the relay's exit code, `sandbox_relay.FAILED`, in a mode that confines: the harness
    never started), else the outcome."""
    if outcome == "ok" and mode != "none" and exit_code == sandbox_relay.FAILED:
        return "harness_error"
    return outcome


async def wait_or_kill(proc: asyncio.subprocess.Process, timeout_s: float, stop: asyncio.Event | None) -> str:
    """Wait for `proc` at most `timeout_s` seconds or until `stop` is set; kill its process
    group otherwise. Returns "ok" (exited by itself), "timeout" or "stopped"."""
    exited = asyncio.ensure_future(proc.wait())
    stopping = asyncio.ensure_future(stop.wait()) if stop is not None else None
    try:
        waiters = {exited} | ({stopping} if stopping else set())
        await asyncio.wait(waiters, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        kill_group(proc.pid)
        await asyncio.shield(exited)
        raise
    finally:
        if stopping is not None:
            stopping.cancel()
    if exited.done():
        return "ok"
    kill_group(proc.pid)
    await exited
    return "stopped" if stop is not None and stop.is_set() else "timeout"


def kill_group(pid: int) -> None:
    """SIGKILL the process group led by `pid` (the harness or its bwrap); bwrap's
    --die-with-parent and the pid namespace take everything inside down with it."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


async def run(cfg: Config, stop: asyncio.Event) -> None:
    tasks = task_index(load_tasks(cfg.tasks))
    async with connected(cfg, stop, "runner") as bus:
        runner = Runner(cfg, bus, tasks, stop)
        try:
            await bus.consume("runner-v1", runner.handle, stop=stop, concurrency=cfg.concurrency)
        finally:
            await runner.close()


def main(argv: list[str] | None = None) -> int:
    return daemon_main("runner", "Runner: confined harness processes in per-execution workspaces.",
                       config_from_context, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
