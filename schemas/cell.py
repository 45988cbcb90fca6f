"""Cell roles, switches, routing, and the KV blocks that move with rerouted executions.

Ids: `<run>:cell:<cell>:switch:<seq>`, `<run>:cell:<cell>:switched:<seq>`,
`<run>:route:<seq>`, `<run>:cell:<cell>:kv:<seq>:offered:<hash>`,
`<run>:cell:<cell>:kv:<offer id>:<execution>:pulled` (schemas.ids).
"""
from __future__ import annotations

import dataclasses
from typing import ClassVar, Literal

from schemas.base import Event, fail, register

CellRole = Literal["rollout", "training", "idle"]


@register
@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class CellSwitch(Event):
    """Scheduler → cell: change role. seq: per-cell switch counter from 0.

    moved: where the executions that leave this cell go (execution → cell, '' = paused), the
    routes of the `route.updated` published just before (its seq `route_seq`, -1 = none): a
    cell leaving rollout offers their prefix KV blocks to those cells (`kv.offered`).
    """

    NAME: ClassVar[str] = "cell.switch"
    cell: str
    seq: int
    from_role: CellRole
    to_role: CellRole
    reason: str
    step: int = 0
    moved: tuple[Route, ...] = ()
    route_seq: int = -1

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
      returning engine's version); `pulled_kv`, the prefix KV block bytes of the moved executions
      that their destinations pulled and verified (`kv.pulled`).
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


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class KvBlock:
    """One moved execution's prefix KV cache, exposed by its old cell as a transfer snapshot
    (gyre.serving.kv.to_snapshot). to_cell: the cell it moves to. key, digest: the snapshot's
    transfer key and manifest digest. tokens: positions it covers. bytes: the snapshot's size.
    policy_version: the weights that computed it."""

    execution: str
    to_cell: str
    key: str
    digest: str
    tokens: int
    bytes: int
    policy_version: int


@register
@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class KvOffered(Event):
    """Cell leaving rollout → the cells its executions moved to: pull these blocks (pinned
    until each destination answers with `kv.pulled`, or a lease runs out). seq: the source's
    switch; route_seq: the `route.updated` that moved the executions (the proxy names it to
    the destination's engine, which holds the moved execution's next request until its block
    is imported). An execution with no block (none kept) is not listed."""

    NAME: ClassVar[str] = "kv.offered"
    cell: str
    seq: int
    route_seq: int
    blocks: tuple[KvBlock, ...] = ()


@register
@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class KvPulled(Event):
    """Destination → source: one offered block is done with (the source may free it). offer:
    the `kv.offered` event id. bytes: bytes pulled and verified (0: the pull failed). tokens:
    positions imported into the engine (0: not imported: another policy version computed
    them, or the pull failed; `error` says why)."""

    NAME: ClassVar[str] = "kv.pulled"
    cell: str
    source: str
    offer: str
    execution: str
    bytes: int = 0
    tokens: int = 0
    error: str = ""
