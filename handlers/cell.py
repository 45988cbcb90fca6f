"""Cell daemon: one long-lived process that holds an engine or a trainer replica.

A switch changes what the process holds, never the process (DESIGN.md "Cells and
engines"): the engine's HTTP server stays bound; while the cell trains it answers 503,
so the proxy waits or reroutes. The core cell (`cell0`) owns the optimizer state.

Consumes `cell.switch` (its own durable `<cell>-v1`, `bus.subjects.cell_consumer`), `microstep.ready` (work queue,
only while training) and `step.sealed` (replayed); publishes `cell.switched` with
measured durations, `weights.published` and `step.completed`. What a switch does is
planned by gyre.control.switch and which step is ready to apply is decided by
gyre.learning.steps; this module executes both and publishes the outcomes.
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
from gyre.learning.steps import StepAccounts, apply_step
from gyre.learning.trainer import Trainer, TrainerConfig
from gyre.serving.engine import Engine, EngineConfig
from gyre.serving.settings import EngineSettings
from gyre.trajectory.microstep import from_bytes
from handlers.engines import embedded as engine_server
from handlers.daemon import FatalError, RunContext, connected, daemon_main, run_loops
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
    """The embedded engine's configuration."""
    trainer: TrainerConfig
    """The trainer replica's configuration (used by the core cell only)."""
    host: str = "127.0.0.1"
    """Engine listener address."""
    port: int = 0
    """Engine listener port (0 = a free port)."""
    engine_token: str = dataclasses.field(default="", repr=False)
    """The bearer token the engine server demands (the run's; `handlers.engines.embedded`)."""

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
                  trainer=TrainerConfig(**fields_of(r.train, TrainerSettings), seed=r.run.seed))


class Cell:
    def __init__(self, cfg: Config, bus: Bus) -> None:
        self.cfg = cfg
        self.bus = bus
        self.role = "idle"
        self.version = 0
        self.engine = Engine(cfg.engine)
        self.trainer: Trainer | None = None
        self.app = None
        self.url = ""
        self.steps = StepAccounts()
        self.training_stop: asyncio.Event | None = None
        self.training_task: asyncio.Task | None = None
        self.step_lock = asyncio.Lock()
        self.latest_weights: schemas.WeightsPublished | None = None

    async def start(self) -> None:
        self.app, self.runner, self.url = await engine_server.serve(self.engine, host=self.cfg.host, port=self.cfg.port,
                                                                    api_key=self.cfg.engine_token)
        await self._switched(-1, "idle", "rollout", {"total_s": 0.0})
        self.role = "rollout"
        log.info("cell.started", cell=self.cfg.cell, engine_url=self.url)

    async def stop(self) -> None:
        if self.training_stop:
            self.training_stop.set()
        if self.training_task:
            await asyncio.wait([self.training_task], timeout=30)
        await self.runner.cleanup()

    async def _switched(self, seq: int, from_role: str, to_role: str, durations: dict) -> None:
        event_seq = seq if seq >= 0 else 0
        event_id = ids.switched(self.cfg.run, self.cfg.cell, seq) if seq >= 0 else ids.announce(self.cfg.run, self.cfg.cell)
        await self.bus.publish(schemas.CellSwitched(
            event_id=event_id, cell=self.cfg.cell, seq=event_seq, from_role=from_role, to_role=to_role,
            durations=durations, engine_url=self.url if to_role == "rollout" else "", policy_version=self.version))

    # --- switches -------------------------------------------------------------------
    async def handle_switch(self, event: schemas.CellSwitch) -> None:
        if event.cell != self.cfg.cell:
            return
        if event.to_role == self.role:
            return  # redelivered: already there
        plan = plan_switch(self.role, event.to_role, core=self.cfg.core)
        started = time.perf_counter()
        for action in plan.release:
            await self._act(action)
        released = time.perf_counter()
        for action in plan.load:
            await self._act(action)
        loaded = time.perf_counter()
        self.role = plan.to_role
        for action in plan.resume:
            await self._act(action)
        durations = switch_durations(started, released, loaded, time.perf_counter())
        await self._switched(event.seq, event.from_role, event.to_role, durations)
        log.info("cell.switched", cell=self.cfg.cell, to_role=event.to_role, policy_version=self.version, **durations)
        if self.role == "training":
            # A step sealed while we were still rolling out (e.g. one with no micro-steps)
            # must still be applied: nothing else would trigger it. Announced after
            # `cell.switched`, so the scheduler sees the role before the step completes.
            for step in self.steps.sealed_steps():
                await self._maybe_apply(step)

    async def _act(self, action: SwitchAction) -> None:
        """Run one action of a switch plan (gyre.control.switch)."""
        if action == "stop_serving":
            engine_server.set_serving(self.app, False)
        elif action == "flush_cache":
            await asyncio.to_thread(self.engine.flush_cache)
        elif action == "stop_training":
            await self._stop_training()
        elif action == "load_trainer":
            if self.trainer is None:
                self.trainer = await asyncio.to_thread(Trainer, str(self.cfg.model_dir), self.cfg.trainer)
        elif action == "load_weights":
            weights = self.latest_weights
            if weights is not None and weights.policy_version > self.engine.version:
                await asyncio.to_thread(self.engine.load_weights, weights.path, weights.policy_version)
                self.version = weights.policy_version
        elif action == "start_training":
            self._start_training()
        elif action == "start_serving":
            engine_server.set_serving(self.app, True)
        else:
            raise ValueError(f"unknown switch action {action!r}")

    # --- training -------------------------------------------------------------------
    def _start_training(self) -> None:
        self.training_stop = asyncio.Event()
        self.training_task = asyncio.create_task(
            self.bus.consume("trainer-v1", self.handle_microstep, stop=self.training_stop))

    async def _stop_training(self) -> None:
        if self.training_stop is not None:
            self.training_stop.set()
            if self.training_task is not None:
                await self.training_task
            self.training_stop = self.training_task = None

    async def handle_microstep(self, event: schemas.MicrostepReady) -> None:
        assert self.trainer is not None
        data = await self.bus.get_object(event.key)
        ms = from_bytes(data)
        self.steps.microstep_arrived(event.step, time.perf_counter())
        await asyncio.to_thread(self.trainer.accumulate, ms)
        self.steps.microstep_counted(event.step)
        log.info("cell.microstep.trained", step=event.step, microstep=event.microstep, tokens=event.tokens)
        await self._maybe_apply(event.step)

    async def handle_sealed(self, event: schemas.StepSealed) -> None:
        self.steps.seal(event)
        if self.role == "training":
            await self._maybe_apply(event.step)

    async def handle_weights(self, event: schemas.WeightsPublished) -> None:
        if self.latest_weights is None or event.policy_version > self.latest_weights.policy_version:
            self.latest_weights = event

    async def _maybe_apply(self, step: int) -> None:
        async with self.step_lock:
            if self.trainer is None:
                return
            sealed = self.steps.ready(step, self.trainer.policy_version)
            if sealed is None:
                return
            done = await asyncio.to_thread(apply_step, self.trainer, sealed.executions, self.cfg.weights_dir)
            stats, version = done.stats, done.policy_version
            weights = schemas.WeightsPublished(event_id=ids.weights(self.cfg.run, version), policy_version=version,
                                               step=step, path=str(done.path))
            self.latest_weights = weights
            await self.bus.publish(weights)
            duration = self.steps.duration_s(step, time.perf_counter())
            await self.bus.publish(schemas.StepCompleted(
                event_id=ids.step_completed(self.cfg.run, step), step=step, loss=float(stats.loss),
                grad_norm=float(stats.grad_norm), tokens=int(stats.tokens), executions=sealed.executions,
                policy_version=version, duration_s=duration, reward_mean=sealed.reward_mean))
            log.info("cell.step.applied", step=step, loss=stats.loss, grad_norm=stats.grad_norm,
                     tokens=stats.tokens, policy_version=version)


async def run(cfg: Config, stop: asyncio.Event) -> None:
    async with connected(cfg, stop, cfg.cell) as bus:
        cell = Cell(cfg, bus)
        await bus.ensure_consumer(cell_consumer(cfg.cell))
        await cell.start()
        try:
            await run_loops(bus.consume(cell_consumer(cfg.cell), cell.handle_switch, stop=stop),
                            bus.replay([schemas.StepSealed.NAME], cell.handle_sealed, stop=stop),
                            bus.replay([schemas.WeightsPublished.NAME], cell.handle_weights, stop=stop))
        finally:
            await cell.stop()


def _args(p) -> None:
    p.add_argument("--cell", default="cell0", help="cell id; cell0 is the core cell")


def main(argv: list[str] | None = None) -> int:
    return daemon_main("cell", "Cell: hosts an engine (rollout) or a trainer replica (training).",
                       config_from_context, run, argv, extra_args=_args)


if __name__ == "__main__":
    raise SystemExit(main())
