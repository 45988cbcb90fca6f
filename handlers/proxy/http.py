"""HTTP plumbing of the proxy: API keys, request bodies, error responses, and the reply
to a waiting harness (keep-alives, then the answer or an error in the API's shape)."""
from __future__ import annotations

import asyncio
import fcntl
import struct
import termios
from pathlib import Path
from typing import Any, Awaitable, Callable

import aiohttp
import orjson
import structlog
from aiohttp import HttpVersion11, web

from handlers.proxy.api import Api, ApiError, StreamStart, decode_body

log = structlog.get_logger()


def key_of(request: web.Request) -> str | None:
    """The execution key: `Authorization: Bearer` or `x-api-key`; None when neither holds
    one. Raises ApiError(401, code `conflicting_api_keys`) when both hold one and they
    differ: which of two executions is meant is not known."""
    auth = request.headers.get("Authorization", "")
    bearer = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
    key = request.headers.get("x-api-key", "").strip()
    if bearer and key and bearer != key:
        raise ApiError(401, "'Authorization: Bearer' and 'x-api-key' carry different keys; send one key, or the "
                            "same key in both", "authentication_error", code="conflicting_api_keys")
    return bearer or key or None


BODY_READ_S = 60.0
"""Seconds a request's body may take to arrive once its headers have (a 64-MiB body takes
under a second on loopback); then a 408, and the connection closes. A client that stalls
before its headers end is closed by the server's idle timeout (`handlers.proxy.app.IDLE_CLOSE_S`)."""


async def read_json(request: web.Request, limit: int, raw_bodies: bool,
                    loads: Callable[[bytes], Any] = orjson.loads) -> Any:
    """The request body as JSON, parsed by `loads` (an execution's
    `handlers.proxy.body.BodyMemo`, which parses a resent history only where it is new).
    limit: bytes, as sent and once decoded. raw_bodies: the server does not decompress
    (aiohttp `auto_decompress=False`), so `Content-Encoding` is undone here. Raises
    ApiError 400/408/413/415."""
    try:
        async with asyncio.timeout(BODY_READ_S):
            raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise ApiError(413, f"request body too large (> {limit} bytes)", code="request_too_large") from None
    except TimeoutError:  # a client that stopped sending (or a Content-Length larger than its body)
        raise ApiError(408, f"the request body did not arrive within {BODY_READ_S:g} s", code="request_timeout",
                       headers={"Connection": "close"}) from None
    encoding = ", ".join(request.headers.getall("Content-Encoding", ()))  # two header lines are one list (RFC 9110 5.3)
    if encoding and raw_bodies:  # off the event loop: up to `limit` bytes of inflating (zlib frees the GIL)
        raw = await asyncio.to_thread(decode_body, raw, encoding, limit)
    try:
        return loads(raw)
    except orjson.JSONDecodeError as exc:
        raise ApiError(400, f"the request body is not valid JSON: {exc}") from None


def error_response(api: Api, err: ApiError) -> web.Response:
    return web.json_response(api.error_body(err), status=err.status, headers=err.headers, dumps=_dumps)


def _dumps(obj: Any) -> str:
    return orjson.dumps(obj).decode()


STREAM_OPEN_S = 0.25
"""Seconds a streamed call may wait before its response opens (a real engine's answer
takes longer; a quick one then goes out in one write instead of two or three)."""
FLUSH_POLL_S = 0.01
"""How often `Reply.send` looks whether a slow reader has taken the answer's last bytes
(seconds; only while the transport still holds some, which a reader keeping up never
causes)."""
SSE_TYPE = "text/event-stream; charset=utf-8"
TIOCOUTQ = getattr(termios, "TIOCOUTQ", None)
"""The ioctl that reads a socket's send-queue length (Linux); None where there is none."""


def _waiting_headers(content_type: str) -> dict[str, str]:
    """Headers of a response that streams or waits (no caching, no proxy buffering)."""
    return {"Content-Type": content_type, "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class Reply:
    """The harness's response while a call waits: nothing, or an opened response and
    keep-alives, then the answer.

    Streaming: the SSE response opens (headers and the API's preamble frames) when the
    answer is ready or after min(`STREAM_OPEN_S`, keepalive_s), whichever comes first, then
    its keep-alive frame every keepalive_s from the opening; an answer ready by then goes
    out in one write, and an error by then is an HTTP error in the API's shape.
    Non-streaming: after keepalive_s a 200 JSON response is prepared and newlines are sent;
    an error after that cuts the connection (`fail`).
    """

    def __init__(self, request: web.Request, api: Api, stream: bool, keepalive_s: float, deliver_timeout_s: float):
        self.request = request
        self.api = api
        self.stream = stream
        self.keepalive_s = keepalive_s
        self.deliver_timeout_s = deliver_timeout_s
        self.resp: web.StreamResponse | None = None
        self.start_info: StreamStart | None = None
        self._preamble = b""
        self._timer: asyncio.TimerHandle | None = None
        self._task: asyncio.Task | None = None
        self._opening: asyncio.Future | None = None
        self._opening_begun = False
        self.handed_over = False
        """`send` has handed the answer's last bytes to the transport (it may still be
        waiting for a slow reader to take them)."""

    async def _prepare(self, content_type: str) -> web.StreamResponse:
        resp = web.StreamResponse(status=200, headers=_waiting_headers(content_type))
        if self.request.version < HttpVersion11:
            resp.force_close()  # HTTP/1.0 has no chunking: the body ends where the connection does
        await resp.prepare(self.request)
        self.resp = resp
        return resp

    async def start(self, start: StreamStart, preamble: list[bytes]) -> None:
        self.start_info = start
        self._preamble = b"".join(preamble)
        # A timer, not a task: most calls are answered long before the response opens.
        first = min(self.keepalive_s, STREAM_OPEN_S) if self.stream else self.keepalive_s
        self._timer = asyncio.get_running_loop().call_later(first, self._start_keepalive)

    def _start_keepalive(self) -> None:
        self._timer = None
        self._opening = asyncio.ensure_future(self._open())
        self._task = asyncio.ensure_future(self._keepalive(self._opening))

    async def _open(self) -> None:
        """Headers, then the preamble (streams) or a first newline."""
        self._opening_begun = True
        try:
            if self.stream:
                resp = await self._prepare(SSE_TYPE)
                if self._preamble:
                    await resp.write(self._preamble)
            else:
                resp = await self._prepare("application/json")
                await resp.write(b"\n")
        except ConnectionResetError:
            pass

    async def _keepalive(self, opening: asyncio.Future) -> None:
        try:
            await asyncio.shield(opening)
            while self.resp is not None:
                await asyncio.sleep(self.keepalive_s)
                await self.resp.write(self.api.keepalive if self.stream else b"\n")
        except (ConnectionResetError, asyncio.CancelledError):
            pass

    async def stop_keepalive(self) -> None:
        """End the timer and keep-alives. An opening that began is finished first (cut, it
        would lose headers or preamble); one only scheduled is dropped. Raises
        CancelledError when the calling task was cancelled meanwhile (the awaits here would
        otherwise absorb it)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        opening, self._opening = self._opening, None
        if opening is not None and not self._opening_begun:
            opening.cancel()  # before any await here: cancelled before its first step, it never runs
            opening = None
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
        if opening is not None:
            await asyncio.shield(opening)
        current = asyncio.current_task()
        if current is not None and current.cancelling():
            raise asyncio.CancelledError

    async def send(self, body: dict | list[bytes]) -> web.StreamResponse:
        """Deliver the answer (a body object, or the stream's remaining frames, written at
        once) and end it; return once the transport holds none of it (`_flushed`).
        Raises ConnectionResetError when the connection closes first, or when the harness
        took none of the answer for `deliver_timeout_s` while some was still unsent (a
        reader that stopped reading; `_Stall`): the connection is then cut, so that the
        harness, like the call's record (`aborted`), has no answer."""
        await self.stop_keepalive()
        data = b"".join(body) if self.stream else orjson.dumps(body)
        if self.resp is None:  # not opened yet: headers, preamble and answer in one write
            if self.stream:
                resp = web.Response(body=self._preamble + data, headers=_waiting_headers(SSE_TYPE))
            else:
                resp = web.Response(body=data, content_type="application/json")
            await resp.prepare(self.request)
            self.handed_over = True  # write_eof hands the body to the transport before it awaits
            await self._delivered(resp.write_eof())
            return resp
        # The last frames with the end of the body: one send, not two.
        self.handed_over = True
        await self._delivered(self.resp.write_eof(data))
        return self.resp

    async def _delivered(self, eof: Awaitable[None]) -> None:
        """Await `eof` (write_eof: it waits for the transport to drain below its high-water
        mark) and `_flushed`, while the harness keeps taking the answer: cut once the
        transport's unsent bytes have not shrunk for `deliver_timeout_s` (`_Stall`)."""
        transport = self.request.transport
        ended = False
        try:
            async with asyncio.timeout(None) as deadline:
                stall = _Stall(transport, deadline, self.deliver_timeout_s)
                try:
                    await eof
                    ended = True
                    await self._flushed()
                    return
                finally:
                    stall.stop()
        except TimeoutError:
            # the last bytes left in the loop pass between the stall's look and the expiry
            if ended and transport is not None and not transport.is_closing() \
                    and not transport.get_write_buffer_size():
                return
        log.warning("proxy.reply.unread", timeout_s=self.deliver_timeout_s,
                    unsent_bytes=transport.get_write_buffer_size() if transport is not None else 0)
        self.cut()
        raise ConnectionResetError(
            f"the client took none of the answer for {self.deliver_timeout_s} s") from None

    async def _flushed(self) -> None:
        """Return once the transport holds none of the answer: its last bytes are then the
        kernel's to send, also if the process exits. (write_eof returns with up to 64 KiB
        still in the transport for a reader that takes it slowly; a stop would lose that
        tail of an answer recorded `ok`.) Raises ConnectionResetError when the connection
        closes first."""
        transport = self.request.transport
        while transport is not None and transport.get_write_buffer_size():
            if transport.is_closing():
                raise ConnectionResetError("the client went away before it took the whole answer")
            await asyncio.sleep(FLUSH_POLL_S)

    def cut(self) -> None:
        """The call is given up before `send` returned: when the answer is already handed to
        the transport (a slow reader holds it), cut the connection, so that the harness, like
        the call's record, has no answer."""
        if self.handed_over and self.request.transport is not None:
            self.request.transport.abort()

    async def fail(self, err: ApiError) -> web.StreamResponse:
        await self.stop_keepalive()
        if self.resp is None:
            return error_response(self.api, err)
        if not self.stream:
            # The 200 went out with the keep-alive newlines, and an SDK reads a 200 body as an
            # answer (OpenAI's gives `choices=None`): cut the body short instead, which the
            # SDKs and harnesses treat as a broken connection and retry.
            log.warning("proxy.reply.cut", status=err.status, error=err.message[:200])
            if self.request.transport is not None:
                self.request.transport.abort()
            return self.resp
        await self.resp.write(self.api.sse_error(err, self.start_info))
        await self.resp.write_eof()
        return self.resp


class _Stall:
    """Watches an answer's unsent bytes after its hand-over: every quarter of limit_s it
    samples what the transport holds plus what the socket's send queue holds (Linux
    `TIOCOUTQ`: the kernel lets the transport write again only once half its queue has
    drained, so a steady reader's progress shows there first), and once that has not shrunk
    for limit_s while the transport still holds some (a reader that stopped; one that
    reads slowly but steadily is never cut), it expires `deadline` (an `asyncio.timeout`):
    the awaiting coroutine gets TimeoutError within 1.25 × limit_s of the reader's last
    progress. An answer wholly handed to the kernel is delivered, whenever the timer looks."""

    def __init__(self, transport: asyncio.Transport | None, deadline: asyncio.Timeout, limit_s: float):
        self.transport = transport
        self.deadline = deadline
        self.limit_s = limit_s
        self.loop = asyncio.get_running_loop()
        self.fd: int | None = None  # the socket's, looked up at the first sample
        self.unsent: int | None = None  # the last sample; None before the first
        self.progress_at = self.loop.time()
        self.timer: asyncio.TimerHandle | None = self.loop.call_later(limit_s / 4, self._look)

    def _queued(self) -> int:
        """Bytes in the socket's send queue (sent but not acknowledged, or not sent); 0
        where the platform does not tell."""
        if self.fd is None:
            sock = self.transport.get_extra_info("socket") if self.transport is not None else None
            self.fd = sock.fileno() if sock is not None and TIOCOUTQ is not None else -1
        if self.fd < 0:
            return 0
        try:
            return struct.unpack("i", fcntl.ioctl(self.fd, TIOCOUTQ, b"\0\0\0\0"))[0]
        except OSError:
            self.fd = -1
            return 0

    def _look(self) -> None:
        held = self.transport.get_write_buffer_size() if self.transport is not None else 0
        unsent = held + self._queued()
        now = self.loop.time()
        if self.unsent is not None and unsent < self.unsent:
            self.progress_at = now
        self.unsent = unsent
        if held and now - self.progress_at >= self.limit_s:
            self.timer = None
            self.deadline.reschedule(now)
        else:
            self.timer = self.loop.call_later(self.limit_s / 4, self._look)

    def stop(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None


def url_in(url_file: Path) -> str:
    """The `url` a run's url file (`proxy.json`) names; '' when there is none."""
    try:
        url = orjson.loads(url_file.read_bytes())["url"]
    except (OSError, ValueError, TypeError, KeyError):
        return ""
    return url if isinstance(url, str) else ""


async def serving_proxy(session: Any, url: str, run: str, timeout_s: float = 2.0) -> str | None:
    """`url` when a proxy of `run` answers `/health` there, else None (a proxy that has
    exited, something else on that port now)."""
    try:
        async with session.get(url + "/health", timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            body = await resp.json(content_type=None)
        return url if resp.status == 200 and isinstance(body, dict) and body.get("run") == run else None
    except Exception:  # noqa: BLE001 - nothing of ours serves there
        return None
