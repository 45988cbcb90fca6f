"""A trainer replica's loop: claim, train, renew, return (DESIGN.md "Training exactly once").

One loop runs in every cell in training: the core's own replica and each satellite's.
- It claims micro-steps of the step being trained, one at a time: from the core's ledger in
  process (the core, `handlers.training.core.Core.claim`) or with a `microstep.claim`
  request (a satellite). A claim lists the grants the replica holds, which renews their
  leases; while it trains, a satellite renews them every third of the lease.
- Granted: it fetches the micro-step from the object store, waits out the emulated device
  time (`device_time_s`, `gyre bench modes`) if any, and runs forward-backward on it
  (`Trainer.accumulate`). The real forward-backward counts towards the device time: the
  replica waits what its previous micro-step's forward-backward left of it, so a micro-step
  lasts about max(device_time_s, its forward-backward). The core's replica adds into the core's gradient under the core's
  lock and commits the micro-step at once; a satellite keeps the ids it holds.
- A reply under another epoch or step than the replica's accumulation voids it: the
  accumulation is dropped, and a satellite pulls that step's weights (the snapshot the reply
  names, verified against its manifest) and publishes `weights.loaded` before it trains.
- A satellite returns one contribution per step — its gradient sum exposed through the
  transfer layer and `contribution.returned` on the bus — when the ledger says nothing is left
  to claim, when it learns that a grant of its was lost (the core refuses the contribution
  whole and grants its ids again), or when the cell leaves training; then it claims nothing
  more of that step. The exposed sum stays until the replica moves past the step.
- A micro-step it cannot fetch or decode is left out of the ids it holds, so the ledger
  grants it again (within the grant budget, which then fails the step loudly).
- A failure of the core's own forward-backward is fatal (the core's gradient can no longer be
  trusted): `Core` raises it and a supervisor restarts the core under a new epoch.
- A satellite switching to training `join`s the step in flight before it claims: it asks the
  ledger which step and weights (a claim that wants nothing) and pulls and loads that
  snapshot, so its cell's switch reports the bytes pulled (`pulled_bytes`).
- A cell leaving training `detach`es the replica once its loop ended: the replica drops its
  trainer (so the cell frees it) and only keeps offering the contributions it returned until
  their step is applied; a later replica of the cell `take_over`s those.
"""
from __future__ import annotations

import asyncio
import time

import structlog

import schemas
from bus import Bus, RequestFailed
from gyre.learning.trainer import Trainer
from gyre.trajectory.microstep import MicrostepFormatError, from_bytes
from gyre.transfer.interface import TransferBackend, TransferError, TransferRef
from handlers.training.core import Core
from schemas import ids

log = structlog.get_logger()


class Replica:
    """The claim loop of cell `cell` (module docstring); `core` is given for the core's own.

    poll_s: seconds between claims while there is nothing to train. request_timeout_s: how
    long a satellite waits for the ledger's answer.
    """

    def __init__(self, *, run: str, cell: str, bus: Bus, trainer: Trainer, transfer: TransferBackend,
                 core: Core | None = None, device_time_s: float = 0.0, poll_s: float = 0.2,
                 request_timeout_s: float = 5.0) -> None:
        self.run_id = run
        self.cell = cell
        self.bus = bus
        self.trainer = trainer
        self.transfer = transfer
        self.core = core
        self.device_time_s = device_time_s
        self._forward_backward_s = 0.0
        """Seconds of the last micro-step's forward-backward (what the device time waits less)."""
        self.poll_s = poll_s
        self.request_timeout_s = request_timeout_s
        self.epoch = -1
        self.step = -1
        self.held: list[int] = []
        """Ids of (epoch, step) granted to this replica and not seen counted: accumulated, or
        (after it returned them) waiting for the core to take the contribution. Every claim
        lists them, so the ledger never mistakes them for a grant whose reply was lost."""
        self.trained = 0
        """Micro-steps this replica ran forward-backward on (counted or not)."""
        self.returned: set[tuple[int, int]] = set()
        """(epoch, step) this replica returned its contribution to."""
        self._loaded: tuple[str, str] | None = None
        self._contributions: dict[str, int] = {}
        self._seq = 0
        self._lease_s: float | None = None
        self._idle_since = time.perf_counter()
        self._failed: set[tuple[int, int]] = set()
        self.pulled_bytes = 0
        """Bytes of the weight snapshots this replica pulled."""

    async def join(self) -> int:
        """Learn the step in flight and load its weights before claiming (module docstring);
        returns the bytes pulled (0: no answer, or nothing to pull)."""
        before = self.pulled_bytes
        reply = await self._ask(want=False)
        if reply is not None and reply.outcome not in ("failed", "refused") \
                and (reply.epoch, reply.step) != (self.epoch, self.step):
            await self._move(reply)
        return self.pulled_bytes - before

    def detach(self) -> None:
        """Drop the trainer once `run` has ended (module docstring)."""
        self.trainer = None  # type: ignore[assignment] - run() is never called again

    def take_over(self, previous: Replica) -> None:
        """Offer the contributions `previous` (the cell's earlier replica) still offers."""
        self._contributions.update(previous._contributions)
        previous._contributions.clear()

    # -- the loop -------------------------------------------------------------------------------
    async def run(self, stop: asyncio.Event) -> None:
        """Claim and train until `stop`; a satellite returns what it holds on the way out."""
        try:
            while not stop.is_set():
                if self.core is not None:
                    self.core.changed.clear()
                done = (self.epoch, self.step) in self.returned
                reply = await self._ask(want=not done)
                if reply is None:
                    await self._pause(stop)
                    continue
                if (reply.epoch, reply.step) != (self.epoch, self.step) and not await self._move(reply):
                    await self._pause(stop)
                    continue
                if reply.outcome == "granted":
                    await self._train(reply)
                elif reply.outcome == "lost" and self.core is None:
                    if done:  # the returned contribution was refused: its ids are granted again
                        self.held.clear()
                    else:
                        await self._give_back(f"grants {list(reply.lost)} were granted again")
                elif reply.outcome == "nothing_left" and self.held and self.core is None and not done:
                    await self._give_back("nothing left to claim")
                else:
                    if reply.outcome in ("failed", "refused") and (reply.epoch, reply.step) not in self._failed:
                        self._failed.add((reply.epoch, reply.step))
                        log.error("replica.claim.failed", cell=self.cell, step=reply.step, reason=reply.reason)
                    await self._pause(stop)
        except Exception as exc:
            if self.core is None:
                raise
            self.core.fail(exc)  # the core's gradient may hold half a micro-step
        finally:
            if self.core is None and self.held and (self.epoch, self.step) not in self.returned:
                try:
                    await self._give_back("leaving training")
                except Exception:  # noqa: BLE001 - the ledger grants its ids again when the lease ends
                    log.exception("replica.contribution.not_returned", cell=self.cell, step=self.step)

    async def _pause(self, stop: asyncio.Event) -> None:
        waits = [asyncio.ensure_future(stop.wait())]
        if self.core is not None:
            waits.append(asyncio.ensure_future(self.core.changed.wait()))
        try:
            await asyncio.wait(waits, timeout=self.poll_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()

    async def _ask(self, want: bool) -> schemas.ClaimReply | None:
        """The ledger's answer to a claim listing the held ids; None when none came."""
        req = schemas.MicrostepClaim(event_id=ids.claim(self.run_id, self.cell, self._seq), replica=self.cell,
                                     epoch=self.epoch, step=self.step, held=tuple(self.held), want=want)
        self._seq += 1
        if self.core is not None:
            return await self.core.claim(req)
        try:
            data = await self.bus.request(schemas.MicrostepClaim.NAME, schemas.encode(req), self.request_timeout_s)
            return schemas.decode_part(schemas.ClaimReply, data)
        except RequestFailed as exc:
            log.info("replica.claim.unanswered", cell=self.cell, error=str(exc))
        except schemas.SchemaError as exc:
            log.warning("replica.claim.bad_reply", cell=self.cell, error=str(exc))
        return None

    async def _move(self, reply: schemas.ClaimReply) -> bool:
        """Follow the ledger to (reply.epoch, reply.step): (a satellite) drop what was
        accumulated for another one and load that step's weights. The core's trainer holds the
        step's gradient itself (what the core committed, and satellites' contributions, also
        while the core cell served rollouts), which only the core drops, as it applies a step:
        a core replica started in the middle of a step keeps it. False when the weights could
        not be pulled (the replica then holds nothing and asks again)."""
        if self.core is None:
            if self.trainer.metrics.microsteps:
                log.warning("replica.accumulation.void", cell=self.cell, epoch=self.epoch, step=self.step,
                            held=self.held, now_epoch=reply.epoch, now_step=reply.step)
            self.trainer.discard()
        self.held.clear()
        self.epoch = self.step = -1
        self.withdraw_through(reply.step - 1)
        if self.core is None and reply.weights_version != reply.step:
            log.warning("replica.weights.mismatch", cell=self.cell, step=reply.step,
                        weights_version=reply.weights_version)  # never train a step on other weights
            return False
        if self.core is None and (reply.weights_key, reply.weights_digest) != self._loaded:
            try:
                tensors = await asyncio.to_thread(self.transfer.pull, TransferRef(reply.weights_key,
                                                                                  reply.weights_digest), self.cell)
                self.pulled_bytes += sum(t.nbytes for t in tensors.values())
                await asyncio.to_thread(self.trainer.load_weights, tensors, reply.step)
                del tensors
            except (TransferError, ValueError) as exc:
                log.warning("replica.weights.unavailable", cell=self.cell, policy_version=reply.step, error=str(exc))
                return False
            self._loaded = (reply.weights_key, reply.weights_digest)
            await self.bus.publish(schemas.WeightsLoaded(
                event_id=ids.loaded(self.run_id, self.cell, reply.step, reply.epoch, "training"), cell=self.cell,
                policy_version=reply.step, epoch=reply.epoch, digest=reply.weights_digest, role="training"))
            log.info("replica.weights.loaded", cell=self.cell, policy_version=reply.step, epoch=reply.epoch)
        self.epoch, self.step = reply.epoch, reply.step
        self._idle_since = time.perf_counter()
        return True

    # -- training -----------------------------------------------------------------------------
    async def _train(self, reply: schemas.ClaimReply) -> None:
        mid = reply.microstep
        self.trainer.metrics.add_time("waiting_for_grants", time.perf_counter() - self._idle_since)
        self._lease_s = reply.lease_s
        renewing = None
        if self.core is None:
            self.held.append(mid)
            if reply.lease_s:
                renewing = asyncio.create_task(self._renew(reply.lease_s))
        try:
            try:
                ms = from_bytes(await self.bus.get_object(reply.key))
            except (KeyError, MicrostepFormatError) as exc:
                log.error("replica.microstep.unreadable", cell=self.cell, step=reply.step, microstep=mid,
                          key=reply.key, error=repr(exc))
                if mid in self.held:
                    self.held.remove(mid)  # not listed at the next claim: the ledger grants it again
                return
            if self.device_time_s > self._forward_backward_s:
                await asyncio.sleep(self.device_time_s - self._forward_backward_s)
            if self.core is not None:
                async with self.core.grad_lock:
                    started = time.perf_counter()
                    await asyncio.to_thread(self.trainer.accumulate, ms)
                    self._forward_backward_s = time.perf_counter() - started
                    self.trainer.metrics.add_time("forward_backward", self._forward_backward_s)
                    await self.core.commit_local(mid)
                self.trained += 1
                await self.core.maybe_apply()
            else:
                started = time.perf_counter()
                try:
                    await asyncio.to_thread(self.trainer.accumulate, ms)
                except Exception:  # noqa: BLE001 - the partial gradient is dropped with everything held
                    log.exception("replica.microstep.failed", cell=self.cell, step=reply.step, microstep=mid)
                    self.trainer.discard()
                    self.held.clear()
                    return
                self._forward_backward_s = time.perf_counter() - started
                self.trainer.metrics.add_time("forward_backward", self._forward_backward_s)
                self.trained += 1
            log.info("replica.microstep.trained", cell=self.cell, step=reply.step, microstep=mid, tokens=ms.n_tokens)
        finally:
            if renewing is not None:
                renewing.cancel()
            self._idle_since = time.perf_counter()

    async def _renew(self, lease_s: float) -> None:
        """Renew the held grants every third of the lease while a micro-step trains."""
        while True:
            await asyncio.sleep(lease_s / 3)
            reply = await self._ask(want=False)
            if reply is not None and reply.outcome == "lost":
                log.warning("replica.grants.lost", cell=self.cell, step=self.step, lost=reply.lost)

    async def _give_back(self, why: str) -> None:
        """Return the gradient sum of the held ids as this replica's one contribution to the step."""
        if not self.held or (self.epoch, self.step) in self.returned:
            return
        epoch, step, held = self.epoch, self.step, tuple(sorted(self.held))
        grads = await asyncio.to_thread(self.trainer.gradients)
        event_id = ids.contribution(self.run_id, epoch, step, self.cell, held)
        name = f"contribution-{self.cell}-s{step}-e{epoch}-{event_id.rsplit(':', 1)[1]}"
        ref = await asyncio.to_thread(self.transfer.expose, name, grads)
        self._contributions[name] = step
        await self.bus.publish(schemas.ContributionReturned(
            event_id=event_id, step=step, epoch=epoch, replica=self.cell,
            microsteps=held, key=ref.key, digest=ref.digest, metrics=self.trainer.metrics.to_dict()))
        self.returned.add((epoch, step))
        self.trainer.discard()  # `held` keeps the ids until the step moves on or the ledger says lost
        log.info("replica.contribution.returned", cell=self.cell, step=step, epoch=epoch, microsteps=held, why=why)

    def withdraw_through(self, step: int) -> None:
        """Stop offering the contributions to steps <= `step` (applied: the core has what it
        needed); a reader in the middle of a pull keeps its lease."""
        for name, s in list(self._contributions.items()):
            if s <= step:
                self.transfer.withdraw(name)
                del self._contributions[name]
