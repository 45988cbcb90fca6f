"""`gyre tap [PATTERN]`: print a run's live events in a form a person can read.

Finds the current run through `runs/latest/nats.json` (written by `gyre run`, token
readable only by its owner), or `runs/ID/nats.json` with `--run ID`, or `--run-dir DIR`,
or `GYRE_NATS_URL` + `--run ID`.
PATTERN filters event names with NATS wildcards (`call.*`, `execution.>`); default all.
A PATTERN that is a whole subject (`gyre.v1.RUN.call.*`) names its run(s) itself.
Token arrays are shown by length, never dumped.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path

import orjson

from bus import Bus, BusConfig, ConnectError
from bus.subjects import PREFIX, name_of, run_of
from handlers.daemon import ended_run_message, install_signals, run_owner_alive, stop_when_run_ends
from handlers.run import live_run

_ARRAYS = ("prompt_ids", "completion_ids", "logprobs")
_FIRST = ("execution", "task", "step", "call", "status", "finish_reason", "role", "reward", "cell")
CONNECT_TIMEOUT_S = 5.0  # a person is waiting: say the bus is unreachable soon


def summarise(subject: str, data: bytes, *, width: int = 160) -> str:
    """One readable line for an event: time, run, name, key fields; arrays by length."""
    name = name_of(subject)
    try:
        obj = orjson.loads(data)
    except orjson.JSONDecodeError:
        return f"{run_of(subject)} {name} <{len(data)} undecodable bytes>"
    if not isinstance(obj, dict):
        return f"{run_of(subject)} {name} {str(obj)[:width]}"
    when = str(obj.pop("emitted_at", ""))[11:23]
    obj.pop("schema_version", None)
    obj.pop("event_id", None)  # noise in a live view
    tokens = obj.get("tokens")
    if isinstance(tokens, dict):  # lengths, not ids
        obj["tokens"] = " ".join(f"{k}<{len(v)}>" for k, v in tokens.items() if k in _ARRAYS and hasattr(v, "__len__"))
    info = obj.pop("info", None)
    if isinstance(info, dict):
        obj = {"execution": info.get("execution"), "task": info.get("task"), "step": info.get("step"), **obj}
    first = {k: obj.pop(k) for k in _FIRST if k in obj}  # what happened, before the details the width may cut
    fields = " ".join(f"{k}={_short(v)}" for k, v in {**first, **obj}.items() if v not in (None, "", {}, []))
    line = f"{when} {name:<20} {fields}"
    return line if len(line) <= width else line[: width - 1] + "…"


def _short(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, (dict, list)):  # whole: a value cut inside reads as another value
        return orjson.dumps(v).decode()
    return str(v)


def _locate(args) -> tuple[str, str | None, str | None, dict | None, Path | None]:
    """(url, token, run, the owning `gyre run`'s identity from nats.json or None, its run
    directory resolved or None) of the run to tap."""
    if args.run_dir or not os.environ.get("GYRE_NATS_URL"):
        info, run_dir = live_run(args.run_dir, args.run)
        return info["url"], info.get("token"), None if args.all_runs else (args.run or info["run"]), info, run_dir
    if not (args.run or args.all_runs or args.pattern.startswith(PREFIX + ".")):  # no "current" run there
        raise RuntimeError("GYRE_NATS_URL is set: name the run to tap with --run ID (or --all-runs)")
    return (os.environ["GYRE_NATS_URL"], os.environ.get("GYRE_NATS_TOKEN"),
            None if args.all_runs else args.run, None, None)


async def _tap(url: str, token: str | None, run: str | None, pattern: str, width: int, owner: dict | None) -> None:
    stop = asyncio.Event()
    install_signals(stop)
    run_part = run if run else "*"
    subject = pattern if pattern.startswith(PREFIX) else f"{PREFIX}.{run_part}.{pattern}"
    bus = await Bus.connect(url, token=token, run=run or "tap", name="gyre-tap", stop=stop,
                            config=BusConfig(connect_timeout_s=CONNECT_TIMEOUT_S))
    print(f"gyre tap: {subject} on {url} (Ctrl-C to stop)", file=sys.stderr, flush=True)

    async def show(subj: str, data: bytes) -> None:
        try:
            print(summarise(subj, data, width=width), flush=True)
        except BrokenPipeError:  # the reader went away (`gyre tap | head`): stop, quietly
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())  # no error at exit's flush
            os.close(devnull)
            stop.set()

    watcher = None
    try:
        await bus.tap(subject, show)
        if owner is not None:
            watcher = asyncio.create_task(stop_when_run_ends(
                owner, stop, lambda: print("gyre tap: the run has ended", file=sys.stderr, flush=True)))
        await stop.wait()
    finally:
        if watcher is not None:
            watcher.cancel()
        await bus.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="gyre tap", description="Print live events of the current run.")
    p.add_argument("pattern", nargs="?", default=">", help="event names, NATS wildcards (default: all)")
    p.add_argument("--run-dir", help="run directory (default: runs/latest)")
    p.add_argument("--run", help="run id: runs/ID (default: runs/latest), or with GYRE_NATS_URL set that "
                                 "server's run ID (then required, or --all-runs)")
    p.add_argument("--all-runs", action="store_true", help="events of every run on that server")
    p.add_argument("--width", type=int, default=200, help="cut lines at this many characters (default 200)")
    a = p.parse_args(argv)
    import logging

    from handlers.daemon import configure_logging
    configure_logging("tap", level=logging.ERROR)  # its own lines say what matters; not the bus's retries
    try:
        url, token, run, owner, run_dir = _locate(a)
    except Exception as exc:  # noqa: BLE001 - tell the user, exit 2
        print(f"gyre tap: {exc}", file=sys.stderr)
        return 2
    try:
        asyncio.run(_tap(url, token, run, a.pattern, a.width, owner))
    except ConnectError as exc:
        if exc.stopped:  # Ctrl-C while connecting
            return 0
        if owner is not None and not run_owner_alive(owner):  # the run's own server went with it
            print(f"gyre tap: {ended_run_message(run_dir, owner)}", file=sys.stderr)
            return 1
        hint = " (the run may be ending: its nats-server stops with it)" if owner is not None else ""
        print(f"gyre tap: {exc}{hint}", file=sys.stderr)
        return 1
    except ValueError as exc:  # a pattern NATS refuses
        print(f"gyre tap: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
