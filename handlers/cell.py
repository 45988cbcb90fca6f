"""Cell daemon: one long-lived process that holds an engine or a trainer replica.

A switch changes what the process holds, never the process (DESIGN.md "Cells and
engines"): the engine's HTTP server stays bound; while the cell trains it answers 503,
so the proxy waits or reroutes. What a switch does is planned by gyre.control.switch; this
module executes the plan and publishes the outcome.

Training (DESIGN.md "Training exactly once"): the core cell (`cell0`) hosts the step
ledger from its start, whatever its role (handlers.training.core: it answers
`microstep.claim`, takes `contribution.returned`, applies each step, checkpoints, publishes
`weights.published` and `step.completed`); it owns the authoritative weights and the only
optimizer state. Every cell in training, core or satellite, runs a replica
(handlers.training.replica) that claims micro-steps from the ledger; a satellite pulls the
core's weights of the step through the transfer layer and returns its gradient sum there.
Each cell process has one transfer backend (handlers.transfer: loopback, or Mooncake when the
recipe's `cells.transfer` says so).

Weights while serving (DESIGN.md "Weight publication"): a cell in rollout follows
`weights.published` through handlers.transfer.follow.EngineWeights: pull the newest
snapshot (verified against its manifest), load it between decode steps, then publish
`weights.loaded`; a refused pull leaves the engine on the version it serves.

The engine is held through the engine-host interface (gyre.serving.host.EngineHost; `engine`,
made by handlers.engines.hosts from the recipe's `engine.kind`). A switch frees the state of
the role left (the engine's weights and KV caches; a satellite's trainer; the core's trainer,
offloaded to disk) and reports on `cell.switched` the process's live tensor storage before and
after it, the storage its release freed, the snapshot bytes it pulled and the KV bytes its
moved executions' new cells pulled (`bytes`).

KV blocks (DESIGN.md "Elastic scheduling"): a cell leaving rollout hands the prefix KV of the
executions its switch moved to their new cells before it releases its engine, and a serving
cell takes the blocks offered to it (handlers.transfer.kv_move.KvMoves; `kv.offered`,
`kv.pulled`), holding a moved execution's first request until they are imported (the host's
`set_kv_hold`).

Consumes `cell.switch` (its own durable `<cell>-v1`, `bus.subjects.cell_consumer`) and
replays `weights.published`, `kv.offered` and `kv.pulled`; publishes `cell.switched` with
measured durations and bytes.

Restart (kill -9) of a cell process recovers:
- its role: the newest `cell.switch` addressed to it (`_last_asked`): training → it goes back
  to training at once (a replica claiming again), else rollout; announced as `cell.switched`
  idle → role under a fresh id (`ids.announce`). A switch it was doing is thus done again,
  whole, at start; its `cell.switch` (acked only once a switch is done) comes back after
  the durable's ack_wait and then changes nothing.
- its engine's weights: the initial model or the core's newest checkpoint (the core), then
  the newest `weights.published` (replayed) pulled and verified as usual.
- the core's ledger and weights (handlers.training.core): the epoch is raised, the trainer
  restored from the newest checkpoint, the step in flight trained again from its retained
  micro-steps under the new epoch; grants, commits and contributions of the old epoch count
  for nothing, so no micro-step counts twice.
It loses, by design: the engine's KV caches (a moved or sticky execution's next call
prefills again) and the calls it was serving (the proxy retries them on another rollout
cell or on the restarted one: `handlers.proxy.routing.Dispatcher`); a satellite's gradient
of uncommitted micro-steps: the ledger grants them again, to the restarted satellite's
replica (its first claim lists none of them, which releases them) or, once their lease
lapses (`train.lease_s`, 30 s), to any replica that claims. tests/test_crash_daemons.py
kills a cell in rollout and the core in training mid-step; tests/test_crash_satellite.py a
satellite holding a grant (lease 4 s there: the core took it over after it lapsed).
"""
from __future__ import annotations

import asyncio
import dataclasses
import time
from pathlib import Path

import structlog

import schemas
from bus import Bus
from bus.subjects import cell_consumer
from gyre.config import fields_of
from gyre.control.switch import SwitchAction, durations as switch_durations, plan_switch
from gyre.learning.settings import TrainerSettings
from gyre.learning.trainer import Trainer, TrainerConfig
from gyre.serving.engine import EngineConfig
from gyre.serving.settings import EngineSettings
from gyre.serving.storage import live_tensor_bytes
from handlers.engines.hosts import make_host
from handlers.daemon import FatalError, RunContext, connected, daemon_main, run_loops
from handlers.training.core import Core
from handlers.training.replica import Replica
from handlers.transfer import make_backend
from handlers.transfer.follow import EngineWeights
from handlers.transfer.kv_move import KvMoves
from schemas import ids

log = structlog.get_logger()


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Config:
    """The cell's settings. run, nats_url, nats_token: the bus (`handlers.daemon.BusSettings`)."""

    run: str
    nats_url: str
    nats_token: str | None
    cell: str
    """Cell id; the core cell is `cell0` (gyre.config.CellsSection.ids)."""
    model_dir: Path
    """The policy checkpoint the trainer starts from."""
    weights_dir: Path
    """Where new versions are written (`v<k>/`)."""
    engine: EngineConfig
    """The embedded engine's configuration (the scripted engine reads its model_dir's tokenizer)."""
    engine_kind: str = "embedded"
    """Which engine the cell hosts (`engine.kind`: embedded or scripted)."""
    engine_script: str = ""
    """The scripted engine's script or playbook file (`engine.script`)."""
    trainer: TrainerConfig
    """The trainer replica's configuration (its `replica` is the cell id); its lease_s and
    grant_budget configure the core's ledger, its device_time_s the emulated device time."""
    host: str = "127.0.0.1"
    """Engine listener address."""
    port: int = 0
    """Engine listener port (0 = a free port)."""
    engine_token: str = dataclasses.field(default="", repr=False)
    """The bearer token the engine server demands (the run's; `handlers.engines.embedded`)."""
    transfer: str = "loopback"
    """The transfer backend (`cells.transfer`: loopback or mooncake)."""
    transfer_protocol: str = "tcp"
    """Mooncake's transport (`cells.transfer_protocol`)."""
    transfer_cluster: bool = False
    """Mooncake may bind every interface (`cells.transfer_cluster`)."""

    @property
    def core(self) -> bool:
        return self.cell == "cell0"


def config_from_context(ctx: RunContext, args) -> Config:
    """The cell's Config from the recipe: the engine's and the trainer's configs are built
    from their recipe tables here, and only here."""
    r = ctx.recipe
    model_dir = ctx.checkpoint()
    if not ctx.engine_token:
        raise FatalError("no engine token: the engine demands one; set GYRE_ENGINE_TOKEN (the value the proxy "
                         "sends) or start the cell with --run-dir of a run `gyre run` made (its engine_token file)")
    return Config(run=ctx.run, nats_url=ctx.nats_url, nats_token=ctx.nats_token, cell=args.cell,
                  engine_token=ctx.engine_token,
                  model_dir=model_dir, weights_dir=ctx.run_dir / "weights",
                  engine=EngineConfig(**fields_of(r.engine, EngineSettings), model_dir=str(model_dir),
                                      max_completion_tokens=r.sampling.max_tokens, seed=r.run.seed),
                  trainer=TrainerConfig(**fields_of(r.train, TrainerSettings), seed=r.run.seed, replica=args.cell),
                  transfer=r.cells.transfer, transfer_protocol=r.cells.transfer_protocol,
                  transfer_cluster=r.cells.transfer_cluster, engine_kind=r.engine.kind, engine_script=r.engine.script)


class Cell:
    def __init__(self, cfg: Config, bus: Bus) -> None:
        self.cfg = cfg
        self.bus = bus
        self.role = "idle"
        try:
            self.engine = make_host(cfg.engine_kind, cfg.engine, script=cfg.engine_script, api_key=cfg.engine_token)
        except (ValueError, OSError) as exc:  # a scripted engine's script that cannot be read
            raise FatalError(f"cannot host the {cfg.engine_kind} engine: {exc}") from None
        try:
            self.transfer = make_backend(cfg.transfer, host=cfg.host, lease_s=max(cfg.trainer.lease_s, 30.0),
                                         protocol=cfg.transfer_protocol, cluster=cfg.transfer_cluster)
        except RuntimeError as exc:  # MooncakeUnavailable: not installed, or not in a private namespace
            raise FatalError(str(exc)) from None
        self.core = Core(run=cfg.run, cell=cfg.cell, bus=bus, cfg=cfg.trainer, model_dir=cfg.model_dir,
                         weights_dir=cfg.weights_dir, transfer=self.transfer) if cfg.core else None
        self.trainer: Trainer | None = None
        """A satellite's own trainer while it trains (the core's lives in `core`)."""
        self.replica: Replica | None = None
        self.url = ""
        self._pulled = {"pulled_weights": 0, "pulled_kv": 0}  # bytes pulled during the switch under way
        self.training_stop: asyncio.Event | None = None
        self.training_task: asyncio.Task | None = None
        self.latest_weights: schemas.WeightsPublished | None = None
        self.weights = EngineWeights(run=cfg.run, cell=cfg.cell, engine=self.engine, transfer=self.transfer,
                                     publish=bus.publish, serving=self._serves)
        self.kv = KvMoves(run=cfg.run, cell=cfg.cell, engine=self.engine, transfer=self.transfer,
                          publish=bus.publish, serving=self._serves)
        self.switching: schemas.CellSwitch | None = None
        """The switch being done (its `moved` executions' KV blocks go to their new cells)."""

    def _serves(self) -> bool:
        """Whether the engine serves now: it takes new weights and KV blocks only then."""
        return self.engine.serving and not self.engine.released

    async def start(self) -> None:
        """Start the core's ledger (the core cell), the engine server, and announce the role:
        the one the scheduler last asked of this cell (a restarted cell goes back to training
        at once, its replica claiming again), else rollout."""
        if self.core is not None:
            await self.core.start()
        self.url = await self.engine.start(self.cfg.host, self.cfg.port)
        self.engine.set_kv_hold(self.kv.hold)
        self.role = "rollout"
        started = time.perf_counter()
        if await self._last_asked() == "training":
            plan = plan_switch("rollout", "training", core=self.cfg.core)
            for action in plan.release + plan.load + plan.resume:
                await self._act(action)
            self.role = "training"
        elif self.core is not None:
            await self.core.keep(False)  # a core cell in rollout holds no trainer
        await self._switched(-1, "idle", self.role, {"total_s": time.perf_counter() - started})
        log.info("cell.started", cell=self.cfg.cell, role=self.role, engine_url=self.url, core=self.cfg.core)

    async def _last_asked(self) -> str | None:
        """The role of the newest `cell.switch` addressed to this cell (None: never asked)."""
        last: list[str] = []

        async def on_switch(event: schemas.CellSwitch) -> None:
            if event.cell == self.cfg.cell:
                last.append(event.to_role)

        caught_up, stop = asyncio.Event(), asyncio.Event()
        replay = asyncio.create_task(self.bus.replay([schemas.CellSwitch.NAME], on_switch, stop=stop,
                                                     caught_up=caught_up))
        waiter = asyncio.ensure_future(caught_up.wait())
        try:
            await asyncio.wait([waiter, replay], return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiter.cancel()
            stop.set()
            await replay
        return last[-1] if last else None

    async def stop(self) -> None:
        self.weights.stop()
        await self._stop_training()
        await self.engine.stop()
        self.transfer.close()

    async def _switched(self, seq: int, from_role: str, to_role: str, durations: dict,
                        measured: dict | None = None) -> None:
        event_seq = seq if seq >= 0 else 0
        event_id = ids.switched(self.cfg.run, self.cfg.cell, seq) if seq >= 0 else ids.announce(self.cfg.run, self.cfg.cell)
        await self.bus.publish(schemas.CellSwitched(
            event_id=event_id, cell=self.cfg.cell, seq=event_seq, from_role=from_role, to_role=to_role,
            durations=durations, engine_url=self.url if to_role == "rollout" else "", policy_version=self.engine.version,
            bytes=measured or {}))

    # --- switches -------------------------------------------------------------------
    async def handle_switch(self, event: schemas.CellSwitch) -> None:
        if event.cell != self.cfg.cell:
            return
        if event.to_role == self.role:
            return  # redelivered: already there
        plan = plan_switch(self.role, event.to_role, core=self.cfg.core)
        live_before = await asyncio.to_thread(live_tensor_bytes)
        self.switching, self._pulled = event, {"pulled_weights": 0, "pulled_kv": 0}
        started = time.perf_counter()
        for action in plan.release:
            await self._act(action)
        released = time.perf_counter()
        live_released = await asyncio.to_thread(live_tensor_bytes)
        measuring = time.perf_counter() - released  # not part of the switch's phases
        for action in plan.load:
            await self._act(action)
        loaded = time.perf_counter()
        for action in plan.resume:
            await self._act(action)
        self.role = plan.to_role  # only now: a switch that failed half-way is redone whole on redelivery
        self.switching = None
        durations = switch_durations(started + measuring, released + measuring, loaded, time.perf_counter())
        measured = {"live_before": live_before, "freed": live_before - live_released,
                    "live_after": await asyncio.to_thread(live_tensor_bytes), **self._pulled}
        await self._switched(event.seq, event.from_role, event.to_role, durations, measured)
        log.info("cell.switched", cell=self.cfg.cell, to_role=event.to_role, policy_version=self.engine.version,
                 **durations, **measured)

    async def _act(self, action: SwitchAction) -> None:
        """Run one action of a switch plan (gyre.control.switch)."""
        if action == "stop_serving":
            self.engine.set_serving(False)
        elif action == "move_kv":  # before the release, which frees the KV it hands over
            if self.switching is not None:  # a restarted cell going back to training moves none
                self._pulled["pulled_kv"] += await self.kv.offer(self.switching)
        elif action == "release_engine":
            await self.weights.halt()  # no load lands in the engine after its release
            await asyncio.to_thread(self.engine.release)
        elif action == "stop_training":
            await self._stop_training()
        elif action == "offload_trainer":
            await self.core.keep(False)
        elif action == "release_trainer":
            self.trainer = None  # the replica dropped its reference when it stopped
        elif action == "restore_trainer":
            await self.core.keep(True)
        elif action == "load_trainer":  # a satellite: a trainer, and the weights of the step in flight
            if self.trainer is None:
                self.trainer = await asyncio.to_thread(Trainer, str(self.cfg.model_dir), self.cfg.trainer)
            self._new_replica(self.trainer)
            self._pulled["pulled_weights"] += await self.replica.join()
        elif action == "restore_engine":
            before = self.weights.pulled_bytes
            await self.weights.restore(self.latest_weights, (str(self.cfg.model_dir), self.cfg.engine.initial_version))
            self._pulled["pulled_weights"] += self.weights.pulled_bytes - before
        elif action == "start_training":
            self._start_training()
        elif action == "start_serving":
            self.engine.set_serving(True)
            if self.weights.latest is not None:
                self.weights.published(self.weights.latest)  # a version published during the switch
        else:
            raise ValueError(f"unknown switch action {action!r}")

    # --- training -------------------------------------------------------------------
    def _new_replica(self, trainer: Trainer) -> None:
        replica = Replica(run=self.cfg.run, cell=self.cfg.cell, bus=self.bus, trainer=trainer, transfer=self.transfer,
                          core=self.core, device_time_s=self.cfg.trainer.device_time_s,
                          poll_s=min(0.2, self.cfg.trainer.lease_s / 4))
        if self.replica is not None:
            replica.take_over(self.replica)
        self.replica = replica

    def _start_training(self) -> None:
        if self.training_task is not None and not self.training_task.done():
            return  # a redelivered switch: already claiming
        if self.core is not None:
            assert self.core.trainer is not None, "start_training before restore_trainer"
            self._new_replica(self.core.trainer)
        assert self.replica is not None and self.replica.trainer is not None, "start_training without a trainer"
        self.training_stop = asyncio.Event()
        self.training_task = asyncio.create_task(self.replica.run(self.training_stop))

    async def _stop_training(self) -> None:
        if self.training_stop is not None:
            self.training_stop.set()
            if self.training_task is not None:
                try:
                    await self.training_task
                except Exception:  # noqa: BLE001 - the replica's failure is logged; its grants lapse
                    log.exception("cell.training.failed", cell=self.cfg.cell)
            self.training_stop = self.training_task = None
            if self.replica is not None:
                self.replica.detach()  # so the trainer it trained with can be freed

    async def handle_weights(self, event: schemas.WeightsPublished) -> None:
        latest = self.latest_weights
        if latest is None or (event.policy_version, event.epoch) > (latest.policy_version, latest.epoch):
            self.latest_weights = event
        if self.replica is not None and self.core is None:
            self.replica.withdraw_through(event.policy_version - 1)  # that step is applied
        self.weights.published(event)


async def run(cfg: Config, stop: asyncio.Event) -> None:
    async with connected(cfg, stop, cfg.cell) as bus:
        cell = Cell(cfg, bus)
        await bus.ensure_consumer(cell_consumer(cfg.cell))
        await cell.start()
        try:
            await run_loops(bus.consume(cell_consumer(cfg.cell), cell.handle_switch, stop=stop),
                            bus.replay([schemas.WeightsPublished.NAME], cell.handle_weights, stop=stop),
                            bus.replay([schemas.KvOffered.NAME, schemas.KvPulled.NAME], cell.kv.handle, stop=stop,
                                       caught_up=cell.kv.caught_up),
                            *(cell.core.loops(stop) if cell.core is not None else ()))
        finally:
            await cell.stop()


def _args(p) -> None:
    p.add_argument("--cell", default="cell0", help="cell id; cell0 is the core cell")


def main(argv: list[str] | None = None) -> int:
    return daemon_main("cell", "Cell: hosts an engine (rollout) or a trainer replica (training).",
                       config_from_context, run, argv, extra_args=_args)


if __name__ == "__main__":
    raise SystemExit(main())
