"""Scheduler daemon: runs a scheduling policy of `gyre.control` on the bus, unchanged.

The policy is the one `gyre sim` drives (`gyre.control.modes.make_policy`): `run.mode`
picks `elastic`, `colocate`, `colocate_overlapped`, `async` or `async_nonstreaming`. This
module only translates:

- facts in: `execution.started` / `finished` / `scored`, `microstep.ready`, `step.sealed`,
  `microstep.granted` / `committed`, `step.completed`, `cell.switched` (a cell in rollout
  also reports the version its engine loaded: a `weights.loaded` fact before it),
  `weights.loaded` of an engine (a serving cell follows `weights.published`: the staleness
  gate opens without a switch), and the scheduler's clock every `clock_s`; each fact carries `t`, seconds on the scheduler's
  monotonic clock;
- actions out: `Dispatch` → `route.updated` (reason `dispatch`) and one
  `execution.dispatched` per execution with its target cell (the runner launches what it
  is given); `Reroute` → `route.updated`; `Switch` → `cell.switch` (to rollout: the
  return); `OpenStep` is the core's ledger's own rule (it grants the oldest step not
  completed to any replica that claims), so it is only traced; `Done` is logged.

Every fact consumed and action taken is appended to `trace.jsonl` in the run directory
(docs/traces.md), flushed to disk before the actions are published and the event acked.

Restart-safe (kill -9 included: tests/test_scheduler_restart.py, tests/test_crash_daemons.py;
its own state is the trace, flushed before it acts): a restarted scheduler rebuilds its
policy by feeding the trace's facts to a fresh one (the same actions come back: the policy
is deterministic), republishes the last
fact's actions (ids are deterministic, so JetStream drops what was published already),
and skips events whose id the trace holds (a fact line carries the `id` of the event it
came from), so a redelivered event is consumed once.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import random
import time
from pathlib import Path

import structlog

import schemas
from bus import Bus
from gyre.config import CellsSection, HarnessSection, Recipe, RunSection, TasksSection
from gyre.control import facts as F
from gyre.control import trace
from gyre.control.modes import make_policy
from gyre.control.policy import Policy, PolicyConfig
from gyre.env.tasks import load_tasks
from handlers.daemon import FatalError, RunContext, connected, daemon_main, run_loops
from handlers.metrics import WATER_LEVEL
from schemas import ids

log = structlog.get_logger()


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Config:
    """The scheduler's settings. run, nats_url, nats_token: the bus (`handlers.daemon.BusSettings`)."""

    run: str
    nats_url: str
    nats_token: str | None
    schedule: RunSection
    """The recipe's [run]: steps, the seed of task order, the mode and its options."""
    tasks: TasksSection
    """The task set and the tasks (groups) per step, executions per group."""
    harness: HarnessSection
    """The harness profile and the per-execution limits (timeout_s, max_calls) passed to the runner."""
    cells: CellsSection
    """The cells, in switch order (core first), and C_e."""
    staleness: int
    """S (the recipe's `train.max_staleness`): burst k waits until every serving engine loaded v_{k−S}."""
    rollout_cells: int
    """The async modes' split (`Recipe.rollout_cells`)."""
    trace_path: Path
    """Where the trace is written (`<run dir>/trace.jsonl`)."""
    clock_s: float = 1.0
    """Seconds between the scheduler's clock facts (what a policy waiting on time needs)."""


def config_from_context(ctx: RunContext, _args=None) -> Config:
    r: Recipe = ctx.recipe
    return Config(run=ctx.run, nats_url=ctx.nats_url, nats_token=ctx.nats_token, schedule=r.run, tasks=r.tasks,
                  harness=r.harness, cells=r.cells, staleness=r.train.max_staleness, rollout_cells=r.rollout_cells,
                  trace_path=ctx.run_dir / "trace.jsonl")


def build_policy(cfg: Config) -> Policy:
    """The policy of `cfg.schedule.mode` over the run's cells (what a trace's header rebuilds)."""
    config = PolicyConfig(cells=cfg.cells.ids, capacity=cfg.cells.capacity, groups_per_step=cfg.tasks.groups_per_step,
                          group_size=cfg.tasks.group_size, steps=cfg.schedule.steps, staleness=cfg.staleness)
    mode = cfg.schedule.mode
    if mode == "elastic":
        return make_policy(mode, config, return_rule=cfg.schedule.return_rule)
    if mode in ("async", "async_nonstreaming"):
        return make_policy(mode, config, rollout_cells=cfg.rollout_cells)
    return make_policy(mode, config)


def facts_of(event, t: float) -> list[F.Fact]:
    """The policy's facts for one bus event (none for an event it does not consume)."""
    if isinstance(event, schemas.ExecutionStarted):
        return [F.ExecutionStarted(t=t, execution=event.info.execution, step=event.info.step)]
    if isinstance(event, schemas.ExecutionFinished):
        return [F.ExecutionFinished(t=t, execution=event.info.execution, step=event.info.step, status=event.status)]
    if isinstance(event, schemas.ExecutionScored):
        return [F.ExecutionScored(t=t, execution=event.info.execution, step=event.info.step)]
    if isinstance(event, schemas.MicrostepReady):
        return [F.MicrostepReady(t=t, step=event.step, microstep=event.microstep)]
    if isinstance(event, schemas.StepSealed):
        return [F.StepSealed(t=t, step=event.step, microsteps=event.microsteps, executions=event.executions)]
    if isinstance(event, schemas.MicrostepGranted):
        return [F.MicrostepGranted(t=t, step=event.step, microstep=event.microstep, replica=event.replica,
                                   epoch=event.epoch)]
    if isinstance(event, schemas.MicrostepCommitted):
        return [F.MicrostepCommitted(t=t, step=event.step, microstep=event.microstep, replica=event.replica,
                                     epoch=event.epoch)]
    if isinstance(event, schemas.StepCompleted):
        return [F.StepCompleted(t=t, step=event.step)]
    if isinstance(event, schemas.WeightsLoaded):  # an engine that follows weights.published while serving
        return [F.VersionLoaded(t=t, engine=event.cell, version=event.policy_version)] if event.role == "rollout" else []
    if isinstance(event, schemas.CellSwitched):
        switched = F.CellSwitched(t=t, cell=event.cell, from_role=event.from_role, to_role=event.to_role,
                                  durations=dict(event.durations))
        if event.to_role == "rollout":  # the engine serves the version it reports
            return [F.VersionLoaded(t=t, engine=event.cell, version=event.policy_version), switched]
        return [switched]
    return []


class Scheduler:
    """The policy, its trace, and the counters that make published ids deterministic."""

    def __init__(self, cfg: Config, bus: Bus, tasks: list[str]) -> None:
        if not tasks:
            raise FatalError(f"task set {cfg.tasks.set!r} has no tasks")
        self.cfg = cfg
        self.bus = bus
        self.policy = build_policy(cfg)
        self.order = list(tasks)
        random.Random(cfg.schedule.seed).shuffle(self.order)
        self.switch_seq = {c: 0 for c in cfg.cells.ids}
        self.route_seq = 0
        self.seen: set[str] = set()
        """Ids of the events consumed (their facts are in the trace)."""
        self.t = 0.0
        self._origin = time.monotonic()
        self.done = asyncio.Event()
        self.lock = asyncio.Lock()
        self._file = None
        self._last: list[F.Action] = []

    # --- the trace --------------------------------------------------------------------------

    def open_trace(self) -> list[F.Action]:
        """Start the trace, or rebuild the policy from the one a previous scheduler of this
        run wrote (module docstring); returns the actions of its last fact, to publish again."""
        path = self.cfg.trace_path
        path.parent.mkdir(parents=True, exist_ok=True)
        head = trace.header(self.policy)
        lines = [json.dumps(head)]
        last: list[F.Action] = []
        if path.exists() and path.stat().st_size:
            old_head, items = self._read(path)
            if old_head != json.loads(lines[0]):
                raise FatalError(f"{path} is the trace of another schedule ({old_head}); this run's is {head}")
            for obj in items:
                if "fact" not in obj:
                    continue  # the policy takes its actions again
                fact = trace.decode(obj)
                last = self.policy.on(fact)
                self.t = fact.t
                if obj.get("id"):
                    self.seen.add(obj["id"])
                lines.append(json.dumps(obj))
                for action in last:
                    self._count(action)
                    lines.append(json.dumps(trace.encode(action, fact.t)))
            log.info("scheduler.resumed", facts=sum(1 for line in lines if '"fact"' in line), t=self.t)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text("\n".join(lines) + "\n")
        os.replace(tmp, path)
        self._origin = time.monotonic() - self.t
        self._file = open(path, "a", encoding="utf-8")
        self._last = last
        return last

    @staticmethod
    def _read(path: Path) -> tuple[dict, list[dict]]:
        """The header and the objects of a trace; a torn last line (a crash mid-write) is dropped."""
        objs = []
        with open(path, encoding="utf-8") as f:
            for line in f:
                if not line.strip():
                    continue
                try:
                    objs.append(json.loads(line))
                except json.JSONDecodeError:
                    break
        if not objs or objs[0].get("trace") != trace.VERSION:
            raise FatalError(f"{path} is not a gyre trace")
        return objs[0], objs[1:]

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def now(self) -> float:
        """The scheduler's clock: seconds since its first start, never going back."""
        self.t = max(self.t, time.monotonic() - self._origin)
        return self.t

    # --- facts in, actions out --------------------------------------------------------------

    async def handle(self, event) -> None:
        """Consume one bus event (idempotent on its id)."""
        async with self.lock:
            if event.event_id in self.seen:
                return
            facts = facts_of(event, self.now())
            if facts:
                await self._feed(facts, event.event_id)
            self.seen.add(event.event_id)

    async def tick(self) -> None:
        async with self.lock:
            await self._feed([F.Clock(t=self.now())], None)

    async def _feed(self, facts: list[F.Fact], event_id: str | None) -> None:
        assert self._file is not None, "open_trace first"
        lines, actions = [], []
        for i, fact in enumerate(facts):
            taken = self.policy.on(fact)
            obj = trace.encode(fact)
            if event_id is not None and i == len(facts) - 1:
                obj["id"] = event_id
            lines.append(json.dumps(obj))
            lines += [json.dumps(trace.encode(a, fact.t)) for a in taken]
            actions += taken
        self._file.write("\n".join(lines) + "\n")
        self._file.flush()
        if actions:
            os.fsync(self._file.fileno())  # what was decided is on disk before anyone acts on it
        await self.act(actions)

    def _count(self, action: F.Action) -> tuple[int, ...]:
        """Advance the id counters an action uses; returns the seqs it takes."""
        if isinstance(action, (F.Dispatch, F.Reroute)):
            self.route_seq += 1
            return (self.route_seq - 1,)
        if isinstance(action, F.Switch):
            self.switch_seq[action.cell] += 1
            return (self.switch_seq[action.cell] - 1,)
        return ()

    async def act(self, actions: list[F.Action], *, counted: bool = False) -> None:
        """Publish `actions` (`counted`: their seqs were taken already, by the replay of the trace)."""
        seqs = self._seqs(actions) if counted else [self._count(a) for a in actions]
        moved: tuple[tuple[schemas.Route, ...], int] = ((), -1)  # the reroute the next switches carry
        for action, seq in zip(actions, seqs):
            if not isinstance(action, (F.Reroute, F.Switch)):
                moved = ((), -1)
            if isinstance(action, F.Dispatch):
                await self._dispatch(action, seq[0])
            elif isinstance(action, F.Reroute):
                # engine None: paused (no rollout engine holds it until a later route)
                routes = tuple(schemas.Route(execution=r.execution, cell=r.engine or "", reason=action.reason)
                               for r in action.routes)
                await self.bus.publish(schemas.RouteUpdated(event_id=ids.route(self.cfg.run, seq[0]), seq=seq[0],
                                                            routes=routes))
                moved = (routes, seq[0])
                log.info("scheduler.rerouted", routes=len(routes), reason=action.reason)
            elif isinstance(action, F.Switch):
                # a policy's switch follows the reroute of the executions it moves: the cell
                # offers their KV blocks to where they went
                await self.bus.publish(schemas.CellSwitch(
                    event_id=ids.switch(self.cfg.run, action.cell, seq[0]), cell=action.cell, seq=seq[0],
                    from_role=action.from_role, to_role=action.to_role, reason=action.reason, step=action.step,
                    moved=moved[0], route_seq=moved[1]))
                log.info("scheduler.switch", cell=action.cell, to_role=action.to_role, reason=action.reason,
                         step=action.step, water_level=self.policy.water_level)
            elif isinstance(action, F.OpenStep):
                log.info("scheduler.open", step=action.step)
            elif isinstance(action, F.Done):
                log.info("scheduler.done", steps=action.steps)
                self.done.set()
        WATER_LEVEL.set(self.policy.water_level)

    def _seqs(self, actions: list[F.Action]) -> list[tuple[int, ...]]:
        """The seqs `actions`, the last ones counted, took."""
        route, switch = self.route_seq, dict(self.switch_seq)
        out: list[tuple[int, ...]] = []
        for action in reversed(actions):
            if isinstance(action, (F.Dispatch, F.Reroute)):
                route -= 1
                out.append((route,))
            elif isinstance(action, F.Switch):
                switch[action.cell] -= 1
                out.append((switch[action.cell],))
            else:
                out.append(())
        return out[::-1]

    async def _dispatch(self, burst: F.Dispatch, seq: int) -> None:
        routes = tuple(schemas.Route(execution=p.execution, cell=p.engine, reason="dispatch") for p in burst.executions)
        await self.bus.publish(schemas.RouteUpdated(event_id=ids.route(self.cfg.run, seq), seq=seq, routes=routes))
        groups, size = self.cfg.tasks.groups_per_step, self.cfg.tasks.group_size
        for p in burst.executions:
            task = self.order[(burst.step * groups + p.group) % len(self.order)]
            info = schemas.ExecutionInfo(execution=p.execution, task=task, group=f"s{burst.step}-g{p.group}",
                                         step=burst.step, harness=self.cfg.harness.name, group_size=size,
                                         step_groups=groups)
            await self.bus.publish(schemas.ExecutionDispatched(
                event_id=ids.dispatched(self.cfg.run, p.execution), info=info, timeout_s=self.cfg.harness.timeout_s,
                max_calls=self.cfg.harness.max_calls, cell=p.engine))
        log.info("scheduler.dispatched", step=burst.step, executions=len(burst.executions),
                 cells=sorted({p.engine for p in burst.executions}), water_level=self.policy.water_level)

    async def clock(self, stop: asyncio.Event) -> None:
        """Feed a clock fact every `clock_s` until `stop`."""
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), self.cfg.clock_s)
            except asyncio.TimeoutError:
                await self.tick()


async def run(cfg: Config, stop: asyncio.Event) -> None:
    tasks = [t.instance_id for t in load_tasks(cfg.tasks.set)]
    async with connected(cfg, stop, "scheduler") as bus:
        sched = Scheduler(cfg, bus, tasks)
        last = sched.open_trace()
        try:
            async with sched.lock:
                await sched.act(last, counted=True)  # a previous scheduler may have died before publishing them
            await run_loops(bus.consume("scheduler-v1", sched.handle, stop=stop),
                            bus.consume("scheduler-steps-v2", sched.handle, stop=stop),
                            bus.consume("scheduler-cells-v1", sched.handle, stop=stop),
                            bus.consume("scheduler-microsteps-v1", sched.handle, stop=stop),
                            bus.consume("scheduler-ledger-v1", sched.handle, stop=stop),
                            sched.clock(stop))
        finally:
            sched.close()


def main(argv: list[str] | None = None) -> int:
    return daemon_main("scheduler", "Scheduler: runs the scheduling policy of run.mode (water level, cell roles, "
                       "step lifecycle) and writes trace.jsonl.", config_from_context, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
