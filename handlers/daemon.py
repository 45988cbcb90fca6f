"""What every daemon shares: run context, logging, signals, and the main() shape.

A daemon module reads as its frozen `Config`, its `handle_*` functions and its wiring:

    async def run(cfg, stop):
        async with connected(cfg, stop, "builder") as bus:      # connect, declare streams; drain on exit
            builder = Builder(cfg, bus)
            await run_loops(bus.consume("builder-v1", builder.handle_execution, stop=stop), ...)

    def main(argv=None):
        return daemon_main("builder", "…", config_from_context, run, argv)

A daemon is started either by `gyre run` (which passes `--run-dir`) or on its own for a
deployment (`gyre proxy --run-dir DIR`, or `--recipe R --run ID` with `GYRE_NATS_URL`
and credentials in the environment). Secrets travel in the environment, never argv:
`GYRE_NATS_TOKEN` (NATS token), `GYRE_KEY_SECRET` (hex; execution keys) and
`GYRE_ENGINE_TOKEN` (the bearer token engines demand); a daemon joining a run with
`--run-dir` reads the last two from the run directory when the environment lacks them.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, Protocol, TextIO

import orjson
import structlog

from bus import Bus, ConnectError
from gyre.config import Recipe, load_recipe, recipe_from_dict

log = structlog.get_logger()


class FatalError(RuntimeError):
    """A daemon cannot continue; main() exits non-zero so a supervisor restarts it."""


class RunEnded(FatalError):
    """`--run-dir` names a run whose `gyre run` has ended (`run_owner_alive`)."""


@dataclasses.dataclass(frozen=True, slots=True)
class RunContext:
    """Where a daemon belongs: its run, run directory, recipe and bus credentials.

    nats_token / key_secret come from the environment only.
    """

    run: str
    run_dir: Path
    recipe: Recipe
    nats_url: str
    nats_token: str | None
    key_secret: bytes
    owner: dict | None = None
    """The `gyre run` that owns the run (nats.json's identity, `run_owner_alive`) when the
    daemon joined it with `--run-dir` on its private server; None otherwise."""
    engine_token: str = dataclasses.field(default="", repr=False)
    """The bearer token the run's engines demand and the proxy sends ('' = none given):
    `GYRE_ENGINE_TOKEN`, else `<run_dir>/engine_token`."""

    @property
    def model_dir(self) -> Path:
        return Path(self.recipe.model.dir) if self.recipe.model.dir else self.run_dir / "model"

    def checkpoint(self) -> Path:
        """`model_dir` for a daemon that loads the policy (its tokenizer or weights).
        Raises FatalError, naming the fix, when no HF checkpoint is there (no config.json):
        with an empty `model.dir` the policy is the embedded default model, which only
        `gyre run` writes into the run directory."""
        d = self.model_dir
        if (d / "config.json").is_file():
            return d
        m = self.recipe.model
        if m.dir:
            raise FatalError(f"no checkpoint in {d} (the recipe's model.dir): it has no config.json")
        raise FatalError(f"no checkpoint in {d}: the recipe's model.dir is empty, so the policy is the embedded "
                         "default model, which `gyre run` writes into the run directory; for a daemon started on "
                         f"its own, write it first with `gyre init-model {d} --layers {m.layers} --hidden {m.hidden} "
                         f"--heads {m.heads} --kv-heads {m.kv_heads} --seed {m.seed}` (the recipe's [model]), or set "
                         "model.dir to a checkpoint")


def read_nats_info(run_dir: Path) -> dict:
    """The run's `nats.json`: {"url", "run", "token"?}. Raises FatalError if absent."""
    path = run_dir / "nats.json"
    try:
        return orjson.loads(path.read_bytes())
    except FileNotFoundError:
        raise FatalError(f"{path} not found: is the run started (gyre run) and is --run-dir right?") from None


def process_identity(pid: int | None = None) -> dict:
    """Where a process (default: this one) can be found again: {"pid", "host", "pid_ns",
    "started"}; "pid_ns" and "started" (clock ticks after boot, /proc/PID/stat field 22)
    only where /proc shows them. `gyre run` writes its own into nats.json;
    `run_owner_alive` reads it back."""
    pid = pid or os.getpid()
    out: dict = {"pid": pid, "host": socket.gethostname()}
    if (ns := _pid_ns(pid)) is not None:
        out["pid_ns"] = ns
    try:
        out["started"] = _proc_stat(pid)[1]
    except (OSError, IndexError, ValueError):
        pass
    return out


def _pid_ns(pid: int | str) -> str | None:
    """The pid namespace of a process ("pid:[4026531836]"), None where /proc does not show it."""
    try:
        return os.readlink(f"/proc/{pid}/ns/pid")
    except OSError:
        return None


def _proc_stat(pid: int) -> tuple[str, int]:
    """(state, start time in clock ticks) of a process from /proc/PID/stat. Raises OSError."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return fields[0], int(fields[19])


def run_owner_alive(info: dict) -> bool:
    """Whether the `gyre run` that wrote `nats.json` (`process_identity`) still runs. True
    whenever this process cannot tell: no pid written, another host or pid namespace (a
    container sharing the run directory), a process of another user."""
    pid = info.get("pid")
    if not pid:
        return True
    if "host" in info and info["host"] != socket.gethostname():
        return True
    if "pid_ns" in info and info["pid_ns"] != _pid_ns("self"):
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        state, started = _proc_stat(pid)
    except FileNotFoundError:  # gone since the kill, or no /proc here
        return not Path("/proc/self").exists()
    except (OSError, IndexError, ValueError):
        return True
    if state in ("Z", "X"):  # exited, not yet reaped
        return False
    return "started" not in info or info["started"] == started  # else the pid was reused


def ended_run_message(run_dir: Path, info: dict) -> str:
    summary = run_dir / "summary.json"
    where = f"its summary is in {summary}" if summary.exists() else f"it wrote no summary; see {run_dir / 'logs'}"
    return f"run {info['run']} has ended (its `gyre run` process {info.get('pid')} is gone); {where}"


def context_from_args(args: argparse.Namespace) -> RunContext:
    """Build the RunContext from `--run-dir` or `--recipe/--run` plus the environment."""
    env_url = os.environ.get("GYRE_NATS_URL")
    token = os.environ.get("GYRE_NATS_TOKEN")
    secret_hex = os.environ.get("GYRE_KEY_SECRET", "")
    if args.run_dir:
        run_dir = Path(args.run_dir).resolve()
        info = read_nats_info(run_dir)
        if not env_url and not run_owner_alive(info):  # say so now, not after a 30 s connect timeout
            raise RunEnded(ended_run_message(run_dir, info))
        recipe = recipe_from_dict(orjson.loads((run_dir / "config.json").read_bytes()))
        run = info["run"]
        url = env_url or info["url"]
        token = token or info.get("token")
    else:
        if not (args.recipe and args.run and env_url):
            raise FatalError("give --run-dir, or --recipe and --run with GYRE_NATS_URL set")
        recipe = load_recipe(args.recipe)
        run = args.run
        run_dir = Path(os.environ.get("GYRE_RUNS_DIR", "runs")).resolve() / run
        url = env_url
    if not secret_hex and (run_dir / "key_secret").exists():
        secret_hex = (run_dir / "key_secret").read_text().strip()
    engine_token = os.environ.get("GYRE_ENGINE_TOKEN", "")
    if not engine_token and (run_dir / "engine_token").exists():
        engine_token = (run_dir / "engine_token").read_text().strip()
    return RunContext(run=run, run_dir=run_dir, recipe=recipe, nats_url=url, nats_token=token,
                      key_secret=bytes.fromhex(secret_hex) if secret_hex else b"",
                      owner=info if args.run_dir and not env_url else None, engine_token=engine_token)


def base_parser(prog: str, description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=description)
    p.add_argument("--run-dir", help="run directory written by `gyre run` (config.json, nats.json)")
    p.add_argument("--recipe", help="recipe name or TOML path (with --run and GYRE_NATS_URL)")
    p.add_argument("--run", help="run id (with --recipe)")
    p.add_argument("--log-json", action="store_true", help="JSON log lines even on a terminal")
    p.add_argument("--log-level", choices=("debug", "info", "warning", "error"), default="info",
                   help="least severe log lines written (debug adds per-call lines, e.g. the proxy's "
                        "`proxy.call.recorded`)")
    p.add_argument("--metrics-host", default=os.environ.get("GYRE_METRICS_HOST", "127.0.0.1"),
                   help="address of this daemon's Prometheus /metrics (default $GYRE_METRICS_HOST or 127.0.0.1)")
    p.add_argument("--metrics-port", type=int, default=0,
                   help="port of its /metrics (default 0: a free one); the URL is recorded in "
                        "<run dir>/metrics/<daemon>.json")
    return p


def _json_line(event: dict, default: Callable[[object], object] | None = None) -> str:
    """One JSON log line: orjson, or the stdlib encoder for what orjson refuses (ints beyond
    64 bits, lone surrogates, very deep nesting), so a log call never raises."""
    try:
        return orjson.dumps(event, default=default,
                            option=orjson.OPT_NON_STR_KEYS | orjson.OPT_SERIALIZE_NUMPY).decode()
    except orjson.JSONEncodeError:
        return json.dumps(event, default=default)


def configure_logging(name: str, *, json_lines: bool | None = None, level: int = logging.INFO,
                      file: TextIO | None = None) -> None:
    """structlog to `file` (default stderr): JSON lines in production (not a TTY),
    readable lines on a terminal."""
    out = file if file is not None else sys.stderr
    if json_lines is None:
        json_lines = not out.isatty()
    # orjson, not the stdlib encoder: the proxy writes a line per call
    renderer = (structlog.processors.JSONRenderer(serializer=_json_line) if json_lines
                else structlog.dev.ConsoleRenderer(colors=False))
    # the fields every line carries, gyre's own and the stdlib's (below)
    shared = [structlog.contextvars.merge_contextvars, structlog.processors.add_log_level,
              structlog.processors.TimeStamper(fmt="iso", utc=True)]
    structlog.configure(
        processors=[*shared, structlog.processors.format_exc_info, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.PrintLoggerFactory(file=out),
        cache_logger_on_first_use=True,
    )
    structlog.contextvars.bind_contextvars(daemon=name)
    # What libraries log through the stdlib (aiohttp's "Error handling request" with its
    # traceback, nats-py's reconnects) is written the same way, so a daemon's log stays one
    # line per event (JSON lines when not a TTY); warnings and worse only.
    handler = logging.StreamHandler(out)
    handler.setFormatter(structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[*shared, structlog.stdlib.add_logger_name],
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                    structlog.processors.format_exc_info, renderer]))
    handler.set_name("gyre")
    release_stdlib_logging()
    logging.getLogger().addHandler(handler)
    logging.getLogger().setLevel(max(level, logging.WARNING))


def release_stdlib_logging() -> None:
    """Take away the stdlib handler `configure_logging` installed (before its file closes:
    what libraries log later goes to the interpreter's fallback, stderr)."""
    root = logging.getLogger()
    for handler in [h for h in root.handlers if h.get_name() == "gyre"]:
        root.removeHandler(handler)


def run_async(main: Awaitable[object]) -> object:
    """Run a daemon's top coroutine on uvloop when installed (faster sockets and
    timers for the HTTP hot path), else on asyncio's default loop. GYRE_NO_UVLOOP=1
    forces the default loop."""
    if not os.environ.get("GYRE_NO_UVLOOP"):
        try:
            import uvloop
        except ImportError:
            pass
        else:
            return uvloop.run(main)
    return asyncio.run(main)


def install_signals(stop: asyncio.Event) -> None:
    """SIGTERM/SIGINT set `stop`; a second signal exits at once with 128 + its number (a
    stop set otherwise, e.g. because the run ended, still lets the first one wait)."""
    loop = asyncio.get_running_loop()
    signalled = []

    def _on_signal(signum: int) -> None:
        if signalled:
            log.warning("daemon.signal.forced", signal=signum)
            os._exit(128 + signum)
        signalled.append(signum)
        log.info("daemon.signal", signal=signum)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, _on_signal, sig)


async def stop_when_run_ends(owner: dict, stop: asyncio.Event, on_end: Callable[[], None],
                             every_s: float = 1.0) -> None:
    """Call `on_end` and set `stop` once the `gyre run` identified by `owner` (nats.json,
    `run_owner_alive`) has ended, checking every `every_s` seconds: a daemon or tap joined
    with `--run-dir` to a run on its private NATS server then stops instead of following a
    run that is over (retrying its server every second once that stopped too)."""
    while not stop.is_set():
        try:
            await asyncio.wait_for(stop.wait(), every_s)
        except asyncio.TimeoutError:
            pass
        if not stop.is_set() and not run_owner_alive(owner):
            on_end()
            stop.set()


class BusSettings(Protocol):
    """What a daemon's Config carries to reach its run's bus."""

    run: str
    """Run id (`bus.subjects.check_run`): every subject and stream of the run carries it."""
    nats_url: str
    """The run's NATS server, e.g. `nats://127.0.0.1:4222`."""
    nats_token: str | None
    """NATS token, None = none; from the environment or the run's nats.json, never argv."""


@contextlib.asynccontextmanager
async def connected(cfg: BusSettings, stop: asyncio.Event, name: str) -> AsyncIterator[Bus]:
    """The run's bus for the daemon `name`: connects (retrying until it succeeds or `stop`
    is set: ConnectError(stopped=True) then), declares the run's streams (a failure once
    `stop` is set is ConnectError(stopped=True) too), and on the way out, whatever raised,
    drains and closes it."""
    bus = await Bus.connect(cfg.nats_url, token=cfg.nats_token, run=cfg.run, name=name, stop=stop)
    try:
        try:
            await bus.ensure_streams()
        except Exception as exc:
            if stop.is_set():  # the server went away with the run while we declared: a stop, not a crash
                raise ConnectError(f"stopped while declaring the run's streams: {exc!r}", stopped=True) from exc
            raise
        yield bus
    finally:
        await bus.close()


async def run_loops(*loops: Awaitable[Any]) -> None:
    """Run a daemon's loops (consumers, replays, servers) together until every one has
    returned; the first to raise cancels the others and its exception propagates
    (asyncio.TaskGroup semantics)."""
    async with asyncio.TaskGroup() as tg:
        for loop in loops:
            tg.create_task(loop)


def daemon_main(name: str, description: str,
                make_config: Callable[[RunContext, argparse.Namespace], object],
                run: Callable[[object, asyncio.Event], Awaitable[None]],
                argv: list[str] | None = None, extra_args: Callable[[argparse.ArgumentParser], None] | None = None,
                ) -> int:
    """The one main() of every daemon: parse args, build its Config, serve its Prometheus
    `/metrics` (`handlers.metrics.serve`), run until stopped, then remove its metrics
    service discovery file (`handlers.metrics.forget`).

    make_config(ctx, args) builds the daemon's frozen Config from the run context;
    run(cfg, stop) is the daemon's `async def run`.

    Returns the exit status: 0 after a clean stop, 1 on a fatal error (so a supervisor
    restarts it), 2 on bad arguments.
    """
    parser = base_parser(f"gyre {name}", description)
    if extra_args:
        extra_args(parser)
    args = parser.parse_args(argv)
    configure_logging(name, json_lines=True if args.log_json else None,
                      level=logging.getLevelName(args.log_level.upper()))
    try:
        ctx = context_from_args(args)
        cfg = make_config(ctx, args)
    except RunEnded as exc:
        log.error("daemon.run.ended", error=str(exc))
        return 2
    except (FatalError, ValueError, OSError) as exc:
        log.error("daemon.config.invalid", error=str(exc))
        return 2
    structlog.contextvars.bind_contextvars(run=ctx.run)
    from handlers import metrics

    try:  # every daemon's /metrics (handlers.metrics), one per process; a cell's carries its id
        url = metrics.serve(getattr(args, "cell", None) or name, ctx.run_dir, args.metrics_host, args.metrics_port,
                            ctx.run)
    except OSError as exc:
        log.error("daemon.metrics.failed", error=f"cannot serve /metrics on {args.metrics_host}:"
                                                 f"{args.metrics_port}: {exc}")
        return 2
    log.info("daemon.metrics", url=url)

    async def _main() -> None:
        stop = asyncio.Event()
        install_signals(stop)
        watcher = None
        if ctx.owner is not None:
            watcher = asyncio.create_task(stop_when_run_ends(ctx.owner, stop, lambda: log.warning(
                "daemon.run.ended", error=ended_run_message(ctx.run_dir, ctx.owner))))
        try:
            await run(cfg, stop)
        finally:
            if watcher is not None:
                watcher.cancel()

    try:
        run_async(_main())
    except ConnectError as exc:  # no bus: say so in one line (the traceback adds nothing)
        if exc.stopped:
            log.info("daemon.stopped", before="the bus connected")
            return 0
        log.error("daemon.fatal", error=str(exc))
        return 1
    except FatalError as exc:
        log.error("daemon.fatal", error=str(exc))
        return 1
    except Exception as exc:  # noqa: BLE001 - last line of defence: log, exit non-zero
        log.error("daemon.crashed", error=repr(exc), traceback=traceback.format_exc())
        return 1
    finally:  # nothing serves the URL once this process ends: scrapers must stop asking it
        metrics.forget(ctx.run_dir, getattr(args, "cell", None) or name, os.getpid())
    log.info("daemon.stopped")
    return 0


def stop_processes(procs, timeout_s: float = 30.0) -> None:
    """SIGTERM every process of `procs` (subprocess.Popen, each its own session) still running;
    SIGKILL the process group of any still alive `timeout_s` after."""
    procs = list(procs)
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
