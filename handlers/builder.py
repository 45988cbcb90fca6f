"""Builder daemon: wires gyre.trajectory.builder to the bus.

Consumes `call.completed` (durable `builder-calls-v1`) and `execution.scored`
(`builder-v1`); publishes packed micro-steps (object store + `microstep.ready`) and
`step.sealed`. Calls whose token arrays were moved to the object store are fetched.
"""
from __future__ import annotations

import asyncio
import dataclasses

import structlog

import schemas
from bus import Bus
from gyre.config import TrainSection
from gyre.trajectory.builder import BuilderPolicy, Sealed
from gyre.trajectory.microstep import to_bytes
from handlers.daemon import RunContext, connected, daemon_main, run_loops
from schemas import ids

log = structlog.get_logger()


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Config:
    """The builder's settings. run, nats_url, nats_token: the bus (`handlers.daemon.BusSettings`)."""

    run: str
    nats_url: str
    nats_token: str | None
    train: TrainSection = TrainSection()
    """Trajectory selection and packing: `microstep_tokens`, `j_max`, `max_staleness`."""
    seed: int = 0
    """The recipe's `run.seed`: seeds trajectory selection."""


def config_from_context(ctx: RunContext, _args=None) -> Config:
    return Config(run=ctx.run, nats_url=ctx.nats_url, nats_token=ctx.nats_token, train=ctx.recipe.train,
                  seed=ctx.recipe.run.seed)


class Builder:
    def __init__(self, cfg: Config, bus: Bus) -> None:
        self.cfg = cfg
        self.bus = bus
        self.policy = BuilderPolicy(j_max=cfg.train.j_max, max_staleness=cfg.train.max_staleness,
                                    token_budget=cfg.train.microstep_tokens, seed=cfg.seed)
        self.lock = asyncio.Lock()

    async def handle_call(self, event: schemas.CallCompleted) -> None:
        if event.tokens_ref:
            tokens = schemas.decode_part(schemas.CallTokens, await self.bus.get_object(event.tokens_ref))
            event = dataclasses.replace(event, tokens=tokens, tokens_ref=None)
        async with self.lock:
            self.policy.add_call(event)

    async def handle_execution(self, event) -> None:
        if not isinstance(event, schemas.ExecutionScored):
            return
        async with self.lock:
            microsteps, sealed = await asyncio.to_thread(self.policy.add_score, event)
            for ms in microsteps:
                key = f"step-{ms.step}/mstep-{ms.index}"
                await self.bus.put_object(key, to_bytes(ms))
                summary = ms.execution_summary()
                await self.bus.publish(schemas.MicrostepReady(
                    event_id=ids.microstep(self.cfg.run, ms.step, ms.index), step=ms.step, microstep=ms.index,
                    key=key, executions=tuple(schemas.MicrostepExecution(execution=e, n_tokens=n, advantage=a)
                                              for e, n, a in summary),
                    tokens=ms.n_tokens, trained=ms.n_trained, trajectories=ms.n_trajectories))
            if sealed is not None:
                await self._seal(sealed)

    async def _seal(self, s: Sealed) -> None:
        await self.bus.publish(schemas.StepSealed(
            event_id=ids.sealed(self.cfg.run, s.step), step=s.step, microsteps=s.microsteps, executions=s.executions,
            groups=s.groups, zero_variance_groups=s.zero_variance_groups, excluded=s.excluded,
            reward_mean=s.reward_mean))
        log.info("builder.step.sealed", step=s.step, microsteps=s.microsteps, executions=s.executions,
                 zero_variance_groups=s.zero_variance_groups, late_calls=self.policy.late_calls)


async def run(cfg: Config, stop: asyncio.Event) -> None:
    async with connected(cfg, stop, "builder") as bus:
        builder = Builder(cfg, bus)
        await run_loops(bus.consume("builder-calls-v1", builder.handle_call, stop=stop),
                        bus.consume("builder-v1", builder.handle_execution, stop=stop))


def main(argv: list[str] | None = None) -> int:
    return daemon_main("builder", "Builder: trajectory trees → samples → micro-steps.", config_from_context, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
