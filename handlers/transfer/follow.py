"""An engine that follows `weights.published` while it serves (DESIGN.md "Weight publication").

`EngineWeights` belongs to a cell: `published(event)` records the newest version and, while
`serving()` says so, starts loading it in the background; `load(event)` pulls the snapshot
through the transfer backend (which verifies every tensor against the manifest the event
names), loads it into the engine between two decode steps (requests in flight continue,
their version spans show the switch) and only then publishes `weights.loaded`.

A pull that fails, is short, times out, is cancelled (a newer version superseded it) or does
not verify, and a snapshot the engine refuses (names, shapes), yield no `weights.loaded`: the
engine keeps serving the version it has, the error (naming the tensor where one is at fault)
is logged as `cell.weights.refused`, and the version is tried again, at most `attempts`
times, unless a newer one arrives.

A cell leaving rollout `halt`s the following (no load runs in the engine once it returns) and
releases the engine; on its way back, `restore(latest)` loads the newest published version
into the released engine before it serves: pulled and verified as above (a released engine
loads whatever the version), else, when the snapshot cannot be had, the checkpoint the core
wrote of that version, else (nothing published yet) the run's initial model. `pulled_bytes`
counts the snapshot bytes pulled.
"""
from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable

import structlog

import schemas
from gyre.serving.engine import WeightLoadError
from gyre.serving.host import EngineHost
from gyre.transfer.interface import TransferBackend, TransferError, TransferRef
from schemas import ids

log = structlog.get_logger()


class EngineWeights:
    """The weights an engine serves, following the published ones (module docstring).

    publish: stores an event on the bus (`Bus.publish`). serving: whether the cell serves now.
    """

    def __init__(self, *, run: str, cell: str, engine: EngineHost, transfer: TransferBackend,
                 publish: Callable[[schemas.WeightsLoaded], Awaitable[object]], serving: Callable[[], bool],
                 attempts: int = 3, retry_s: float = 0.2) -> None:
        self.run = run
        self.cell = cell
        self.engine = engine
        self.transfer = transfer
        self.publish = publish
        self.serving = serving
        self.attempts = attempts
        self.retry_s = retry_s
        self.latest: schemas.WeightsPublished | None = None
        self.refused: list[tuple[int, str]] = []
        """(policy version, error) of every refused load, oldest first."""
        self._lock = asyncio.Lock()
        self._task: asyncio.Task | None = None
        self._pulling: tuple[schemas.WeightsPublished, threading.Event] | None = None
        self._loading: asyncio.Future | None = None
        self.pulled_bytes = 0
        """Bytes of the snapshots pulled, over the cell's life."""

    def published(self, event: schemas.WeightsPublished) -> None:
        """A `weights.published` fact (replayed or live): remember the newest, and load it
        while serving; a pull of an older version in flight is cancelled."""
        latest = self.latest
        if latest is None or (event.policy_version, event.epoch) > (latest.policy_version, latest.epoch):
            self.latest = event
        if event is not self.latest or not event.key or not self.serving():
            return
        pulling = self._pulling
        if pulling is not None and pulling[0].policy_version < event.policy_version:
            pulling[1].set()
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self.follow())

    async def follow(self) -> None:
        """Load the newest published version until the engine serves it, or give up on it."""
        failed: dict[tuple[int, int], int] = {}
        while self.serving():
            target = self.latest
            if target is None or not target.key or target.policy_version <= self.engine.version:
                return
            where = (target.policy_version, target.epoch)
            if failed.get(where, 0) >= self.attempts:
                return
            if not await self.load(target):
                failed[where] = failed.get(where, 0) + 1
                await asyncio.sleep(self.retry_s * failed[where])

    async def load(self, event: schemas.WeightsPublished, cancel: threading.Event | None = None) -> bool:
        """Pull, verify and load `event`'s snapshot, then publish `weights.loaded`. False, the
        engine untouched and nothing published, when any of it fails."""
        async with self._lock:
            if event.policy_version <= self.engine.version and not self.engine.released:
                return True
            cancel = cancel or threading.Event()
            self._pulling = (event, cancel)
            started = time.perf_counter()
            try:
                tensors = await asyncio.to_thread(self.transfer.pull, TransferRef(event.key, event.digest),
                                                  self.cell, cancel)
                self.pulled_bytes += sum(t.nbytes for t in tensors.values())
                self._loading = asyncio.ensure_future(asyncio.to_thread(self.engine.load_tensors, tensors,
                                                                        event.policy_version))
                del tensors
                await asyncio.shield(self._loading)  # a cancelled follower still lets the load finish (`halt`)
            except (TransferError, WeightLoadError) as exc:
                self.refused.append((event.policy_version, str(exc)))
                log.error("cell.weights.refused", cell=self.cell, policy_version=event.policy_version,
                          serving=self.engine.version, error=str(exc))
                return False
            finally:
                self._pulling = None
            await self.publish(schemas.WeightsLoaded(
                event_id=ids.loaded(self.run, self.cell, event.policy_version, event.epoch), cell=self.cell,
                policy_version=event.policy_version, epoch=event.epoch, digest=event.digest, role="rollout"))
            log.info("cell.weights.loaded", cell=self.cell, policy_version=event.policy_version,
                     seconds=round(time.perf_counter() - started, 4))
            return True

    async def halt(self) -> None:
        """Stop following and return once no load runs in the engine (a cell releasing it)."""
        self.stop()
        for waited in (self._task, self._loading):
            if waited is not None:
                await asyncio.wait([waited])
                if not waited.cancelled():
                    waited.exception()  # retrieved: a failed load was logged by the follower, or is moot

    async def restore(self, latest: schemas.WeightsPublished | None, initial: tuple[str, int]) -> None:
        """Load the newest published version `latest` into a released engine (module
        docstring); `initial`: the run's initial model and its version, for when nothing was
        published. Raises WeightLoadError (OSError) when no source loads."""
        if latest is not None and latest.key:
            for attempt in range(self.attempts):
                if await self.load(latest):
                    return
                await asyncio.sleep(self.retry_s * (attempt + 1))
        path, version = (latest.path, latest.policy_version) if latest is not None else initial
        await asyncio.to_thread(self.engine.load_weights, path, version)
        log.info("cell.weights.restored", cell=self.cell, policy_version=version, path=str(path))

    def stop(self) -> None:
        """Cancel a pull in flight and stop following."""
        if self._pulling is not None:
            self._pulling[1].set()
        if self._task is not None:
            self._task.cancel()
