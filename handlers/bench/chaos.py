"""`gyre bench chaos [--json PATH]`: does a run survive its daemons dying, with nothing lost and
nothing counted twice? (BENCHMARKS.md)

A seeded elastic toy run (`--steps`, default 6, on two cells; every daemon a process, as
`gyre run` starts them, on a private nats-server). A chaos driver (seeded `random.Random`)
waits a random 1–`--gap` seconds, draws a target uniformly among proxy, scheduler, builder,
runner, evaluator, a cell in rollout and a cell in training, and SIGKILLs its daemon at the
first moment, within `--gap` seconds more, that the daemon holds unfinished work
(`Observer.holding`), else when that time is up (a cell target with no cell in that role
then is drawn again); `--kills` times (default 20). Once, between two kills, the nats-server is stopped and
started again on its port and store. A supervisor restarts every daemon that exited (killed
or crashed) after 1 s. When every step is completed (or `--timeout`), the daemons stop and
`handlers.audit.audit` reads the bus and the run directory (calls counted on the client side:
the toy harness's own lines).

Keys: `trials` (kills made), `calls_lost`, `samples_duplicated`, `microsteps_double_counted`,
`executions_dispatched_twice`, `steps_completed`, `steps_expected`, `kills_mid_work`,
`recovery_s` (per daemon, `p50` and `max`: from the kill to the restarted daemon's first
handled message, `proxy.started` for the proxy; kills not followed by one are left out),
`wall_s`, and `kills` (each: target, daemon, mid_work, work, t), `nats_restarts`, `crashes`
(exits the driver did not cause), `calls_answered`, `calls_recorded`, `run_dir`, `seed`.
Targets: at least 20 kills, at least 10 mid-work, over at least 6 steps; every loss or
duplication count 0; every step completed.
"""
from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import random
import secrets
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import orjson

import schemas
from bus import Bus
from bus.server import NatsServer
from handlers.daemon import stop_processes

CELLS = ("cell0", "cell1")
TARGETS = ("proxy", "scheduler", "builder", "runner", "evaluator", "cell-in-rollout", "cell-in-training")
MODULES = {"proxy": ("handlers.proxy",), "runner": ("handlers.runner",), "evaluator": ("handlers.evaluator",),
           "builder": ("handlers.builder",), **{c: ("handlers.cell", "--cell", c) for c in CELLS},
           "scheduler": ("handlers.scheduler",)}


def recipe_for(steps: int, seed: int):
    from gyre.config import load_recipe

    return load_recipe("toy", {"run.mode": "elastic", "run.steps": steps, "run.seed": seed, "cells.count": len(CELLS),
                               "cells.capacity": 4, "tasks.group_size": 4, "tasks.groups_per_step": 2})


def prepare_run_dir(run_dir: Path, run: str, url: str, token: str, recipe) -> Path:
    """What `gyre run` writes before it starts daemons: config.json, nats.json (no owner pid:
    the daemons never stop on their own), key_secret, engine_token, logs/, the model."""
    from gyre.serving.model import ModelSpec, init_model

    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_bytes(orjson.dumps(recipe.to_dict()))
    for name, data in (("nats.json", orjson.dumps({"run": run, "url": url, "token": token})),
                       ("key_secret", secrets.token_hex(32).encode()), ("engine_token", secrets.token_hex(32).encode())):
        fd = os.open(run_dir / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
    m = recipe.model
    init_model(run_dir / "model", ModelSpec(layers=m.layers, hidden=m.hidden, heads=m.heads, kv_heads=m.kv_heads,
                                            head_dim=m.hidden // m.heads, intermediate=3 * m.hidden, seed=m.seed))
    return run_dir


class Supervisor:
    """Daemon processes of one run; logs append to `<run_dir>/logs/<name>.log` across restarts.
    `tend()` restarts every daemon that exited, `restart_s` after it exited."""

    def __init__(self, run_dir: Path, restart_s: float = 1.0) -> None:
        self.run_dir = run_dir
        self.restart_s = restart_s
        self.procs: dict[str, subprocess.Popen] = {}
        self.exited: dict[str, float] = {}
        self.killed: set[str] = set()  # exits this supervisor's owner caused (kill9)
        self.crashes: list[tuple[str, int]] = []
        self.restarts: dict[str, list[float]] = {}  # wall clock of each restart
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("GYRE_NATS")}
        self.env.update(HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1",
                        HF_HUB_DISABLE_PROGRESS_BARS="1")

    def start(self, name: str) -> None:
        module, *extra = MODULES[name]
        with open(self.run_dir / "logs" / f"{name}.log", "ab") as log:
            self.procs[name] = subprocess.Popen(
                [sys.executable, "-m", module, "--run-dir", str(self.run_dir), "--log-json", *extra], stdout=log,
                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=self.env, start_new_session=True)
        self.restarts.setdefault(name, []).append(time.time())

    def kill9(self, name: str) -> int:
        """SIGKILL the daemon's process (not its children: a crash leaves them to their fate);
        returns its exit status."""
        proc = self.procs[name]
        self.killed.add(name)
        proc.send_signal(signal.SIGKILL)
        return proc.wait(30)

    def tend(self) -> None:
        now = time.monotonic()
        for name, proc in self.procs.items():
            if proc.poll() is None:
                continue
            if name not in self.exited:
                self.exited[name] = now
                if name not in self.killed:
                    self.crashes.append((name, proc.returncode))
            elif now - self.exited[name] >= self.restart_s:
                del self.exited[name]
                self.killed.discard(name)
                self.start(name)

    def log(self, name: str) -> str:
        try:
            return (self.run_dir / "logs" / f"{name}.log").read_text(errors="replace")
        except OSError:
            return ""

    def stop(self, timeout_s: float = 30.0) -> None:
        stop_processes(self.procs.values(), timeout_s)


def current_process(log: str) -> str:
    """The part of a daemon's log its current process wrote (after its last start line): the
    harnesses an earlier runner launched died with it."""
    start = log.rfind('"event":"daemon.metrics"')
    return log[log.rfind("\n", 0, start) + 1:] if start >= 0 else log


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:  # removed meanwhile (graded)
        return 0.0


def _lines(text: str, event: str) -> list[dict]:
    out = []
    for line in text.splitlines():
        if event in line:
            try:
                out.append(orjson.loads(line))
            except orjson.JSONDecodeError:
                pass
    return out


class Observer:
    """What the run holds now, from its events (followed by `follow`) and its run directory."""

    NAMES = (schemas.StepCompleted.NAME, schemas.StepSealed.NAME, schemas.MicrostepGranted.NAME,
             schemas.MicrostepCommitted.NAME, schemas.CallCompleted.NAME, schemas.CellSwitched.NAME)

    def __init__(self, run_dir: Path, sup: Supervisor) -> None:
        self.run_dir = run_dir
        self.sup = sup
        self.completed: set[int] = set()
        self.sealed: set[int] = set()
        self.granted: dict[tuple[int, int, int], str] = {}  # (epoch, step, micro-step) → replica
        self.committed: set[tuple[int, int, int]] = set()
        self.call_steps: set[int] = set()
        self.roles: dict[str, str] = {}

    async def on(self, e: schemas.Event) -> None:
        if isinstance(e, schemas.StepCompleted):
            self.completed.add(e.step)
        elif isinstance(e, schemas.StepSealed):
            self.sealed.add(e.step)
        elif isinstance(e, schemas.MicrostepGranted):
            self.granted[(e.epoch, e.step, e.microstep)] = e.replica
        elif isinstance(e, schemas.MicrostepCommitted):
            self.committed.add((e.epoch, e.step, e.microstep))
        elif isinstance(e, schemas.CallCompleted):
            self.call_steps.add(int(e.execution.split("-")[0][1:]))
        elif isinstance(e, schemas.CellSwitched):
            self.roles[e.cell] = e.to_role

    def in_flight(self) -> dict[str, str]:
        """execution → cell, dispatched by the scheduler's trace and not finished."""
        placed, done = {}, set()
        try:
            text = (self.run_dir / "trace.jsonl").read_text()
        except OSError:
            return {}
        for line in text.splitlines():
            try:
                x = json.loads(line)
            except json.JSONDecodeError:
                continue
            if x.get("action") == "dispatch":
                placed.update({e[0]: e[-1] for e in x["executions"]})  # [execution, slot, cell]
            elif x.get("fact") == "execution.finished":
                done.add(x.get("execution"))
        return {e: c for e, c in placed.items() if e not in done}

    def running(self, answered: bool = False) -> list[str]:
        """Executions whose harness runs (no runner record); `answered`: and has had a call answered."""
        out = []
        for x in _lines(current_process(self.sup.log("runner")), "runner.harness.started"):
            e = x.get("execution", "")
            if not e or (self.run_dir / "runner" / f"{e}.json").exists():
                continue
            if answered:
                try:
                    if "toy_harness: call 0:" not in (self.run_dir / "logs" / "executions" / f"{e}.log").read_text():
                        continue
                except OSError:
                    continue
            out.append(e)
        return sorted(set(out))

    def grading(self) -> list[str]:
        """Executions the current evaluator process grades: a graded copy it made, no result."""
        root = self.run_dir / "eval"
        starts = _lines(current_process(self.sup.log("evaluator")), "daemon.metrics")
        if not root.is_dir() or not starts:
            return []
        since = dt.datetime.fromisoformat(starts[0]["timestamp"]).timestamp()
        return sorted(p.name for p in root.iterdir() if any(_mtime(a) >= since for a in p.glob("a*"))
                      and not (self.run_dir / "evaluator" / f"{p.name}.json").exists())

    def held_grants(self, replica: str | None = None) -> list[tuple[int, int]]:
        return sorted({(s, i) for (ep, s, i), r in self.granted.items() if s not in self.completed
                       and (ep, s, i) not in self.committed and (replica is None or r == replica)})

    async def holding(self, target: str, bus: Bus, rng: random.Random) -> tuple[str, object]:
        """(the daemon to kill for `target`, the unfinished work it holds or None). The daemon
        is '' when no process fits the target now (no cell in that role)."""
        if target == "scheduler":
            return target, sorted(self.in_flight()) or None
        if target in ("runner", "proxy"):
            return target, self.running(answered=True) or None
        if target == "evaluator":
            return target, self.grading() or None
        if target == "builder":
            open_steps = self.call_steps - self.sealed
            try:
                caught_up = await bus.consumer_backlog("builder-calls-v1") == 0
            except Exception:  # noqa: BLE001 - the bus is reconnecting (its server restarted): not known now
                caught_up = False
            return target, sorted(open_steps) if open_steps and caught_up else None
        role = "rollout" if target == "cell-in-rollout" else "training"
        cells = [c for c in CELLS if self.roles.get(c) == role]
        if not cells:
            return "", None
        cell = rng.choice(cells)
        if role == "rollout":
            flight = self.in_flight()
            return cell, [e for e in self.running() if flight.get(e) == cell] or None
        return cell, self.held_grants(None if cell == "cell0" else cell) or None


def recovery(sup: Supervisor, kills: list[dict]) -> dict:
    """Per daemon, seconds from each kill to the restarted daemon's first handled message."""
    per: dict[str, list[float]] = {}
    for k in kills:
        name = k["daemon"]
        event = "proxy.started" if name == "proxy" else "bus.message.handled"
        later = [dt.datetime.fromisoformat(x["timestamp"]).timestamp()
                 for x in _lines(sup.log(name), event) if "timestamp" in x]
        after = [t for t in later if t > k["wall"] + 0.5]
        if after:
            per.setdefault(name, []).append(round(min(after) - k["wall"], 2))
    return {n: {"p50": round(statistics.median(v), 2), "max": max(v), "n": len(v)} for n, v in per.items()}


async def measure(*, steps: int = 6, kills: int = 20, seed: int = 0, gap_s: float = 8.0, timeout_s: float = 3600.0,
                  workdir: Path | None = None, quiet: bool = True) -> dict:
    from handlers.audit import audit

    rng = random.Random(seed)
    root = Path(workdir or os.environ.get("GYRE_RUNS_DIR", "runs")).resolve()
    run = f"chaos-{seed}-{int(time.time())}"
    run_dir = root / run
    run_dir.mkdir(parents=True)
    server = NatsServer.start(run_dir / "nats")
    port = int(server.url.rsplit(":", 1)[1])
    recipe = recipe_for(steps, seed)
    prepare_run_dir(run_dir, run, server.url, server.token, recipe)
    sup = Supervisor(run_dir)
    obs = Observer(run_dir, sup)
    bus = await Bus.connect(server.url, token=server.token, run=run, name="chaos")
    await bus.ensure_streams()
    stop = asyncio.Event()
    follower = asyncio.create_task(bus.replay(list(Observer.NAMES), obs.on, stop=stop))
    for name in MODULES:
        sup.start(name)
    t0 = time.monotonic()
    made: list[dict] = []
    restart_at = rng.randint(kills // 4, 3 * kills // 4)
    nats_restarts = 0
    next_kill = t0 + 15.0 + rng.uniform(1.0, gap_s)  # the daemons' start (imports, model) first
    target: str | None = None  # drawn, waiting for its daemon to hold work (at most gap_s)
    give_up = 0.0
    try:
        while len(obs.completed) < steps and time.monotonic() - t0 < timeout_s:
            sup.tend()
            now = time.monotonic()
            if len(made) < kills and now >= next_kill:
                if target is None:
                    target, give_up = rng.choice(TARGETS), now + gap_s
                daemon, work = await obs.holding(target, bus, rng)
                up = bool(daemon) and daemon not in sup.exited and sup.procs[daemon].poll() is None
                if up and (work is not None or now >= give_up):
                    sup.kill9(daemon)
                    made.append({"target": target, "daemon": daemon, "mid_work": work is not None,
                                 "work": work, "t": round(now - t0, 2), "wall": time.time(),
                                 "step": len(obs.completed)})
                    if not quiet:
                        print(f"chaos: t={now - t0:6.1f}s kill -9 {daemon} ({target}), holding {work}", flush=True)
                    if len(made) == restart_at and not nats_restarts:
                        server.stop()
                        await asyncio.sleep(1.0)
                        server = NatsServer.start(run_dir / "nats", port=port, token=server.token)
                        nats_restarts += 1
                        if not quiet:
                            print(f"chaos: t={time.monotonic() - t0:6.1f}s nats-server restarted", flush=True)
                    target, next_kill = None, now + rng.uniform(1.0, gap_s)
                elif now >= give_up:  # no process fits the target now (no cell in that role): draw again
                    target = None
            await asyncio.sleep(0.25)
        wall = time.monotonic() - t0
        await asyncio.sleep(2.0)
        result = await audit(bus, run_dir)
    finally:
        stop.set()
        await asyncio.gather(follower, return_exceptions=True)
        sup.stop()
        await bus.close()
        server.stop()
    return {"trials": len(made), "calls_lost": result.calls_lost, "samples_duplicated": result.samples_duplicated,
            "microsteps_double_counted": result.microsteps_double_counted,
            "executions_dispatched_twice": result.executions_dispatched_twice,
            "steps_completed": result.steps_completed, "steps_expected": steps,
            "kills_mid_work": sum(k["mid_work"] for k in made), "recovery_s": recovery(sup, made),
            "wall_s": round(wall, 1), "nats_restarts": nats_restarts, "crashes": sup.crashes,
            "calls_answered": result.calls_answered, "calls_recorded": result.calls_recorded,
            "kills": [{k: v for k, v in x.items() if k != "wall"} for x in made], "audit": result.details,
            "run_dir": str(run_dir), "seed": seed}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="gyre bench chaos", description=__doc__.splitlines()[0])
    p.add_argument("--json", help="write the figures here")
    p.add_argument("--steps", type=int, default=6, help="steps of the run (default 6)")
    p.add_argument("--kills", type=int, default=20, help="kill -9 this many times (default 20)")
    p.add_argument("--seed", type=int, default=0, help="the run's and the chaos driver's seed (default 0)")
    p.add_argument("--gap", type=float, default=8.0, help="most seconds between two kills, and most seconds a drawn target is waited for to hold work (default 8)")
    p.add_argument("--timeout", type=float, default=3600.0, help="give up after this many seconds (default 3600)")
    p.add_argument("--workdir", help="where the run goes (default $GYRE_RUNS_DIR or runs/)")
    p.add_argument("--verbose", action="store_true", help="print each kill")
    a = p.parse_args(argv)
    f = asyncio.run(measure(steps=a.steps, kills=a.kills, seed=a.seed, gap_s=a.gap, timeout_s=a.timeout,
                            workdir=Path(a.workdir) if a.workdir else None, quiet=not a.verbose))
    keys = ("trials", "kills_mid_work", "nats_restarts", "steps_completed", "steps_expected", "calls_answered",
            "calls_recorded", "calls_lost", "samples_duplicated", "microsteps_double_counted",
            "executions_dispatched_twice", "wall_s")
    for k in keys:
        print(f"{k:28s} {f[k]}")
    print(f"{'recovery_s':28s} {json.dumps(f['recovery_s'])}")
    if a.json:
        Path(a.json).write_bytes(orjson.dumps(f, option=orjson.OPT_INDENT_2))
        print(f"figures written to {a.json}")
    met = (f["trials"] >= 20 and f["kills_mid_work"] >= 10 and f["steps_completed"] == f["steps_expected"] >= 6
           and not (f["calls_lost"] or f["samples_duplicated"] or f["microsteps_double_counted"]
                    or f["executions_dispatched_twice"]))
    print("targets met" if met else "targets NOT met")
    return 0 if met else 1


if __name__ == "__main__":
    raise SystemExit(main())
