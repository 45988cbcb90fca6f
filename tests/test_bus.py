"""bus/: delivery semantics against a real nats-server (dedup, redelivery, DLQ, stalls, drain)."""
from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time

import nats
import nats.errors
import nats.js.errors
import pytest
from pathlib import Path

import schemas
from bus import (
    Backoff,
    Bus,
    BusConfig,
    Delivery,
    Invalid,
    PayloadTooLarge,
    Retry,
    classify,
    subjects,
    too_big,
)
from bus import client as bus_module
from bus import consumer as bus_consumer

FAST = Backoff(base_s=0.05, max_s=0.2)
POLL = 0.2


def switch(run: str, i: int, cell: str = "c0") -> schemas.CellSwitch:
    return schemas.CellSwitch(event_id=f"{run}:cell:{cell}:switch:{i}", cell=cell, seq=i, from_role="idle",
                              to_role="rollout", reason="test")


def spec(name: str, **kw) -> subjects.ConsumerSpec:
    return subjects.ConsumerSpec(name, "CELLS", ("cell.switch",), **kw)


async def until(predicate, timeout_s: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not predicate():
        if loop.time() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.02)


def _all_threads_stopped(pid: int) -> bool:
    states = []
    for stat in Path(f"/proc/{pid}/task").glob("*/stat"):
        with contextlib.suppress(OSError):  # a thread that just ended
            states.append(stat.read_text().rsplit(")", 1)[1].split()[0])
    return bool(states) and all(state in "tT" for state in states)


async def freeze(process) -> None:
    """SIGSTOP `process` (a nats-server: a partition, a hung host) and return once every
    thread of it has stopped: one still running just after the signal could answer a PING."""
    os.kill(process.pid, signal.SIGSTOP)
    await until(lambda: _all_threads_stopped(process.pid))


async def connect(nats_server, run_id, name="test") -> Bus:
    return await Bus.connect(nats_server.url, token=nats_server.token, run=run_id, name=name,
                             config=BusConfig(connect_timeout_s=5.0, drain_timeout_s=5.0))


@pytest.fixture
async def bus(nats_server, run_id):
    b = await connect(nats_server, run_id)
    await b.ensure_streams()
    yield b
    await b.close()


def cells_stream(run: str) -> str:
    return subjects.stream("CELLS").stream_name(run)


class Consumer:
    """Runs bus.consume in a task; `stop()` sets the event and awaits it."""

    def __init__(self, bus: Bus, durable, handler, **kw):
        self.stop_event = asyncio.Event()
        kw.setdefault("poll_s", POLL)
        kw.setdefault("backoff", FAST)
        self.task = asyncio.create_task(bus.consume(durable, handler, stop=self.stop_event, **kw))

    async def stop(self) -> None:
        self.stop_event.set()
        await asyncio.wait_for(self.task, 10)


# ---- pure mapping -------------------------------------------------------------------------

def test_classify_maps_each_outcome_once():
    b = Backoff(base_s=1.0, max_s=60.0)
    assert classify(None, 1, b).action == "ack"
    assert classify(Retry(2.5), 1, b) == bus_consumer.Outcome("nak", 2.5, "retry")
    assert classify(Retry(), 3, b).delay_s == 4.0  # 1 * 2**(3-1)
    assert classify(Invalid("bad cell"), 1, b) == bus_consumer.Outcome("term", None, "bad cell")
    assert classify(schemas.SchemaError("x.y: bad"), 1, b).action == "term"
    other = classify(RuntimeError("boom"), 2, b)
    assert (other.action, other.delay_s) == ("nak", 2.0)
    assert b.delay(10) == 60.0  # 2**9 = 512 capped at 60
    with pytest.raises(ValueError, match="max_s"):
        Backoff(base_s=2.0, max_s=1.0)


def test_too_big_threshold():
    assert not too_big(b"x" * (256 * 1024))
    assert too_big(b"x" * (256 * 1024 + 1))


# ---- declarations -------------------------------------------------------------------------

async def test_ensure_streams_idempotent_and_concurrent(bus, nats_server, run_id):
    await bus.ensure_streams()
    a, b = await connect(nats_server, run_id, "a"), await connect(nats_server, run_id, "b")
    try:
        await asyncio.gather(a.ensure_streams(), b.ensure_streams())
    finally:
        await a.close()
        await b.close()
    for s in subjects.STREAMS:
        info = await bus.js.stream_info(s.stream_name(run_id))
        assert info.config.duplicate_window == s.duplicate_window_s
        assert str(getattr(info.config.retention, "value", info.config.retention)) == ("workqueue" if s.work_queue else "limits")
    for c in subjects.CONSUMERS:
        info = await bus.js.consumer_info(subjects.stream(c.stream).stream_name(run_id), c.durable)
        assert info.config.ack_wait == c.ack_wait_s
        assert info.config.max_ack_pending == c.max_ack_pending


async def test_ensure_consumer_updates_in_place(bus, run_id):
    await bus.ensure_consumer(spec("cell-c0-v1", ack_wait_s=5.0))
    await bus.ensure_consumer(spec("cell-c0-v1", ack_wait_s=7.0))
    info = await bus.js.consumer_info(cells_stream(run_id), "cell-c0-v1")
    assert info.config.ack_wait == 7.0


def test_close_after_the_server_went_away_does_not_raise_under_uvloop(tmp_path):
    """nats-py's close writes pending bytes into the dead transport, which uvloop refuses
    (RuntimeError: the handler is closed): a daemon stopping after its run's server ended
    exited 1 with a traceback."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(f"""
        import asyncio, uvloop
        from bus import Bus, BusConfig
        from bus.server import NatsServer

        async def main():
            srv = NatsServer.start({str(tmp_path / "nats")!r})
            bus = await Bus.connect(srv.url, token=srv.token, run="r1", name="t",
                                    config=BusConfig(drain_timeout_s=2.0))
            await bus.ensure_streams()
            stop = asyncio.Event()
            replay = asyncio.create_task(bus.replay(["cell.switched"], lambda e: asyncio.sleep(0), stop=stop))
            await asyncio.sleep(0.5)
            srv.stop()
            await asyncio.sleep(1.5)
            await bus.close()
            print("closed", bus.nc.is_closed)
            stop.set()
            await asyncio.wait_for(replay, 10)

        uvloop.run(main())
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                         cwd=str(Path(__file__).resolve().parents[1]))
    assert out.returncode == 0 and "closed True" in out.stdout, out.stderr[-2000:]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_server_goes_when_the_process_that_started_it_is_killed(tmp_path):
    """A `gyre run` killed with SIGKILL runs no cleanup; its private server used to run on."""
    import subprocess
    import textwrap

    script = textwrap.dedent(f"""
        import time
        from bus.server import NatsServer
        srv = NatsServer.start({str(tmp_path / "nats")!r})
        print(srv.process.pid, flush=True)
        time.sleep(120)
    """)
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                              cwd=str(Path(__file__).resolve().parents[1]))
    server_pid = None
    try:
        server_pid = int(parent.stdout.readline())
        assert _alive(server_pid)
        parent.kill()
        parent.wait(10)
        deadline = time.monotonic() + 10
        while _alive(server_pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(server_pid), "nats-server outlived the process that started it"
    finally:
        parent.kill()
        parent.stdout.close()
        if server_pid is not None and _alive(server_pid):
            os.kill(server_pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    """Running and not a zombie (the server's parent, init, may not have reaped it yet)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


# ---- publishing ---------------------------------------------------------------------------

async def test_publish_dedups_by_event_id(bus, run_id):
    ev = switch(run_id, 0)
    assert await bus.publish(ev) is True
    assert await bus.publish(ev) is False
    info = await bus.js.stream_info(cells_stream(run_id))
    assert info.state.messages == 1
    msg = await bus.js.get_msg(cells_stream(run_id), 1)
    assert msg.headers["Nats-Msg-Id"] == ev.event_id
    assert schemas.decode("cell.switch", msg.data) == ev


async def test_stored_ids_lists_an_events_ids_in_order_with_headers_only(bus, run_id):
    consumers = (await bus.js.stream_info(cells_stream(run_id))).state.consumer_count
    events = [switch(run_id, k) for k in range(5)]
    for ev in events:
        await bus.publish(ev)
    await bus.publish(schemas.CellSwitched(event_id=f"{run_id}:cell:c0:switched:0", cell="c0", seq=0,
                                           from_role="idle", to_role="rollout", durations={}))
    await bus.publish(switch(run_id, 5), headers={"Gyre-Request-Kind": "count_tokens"})
    stored = await bus.stored_ids("cell.switch", batch=2)
    assert list(stored) == [ev.event_id for ev in events] + [switch(run_id, 5).event_id]
    assert [h.get("Gyre-Request-Kind") for h in stored.values()] == [None] * 5 + ["count_tokens"]
    assert await bus.stored_ids("call.completed") == {}
    with pytest.raises(ValueError, match="work queue"):
        await bus.stored_ids("execution.dispatched")
    info = await bus.js.stream_info(cells_stream(run_id))
    assert info.state.consumer_count == consumers  # its consumers are gone


@pytest.mark.parametrize("failure, stored", [(nats.errors.TimeoutError, True),
                                              (nats.js.errors.NoStreamResponseError, False)])
async def test_a_duplicate_after_a_retry_counts_as_stored_only_if_the_failed_attempt_may_have_landed(
        bus, run_id, monkeypatch, failure, stored):
    """The id is already on the server; the first attempt fails. After a PubAck timeout the
    duplicate is our own attempt (stored); after "no stream" it is somebody else's."""
    ev = switch(run_id, 0)
    assert await bus.publish(ev) is True
    real, calls = bus.js.publish, []

    async def flaky(*args, **kw):
        calls.append(1)
        if len(calls) == 1:
            raise failure()
        return await real(*args, **kw)

    monkeypatch.setattr(bus.js, "publish", flaky)
    assert await bus.publish(ev) is stored and len(calls) == 2


async def test_publish_refuses_oversized_event(bus, run_id):
    ev = schemas.CellSwitch(event_id="big", cell="c0", seq=0, from_role="idle", to_role="rollout",
                            reason="x" * (950 * 1024))
    assert too_big(ev)
    with pytest.raises(PayloadTooLarge, match="object store"):
        await bus.publish(ev)


# ---- consuming ----------------------------------------------------------------------------

async def test_redelivery_after_ack_wait_when_handler_is_stuck(bus, run_id):
    await bus.ensure_consumer(spec("stuck-v1", ack_wait_s=1.0))
    release = asyncio.Event()
    seen: list[tuple[str, int]] = []

    async def stuck(event, meta: Delivery):
        seen.append(("a", meta.num_delivered))
        await release.wait()

    async def healthy(event, meta: Delivery):
        seen.append(("b", meta.num_delivered))

    a = Consumer(bus, "stuck-v1", stuck, with_meta=True, heartbeat_s=0)
    await bus.publish(switch(run_id, 0))
    await until(lambda: seen)
    b = Consumer(bus, "stuck-v1", healthy, with_meta=True)
    await until(lambda: len(seen) == 2)
    assert seen == [("a", 1), ("b", 2)]
    release.set()
    await a.stop()
    await b.stop()


async def test_retry_naks_with_delay_then_succeeds(bus, run_id):
    await bus.ensure_consumer(spec("retry-v1", ack_wait_s=5.0))
    deliveries: list[int] = []

    async def handler(event, meta):
        deliveries.append(meta.num_delivered)
        if meta.num_delivered == 1:
            raise Retry(0.2)

    c = Consumer(bus, "retry-v1", handler, with_meta=True)
    await bus.publish(switch(run_id, 0))
    await until(lambda: len(deliveries) == 2)
    await c.stop()
    assert deliveries == [1, 2]
    info = await bus.js.consumer_info(cells_stream(run_id), "retry-v1")
    assert info.num_ack_pending == 0


async def test_unexpected_exception_is_redelivered_not_lost(bus, run_id):
    await bus.ensure_consumer(spec("boom-v1", ack_wait_s=5.0))
    handled: list[int] = []

    async def handler(event, meta):
        if meta.num_delivered < 3:
            raise RuntimeError("transient bug")
        handled.append(event.seq)

    c = Consumer(bus, "boom-v1", handler, with_meta=True)
    await bus.publish(switch(run_id, 0))
    await until(lambda: handled == [0])
    await c.stop()
    info = await bus.js.consumer_info(cells_stream(run_id), "boom-v1")
    assert info.num_ack_pending == 0 and info.num_redelivered == 0


async def test_undecodable_and_invalid_are_dead_lettered_and_consumer_continues(bus, run_id):
    await bus.ensure_consumer(spec("dlq-v1", ack_wait_s=5.0))
    subj = subjects.subject(run_id, "cell.switch")
    handled: list[int] = []

    async def handler(event):
        if event.seq == 1:
            raise Invalid("cell c0 does not exist")
        handled.append(event.seq)

    await bus.js.publish(subj, b"\xffnot json", headers={"Nats-Msg-Id": "raw-1"})
    await bus.js.publish(subj, b'{"event_id": "x", "cell": "c0"}', headers={"Nats-Msg-Id": "raw-2"})
    await bus.publish(switch(run_id, 1))
    await bus.publish(switch(run_id, 2))
    c = Consumer(bus, "dlq-v1", handler)
    await until(lambda: handled == [2])
    await c.stop()

    dlq = subjects.stream("DLQ").stream_name(run_id)
    info = await bus.js.stream_info(dlq)
    assert info.state.messages == 3
    copies = [await bus.js.get_msg(dlq, seq) for seq in (1, 2, 3)]
    assert {m.subject for m in copies} == {subjects.dlq_subject(run_id, "cell.switch")}
    assert copies[0].data == b"\xffnot json"
    assert "not JSON" in copies[0].headers[bus_consumer.DLQ_REASON]
    assert "missing field" in copies[1].headers[bus_consumer.DLQ_REASON]
    assert copies[2].headers[bus_consumer.DLQ_REASON] == "cell c0 does not exist"
    assert copies[2].headers[bus_consumer.DLQ_SUBJECT] == subj
    assert copies[2].headers[bus_consumer.DLQ_SEQ] == "3"
    assert copies[2].headers["Nats-Msg-Id"] == f"dlq:{cells_stream(run_id)}:3"
    cinfo = await bus.js.consumer_info(cells_stream(run_id), "dlq-v1")
    assert cinfo.num_ack_pending == 0 and cinfo.num_pending == 0


async def test_max_ack_pending_stalls_delivery(bus, run_id):
    await bus.ensure_consumer(spec("stall-v1", ack_wait_s=10.0, max_ack_pending=1))
    gate = asyncio.Event()
    started: list[int] = []

    async def handler(event):
        started.append(event.seq)
        if event.seq == 0:
            await gate.wait()

    c = Consumer(bus, "stall-v1", handler, concurrency=2)
    await bus.publish(switch(run_id, 0))
    await bus.publish(switch(run_id, 1))
    await until(lambda: started == [0])
    await asyncio.sleep(0.6)  # several pull rounds: the server must hold message 1 back
    assert started == [0]
    gate.set()
    await until(lambda: started == [0, 1])
    await c.stop()


async def test_concurrency_runs_handlers_at_once(bus, run_id):
    await bus.ensure_consumer(spec("par-v1", ack_wait_s=10.0))
    gate = asyncio.Event()
    running: list[int] = []

    async def handler(event):
        running.append(event.seq)
        await gate.wait()

    for i in range(4):
        await bus.publish(switch(run_id, i))
    c = Consumer(bus, "par-v1", handler, concurrency=3)
    await until(lambda: len(running) == 3)  # three held at once; the fourth waits for a slot
    assert sorted(running) == [0, 1, 2]
    gate.set()
    await until(lambda: len(running) == 4)
    await c.stop()


async def test_heartbeats_keep_slow_handler_from_redelivery(bus, run_id):
    await bus.ensure_consumer(spec("slow-v1", ack_wait_s=1.0))
    deliveries: list[int] = []

    async def slow(event, meta):
        deliveries.append(meta.num_delivered)
        await asyncio.sleep(2.5)  # 2.5 × ack_wait; beats every ack_wait / 3

    c = Consumer(bus, "slow-v1", slow, with_meta=True, concurrency=2)
    await bus.publish(switch(run_id, 0))
    await until(lambda: deliveries)
    await c.stop()
    assert deliveries == [1]
    info = await bus.js.consumer_info(cells_stream(run_id), "slow-v1")
    assert info.num_redelivered == 0 and info.num_ack_pending == 0


async def test_close_finishes_handler_in_hand_then_drains(nats_server, run_id):
    bus = await connect(nats_server, run_id)
    await bus.ensure_streams()
    await bus.ensure_consumer(spec("drain-v1", ack_wait_s=10.0))
    started, finished = asyncio.Event(), asyncio.Event()

    async def handler(event):
        started.set()
        await asyncio.sleep(0.5)
        finished.set()

    task = asyncio.create_task(bus.consume("drain-v1", handler, stop=asyncio.Event(), poll_s=POLL))
    await bus.publish(switch(run_id, 0))
    await started.wait()
    await bus.close()
    assert finished.is_set()
    await asyncio.wait_for(task, 5)
    assert bus.nc.is_closed

    other = await connect(nats_server, run_id, "check")
    try:
        info = await other.js.consumer_info(cells_stream(run_id), "drain-v1")
        assert info.num_ack_pending == 0 and info.ack_floor.stream_seq == 1
    finally:
        await other.close()


async def test_close_against_a_frozen_server_does_not_drain_and_closes(nats_server, run_id):
    """A server that answers nothing (SIGSTOP; a partition): close() used to spend 20 s in
    nats-py's drain and final flush (10 s each) and leave the connection open, so a daemon
    stopping then outlived its supervisor's grace."""
    bus = await connect(nats_server, run_id)
    await bus.ensure_streams()
    await bus.ensure_consumer(spec("frozen-v1"))
    stop = asyncio.Event()
    task = asyncio.create_task(bus.consume("frozen-v1", lambda event: None, stop=stop, poll_s=POLL))
    await asyncio.sleep(0.5)
    await freeze(nats_server.process)
    try:
        t0 = time.monotonic()
        await asyncio.wait_for(bus.close(), 60)
        closed_s = time.monotonic() - t0
    finally:
        os.kill(nats_server.process.pid, signal.SIGCONT)
        stop.set()
    await asyncio.wait_for(task, 10)
    assert bus.nc.is_closed
    assert closed_s < 10.0, closed_s  # the PING probe's 2 s, not the drain's and flush's 10 s each


# ---- object store, replay, tap ------------------------------------------------------------

async def test_object_store_round_trip(bus):
    data = os.urandom(3 * 1024 * 1024 + 17)
    await bus.put_object("microsteps/0/0", data)
    assert await bus.get_object("microsteps/0/0") == data
    with pytest.raises(KeyError):
        await bus.get_object("missing")


async def test_replay_delivers_history_then_live(bus, run_id):
    for i in range(3):
        await bus.publish(switch(run_id, i))
    stop, caught_up = asyncio.Event(), asyncio.Event()
    seen: list[int] = []

    async def handler(event):
        seen.append(event.seq)

    task = asyncio.create_task(bus.replay(["cell.switch"], handler, stop=stop, caught_up=caught_up, poll_s=POLL))
    await asyncio.wait_for(caught_up.wait(), 10)
    assert seen == [0, 1, 2]
    await bus.publish(switch(run_id, 3))
    await until(lambda: seen == [0, 1, 2, 3])
    stop.set()
    await asyncio.wait_for(task, 5)


async def test_replay_refuses_work_queue(bus):
    with pytest.raises(ValueError, match="work queue"):
        await bus.replay(["execution.dispatched"], lambda e: None, stop=asyncio.Event())


async def test_tap_sees_raw_subject_and_bytes(bus, run_id):
    got: list[tuple[str, bytes]] = []

    async def cb(subj, data):
        got.append((subj, data))

    tap = await bus.tap(None, cb)
    ev = switch(run_id, 0)
    await bus.publish(ev)
    await until(lambda: got)
    assert got[0] == (subjects.subject(run_id, "cell.switch"), schemas.encode(ev))
    await tap.close()


# ---- failure paths ------------------------------------------------------------------------

async def test_dead_letter_copy_is_stored_once_per_message(bus, run_id):
    """A worker stored the DLQ copy, then died before term; the redelivery adds no second copy."""
    await bus.ensure_consumer(spec("poison-v1", ack_wait_s=5.0))
    subj = subjects.subject(run_id, "cell.switch")
    await bus.js.publish(subj, b"garbage")
    crashed = Delivery(subject=subj, stream=cells_stream(run_id), consumer="poison-v1", stream_seq=1,
                       consumer_seq=1, num_delivered=1, num_pending=0)
    await bus._dead_letter(subjects.dlq_subject(run_id, "cell.switch"), b"garbage",
                           bus_consumer.dead_letter_headers(crashed, "undecodable"))
    handled: list[int] = []

    async def handler(event):
        handled.append(event.seq)

    c = Consumer(bus, "poison-v1", handler)
    await bus.publish(switch(run_id, 0))
    await until(lambda: handled == [0])
    await c.stop()
    info = await bus.js.stream_info(subjects.stream("DLQ").stream_name(run_id))
    assert info.state.messages == 1


async def test_consume_finds_consumer_declared_by_another_process(bus, nats_server, run_id):
    await bus.ensure_consumer(spec("cell-c1-v1", ack_wait_s=5.0))
    other = await connect(nats_server, run_id, "other")
    handled: list[int] = []

    async def handler(event):
        handled.append(event.seq)

    try:
        c = Consumer(other, "cell-c1-v1", handler)
        await bus.publish(switch(run_id, 0))
        await until(lambda: handled == [0])
        await c.stop()
        with pytest.raises(KeyError, match="ensure_consumer"):
            await other.consume("nope-v1", handler, stop=asyncio.Event())
    finally:
        await other.close()


async def test_publish_without_stream_fails_after_bounded_retries(nats_server, run_id):
    bus = await Bus.connect(nats_server.url, token=nats_server.token, run=run_id, name="t",
                            config=BusConfig(publish_attempts=2, publish_backoff_s=0.05, timeout_s=1.0))
    try:
        with pytest.raises(bus_module.PublishError, match="ensure_streams"):
            await bus.publish(switch(run_id, 0))  # no stream declared for this run
    finally:
        await bus.close()


async def test_initial_connect_is_bounded(run_id):
    from bus.server import free_port

    with pytest.raises(bus_module.BusError, match="could not connect"):
        await Bus.connect(f"nats://127.0.0.1:{free_port()}", run=run_id, name="t",
                          config=BusConfig(connect_timeout_s=0.5))


async def test_a_connect_stopped_or_cancelled_leaves_no_client_behind(nats_server, run_id):  # noqa: F811
    """`Bus.connect(stop=...)`: a stop set first gives ConnectError(stopped); a connect
    cancelled at any step, even twice, ends cancelled with nats-py's tasks gone (its
    clean-up runs through the second cancellation)."""
    stop = asyncio.Event()
    stop.set()
    with pytest.raises(bus_module.ConnectError) as err:
        await Bus.connect(nats_server.url, token=nats_server.token, run=run_id, name="t", stop=stop)
    assert err.value.stopped
    ours = asyncio.all_tasks()
    for steps in range(0, 24, 2):
        for gap in (0, 1, 2):
            task = asyncio.ensure_future(Bus.connect(nats_server.url, token=nats_server.token, run=run_id, name="t",
                                                     stop=asyncio.Event()))
            for _ in range(steps):
                await asyncio.sleep(0)
            if task.done():
                await task.result().close()
                continue
            task.cancel()
            for _ in range(gap):
                await asyncio.sleep(0)
            task.cancel()
            (outcome,) = await asyncio.gather(task, return_exceptions=True)
            await asyncio.sleep(0.02)
            left = [t.get_coro().__qualname__ for t in asyncio.all_tasks() - ours if t is not asyncio.current_task()]
            assert isinstance(outcome, asyncio.CancelledError) and not left, (steps, gap, outcome, left)


async def test_publish_and_consume_survive_server_restart(tmp_path, run_id):
    from bus.server import NatsServer

    server = NatsServer.start(tmp_path / "nats")
    port = int(server.url.rsplit(":", 1)[1])
    bus = await Bus.connect(server.url, token=server.token, run=run_id, name="t",
                            config=BusConfig(reconnect_wait_s=0.1, timeout_s=1.0, publish_backoff_s=0.1))
    try:
        await bus.ensure_streams()
        await bus.ensure_consumer(spec("restart-v1", ack_wait_s=5.0))
        handled: list[int] = []

        async def handler(event):
            handled.append(event.seq)

        c = Consumer(bus, "restart-v1", handler)
        await bus.publish(switch(run_id, 0))
        await until(lambda: handled == [0])
        server.stop()
        await asyncio.sleep(0.3)
        server = await asyncio.to_thread(NatsServer.start, tmp_path / "nats", port=port, token=server.token)
        assert await bus.publish(switch(run_id, 1)) is True  # retried through the reconnect
        await until(lambda: handled == [0, 1], timeout_s=15)
        await c.stop()
    finally:
        await bus.close()
        server.stop()


def test_event_timestamps_keep_their_format():
    import re

    from schemas.base import utc_now

    assert all(re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z", utc_now()) for _ in range(200))


async def test_a_first_connect_that_times_out_says_what_went_wrong(nats_server):
    """A wrong token is not just a timeout: the errors seen while trying are in the message."""
    from bus import BusConfig, ConnectError

    with pytest.raises(ConnectError, match="Authorization Violation"):
        await Bus.connect(nats_server.url, token="not-the-token", run="r", name="t",
                          config=BusConfig(connect_timeout_s=3.0))


async def test_a_server_older_than_2_10_is_refused_with_a_clear_error(run_id):
    """Before 2.10 nats-server ignores a consumer's `filter_subjects` and delivers every
    subject (Debian's 2.9 did: a cell crashed on `route.updated`). The connect says so.
    The old server is played over the NATS wire protocol: INFO with its version, PONG."""
    from bus import ConnectError

    async def old_server(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b'INFO {"server_id":"OLD","version":"2.9.10","go":"go1.19","host":"127.0.0.1","port":0,'
                     b'"headers":true,"max_payload":1048576,"proto":1,"jetstream":true}\r\n')
        while line := await reader.readline():
            if line.startswith(b"PING"):
                writer.write(b"PONG\r\n")
                await writer.drain()

    server = await asyncio.start_server(old_server, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        with pytest.raises(ConnectError, match=r"nats-server 2\.9\.10 .* too old: gyre needs 2\.10 or newer"):
            await Bus.connect(f"nats://127.0.0.1:{port}", run=run_id, name="t", config=BusConfig(connect_timeout_s=5))
    finally:
        server.close()
