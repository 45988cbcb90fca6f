"""Durable pull-consumer loop and the one place that maps handler outcomes to acks.

Contract (STYLE.md "Bus"), applied by `classify` + `settle` and nowhere else:
- the handler returns → `ack`;
- it raises `Retry(delay_s)` → `nak(delay_s)` (redelivered after the delay; backoff if None);
- it raises `Invalid(reason)`, or the message is undecodable (`SchemaError`, not a gyre
  subject) → a dead-letter copy on `dlq_subject(run, name)` (original bytes as body, reason,
  subject, stream and sequence in `Gyre-Dlq-*` headers, `Nats-Msg-Id = dlq:<stream>:<seq>`
  (`schemas.ids.dead_letter`) so a redelivered poison message is dead-lettered once), then
  `term`, plus a warning;
- any other exception → `nak` with exponential backoff by delivery count, logged with its
  traceback; never dropped. If the dead-letter copy cannot be stored the message is nak'd too.

While a handler runs, `in_progress()` is sent every `heartbeat_s` (default a third of the
consumer's `ack_wait`) so long handlers are not redelivered. `run_loop` fetches only as many
messages as it has free handler slots (`concurrency`), so a fetched message never waits out its
`ack_wait` in a local queue; on stop it fetches nothing more and finishes the handlers in hand.

Also the loop helpers `bus.history` shares (`wait_any`, `fetch_or_stop`, `unsubscribe`, `TRANSIENT`).
"""
from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any, Awaitable, Callable, Literal

import nats.errors
import nats.js.errors
import structlog

import schemas
from bus import subjects
from schemas import ids

log = structlog.get_logger("gyre.bus")

DLQ_REASON = "Gyre-Dlq-Reason"
DLQ_SUBJECT = "Gyre-Dlq-Subject"
DLQ_STREAM = "Gyre-Dlq-Stream"
DLQ_SEQ = "Gyre-Dlq-Stream-Seq"
DLQ_CONSUMER = "Gyre-Dlq-Consumer"
DLQ_DELIVERED = "Gyre-Dlq-Delivered"
_MAX_HEADER_CHARS = 1000
ACK_TIMEOUT_S = 5.0

TRANSIENT = (
    nats.errors.TimeoutError,
    asyncio.TimeoutError,
    nats.errors.NoRespondersError,
    nats.js.errors.NoStreamResponseError,
    nats.js.errors.ServiceUnavailableError,
    nats.errors.ConnectionReconnectingError,
    nats.errors.StaleConnectionError,
    nats.errors.OutboundBufferLimitError,
)
"""nats errors that pass with time (a timeout, a reconnect, JetStream briefly away): `Bus.publish`
retries them, a replay re-creates its consumer after them."""


class Retry(Exception):
    """Raise from a handler to have the message redelivered after `delay_s` seconds.

    delay_s: seconds (>= 0); None = the consumer's exponential backoff by delivery count.
    """

    def __init__(self, delay_s: float | None = None, reason: str = ""):
        if delay_s is not None and delay_s < 0:
            raise ValueError(f"Retry.delay_s must be >= 0, got {delay_s}")
        super().__init__(reason or f"retry in {delay_s}s")
        self.delay_s = delay_s
        self.reason = reason


class Invalid(Exception):
    """Raise from a handler when the event can never be handled: term + dead-letter copy."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


@dataclasses.dataclass(frozen=True, slots=True)
class Delivery:
    """Delivery metadata of one JetStream message (passed to handlers that ask with_meta).

    num_delivered: deliveries so far, 1 on the first. num_pending: messages after this one
    still to be delivered to the consumer. stream_seq / consumer_seq: sequences in each.
    """

    subject: str
    stream: str
    consumer: str
    stream_seq: int
    consumer_seq: int
    num_delivered: int
    num_pending: int

    @classmethod
    def of(cls, msg: Any) -> "Delivery":
        md = msg.metadata
        return cls(subject=msg.subject, stream=md.stream, consumer=md.consumer, stream_seq=md.sequence.stream,
                   consumer_seq=md.sequence.consumer, num_delivered=md.num_delivered, num_pending=md.num_pending)


@dataclasses.dataclass(frozen=True, slots=True)
class Backoff:
    """Nak delay after an unexpected handler error: min(max_s, base_s * 2**(n-1)) for delivery n.

    base_s: seconds after the first failed delivery (> 0). max_s: cap in seconds (>= base_s).
    """

    base_s: float = 1.0
    max_s: float = 60.0

    def __post_init__(self) -> None:
        if self.base_s <= 0:
            raise ValueError(f"Backoff.base_s must be > 0, got {self.base_s}")
        if self.max_s < self.base_s:
            raise ValueError(f"Backoff.max_s ({self.max_s}) must be >= base_s ({self.base_s})")

    def delay(self, num_delivered: int) -> float:
        """Seconds to wait before delivery `num_delivered + 1`."""
        exponent = min(max(num_delivered, 1) - 1, 30)
        return min(self.max_s, self.base_s * 2.0**exponent)


@dataclasses.dataclass(frozen=True, slots=True)
class Outcome:
    """What to tell the server about one message. delay_s: nak delay in seconds (None = now)."""

    action: Literal["ack", "nak", "term"]
    delay_s: float | None = None
    reason: str = ""


ACK = Outcome("ack")


def classify(exc: BaseException | None, num_delivered: int, backoff: Backoff) -> Outcome:
    """Map a handler's result (None = returned) to an Outcome. Pure; the single mapping."""
    if exc is None:
        return ACK
    if isinstance(exc, Retry):
        delay = exc.delay_s if exc.delay_s is not None else backoff.delay(num_delivered)
        return Outcome("nak", delay, exc.reason or "retry")
    if isinstance(exc, Invalid):
        return Outcome("term", None, exc.reason)
    if isinstance(exc, schemas.SchemaError):
        return Outcome("term", None, str(exc))
    return Outcome("nak", backoff.delay(num_delivered), f"{type(exc).__name__}: {exc}")


def _header_value(text: str) -> str:
    one_line = " ".join(str(text).split())
    return one_line[:_MAX_HEADER_CHARS]


def dead_letter_headers(meta: Delivery, reason: str) -> dict[str, str]:
    """Headers of a dead-letter copy: reason, original subject, stream, sequence, consumer."""
    return {
        "Nats-Msg-Id": ids.dead_letter(meta.stream, meta.stream_seq),
        DLQ_REASON: _header_value(reason) or "invalid",
        DLQ_SUBJECT: meta.subject,
        DLQ_STREAM: meta.stream,
        DLQ_SEQ: str(meta.stream_seq),
        DLQ_CONSUMER: meta.consumer,
        DLQ_DELIVERED: str(meta.num_delivered),
    }


DeadLetter = Callable[[str, bytes, dict[str, str]], Awaitable[Any]]


async def settle(msg: Any, outcome: Outcome, meta: Delivery, run: str, dead_letter: DeadLetter,
                 backoff: Backoff) -> Outcome:
    """Apply `outcome` to `msg`; returns what was actually done.

    ack waits for the server's confirmation (raises nats TimeoutError after ACK_TIMEOUT_S; the
    server then redelivers after ack_wait, so handlers stay idempotent on event_id).

    term first stores the dead-letter copy via `dead_letter(subject, body, headers)`; if that
    fails the message is nak'd with backoff instead, so it is never lost.
    """
    if outcome.action == "ack":
        # Confirmed ack: once settle returns, the server has recorded it (drain relies on this).
        await msg.ack_sync(timeout=ACK_TIMEOUT_S)
    elif outcome.action == "nak":
        await msg.nak(delay=outcome.delay_s)
    else:
        try:
            name = subjects.name_of(meta.subject)
        except ValueError:
            name = "unknown"
        try:
            await dead_letter(subjects.dlq_subject(run, name), msg.data, dead_letter_headers(meta, outcome.reason))
        except Exception as exc:  # noqa: BLE001 - any failure keeps the message
            delay = backoff.delay(meta.num_delivered)
            log.error("bus.dead_letter.failed", subject=meta.subject, stream_seq=meta.stream_seq,
                      error=repr(exc), delay_s=delay)
            await msg.nak(delay=delay)
            return Outcome("nak", delay, f"dead letter failed: {exc!r}")
        await msg.term()
        log.warning("bus.message.dead_lettered", subject=meta.subject, stream=meta.stream,
                    stream_seq=meta.stream_seq, consumer=meta.consumer, reason=outcome.reason)
    return outcome


Handler = Callable[..., Awaitable[Any]]


@dataclasses.dataclass
class Worker:
    """Handles one message at a time for one consume() call: decode, heartbeat, run, settle.

    heartbeat_s: seconds between in_progress() while the handler runs; 0 disables them.
    """

    run: str
    durable: str
    handler: Handler
    with_meta: bool
    heartbeat_s: float
    backoff: Backoff
    dead_letter: DeadLetter

    async def handle(self, msg: Any) -> Outcome:
        meta = Delivery.of(msg)
        started = time.monotonic()
        mlog = log.bind(consumer=self.durable, subject=msg.subject, stream_seq=meta.stream_seq,
                        delivered=meta.num_delivered)
        try:
            event = schemas.decode(subjects.name_of(msg.subject), msg.data)
        except (schemas.SchemaError, ValueError) as exc:
            outcome = Outcome("term", None, f"undecodable: {exc}")
        else:
            mlog = mlog.bind(event_id=event.event_id)
            outcome = await self._run_handler(msg, event, meta, mlog)
        outcome = await settle(msg, outcome, meta, self.run, self.dead_letter, self.backoff)
        mlog.info("bus.message.handled", outcome=outcome.action, delay_s=outcome.delay_s,
                  duration_s=round(time.monotonic() - started, 4))
        return outcome

    async def _run_handler(self, msg: Any, event: schemas.Event, meta: Delivery, mlog: Any) -> Outcome:
        beat = asyncio.create_task(self._heartbeat(msg, mlog)) if self.heartbeat_s > 0 else None
        try:
            if self.with_meta:
                await self.handler(event, meta)
            else:
                await self.handler(event)
        except asyncio.CancelledError:
            # Our task is being torn down: give the message back now rather than after ack_wait.
            try:
                await msg.nak()
            except Exception:  # noqa: BLE001 - best effort during shutdown
                pass
            raise
        except Exception as exc:  # noqa: BLE001 - mapped by classify, never dropped
            outcome = classify(exc, meta.num_delivered, self.backoff)
            if outcome.action == "nak" and not isinstance(exc, Retry):
                mlog.error("bus.handler.failed", delay_s=outcome.delay_s, exc_info=exc)
            return outcome
        finally:
            if beat is not None:
                beat.cancel()
        return ACK

    async def _heartbeat(self, msg: Any, mlog: Any) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_s)
            try:
                await msg.in_progress()
            except Exception as exc:  # noqa: BLE001 - a missed beat only risks a redelivery
                mlog.warning("bus.heartbeat.failed", error=repr(exc))


async def wait_any(events: list[asyncio.Event]) -> None:
    """Return once any of `events` is set."""
    waiters = [asyncio.ensure_future(e.wait()) for e in events]
    try:
        await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waiters:
            w.cancel()


async def unsubscribe(sub: Any) -> None:
    """Unsubscribe `sub`, quietly when the connection is already closed or draining."""
    try:
        await sub.unsubscribe()
    except Exception:  # noqa: BLE001 - connection already closed or draining
        pass


async def fetch_or_stop(sub: Any, n: int, poll_s: float, stopped: asyncio.Future) -> list[Any] | None:
    """Fetch up to n messages, waiting at most poll_s; [] on timeout, None once `stopped` is done.

    A pull request cut short by stop may still deliver a message into a subscription that is
    going away; the server redelivers it after ack_wait, so nothing is lost.
    """
    fetch = asyncio.ensure_future(sub.fetch(n, timeout=poll_s))
    await asyncio.wait({fetch, stopped}, return_when=asyncio.FIRST_COMPLETED)
    if not fetch.done():
        fetch.cancel()
        await asyncio.gather(fetch, return_exceptions=True)
        return None
    try:
        return fetch.result()
    except (nats.errors.TimeoutError, asyncio.TimeoutError):
        return []


def _pending_after(msgs: list[Any]) -> int:
    try:
        return msgs[-1].metadata.num_pending if msgs else 0
    except Exception:  # noqa: BLE001 - metadata missing: assume none
        return 0


async def run_loop(sub: Any, worker: Worker, *, concurrency: int, batch: int, poll_s: float,
                   stop_events: list[asyncio.Event]) -> None:
    """Fetch and handle messages until any of `stop_events` is set; then finish those in hand."""
    clog = log.bind(consumer=worker.durable)
    stopped = asyncio.ensure_future(wait_any(stop_events))
    tasks: set[asyncio.Task] = set()
    backlog = 0

    def finished(task: asyncio.Task) -> None:
        tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            # Settling failed (e.g. connection lost): the server redelivers after ack_wait.
            clog.error("bus.message.unsettled", exc_info=task.exception())

    try:
        while not stopped.done():
            free = concurrency - len(tasks)
            if free <= 0:
                await asyncio.wait(tasks | {stopped}, return_when=asyncio.FIRST_COMPLETED)
                continue
            # A pull for n > 1 that finds nothing waits until poll_s for all n, delaying the first;
            # so pull several only when the last message said more were pending.
            n = min(batch, free, max(backlog, 1))
            try:
                msgs = await fetch_or_stop(sub, n, poll_s, stopped)
            except nats.errors.ConnectionClosedError:
                raise
            except Exception as exc:  # noqa: BLE001 - transient pull errors: wait and pull again
                clog.warning("bus.fetch.failed", error=repr(exc))
                await asyncio.wait({stopped}, timeout=min(poll_s, 1.0))
                continue
            if msgs is None:
                break
            backlog = _pending_after(msgs)
            for msg in msgs:
                task = asyncio.create_task(worker.handle(msg))
                tasks.add(task)
                task.add_done_callback(finished)
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
    finally:
        stopped.cancel()
        for task in list(tasks):
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
