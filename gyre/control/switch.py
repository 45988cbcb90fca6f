"""What a cell's switch means: the roles, what each holds, and the phases of a switch.

A cell is one long-lived process; a switch changes what it holds, never the process
(DESIGN.md "Cells and engines"). Roles (`schemas.cell.CellRole`):
- `idle`: before the cell has announced itself; it holds nothing.
- `rollout`: the cell's engine serves generation: its HTTP server answers and it keeps
  per-execution prefix KV caches.
- `training`: the cell's trainer replica claims micro-steps. The core cell's trainer (the
  authoritative model and the only AdamW state) lives from the core's start and is kept
  across switches; a satellite builds a trainer when it switches to training (its weights
  are pulled from the core's snapshot when it first claims) and frees it when it leaves.
The engine's weights stay loaded in every role, and its HTTP server stays bound (it
answers 503 while the cell does not serve).

A switch from role A to role B (`plan_switch`) runs three phases, in order:
- release: stop what A does (rollout: stop serving, hand the prefix KV of the executions the
  scheduler moved to their new cells, then drop the KV caches; training:
  stop claiming micro-steps, then, on a satellite, free its trainer);
- load: bring in what B needs (training: the trainer, when the cell has none yet;
  rollout: the newest published weights, when newer than the engine's);
- resume: start B's work (training: take micro-steps; rollout: serve).
The cell reports the measured `durations` of a switch in `cell.switched`.

Pure: no torch, no asyncio; the cell (handlers/cell.py) executes the plan's actions.
"""
from __future__ import annotations

import dataclasses
from typing import Literal

from schemas.cell import CellRole

SwitchAction = Literal["stop_serving", "move_kv", "flush_cache", "stop_training", "release_trainer", "load_trainer",
                       "load_weights", "start_training", "start_serving"]
"""One thing a cell does during a switch; see the module docstring for each."""


@dataclasses.dataclass(frozen=True, slots=True)
class SwitchPlan:
    """The actions of one switch, phase by phase (each phase's actions run in order)."""

    from_role: CellRole
    to_role: CellRole
    release: tuple[SwitchAction, ...]
    load: tuple[SwitchAction, ...]
    resume: tuple[SwitchAction, ...]


def plan_switch(from_role: CellRole, to_role: CellRole, *, core: bool) -> SwitchPlan:
    """The plan of a switch from `from_role` to `to_role` of a cell (`core`: the core cell,
    whose trainer outlives its switches). A switch to the role the cell has is empty."""
    if from_role == to_role:
        return SwitchPlan(from_role, to_role, (), (), ())
    release: tuple[SwitchAction, ...] = ()
    if from_role == "rollout":
        release = ("stop_serving", "move_kv", "flush_cache")
    elif from_role == "training":
        release = ("stop_training",) if core else ("stop_training", "release_trainer")
    load: tuple[SwitchAction, ...] = ()
    resume: tuple[SwitchAction, ...] = ()
    if to_role == "training":
        load, resume = ("load_trainer",), ("start_training",)
    elif to_role == "rollout":
        load, resume = ("load_weights",), ("start_serving",)
    return SwitchPlan(from_role, to_role, release, load, resume)


def durations(started: float, released: float, loaded: float, ended: float) -> dict[str, float]:
    """The `cell.switched` durations of a switch from the times (seconds, one monotonic
    clock) it started, finished its release, finished its load and ended: `release_s`,
    `load_s`, and `total_s` (all three phases)."""
    return {"release_s": released - started, "load_s": loaded - released, "total_s": ended - started}
