"""The core's ledger host: grants, contributions, applying the step, checkpoints.

Runs in the core cell's process from its start, whatever the cell's role (DESIGN.md
"Training exactly once"; the ledger itself is gyre.learning.ledger):
- Start: raise the core's epoch (gyre.learning.checkpoint.next_epoch), restore the trainer
  from the newest checkpoint (else the initial model, version 0), expose that version's
  weights through the transfer layer; after a restart, publish that version's
  `weights.published` and its `step.completed` again (under the new epoch's id), in case
  the previous core died between its checkpoint and those facts.
- `microstep.ready` and `step.sealed` are replayed from their streams (kept until their step
  completes) into the ledger.
- `microstep.claim` requests are answered from the ledger (`claim`); each grant is first
  published as `microstep.granted`. Every answer names the core's epoch, the step and the
  transfer reference of that step's weights.
- `contribution.returned` (durable `core-contributions-v1`): a contribution the ledger can
  accept is pulled and verified, accepted, added to the core's gradient, and each of its ids
  published as `microstep.committed`; any other is refused whole (its ids are granted again).
  An unreadable one is refused too.
- The core's own replica (handlers.training.replica) trains into the core's gradient under
  `grad_lock` and commits each micro-step at once (`commit_local`).
- When the step is sealed and every micro-step committed (`maybe_apply`): apply and
  checkpoint (gyre.learning.steps), expose the new weights, publish `weights.published`
  then `step.completed` (with gyre.learning.metrics' summary), and move the ledger on.
- A micro-step past its grant budget fails its step: `step.failed` and a dead-letter copy of
  its `microstep.ready`.
Every change to the gradient (the core's own forward-backward, adding a contribution,
applying the step) holds `grad_lock`. A failure while applying is fatal (`watch` raises it),
so a supervisor restarts the core under a new epoch.

The trainer in memory: while the core cell trains (`keep(True)`) the trainer stays; while it
does not (`keep(False)`, rollout) the trainer is offloaded to disk (gyre.learning.offload: the
newest checkpoint plus the step in flight's gradient and metrics) and freed, then restored
for each use that needs it (a contribution to add, a step to apply) and offloaded again.
`trainer` is None while offloaded. A core built on its own (tests) keeps its trainer.
"""
from __future__ import annotations

import asyncio
import time
from pathlib import Path

import structlog

import schemas
from bus import Bus
from gyre.learning import checkpoint, offload
from gyre.learning.ledger import (
    Accepted, Announced, Duplicate, Failed, Granted, Ledger, Lost, NothingLeft, Refused, Renewed, Wait,
)
from gyre.learning.metrics import StepMetrics
from gyre.learning.steps import apply_step
from gyre.learning.trainer import StepStats, Trainer, TrainerConfig
from gyre.transfer.interface import TransferBackend, TransferError, TransferRef
from schemas import ids

log = structlog.get_logger()


class Core:
    """The ledger host of the core cell `cell` (module docstring). `cfg` is the trainer's
    configuration (its lease_s and grant_budget configure the ledger)."""

    def __init__(self, *, run: str, cell: str, bus: Bus, cfg: TrainerConfig, model_dir: Path, weights_dir: Path,
                 transfer: TransferBackend) -> None:
        self.run = run
        self.cell = cell
        self.bus = bus
        self.cfg = cfg
        self.model_dir = Path(model_dir)
        self.weights_dir = Path(weights_dir)
        self.transfer = transfer
        self.grad_lock = asyncio.Lock()
        self.changed = asyncio.Event()
        """Set whenever the ledger may grant something new (the core's replica waits on it)."""
        self.trainer: Trainer | None = None
        """The trainer; None while offloaded (module docstring)."""
        self.resident = True
        """Whether the trainer stays in memory between uses (`keep`)."""
        self._version = -1  # the trainer's policy version, also while offloaded
        self.ledger: Ledger | None = None
        self.epoch = -1
        self.weights: TransferRef | None = None
        self.weights_version = -1
        self._weights_name = ""
        self._ready: dict[tuple[int, int], schemas.MicrostepReady] = {}
        self._seals: dict[int, schemas.StepSealed] = {}
        self._step_started: float | None = None
        self._failed: set[tuple[int, int]] = set()
        self._fatal: asyncio.Future = asyncio.get_running_loop().create_future()

    # -- start ------------------------------------------------------------------------------
    async def start(self) -> None:
        """Raise the epoch, restore the trainer, expose its weights (module docstring)."""
        self.epoch = await asyncio.to_thread(checkpoint.next_epoch, self.weights_dir)
        path = checkpoint.latest(self.weights_dir)
        completed = None
        if path is not None:
            self.trainer, state = await asyncio.to_thread(checkpoint.restore, path, self.cfg)
            completed = state.get("extra", {}).get("step_completed")
        else:
            self.trainer = await asyncio.to_thread(Trainer, self.model_dir, self.cfg)
        await asyncio.to_thread(offload.clear, self.weights_dir)  # a step a dead core left: trained again
        version = self._version = self.trainer.policy_version
        self.ledger = Ledger(epoch=self.epoch, step=version, lease_s=self.cfg.lease_s,
                             grant_budget=self.cfg.grant_budget)
        self._offer(*await self._snapshot())
        if path is not None and version > 0:
            await self._publish_weights(path)
            if completed:
                await self.bus.publish(schemas.decode(schemas.StepCompleted.NAME, completed))
        log.info("core.started", cell=self.cell, epoch=self.epoch, policy_version=version,
                 checkpoint=str(path) if path else None)

    async def keep(self, resident: bool) -> None:
        """The core cell trains (True: restore the trainer if offloaded, and keep it) or not
        (False: offload it now, and again after each later use). Raises what
        gyre.learning.offload raises; an offload that fails keeps the trainer."""
        async with self.grad_lock:
            self.resident = resident
            if resident:
                await self._hold()
            else:
                await self._offload()

    async def _hold(self) -> Trainer:
        """The trainer, restored when offloaded (the caller holds `grad_lock`)."""
        if self.trainer is None:
            started = time.perf_counter()
            self.trainer = await asyncio.to_thread(offload.restore, self.weights_dir, self.model_dir, self.cfg,
                                                   self._version)
            log.info("core.trainer.restored", cell=self.cell, policy_version=self._version,
                     seconds=round(time.perf_counter() - started, 4))
        return self.trainer

    async def _offload(self) -> None:
        """Offload and drop the trainer (the caller holds `grad_lock`)."""
        trainer = self.trainer
        if trainer is None:
            return
        started = time.perf_counter()
        written = await asyncio.to_thread(offload.offload, trainer, self.weights_dir)
        self.trainer = None
        log.info("core.trainer.offloaded", cell=self.cell, policy_version=trainer.policy_version,
                 step_bytes=written, seconds=round(time.perf_counter() - started, 4))

    def loops(self, stop: asyncio.Event) -> list:
        """The core's loops, to run beside the cell's (handlers.daemon.run_loops)."""
        return [self.bus.replay([schemas.MicrostepReady.NAME], self.on_ready, stop=stop),
                self.bus.replay([schemas.StepSealed.NAME], self.on_sealed, stop=stop),
                self.bus.serve(schemas.MicrostepClaim.NAME, self.on_claim_request, stop=stop, queue="core"),
                self.bus.consume("core-contributions-v1", self.on_contribution, stop=stop),
                self.watch(stop)]

    async def watch(self, stop: asyncio.Event) -> None:
        """Raise the first fatal error (a step that could not be applied) until `stop`."""
        stopped = asyncio.ensure_future(stop.wait())
        try:
            await asyncio.wait([self._fatal, stopped], return_when=asyncio.FIRST_COMPLETED)
            if self._fatal.done():
                raise self._fatal.result()
        finally:
            stopped.cancel()

    async def _snapshot(self) -> tuple[str, TransferRef, int]:
        """Expose the trainer's weights through the transfer layer: (name, reference, version)."""
        assert self.trainer is not None
        version = self.trainer.policy_version
        name = f"weights-v{version}-e{self.epoch}"
        tensors = await asyncio.to_thread(self.trainer.weights)
        return name, await asyncio.to_thread(self.transfer.expose, name, tensors), version

    def _offer(self, name: str, ref: TransferRef, version: int) -> None:
        """Make `ref` the weights every claim answer names, and withdraw the previous ones
        (readers holding a lease keep them until they finish)."""
        if self._weights_name and self._weights_name != name:
            self.transfer.withdraw(self._weights_name)
        self.weights, self._weights_name, self.weights_version = ref, name, version

    async def _publish_weights(self, path: Path) -> None:
        assert self.weights is not None
        version = self._version
        await self.bus.publish(schemas.WeightsPublished(
            event_id=ids.weights(self.run, version, self.epoch), policy_version=version, step=version - 1,
            path=str(path), epoch=self.epoch, key=self.weights.key, digest=self.weights.digest))

    # -- facts from the builder -----------------------------------------------------------------
    async def on_ready(self, event: schemas.MicrostepReady) -> None:
        assert self.ledger is not None
        if event.step >= self.ledger.step:
            self._ready[(event.step, event.microstep)] = event
            self.ledger.announce(Announced(event.step, event.microstep, key=event.key, tokens=event.tokens,
                                           trained=event.trained))
            self.changed.set()

    async def on_sealed(self, event: schemas.StepSealed) -> None:
        assert self.ledger is not None
        if event.step >= self.ledger.step:
            self._seals[event.step] = event
            self.ledger.seal(event.step, event.microsteps, event.executions)
            self.changed.set()
            await self.maybe_apply()

    # -- claims -----------------------------------------------------------------------------------
    async def on_claim_request(self, data: bytes) -> bytes:
        assert self.ledger is not None
        try:
            req = schemas.decode(schemas.MicrostepClaim.NAME, data)
        except schemas.SchemaError as exc:
            log.warning("core.claim.refused", error=str(exc))
            return schemas.encode_part(schemas.ClaimReply(outcome="refused", epoch=self.epoch, step=self.ledger.step,
                                                          reason=f"bad microstep.claim: {exc}"))
        return schemas.encode_part(await self.claim(req))

    async def claim(self, req: schemas.MicrostepClaim) -> schemas.ClaimReply:
        """The ledger's answer to `req`. Held ids of another epoch or step are void: the
        replica learns the current ones from the reply and drops its accumulation."""
        ledger = self.ledger
        assert ledger is not None and self.weights is not None
        held = req.held if (req.epoch, req.step) == (ledger.epoch, ledger.step) else ()
        step = ledger.step
        answer = ledger.claim(req.replica, held, time.monotonic(), want=req.want, expires=req.replica != self.cell)
        log.debug("core.claim", replica=req.replica, req_epoch=req.epoch, req_step=req.step, held=req.held, want=req.want,
                 answer=type(answer).__name__)
        reply = dict(epoch=self.epoch, step=step, weights_key=self.weights.key, weights_digest=self.weights.digest,
                     weights_version=self.weights_version)
        if isinstance(answer, Granted):
            await self.bus.publish(schemas.MicrostepGranted(
                event_id=ids.granted(self.run, self.epoch, step, answer.microstep, answer.n), step=step,
                microstep=answer.microstep, replica=req.replica, epoch=self.epoch, grant=answer.n,
                lease_s=answer.lease_s))
            if self._step_started is None:
                self._step_started = time.perf_counter()
            log.info("core.microstep.granted", step=step, microstep=answer.microstep, replica=req.replica,
                     grant=answer.n, expired_from=answer.expired_from)
            return schemas.ClaimReply(outcome="granted", microstep=answer.microstep, key=answer.key,
                                      lease_s=answer.lease_s, grant=answer.n, **reply)
        if isinstance(answer, Lost):
            log.warning("core.grants.lost", step=step, replica=req.replica, lost=answer.microsteps,
                        released=answer.released)
            self.changed.set()
            return schemas.ClaimReply(outcome="lost", lost=answer.microsteps, **reply)
        if isinstance(answer, Failed):
            await self._fail(step, answer)
            return schemas.ClaimReply(outcome="failed", reason=answer.reason, **reply)
        if isinstance(answer, Renewed):
            return schemas.ClaimReply(outcome="renewed", **reply)
        if isinstance(answer, NothingLeft):
            return schemas.ClaimReply(outcome="nothing_left", **reply)
        assert isinstance(answer, Wait)
        return schemas.ClaimReply(outcome="wait", reason=answer.reason, **reply)

    async def _fail(self, step: int, failed: Failed) -> None:
        if (self.epoch, step) in self._failed:
            return
        self._failed.add((self.epoch, step))
        await self.bus.publish(schemas.StepFailed(event_id=ids.step_failed(self.run, self.epoch, step), step=step,
                                                  epoch=self.epoch, reason=failed.reason, microstep=failed.microstep))
        ready = self._ready.get((step, failed.microstep))
        if ready is not None:
            await self.bus.dead_letter(ready, failed.reason)
        log.error("core.step.failed", step=step, epoch=self.epoch, microstep=failed.microstep, reason=failed.reason)

    # -- commits ------------------------------------------------------------------------------------
    async def _committed(self, step: int, microsteps: tuple[int, ...], replica: str) -> None:
        for i in microsteps:
            await self.bus.publish(schemas.MicrostepCommitted(
                event_id=ids.committed(self.run, self.epoch, step, i), step=step, microstep=i, replica=replica,
                epoch=self.epoch))

    async def commit_local(self, microstep: int) -> None:
        """The core's replica trained `microstep` into the core's gradient (the caller holds
        `grad_lock`). Raises RuntimeError when the ledger refuses: the gradient now holds a
        micro-step that does not count, and only a restart can undo that."""
        ledger = self.ledger
        assert ledger is not None
        outcome = ledger.contribute(self.cell, ledger.step, ledger.epoch, [microstep], time.monotonic())
        if not isinstance(outcome, Accepted):
            raise RuntimeError(f"the core's own micro-step {microstep} of step {ledger.step} was not accepted: {outcome}")
        await self._committed(ledger.step, outcome.microsteps, self.cell)

    async def on_contribution(self, event: schemas.ContributionReturned) -> None:
        ledger = self.ledger
        assert ledger is not None
        where = dict(step=event.step, epoch=event.epoch, replica=event.replica, microsteps=event.microsteps)
        if (event.epoch, event.step) == (ledger.epoch, ledger.step) and all(
                ledger.committed.get(i) == event.replica for i in event.microsteps):
            await self._committed(event.step, event.microsteps, event.replica)  # facts a failed attempt may lack
            log.info("core.contribution.duplicate", **where)
            return
        if not ledger.acceptable(event.replica, event.step, event.epoch, event.microsteps):
            outcome = ledger.contribute(event.replica, event.step, event.epoch, event.microsteps, time.monotonic())
            self._refused(outcome, where)
            return
        started = time.perf_counter()
        try:
            grads = await asyncio.to_thread(self.transfer.pull, TransferRef(event.key, event.digest), self.cell)
            metrics = StepMetrics.from_dict(event.metrics)
        except (TransferError, ValueError) as exc:
            if (event.epoch, event.step) == (ledger.epoch, ledger.step):
                released = ledger.release(event.replica)
                self.changed.set()
            else:
                released = ()
            log.warning("core.contribution.unreadable", error=str(exc), released=released, **where)
            return
        async with self.grad_lock:
            trainer = await self._hold()
            outcome = ledger.contribute(event.replica, event.step, event.epoch, event.microsteps, time.monotonic())
            if isinstance(outcome, Accepted):
                try:
                    await asyncio.to_thread(trainer.add_gradients, grads, metrics)
                except ValueError as exc:  # a replica of another model: nothing was added
                    self.fail(RuntimeError(f"contribution of {event.replica} to step {event.step} does not "
                                                   f"fit the model: {exc}"))
                    return
                trainer.metrics.add_time("reduction", time.perf_counter() - started)
                await self._committed(event.step, outcome.microsteps, event.replica)
                log.info("core.contribution.accepted", **where)
            else:
                self._refused(outcome, where)
        await self.maybe_apply()

    def _refused(self, outcome, where: dict) -> None:
        if isinstance(outcome, Duplicate):
            log.info("core.contribution.duplicate", **where)
            return
        assert isinstance(outcome, Refused)
        if outcome.released:
            self.changed.set()
        log.warning("core.contribution.refused", reason=outcome.reason, released=outcome.released, **where)

    # -- the step -------------------------------------------------------------------------------------
    async def maybe_apply(self) -> None:
        """Apply the step when the ledger says it is complete (module docstring); then, while
        the core cell does not train, offload the trainer again."""
        try:
            await self._maybe_apply()
            if not self.resident:
                async with self.grad_lock:
                    await self._offload()
        except Exception as exc:  # noqa: BLE001 - fatal: the supervisor restarts the core under a new epoch
            self.fail(exc)

    def fail(self, exc: BaseException) -> None:
        """Make `watch` raise `exc`: the core cannot go on (its daemon exits, a supervisor restarts it)."""
        log.error("core.fatal", error=repr(exc))
        if not self._fatal.done():
            self._fatal.set_result(exc)

    async def _maybe_apply(self) -> None:
        async with self.grad_lock:
            ledger = self.ledger
            assert ledger is not None
            if ledger.failed is not None or not ledger.complete():
                return
            trainer = await self._hold()
            step = ledger.step
            sealed = self._seals[step]
            per_replica = ledger.committed_per_replica()
            duration = time.perf_counter() - self._step_started if self._step_started is not None else 0.0

            def completed_of(stats: StepStats, optimizer_s: float) -> dict:
                # start() republishes it from here when the core died between checkpoint and publish
                return {"step_completed": self._completed(step, sealed, stats, per_replica, duration, optimizer_s,
                                                          0.0).to_dict()}

            done = await asyncio.to_thread(apply_step, trainer, sealed.executions, self.weights_dir, completed_of)
            self._version = done.policy_version
            snapshot = await self._snapshot()
            # The ledger moves to step k + 1 and every answer names v_{k+1} in the same breath:
            # a claim between the two would send a replica to step k + 1 on v_k's weights.
            ledger.advance()
            self._offer(*snapshot)
            self._step_started = None
            for key in [k for k in self._ready if k[0] <= step]:
                del self._ready[key]
            self._seals.pop(step, None)
            await self._publish_weights(done.path)
            event = self._completed(step, sealed, done.stats, per_replica, duration, done.optimizer_s,
                                    done.checkpoint_s)
            await self.bus.publish(event)
            self.changed.set()
            log.info("core.step.applied", step=step, epoch=self.epoch, loss=event.loss, grad_norm=event.grad_norm,
                     tokens=event.tokens, microsteps_per_replica=per_replica, policy_version=done.policy_version)
        # the next step may be sealed with nothing to train already
        if self.ledger.complete():
            await self._maybe_apply()

    def _completed(self, step: int, sealed: schemas.StepSealed, stats: StepStats, per_replica: dict,
                   duration: float, optimizer_s: float, checkpoint_s: float) -> schemas.StepCompleted:
        m = stats.metrics
        phase_s = dict(m["phase_s"], optimizer=round(optimizer_s, 6), checkpoint=round(checkpoint_s, 6))
        return schemas.StepCompleted(
            event_id=ids.step_completed(self.run, step), step=step, loss=float(stats.loss),
            grad_norm=float(stats.grad_norm), tokens=int(stats.tokens), executions=sealed.executions,
            policy_version=stats.policy_version, duration_s=duration, reward_mean=sealed.reward_mean,
            microsteps=int(m["microsteps"]), trajectories=int(m["trajectories"]), clip_fraction=m["clip_fraction"],
            ratio={k: m[f"ratio_{k}"] for k in ("mean", "std", "min", "max")}, kl=m["kl"],
            microsteps_per_replica=dict(sorted(per_replica.items())), staleness_histogram=m["staleness_histogram"],
            phase_s=phase_s, epoch=self.epoch)

