"""Routing of the proxy's calls to engines: rollout cells, scheduler routes, stickiness,
and eviction of in-flight requests whose cell leaves rollout.

Contract: `Router.pick(execution, avoid)` → (cell, engine URL) or None; the scheduler's
route wins, then the sticky cell, then the least-loaded rollout cell (cells in `avoid`
only when nothing else is left), then the static engine. `handle_cell_switched` removes a
cell that leaves rollout (or changes URL) and sets `evicted` on every `Attempt` tracked
there, so the caller cancels it, aborts it upstream and retries elsewhere.
"""
from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Coroutine
from typing import Any

from handlers.engine_client import EngineClient
from schemas.call import SamplingParams
from schemas.cell import CellSwitched, RouteUpdated


@dataclasses.dataclass(slots=True, eq=False)
class Attempt:
    """The engine request in flight for a call (for aborting it upstream). `evicted` turns
    True, and `task` (the call's task, while `race` awaits the request) is cancelled, when
    its cell leaves rollout while the request runs."""

    client: EngineClient | None = None
    rid: str = ""
    cell: str = ""
    evicted: bool = False
    task: asyncio.Task | None = None
    cancel_owed: bool = False
    """The router cancelled `task` for this eviction and `race` has not taken it back yet."""


class Router:
    """Which engine serves an execution: rollout cells, scheduler routes, stickiness.

    cells: rollout cell → engine URL. routes: execution → cell from `route.updated`.
    sticky: execution → cell it was last sent to. inflight: cell → engine requests running
    there (evicted when the cell leaves rollout or moves). Waiters are woken on every change.
    """

    def __init__(self, static_url: str = "", static_cell: str = "static"):
        self.static_url = static_url
        self.static_cell = static_cell
        self.cells: dict[str, str] = {}
        self.routes: dict[str, str] = {}
        self.sticky: dict[str, str] = {}
        self.inflight: dict[str, set[Attempt]] = {}
        self._changed = asyncio.Event()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def _evict(self, cell: str) -> None:
        for attempt in self.inflight.pop(cell, ()):
            attempt.evicted = True
            if attempt.task is not None and not attempt.cancel_owed:
                attempt.cancel_owed = True
                attempt.task.cancel()

    def handle_cell_switched(self, event: CellSwitched) -> None:
        old = self.cells.get(event.cell)
        if event.to_role == "rollout" and event.engine_url:
            self.cells[event.cell] = event.engine_url
            if old is not None and old != event.engine_url:
                self._evict(event.cell)
        else:
            self.cells.pop(event.cell, None)
            self._evict(event.cell)
        self._notify()

    def handle_route_updated(self, event: RouteUpdated) -> None:
        for route in event.routes:
            self.routes[route.execution] = route.cell
        self._notify()

    def track(self, attempt: Attempt) -> None:
        self.inflight.setdefault(attempt.cell, set()).add(attempt)

    def untrack(self, attempt: Attempt) -> None:
        running = self.inflight.get(attempt.cell)
        if running is not None:
            running.discard(attempt)
            if not running:
                del self.inflight[attempt.cell]

    def load(self, cell: str) -> int:
        return sum(1 for c in self.sticky.values() if c == cell)

    def pick(self, execution: str, avoid: frozenset[str] = frozenset()) -> tuple[str, str] | None:
        """(cell, engine URL) for `execution`, or None when no engine is known.

        Order: the scheduler's route, the sticky cell, the least-loaded rollout cell (cells
        in `avoid` only when nothing else is left), then the static engine.
        """
        if self.cells:
            usable = [c for c in self.cells if c not in avoid] or list(self.cells)
            choice = None
            for preferred in (self.routes.get(execution), self.sticky.get(execution)):
                if preferred in usable:
                    choice = preferred
                    break
            if choice is None:
                choice = min(usable, key=lambda c: (self.load(c), c))
            self.sticky[execution] = choice
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


def engine_sampling(sp: SamplingParams) -> dict:
    """SGLang `sampling_params` for recorded SamplingParams."""
    return {"temperature": sp.temperature, "top_p": sp.top_p, "top_k": sp.top_k, "max_new_tokens": sp.max_tokens}
