"""`handlers.engines.connections.EngineConnections` (the `/generate` leg's keep-alive pool) against
real servers on 127.0.0.1: an aiohttp app for the ordinary answers, raw asyncio servers
for what aiohttp would not send (a connection closed mid-answer, an idle close that races
a reuse). Cancellation and timeouts must close the connection so the engine sees the
client go; `tests/test_engine_server.py` checks the engine then aborts."""
from __future__ import annotations

import asyncio
import base64
import contextlib
import socket
import threading
import time

import orjson
import pytest
from aiohttp import web

from handlers.engines.client import EngineClient, EngineRequestError, EngineUnavailable, make_session
from handlers.engines.connections import EngineConnections
from tests.test_engine_server import until


@contextlib.asynccontextmanager
async def _app_server(app: web.Application):
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


def _echo_app(seen: list) -> web.Application:
    """/generate answers the request body and the peer's port; /chunked streams it in chunks;
    /close answers with Connection: close; /refused and /unavailable prefixes answer 400 and 503."""
    app = web.Application()

    async def generate(request: web.Request) -> web.Response:
        body = await request.read()
        peer = request.transport.get_extra_info("peername")[1]
        seen.append((request.path, peer, request.headers.get("Content-Type"), request.headers.get("Host"),
                     request.headers.get("Authorization")))
        return web.Response(body=orjson.dumps({"echo": orjson.loads(body), "peer": peer}),
                            content_type="application/json")

    async def chunked(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        for part in (b'{"parts": [', b'"a", ', b'"b"', b"]}"):
            await resp.write(part)
        await resp.write_eof()
        return resp

    async def close(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=b'{"closing": true}', headers={"Connection": "close"})

    async def refused(request: web.Request) -> web.Response:
        await request.read()
        return web.json_response({"error": {"message": "bad sampling", "type": "invalid_request_error"}}, status=400)

    async def unavailable(request: web.Request) -> web.Response:
        await request.read()
        return web.json_response({"error": "not serving"}, status=503)

    app.router.add_post("/generate", generate)
    app.router.add_post("/prefix/generate", generate)
    app.router.add_post("/my engine/é/generate", generate)
    app.router.add_post("/chunked", chunked)
    app.router.add_post("/close", close)
    app.router.add_post("/refused/generate", refused)
    app.router.add_post("/unavailable/generate", unavailable)
    return app


async def test_requests_reuse_one_keep_alive_connection_and_frame_the_body():
    seen: list = []
    async with _app_server(_echo_app(seen)) as url:
        pool = EngineConnections(url)
        answers = []
        for i in range(3):
            status, raw = await pool.post("/generate", orjson.dumps({"i": i, "text": "é" * 1000}))
            assert status == 200
            answers.append(orjson.loads(raw))
        assert [a["echo"]["i"] for a in answers] == [0, 1, 2] and answers[0]["echo"]["text"] == "é" * 1000
        assert len({a["peer"] for a in answers}) == 1  # the same connection each time
        assert len(pool._idle) == 1 and not pool._idle[0].chunks  # an idle connection holds no old answer
        pool.close()  # for good: a request after it is answered, its connection not kept
        assert (await pool.post("/generate", b"{}"))[0] == 200 and not pool._idle
        assert seen[0][2:] == ("application/json", url.removeprefix("http://"), None)
        # A path prefix in the base URL is kept; credentials in it are sent as Basic auth.
        status, raw = await EngineConnections(url + "/prefix/").post("/generate", b"{}")
        assert status == 200 and seen[-1][0] == "/prefix/generate"
        await EngineConnections(url.replace("//", "//us%40er:p%3Ass@")).post("/generate", b"{}")
        assert seen[-1][3:] == (url.removeprefix("http://"), "Basic " + base64.b64encode(b"us@er:p:ss").decode())
        await EngineConnections(url.replace("//", "//:t%20ok@")).post("/generate", b"{}")  # a token alone
        assert seen[-1][4] == "Basic " + base64.b64encode(b":t ok").decode()
        # A prefix with characters a request line cannot hold is percent-encoded, as aiohttp does.
        status, raw = await EngineConnections(url + "/my engine/é").post("/generate", b"{}")
        assert status == 200 and seen[-1][0] == "/my engine/é/generate"
        pool.close()


async def test_concurrent_requests_take_their_own_connections():
    seen: list = []
    async with _app_server(_echo_app(seen)) as url:
        pool = EngineConnections(url)
        answers = await asyncio.gather(*(pool.post("/generate", orjson.dumps({"i": i})) for i in range(5)))
        assert sorted(orjson.loads(raw)["echo"]["i"] for _, raw in answers) == list(range(5))
        assert len({orjson.loads(raw)["peer"] for _, raw in answers}) == 5
        pool.close()


async def test_chunked_answers_are_joined_and_connection_close_is_honoured():
    seen: list = []
    async with _app_server(_echo_app(seen)) as url:
        pool = EngineConnections(url)
        status, raw = await pool.post("/chunked", b"{}")
        assert status == 200 and orjson.loads(raw) == {"parts": ["a", "b"]}
        first = orjson.loads((await pool.post("/generate", b"{}"))[1])["peer"]
        status, raw = await pool.post("/close", b"{}")  # on the same connection, which then goes
        assert status == 200 and orjson.loads(raw) == {"closing": True}
        after = orjson.loads((await pool.post("/generate", b"{}"))[1])["peer"]
        assert after != first
        pool.close()


async def test_an_idle_connection_is_dropped_after_idle_s():
    seen: list = []
    async with _app_server(_echo_app(seen)) as url:
        pool = EngineConnections(url, idle_s=0.05)
        first = orjson.loads((await pool.post("/generate", b"{}"))[1])["peer"]
        again = orjson.loads((await pool.post("/generate", b"{}"))[1])["peer"]
        await asyncio.sleep(0.1)
        later = orjson.loads((await pool.post("/generate", b"{}"))[1])["peer"]
        assert first == again != later
        # A burst's extra connections are closed once idle_s has passed, not kept for good.
        await asyncio.gather(*(pool.post("/generate", b"{}") for _ in range(4)))
        assert len(pool._idle) == 4
        for _ in range(8):  # one call at a time keeps reusing the newest connection
            await asyncio.sleep(0.015)
            await pool.post("/generate", b"{}")
        assert len(pool._idle) == 1
        pool.close()


class _RawEngine:
    """A raw HTTP/1.1 server: reads requests (headers and a Content-Length body) one after
    another on each connection and does what `behaviour(n)` says for the server's n-th
    request: "answer" (200, keep-alive), "interim" (100 and 103 first), "stray" (an answer
    followed by the start of another), "eof" (an answer without a length, then close),

    "drop" (close the connection without a byte: an idle close that crossed the client's
    reuse), "cut" (half an answer, then close), or "hang" (nothing, until the client goes)."""

    def __init__(self, behaviour):
        self.behaviour = behaviour
        self.requests = 0
        self.connections = 0
        self.closed_by_client = 0
        self.heads: list[bytes] = []

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                                  if line.lower().startswith(b"content-length")))
                await reader.readexactly(length)
                self.heads.append(head)
                self.requests += 1
                what = self.behaviour(self.requests)
                body = b'{"ok": true, "n": %d}' % self.requests
                if what in ("answer", "interim", "stray"):
                    if what == "interim":  # interim answers first, as HTTP/1.1 allows
                        writer.write(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </x>\r\n\r\n")
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
                    if what == "stray":  # bytes beyond the answer, the start of another
                        writer.write(b"HTTP/1.1 200 OK\r\nContent-Le")
                    await writer.drain()
                    continue
                if what == "eof":  # no length: the body ends where the connection does
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n\r\n%s" % body)
                    await writer.drain()
                if what == "cut":
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body[:5]))
                    await writer.drain()
                elif what == "hang" and await reader.read(1) == b"":
                    self.closed_by_client += 1
                return
        except (asyncio.IncompleteReadError, ConnectionError):
            self.closed_by_client += 1
        finally:
            writer.close()

    @contextlib.asynccontextmanager
    async def serving(self):
        server = await asyncio.start_server(self.handle, "127.0.0.1", 0)
        try:
            yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        finally:
            server.close()


async def test_a_request_is_never_sent_twice_not_even_after_an_idle_close_crossed_it():
    engine = _RawEngine(lambda n: "drop" if n == 2 else "answer")
    async with engine.serving() as url:
        pool = EngineConnections(url)
        assert orjson.loads((await pool.post("/generate", b"{}"))[1]) == {"ok": True, "n": 1}
        # The engine may have read it before it closed: the caller retries under a new id.
        with pytest.raises(ConnectionError):
            await pool.post("/generate", b"{}")
        assert engine.requests == 2 and engine.connections == 1
        assert orjson.loads((await pool.post("/generate", b"{}"))[1]) == {"ok": True, "n": 3}
        pool.close()


async def test_interim_answers_are_skipped_and_a_close_ended_body_is_an_answer():
    engine = _RawEngine(lambda n: {1: "interim", 2: "answer", 3: "eof"}.get(n, "answer"))
    async with engine.serving() as url:
        pool = EngineConnections(url)
        for n in (1, 2, 3, 4):  # each gets its own answer, never another request's
            status, raw = await pool.post("/generate", b"{}")
            assert (status, orjson.loads(raw)) == (200, {"ok": True, "n": n})
        assert engine.connections == 2  # the close-ended answer's connection was not reused
        pool.close()


async def test_a_connection_with_bytes_beyond_its_answer_is_not_reused():
    engine = _RawEngine(lambda n: "stray" if n == 1 else "answer")
    async with engine.serving() as url:
        pool = EngineConnections(url)
        assert orjson.loads((await pool.post("/generate", b"{}"))[1]) == {"ok": True, "n": 1}
        assert orjson.loads((await pool.post("/generate", b"{}"))[1]) == {"ok": True, "n": 2}
        assert engine.connections == 2
        pool.close()


async def test_an_answer_cut_midway_is_an_error_and_not_sent_again():
    engine = _RawEngine(lambda n: "answer" if n == 1 else "cut")
    async with engine.serving() as url:
        pool = EngineConnections(url)
        await pool.post("/generate", b"{}")
        with pytest.raises(ConnectionError):  # on the reused connection
            await pool.post("/generate", b"{}")
        assert engine.requests == 2  # a request the engine answered in part is never sent again
        client = EngineClient(url, make_session())
        with pytest.raises(EngineUnavailable, match="ConnectionResetError"):
            await client.generate([1, 2], {}, rid="r")
        await client.session.close()


async def test_a_timeout_or_a_cancel_closes_the_connection_so_the_engine_sees_the_client_go():
    engine = _RawEngine(lambda n: "hang")
    async with engine.serving() as url:
        pool = EngineConnections(url)
        with pytest.raises(TimeoutError):
            await pool.post("/generate", b"{}", timeout_s=0.2)
        await until(lambda: engine.closed_by_client == 1, "the engine to see the timed-out client go", 5)
        task = asyncio.create_task(pool.post("/generate", b"{}"))
        await until(lambda: engine.requests == 2, "the second request to arrive", 5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await until(lambda: engine.closed_by_client == 2, "the engine to see the cancelled client go", 5)
        assert not pool._idle


async def test_engine_client_generate_maps_statuses_and_failures_to_its_errors():
    seen: list = []
    async with _app_server(_echo_app(seen)) as url:
        session = make_session()
        ok = await EngineClient(url, session).generate([1, 2, 3], {"max_new_tokens": 2}, rid="r1", execution="e")
        assert ok["echo"] == {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}, "return_logprob": True,
                              "rid": "r1", "stream": False, "gyre_execution": "e"}
        with pytest.raises(EngineRequestError) as err:
            await EngineClient(url + "/refused", session).generate([1], {}, rid="r2")
        assert err.value.status == 400 and err.value.body["error"]["message"] == "bad sampling"
        with pytest.raises(EngineUnavailable, match="503"):
            await EngineClient(url + "/unavailable", session).generate([1], {}, rid="r3")
        await session.close()
    # Nothing listens there any more: refused, retryable.
    session = make_session()
    with pytest.raises(EngineUnavailable, match="generate"):
        await EngineClient(url, session).generate([1], {}, rid="r4")
    await session.close()


async def test_an_engine_url_that_is_not_http_fails_each_request_as_unreachable():
    # Not at construction: the proxy's router avoids such a cell and serves elsewhere,
    # as it did when aiohttp refused the URL.
    for bad in ("unix:///tmp/engine.sock", "127.0.0.1:30000", "http://127.0.0.1:99999", "http://höst:1",
                "http://127.0.0.1:0", "http://a..b:1", "http://" + "x" * 64 + ".example:1"):
        with pytest.raises(ConnectionError, match="engine URL"):
            await EngineConnections(bad).post("/generate", b"{}")
        session = make_session()
        with pytest.raises(EngineUnavailable, match="engine URL"):
            await EngineClient(bad, session).generate([1], {}, rid="r")
        await session.close()


async def test_network_failures_of_every_kind_are_connection_errors():
    # Not resolved (gaierror), a TLS handshake with a plain-HTTP engine (SSLError): OSErrors
    # that are not ConnectionErrors, which a caller going by the docstring would miss.
    async with _app_server(_echo_app([])) as url:
        for unreachable in ("http://no-such-engine.invalid:30000", url.replace("http:", "https:")):
            with pytest.raises(ConnectionError):
                await EngineConnections(unreachable, connect_s=5).post("/generate", b"{}")


@contextlib.contextmanager
def _closing_engine_thread(close_after_s: float):
    """An engine in its own thread (so its close is sent while the test's event loop is
    busy): each connection gets one keep-alive answer, then is closed after `close_after_s`.
    Yields (url, the number of requests read)."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.05)  # so the thread sees `stop`
    requests = [0]
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            with conn:
                head = b""
                while b"\r\n\r\n" not in head:
                    head += conn.recv(65536)
                requests[0] += 1
                body = b'{"ok": true, "n": %d}' % requests[0]
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
                time.sleep(close_after_s)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}", requests
    finally:
        stop.set()
        thread.join(5)
        listener.close()


async def test_an_idle_connection_the_engine_closed_is_not_reused_and_the_request_goes_on_a_new_one():
    # The engine closed the idle connection while the event loop was busy: the close is in the
    # kernel, not yet read by the loop. The poll before reuse finds it, so the request goes
    # out once, on a new connection (without the poll it failed with ConnectionResetError).
    with _closing_engine_thread(0.05) as (url, requests):
        pool = EngineConnections(url)
        for n in (1, 2, 3):
            assert orjson.loads((await pool.post("/generate", b"{}"))[1]) == {"ok": True, "n": n}
            time.sleep(0.3)  # the loop is busy; the engine's close arrives meanwhile
        assert requests[0] == 3
        pool.close()


async def test_a_bursts_idle_connections_are_closed_after_idle_s_with_no_further_call():
    engine = _RawEngine(lambda n: "answer")
    async with engine.serving() as url:
        pool = EngineConnections(url, idle_s=0.1)
        await asyncio.gather(*(pool.post("/generate", b"{}") for _ in range(6)))
        assert engine.connections == 6
        await until(lambda: engine.closed_by_client == 6, "the idle connections to be closed", 2)
        assert not pool._idle and pool._pruning is None
        assert orjson.loads((await pool.post("/generate", b"{}"))[1])["n"] == 7  # and a later call is served
        pool.close()
        assert pool._pruning is None


async def test_requests_ask_for_no_compression():
    # No Accept-Encoding would allow any (RFC 9110 12.5.3), and the pool decodes none.
    engine = _RawEngine(lambda n: "answer")
    async with engine.serving() as url:
        pool = EngineConnections(url)
        await pool.post("/generate", b"{}")
        assert b"\r\naccept-encoding: identity\r\n" in engine.heads[0].lower()
        pool.close()
