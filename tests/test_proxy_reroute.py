"""The proxy moves calls on `route.updated` (handlers.proxy.router): the scheduler publishes
the reroute of a switching cell's executions before the switch, and the proxy cuts their
requests in flight at the old cell at once (aborted there), retries them at the new cell
with the KV hint (`gyre_kv_from`), and the harness sees a normal answer: one recorded call,
drift 0, the retry counted by reason. A real nats-server carries the events; the engines are
scripted (they speak SGLang's /generate)."""
from __future__ import annotations

import asyncio

import pytest
from prometheus_client import REGISTRY

from schemas import ids
from schemas.cell import CellSwitched, Route, RouteUpdated
from tests.test_proxy import TASK, Stack, bus, tok  # noqa: F401 - fixtures


@pytest.fixture
async def stack(tok, bus, run_id):  # noqa: F811
    s = Stack(tok, bus, run_id)
    yield s
    await s.close()


def retries(reason: str) -> float:
    return REGISTRY.get_sample_value("gyre_proxy_retries_total", {"reason": reason}) or 0.0


async def until(predicate, what: str, timeout_s: float = 10.0) -> None:
    for _ in range(int(timeout_s / 0.02)):
        if predicate():
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


async def test_a_moved_call_in_flight_is_cut_at_its_cell_and_answered_at_the_new_one(stack, bus, run_id):  # noqa: F811
    source = await stack.engine(["from the old cell"], delay_s=30.0)
    dest = await stack.engine(["from the new cell"])
    await stack.proxy()
    state = stack.state
    stop = asyncio.Event()
    replay = asyncio.create_task(bus.replay(["cell.switched", "route.updated"], state.handle_event, stop=stop,
                                            poll_s=0.1))
    try:
        for seq, (cell, engine) in enumerate((("c0", source), ("c1", dest))):
            await bus.publish(CellSwitched(event_id=ids.switched(run_id, cell, 0), cell=cell, seq=0,
                                           from_role="idle", to_role="rollout", durations={}, engine_url=engine.url))
        await bus.publish(RouteUpdated(event_id=ids.route(run_id, 0), seq=0, routes=(
            Route(execution="ex-moved", cell="c0"), Route(execution="ex-paused", cell="c0"))))
        await until(lambda: len(state.router.cells) == 2 and "ex-paused" in state.router.routes, "cells and routes")
        before = retries("rerouted")

        moved = asyncio.ensure_future(stack.client("ex-moved").chat.completions.create(model="m", messages=[TASK]))
        paused = asyncio.ensure_future(stack.client("ex-paused").chat.completions.create(model="m", messages=[TASK]))
        await until(lambda: len(source.requests) == 2, "both calls at the old cell")
        # The scheduler moves c0's executions (reason as gyre.control.policy words it): one to
        # c1, one paused (no cell has room), before it switches c0.
        await bus.publish(RouteUpdated(event_id=ids.route(run_id, 1), seq=1, routes=(
            Route(execution="ex-moved", cell="c1", reason="c0 to training"),
            Route(execution="ex-paused", cell="", reason="c0 to training"))))
        answer = await asyncio.wait_for(moved, 10)
        assert answer.choices[0].message.content == "from the new cell"  # the harness saw no error
        await until(lambda: {r["rid"] for r in source.requests} <= source.aborted, "the upstream aborts at c0")
        assert dest.requests[0]["gyre_execution"] == "ex-moved"
        assert dest.requests[0]["gyre_kv_from"] == {"cell": "c0", "route": 1}  # its KV is at c0

        # The paused execution's call waits (keep-alives) until a later route names a cell;
        # its KV was dropped with the old cell's cache, so it carries no hint.
        await asyncio.sleep(0.3)
        assert not paused.done() and len(dest.requests) == 1
        await bus.publish(RouteUpdated(event_id=ids.route(run_id, 2), seq=2, routes=(
            Route(execution="ex-paused", cell="c1", reason="resume"),)))
        answer = await asyncio.wait_for(paused, 10)
        assert answer.choices[0].message.content == "from the new cell"
        assert "gyre_kv_from" not in dest.requests[1]

        events = await stack.calls(2)
        assert [(e.execution, e.status, e.cell, e.drift) for e in events] == [
            ("ex-moved", "ok", "c1", 0), ("ex-paused", "ok", "c1", 0)]
        with pytest.raises(asyncio.TimeoutError):  # one recorded call each, never the cut attempt
            await stack.calls(1, timeout_s=1.0)
        assert state.engines.retries == {"rerouted": 2}
        assert retries("rerouted") - before == 2
        assert state.router.inflight == {} and state.router.running == {}

        # A call answered at the new cell takes the hint away: the next one carries none.
        follow_up = [TASK, {"role": "assistant", "content": "from the new cell"}, {"role": "user", "content": "go on"}]
        await stack.client("ex-moved").chat.completions.create(model="m", messages=follow_up)
        assert "gyre_kv_from" not in dest.requests[-1] and dest.requests[-1]["gyre_execution"] == "ex-moved"
    finally:
        stop.set()
        await asyncio.wait_for(replay, 10)
