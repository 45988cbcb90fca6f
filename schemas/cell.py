"""Cell roles, switches and routing.

Ids: `<run>:cell:<cell>:switch:<seq>`, `<run>:cell:<cell>:switched:<seq>`,
`<run>:route:<seq>`.
"""
from __future__ import annotations

import dataclasses
from typing import ClassVar, Literal

from schemas.base import Event, fail, register

CellRole = Literal["rollout", "training", "idle"]


@register
@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class CellSwitch(Event):
    """Scheduler → cell: change role. seq: per-cell switch counter from 0."""

    NAME: ClassVar[str] = "cell.switch"
    cell: str
    seq: int
    from_role: CellRole
    to_role: CellRole
    reason: str
    step: int = 0

    def check(self) -> None:
        if self.from_role == self.to_role:
            fail(self, "to_role", "a switch must change the role")


@register
@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class CellSwitched(Event):
    """Cell: a switch finished (or a cell announced itself with seq -1 at start).

    durations: measured phase durations in seconds (e.g. `release_s`, `load_s`, `total_s`).
    engine_url: base URL of the cell's engine when its role is `rollout`, else ''.
    policy_version: version of the weights the cell holds now.
    bytes: what the switch freed and moved, in bytes (DESIGN.md "Cells and engines"; empty in
      events of cells that did not measure): `live_before` and `live_after`, the process's live
      tensor storage (gyre.serving.storage) before the switch and after it; `freed`, the
      storage the release phase freed (the state of the role left); `pulled_weights`, the
      weight snapshot bytes pulled through the transfer layer (a satellite's step weights, a
      returning engine's version); `pulled_kv`, the KV block bytes pulled for moved executions.
    """

    NAME: ClassVar[str] = "cell.switched"
    cell: str
    seq: int
    from_role: CellRole
    to_role: CellRole
    durations: dict
    engine_url: str = ""
    policy_version: int = 0
    bytes: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Route:
    """execution → cell assignment, with why it changed."""

    execution: str
    cell: str
    reason: str = "dispatch"


@register
@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class RouteUpdated(Event):
    """Scheduler → proxy: execution → cell assignments that changed."""

    NAME: ClassVar[str] = "route.updated"
    seq: int
    routes: tuple[Route, ...]
