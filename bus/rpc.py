"""Request/reply on core NATS: a request that needs an answer now and leaves no history
(`microstep.claim`: a replica asks the core's ledger for a grant).

- `serve(bus, name, handler, stop=...)` answers requests on `subject(run, name)` until
  `stop`: `await handler(data) -> bytes` is the reply. Members of one queue group share
  the subject, so only one answers each request. A handler that raises is logged and
  leaves the request unanswered (the requester times out and asks again).
- `request(bus, name, data, timeout_s)` sends one request and returns the reply's bytes.
  Raises RequestFailed when nobody answers in time or nobody serves the subject.
"""
from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, Awaitable, Callable

import nats.errors
import structlog

from bus import subjects
from bus.consumer import wait_any

if TYPE_CHECKING:
    from bus.client import Bus

log = structlog.get_logger("gyre.bus")


class RequestFailed(RuntimeError):
    """No reply: nobody serves the subject, or the answer did not come within the timeout."""


async def serve(bus: Bus, name: str, handler: Callable[[bytes], Awaitable[bytes]], *, stop: asyncio.Event,
                queue: str = "") -> None:
    """Answer requests on `name` with `handler` until `stop` (or the bus closes)."""

    async def on_msg(msg: Any) -> None:
        try:
            reply = await handler(msg.data)
        except Exception:  # noqa: BLE001 - unanswered: the requester times out and retries
            log.exception("bus.serve.handler_failed", subject=msg.subject)
            return
        if msg.reply:
            try:
                await msg.respond(reply)
            except nats.errors.Error as exc:
                log.warning("bus.serve.respond_failed", subject=msg.subject, error=repr(exc))

    sub = await bus.nc.subscribe(subjects.subject(bus.run, name), queue=queue, cb=on_msg)
    log.info("bus.serve.started", name=name)
    try:
        with bus.loop_scope() as closing:
            await wait_any([stop, closing])
    finally:
        try:
            await sub.unsubscribe()
        except (nats.errors.ConnectionClosedError, nats.errors.BadSubscriptionError):
            pass
        log.info("bus.serve.stopped", name=name)


async def request(bus: Bus, name: str, data: bytes, timeout_s: float) -> bytes:
    """The reply to `data` sent on `name`. Raises RequestFailed."""
    try:
        msg = await bus.nc.request(subjects.subject(bus.run, name), data, timeout=timeout_s)
    except (nats.errors.TimeoutError, asyncio.TimeoutError, nats.errors.NoRespondersError,
            nats.errors.ConnectionReconnectingError, nats.errors.ConnectionClosedError) as exc:
        raise RequestFailed(f"no reply on {name} within {timeout_s}s: {exc!r}") from exc
    return msg.data
