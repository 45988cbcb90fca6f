"""The simulated cluster: SimPy drives one policy of `gyre.control` unchanged.

The model (everything else the policy decides):
- cells `c0` (the core) … `c<K−1>`, and the standalone pool when the workload declares one;
  at t = 0 every cell announces itself in rollout with policy version 0;
- an execution runs for its drawn duration while an engine serving rollouts holds it; a
  route to another engine keeps it running (a switch is harness-preserving: its calls are
  retried at the destination), a route to no engine pauses it until a later route;
- when the last execution of a group finishes (and is scored), the builder announces the
  group's micro-steps; the step is sealed when its last group is in;
- a cell in training claims micro-steps of the open step from the core's ledger, one at a
  time, and runs each for the micro-step's device time; when the step is sealed and every
  micro-step is granted, a claim is answered "nothing left to claim" (once per step and
  replica); a satellite pulls the core's newest version (`load_s`) before claiming a step;
- the step is completed when it is sealed and every micro-step is committed; then every
  serving engine loads the new version (`load_s`);
- a switch takes the workload's fixed cost for its direction; a training cell asked to
  return first finishes the micro-step it holds; a cell returning to rollout serves the
  newest version.

Facts happening at one instant are fed to the policy one at a time, in the order they
arise, and the actions each returns are applied before the next fact is fed.
"""
from __future__ import annotations

import collections
import dataclasses
from typing import Callable

import numpy as np
import simpy

from gyre.control import facts as F
from gyre.control.policy import Policy


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Workload:
    """What the simulated cluster runs. Seconds throughout."""

    cells: int
    capacity: int
    """C_e."""
    groups: int
    group_size: int
    durations: np.ndarray
    """(steps, groups × group_size): execution k's duration sits at [step, group × group_size + index]."""
    microsteps_per_group: int
    microstep_s: float
    """Device time of one micro-step on one cell."""
    to_training_s: float
    to_rollout_s: float
    load_s: float = 0.0
    staleness: int = 1
    pool: int = 0
    timeout_s: float | None = None
    """Executions of this duration are reported with status `timeout`."""

    @property
    def steps(self) -> int:
        return int(self.durations.shape[0])

    @property
    def cell_names(self) -> tuple[str, ...]:
        return tuple(f"c{i}" for i in range(self.cells))

    @property
    def train_s(self) -> float:
        """Device time of one step's training on one cell."""
        return self.microstep_s * self.microsteps_per_group * self.groups


@dataclasses.dataclass
class Timeline:
    """What the pictures show: each cell's state over time and the water level."""

    segments: dict[str, list[tuple[float, float, str]]]
    """cell -> (start, end, state) with state `rollout`, `training`, `switching`."""
    busy: dict[str, list[tuple[float, float]]]
    """cell -> the intervals it ran a micro-step."""
    t: list[float]
    water_level: list[int]
    spare: list[int]
    """C_R(t) − C_e at each t: the switch rule's threshold."""


@dataclasses.dataclass
class SimResult:
    mode: str
    step_ends: list[float]
    """T_k: the time step k's optimizer update ended."""
    idle_cell_s: dict[str, float]
    """Cell-seconds: `rollout` (empty slots ÷ C_e), `training` (a training cell holding no
    micro-step), `switching`."""
    switches: int
    microsteps_per_cell: dict[str, int]
    timeline: Timeline | None


@dataclasses.dataclass(slots=True)
class _Execution:
    step: int
    group: int
    duration: float
    remaining: float
    engine: str | None
    resumed_at: float = 0.0
    gen: int = 0


@dataclasses.dataclass(slots=True)
class _Cell:
    name: str
    state: str = "idle"  # idle, rollout, training, switching
    version: int = 0
    trainer: object = None  # the claim loop while in training
    leaving: bool = False
    queued: list = dataclasses.field(default_factory=list)
    since: float = 0.0
    busy: bool = False


class Simulation:
    """Run `policy` on `workload`; `observe(item)` sees every fact fed and action taken."""

    def __init__(self, workload: Workload, policy: Policy, *, observe: Callable | None = None,
                 timeline: bool = False) -> None:
        self.w = workload
        self.policy = policy
        self.observe = observe
        self.env = simpy.Environment(initial_time=0.0)
        names = workload.cell_names
        if tuple(policy.cfg.cells) != names:
            raise ValueError(f"the policy's cells {policy.cfg.cells} are not the workload's {names}")
        self.core = names[0]
        self.cells = {c: _Cell(c) for c in names}
        self.execs: dict[str, _Execution] = {}
        self.on_engine: dict[str, set[str]] = {c: set() for c in names} | {F.POOL: set()}
        self.pool_version = 0
        # the builder and the core's ledger
        self.group_left: dict[tuple[int, int], int] = {}
        self.groups_left: dict[int, int] = {}
        self.ready: dict[int, collections.deque[int]] = collections.defaultdict(collections.deque)
        self.granted: collections.Counter[int] = collections.Counter()
        self.committed: collections.Counter[int] = collections.Counter()
        self.sealed: dict[int, int] = {}
        self.open = -1
        self.completed = 0
        self.told: dict[str, int] = {}
        self.work = self.env.event()
        # feeding the policy
        self.queue: collections.deque[F.Fact] = collections.deque()
        self.pumping = False
        self.done = False
        # results
        self.step_ends: list[float] = []
        self.switch_count = 0
        self.microsteps_by = collections.Counter()
        self.idle = {"rollout": 0.0, "training": 0.0, "switching": 0.0}
        self._last = 0.0
        self._rates = (0.0, 0.0, 0.0)
        self.tl = Timeline({c: [] for c in names}, {c: [] for c in names}, [], [], []) if timeline else None

    # --- running ----------------------------------------------------------------------------

    def run(self) -> SimResult:
        for c in self.cells.values():
            self.feed(F.VersionLoaded(t=0.0, engine=c.name, version=0))
            self._set_state(c, "rollout")
            self.feed(F.CellSwitched(t=0.0, cell=c.name, from_role="idle", to_role="rollout"))
        if self.w.pool:
            self.feed(F.VersionLoaded(t=0.0, engine=F.POOL, version=0))
        self.env.run()
        if not self.done:
            raise RuntimeError(f"{self.policy.mode}: the simulation stalled at t={self.env.now:.1f} s after "
                               f"{self.completed} of {self.w.steps} steps")
        end = self.step_ends[-1]
        for c in self.cells.values():
            self._set_state(c, c.state, end)
        return SimResult(mode=self.policy.mode, step_ends=self.step_ends, idle_cell_s=dict(self.idle),
                         switches=self.switch_count, microsteps_per_cell=dict(self.microsteps_by), timeline=self.tl)

    def feed(self, fact: F.Fact) -> None:
        self.queue.append(fact)
        if self.pumping:
            return
        self.pumping = True
        try:
            self._account(self.env.now)
            while self.queue:
                fact = self.queue.popleft()
                if self.observe:
                    self.observe(fact)
                actions = self.policy.on(fact)
                for action in actions:
                    if self.observe:
                        self.observe(action)
                    self._apply(action)
                if self.tl is not None:
                    p = self.policy
                    self.tl.t.append(self.env.now)
                    self.tl.water_level.append(p.water_level)
                    self.tl.spare.append(p.rollout_capacity - p.cfg.capacity)
            self._rates = self._current_rates()
        finally:
            self.pumping = False

    def _current_rates(self) -> tuple[float, float, float]:
        serving = [c for c in self.cells.values() if c.state == "rollout"]
        held = sum(len(self.on_engine[c.name]) for c in serving)
        rollout_idle = len(serving) - held / self.w.capacity
        training_idle = sum(1 for c in self.cells.values() if c.state == "training" and not c.busy)
        switching = sum(1 for c in self.cells.values() if c.state == "switching")
        return rollout_idle, float(training_idle), float(switching)

    def _account(self, now: float) -> None:
        dt = now - self._last
        if dt > 0 and not self.done:
            r, t, s = self._rates
            self.idle["rollout"] += dt * r
            self.idle["training"] += dt * t
            self.idle["switching"] += dt * s
        self._last = now

    def _set_state(self, c: _Cell, state: str, now: float | None = None) -> None:
        now = self.env.now if now is None else now
        if self.tl is not None and c.state != "idle" and now > c.since:
            self.tl.segments[c.name].append((c.since, now, c.state))
        c.state, c.since = state, now

    # --- actions ------------------------------------------------------------------------------

    def _apply(self, action: F.Action) -> None:
        if isinstance(action, F.Dispatch):
            for placed in action.executions:
                self._start(action.step, placed)
        elif isinstance(action, F.Reroute):
            for route in action.routes:
                self._route(route)
        elif isinstance(action, F.Switch):
            self._switch(action)
        elif isinstance(action, F.OpenStep):
            self.open = action.step
            self._wake()
        elif isinstance(action, F.Done):
            self.done = True
            for c in self.cells.values():
                c.leaving = True
            self._wake()

    def _serving(self, engine: str) -> bool:
        return engine == F.POOL and self.w.pool > 0 or engine in self.cells and self.cells[engine].state == "rollout"

    def _hold(self, x: str, engine: str) -> None:
        if not self._serving(engine):
            raise RuntimeError(f"{self.policy.mode}: {x} placed on {engine}, which does not serve rollouts")
        cap = self.w.pool if engine == F.POOL else self.w.capacity
        if len(self.on_engine[engine]) >= cap:
            raise RuntimeError(f"{self.policy.mode}: {engine} would hold more than {cap} executions")
        self.on_engine[engine].add(x)

    def _start(self, step: int, placed: F.Placed) -> None:
        index = int(placed.execution.rsplit("-e", 1)[1])
        d = float(self.w.durations[step, placed.group * self.w.group_size + index])
        x = _Execution(step=step, group=placed.group, duration=d, remaining=d, engine=placed.engine,
                       resumed_at=self.env.now)
        self.execs[placed.execution] = x
        self._hold(placed.execution, placed.engine)
        self._schedule(placed.execution, x)
        self.feed(F.ExecutionStarted(t=self.env.now, execution=placed.execution, step=step))

    def _schedule(self, name: str, x: _Execution) -> None:
        gen = x.gen
        ev = self.env.timeout(x.remaining)
        ev.callbacks.append(lambda _ev: self._finish(name, gen))

    def _route(self, route: F.Route) -> None:
        x = self.execs[route.execution]
        if x.engine is not None:
            self.on_engine[x.engine].discard(route.execution)
            if route.engine is None:  # pause
                x.remaining -= self.env.now - x.resumed_at
                x.gen += 1
        elif route.engine is not None:  # resume
            x.resumed_at = self.env.now
            self._schedule(route.execution, x)
        x.engine = route.engine
        if route.engine is not None:
            self._hold(route.execution, route.engine)

    def _finish(self, name: str, gen: int) -> None:
        x = self.execs.get(name)
        if x is None or x.gen != gen:
            return
        del self.execs[name]
        self.on_engine[x.engine].discard(name)
        now = self.env.now
        timeout = self.w.timeout_s is not None and x.duration >= self.w.timeout_s
        self.feed(F.ExecutionFinished(t=now, execution=name, step=x.step, status="timeout" if timeout else "ok"))
        self.feed(F.ExecutionScored(t=now, execution=name, step=x.step))
        key = (x.step, x.group)
        left = self.group_left.get(key, self.w.group_size) - 1
        self.group_left[key] = left
        if left == 0:
            m = self.w.microsteps_per_group
            for j in range(m):
                self.ready[x.step].append(x.group * m + j)
                self.feed(F.MicrostepReady(t=now, step=x.step, microstep=x.group * m + j))
            groups = self.groups_left.get(x.step, self.w.groups) - 1
            self.groups_left[x.step] = groups
            if groups == 0:
                n = self.w.groups * m
                self.sealed[x.step] = n
                self.feed(F.StepSealed(t=now, step=x.step, microsteps=n,
                                       executions=self.w.groups * self.w.group_size))
            self._wake()

    # --- switches and training ----------------------------------------------------------------

    def _switch(self, sw: F.Switch) -> None:
        c = self.cells[sw.cell]
        if c.state == "switching" or c.leaving or c.queued:
            c.queued.append(sw)
            return
        if c.state == sw.to_role:
            return
        self.switch_count += 1
        if c.state == "rollout":
            if self.on_engine[c.name]:
                raise RuntimeError(f"{self.policy.mode}: {c.name} leaves rollout holding "
                                   f"{len(self.on_engine[c.name])} executions")
            self._begin(c, sw)
        else:  # training: stop claiming, finish the micro-step held, then switch
            c.leaving = True
            c.queued.insert(0, sw)
            self._wake()

    def _begin(self, c: _Cell, sw: F.Switch) -> None:
        from_role = c.state
        c.leaving = False
        self._account(self.env.now)
        self._set_state(c, "switching")
        self._rates = self._current_rates()
        cost = self.w.to_training_s if sw.to_role == "training" else self.w.to_rollout_s
        started = self.env.now
        ev = self.env.timeout(cost)
        ev.callbacks.append(lambda _ev: self._switched(c, from_role, sw.to_role, started))

    def _switched(self, c: _Cell, from_role: str, to_role: str, started: float) -> None:
        now = self.env.now
        version = self.completed
        self._set_state(c, to_role)
        c.version = version
        if to_role == "rollout":
            self.feed(F.VersionLoaded(t=now, engine=c.name, version=version))
        self.feed(F.CellSwitched(t=now, cell=c.name, from_role=from_role, to_role=to_role,
                                 durations={"total_s": now - started}))
        if c.queued:
            nxt = c.queued.pop(0)
            if nxt.to_role != c.state:
                self.switch_count += 1
                if c.state == "rollout" and self.on_engine[c.name]:
                    raise RuntimeError(f"{self.policy.mode}: {c.name} leaves rollout holding executions")
                self._begin(c, nxt)
                return
        if c.state == "training":
            c.leaving = False
            c.trainer = self.env.process(self._train(c))

    def _wake(self) -> None:
        if not self.work.triggered:
            self.work.succeed()
        self.work = self.env.event()

    def _train(self, c: _Cell):
        env, w = self.env, self.w
        while not c.leaving and not self.done:
            k = self.open
            if 0 <= k < w.steps and k == self.completed:
                if c.name != self.core and c.version < k:
                    if w.load_s > 0:
                        yield env.timeout(w.load_s)
                    c.version = k
                    self.feed(F.VersionLoaded(t=env.now, engine=c.name, version=k))
                    continue
                if self.ready[k]:
                    m = self.ready[k].popleft()
                    self.granted[k] += 1
                    c.busy = True
                    self.feed(F.MicrostepGranted(t=env.now, step=k, microstep=m, replica=c.name))
                    start = env.now
                    yield env.timeout(w.microstep_s)
                    c.busy = False
                    if self.tl is not None:
                        self.tl.busy[c.name].append((start, env.now))
                    self.committed[k] += 1
                    self.microsteps_by[c.name] += 1
                    self.feed(F.MicrostepCommitted(t=env.now, step=k, microstep=m, replica=c.name))
                    if self.sealed.get(k) == self.committed[k]:
                        self._complete(k)
                    continue
                if k in self.sealed and self.granted[k] >= self.sealed[k] and self.told.get(c.name) != k:
                    self.told[c.name] = k
                    self.feed(F.NothingToClaim(t=env.now, step=k, replica=c.name))
                    continue
            if c.leaving or self.done:
                break
            yield self.work
        c.trainer = None
        if c.queued and not self.done:
            self._begin(c, c.queued.pop(0))

    def _complete(self, k: int) -> None:
        now = self.env.now
        self.completed = k + 1
        self.step_ends.append(now)
        self.feed(F.StepCompleted(t=now, step=k))
        self._wake()
        if self.done:
            return
        engines = [c.name for c in self.cells.values() if c.state == "rollout"]
        if self.w.pool:
            engines.append(F.POOL)
        version = k + 1

        def load(_ev=None):
            for e in engines:
                if e == F.POOL or self.cells[e].state == "rollout":
                    if e in self.cells:
                        self.cells[e].version = version
                    self.feed(F.VersionLoaded(t=self.env.now, engine=e, version=version))
        if self.w.load_s > 0:
            self.env.timeout(self.w.load_s).callbacks.append(load)
        else:
            load()
