"""Scheduling policy: which executions to dispatch, when cells switch role.

Pure: the policy consumes facts (`on_*` methods) and returns actions; the scheduler
daemon (handlers/scheduler.py) turns actions into events, and a simulator can drive
the very same object. Counters follow DESIGN.md "Elastic scheduling": d(t) dispatched,
f(t) finished, water level w(t) = d(t) − f(t).

Implemented mode: `colocate` (classic): every cell rolls out burst k; when the burst
has finished, every cell switches to training; when step k is completed, every cell
returns to rollout and burst k+1 is dispatched.

This is the policy the scheduler daemon runs today. Every mode, this one included, also
exists over the shared view of `gyre.control.policy` (`gyre.control.modes`,
`gyre.control.elastic`), which `gyre sim` drives; the daemons move to those next.
"""
from __future__ import annotations

import dataclasses
import random
from typing import Literal

CellRole = Literal["rollout", "training", "idle"]


@dataclasses.dataclass(frozen=True, slots=True)
class PlannedExecution:
    """One execution to launch: ids follow `s<step>-g<group>-e<index>`."""

    execution: str
    task: str
    group: str
    step: int
    group_size: int
    step_groups: int
    cell: str


@dataclasses.dataclass(frozen=True, slots=True)
class Dispatch:
    step: int
    executions: tuple[PlannedExecution, ...]


@dataclasses.dataclass(frozen=True, slots=True)
class Switch:
    cell: str
    from_role: CellRole
    to_role: CellRole
    reason: str
    step: int


@dataclasses.dataclass(frozen=True, slots=True)
class Done:
    steps: int


Action = Dispatch | Switch | Done


@dataclasses.dataclass
class ColocatePolicy:
    """Classic colocate: one burst per phase, all cells switch together.

    tasks: task ids to draw groups from (seeded shuffle, cycled).
    cells: cell ids; all start idle and must announce rollout before dispatch.
    """

    tasks: list[str]
    cells: list[str]
    steps: int
    groups_per_step: int
    group_size: int
    seed: int = 0
    step: int = 0
    phase: Literal["waiting", "rollout", "training", "returning", "done"] = "waiting"
    roles: dict[str, CellRole] = dataclasses.field(default_factory=dict)
    dispatched: dict[int, set[str]] = dataclasses.field(default_factory=dict)
    finished: dict[int, set[str]] = dataclasses.field(default_factory=dict)
    completed_steps: set[int] = dataclasses.field(default_factory=set)
    targets: dict[str, CellRole] = dataclasses.field(default_factory=dict)  # role last asked of each cell

    def __post_init__(self) -> None:
        if not self.tasks:
            raise ValueError("ColocatePolicy needs at least one task")
        if not self.cells:
            raise ValueError("ColocatePolicy needs at least one cell")
        for cell in self.cells:
            self.roles.setdefault(cell, "idle")
        self._order = list(self.tasks)
        random.Random(self.seed).shuffle(self._order)

    @property
    def water_level(self) -> int:
        """w(t) = d(t) − f(t) over every burst in flight."""
        d = sum(len(v) for v in self.dispatched.values())
        f = sum(len(v) for v in self.finished.values())
        return d - f

    def plan(self, step: int) -> Dispatch:
        """The burst of `step`: groups_per_step tasks × group_size executions."""
        rollout = [c for c in self.cells if self.roles[c] == "rollout"] or list(self.cells)
        executions = []
        for g in range(self.groups_per_step):
            task = self._order[(step * self.groups_per_step + g) % len(self._order)]
            for i in range(self.group_size):
                n = g * self.group_size + i
                executions.append(PlannedExecution(
                    execution=f"s{step}-g{g}-e{i}", task=task, group=f"s{step}-g{g}", step=step,
                    group_size=self.group_size, step_groups=self.groups_per_step, cell=rollout[n % len(rollout)]))
        return Dispatch(step=step, executions=tuple(executions))

    def _dispatch(self) -> list[Action]:
        burst = self.plan(self.step)
        self.dispatched[self.step] = {e.execution for e in burst.executions}
        self.finished.setdefault(self.step, set())
        self.phase = "rollout"
        return [burst]

    def on_cell_switched(self, cell: str, to_role: CellRole) -> list[Action]:
        """A cell reports its new role (or announces itself at start)."""
        if cell not in self.roles:
            return []
        self.roles[cell] = to_role
        all_rollout = all(r == "rollout" for r in self.roles.values())
        if self.phase in ("waiting", "returning") and all_rollout:
            if self.step >= self.steps:
                self.phase = "done"
                return [Done(steps=self.steps)]
            return self._dispatch()
        return []

    def on_execution_finished(self, step: int, execution: str) -> list[Action]:
        """An execution of burst `step` ended (any status). Idempotent."""
        self.finished.setdefault(step, set()).add(execution)
        if (self.phase == "rollout" and step == self.step
                and self.finished[step] >= self.dispatched.get(step, set())):
            self.phase = "training"
            switches = [Switch(cell=c, from_role="rollout", to_role="training", reason="burst finished", step=step)
                        for c in self.cells if self.roles[c] == "rollout"]
            for sw in switches:
                self.targets[sw.cell] = "training"
            return switches
        return []

    def on_step_completed(self, step: int) -> list[Action]:
        """The optimizer step of `step` was applied: return cells to rollout."""
        if step in self.completed_steps or step != self.step:
            return []
        self.completed_steps.add(step)
        self.step = step + 1
        self.phase = "returning"
        # Every cell that was sent to training returns, also one whose `cell.switched`
        # has not arrived yet (a step can complete while that event is in flight).
        switches = [Switch(cell=c, from_role="training", to_role="rollout", reason="step completed", step=step)
                    for c in self.cells if self.targets.get(c) == "training"]
        for sw in switches:
            self.targets[sw.cell] = "rollout"
        return switches
