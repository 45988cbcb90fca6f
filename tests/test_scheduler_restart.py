"""The scheduler daemon against a real nats-server: facts in, actions out, its trace, and a
restart that rebuilds the policy from the trace (handlers/scheduler.py)."""
from __future__ import annotations

import asyncio
import json

import pytest

import schemas
from bus import Bus
from gyre.config import load_recipe
from gyre.control import trace
from handlers import scheduler
from handlers.daemon import FatalError, RunContext
from schemas import ids


def config(run_id, tmp_path, server, **overrides):
    recipe = load_recipe("toy", {"cells.count": 2, "cells.capacity": 2, "tasks.group_size": 2, "run.mode": "elastic",
                                 **overrides})
    ctx = RunContext(run=run_id, run_dir=tmp_path, recipe=recipe, nats_url=server.url, nats_token=server.token,
                     key_secret=b"k" * 32)
    return scheduler.config_from_context(ctx)


def info(execution: str) -> schemas.ExecutionInfo:
    step, group, _ = execution.split("-")
    return schemas.ExecutionInfo(execution=execution, task="t", group=f"{step}-{group}", step=int(step[1:]),
                                 harness="toy", group_size=2, step_groups=2)


def finished(run: str, execution: str) -> schemas.ExecutionFinished:
    return schemas.ExecutionFinished(event_id=ids.finished(run, execution), info=info(execution), status="ok",
                                     workspace="")


def traced(path) -> list[dict]:
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # the torn line, until the restarted scheduler rewrites the trace
            pass
    return out


async def until(predicate, what: str, timeout_s: float = 20.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, what
        await asyncio.sleep(0.05)


def dispatched(path) -> list[str]:
    return [x[0] for a in traced(path) if a.get("action") == "dispatch" for x in a["executions"]]


async def routes_on_bus(bus: Bus) -> list[schemas.RouteUpdated]:
    got: list = []
    stop, caught = asyncio.Event(), asyncio.Event()

    async def on(event):
        got.append(event)

    task = asyncio.create_task(bus.replay([schemas.RouteUpdated.NAME], on, stop=stop, caught_up=caught))
    await asyncio.wait_for(caught.wait(), 20)
    stop.set()
    await task
    return got


async def test_a_restarted_scheduler_goes_on_from_its_trace_and_consumes_a_redelivered_event_once(
        nats_server, run_id, tmp_path):
    cfg = config(run_id, tmp_path, nats_server)
    path = cfg.trace_path
    bus = await Bus.connect(nats_server.url, token=nats_server.token, run=run_id, name="test")
    await bus.ensure_streams()
    stop = asyncio.Event()
    first = asyncio.create_task(scheduler.run(cfg, stop))
    for cell in ("cell0", "cell1"):
        await bus.publish(schemas.CellSwitched(event_id=ids.announce(run_id, cell), cell=cell, seq=0, from_role="idle",
                                               to_role="rollout", durations={"total_s": 0.0}, policy_version=0))
    await until(lambda: path.exists() and len(dispatched(path)) == 4, "burst 0 on two cells of C_e = 2")
    await bus.publish(finished(run_id, "s0-g0-e0"))
    await until(lambda: len(dispatched(path)) == 5, "a freed slot takes burst 1's first execution")
    stop.set()
    await first

    # The next scheduler of this run died after tracing the finish of s0-g0-e1, before it
    # published what the fact led to and acked the event: that is what its trace holds.
    lines = path.read_text().splitlines()
    obj = trace.encode(scheduler.facts_of(finished(run_id, "s0-g0-e1"), json.loads(lines[-1])["t"])[0])
    obj["id"] = ids.finished(run_id, "s0-g0-e1")
    path.write_text("\n".join(lines + [json.dumps(obj), '{"t": 9']) + "\n")  # and a torn line

    stop = asyncio.Event()
    second = asyncio.create_task(scheduler.run(cfg, stop))
    await until(lambda: len(dispatched(path)) == 6, "the traced fact's dispatch, taken again")
    await bus.publish(finished(run_id, "s0-g0-e1"))  # the redelivery: consumed once
    await bus.publish(finished(run_id, "s0-g1-e0"))
    await until(lambda: len(dispatched(path)) == 7, "the next finish's dispatch")
    await asyncio.sleep(0.5)
    stop.set()
    await second

    assert '{"t": 9\n' not in path.read_text()
    lines = traced(path)
    assert sum(1 for x in lines if "trace" in x) == 1
    assert [x["execution"] for x in lines if x.get("fact") == "execution.finished"] == [
        "s0-g0-e0", "s0-g0-e1", "s0-g1-e0"]
    assert sorted(dispatched(path)) == sorted({*dispatched(path)})  # each execution dispatched once
    with open(path) as f:
        assert trace.replay(f) == []
    # On the bus: one route.updated per traced dispatch, seqs 0.. without a gap or a repeat
    # (the republished dispatch was a duplicate of nothing: the first scheduler never sent it).
    routes = await routes_on_bus(bus)
    await bus.close()
    assert [e.seq for e in routes] == list(range(sum(1 for x in lines if x.get("action") == "dispatch")))
    assert [r.execution for e in routes for r in e.routes] == dispatched(path)


def test_a_trace_of_another_schedule_is_refused(nats_server, run_id, tmp_path):
    cfg = config(run_id, tmp_path, nats_server)
    s = scheduler.Scheduler(cfg, bus=None, tasks=["t"])
    s.open_trace()
    s.close()
    other = scheduler.Scheduler(config(run_id, tmp_path, nats_server, **{"run.mode": "colocate"}), bus=None,
                                tasks=["t"])
    with pytest.raises(FatalError, match="another schedule"):
        other.open_trace()


async def test_a_switch_carries_the_reroute_published_just_before_it(tmp_path):
    """`cell.switch` names the executions the reroute before it moved and that route's seq:
    the cell hands their KV blocks to their new cells (handlers.transfer.kv_move)."""
    from gyre.control import facts as F

    class Recording:
        def __init__(self):
            self.events = []

        async def publish(self, event):
            self.events.append(event)
            return True

    bus = Recording()
    offline = type("Server", (), {"url": "nats://127.0.0.1:9", "token": None})
    sched = scheduler.Scheduler(config("r1", tmp_path, offline), bus, ["t"])
    sched.route_seq = 3
    moved = F.Reroute(routes=(F.Route(execution="s0-g0-e0", engine="cell1"), F.Route(execution="s0-g0-e1", engine=None)),
                      reason="cell0 to training")
    back = F.Switch(cell="cell1", from_role="training", to_role="rollout", reason="return", step=0)
    await sched.act([moved, F.Switch(cell="cell0", from_role="rollout", to_role="training", reason="water level",
                                     step=0), F.OpenStep(step=1), back])
    route, switch, other = bus.events
    assert route.seq == switch.route_seq == 3
    assert switch.moved == route.routes == (schemas.Route(execution="s0-g0-e0", cell="cell1", reason="cell0 to training"),
                                            schemas.Route(execution="s0-g0-e1", cell="", reason="cell0 to training"))
    assert (other.cell, other.moved, other.route_seq) == ("cell1", (), -1)  # not after that reroute
