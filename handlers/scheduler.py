"""Scheduler daemon: wires the scheduling policy (gyre.control.colocate) to the bus.

Consumes `execution.finished`, `step.completed` and `cell.switched`; publishes
`execution.dispatched` (work queue of the runner), `route.updated` and `cell.switch`.
The policy is rebuilt from history on restart: the durable consumers redeliver what
was not acked, and every published fact has a deterministic id, so a replayed
decision is deduplicated by JetStream.
"""
from __future__ import annotations

import asyncio
import dataclasses

import structlog

import schemas
from bus import Bus
from gyre.config import CellsSection, HarnessSection, RunSection, TasksSection
from gyre.control.colocate import ColocatePolicy, Dispatch, Done, Switch
from gyre.env.tasks import load_tasks
from handlers.daemon import RunContext, connected, daemon_main, run_loops
from handlers.metrics import WATER_LEVEL
from schemas import ids

log = structlog.get_logger()


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Config:
    """The scheduler's settings. run, nats_url, nats_token: the bus (`handlers.daemon.BusSettings`)."""

    run: str
    nats_url: str
    nats_token: str | None
    schedule: RunSection
    """The recipe's [run]: steps to run, the seed of task order, the scheduling mode."""
    tasks: TasksSection
    """The task set and the tasks (groups) per step, executions per group."""
    harness: HarnessSection
    """The harness profile and the per-execution limits (timeout_s, max_calls) passed to the runner."""
    cells: CellsSection
    """The cells, in switch order (core first)."""


def config_from_context(ctx: RunContext, _args=None) -> Config:
    r = ctx.recipe
    return Config(run=ctx.run, nats_url=ctx.nats_url, nats_token=ctx.nats_token, schedule=r.run, tasks=r.tasks,
                  harness=r.harness, cells=r.cells)


class Scheduler:
    """Holds the policy and the counters that make published ids deterministic."""

    def __init__(self, cfg: Config, bus: Bus, tasks: list[str]) -> None:
        self.cfg = cfg
        self.bus = bus
        self.policy = ColocatePolicy(tasks=tasks, cells=list(cfg.cells.ids), steps=cfg.schedule.steps,
                                     groups_per_step=cfg.tasks.groups_per_step, group_size=cfg.tasks.group_size,
                                     seed=cfg.schedule.seed)
        self.switch_seq = {c: 0 for c in cfg.cells.ids}
        self.route_seq = 0
        self.done = asyncio.Event()
        self.lock = asyncio.Lock()

    async def act(self, actions) -> None:
        for action in actions:
            if isinstance(action, Dispatch):
                await self._dispatch(action)
            elif isinstance(action, Switch):
                seq = self.switch_seq[action.cell]
                self.switch_seq[action.cell] += 1
                await self.bus.publish(schemas.CellSwitch(
                    event_id=ids.switch(self.cfg.run, action.cell, seq), cell=action.cell, seq=seq,
                    from_role=action.from_role, to_role=action.to_role, reason=action.reason, step=action.step))
                log.info("scheduler.switch", cell=action.cell, to_role=action.to_role, step=action.step)
            elif isinstance(action, Done):
                log.info("scheduler.done", steps=action.steps)
                self.done.set()
        WATER_LEVEL.set(self.policy.water_level)

    async def _dispatch(self, burst: Dispatch) -> None:
        routes = tuple(schemas.Route(execution=e.execution, cell=e.cell, reason="dispatch") for e in burst.executions)
        await self.bus.publish(schemas.RouteUpdated(event_id=ids.route(self.cfg.run, self.route_seq),
                                                    seq=self.route_seq, routes=routes))
        self.route_seq += 1
        for e in burst.executions:
            info = schemas.ExecutionInfo(execution=e.execution, task=e.task, group=e.group, step=e.step,
                                         harness=self.cfg.harness.name, group_size=e.group_size,
                                         step_groups=e.step_groups)
            await self.bus.publish(schemas.ExecutionDispatched(
                event_id=ids.dispatched(self.cfg.run, e.execution), info=info,
                timeout_s=self.cfg.harness.timeout_s, max_calls=self.cfg.harness.max_calls))
        log.info("scheduler.dispatched", step=burst.step, executions=len(burst.executions),
                 water_level=self.policy.water_level)

    async def handle_execution(self, event) -> None:
        if isinstance(event, schemas.ExecutionFinished):
            async with self.lock:
                await self.act(self.policy.on_execution_finished(event.info.step, event.info.execution))

    async def handle_step(self, event) -> None:
        if isinstance(event, schemas.StepCompleted):
            async with self.lock:
                await self.act(self.policy.on_step_completed(event.step))

    async def handle_cell(self, event) -> None:
        if isinstance(event, schemas.CellSwitched):
            async with self.lock:
                await self.act(self.policy.on_cell_switched(event.cell, event.to_role))


async def run(cfg: Config, stop: asyncio.Event) -> None:
    tasks = [t.instance_id for t in load_tasks(cfg.tasks.set)]
    async with connected(cfg, stop, "scheduler") as bus:
        sched = Scheduler(cfg, bus, tasks)
        await run_loops(bus.consume("scheduler-v1", sched.handle_execution, stop=stop),
                        bus.consume("scheduler-steps-v1", sched.handle_step, stop=stop),
                        bus.consume("scheduler-cells-v1", sched.handle_cell, stop=stop))


def main(argv: list[str] | None = None) -> int:
    return daemon_main("scheduler", "Scheduler: water level, cell roles, step lifecycle.", config_from_context, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
