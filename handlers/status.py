"""`gyre status`: a live terminal view of one run, fed from its bus.

    gyre status [--run-dir DIR | --run ID] [--once] [--refresh S]

Finds the run as `gyre tap` does: with no flags the current run (`runs/latest/nats.json`)
on its private NATS server; `--run ID` is `runs/ID`, or, with `GYRE_NATS_URL` set, run ID
on that server (a deployment's NATS). It replays the run's stored events from the start
and follows live ones (`Bus.replay`), folding them into a `RunView`: the step and its
phase, the water level against C_R − C_e, each cell's role, policy version and what it is
doing, executions queued/running/finished/scored per step, calls/s and tokens/s, reward
mean per step, the last switches with their durations, micro-steps claimed and committed
per replica, and each daemon's metrics URL (`<run dir>/metrics/`). The view is drawn with
rich; `--once` prints one snapshot, once the history stored at start is read, and exits.
Exit status: 0, 1 when the bus cannot be reached, 2 for a run that cannot be found (on a
deployment's NATS, `--once` for a run of which no event is stored: the message names the
runs stored there; the live view says on screen that none of its events was seen yet).
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import datetime as _dt
import os
import sys
import time
from pathlib import Path

import schemas
from bus import Bus, BusConfig, ConnectError
from handlers.daemon import install_signals, run_owner_alive, stop_when_run_ends
from handlers.run import live_run, runs_root

RATE_WINDOW_S = 30.0
"""calls/s and tokens/s are over the last this many seconds of the run's events."""
NAMES = tuple(e.NAME for e in (
    schemas.ExecutionStarted, schemas.ExecutionFinished, schemas.ExecutionScored, schemas.CallCompleted,
    schemas.StepSealed, schemas.StepCompleted, schemas.StepFailed, schemas.CellSwitch, schemas.CellSwitched,
    schemas.RouteUpdated, schemas.MicrostepGranted, schemas.MicrostepCommitted))


def _when(event: schemas.Event) -> float:
    try:
        return _dt.datetime.fromisoformat(event.emitted_at.replace("Z", "+00:00")).timestamp()
    except (ValueError, AttributeError):
        return time.time()


def _step_of(execution: str) -> int | None:
    """Executions are named `s<step>-…` (schemas.ids)."""
    head = execution.split("-", 1)[0]
    return int(head[1:]) if head[:1] == "s" and head[1:].isdigit() else None


class RunView:
    """What `gyre status` shows, folded from the run's events (`on_event`). c_e: the
    executions one rollout cell serves at once (the recipe's harness.concurrency)."""

    def __init__(self, run: str, c_e: int = 1, cells: tuple[str, ...] = ()) -> None:
        self.run = run
        self.c_e = c_e
        self.cells: dict[str, dict] = {c: {"role": "?", "version": None, "doing": "not started"} for c in cells}
        self.dispatched: dict[int, set[str]] = collections.defaultdict(set)
        self.started: set[str] = set()
        self.finished: dict[str, str] = {}
        self.scored: dict[str, float | None] = {}
        self.sealed: set[int] = set()
        self.completed: dict[int, schemas.StepCompleted] = {}
        self.failed: schemas.StepFailed | None = None
        self.switches: collections.deque[tuple[str, str, str, float]] = collections.deque(maxlen=6)
        self.claimed: collections.Counter[str] = collections.Counter()
        self.committed: collections.Counter[str] = collections.Counter()
        self.calls: collections.deque[tuple[float, int]] = collections.deque()
        self.calls_total = 0
        self.cell_calls: collections.Counter[str] = collections.Counter()
        self.last_t = 0.0
        self.unseen = ""  # said on screen until the run's first event arrives

    async def on_event(self, event: schemas.Event) -> None:
        self.fold(event)

    def fold(self, event: schemas.Event) -> None:
        t = _when(event)
        self.last_t = max(self.last_t, t)
        if isinstance(event, schemas.RouteUpdated):
            for r in event.routes:
                step = _step_of(r.execution)
                if r.reason == "dispatch" and step is not None:
                    self.dispatched[step].add(r.execution)
        elif isinstance(event, schemas.ExecutionStarted):
            self.started.add(event.info.execution)
            self.dispatched[event.info.step].add(event.info.execution)
        elif isinstance(event, schemas.ExecutionFinished):
            self.finished[event.info.execution] = event.status
            self.dispatched[event.info.step].add(event.info.execution)
        elif isinstance(event, schemas.ExecutionScored):
            self.scored[event.info.execution] = event.reward if event.outcome != "excluded" else None
        elif isinstance(event, schemas.CallCompleted):
            from handlers.metrics import completion_tokens
            self.calls.append((t, completion_tokens(event)))
            self.calls_total += 1
            self.cell_calls[event.cell] += 1
        elif isinstance(event, schemas.StepSealed):
            self.sealed.add(event.step)
        elif isinstance(event, schemas.StepCompleted):
            self.completed[event.step] = event
        elif isinstance(event, schemas.StepFailed):
            self.failed = event
        elif isinstance(event, schemas.CellSwitch):
            cell = self.cells.setdefault(event.cell, {"role": event.from_role, "version": None, "doing": ""})
            cell["doing"] = f"switching to {event.to_role}"
        elif isinstance(event, schemas.CellSwitched):
            cell = self.cells.setdefault(event.cell, {"role": "?", "version": None, "doing": ""})
            cell.update(role=event.to_role, version=event.policy_version, doing="")
            if event.seq >= 0 or event.from_role != "idle":
                self.switches.append((event.cell, event.from_role, event.to_role,
                                      float(event.durations.get("total_s", 0.0))))
        elif isinstance(event, schemas.MicrostepGranted):
            self.claimed[event.replica] += 1
        elif isinstance(event, schemas.MicrostepCommitted):
            self.committed[event.replica] += 1

    # ---- what is shown (plain values; `render` draws them) ------------------------------

    @property
    def step(self) -> int | None:
        steps = [*self.dispatched, *self.completed, *self.sealed]
        return max(steps) if steps else None

    def phase(self, step: int) -> str:
        if self.failed is not None and self.failed.step == step:
            return "failed"
        if step in self.completed:
            return "completed"
        if step in self.sealed:
            return "training"
        ex = self.dispatched.get(step, set())
        if ex and all(e in self.finished for e in ex):
            return "scoring"
        return "rollout"

    @property
    def water_level(self) -> int:
        return sum(len(v) for v in self.dispatched.values()) - len(self.finished)

    @property
    def spare(self) -> int:
        """C_R − C_e: the capacity of the cells in rollout now, less one cell's."""
        return self.c_e * sum(1 for c in self.cells.values() if c["role"] == "rollout") - self.c_e

    def rates(self) -> tuple[float, float]:
        """(calls/s, tokens/s) over the last RATE_WINDOW_S seconds up to the latest event."""
        recent = [(t, n) for t, n in self.calls if t >= self.last_t - RATE_WINDOW_S]
        if not recent:
            return 0.0, 0.0
        span = max(self.last_t - min(t for t, _ in recent), 1.0)
        return len(recent) / span, sum(n for _, n in recent) / span

    def executions(self) -> list[dict]:
        """Per step (burst): dispatched, queued (not started), running, finished, scored."""
        out = []
        for step in sorted(self.dispatched):
            ex = self.dispatched[step]
            finished = sum(1 for e in ex if e in self.finished)
            running = sum(1 for e in ex if e in self.started and e not in self.finished)
            out.append({"step": step, "dispatched": len(ex), "queued": len(ex) - finished - running,
                        "running": running, "finished": finished, "scored": sum(1 for e in ex if e in self.scored)})
        return out

    def rewards(self) -> dict[int, float]:
        """Mean reward per step over its scored (not excluded) executions."""
        per: dict[int, list[float]] = collections.defaultdict(list)
        for e, r in self.scored.items():
            if r is not None and (s := _step_of(e)) is not None:
                per[s].append(r)
        return {s: sum(v) / len(v) for s, v in sorted(per.items())}

    def doing(self, cell: str) -> str:
        c = self.cells[cell]
        if c["doing"]:
            return c["doing"]
        if c["role"] == "rollout":
            return f"serving ({self.cell_calls[cell]} calls so far)"
        if c["role"] == "training":
            return f"training ({self.committed[cell]} micro-steps committed)"
        return c["role"]


def render(view: RunView, metrics_urls: dict[str, str] | None = None):
    """The view as one rich renderable."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    step = view.step
    head = Text(f"gyre status — run {view.run}   ", style="bold")
    head.append("step -   " if step is None else f"step {step} ({view.phase(step)})   ")
    head.append(f"water level {view.water_level} vs C_R − C_e {view.spare}   ")
    calls_s, tokens_s = view.rates()
    head.append(f"calls {view.calls_total}, {calls_s:.2f} calls/s, {tokens_s:.1f} tokens/s")
    if view.unseen and not view.last_t:
        head.append(f"\n{view.unseen}", style="yellow")
    if view.failed is not None:
        head.append(f"\nstep {view.failed.step} FAILED: {view.failed.reason}", style="red")
    cells = Table(title="cells", title_justify="left")
    for col in ("cell", "role", "policy version", "doing", "micro-steps claimed", "committed"):
        cells.add_column(col)
    for name in sorted(view.cells, key=lambda c: (len(c), c)):
        c = view.cells[name]
        cells.add_row(name, c["role"], "-" if c["version"] is None else str(c["version"]), view.doing(name),
                      str(view.claimed[name]), str(view.committed[name]))
    ex = Table(title="executions per step", title_justify="left")
    for col in ("step", "dispatched", "queued", "running", "finished", "scored", "reward mean"):
        ex.add_column(col, justify="right")
    rewards = view.rewards()
    for row in view.executions():
        r = rewards.get(row["step"])
        ex.add_row(*(str(row[k]) for k in ("step", "dispatched", "queued", "running", "finished", "scored")),
                   "-" if r is None else f"{r:.3f}")
    parts = [head, cells, ex]
    if view.completed:
        steps = Table(title="completed steps", title_justify="left")
        for col in ("step", "loss", "grad norm", "kl", "clip fraction", "tokens", "seconds"):
            steps.add_column(col, justify="right")
        for k in sorted(view.completed)[-5:]:
            s = view.completed[k]
            steps.add_row(str(k), f"{s.loss:.4g}", f"{s.grad_norm:.4g}", f"{s.kl:.3g}", f"{s.clip_fraction:.3f}",
                          str(s.tokens), f"{s.duration_s:.1f}")
        parts.append(steps)
    if view.switches:
        sw = Table(title="last switches", title_justify="left")
        for col in ("cell", "from", "to", "seconds"):
            sw.add_column(col)
        for cell, a, b, s in view.switches:
            sw.add_row(cell, a, b, f"{s:.2f}")
        parts.append(sw)
    if metrics_urls:
        parts.append(Text("metrics:\n" + "\n".join(f"  {d:<10} {u}" for d, u in sorted(metrics_urls.items())),
                          style="dim", no_wrap=True))
    return Group(*parts)


def _locate(args) -> tuple[str, str | None, str, dict | None, Path | None]:
    """(url, token, run, the owning `gyre run`'s identity or None, run directory or None)."""
    if args.run_dir or not os.environ.get("GYRE_NATS_URL"):
        info, run_dir = live_run(args.run_dir, args.run, "; `gyre report {run_dir}` draws it")
        return info["url"], info.get("token"), info["run"], info, run_dir
    if not args.run:
        raise RuntimeError("GYRE_NATS_URL is set: name the run with --run ID")
    run_dir = runs_root() / args.run
    return os.environ["GYRE_NATS_URL"], os.environ.get("GYRE_NATS_TOKEN"), args.run, None, \
        run_dir if run_dir.is_dir() else None


class UnknownRun(Exception):
    """`--once` for a run of which the server stores no event."""


def _view_for(run: str, run_dir: Path | None) -> RunView:
    c_e, cells = 1, ()
    if run_dir is not None and (run_dir / "config.json").exists():
        import orjson
        cfg = orjson.loads((run_dir / "config.json").read_bytes())
        c_e = int((cfg.get("harness") or {}).get("concurrency") or 1)
        cells = tuple(f"cell{i}" for i in range(int((cfg.get("cells") or {}).get("count") or 0)))
    return RunView(run, c_e=c_e, cells=cells)


async def _status(url: str, token: str | None, run: str, owner: dict | None, run_dir: Path | None,
                  once: bool, refresh_s: float, catch_up_s: float) -> None:
    from rich.console import Console
    from rich.live import Live

    from handlers.metrics import recorded_urls

    stop = asyncio.Event()
    install_signals(stop)
    view = _view_for(run, run_dir)
    bus = await Bus.connect(url, token=token, run=run, name="gyre-status", stop=stop,
                            config=BusConfig(connect_timeout_s=5.0))
    if owner is None and await bus.stored_count(NAMES) == 0:  # a deployment's NATS: is the run there at all?
        if once:
            runs = await bus.runs_on_server()
            await bus.close()
            raise UnknownRun(f"no event of run {run!r} is stored on {url}; "
                             + (f"the runs there: {', '.join(runs[:20])}{' …' if len(runs) > 20 else ''}" if runs
                                else "it holds no run"))
        view.unseen = (f"no event of run {run!r} seen yet on {url}: is the run id right? "
                       "(`gyre status --once --run ID` names the runs there)")
    caught_up = asyncio.Event()
    follower = asyncio.create_task(bus.replay(NAMES, view.on_event, stop=stop, caught_up=caught_up))
    watcher = None
    if owner is not None:
        watcher = asyncio.create_task(stop_when_run_ends(owner, stop, lambda: None))
    urls = lambda: recorded_urls(run_dir) if run_dir is not None else {}  # noqa: E731
    console = Console() if sys.stdout.isatty() else Console(width=140, force_terminal=False)
    try:
        if once:
            try:
                await asyncio.wait_for(caught_up.wait(), catch_up_s)
            except asyncio.TimeoutError:
                print(f"gyre status: history not read within {catch_up_s:.0f}s; showing what was", file=sys.stderr)
            console.print(render(view, urls()))
            return
        with Live(render(view, urls()), console=console, refresh_per_second=max(1.0, 1 / refresh_s),
                  screen=False) as live:
            while not stop.is_set():
                try:
                    await asyncio.wait_for(stop.wait(), refresh_s)
                except asyncio.TimeoutError:
                    pass
                live.update(render(view, urls()))
        if owner is not None and not run_owner_alive(owner):
            print("gyre status: the run has ended", file=sys.stderr)
    finally:
        stop.set()
        if watcher is not None:
            watcher.cancel()
        try:
            await asyncio.wait_for(follower, 5)
        except (asyncio.TimeoutError, Exception):  # noqa: BLE001 - leaving either way
            follower.cancel()
        await bus.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="gyre status", description="A live view of a run: cells, executions, rewards.")
    p.add_argument("--run-dir", help="run directory (default: runs/latest)")
    p.add_argument("--run", help="run id: runs/ID, or with GYRE_NATS_URL set that server's run ID (then required)")
    p.add_argument("--once", action="store_true", help="print one snapshot and exit")
    p.add_argument("--refresh", type=float, default=1.0, help="seconds between redraws (default 1)")
    p.add_argument("--catch-up", type=float, default=15.0,
                   help="--once: seconds to wait for the stored history (default 15)")
    a = p.parse_args(argv)
    import logging

    from handlers.daemon import configure_logging
    configure_logging("status", level=logging.ERROR)
    try:
        url, token, run, owner, run_dir = _locate(a)
    except Exception as exc:  # noqa: BLE001 - tell the user, exit 2
        print(f"gyre status: {exc}", file=sys.stderr)
        return 2
    try:
        asyncio.run(_status(url, token, run, owner, run_dir, a.once, max(a.refresh, 0.1), a.catch_up))
    except ConnectError as exc:
        if exc.stopped:
            return 0
        print(f"gyre status: {exc}", file=sys.stderr)
        return 1
    except UnknownRun as exc:
        print(f"gyre status: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
