"""What a cell's switch means: the roles, what each holds, and the phases of a switch.

A cell is one long-lived process; a switch changes what it holds, never the process
(DESIGN.md "Cells and engines"). Roles (`schemas.cell.CellRole`) and what each holds:
- `idle`: before the cell has announced itself; it holds nothing.
- `rollout`: the engine's weights and its per-execution prefix KV caches; its HTTP server
  answers. No trainer state: a satellite holds no trainer, and the core's trainer is
  offloaded to disk (its newest checkpoint plus the gradient of the step in flight), restored
  only for the moments it must add a satellite's contribution or apply a step.
- `training`: the trainer's weights and gradient (the core's also the only AdamW state); the
  trainer replica claims micro-steps. No engine state: the engine's weights and KV caches are
  freed, and its HTTP server, still bound, answers 503.

A switch from role A to role B (`plan_switch`) runs three phases, in order:
- release: stop what A does and free what A holds. Leaving rollout: `stop_serving` (new
  requests get 503), then `move_kv` (the prefix KV of the executions the scheduler moved is
  handed to their new cells: offered, pulled, freed once confirmed; before the release,
  which frees every KV cache), then `release_engine` (calls in flight are aborted, the
  weights and every KV cache freed). Leaving training: `stop_training` (a satellite returns
  its contribution), then `offload_trainer` (the core: state to disk, trainer freed) or
  `release_trainer` (a satellite: its trainer freed);
- load: bring in what B needs. Training: `restore_trainer` (the core: from disk, optimizer
  state included) or `load_trainer` (a satellite: a trainer, and the weights of the step in
  flight, pulled from the core's snapshot); rollout: `restore_engine` (the newest published
  version, loaded into the released engine whatever its version, before any request);
- resume: start B's work (`start_training`: take micro-steps; `start_serving`: serve).
The cell reports the measured `durations` of a switch in `cell.switched`, and its `bytes`:
the tensor storage freed by the release, the snapshot bytes pulled and the KV bytes the
destinations pulled.

Pure: no torch, no asyncio; the cell (handlers/cell.py) executes the plan's actions.
"""
from __future__ import annotations

import dataclasses
from typing import Literal

from schemas.cell import CellRole

SwitchAction = Literal["stop_serving", "move_kv", "release_engine", "stop_training", "offload_trainer",
                       "release_trainer", "restore_trainer", "load_trainer", "restore_engine", "start_training",
                       "start_serving"]
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
    whose trainer outlives its switches on disk). A switch to the role the cell has is empty."""
    if from_role == to_role:
        return SwitchPlan(from_role, to_role, (), (), ())
    release: tuple[SwitchAction, ...] = ()
    if from_role == "rollout":
        release = ("stop_serving", "move_kv", "release_engine")
    elif from_role == "training":
        release = ("stop_training", "offload_trainer" if core else "release_trainer")
    load: tuple[SwitchAction, ...] = ()
    resume: tuple[SwitchAction, ...] = ()
    if to_role == "training":
        load, resume = ("restore_trainer" if core else "load_trainer",), ("start_training",)
    elif to_role == "rollout":
        load, resume = ("restore_engine",), ("start_serving",)
    return SwitchPlan(from_role, to_role, release, load, resume)


def durations(started: float, released: float, loaded: float, ended: float) -> dict[str, float]:
    """The `cell.switched` durations of a switch from the times (seconds, one monotonic
    clock) it started, finished its release, finished its load and ended: `release_s`,
    `load_s`, and `total_s` (all three phases)."""
    return {"release_s": released - started, "load_s": loaded - released, "total_s": ended - started}
