"""Keep-alive HTTP/1.1 connections to one engine, for its hot endpoint (`/generate`).

Every model call of every harness goes proxy → engine once, so this request is gyre's
hottest internal one. aiohttp's client spends ≈ 210 Python calls on it (URL, headers,
request and response objects, timers, payload writers): 0.3–0.5 ms of CPU a request on
the project's 2-core VM when calls arrive a few milliseconds apart (the proxy bench's
latency run), against 0.13–0.16 ms for one `transport.write` and a parse with `httptools`
(llhttp, the parser uvicorn uses) — measured in the same process, interleaved
(docs/results.md, "The engine request"). The proxy's budget for all it adds to a
call is 1 ms (BENCHMARKS.md), so the `/generate` leg uses this pool; every other engine
endpoint stays on the aiohttp session (`handlers.engines.client.EngineClient`).

What it speaks: `POST` with a `Content-Length` body; a response framed by
`Content-Length`, chunked encoding, or the connection's close (httptools parses them;
`Accept-Encoding: identity` asks for no compression); interim 1xx responses are skipped.
One request per connection at a time; an idle connection is kept for reuse for at most
`idle_s` seconds (below uvicorn's 5-s keep-alive, SGLang's server; a timer closes it then,
whether or not another call comes) and dropped when the engine closes it, answers
`Connection: close`, or sends bytes beyond its answer. Before an idle connection is
reused its socket is polled: one the engine has closed or written to meanwhile (a close
the event loop has not read yet) is dropped and the request goes on another, as urllib3
does.

Errors (`post`): ConnectionError (refused, reset, not resolved, no route, a TLS failure,
closed before the whole response, malformed response, an unusable URL) and
asyncio.TimeoutError (`timeout_s` ran out); `Unreachable`, a ConnectionError, when no
connection could be made (within `connect_s` too), so the request was never sent. A request is never sent twice:
when the engine closes a reused idle connection after the poll, just as the request goes
out, that is a ConnectionError like any other (the caller, `handlers.proxy.routing.Dispatcher`,
retries under a new request id), since the engine may have read it. Cancelling `post`, or
its timeout, aborts the connection, so the engine sees the client go and aborts the
generation (SGLang and gyre's engine do).
"""
from __future__ import annotations

import asyncio
import base64
import select
import ssl
import time
import urllib.parse

import httptools

IDLE_S = 4.0
"""Seconds an idle connection is kept for reuse (uvicorn closes idle ones after 5 s)."""


class Unreachable(ConnectionError):
    """No connection to the engine could be made: the request was never sent."""


class _Connection(asyncio.Protocol):
    """One connection; `request` sends a whole request and returns (status, body)."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.waiter: asyncio.Future | None = None
        self.chunks: list[bytes] = []
        self.framed = False  # the answer's headers name its length (Content-Length or chunked)
        self.headers_done = False
        self.answered = False  # the final answer of the current request is complete
        self.keep_alive = False
        self.closed = False
        self.idle_since = 0.0
        self.poll = select.poll()

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None:
            self.poll.register(sock.fileno(), select.POLLIN | select.POLLPRI)

    def reusable(self) -> bool:
        """Open, and nothing arrived on it since its answer: no close, reset or stray bytes
        in the kernel that the event loop has not read yet (one `poll` with no wait)."""
        return not self.closed and not self.transport.is_closing() and not self.poll.poll(0)

    def data_received(self, data: bytes) -> None:
        if self.waiter is None or self.waiter.done():  # unasked bytes (a 408 on an idle connection)
            self.abort()
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(ConnectionError(f"malformed HTTP response from the engine: {exc}"))
            self.abort()
        except httptools.HttpParserUpgrade:
            self._fail(ConnectionError("the engine answered with a protocol upgrade"))
            self.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if exc is None and self.headers_done and not self.framed and not self.answered:
            self._answer()  # a body that ends where the connection does (HTTP/1.0 style)
        if exc is None:
            exc = ConnectionResetError("the engine closed the connection before its whole answer")
        elif not isinstance(exc, (ConnectionError, TimeoutError)):  # an SSL or other OSError
            exc = ConnectionResetError(f"the engine's connection failed: {exc!r}")
        self._fail(exc)

    # httptools callbacks
    def on_message_begin(self) -> None:
        if self.answered:  # bytes beyond the answer: this connection's framing is not to be trusted
            self.keep_alive = False
        self.chunks, self.framed, self.headers_done = [], False, False

    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        if name == b"content-length" or (name == b"transfer-encoding" and b"chunked" in value.lower()):
            self.framed = True

    def on_headers_complete(self) -> None:
        self.headers_done = True
        status = self.parser.get_status_code()
        if status < 200 or status in (204, 304):
            self.framed = True  # no body

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)

    def on_message_complete(self) -> None:
        status = self.parser.get_status_code()
        if 100 <= status < 200:
            return  # an interim answer (100 Continue, 103 Early Hints): the final one follows
        if not self.answered:
            self.keep_alive = self.parser.should_keep_alive()
            self._answer()

    def _answer(self) -> None:
        self.answered = True
        body, self.chunks = b"".join(self.chunks), []  # an idle connection holds no old answer
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result((self.parser.get_status_code(), body))

    def _fail(self, exc: BaseException) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(exc)

    def abort(self) -> None:
        """Close at once, unsent bytes dropped (a request given up: the engine sees it go)."""
        self.closed = True
        if self.transport is not None:
            self.transport.abort()

    def close(self) -> None:
        """Close once what was written is sent (a connection done with)."""
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    async def request(self, data: bytes) -> tuple[int, bytes]:
        if self.closed or self.transport.is_closing():  # type: ignore[union-attr]
            raise ConnectionResetError("the engine's connection closed before the request was sent")
        self.waiter = asyncio.get_running_loop().create_future()
        self.chunks, self.answered, self.headers_done, self.framed = [], False, False, False
        self.transport.write(data)  # type: ignore[union-attr]
        try:
            return await self.waiter
        finally:
            self.waiter = None


class EngineConnections:
    """A pool of keep-alive connections to the engine at `base_url` ("http://host:port",
    optionally with a path prefix; https is served with the default SSL context).
    connect_s: seconds a new connection may take. idle_s: seconds an idle connection is
    kept. bearer: the engine's token, sent as `Authorization: Bearer` ('' = none; a URL's
    user and password are then sent as Basic). Use from one event loop; `close` drops the idle connections. A URL this pool
    cannot reach (no http(s) scheme or host, a bad port) fails each `post` with
    ConnectionError, as a refused connection does: the caller avoids that engine, as it
    did when aiohttp refused such a URL."""

    def __init__(self, base_url: str, connect_s: float = 10.0, idle_s: float = IDLE_S, bearer: str = "") -> None:
        self.invalid = ""
        try:
            parts = urllib.parse.urlsplit(base_url)
            self.port = (443 if parts.scheme == "https" else 80) if parts.port is None else parts.port
            if not self.port:
                raise ValueError("port 0")
            (parts.hostname or "").encode("idna")  # as getaddrinfo will (an empty or 64-char label fails)
            self.authority = parts.netloc.rpartition("@")[2].encode("ascii")
            # Written into the request line: percent-encoded as aiohttp (yarl) does (RFC 3986 3.3).
            self.prefix = urllib.parse.quote(parts.path.rstrip("/"), safe="/%:@!$&'()*+,;=-._~")
            user, password = parts.username or "", parts.password or ""
            self.auth = b"Authorization: Basic %s\r\n" % base64.b64encode(
                f"{urllib.parse.unquote(user)}:{urllib.parse.unquote(password)}".encode()) if user or password else b""
            if bearer:  # the engine's token (SGLang's --api-key) takes the Authorization header
                self.auth = b"Authorization: Bearer %s\r\n" % bearer.encode("ascii")
        except (ValueError, UnicodeError) as exc:
            parts, self.invalid = None, f"engine URL {base_url!r} is not usable: {exc}"
        if parts is not None and (parts.scheme not in ("http", "https") or not parts.hostname):
            self.invalid = f"engine URL must be http(s)://host[:port][/prefix], got {base_url!r}"
        self.host = parts.hostname if parts is not None else ""
        self.ssl = ssl.create_default_context() if parts is not None and parts.scheme == "https" else None
        self.connect_s = connect_s
        self.idle_s = idle_s
        self._idle: list[_Connection] = []  # most recently used last
        self._pruning: asyncio.TimerHandle | None = None  # closes the idle connections idle_s has passed for
        self._closed = False

    def _head(self, path: str, length: int) -> bytes:
        return (b"POST %s HTTP/1.1\r\nHost: %s\r\n%sContent-Type: application/json\r\nAccept-Encoding: identity\r\n"
                b"Content-Length: %d\r\n\r\n"
                % ((self.prefix + path).encode("ascii"), self.authority, self.auth, length))

    def _take_idle(self) -> _Connection | None:
        now = time.monotonic()
        while self._idle:
            conn = self._idle.pop()
            if now - conn.idle_since < self.idle_s and conn.reusable():
                return conn
            conn.close()
        return None

    async def _connect(self) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_s):
                _, conn = await loop.create_connection(_Connection, self.host, self.port, ssl=self.ssl)
        except UnicodeError as exc:  # a host name the resolver's IDNA step refuses
            raise Unreachable(f"engine host {self.host!r} is not usable: {exc}") from None
        except TimeoutError:
            raise Unreachable(f"engine {self.host}:{self.port}: no connection within {self.connect_s:g} s") from None
        except OSError as exc:  # refused, not resolved, no route, a TLS handshake refused
            raise Unreachable(f"engine {self.host}:{self.port} unreachable: {exc}") from exc
        return conn

    async def post(self, path: str, body: bytes, timeout_s: float | None = None) -> tuple[int, bytes]:
        """POST `body` (JSON bytes) to `path`; returns (HTTP status, response body bytes).
        timeout_s: seconds the whole request may take (None: unbounded). Raises
        ConnectionError or asyncio.TimeoutError (module docstring)."""
        if self.invalid:
            raise Unreachable(self.invalid)
        data = self._head(path, len(body)) + body
        async with asyncio.timeout(timeout_s):
            conn = self._take_idle() or await self._connect()
            try:
                return self._done(conn, await conn.request(data))
            except BaseException:
                conn.abort()
                raise

    def _done(self, conn: _Connection, result: tuple[int, bytes]) -> tuple[int, bytes]:
        if conn.keep_alive and not conn.closed and not self._closed:
            conn.idle_since = time.monotonic()
            self._idle.append(conn)
            if self._pruning is None:
                self._pruning = asyncio.get_running_loop().call_later(self.idle_s, self._prune)
        else:
            conn.close()
        return result

    def _prune(self) -> None:
        """Close the idle connections idle_s has passed for (the least recently used are
        first: once a burst is over its connections go), and wake again for the next."""
        self._pruning = None
        now = time.monotonic()
        while self._idle and (self._idle[0].closed or now - self._idle[0].idle_since >= self.idle_s):
            self._idle.pop(0).close()
        if self._idle:
            wait = self._idle[0].idle_since + self.idle_s - now
            self._pruning = asyncio.get_running_loop().call_later(max(wait, 0.001), self._prune)

    def close(self) -> None:
        """Drop the idle connections and keep none from now on (one in use is closed when its
        request ends or is cancelled). Requests may still be made, each on a new connection."""
        self._closed = True
        if self._pruning is not None:
            self._pruning.cancel()
            self._pruning = None
        while self._idle:
            self._idle.pop().close()
