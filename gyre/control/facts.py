"""What a scheduling policy consumes (facts) and what it returns (actions).

A policy (`gyre.control.policy.Policy`) is fed facts one at a time, in the order the
scheduler learned them, and answers each with a list of actions. Every fact carries `t`,
the scheduler's clock in seconds (monotonic, any origin; the simulator starts at 0): the
policy never reads a clock of its own, so the same facts give the same actions, which is
what makes a trace (`gyre.control.trace`) replayable.

Facts name the bus events they stand for (DESIGN.md "Subjects, streams, events"); `Clock`
is the scheduler's timer. Actions are what the scheduler daemon publishes (`Dispatch` →
`execution.dispatched`, `Route` → `route.updated`, `Switch` → `cell.switch`) or tells the
core's ledger (`OpenStep`). A switch back to rollout is the *return* of DESIGN.md.

Every class has `KIND`, its name in a trace line; `KINDS` maps names to classes.
"""
from __future__ import annotations

import dataclasses
from typing import ClassVar, Literal

Role = Literal["idle", "rollout", "training"]
"""A cell's role (`schemas.cell.CellRole`); `idle` before a cell announced itself."""

POOL = "pool"
"""The engine name of the standalone rollout pool, when one is declared."""


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Fact:
    """Base of every fact. t: the scheduler's clock when it learned the fact, seconds."""

    KIND: ClassVar[str] = ""
    t: float


# --- facts ------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ExecutionDispatched(Fact):
    """`execution.dispatched` seen back on the bus: the runner was given the execution on
    `cell`. The policy counted it when it dispatched it; this fact only confirms it."""

    KIND: ClassVar[str] = "execution.dispatched"
    execution: str
    step: int
    cell: str


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ExecutionStarted(Fact):
    """`execution.started`: the runner launched the harness."""

    KIND: ClassVar[str] = "execution.started"
    execution: str
    step: int


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ExecutionFinished(Fact):
    """`execution.finished`: the harness ended (`ok`, `timeout` or `harness_error`)."""

    KIND: ClassVar[str] = "execution.finished"
    execution: str
    step: int
    status: str = "ok"


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ExecutionScored(Fact):
    """`execution.scored`: a reward (or an exclusion) arrived for the execution."""

    KIND: ClassVar[str] = "execution.scored"
    execution: str
    step: int


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class MicrostepReady(Fact):
    """`microstep.ready`: the builder announced micro-step `microstep` of `step`."""

    KIND: ClassVar[str] = "microstep.ready"
    step: int
    microstep: int


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class StepSealed(Fact):
    """`step.sealed`: every group of `step` is in; it has `microsteps` micro-steps and
    `executions` executions (|E| after exclusions)."""

    KIND: ClassVar[str] = "step.sealed"
    step: int
    microsteps: int
    executions: int


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class MicrostepGranted(Fact):
    """`microstep.granted`: the core's ledger granted the micro-step to `replica` (a cell)."""

    KIND: ClassVar[str] = "microstep.granted"
    step: int
    microstep: int
    replica: str
    epoch: int = 0
    """The core's epoch (raised at each core start): facts of an older epoch count for nothing."""


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class MicrostepCommitted(Fact):
    """`microstep.committed`: the core committed the micro-step trained by `replica`."""

    KIND: ClassVar[str] = "microstep.committed"
    step: int
    microstep: int
    replica: str
    epoch: int = 0
    """The core's epoch (raised at each core start): facts of an older epoch count for nothing."""


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class NothingToClaim(Fact):
    """The ledger answered `replica`'s claim with "nothing left to claim": `step` is sealed
    and every one of its micro-steps is granted or committed."""

    KIND: ClassVar[str] = "microstep.nothing"
    step: int
    replica: str


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class StepCompleted(Fact):
    """`step.completed`: the optimizer step of `step` was applied; policy version step+1 exists."""

    KIND: ClassVar[str] = "step.completed"
    step: int


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class CellSwitched(Fact):
    """`cell.switched`: `cell` is now in `to_role`. durations: the measured phases, seconds
    (`total_s` at least). A cell announcing itself at start switches from `idle`."""

    KIND: ClassVar[str] = "cell.switched"
    cell: str
    from_role: Role
    to_role: Role
    durations: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class VersionLoaded(Fact):
    """`weights.loaded`: `engine` (a cell, or `pool`) verified and serves (or, a satellite in
    training, holds) policy version `version`."""

    KIND: ClassVar[str] = "weights.loaded"
    engine: str
    version: int


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Clock(Fact):
    """The scheduler's timer fired at `t` (nothing else happened)."""

    KIND: ClassVar[str] = "clock"


# --- actions ----------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Placed:
    """One execution and the engine it runs on. Ids follow `s<step>-g<group>-e<index>`."""

    execution: str
    group: int
    engine: str


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Action:
    KIND: ClassVar[str] = ""


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Dispatch(Action):
    """Launch these executions of burst `step`, each on its engine (admission: an engine
    never holds more than its capacity)."""

    KIND: ClassVar[str] = "dispatch"
    step: int
    executions: tuple[Placed, ...]


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Route:
    """Move a running execution to `engine`; `engine` None pauses it (no rollout engine
    holds it until a later route)."""

    execution: str
    engine: str | None


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Reroute(Action):
    """`route.updated`: these executions move (a switch takes their engine away, or paused
    executions resume)."""

    KIND: ClassVar[str] = "route"
    routes: tuple[Route, ...]
    reason: str


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Switch(Action):
    """`cell.switch`: `cell` changes role (to `rollout`: the return). step: the step the
    policy is at (the oldest one not completed)."""

    KIND: ClassVar[str] = "switch"
    cell: str
    from_role: Role
    to_role: Role
    reason: str
    step: int


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class OpenStep(Action):
    """The core's ledger may grant the micro-steps of `step` (the one after the last
    completed step) to replicas that claim them."""

    KIND: ClassVar[str] = "open"
    step: int


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Done(Action):
    """Every step of the run is completed."""

    KIND: ClassVar[str] = "done"
    steps: int


FACTS: tuple[type[Fact], ...] = (ExecutionDispatched, ExecutionStarted, ExecutionFinished, ExecutionScored,
                                 MicrostepReady, StepSealed, MicrostepGranted, MicrostepCommitted, NothingToClaim,
                                 StepCompleted, CellSwitched, VersionLoaded, Clock)
ACTIONS: tuple[type[Action], ...] = (Dispatch, Reroute, Switch, OpenStep, Done)
KINDS: dict[str, type] = {cls.KIND: cls for cls in (*FACTS, *ACTIONS)}
