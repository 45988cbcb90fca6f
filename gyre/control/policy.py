"""The scheduling policy's view of the cluster, and what every mode shares.

A `Policy` consumes facts (`gyre.control.facts`) through `on(fact) -> list[Action]`. It
keeps (DESIGN.md "Elastic scheduling", "Staleness"):

- the counters over every burst in flight: d(t) dispatched, p(t) started, f(t) finished
  executions, and the water level w(t) = d(t) − f(t) (paused executions count: they are
  dispatched and unfinished);
- the engines and what they hold: each cell's role, the cells in the middle of a switch
  (they count for no role), the standalone rollout pool when one is declared, the executions
  on each engine, and the policy version each engine has loaded;
- C_R(t): the capacity of the engines serving now (C_e per rollout cell, plus the pool);
- the bursts released by the staleness gate (burst k needs every serving engine at
  v_{k−S} or newer) and the executions released but not yet admitted (the backlog, FIFO);
- the core's ledger as the scheduler sees it: micro-steps ready, granted, committed (under
  the core's newest epoch: a restarted core's grants start the steps not completed afresh),
  which steps are sealed and completed, which step is open for claims;
- what it observed: execution durations, switch durations by direction, micro-step durations.

Modes (`gyre.control.modes`, `gyre.control.elastic`) decide, from that view, what to
release, what to admit where, which cell switches, and which step the ledger may grant.
Admission is always bounded: an engine never holds more than its capacity.

Pure: no clock of its own (facts carry `t`), no randomness, no I/O; equal facts give
equal actions.
"""
from __future__ import annotations

import bisect
import collections
import dataclasses
from typing import ClassVar

from gyre.control.facts import (POOL, Action, CellSwitched, Clock, Dispatch, Done, ExecutionDispatched,
                                ExecutionFinished, ExecutionScored, ExecutionStarted, Fact, MicrostepCommitted,
                                MicrostepGranted, MicrostepReady, NothingToClaim, OpenStep, Placed, Reroute, Role,
                                Route, StepCompleted, StepSealed, Switch, VersionLoaded)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class PolicyConfig:
    """What every mode is told about the run (never the durations it will meet)."""

    cells: tuple[str, ...]
    """The cells in switch order: the core first, then the satellites."""
    capacity: int
    """C_e: the executions one rollout cell serves at once."""
    groups_per_step: int
    """Groups (tasks) per burst."""
    group_size: int
    """Executions per group."""
    steps: int
    """Steps to train; the run is done when the last one is completed."""
    staleness: int = 1
    """S: burst k may be dispatched once every serving engine has loaded v_{k−S} or newer."""
    pool: int = 0
    """The standalone rollout pool's capacity in executions (engines that never train); 0: none."""

    def __post_init__(self) -> None:
        if not self.cells or len(set(self.cells)) != len(self.cells):
            raise ValueError(f"cells must be distinct and at least one: {self.cells!r}")
        if POOL in self.cells:
            raise ValueError(f"{POOL!r} names the standalone pool, not a cell")
        for name in ("capacity", "groups_per_step", "group_size", "steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.staleness < 0 or self.pool < 0:
            raise ValueError(f"staleness and pool must be >= 0, got {self.staleness}, {self.pool}")

    @property
    def executions_per_step(self) -> int:
        return self.groups_per_step * self.group_size

    def to_dict(self) -> dict:
        return dataclasses.asdict(self) | {"cells": list(self.cells)}


def execution_id(step: int, group: int, index: int) -> str:
    return f"s{step}-g{group}-e{index}"


class Policy:
    """The shared view and mechanics; a mode overrides `decide` (and `placeable`)."""

    mode: ClassVar[str] = ""

    def __init__(self, config: PolicyConfig) -> None:
        self.cfg = config
        self.t = 0.0
        cells = config.cells
        self.role: dict[str, Role] = {c: "idle" for c in cells}
        self.target: dict[str, Role] = {}  # cell -> the role it is switching to
        self.engines: tuple[str, ...] = ((POOL,) if config.pool else ()) + tuple(reversed(cells))
        """Placement order: the pool, then the cells that stay in rollout longest (satellites
        from the last; the core last)."""
        self.capacity = {c: config.capacity for c in cells} | ({POOL: config.pool} if config.pool else {})
        self.loaded: dict[str, int] = {POOL: 0} if config.pool else {}
        self.held: dict[str, set[str]] = {e: set() for e in self.engines}
        self.where: dict[str, str | None] = {}  # unfinished dispatched execution -> engine, None paused
        self.step_of: dict[str, int] = {}
        self.started_at: dict[str, float] = {}
        self.backlog: collections.deque[tuple[int, int, int]] = collections.deque()  # (step, group, index)
        self.paused: collections.deque[str] = collections.deque()
        self.released = 0  # bursts 0 .. released-1 passed the gate
        self.d = self.p = self.f = 0
        self.dispatched_in: collections.Counter[int] = collections.Counter()
        self.unfinished: dict[int, set[str]] = collections.defaultdict(set)  # step -> dispatched, not finished
        self.group_of: dict[str, int] = {}  # unfinished dispatched execution -> its group
        self.in_group: dict[tuple[int, int], set[str]] = collections.defaultdict(set)  # dispatched, not finished
        self.group_left: collections.Counter[tuple[int, int]] = collections.Counter()  # released, not finished
        self.recent_finishes: collections.deque[float] = collections.deque(maxlen=max(16, 2 * config.capacity))
        self.finished_in: collections.Counter[int] = collections.Counter()
        # the core's ledger, as facts tell it
        self.completed = 0  # steps 0 .. completed-1 are completed (policy version = completed)
        self.opened = -1  # the highest step opened for claims
        self.ready: collections.Counter[int] = collections.Counter()
        self.granted: collections.Counter[int] = collections.Counter()
        self.committed: collections.Counter[int] = collections.Counter()
        self.core_epoch = 0  # the newest epoch of the core's ledger facts
        self.sealed: dict[int, int] = {}  # step -> its micro-steps
        self.holding: dict[str, tuple[int, int, float]] = {}  # replica -> (step, micro-step, granted at)
        self.told_nothing: dict[str, int] = {}  # replica -> step it was told has nothing left
        # observations
        self.durations: list[float] = []  # finished executions (started -> finished), sorted
        self.switch_s: dict[tuple[str, str], list[float]] = {("rollout", "training"): [], ("training", "rollout"): []}
        self.microstep_s: list[float] = []
        self.finished_done = False

    # --- the view -------------------------------------------------------------------------

    def serving(self, engine: str) -> bool:
        """The engine serves rollouts now (a cell in rollout, not switching; or the pool)."""
        return engine == POOL or (self.role[engine] == "rollout" and engine not in self.target)

    def trainer(self, cell: str) -> bool:
        """The cell is a training replica now (in training, not switching)."""
        return self.role[cell] == "training" and cell not in self.target

    @property
    def water_level(self) -> int:
        """w(t) = d(t) − f(t)."""
        return self.d - self.f

    @property
    def rollout_capacity(self) -> int:
        """C_R(t): the capacity of the engines serving now."""
        return sum(self.capacity[e] for e in self.engines if self.serving(e))

    def free_slots(self, engine: str) -> int:
        return self.capacity[engine] - len(self.held[engine]) if self.serving(engine) else 0

    def claimable(self, step: int) -> int:
        """Micro-steps of `step` ready and not granted."""
        return self.ready[step] - self.granted[step]

    def nothing_left(self, step: int) -> bool:
        """DESIGN.md: the step is sealed and every micro-step is granted or committed."""
        return step in self.sealed and self.granted[step] >= self.sealed[step]

    def gate_open(self, burst: int) -> bool:
        """The staleness gate: every serving engine has loaded v_{burst−S} or newer."""
        return all(self.fresh(e, burst) for e in self.engines if self.serving(e))

    def fresh(self, engine: str, burst: int) -> bool:
        """`engine` has loaded v_{burst−S} or newer: it may serve executions of `burst`. The
        gate is checked at release over the engines serving then; an engine that starts
        serving later (a cell back from training, restored to the newest version it had heard
        of, which may be older than the newest published) must pass it too before it is
        given an execution of the burst, else which version samples a call would depend on
        which cell served it and when it came back."""
        return self.loaded.get(engine, -1) >= burst - self.cfg.staleness

    # --- facts ----------------------------------------------------------------------------

    def on(self, fact: Fact) -> list[Action]:
        """Consume one fact; return the actions it leads to (possibly none)."""
        if fact.t < self.t:
            raise ValueError(f"facts must come in clock order: {fact.t} after {self.t}")
        self.t = fact.t
        _HANDLERS[type(fact)](self, fact)
        if self.finished_done:
            return []
        if self.completed >= self.cfg.steps:
            # every cell ends serving the last version: a harness that talks to the proxy after
            # the last step (an evaluation, a long-lived deployment) still finds an engine
            self.finished_done = True
            training = [c for c in self.cfg.cells if self.target.get(c, self.role[c]) == "training"]
            back = self.switch(training, "rollout", "run done") if training else []
            return [*back, Done(steps=self.cfg.steps)]
        return self.decide()

    def _on_dispatched(self, fact: ExecutionDispatched) -> None:
        pass  # the policy's own dispatch, seen back on the bus: it counted it when it dispatched

    def _on_started(self, fact: ExecutionStarted) -> None:
        if fact.execution not in self.started_at:
            self.started_at[fact.execution] = fact.t
            self.p += 1

    def _on_finished(self, fact: ExecutionFinished) -> None:
        if fact.execution not in self.where:
            return  # redelivered
        engine = self.where.pop(fact.execution)
        if engine is None:
            self.paused.remove(fact.execution)
        else:
            self.held[engine].discard(fact.execution)
        self.f += 1
        step = self.step_of.pop(fact.execution, fact.step)
        self.finished_in[step] += 1
        self.unfinished[step].discard(fact.execution)
        group = self.group_of.pop(fact.execution, None)
        if group is not None:
            self.in_group[(step, group)].discard(fact.execution)
            self.group_left[(step, group)] -= 1
            if self.group_left[(step, group)] <= 0:
                del self.group_left[(step, group)]
                self.in_group.pop((step, group), None)
        self.recent_finishes.append(fact.t)
        started = self.started_at.pop(fact.execution, None)
        if started is not None:
            bisect.insort(self.durations, fact.t - started)

    def _on_scored(self, fact: ExecutionScored) -> None:
        pass  # the builder's business; the ledger facts tell the policy what is trainable

    def _on_ready(self, fact: MicrostepReady) -> None:
        self.ready[fact.step] += 1

    def _on_sealed(self, fact: StepSealed) -> None:
        self.sealed[fact.step] = fact.microsteps

    def _counts(self, fact: MicrostepGranted | MicrostepCommitted) -> bool:
        """Whether a ledger fact counts: one of an older core epoch does not; the first of a
        newer one (a restarted core trains every step not completed again, from scratch)
        clears the grants, commits and holdings of the steps not completed."""
        if fact.epoch < self.core_epoch:
            return False
        if fact.epoch > self.core_epoch:
            self.core_epoch = fact.epoch
            for counter in (self.granted, self.committed):
                for step in [k for k in counter if k >= self.completed]:
                    del counter[step]
            self.holding = {r: h for r, h in self.holding.items() if h[0] < self.completed}
        return True

    def _on_granted(self, fact: MicrostepGranted) -> None:
        if not self._counts(fact):
            return
        self.granted[fact.step] += 1
        self.holding[fact.replica] = (fact.step, fact.microstep, fact.t)

    def _on_committed(self, fact: MicrostepCommitted) -> None:
        if not self._counts(fact):
            return
        self.committed[fact.step] += 1
        held = self.holding.get(fact.replica)
        if held is not None and held[:2] == (fact.step, fact.microstep):
            del self.holding[fact.replica]
            self.microstep_s.append(fact.t - held[2])

    def _on_nothing(self, fact: NothingToClaim) -> None:
        self.told_nothing[fact.replica] = fact.step

    def _on_completed(self, fact: StepCompleted) -> None:
        if fact.step == self.completed:
            self.completed += 1

    def _on_switched(self, fact: CellSwitched) -> None:
        if fact.cell not in self.role:
            return
        self.role[fact.cell] = fact.to_role
        if self.target.get(fact.cell) == fact.to_role:
            del self.target[fact.cell]
        total = fact.durations.get("total_s")
        if total is not None and (fact.from_role, fact.to_role) in self.switch_s:
            self.switch_s[(fact.from_role, fact.to_role)].append(float(total))

    def _on_loaded(self, fact: VersionLoaded) -> None:
        self.loaded[fact.engine] = max(fact.version, self.loaded.get(fact.engine, -1))

    def _on_clock(self, fact: Clock) -> None:
        pass

    # --- decisions (a mode overrides decide) ----------------------------------------------

    def options(self) -> dict:
        """The mode's own settings, as `make_policy` takes them (a trace's header keeps them)."""
        return {}

    def decide(self) -> list[Action]:
        raise NotImplementedError

    def placeable(self, engine: str) -> bool:
        """Whether new executions may be placed on `engine` (async keeps its training cells empty)."""
        return True

    def release(self, upto: int) -> None:
        """Release bursts through `upto` (inclusive) while the staleness gate allows."""
        upto = min(upto, self.cfg.steps - 1)
        while self.released <= upto and self.gate_open(self.released):
            k = self.released
            self.backlog.extend((k, g, i) for g in range(self.cfg.groups_per_step) for i in range(self.cfg.group_size))
            for g in range(self.cfg.groups_per_step):
                self.group_left[(k, g)] = self.cfg.group_size
            self.released += 1

    def admit(self, limit: int | None = None) -> list[Action]:
        """Paused executions first, then the backlog in order, into free slots of placeable
        serving engines (in placement order) that have loaded a version the execution's burst
        may use (`fresh`); at most `limit` executions newly dispatched."""
        actions: list[Action] = []
        if not self.paused and not self.backlog:
            return actions
        routes: list[Route] = []
        placed: dict[int, list[Placed]] = {}
        budget = len(self.backlog) if limit is None else min(limit, len(self.backlog))
        for engine in self.engines:
            if not self.placeable(engine):
                continue
            free = self.free_slots(engine)
            held = self.held[engine]
            while free > 0 and self.paused and self.fresh(engine, self.step_of[self.paused[0]]):
                x = self.paused.popleft()
                self.where[x] = engine
                held.add(x)
                routes.append(Route(execution=x, engine=engine))
                free -= 1
            while free > 0 and budget > 0 and self.fresh(engine, self.backlog[0][0]):
                k, g, i = self.backlog.popleft()
                x = execution_id(k, g, i)
                self.where[x] = engine
                self.step_of[x] = k
                held.add(x)
                self.unfinished[k].add(x)
                self.group_of[x] = g
                self.in_group[(k, g)].add(x)
                placed.setdefault(k, []).append(Placed(execution=x, group=g, engine=engine))
                self.d += 1
                self.dispatched_in[k] += 1
                free -= 1
                budget -= 1
            if not self.paused and budget == 0:
                break
        if routes:
            actions.append(Reroute(routes=tuple(routes), reason="resume"))
        actions += [Dispatch(step=k, executions=tuple(v)) for k, v in sorted(placed.items())]
        return actions

    def switch(self, cells: str | list[str], to_role: Role, reason: str) -> list[Action]:
        """Start the switch of one cell, or of several at once, to `to_role`. Executions on a
        cell leaving rollout go to the serving engines that stay in rollout longest, and are
        paused where none has room (only colocate_overlapped lets that happen) or none has
        loaded a version their burst may use (`fresh`)."""
        cells = [cells] if isinstance(cells, str) else list(cells)
        from_roles = {c: self.target.get(c, self.role[c]) for c in cells}  # a switch in flight counts as done
        moving: list[str] = []
        for cell in cells:
            self.target[cell] = to_role
            if self.role[cell] == "rollout" and self.held[cell]:
                moving += sorted(self.held[cell])
                self.held[cell] = set()
        actions: list[Action] = []
        if moving:
            routes = []
            moving.reverse()
            for engine in self.engines:
                free = self.free_slots(engine)
                while free > 0 and moving and self.fresh(engine, self.step_of[moving[-1]]):
                    x = moving.pop()
                    self.where[x] = engine
                    self.held[engine].add(x)
                    routes.append(Route(execution=x, engine=engine))
                    free -= 1
            for x in reversed(moving):
                self.where[x] = None
                self.paused.append(x)
                routes.append(Route(execution=x, engine=None))
            actions.append(Reroute(routes=tuple(routes), reason=f"{'+'.join(cells)} to {to_role}"))
        actions += [Switch(cell=c, from_role=from_roles[c], to_role=to_role, reason=reason, step=self.completed)
                    for c in cells]
        return actions

    def open_step(self, step: int) -> list[Action]:
        if step <= self.opened or step >= self.cfg.steps:
            return []
        self.opened = step
        return [OpenStep(step=step)]

    def burst_finished(self, step: int) -> bool:
        return step < self.released and self.finished_in[step] >= self.cfg.executions_per_step


_HANDLERS = {
    ExecutionDispatched: Policy._on_dispatched,
    ExecutionStarted: Policy._on_started,
    ExecutionFinished: Policy._on_finished,
    ExecutionScored: Policy._on_scored,
    MicrostepReady: Policy._on_ready,
    StepSealed: Policy._on_sealed,
    MicrostepGranted: Policy._on_granted,
    MicrostepCommitted: Policy._on_committed,
    NothingToClaim: Policy._on_nothing,
    StepCompleted: Policy._on_completed,
    CellSwitched: Policy._on_switched,
    VersionLoaded: Policy._on_loaded,
    Clock: Policy._on_clock,
}
