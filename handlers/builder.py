"""Builder daemon: wires gyre.trajectory.builder to the bus.

Consumes `call.completed` (durable `builder-calls-v1`) and `execution.scored`
(`builder-v1`); publishes packed micro-steps (object store + `microstep.ready`) and
`step.sealed`. Calls whose token arrays were moved to the object store are fetched.

Restart (a kill -9 included) recovers everything: the trees, scores and step tallies live
only in memory and both consumers ack on return, so before consuming, `recover` rebuilds
them from the run's retained streams (no snapshot: the streams keep every fact until the
run ends, and re-deriving is what the policy does anyway):
1. the `microstep.ready` and `step.sealed` already published: a sealed step's groups are
   final (their calls and scores are not read again; a call of theirs arriving now is late);
   a group with published micro-steps keeps its first index (`BuilderPolicy.reserve`), and
   fresh ranges start after the highest published index, so a re-finalised group gets the
   ids it had and no id names two contents;
2. every stored `call.completed` of the other executions, then every stored
   `execution.scored` in stream order (the order the live consumer, concurrency 1, used),
   through the live handlers, except that a micro-step or seal already on the bus is not
   published again (not even after the streams' duplicate windows have passed).
Then the durables redeliver what was not acked; the policy ignores what it already holds.
A restarted builder thus publishes each micro-step of an unsealed step exactly once. What
it cannot restore: a call that arrived after its group was finalised is counted late by the
live builder but filed by the replay (calls are replayed before scores), so only such a
group's packing could differ.
"""
from __future__ import annotations

import asyncio
import dataclasses

import structlog

import schemas
from bus import Bus, subjects
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
    calls_wait_s: float = 30.0
    """Most seconds a score waits for the calls stored before it to be handled (`calls_caught_up`); 0 = never."""


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
        self.published: set[tuple[int, int]] = set()  # (step, micro-step) a predecessor published
        self.sealed_before: set[int] = set()

    async def recover(self) -> dict:
        """Rebuild the policy from the run's streams (module docstring); returns what was found."""
        out = await self.bus.stored_events([schemas.MicrostepReady.NAME, schemas.StepSealed.NAME])
        first: dict[str, tuple[int, int]] = {}  # execution → (step, lowest published index)
        for e in out:
            if isinstance(e, schemas.StepSealed):
                self.sealed_before.add(e.step)
                continue
            self.published.add((e.step, e.microstep))
            self.policy.floor(e.step, e.microstep)
            for x in e.executions:
                first[x.execution] = min(first.get(x.execution, (e.step, e.microstep)), (e.step, e.microstep))
        scores = [e for e in await self.bus.stored_events([schemas.ExecutionScored.NAME])
                  if isinstance(e, schemas.ExecutionScored)]
        done: dict[int, dict[str, list[str]]] = {}
        live: set[str] = set()
        for s in scores:
            i = s.info
            if i.step in self.sealed_before:
                members = done.setdefault(i.step, {}).setdefault(i.group, [])
                if i.execution not in members:
                    members.append(i.execution)
                continue
            live.add(i.execution)
            if i.execution in first:
                step, index = first[i.execution]
                self.policy.reserve(step, i.group, index)
        for step, groups in done.items():
            self.policy.mark_sealed(step, groups)
        sealed_executions = {e for groups in done.values() for es in groups.values() for e in es}
        calls = await self.bus.stored_events([schemas.CallCompleted.NAME],
                             lambda e: isinstance(e, schemas.CallCompleted) and e.execution not in sealed_executions)
        for call in calls:
            await self.handle_call(call)
        for s in scores:
            if s.info.execution in live:
                await self.add_score(s)  # its calls are in: replayed above
        found = {"microsteps_published": len(self.published), "steps_sealed": len(self.sealed_before),
                 "calls": len(calls), "scores": len(scores), "trees": len(self.policy.trees)}
        log.info("builder.recovered", **found)
        return found

    async def handle_call(self, event: schemas.CallCompleted) -> None:
        if event.tokens_ref:
            tokens = schemas.decode_part(schemas.CallTokens, await self.bus.get_object(event.tokens_ref))
            event = dataclasses.replace(event, tokens=tokens, tokens_ref=None)
        async with self.lock:
            self.policy.add_call(event)

    async def calls_caught_up(self) -> None:
        """Wait (at most `calls_wait_s`) until the calls consumer has handled every
        `call.completed` stored now: the two durables run side by side, and a score taken
        before its execution's calls (a backlog after a restart or an outage) would finalise
        the group without them (they would come late, never trained)."""
        stream = subjects.stream("CALLS").stream_name(self.cfg.run)
        last = (await self.bus.js.stream_info(stream)).state.last_seq
        deadline = asyncio.get_running_loop().time() + self.cfg.calls_wait_s
        while (await self.bus.js.consumer_info(stream, "builder-calls-v1")).ack_floor.stream_seq < last:
            if asyncio.get_running_loop().time() > deadline:
                log.warning("builder.calls.behind", stream_seq=last, waited_s=self.cfg.calls_wait_s)
                return
            await asyncio.sleep(0.05)

    async def handle_execution(self, event) -> None:
        if not isinstance(event, schemas.ExecutionScored):
            return
        if self.cfg.calls_wait_s > 0:
            await self.calls_caught_up()
        await self.add_score(event)

    async def add_score(self, event: schemas.ExecutionScored) -> None:
        """File a score; publish the micro-steps and seal it completes (not those already on the bus)."""
        async with self.lock:
            microsteps, sealed = await asyncio.to_thread(self.policy.add_score, event)
            for ms in microsteps:
                if (ms.step, ms.index) in self.published:  # a predecessor published it (recover)
                    continue
                key = f"step-{ms.step}/mstep-{ms.index}"
                await self.bus.put_object(key, to_bytes(ms))
                summary = ms.execution_summary()
                await self.bus.publish(schemas.MicrostepReady(
                    event_id=ids.microstep(self.cfg.run, ms.step, ms.index), step=ms.step, microstep=ms.index,
                    key=key, executions=tuple(schemas.MicrostepExecution(execution=e, n_tokens=n, advantage=a)
                                              for e, n, a in summary),
                    tokens=ms.n_tokens, trained=ms.n_trained, trajectories=ms.n_trajectories))
            if sealed is not None and sealed.step not in self.sealed_before:
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
        await builder.recover()
        await run_loops(bus.consume("builder-calls-v1", builder.handle_call, stop=stop),
                        bus.consume("builder-v1", builder.handle_execution, stop=stop))


def main(argv: list[str] | None = None) -> int:
    return daemon_main("builder", "Builder: trajectory trees → samples → micro-steps.", config_from_context, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
