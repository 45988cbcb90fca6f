"""Reading a run's history and live traffic: `replay`, `stored_ids` and `tap`.

Contract (each is also a `Bus` method that delegates here: `bus.replay(...)`, ...):
- `replay(bus, names, handler)` delivers every stored event of `names` from the start, then
  live ones, in stream order (ordered per stream; ephemeral consumers, nothing acked); a
  handler error or an undecodable event is logged and skipped. `close()` waits for it.
- `stored_events(bus, names)` returns the events of `names` stored when called (a replay that
  stops once caught up).
- `stored_ids(bus, name)` lists the ids and headers of the events of `name` stored when
  called, reading headers only.
- `tap(bus, pattern, callback)` is a core-NATS subscription (nothing stored, nothing acked).
Replay and stored ids refuse names on a work-queue stream (reading would consume them):
ValueError.
"""
from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Iterable

import nats.errors
import nats.js.errors
import structlog
from nats.js import api

import schemas
from bus import subjects
from bus.consumer import TRANSIENT, fetch_or_stop, unsubscribe, wait_any

if TYPE_CHECKING:
    from bus.client import Bus

log = structlog.get_logger("gyre.bus")


class Tap:
    """A core-NATS subscription made by `Bus.tap`; `await tap.close()` ends it."""

    def __init__(self, sub: Any):
        self._sub = sub

    async def close(self) -> None:
        try:
            await self._sub.unsubscribe()
        except (nats.errors.ConnectionClosedError, nats.errors.BadSubscriptionError):
            pass


async def replay(bus: Bus, names: Iterable[str], handler: Callable[[schemas.Event], Awaitable[Any]], *,
                 stop: asyncio.Event, caught_up: asyncio.Event | None = None,
                 batch: int = 256, poll_s: float = 1.0) -> None:
    """Deliver every stored event of `names` from the start, then live ones, until `stop`.

    Order is the stream's order within each stream (names of different streams are replayed
    concurrently). `caught_up` is set once all history stored at start has been handled.
    Nothing is acked or redelivered: a handler error or an undecodable event is logged and
    skipped. Raises ValueError for names on a work-queue stream (replay would consume them).
    """
    groups: dict[str, list[str]] = {}
    for n in names:
        groups.setdefault(_kept_stream(n, "replay").concern, []).append(n)
    done_events = {concern: asyncio.Event() for concern in groups}

    async def all_caught_up() -> None:
        for e in done_events.values():
            await e.wait()
        if caught_up is not None:
            caught_up.set()

    with bus.loop_scope() as closing:
        async with asyncio.TaskGroup() as tg:
            watcher = tg.create_task(all_caught_up())
            loops = [tg.create_task(_replay_stream(bus, subjects.stream(c), ns, handler, [stop, closing],
                                                   done_events[c], batch, poll_s))
                     for c, ns in groups.items()]
            await asyncio.gather(*loops)
            watcher.cancel()


async def _replay_stream(bus: Bus, spec: subjects.StreamSpec, names: list[str], handler: Callable,
                         stop_events: list[asyncio.Event], caught_up: asyncio.Event, batch: int,
                         poll_s: float) -> None:
    stream = spec.stream_name(bus.run)
    rlog = log.bind(stream=stream, names=names)
    stopped = asyncio.ensure_future(wait_any(stop_events))
    next_seq = 1
    try:
        while not stopped.done():
            cfg = api.ConsumerConfig(
                ack_policy=api.AckPolicy.NONE, deliver_policy=api.DeliverPolicy.BY_START_SEQUENCE,
                opt_start_seq=next_seq, filter_subjects=[subjects.subject(bus.run, n) for n in names],
                inactive_threshold=max(30.0, 5 * poll_s), mem_storage=True)
            try:
                info = await bus.js.add_consumer(stream, cfg)
                sub = await bus.js.pull_subscribe_bind(consumer=info.name, stream=stream)
            except TRANSIENT as exc:
                rlog.warning("bus.replay.create_failed", error=repr(exc))
                await asyncio.wait({stopped}, timeout=poll_s)
                continue
            if info.num_pending == 0:
                caught_up.set()
            try:
                while not stopped.done():
                    msgs = await fetch_or_stop(sub, batch, poll_s, stopped)
                    if msgs is None:
                        break
                    if not msgs:
                        caught_up.set()
                    for msg in msgs:
                        next_seq = msg.metadata.sequence.stream + 1
                        await _replay_one(msg, handler, rlog)
                        if msg.metadata.num_pending == 0:
                            caught_up.set()
            except nats.errors.ConnectionClosedError:
                raise
            except Exception as exc:  # noqa: BLE001 - consumer lost (server restart): recreate
                rlog.warning("bus.replay.restarting", next_seq=next_seq, error=repr(exc))
                await asyncio.wait({stopped}, timeout=min(poll_s, 1.0))
            finally:
                await _drop_ephemeral(bus, sub, stream, info.name)
    finally:
        stopped.cancel()


async def _replay_one(msg: Any, handler: Callable, rlog: Any) -> None:
    try:
        event = schemas.decode(subjects.name_of(msg.subject), msg.data)
    except (schemas.SchemaError, ValueError) as exc:
        rlog.warning("bus.replay.undecodable", subject=msg.subject, error=str(exc))
        return
    try:
        await handler(event)
    except Exception:  # noqa: BLE001 - replay has no redelivery; keep going
        rlog.exception("bus.replay.handler_failed", subject=msg.subject, event_id=event.event_id)


async def stored_events(bus: Bus, names: Iterable[str],
                        keep: Callable[[schemas.Event], bool] = lambda _e: True) -> list[schemas.Event]:
    """The events of `names` stored now that `keep` accepts, in stream order per stream
    (`replay` until caught up: what arrives meanwhile may be included)."""
    out: list[schemas.Event] = []
    stop, caught = asyncio.Event(), asyncio.Event()

    async def on(event: schemas.Event) -> None:
        if not caught.is_set() and keep(event):
            out.append(event)

    task = asyncio.create_task(replay(bus, names, on, stop=stop, caught_up=caught))
    waiter = asyncio.create_task(caught.wait())
    try:
        await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            task.result()  # what the replay raised
    finally:
        waiter.cancel()
        stop.set()
        await task
    return out


async def stored_ids(bus: Bus, name: str, *, stop: asyncio.Event | None = None,
                     batch: int = 1024) -> dict[str, dict[str, str]] | None:
    """The event ids (`Nats-Msg-Id`) of the events of `name` stored when called, oldest
    first, each with its message headers (`publish`'s headers, `Nats-Msg-Id` among
    them); None once `stop` is set. Both it and a cancellation are checked between
    batches too (nats-py's fetch can swallow a cancellation on Python 3.11). Read
    with a headers-only ephemeral consumer: payloads stay on the server (a
    `call.completed` with inline tokens costs ~150 bytes here, not its ~10-250 KB).
    Raises ValueError for a name on a work-queue stream, nats errors when the server
    cannot be read (callers that must not go on without the ids let them propagate)."""
    stream = _kept_stream(name, "list").stream_name(bus.run)
    cfg = api.ConsumerConfig(ack_policy=api.AckPolicy.NONE, deliver_policy=api.DeliverPolicy.ALL,
                             filter_subject=subjects.subject(bus.run, name), headers_only=True,
                             inactive_threshold=30.0, mem_storage=True)
    info = await bus.js.add_consumer(stream, cfg)
    sub = await bus.js.pull_subscribe_bind(consumer=info.name, stream=stream)
    out: dict[str, dict[str, str]] = {}
    try:
        pending = info.num_pending
        task = asyncio.current_task()
        while pending > 0:
            if task is not None and task.cancelling():
                raise asyncio.CancelledError
            if stop is not None and stop.is_set():
                return None
            msgs = await sub.fetch(min(batch, pending), timeout=bus.config.timeout_s)
            out.update((m.headers["Nats-Msg-Id"], m.headers) for m in msgs if m.headers and "Nats-Msg-Id" in m.headers)
            pending = msgs[-1].metadata.num_pending
    finally:
        await _drop_ephemeral(bus, sub, stream, info.name)
    return out


async def tap(bus: Bus, pattern: str | None, callback: Callable[[str, bytes], Awaitable[Any]]) -> Tap:
    """Core-NATS subscription: `await callback(subject, data)` for every message on `pattern`.

    pattern: a subject pattern; None = everything of this run (`gyre.v1.<run>.>`).
    Raises ValueError for a pattern NATS refuses (spaces, empty tokens, a misplaced wildcard).
    """
    async def on_msg(msg: Any) -> None:
        try:
            await callback(msg.subject, msg.data)
        except Exception:  # noqa: BLE001 - a tap callback must not kill the subscription
            log.exception("bus.tap.callback_failed", subject=msg.subject)

    pattern = pattern or subjects.run_wildcard(bus.run)
    try:
        sub = await bus.nc.subscribe(pattern, cb=on_msg)
    except nats.errors.BadSubjectError:
        raise ValueError(f"{pattern!r} is not a NATS subject pattern (dot-separated tokens without spaces; "
                         "* stands for one token, > for the rest)") from None
    return Tap(sub)


def _kept_stream(name: str, what: str) -> subjects.StreamSpec:
    """The stream holding `name`'s history. Raises ValueError for a work-queue stream
    (reading it would consume the events)."""
    spec = subjects.stream_for(name)
    if spec.work_queue:
        raise ValueError(f"cannot {what} {name!r}: stream {spec.concern} is a work queue")
    return spec


async def _drop_ephemeral(bus: Bus, sub: Any, stream: str, consumer: str) -> None:
    """Unsubscribe from and delete an ephemeral consumer of `stream`."""
    await unsubscribe(sub)
    try:
        await bus.js.delete_consumer(stream, consumer)
    except Exception:  # noqa: BLE001 - ephemeral: the server removes it anyway
        pass


async def stored_count(bus: Bus, names: Iterable[str]) -> int:
    """How many events the streams of `names` hold for the bus's run (0 for a run the server
    never heard of: its streams do not exist)."""
    total = 0
    for spec in {subjects.stream_for(n) for n in names}:
        try:
            total += (await bus.js.stream_info(spec.stream_name(bus.run))).state.messages
        except nats.js.errors.NotFoundError:
            continue
    return total


async def runs_on_server(bus: Bus) -> list[str]:
    """The run ids whose streams the server holds."""
    found = set()
    for info in await bus.js.streams_info():
        for subj in info.config.subjects or ():
            if subj.startswith(subjects.PREFIX + ".") and not subj.startswith(subjects.PREFIX + ".*"):
                found.add(subjects.run_of(subj))
    return sorted(found)
