"""KV blocks that move with rerouted executions (DESIGN.md "Elastic scheduling", "Cells
and engines"): a cell leaving rollout hands the prefix KV cache of each execution the
scheduler moved to the cell it moved to, so that cell's next call of it prefills only
new tokens.

`KvMoves` belongs to a cell; it plays both parts.

The old cell (`offer(switch)`, the switch's `move_kv` action, after the engine stopped
taking requests and before it is released, which frees every KV cache):
1. aborts the requests its engine still runs (the proxy retries them at the execution's
   new cell) and waits until they ended, so each one's prefix is back in the cache
   (`EngineHost.drain`);
2. exports the prefix KV of every execution in `CellSwitch.moved` that goes to another
   cell (`EngineHost.export_kv`), exposes each as a snapshot through the transfer backend
   (`gyre.serving.kv.to_snapshot`: pinned until withdrawn) and publishes `kv.offered`,
   each block naming its destination (an offer without blocks too: it tells the new cells
   that nothing comes);
3. waits until every destination answered with `kv.pulled`, or `confirm_s` passed, then
   withdraws the snapshots (freed once no reader holds a lease, gyre.transfer.leases).
   It returns the bytes the destinations pulled and verified (`cell.switched`'s
   `bytes["pulled_kv"]`).

The new cell (`handle`, fed the live `kv.offered` and `kv.pulled`; history is skipped):
pulls each block offered to it (every tensor verified against the manifest), imports it
into its engine (a block another policy version computed is dropped and counted by the
engine), and publishes `kv.pulled` with the bytes pulled and the tokens kept.

The moved execution's next request (`hold`, the engine host's hook for `gyre_kv_from`,
`EngineHost.set_kv_hold`): the proxy names the old cell and the `route.updated` that moved
the execution on its first request at the new cell (handlers.proxy.router); the request
waits until the execution's block offered for that route is imported here, or the named
cell's offer for that route came without it, or `hold_s` passed. So the import lands before
the request's prefill, whichever of the two reaches the new cell first. An offer for that
route from another cell that lacks the block also ends the wait: the proxy named a cell that
did not switch (it served the execution elsewhere than the scheduler placed it). In a switch
of several cells at once (one route for all) that can end a wait before the named cell
offered: the request then recomputes its prefix, as it does when the block is dropped.
"""
from __future__ import annotations

import asyncio
import collections
import itertools
import time
from collections.abc import Awaitable, Callable

import structlog

import schemas
from gyre.serving.engine import InvalidRequest
from gyre.serving.host import EngineHost
from gyre.serving.kv import KvFormatError, from_snapshot, to_snapshot
from gyre.transfer.interface import TransferBackend, TransferError, TransferRef
from schemas import ids

log = structlog.get_logger()

KEPT_OFFERS = 256
"""Offers a cell remembers for `hold` (oldest forgotten first)."""


class KvMoves:
    """The KV blocks a cell offers and pulls (module docstring).

    publish: stores an event on the bus (`Bus.publish`). serving: whether the cell serves now
    (a cell that does not takes no blocks). hold_s: longest a moved execution's request waits
    for its block, seconds. confirm_s: longest the old cell keeps its blocks pinned for the
    destinations, seconds. drain_s: longest it waits for its aborted requests to end.
    """

    def __init__(self, *, run: str, cell: str, engine: EngineHost, transfer: TransferBackend,
                 publish: Callable[[schemas.Event], Awaitable[object]], serving: Callable[[], bool],
                 hold_s: float = 30.0, confirm_s: float = 30.0, drain_s: float = 10.0, block_tokens: int = 64) -> None:
        self.run = run
        self.cell = cell
        self.engine = engine
        self.transfer = transfer
        self.publish = publish
        self.serving = serving
        self.hold_s = hold_s
        self.confirm_s = confirm_s
        self.drain_s = drain_s
        self.block_tokens = block_tokens
        self.caught_up = asyncio.Event()
        """Set by the replay once the stored events are read: only later ones are acted on."""
        self.offers: collections.OrderedDict[int, dict[str, schemas.KvOffered]] = collections.OrderedDict()
        """route seq → old cell → its latest offer for that route (any destination)."""
        self.imports: dict[tuple[str, str], asyncio.Event] = {}
        """(offer id, execution) → set once the block offered to this cell is done with."""
        self._mine: dict[str, tuple[set[str], dict[str, int], asyncio.Event]] = {}
        """Id of an offer of this cell in flight → (its executions, execution → bytes its
        destination pulled, set once every destination answered)."""
        self._changed = asyncio.Event()
        self._names = itertools.count()
        self._tasks: set[asyncio.Task] = set()

    # --- the old cell ------------------------------------------------------------------
    async def offer(self, switch: schemas.CellSwitch) -> int:
        """Hand the moved executions' KV to their new cells (module docstring); returns the
        bytes they pulled and verified."""
        await asyncio.to_thread(self.engine.drain, self.drain_s)
        blocks, names = [], []
        moved = [r for r in switch.moved if r.cell and r.cell != self.cell]  # paused: dropped with the cache
        if not moved:
            return 0
        for route in moved:
            kv = await asyncio.to_thread(self.engine.export_kv, route.execution, self.block_tokens)
            if kv is None:
                continue
            arrays = to_snapshot(kv)
            name = f"kv-{self.cell}-{switch.seq}-{next(self._names)}"
            ref = await asyncio.to_thread(self.transfer.expose, name, arrays)
            names.append(name)
            blocks.append(schemas.KvBlock(execution=route.execution, to_cell=route.cell, key=ref.key,
                                          digest=ref.digest, tokens=len(kv.ids),
                                          bytes=sum(a.nbytes for a in arrays.values()), policy_version=kv.version))
        offer = schemas.KvOffered(event_id=ids.kv_offered(self.run, self.cell, switch.seq, tuple(names)),
                                  cell=self.cell, seq=switch.seq, route_seq=switch.route_seq, blocks=tuple(blocks))
        pulled: dict[str, int] = {}
        answered = asyncio.Event()
        self._mine[offer.event_id] = ({b.execution for b in blocks}, pulled, answered)
        started = time.perf_counter()
        if not blocks:
            answered.set()
        try:
            await self.publish(offer)
            await asyncio.wait_for(answered.wait(), self.confirm_s)
        except asyncio.TimeoutError:
            log.warning("cell.kv.unanswered", cell=self.cell, offer=offer.event_id,
                        missing=sorted({b.execution for b in blocks} - set(pulled)))
        finally:
            for name in names:
                self.transfer.withdraw(name)
            del self._mine[offer.event_id]
        log.info("cell.kv.offered", cell=self.cell, blocks=len(blocks), pulled_bytes=sum(pulled.values()),
                 answered=len(pulled), seconds=round(time.perf_counter() - started, 4))
        return sum(pulled.values())

    # --- the new cell ------------------------------------------------------------------
    async def handle(self, event: schemas.Event) -> None:
        """Replay handler for `kv.offered` and `kv.pulled` (stored ones are skipped)."""
        if not self.caught_up.is_set():
            return
        if isinstance(event, schemas.KvPulled):
            mine = self._mine.get(event.offer) if event.source == self.cell else None
            if mine is not None:
                expected, pulled, answered = mine
                pulled[event.execution] = event.bytes
                if set(pulled) >= expected:
                    answered.set()
        elif isinstance(event, schemas.KvOffered):
            self.offers.setdefault(event.route_seq, {})[event.cell] = event
            self.offers.move_to_end(event.route_seq)
            while len(self.offers) > KEPT_OFFERS:
                for old in self.offers.popitem(last=False)[1].values():
                    for block in old.blocks:
                        self.imports.pop((old.event_id, block.execution), None)
            mine = [b for b in event.blocks if b.to_cell == self.cell]
            for block in mine:
                self.imports[(event.event_id, block.execution)] = asyncio.Event()
            self._changed.set()
            self._changed = asyncio.Event()
            if mine:
                task = asyncio.create_task(self._pull(event, mine))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)

    async def _pull(self, offer: schemas.KvOffered, blocks: list[schemas.KvBlock]) -> None:
        for block in blocks:
            pulled = tokens = 0
            error = ""
            started = time.perf_counter()
            try:
                if self.serving():
                    tensors = await asyncio.to_thread(self.transfer.pull, TransferRef(block.key, block.digest),
                                                      self.cell)
                    pulled = block.bytes
                    kv = from_snapshot(tensors)
                    if await asyncio.to_thread(self.engine.import_kv, block.execution, kv):
                        tokens = len(kv.ids)
                    else:
                        error = f"not kept by the engine (policy version {kv.version}; it serves " \
                                f"{self.engine.version})"
                else:
                    error = "not pulled: this cell does not serve"
            except (TransferError, KvFormatError, InvalidRequest) as exc:
                error = str(exc)
            except Exception as exc:  # noqa: BLE001 - blocks that do not fit the model: still answer the old cell
                log.exception("cell.kv.import_failed", cell=self.cell, execution=block.execution)
                error, tokens = f"{type(exc).__name__}: {exc}", 0
            finally:
                done = self.imports.get((offer.event_id, block.execution))
                if done is not None:
                    done.set()
            log.info("cell.kv.pulled", cell=self.cell, source=offer.cell, execution=block.execution, bytes=pulled,
                     tokens=tokens, error=error or None, seconds=round(time.perf_counter() - started, 4))
            await self.publish(schemas.KvPulled(
                event_id=ids.kv_pulled(self.run, self.cell, offer.event_id, block.execution), cell=self.cell,
                source=offer.cell, offer=offer.event_id, execution=block.execution, bytes=pulled, tokens=tokens,
                error=error[:500]))

    async def hold(self, execution: str, cell: str, route: int) -> None:
        """Return once `execution`'s block from `cell`, moved by route `route`, is imported
        here or is not coming, or after `hold_s` (module docstring)."""
        if cell == self.cell:
            return
        started = time.monotonic()
        deadline = started + self.hold_s
        outcome = "timeout"
        while time.monotonic() < deadline:
            offers = self.offers.get(route, {})
            done = next((d for o in offers.values() if (d := self.imports.get((o.event_id, execution)))), None)
            if done is not None:
                try:
                    await asyncio.wait_for(done.wait(), deadline - time.monotonic())
                    outcome = "imported"
                except asyncio.TimeoutError:
                    pass
                break
            if offers:  # the named cell's offer, or another's: nothing comes (module docstring)
                outcome = "none"
                break
            changed = self._changed
            try:
                await asyncio.wait_for(changed.wait(), deadline - time.monotonic())
            except asyncio.TimeoutError:
                break
        log.info("cell.kv.held", cell=self.cell, execution=execution, source=cell, route=route, outcome=outcome,
                 seconds=round(time.monotonic() - started, 4))
