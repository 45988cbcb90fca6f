"""Which engine serves an execution's call (`Router`), and the cut of requests in flight
when their cell leaves rollout or their execution is moved (`Attempt`, `race`).

Contract (DESIGN.md "Elastic scheduling": a switch is harness-preserving):
- `pick(execution, avoid)` → (cell, engine URL) or None: the scheduler's route wins, then
  the sticky cell, then the least-loaded rollout cell (cells in `avoid` only when nothing
  else is left), then the static engine. A route to no cell ('') pauses the execution: None
  until a later route names a cell.
- `handle_cell_switched`: a cell that leaves rollout (or changes URL) is dropped and every
  `Attempt` running there is cut (reason `evicted`).
- `handle_route_updated`: the scheduler moved executions (it does so before it switches
  their cell): each moved execution's attempts running elsewhere than its new cell are cut
  at once (reason `rerouted`), so the caller aborts them upstream and retries at the
  destination. An execution moved away from the cell that served it last has its prefix KV
  cache there: until one of its calls is answered, `kv_hint` names that cell and the route
  (`gyre_kv_from` of `/generate`), so the destination's engine holds the request until the
  KV blocks the old cell offers are imported (handlers.transfer.kv_move). A paused
  execution's KV is dropped: no hint.
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
from collections.abc import Coroutine
from typing import Any

from handlers.engines.client import EngineClient
from schemas.cell import CellSwitched, RouteUpdated


@dataclasses.dataclass(slots=True, eq=False)
class Attempt:
    """The engine request in flight for a call (for aborting it upstream). `evicted` turns
    True, and `task` (the call's task, while `race` awaits the request) is cancelled, when
    the router cuts it: `reason` says why (`evicted`: its cell left rollout; `rerouted`: its
    execution was moved to another cell)."""

    client: EngineClient | None = None
    rid: str = ""
    cell: str = ""
    execution: str = ""
    evicted: bool = False
    reason: str = ""
    task: asyncio.Task | None = None
    cancel_owed: bool = False
    """The router cancelled `task` for this eviction and `race` has not taken it back yet."""


class Router:
    """Which engine serves an execution: rollout cells, scheduler routes, stickiness.

    cells: rollout cell → engine URL. routes: execution → cell from `route.updated` ('' =
    paused). sticky: execution → cell it was last sent to (or moved to). inflight: cell →
    engine requests running there; running: execution → its requests in flight. kv_from:
    execution → (cell holding its prefix KV, route seq that moved it), until a call of it is
    answered. Waiters are woken on every change.
    """

    def __init__(self, static_url: str = "", static_cell: str = "static"):
        self.static_url = static_url
        self.static_cell = static_cell
        self.cells: dict[str, str] = {}
        self.routes: dict[str, str] = {}
        self.sticky: dict[str, str] = {}
        self._load: collections.Counter[str] = collections.Counter()
        """cell → executions sticky to it (`load`), kept with `sticky`: counting them on
        every pick took 6 ms of the event loop at 20,000 live executions on 16 cells."""
        self.inflight: dict[str, set[Attempt]] = {}
        self.running: dict[str, set[Attempt]] = {}
        self.kv_from: dict[str, tuple[str, int]] = {}
        self._changed = asyncio.Event()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def wake(self) -> None:
        """Wake every call waiting for a change (`wait_changed`) without one."""
        self._notify()

    @staticmethod
    def _cut(attempts, reason: str) -> None:
        for attempt in list(attempts):
            attempt.evicted = True
            attempt.reason = reason
            if attempt.task is not None and not attempt.cancel_owed:
                attempt.cancel_owed = True
                attempt.task.cancel()

    def handle_cell_switched(self, event: CellSwitched) -> None:
        old = self.cells.get(event.cell)
        if event.to_role == "rollout" and event.engine_url:
            self.cells[event.cell] = event.engine_url
            if old is not None and old != event.engine_url:
                self._cut(self.inflight.pop(event.cell, ()), "evicted")
        else:
            self.cells.pop(event.cell, None)
            self._cut(self.inflight.pop(event.cell, ()), "evicted")
        self._notify()

    def handle_route_updated(self, event: RouteUpdated) -> None:
        for route in event.routes:
            execution, cell = route.execution, route.cell
            self.routes[execution] = cell
            held = self.sticky.get(execution)
            if held is not None and held != cell:  # moved away from the cell that holds its KV
                if cell:
                    self.kv_from[execution] = (held, event.seq)
                    self._stick(execution, cell)
                else:
                    self.kv_from.pop(execution, None)
                    self._unstick(execution)
            self._cut([a for a in self.running.get(execution, ()) if a.cell != cell], "rerouted")
        self._notify()

    def kv_hint(self, execution: str, cell: str) -> dict | None:
        """`gyre_kv_from` for a request of `execution` sent to `cell` (module docstring)."""
        held = self.kv_from.get(execution)
        if held is None or held[0] == cell:
            return None
        return {"cell": held[0], "route": held[1]}

    def answered(self, execution: str) -> None:
        """A call of `execution` was answered: its KV is where it ran."""
        self.kv_from.pop(execution, None)

    def track(self, attempt: Attempt) -> None:
        self.inflight.setdefault(attempt.cell, set()).add(attempt)
        self.running.setdefault(attempt.execution, set()).add(attempt)

    def untrack(self, attempt: Attempt) -> None:
        for index, key in ((self.inflight, attempt.cell), (self.running, attempt.execution)):
            running = index.get(key)
            if running is not None:
                running.discard(attempt)
                if not running:
                    del index[key]

    def load(self, cell: str) -> int:
        """Executions sticky to `cell`."""
        return self._load[cell]

    def _stick(self, execution: str, cell: str) -> None:
        old = self.sticky.get(execution)
        if old == cell:
            return
        if old is not None:
            self._load[old] -= 1
        self.sticky[execution] = cell
        self._load[cell] += 1

    def _unstick(self, execution: str) -> None:
        old = self.sticky.pop(execution, None)
        if old is not None:
            self._load[old] -= 1
            if not self._load[old]:
                del self._load[old]

    def forget(self, execution: str) -> None:
        """Drop a finished execution's sticky cell, route and KV hint."""
        self._unstick(execution)
        self.routes.pop(execution, None)
        self.kv_from.pop(execution, None)

    def pick(self, execution: str, avoid: frozenset[str] = frozenset()) -> tuple[str, str] | None:
        """(cell, engine URL) for `execution`, or None when no engine is known or it is
        paused (module docstring)."""
        if self.cells:
            route = self.routes.get(execution)
            if route == "":
                return None
            usable = [c for c in self.cells if c not in avoid] or list(self.cells)
            choice = None
            for preferred in (route, self.sticky.get(execution)):
                if preferred in usable:
                    choice = preferred
                    break
            if choice is None:
                choice = min(usable, key=lambda c: (self.load(c), c))
            self._stick(execution, choice)
            return choice, self.cells[choice]
        if self.static_url:
            return self.static_cell, self.static_url
        return None

    async def wait_changed(self, timeout_s: float) -> None:
        try:
            await asyncio.wait_for(self._changed.wait(), timeout_s)
        except asyncio.TimeoutError:
            pass


async def race(coro: Coroutine[Any, Any, Any], attempt: Attempt) -> Any:
    """The result of `coro`, awaited in the calling task, or None when the router evicts
    `attempt` first: the router cancels the calling task (`Attempt.cancel_owed`) and `race`
    takes that one cancellation back (`Task.uncancel`, as `asyncio.timeout` does) on every
    way out, so `coro` is cancelled and the caller goes on. Any other cancellation (the
    harness went away) propagates, also when it coincides with an eviction. No task of its
    own: a call's engine request costs no extra task and event-loop round."""
    if attempt.evicted:
        coro.close()
        return None
    task = attempt.task = asyncio.current_task()
    base = task.cancelling()
    try:
        return await coro
    except asyncio.CancelledError:
        if _take_back(task, attempt) and task.cancelling() == base:
            return None  # only the router's cancellation
        raise
    finally:
        attempt.task = None
        _take_back(task, attempt)  # `coro` absorbed it, or turned it into another error


def _take_back(task: asyncio.Task, attempt: Attempt) -> bool:
    if not attempt.cancel_owed:
        return False
    attempt.cancel_owed = False
    task.uncancel()
    return True
