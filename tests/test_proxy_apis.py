"""The proxy's three APIs on the wire: error shapes (401/400/413/415/429), compressed
bodies, raw SSE framing, rerouting when a cell fails or leaves rollout mid-request, key
isolation, and roles + harness metadata on `call.completed`."""
from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
import os
import socket
import time
import zlib
from collections.abc import Callable

import aiohttp
import anthropic
import openai
import pytest
import structlog.testing
from aiohttp import web

from gyre.env.harness import execution_key
from gyre.serving.tokenizer import IM_END, VOCAB_SIZE
from handlers.engines.client import make_session
from handlers.proxy.state import vocab_size
from handlers.proxy.anthropic import parse_messages_request
from handlers.proxy.api import MEMBERS, ApiError, decode_body, unique_hex, zstd_decompressor
from handlers.proxy.http import STREAM_OPEN_S
from handlers.proxy.routing import (
    MAX_ENGINE_ABORTS, MAX_ENGINE_ERRORS, Attempt, Dispatcher, Router, engine_reply, race,
)
from schemas import ids
from schemas.call import SamplingParams
from schemas.cell import CellSwitched, Route, RouteUpdated
from schemas.execution import ExecutionFinished, ExecutionInfo, ExecutionStarted
from tests.test_proxy import SECRET, Stack, bus, tok  # noqa: F401 - fixtures

CHAT = ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "hi"}]})
RESPONSES = ("/v1/responses", {"model": "m", "input": "hi", "stream": True})
MESSAGES = ("/v1/messages?beta=true", {"model": "claude-x", "max_tokens": 50,
                                       "messages": [{"role": "user", "content": "hi"}]})
APIS = {"chat": CHAT, "responses": RESPONSES, "messages": MESSAGES}


@pytest.fixture
async def local(tok):  # noqa: F811
    s = Stack(tok, None, "apis")
    yield s
    await s.close()


def error_type(api: str, body: dict) -> str:
    """The error type in the API's own shape (asserting the shape)."""
    if api == "messages":
        assert body["type"] == "error" and set(body["error"]) == {"type", "message"}
        return body["error"]["type"]
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]["type"]


async def wait_for(predicate, tries: int = 500):
    for _ in range(tries):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition never held")


@pytest.mark.parametrize("api", sorted(APIS))
async def test_errors_in_each_api_shape(local, api):
    engine = await local.engine(["slow"], delay_s=30.0)
    url = await local.proxy(engine=engine, body_limit_bytes=4000, max_active_calls_per_execution=1, retry_after_s=3)
    path, body = APIS[api]
    key = execution_key(SECRET, f"ex-{api}")
    async with aiohttp.ClientSession() as http:
        async with http.post(url + path, json=body) as r:
            assert r.status == 401 and error_type(api, await r.json()) == "authentication_error"
        async with http.post(url + path, json=body, headers={"x-api-key": "gyre-ex-" + "0" * 32}) as r:
            assert r.status == 401 and error_type(api, await r.json()) == "authentication_error"
        auth = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
        async with http.post(url + path, data=b"{nope", headers=auth) as r:
            assert r.status == 400 and error_type(api, await r.json()) == "invalid_request_error"
        async with http.post(url + path, json={"model": "m"}, headers=auth) as r:
            assert r.status == 400 and error_type(api, await r.json()) == "invalid_request_error"
        big = {**body, "padding": "x" * 5000}
        async with http.post(url + path, json=big, headers=auth) as r:
            assert r.status == 413 and error_type(api, await r.json()) in ("request_too_large", "invalid_request_error")
        # A small gzip body that expands past the limit is refused too.
        async with http.post(url + path, data=gzip.compress(json.dumps(big).encode()),
                             headers={**auth, "Content-Encoding": "gzip"}) as r:
            assert r.status == 413
        # One call in flight for this execution: a second one gets 429 + Retry-After.
        first = asyncio.ensure_future(http.post(url + path, json=body, headers=auth))
        await wait_for(lambda: engine.requests)
        async with http.post(url + path, json=body, headers=auth) as r:
            assert r.status == 429 and r.headers["Retry-After"] == "3"
            assert error_type(api, await r.json()) == "rate_limit_error"
        first.cancel()
        await asyncio.gather(first, return_exceptions=True)


@pytest.mark.parametrize("api", sorted(APIS))
async def test_top_p_zero_is_the_top_token_alone(tok, bus, run_id, api):  # noqa: F811
    """The hosted APIs take `top_p` in [0, 1]; 0 (a nucleus of the top token) is sent to the
    engine, and recorded, as top_k = 1, top_p = 1, since SGLang takes top_p only in (0, 1]."""
    stack = Stack(tok, bus, run_id)
    try:
        engine = await stack.engine(["fine"])
        url = await stack.proxy(engine=engine)
        path, body = APIS[api]
        auth = {"Authorization": f"Bearer {execution_key(SECRET, 'ex-top')}"}
        async with aiohttp.ClientSession() as http:
            async with http.post(url + path, json={**body, "top_p": 0}, headers=auth) as r:
                assert r.status == 200, await r.text()
                answer = await r.read()
            if api == "responses":  # the request's own value is echoed, as with max_output_tokens
                assert b'"top_p":0,' in answer
            for bad in (-0.1, 1.5):
                async with http.post(url + path, json={**body, "top_p": bad}, headers=auth) as r:
                    assert r.status == 400 and "'top_p' must be in [0.0, 1.0]" in (await r.text())
        (call,) = await stack.calls(1)
    finally:
        await stack.close()
    sent = engine.requests[0]["sampling_params"]
    assert (sent["top_p"], sent["top_k"]) == (1.0, 1)
    assert (call.sampling.top_p, call.sampling.top_k, call.status) == (1.0, 1, "ok")


async def test_count_tokens_is_held_to_the_concurrency_bounds(local):
    """count_tokens renders and tokenises like a call (on the branch thread when long): an
    execution at its bound of calls in flight gets a 429 for it too, and once the call is
    done its count is answered."""
    engine = await local.engine(["slow"], delay_s=1.0)
    await local.proxy(engine=engine, max_active_calls_per_execution=1, retry_after_s=2)
    client = local.anthropic("ex-count")
    messages = [{"role": "user", "content": "How long is this?"}]
    busy = asyncio.ensure_future(client.messages.create(model="x", max_tokens=5, messages=messages))
    await wait_for(lambda: engine.requests)
    with pytest.raises(anthropic.RateLimitError) as err:
        await client.messages.count_tokens(model="x", messages=messages)
    assert err.value.response.headers["Retry-After"] == "2"
    await asyncio.wait_for(busy, 10)
    counted = await client.messages.count_tokens(model="x", messages=messages)
    assert counted.input_tokens == len(engine.requests[0]["input_ids"])
    assert local.state.active == 0 and local.state.executions["ex-count"].active == 0


async def test_count_tokens_rendered_while_its_execution_finished_is_refused(local):
    """A count_tokens whose rendering waited on the branch thread while `execution.finished`
    arrived is answered 403 `execution_finished` and not recorded, as a model call is: its
    record would land after the execution's score."""
    import threading

    from gyre.serving.tito import HEAVY_CHARS

    await local.proxy(engine=await local.engine(["ok"]))
    gate = threading.Event()
    local.state.branch_thread().submit(gate.wait)  # the branch thread is busy
    try:
        counting = asyncio.ensure_future(local.anthropic("ex-ct").messages.count_tokens(
            model="x", messages=[{"role": "user", "content": "word " * (HEAVY_CHARS // 4)}]))
        await wait_for(lambda: "ex-ct" in local.state.executions)
        info = ExecutionInfo(execution="ex-ct", task="t", group="s0-g0", step=0, harness="claude-code",
                             group_size=1, step_groups=1)
        await local.state.handle_event(ExecutionFinished(event_id=ids.finished("apis", "ex-ct"), info=info,
                                                         status="ok", workspace=""))
    finally:
        gate.set()
    with pytest.raises(anthropic.PermissionDeniedError) as err:
        await asyncio.wait_for(counting, 10)
    assert err.value.body["error"]["type"] == "permission_error"
    assert "has finished" in err.value.message
    assert local.state.executions["ex-ct"].next_seq == 0 and local.state.active == 0


async def test_models_are_listed_with_and_without_v1(local):
    """Completions are served with and without `/v1`, so models are too (a client whose base
    URL has no `/v1` lists them before calling); a model id holding a raw slash is one id."""
    await local.proxy(engine=await local.engine(["hi"]))
    bare = openai.AsyncOpenAI(base_url=local.url, api_key=execution_key(SECRET, "ex-models"), max_retries=0)
    local.clients.append(bare)
    assert (await bare.chat.completions.create(model="m", messages=[{"role": "user", "content": "a"}])
            ).choices[0].message.content == "hi"
    assert [m.id async for m in bare.models.list()] == [m.id async for m in local.client("ex-models").models.list()]
    auth = {"Authorization": f"Bearer {execution_key(SECRET, 'ex-models')}"}
    async with aiohttp.ClientSession() as http:
        for path in ("/v1/models/Qwen/Qwen3-8B", "/models/Qwen/Qwen3-8B"):
            async with http.get(local.url + path, headers=auth) as r:
                assert r.status == 200 and (await r.json())["id"] == "Qwen/Qwen3-8B", path


async def test_sdks_raise_their_own_error_classes(local):
    engine = await local.engine(["ok"], delay_s=30.0)
    await local.proxy(engine=engine, max_active_calls=1)
    with pytest.raises(anthropic.AuthenticationError) as refused:
        async with anthropic.AsyncAnthropic(base_url=local.url, api_key="gyre-ex-" + "0" * 32, max_retries=0) as bad:
            await bad.messages.create(model="x", max_tokens=5, messages=[{"role": "user", "content": "a"}])
    assert refused.value.request_id.startswith("req_")  # errors name themselves too, in the log as well
    with structlog.testing.capture_logs() as logs:
        with pytest.raises(anthropic.BadRequestError) as bad:
            await local.anthropic("ex").messages.create(model="x", max_tokens=5,
                                                        messages=[{"role": "tool", "content": "a"}])
    assert [e["request_id"] for e in logs if e["event"] == "proxy.request.refused"] == [bad.value.request_id]
    with pytest.raises(anthropic.BadRequestError):
        await local.anthropic("ex").messages.create(model="x", max_tokens=5, messages=[{"role": "tool", "content": "a"}])
    with pytest.raises(openai.BadRequestError):
        await local.client("ex").responses.create(model="x", input=[{"type": "message", "role": "robot",
                                                                     "content": "a"}])
    busy = asyncio.ensure_future(local.client("ex").chat.completions.create(
        model="x", messages=[{"role": "user", "content": "a"}]))
    await wait_for(lambda: engine.requests)
    with pytest.raises(anthropic.RateLimitError):
        await local.anthropic("ex2").messages.create(model="x", max_tokens=5, messages=[{"role": "user", "content": "a"}])
    with pytest.raises(openai.RateLimitError):
        await local.client("ex2").responses.create(model="x", input="a")
    busy.cancel()
    await asyncio.gather(busy, return_exceptions=True)


async def test_compressed_bodies_and_plain_endpoints(local):
    engine = await local.engine(["fine"])
    url = await local.proxy(engine=engine)
    key = {"x-api-key": execution_key(SECRET, "exz"), "Content-Type": "application/json"}
    raw = json.dumps(MESSAGES[1]).encode()
    async with aiohttp.ClientSession() as http:
        for coding, data in (("gzip", gzip.compress(raw)), ("deflate", zlib.compress(raw))):
            async with http.post(url + MESSAGES[0], data=data, headers={**key, "Content-Encoding": coding}) as r:
                assert r.status == 200 and (await r.json())["content"][0]["text"] == "fine"
        for coding, data in (("gzip", gzip.compress(raw)[:-8]), ("deflate", zlib.compress(raw)[:-4])):
            # cut short before its checksum: whole JSON inside, still a corrupt body
            async with http.post(url + MESSAGES[0], data=data, headers={**key, "Content-Encoding": coding}) as r:
                assert r.status == 400 and "ends before" in (await r.json())["error"]["message"]
        # gzip members one after another are the concatenation (RFC 1952 2.2); bytes after
        # the stream that are no member are a corrupt body, not ignored
        for data, status in ((gzip.compress(raw[:30]) + gzip.compress(raw[30:]), 200),
                             (gzip.compress(raw) + b"garbage", 400), (gzip.compress(raw) + gzip.compress(b"{}"), 400)):
            async with http.post(url + MESSAGES[0], data=data, headers={**key, "Content-Encoding": "gzip"}) as r:
                assert r.status == status, await r.text()
        async with http.post(url + MESSAGES[0], data=zlib.compress(raw) + b"\x00",
                             headers={**key, "Content-Encoding": "deflate"}) as r:
            assert r.status == 400 and "follow" in (await r.json())["error"]["message"]
        for coding, available in (("br", False), ("zstd", zstd_decompressor() is not None)):
            if available:
                continue  # decoded by the installed module; nothing to refuse
            async with http.post(url + MESSAGES[0], data=b"\x00\x01",
                                 headers={**key, "Content-Encoding": coding}) as r:
                assert r.status == 415 and (await r.json())["error"]["type"] == "invalid_request_error"
        for method in ("GET", "HEAD"):
            async with http.request(method, url + "/") as r:
                assert r.status == 200
        async with http.get(url + "/v1/models", headers=key) as r:
            assert (await r.json())["data"][0]["id"] == "gyre"


async def test_anthropic_raw_stream_framing_and_pings_while_waiting(local, tok):  # noqa: F811
    call = '<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call>'
    engine = await local.engine([call], delay_s=0.3)
    url = await local.proxy(engine=engine, keepalive_s=0.05)
    body = {**MESSAGES[1], "stream": True, "tools": [{"name": "bash", "input_schema": {"type": "object"}}]}
    async with aiohttp.ClientSession() as http:
        async with http.post(url + MESSAGES[0], json=body,
                             headers={"x-api-key": execution_key(SECRET, "exs")}) as r:
            text = (await r.read()).decode()
    frames = [f for f in text.split("\n\n") if f]
    names = [f.split("\n")[0].removeprefix("event: ") for f in frames]
    datas = [json.loads(f.split("\n")[1].removeprefix("data: ")) for f in frames]
    assert all(d["type"] == n for n, d in zip(names, datas))
    assert names[0] == "message_start" and names.count("ping") >= 2  # keep-alives while the engine works
    assert datas[0]["message"]["usage"]["input_tokens"] == len(engine.requests[0]["input_ids"])
    blocks = [n for n in names if n != "ping"]
    assert blocks == ["message_start", "content_block_start", "content_block_delta", "content_block_delta",
                      "content_block_stop", "message_delta", "message_stop"]
    assert "[DONE]" not in text and datas[-2]["delta"]["stop_reason"] == "tool_use"


@pytest.mark.parametrize("api", ["chat", "responses", "messages"])
async def test_a_stream_opens_with_its_answer_or_after_stream_open_s(local, api):  # noqa: F811
    """A streamed answer ready before STREAM_OPEN_S goes out whole, with its length (one
    write, not chunks); a slower one opens the stream first: headers (and the API's opening
    frames, where it has them) arrive while the engine still works, the answer after."""
    engine = await local.engine(["quick", "slow"])
    url = await local.proxy(engine=engine, keepalive_s=30.0)
    path, body = APIS[api]
    body = {**body, "stream": True}
    first = {"chat": "data: ", "responses": "event: response.created", "messages": "event: message_start"}[api]
    key = {"x-api-key": execution_key(SECRET, f"exo-{api}")}
    async with aiohttp.ClientSession() as http:
        async with http.post(url + path, json=body, headers=key) as r:
            quick = (await r.read()).decode()
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
        assert int(r.headers["Content-Length"]) == len(quick.encode()) and quick.startswith(first)
        engine.delay_s = STREAM_OPEN_S + 0.5
        t0 = asyncio.get_running_loop().time()
        async with http.post(url + path, json=body, headers=key) as r:
            opened_s = asyncio.get_running_loop().time() - t0
            head = (await r.content.readuntil(b"\n\n")).decode()
            head_s = asyncio.get_running_loop().time() - t0
            rest = (await r.read()).decode()
            done_s = asyncio.get_running_loop().time() - t0
    assert "Content-Length" not in r.headers and head.startswith(first) and "slow" in head + rest
    assert opened_s < engine.delay_s <= done_s, (opened_s, done_s)
    if api != "chat":  # Chat Completions has no opening frames: its first chunk carries the answer
        assert head_s < engine.delay_s, head_s


class HoldThen503:
    """An engine that holds each /generate until released, then answers 503 (SGLang's
    'unavailable'); it records aborts."""

    def __init__(self):
        self.release = asyncio.Event()
        self.requests, self.aborted = [], []
        self.runner = None
        self.url = ""

    async def generate(self, request):
        self.requests.append(await request.json())
        await self.release.wait()
        return web.json_response({"error": {"message": "draining"}}, status=503)

    async def abort(self, request):
        self.aborted.append((await request.json())["rid"])
        return web.json_response({"success": True})

    async def start(self):
        app = web.Application()
        app.router.add_post("/generate", self.generate)
        app.router.add_post("/abort_request", self.abort)
        self.runner, self.url = await serve(app)

    async def stop(self):
        self.release.set()
        await self.runner.cleanup()


async def serve(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


@contextlib.asynccontextmanager
async def generate_only(generate: Callable):
    """An engine serving only `/generate` with the handler `generate`; yields an object with
    its `url`."""
    app = web.Application()
    app.router.add_post("/generate", generate)
    runner, url = await serve(app)
    try:
        yield type("Engine", (), {"url": url})()
    finally:
        await runner.cleanup()


@contextlib.asynccontextmanager
async def aborting_engine(message: Callable[[dict], str]):
    """An engine that finishes every `/generate` with SGLang's `abort` (its message
    `message(body)`); yields (an object with its `url`, [(loop time, body) received])."""
    seen: list[tuple[float, dict]] = []

    async def generate(request):
        body = await request.json()
        seen.append((asyncio.get_running_loop().time(), body))
        return web.json_response({"text": "", "output_ids": [], "meta_info": {
            "id": "x", "finish_reason": {"type": "abort", "message": message(body)}, "prompt_tokens": 1,
            "completion_tokens": 0, "output_token_logprobs": []}})

    async with generate_only(generate) as engine:
        yield engine, seen


def switched(cell: str, to_role: str, url: str = "", seq: int = 0) -> CellSwitched:
    return CellSwitched(event_id=ids.switched("apis", cell, seq), cell=cell, seq=seq, from_role="rollout",
                        to_role=to_role, durations={}, engine_url=url)


async def test_reroute_on_503_mid_request_and_on_cell_switch(local):
    a = HoldThen503()
    await a.start()
    b = await local.engine(["from b"])
    slow = await local.engine(["from slow"], delay_s=30.0)
    await local.proxy(retry_backoff_s=30.0)  # a long backoff: moving to another cell never waits for it
    state = local.state
    try:
        await state.handle_event(switched("c0", "rollout", a.url))
        await state.handle_event(switched("c1", "rollout", b.url))
        await state.handle_event(RouteUpdated(event_id=ids.route("apis", 0), seq=0,
                                              routes=(Route(execution="ex1", cell="c0", reason="test"),)))
        # 1. c0 answers 503 in the middle of the request: the SDK sees a normal answer from c1.
        pending = asyncio.ensure_future(local.anthropic("ex1").messages.create(
            model="x", max_tokens=20, messages=[{"role": "user", "content": "hi"}]))
        await wait_for(lambda: a.requests)
        a.release.set()
        reply = await asyncio.wait_for(pending, 10)
        assert reply.content[0].text == "from b" and len(b.requests) == 1
        # 2. The serving cell leaves rollout mid-request: aborted there, answered elsewhere.
        await state.handle_event(switched("c0", "training", seq=1))
        await state.handle_event(switched("c2", "rollout", slow.url))
        await state.handle_event(RouteUpdated(event_id=ids.route("apis", 1), seq=1,
                                              routes=(Route(execution="ex2", cell="c2", reason="test"),)))
        stream = asyncio.ensure_future(local.client("ex2").responses.create(model="x", input="hi"))
        await wait_for(lambda: slow.requests)
        await state.handle_event(switched("c2", "training", seq=1))
        answer = await asyncio.wait_for(stream, 10)
        assert answer.output_text == "from b"
        await wait_for(lambda: slow.requests[0]["rid"] in slow.aborted)
        assert state.router.inflight == {}
    finally:
        await a.stop()


async def test_repeated_engine_aborts_back_off_then_fail_with_502(local):
    """An engine that ends every generation with `abort` (SGLang's shape): the only engine
    is retried after a backoff each time, never in a tight loop, and after
    MAX_ENGINE_ABORTS retries the call fails with 502 `engine_aborted`."""
    async with aborting_engine(lambda body: "aborted") as (engine, seen):
        await local.proxy(engine=engine, retry_backoff_s=0.02, retry_backoff_max_s=0.02)
        with pytest.raises(openai.APIStatusError) as err:
            await local.client("ex-aborts").chat.completions.create(
                model="m", messages=[{"role": "user", "content": "hi"}])
        assert err.value.status_code == 502 and err.value.code == "engine_aborted"
        times = [t for t, _ in seen]
        assert len(times) == MAX_ENGINE_ABORTS + 1
        assert min(b - a for a, b in zip(times, times[1:])) >= 0.015


@contextlib.asynccontextmanager
async def failing_engine(status: int, delay_s: float = 0.0):
    """An engine answering every `/generate` with HTTP `status` and an error body (as
    SGLang's server or a gateway in front of it does), after `delay_s` (a gateway's queue
    timeout); yields (an object with its `url`, [loop time of each request])."""
    seen: list[float] = []

    async def generate(request):
        await request.read()
        seen.append(asyncio.get_running_loop().time())
        await asyncio.sleep(delay_s)
        return web.json_response({"error": {"message": f"boom {status}"}}, status=status)

    async with generate_only(generate) as engine:
        yield engine, seen


async def test_an_engine_server_error_or_overload_is_retried_on_another_cell(local):
    """A 500 or 502 from the cell an execution is routed to (a crashed scheduler, a gateway
    in front of a dead worker), or a 429 / 408 (SGLang's gateway: its queue is full, a
    request waited in it too long) is retried on the other rollout cell at once: the
    harness gets that cell's answer, not an error."""
    good = await local.engine(["from the healthy cell"])
    await local.proxy(retry_backoff_s=30.0)  # a long backoff: moving to another cell never waits for it
    state = local.state
    for n, status in enumerate((500, 502, 429, 408)):
        async with failing_engine(status) as (bad, seen):
            await state.handle_event(switched(f"bad{n}", "rollout", bad.url))
            await state.handle_event(switched(f"good{n}", "rollout", good.url))
            await state.handle_event(RouteUpdated(event_id=ids.route("apis", n), seq=n, routes=(
                Route(execution=f"ex-5xx-{n}", cell=f"bad{n}", reason="test"),)))
            reply = await asyncio.wait_for(local.client(f"ex-5xx-{n}").chat.completions.create(
                model="m", messages=[{"role": "user", "content": "hi"}]), 10)
            assert reply.choices[0].message.content == "from the healthy cell"
            assert len(seen) == 1 and len(good.requests) == n + 1
            await state.handle_event(switched(f"bad{n}", "training", seq=1))
            await state.handle_event(switched(f"good{n}", "training", seq=1))


async def test_repeated_engine_server_errors_fail_with_502(local):
    """The only engine answering 500 every time is retried MAX_ENGINE_ERRORS times, after a
    backoff each, then the call fails with 502 `engine_error` carrying the engine's message."""
    async with failing_engine(500) as (engine, seen):
        await local.proxy(engine=engine, retry_backoff_s=0.02, retry_backoff_max_s=0.02)
        with pytest.raises(openai.APIStatusError) as err:
            await local.client("ex-500").chat.completions.create(
                model="m", messages=[{"role": "user", "content": "hi"}])
        assert err.value.status_code == 502 and err.value.code == "engine_error"
        assert "boom 500" in err.value.message
        assert len(seen) == MAX_ENGINE_ERRORS + 1
        assert min(b - a for a, b in zip(seen, seen[1:])) >= 0.015


async def test_time_in_a_gateways_queue_counts_against_the_retry_window(local):
    """A gateway answering 408 after its queue timeout: that time was spent waiting for an
    engine, which `retry_timeout_s` bounds (only an attempt that may have generated adds
    its time back), so the call fails with 503 once the window is out, not hours later."""
    async with failing_engine(408, delay_s=0.3) as (engine, seen):
        await local.proxy(engine=engine, retry_timeout_s=1.0, retry_backoff_s=0.05, retry_backoff_max_s=0.05)
        t0 = asyncio.get_running_loop().time()
        with pytest.raises(openai.APIStatusError) as err:
            await local.client("ex-408").chat.completions.create(
                model="m", messages=[{"role": "user", "content": "hi"}])
        took = asyncio.get_running_loop().time() - t0
        assert err.value.status_code == 503 and err.value.code == "engine_unavailable"
        assert took < 2.5 and len(seen) <= 5, (took, len(seen))


async def test_time_spent_connecting_counts_against_the_retry_window():
    """A connect that times out never reached an engine: that time was waiting for one,
    which `retry_timeout_s` bounds. (Adding it back, as for a request that may have
    generated, made a dead engine that drops connection attempts hold a call for 5× the
    window: 600 s became ~30 minutes of keep-alives.)"""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    filler = socket.create_connection(listener.getsockname())  # accept queue full: later SYNs are dropped
    session = make_session(connect_s=0.4)
    try:
        dispatcher = Dispatcher(Router("http://127.0.0.1:%d" % listener.getsockname()[1]), session, concurrency=4,
                                retry_timeout_s=1.0, retry_backoff_s=0.05, retry_backoff_max_s=0.05,
                                spawn=asyncio.ensure_future)
        t0 = time.monotonic()
        with pytest.raises(ApiError) as err:
            await dispatcher.generate("ex", [1, 2], SamplingParams(max_tokens=4), "ex:0", Attempt())
        took = time.monotonic() - t0
    finally:
        await session.close()
        filler.close()
        listener.close()
    assert err.value.status == 503 and err.value.code == "engine_unavailable"
    assert took < 1.8, took


async def test_a_backoff_ends_when_another_cell_enters_rollout(local):
    """A call backing off from its only cell (here failing with 500) is sent to a cell that
    enters rollout during the wait at once, not after the backoff."""
    good = await local.engine(["from the new cell"])
    await local.proxy(retry_backoff_s=30.0, retry_timeout_s=60.0)
    state = local.state
    async with failing_engine(500) as (bad, seen):
        await state.handle_event(switched("c0", "rollout", bad.url))
        pending = asyncio.ensure_future(local.client("ex-new").chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}]))
        await wait_for(lambda: seen)
        await asyncio.sleep(0.2)  # well into the 30-s backoff
        t0 = time.monotonic()
        await state.handle_event(switched("c1", "rollout", good.url))
        answer = await asyncio.wait_for(pending, 5)
    assert answer.choices[0].message.content == "from the new cell" and len(seen) == 1
    assert time.monotonic() - t0 < 2.0


def test_ids_beyond_the_vocabulary_are_a_bad_reply():
    """An id the policy's embedding table has no row for is no sample of the policy, and
    sent back in the next prompt the engine would refuse it: a 502, not an `ok` call."""
    def reply(out: list[int]) -> dict:
        return {"output_ids": out, "meta_info": {"finish_reason": {"type": "stop"},
                                                  "output_token_logprobs": [[-0.5, i, None] for i in out]}}
    assert engine_reply(reply([VOCAB_SIZE - 1, IM_END]), VOCAB_SIZE).output_ids == [VOCAB_SIZE - 1, IM_END]
    for out in ([VOCAB_SIZE, IM_END], [1_000_000_000, IM_END]):
        with pytest.raises(ApiError) as err:
            engine_reply(reply(out), VOCAB_SIZE)
        assert err.value.status == 502 and err.value.code == "engine_bad_reply" and "151936" in err.value.message


async def test_the_proxy_bounds_ids_by_the_policys_vocabulary(local, tmp_path):
    engine = await local.engine(["x"])
    await local.proxy(engine=engine)
    assert local.state.engines.vocab_size == VOCAB_SIZE  # the built-in tokenizer: Qwen3's padded table
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"vocab_size": 1000}}))
    assert vocab_size(str(tmp_path)) == 1000
    (tmp_path / "config.json").write_text("{}")
    assert vocab_size(str(tmp_path)) == 2**31


async def test_an_engine_client_error_is_not_retried(local):
    """A 4xx from the engine refuses the request itself: a 400 at once, never retried."""
    async with failing_engine(422) as (engine, seen):
        await local.proxy(engine=engine)
        with pytest.raises(openai.BadRequestError) as err:
            await local.client("ex-422").chat.completions.create(
                model="m", messages=[{"role": "user", "content": "hi"}])
        assert err.value.code == "engine_error" and len(seen) == 1


async def test_a_scheduler_abort_for_a_long_prompt_is_a_prompt_too_long_error(local):  # noqa: F811
    """SGLang versions whose scheduler finishes an over-long prompt with `abort` (its message
    saying so): not retried as a cell leaving rollout (502 after 17 tries), but answered as
    the prompt-too-long error, the context learnt (max_req_input_len + 6)."""
    def message(body: dict) -> str:
        return (f"Input length ({len(body['input_ids'])} tokens) exceeds the maximum allowed length (14 tokens). "
                "Use a shorter input or enable --allow-auto-truncate.")

    async with aborting_engine(message) as (engine, seen):
        await local.proxy(engine=engine)
        with pytest.raises(openai.BadRequestError) as err:
            await local.client("ex-long").chat.completions.create(
                model="m", messages=[{"role": "user", "content": "word " * 40}])
        assert err.value.code == "context_length_exceeded" and len(seen) == 1
        assert "maximum context length is 20 tokens" in err.value.message
        assert local.state.context_tokens == 20


async def test_race_tells_an_eviction_from_a_cancelled_call():
    """`race` awaits the engine request in the call's own task: the router's eviction
    cancels the request and the call goes on (None, nothing left cancelling); a harness
    that goes away cancels the call, also when an eviction comes at the same moment."""
    router = Router()
    started = asyncio.Event()
    finished: list[str] = []

    async def request() -> str:
        started.set()
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            finished.append("cancelled")
            raise
        return "answer"

    async def call(attempt: Attempt, after: str = "next") -> tuple:
        result = await race(request(), attempt)
        await asyncio.sleep(0)  # a cancellation left pending would surface here
        return result, after, asyncio.current_task().cancelling()

    async def evicted_while_running(also_cancel: bool):
        started.clear()
        attempt = Attempt(cell="c0")
        router.track(attempt)
        task = asyncio.ensure_future(call(attempt))
        await started.wait()
        router.handle_cell_switched(switched("c0", "training"))
        if also_cancel:
            task.cancel()
        return await asyncio.wait_for(task, 5)

    router.handle_cell_switched(switched("c0", "rollout", "http://127.0.0.1:1"))
    assert await evicted_while_running(False) == (None, "next", 0) and finished == ["cancelled"]
    router.handle_cell_switched(switched("c0", "rollout", "http://127.0.0.1:1"))
    with pytest.raises(asyncio.CancelledError):
        await evicted_while_running(True)
    # a request that absorbs the router's cancellation (returns) or turns it into its own
    # error: the result or that error, and no cancellation left pending on the call's task
    for outcome in ("absorb", "convert"):
        async def stubborn(outcome: str = outcome) -> str:
            started.set()
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                if outcome == "convert":
                    raise ConnectionError("closed") from None
            return "late answer"

        async def call_stubborn() -> tuple:
            attempt = Attempt(cell="c0")
            router.track(attempt)
            try:
                result = await race(stubborn(), attempt)
            except ConnectionError as exc:
                result = repr(exc)
            await asyncio.sleep(0)
            return result, asyncio.current_task().cancelling()

        started.clear()
        router.handle_cell_switched(switched("c0", "rollout", "http://127.0.0.1:1"))
        task = asyncio.ensure_future(call_stubborn())
        await started.wait()
        router.handle_cell_switched(switched("c0", "training"))
        assert await asyncio.wait_for(task, 5) == (
            "late answer" if outcome == "absorb" else "ConnectionError('closed')", 0)
    # an attempt evicted before its request started: the request never runs
    coro = request()
    assert await race(coro, Attempt(evicted=True)) is None and coro.cr_frame is None
    # not evicted: the request's own result
    started.clear()
    assert await race(asyncio.sleep(0, "direct"), Attempt()) == "direct"


async def test_keys_write_only_into_their_own_execution(local):
    engine = await local.engine(["one", "two"])
    await local.proxy(engine=engine)
    await local.anthropic("exa").messages.create(
        model="x", max_tokens=5, messages=[{"role": "user", "content": "a"}],
        metadata={"user_id": json.dumps({"session_id": "exb"})})
    await local.client("exb").chat.completions.create(model="x", messages=[{"role": "user", "content": "b"}],
                                                      extra_body={"execution": "exa"})
    assert [r.call for r in local.store("exa").calls] == ["exa:0"]
    assert [r.call for r in local.store("exb").calls] == ["exb:0"]
    assert [r["gyre_execution"] for r in engine.requests] == ["exa", "exb"]


CC_HEADERS = {"x-claude-code-session-id": "sess-9", "anthropic-version": "2023-06-01",
              "anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14"}


async def test_roles_and_metadata_on_call_completed(tok, bus, run_id):  # noqa: F811
    stack = Stack(tok, bus, run_id)
    try:
        engine = await stack.engine(["main answer", "sub answer", '{"title": "x"}', "side answer", "summary",
                                     "codex summary"])
        await stack.proxy(engine=engine)
        cc = stack.anthropic("ex1", default_headers=CC_HEADERS)
        tools = [{"name": "bash", "input_schema": {"type": "object"}}]
        user = {"role": "user", "content": "fix the bug"}
        await cc.messages.create(model="claude-sonnet-x", max_tokens=50, system="main prompt", messages=[user],
                                 tools=tools)
        sub = await cc.messages.create(model="claude-sonnet-x", max_tokens=50, system="sub prompt", messages=[user],
                                       tools=tools, extra_headers={"x-claude-code-agent-id": "agent-7"})
        await cc.messages.create(model="claude-sonnet-x", max_tokens=50, system="title prompt", messages=[user],
                                 tools=[], extra_body={"output_config": {"format": {"type": "json_schema",
                                                                                    "schema": {}}}})
        await cc.messages.create(model="claude-haiku-4-5", max_tokens=50, messages=[user])
        count = await cc.messages.with_raw_response.count_tokens(model="claude-sonnet-x", messages=[user],
                                                                 tools=tools)
        await cc.messages.create(model="claude-sonnet-x", max_tokens=50, system="main prompt", tools=tools, messages=[
            user, {"role": "assistant", "content": "main answer"},
            {"role": "user", "content": "Your task is to create a detailed summary of the conversation so far."}])
        codex = stack.client("ex2", default_headers={
            "session-id": "thread-1", "x-codex-turn-metadata": json.dumps({"request_kind": "compaction",
                                                                          "turn_id": "t-3"})})
        answered = await codex.responses.create(model="gpt-x", input="You are performing a CONTEXT CHECKPOINT COMPACTION.",
                                     tools=[])
        events = await stack.calls(7)
    finally:
        await stack.close()
    by_call = {e.call: e for e in events}
    assert [by_call[f"ex1:{i}"].role for i in range(6)] == [
        "main", "sub-agent", "auxiliary", "auxiliary", "auxiliary", "main-summary"]
    # each call's request id (as the hosted APIs send one, what harnesses print) is on its record
    assert sub._request_id.startswith("req_") and answered._request_id.startswith("req_")
    assert by_call["ex1:1"].meta == {"harness": "claude-code", "session_id": "sess-9", "agent_id": "agent-7",
                                     "request_id": sub._request_id}
    assert by_call["ex1:4"].meta["request_id"] == count.headers["request-id"] == count.headers["x-request-id"]
    assert by_call["ex2:0"].meta.pop("request_id") == answered._request_id
    assert len({e.meta["request_id"] for e in events if "request_id" in e.meta}) == 6
    assert by_call["ex1:2"].meta["request_kind"] == "title" and by_call["ex1:2"].parent_call is None
    counted = by_call["ex1:4"]
    assert counted.meta["request_kind"] == "count_tokens" and counted.tokens.completion_ids == ()
    assert (counted.status, counted.finish_reason, counted.api) == ("ok", "stop", "messages")
    assert by_call["ex1:5"].meta["request_kind"] == "compaction" and by_call["ex1:5"].parent_call == "ex1:0"
    assert {e.api for e in events} == {"messages", "responses"}
    cx = by_call["ex2:0"]
    assert cx.role == "main-summary" and cx.meta == {"harness": "codex", "session_id": "thread-1",
                                                     "request_kind": "compaction", "turn_id": "t-3"}


async def test_broken_anthropic_stream_then_non_streaming_retry(tok, bus, run_id):  # noqa: F811
    """Claude Code retries without streaming after a dropped stream: the dropped call is
    recorded `aborted` (aborted upstream too), the retry as an ordinary root call."""
    stack = Stack(tok, bus, run_id)
    try:
        engine = await stack.engine(["answer"], delay_s=30.0)
        url = await stack.proxy(engine=engine)
        headers = {"x-api-key": execution_key(SECRET, "exb"), **CC_HEADERS}
        async with aiohttp.ClientSession() as http:
            r = await http.post(url + MESSAGES[0], json={**MESSAGES[1], "stream": True}, headers=headers)
            first = await r.content.readuntil(b"\n\n")
            assert first.startswith(b"event: message_start")
            await wait_for(lambda: engine.requests)
            r.close()  # the connection drops mid-stream
            await wait_for(lambda: engine.requests[0]["rid"] in engine.aborted)
            engine.delay_s = 0.0
            async with http.post(url + MESSAGES[0], json=MESSAGES[1], headers=headers) as again:
                assert (await again.json())["content"][0]["text"] == "answer"
        dropped, retried = await stack.calls(2)
    finally:
        await stack.close()
    assert (dropped.status, dropped.finish_reason, dropped.role) == ("aborted", "abort", "main")
    assert (retried.status, retried.parent_call, retried.meta["session_id"]) == ("ok", None, "sess-9")
    assert retried.tokens.prompt_ids == dropped.tokens.prompt_ids


async def test_profile_configured_per_execution_from_execution_started(local):
    engine = await local.engine(["ok"])
    await local.proxy(engine=engine)
    info = ExecutionInfo(execution="exm", task="t", group="s0-g0", step=0, harness="mini-swe-agent",
                         group_size=1, step_groups=1)
    await local.state.handle_event(ExecutionStarted(event_id=ids.started("apis", "exm"), info=info, workspace=""))
    ex = local.state.execution("exm")
    assert ex.harness == "mini-swe-agent"
    # Claude-looking headers and a compaction-looking message do not override the profile.
    req = parse_messages_request({"messages": [{"role": "user", "content": "Your task is to create a detailed "
                                                                          "summary of the conversation so far"}]},
                                 local.state.defaults)
    roles = local.state.classify(ex, CC_HEADERS, req, "messages")
    assert (roles.role, roles.harness) == ("main", "mini-swe-agent")


def test_responses_function_call_arguments_given_as_an_object_keep_their_values():
    """`arguments` is JSON text on the wire; a client that sends the object itself means the
    same call (it used to be rendered as `{}`)."""
    from handlers.proxy.responses import responses_messages

    items = [{"type": "message", "role": "user", "content": "List files."},
             {"type": "function_call", "call_id": "c1", "name": "bash", "arguments": {"cmd": "ls", "n": 2}},
             {"type": "function_call_output", "call_id": "c1", "output": "a.txt"}]
    (call,) = responses_messages({"input": items})[1]["tool_calls"]
    assert json.loads(call["function"]["arguments"]) == {"cmd": "ls", "n": 2}


def test_router_spreads_new_executions_by_sticky_load_and_forgets_finished_ones():
    """The least-loaded cell is chosen from counts kept with `sticky` (not recounted per
    pick); moves, routes and finished executions keep them exact."""
    import random

    router = Router()
    for n in range(4):
        router.handle_cell_switched(CellSwitched(event_id=f"s{n}", cell=f"c{n}", seq=0, from_role="idle",
                                                 to_role="rollout", durations={}, engine_url=f"http://e{n}"))
    rng = random.Random(0)
    for n in range(400):
        router.pick(f"x{n}", avoid=frozenset({f"c{rng.randrange(4)}"}) if n % 3 == 0 else frozenset())
        if n % 5 == 0:
            router.forget(f"x{rng.randrange(n + 1)}")
        if n % 7 == 0:
            router.handle_route_updated(RouteUpdated(event_id=f"r{n}", seq=n, routes=(
                Route(execution=f"x{rng.randrange(n + 1)}", cell=f"c{rng.randrange(4)}"),)))
    brute = {c: sum(1 for v in router.sticky.values() if v == c) for c in router.cells}
    assert {c: router.load(c) for c in router.cells} == brute
    assert max(brute.values()) - min(brute.values()) <= 40  # spread, not piled on one cell
    router.forget("x1")
    assert "x1" not in router.sticky and "x1" not in router.routes


def test_unique_ids():
    ids = [unique_hex() for _ in range(10_000)]
    assert len(set(ids)) == len(ids) and all(len(i) == 24 and int(i, 16) >= 0 for i in ids)


def test_engine_refusals_of_a_long_prompt_are_recognised():
    """gyre's engine and SGLang (both of its wordings) say a prompt does not fit; other
    refusals and server errors are not read as that."""
    from handlers.engines.client import EngineRequestError
    from handlers.proxy.routing import prompt_too_long

    def refusal(body, status=400):
        return prompt_too_long(EngineRequestError("refused", status, body))

    ours = {"error": {"message": "prompt has 409 tokens, max_context_tokens is 200", "type": "PromptTooLong"}}
    assert refusal(ours) == (200, "prompt has 409 tokens, max_context_tokens is 200")
    sglang = "The input (309 tokens) is longer than the model's context length (120 tokens)."
    assert refusal({"error": {"message": sglang}}) == (120, sglang)
    total = ("Requested token count exceeds the model's maximum context length of 32768 tokens. You requested a "
             "total of 33000 tokens: 900 tokens from the input messages and 32100 tokens for the completion.")
    assert refusal({"object": "error", "message": total, "type": "BadRequestError", "code": 400})[0] == 32768
    assert refusal("The input is longer than the model's context length") == (None, "The input is longer than "
                                                                                     "the model's context length")
    scheduler = ("Input length (29994 tokens) exceeds the maximum allowed length (29994 tokens). Use a shorter "
                 "input or enable --allow-auto-truncate.")
    assert refusal({"error": {"message": scheduler}}) == (30000, scheduler)
    assert refusal({"error": {"message": "input_ids must be a non-empty list"}}) is None
    # a 4xx that merely names a number is not a context refusal
    assert refusal({"error": {"message": "lora adapter: context length of 5 unsupported"}}) is None
    assert refusal({"error": {"message": sglang}}, status=500) is None


def test_decode_body_members_and_limits():
    raw = b'{"a": "' + b"x" * 5000 + b'"}'
    two = gzip.compress(raw[:100]) + gzip.compress(raw[100:])
    assert decode_body(two, "gzip", len(raw)) == raw
    with pytest.raises(ApiError) as err:  # the limit counts every member
        decode_body(two, "gzip", len(raw) - 1)
    assert err.value.status == 413
    with pytest.raises(ApiError) as err:
        decode_body(gzip.compress(raw) + b"\x1f\x8b", "gzip", 10**6)  # a second member cut short
    assert err.value.status == 400
    assert decode_body(zlib.compress(raw), "gzip, identity", 10**6) == raw  # zlib framing under gzip, as before
    # NUL padding after a member is skipped, as gzip.decompress skips it; other bytes are not
    assert decode_body(gzip.compress(raw) + b"\x00" * 8, "gzip", 10**6) == raw
    with pytest.raises(ApiError, match="member 2"):
        decode_body(gzip.compress(raw) + b"\x00garbage", "gzip", 10**6)
    # members bigger than one feed (`_FEED`), split anywhere: the concatenation
    noise = os.urandom(3 << 20)
    body = gzip.compress(noise[:5]) + gzip.compress(noise[5:], compresslevel=0) + gzip.compress(b"")
    assert decode_body(body, "gzip", len(noise)) == noise
    # a body of many (empty) members is refused after MEMBERS of them, whatever its length
    empty = gzip.compress(b"")
    assert decode_body(empty * (MEMBERS - 1) + gzip.compress(raw), "gzip", 10**6) == raw
    with pytest.raises(ApiError, match=f"more than {MEMBERS}"):
        decode_body(empty * 200_000 + gzip.compress(raw), "gzip", 64 << 20)


async def test_a_call_lost_after_generating_longer_than_the_retry_window_is_retried(local):
    # retry_timeout_s counts waiting for an engine, not generating: a switch after a long
    # generation still moves the call to the healthy cell (a reviewer's find: 503 before)
    slow = await local.engine(["from slow"], delay_s=30.0)
    fast = await local.engine(["from fast"])
    await local.proxy(retry_timeout_s=1.0, keepalive_s=30.0)
    st = local.state
    await st.handle_event(switched("c0", "rollout", slow.url))
    await st.handle_event(RouteUpdated(event_id=ids.route(local.run_id, 0), seq=0,
                                       routes=(Route(execution="exw", cell="c0", reason="t"),)))
    call = asyncio.ensure_future(local.client("exw").chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hi"}]))
    await wait_for(lambda: slow.requests)
    await asyncio.sleep(1.5)  # longer than retry_timeout_s
    await st.handle_event(switched("c1", "rollout", fast.url))
    await st.handle_event(switched("c0", "training", seq=1))
    answer = await asyncio.wait_for(call, 10)
    assert answer.choices[0].message.content == "from fast" and len(fast.requests) == 1


async def test_two_keys_that_disagree_are_refused(local):
    engine = await local.engine(["ok"])
    url = await local.proxy(engine=engine)
    body = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}
    async with aiohttp.ClientSession() as http:
        async with http.post(url + "/v1/messages", json=body, headers={
                "x-api-key": execution_key(SECRET, "mine"),
                "Authorization": "Bearer " + execution_key(SECRET, "other")}) as r:
            err = await r.json()  # says why: it read "no API key" when both headers carried one
            assert r.status == 401 and err["type"] == "error" and "different keys" in err["error"]["message"], err
        same = execution_key(SECRET, "mine")
        async with http.post(url + "/v1/messages", json=body,
                             headers={"x-api-key": same, "Authorization": "Bearer " + same}) as r:
            assert r.status == 200
    assert not engine.requests[1:]


@pytest.mark.parametrize("path,body,says", [
    ("/v1/chat/completions", {"tools": [{"type": "function"}]}, "without a 'function' object"),
    ("/v1/chat/completions", {"tools": ["bash"]}, "tools[0] must be an object"),
    ("/v1/chat/completions", {"tools": [{"type": "custom", "name": "x"}]}, "without a 'custom' object"),
    ("/v1/responses", {"input": "hi", "tools": [{"type": "function", "parameters": {}}]}, "without a string 'name'"),
    ("/v1/responses", {"input": "hi", "tools": [{"type": "namespace", "name": "ns", "tools": [
        {"type": "function", "description": "d"}]}]}, "tools[0].tools[0] is a function without"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": [], "text": "hi"}]}]},
     "content[0].type must be a string"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "go"}, {"role": "assistant", "tool_calls": [
        {"id": [1], "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]},
     "a tool call's id must be a string"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "go"}, {"role": "assistant", "tool_calls": [
        {"id": 0, "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]},
     "a tool call's id must be a string"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "go"}, {"role": "tool", "tool_call_id": 5,
                                                                             "content": "out"}]},
     "'tool_call_id' must be a string"),
    ("/v1/messages", {"tools": [{"name": "f"}]}, "needs a string 'name' and an 'input_schema' object"),
    ("/v1/messages", {"tools": [{"type": "custom", "input_schema": {"type": "object"}}]}, "needs a string 'name'"),
    ("/v1/messages", {"messages": [{"role": "user", "content": [{"type": {}, "text": "hi"}]}]},
     "'type' is not a string"),
    ("/v1/messages", {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": [
        {"type": 1, "text": "a"}]}, {"role": "user", "content": "go"}]}, "type must be a string"),
])
async def test_malformed_tools_and_parts_are_a_400_naming_them(local, path, body, says):
    """A function tool with no function, a custom Anthropic tool with no name or schema, a
    part whose type is not a string: each a 400 that names it, in the API's shape. They were
    answered (the malformed tool rendered raw, or dropped: the policy saw another tool set
    than the harness meant) or failed with a TypeError's repr."""
    engine = await local.engine(["ok"])
    url = await local.proxy(engine=engine)
    base = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}
    async with aiohttp.ClientSession() as http:
        async with http.post(url + path, json={**base, **body},
                             headers={"Authorization": "Bearer " + execution_key(SECRET, "ex-bad")}) as r:
            err = await r.json()
            assert r.status == 400, err
            assert error_type("messages" if path == "/v1/messages" else "chat", err) == "invalid_request_error"
            assert says in err["error"]["message"] and "TypeError" not in err["error"]["message"], err
    # A custom tool whose type is null (the SDK's models dump an unset type so) is rendered
    # like one without a type; Anthropic-defined tools are accepted and not rendered.
    counts = []
    async with aiohttp.ClientSession() as http:
        for tool in ({"name": "bash", "input_schema": {"type": "object"}},
                     {"name": "bash", "input_schema": {"type": "object"}, "type": None}, None):
            async with http.post(url + "/v1/messages/count_tokens",
                                 json={**base, **({"tools": [tool]} if tool else {})},
                                 headers={"x-api-key": execution_key(SECRET, "ex-count")}) as r:
                counts.append((await r.json())["input_tokens"])
    assert counts[0] == counts[1] > counts[2], counts
    async with aiohttp.ClientSession() as http:
        async with http.post(url + "/v1/messages", json={**base, "tools": [{"type": "web_search_20250305",
                                                                             "name": "web_search"}]},
                             headers={"x-api-key": execution_key(SECRET, "ex-ok")}) as r:
            assert r.status == 200, await r.text()
    assert len(engine.requests) == 1


@pytest.mark.parametrize("path,field", [("/v1/chat/completions", "messages"), ("/v1/messages", "messages"),
                                        ("/v1/responses", "input")])
async def test_more_messages_than_the_hosted_limit_are_a_400(local, path, field):
    """Beyond `MAX_MESSAGES` (the Messages API's own 100,000) a request is refused before
    any per-message work: 300k tiny messages in a 64-MiB body held the event loop, and so
    every other execution's calls, for seconds."""
    from handlers.proxy.api import MAX_MESSAGES

    engine = await local.engine(["ok"])
    url = await local.proxy(engine=engine)
    many = [{"role": "user" if i % 2 == 0 else "assistant", "content": "x"} for i in range(MAX_MESSAGES + 1)]
    body = {"model": "m", "max_tokens": 5, field: many}
    async with aiohttp.ClientSession() as http:
        async with http.post(url + path, json=body,
                             headers={"Authorization": "Bearer " + execution_key(SECRET, "ex-many")}) as r:
            err = await r.json()
            assert r.status == 400 and "at most 100,000" in err["error"]["message"], err
    assert not engine.requests


# --------------------------------------------------------------------------- valid requests, unusual shapes


def _prompt(tok, engine, i: int = -1) -> str:  # noqa: F811
    return tok.decode(engine.requests[i]["input_ids"], skip_special_tokens=False)


async def test_text_documents_and_search_results_reach_the_policy(local, tok):  # noqa: F811
    """A `document` with a text or content source and a `search_result` block carry text
    the model must read (in a user turn and inside a tool result); a PDF stays a placeholder."""
    engine = await local.engine(["ok"])
    await local.proxy(engine=engine)
    doc = {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "The code is 4711."},
           "title": "Q3 report", "context": "Written by the CFO."}
    blocks = {"type": "document", "source": {"type": "content", "content": [{"type": "text", "text": "Page two."}]}}
    pdf = {"type": "document", "source": {"type": "base64", "media_type": "application/pdf", "data": "JVBERi0="}}
    found = {"type": "search_result", "source": "https://x", "title": "T",
             "content": [{"type": "text", "text": "Search says 42."}]}
    client = local.anthropic("ex-docs")
    await client.messages.create(model="x", max_tokens=5, messages=[
        {"role": "user", "content": [doc, blocks, pdf, {"type": "text", "text": "What is the code?"}]},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "search", "input": {"q": "x"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [found]}]}])
    prompt = _prompt(tok, engine)
    assert ("Q3 report\nWritten by the CFO.\n\nThe code is 4711.\n\nPage two.\n\n[document]\n\n"
            "What is the code?") in prompt
    assert "<tool_response>\nT\nhttps://x\n\nSearch says 42.\n</tool_response>" in prompt


async def test_chat_custom_tool_calls_and_calls_without_arguments_render_as_calls(local, tok):  # noqa: F811
    """An assistant's `custom` tool call (OpenAI's shape for custom tools) is rendered as
    a call with its input, as Responses renders `custom_tool_call`; a function call whose
    arguments are "" is a call without arguments (`{}`), not broken markup. The deprecated
    `functions` are refused rather than dropped unseen."""
    engine = await local.engine(["ok", "ok"])
    await local.proxy(engine=engine)
    client = local.client("ex-custom")
    await client.chat.completions.create(model="m", messages=[
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "custom", "custom": {"name": "apply_patch", "input": "*** Begin"}},
            {"id": "c2", "type": "function", "function": {"name": "now", "arguments": ""}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "r1"},
        {"role": "tool", "tool_call_id": "c2", "content": "r2"}])
    prompt = _prompt(tok, engine)
    assert '<tool_call>\n{"name": "apply_patch", "arguments": {"input": "*** Begin"}}\n</tool_call>' in prompt
    assert '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>' in prompt
    with pytest.raises(openai.BadRequestError) as err:
        await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}],
                                             functions=[{"name": "f", "parameters": {"type": "object"}}])
    assert err.value.body["param"] == "functions" and "tools" in err.value.message
    for nameless in ({"id": "c3", "type": "custom", "custom": {"input": "a"}}, {"id": "c3", "custom": {"name": "f"}}):
        with pytest.raises(openai.BadRequestError, match="name"):  # a call that names no function
            await client.chat.completions.create(model="m", messages=[
                {"role": "user", "content": "x"}, {"role": "assistant", "content": None, "tool_calls": [nameless]},
                {"role": "tool", "tool_call_id": "c3", "content": "r"}])
    assert len(engine.requests) == 1
    await client.chat.completions.create(model="m", messages=[
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c4", "type": "custom",
                                                               "custom": {"name": "count", "input": 0}}]},
        {"role": "tool", "tool_call_id": "c4", "content": "r"}])
    assert '{"name": "count", "arguments": {"input": 0}}' in _prompt(tok, engine)


CUT_CALL = 'Running it.\n<tool_call>\n{"name": "bash", "arguments": {"command": "ls -la /tmp && echo done"}}\n</tool_call>'


async def test_a_tool_call_cut_by_the_cap_or_a_stop_string_is_not_shown_as_text(local, tok):  # noqa: F811
    """A completion cut by `max_tokens` or a stop string inside a tool call answers the text
    before the call (SGLang's tool parser drops the unfinished call), in every API; the ids
    keep the cut call, and the harness's next request, resending the answer as it got it,
    extends it."""
    engine = await local.engine([CUT_CALL] * 4)
    await local.proxy(engine=engine)
    tools = [{"name": "bash", "input_schema": {"type": "object"}}]
    client = local.anthropic("ex-cut")
    first = [{"role": "user", "content": "go"}]
    got = await client.messages.create(model="x", max_tokens=12, tools=tools, messages=first)
    assert got.stop_reason == "max_tokens" and [b.type for b in got.content] == ["text"]
    assert got.content[0].text == "Running it."
    store = local.store("ex-cut")
    cut = store.calls[-1]
    assert "<tool_call>" in tok.decode(cut.own_ids[-cut.completion_len:].tolist())
    resent = first + [{"role": "assistant", "content": "Running it."}, {"role": "user", "content": "go on"}]
    await client.messages.create(model="x", max_tokens=12, tools=tools, messages=resent)
    assert store.calls[-1].parent is cut and store.calls[-1].prefix_len == cut.prefix_len + len(cut.own_ids)
    chat = await local.client("ex-cut-chat").chat.completions.create(
        model="m", max_tokens=12, messages=first, tools=[{"type": "function", "function": {"name": "bash"}}])
    assert chat.choices[0].finish_reason == "length" and chat.choices[0].message.content == "Running it."
    assert not chat.choices[0].message.tool_calls
    whole = await local.client("ex-whole").chat.completions.create(model="m", max_tokens=200, messages=first)
    assert whole.choices[0].message.tool_calls[0].function.name == "bash"
    # Without tools offered the text is the answer
    plain = await local.client("ex-plain").chat.completions.create(model="m", max_tokens=12, messages=first)
    assert plain.choices[0].message.content.startswith("Running it.\n<tool_call>\n")
    # A stop string of the harness's inside the call cuts it like the cap, in every API
    for stop in (["ls -la"], ["</tool_call>"]):
        stopped = await local.client("ex-stop").chat.completions.create(
            model="m", messages=first, stop=stop, tools=[{"type": "function", "function": {"name": "bash"}}])
        assert (stopped.choices[0].finish_reason, stopped.choices[0].message.content) == ("stop", "Running it.")
        assert not stopped.choices[0].message.tool_calls
    seq = await client.messages.create(model="x", max_tokens=100, tools=tools, messages=first, stop_sequences=["ls"])
    assert (seq.stop_reason, seq.stop_sequence, [b.text for b in seq.content]) == ("stop_sequence", "ls", ["Running it."])
    store = local.store("ex-cut")
    stopped_call = store.calls[-1]
    resent = first + [{"role": "assistant", "content": "Running it."}, {"role": "user", "content": "go on"}]
    await client.messages.create(model="x", max_tokens=12, tools=tools, messages=resent)
    assert store.calls[-1].parent is stopped_call
    assert store.calls[-1].prefix_len == stopped_call.prefix_len + len(stopped_call.own_ids)



async def test_a_token_count_is_the_input_tokens_of_the_same_request(local):
    """count_tokens (and Responses' input_tokens) attach the request as its call would: when
    it extends a call whose tool-call JSON the model wrote compactly, the count reuses the
    sampled ids, as the call's `usage` does, instead of re-rendering them canonically."""
    compact = 'Ok.\n<tool_call>\n{"name":"bash","arguments":{"c":"ls"}}\n</tool_call>'
    engine = await local.engine([compact, "done", compact, "done"])
    await local.proxy(engine=engine)
    tools = [{"name": "bash", "input_schema": {"type": "object"}}]
    client = local.anthropic("ex-ct-usage")
    first = [{"role": "user", "content": "go"}]
    got = await client.messages.create(model="x", max_tokens=200, messages=first, tools=tools)
    blocks = [b.model_dump(exclude_none=True, include={"type", "text", "id", "name", "input"}) for b in got.content]
    then = first + [{"role": "assistant", "content": blocks},
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": got.content[-1].id,
                                                  "content": "a"}]}]
    store, ex = local.store("ex-ct-usage"), local.state.executions["ex-ct-usage"]
    memos = (list(store._seen), list(ex.memo._seen), list(ex.bodies._bodies))
    counted = await client.messages.count_tokens(model="x", messages=then, tools=tools)
    # a count leaves the execution's memos of latest requests (TITO's, conversions, bodies) alone
    assert (store._seen, ex.memo._seen, ex.bodies._bodies) == memos
    used = await client.messages.create(model="x", max_tokens=50, messages=then, tools=tools)
    assert counted.input_tokens == used.usage.input_tokens == len(engine.requests[-1]["input_ids"])

    oai = local.client("ex-it-usage")
    ftools = [{"type": "function", "name": "bash", "parameters": {"type": "object"}}]
    answer = await oai.responses.create(model="m", input="go", tools=ftools)
    call = next(item for item in answer.output if item.type == "function_call")
    items = [{"role": "user", "content": "go"}, call.model_dump(exclude_none=True),
             {"type": "function_call_output", "call_id": call.call_id, "output": "a"}]
    counted = await oai.responses.input_tokens.count(model="m", input=items, tools=ftools)
    used = await oai.responses.create(model="m", input=items, tools=ftools)
    assert counted.input_tokens == used.usage.input_tokens == len(engine.requests[-1]["input_ids"])
    assert local.store("ex-it-usage").calls[-1].parent is local.store("ex-it-usage").calls[0]


async def test_responses_reasoning_items_are_the_next_turns_reasoning(local, tok):  # noqa: F811
    """A `reasoning` item sent back is rendered as the reasoning of the assistant turn it
    precedes, as a Messages thinking block is, also where no recorded call restores it (a
    new key, a restarted proxy); stored responses are a 404 in OpenAI's shape."""
    from handlers.proxy.responses import responses_messages

    engine = await local.engine(["ok"])
    await local.proxy(engine=engine)
    items = [{"role": "user", "content": "list"},
             {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "I should run ls."}]},
             {"type": "function_call", "call_id": "c1", "name": "bash", "arguments": "{}"},
             {"type": "function_call_output", "call_id": "c1", "output": "a.txt"}]
    assert responses_messages({"input": items})[1]["reasoning_content"] == "I should run ls."
    # Reasoning its turn's answer does not follow (an interrupted turn) goes with no later turn
    stray = [items[0], items[1], {"role": "user", "content": "q2"}, *items[2:],
             {"type": "reasoning", "summary": [{"type": "summary_text", "text": "R2"}]},
             {"type": "function_call_output", "call_id": "c1", "output": "x"},
             {"type": "function_call", "call_id": "c2", "name": "bash", "arguments": "{}"},
             {"type": "reasoning", "summary": [{"type": "summary_text", "text": "R3"}]},
             {"type": "web_search_call", "id": "ws_1", "status": "completed", "action": {"type": "search"}},
             {"type": "function_call", "call_id": "c5", "name": "bash", "arguments": "{}"}]
    assert not any("reasoning_content" in m for m in responses_messages({"input": stray}))
    oai = local.client("ex-rs")
    await oai.responses.create(model="m", input=items,
                               tools=[{"type": "function", "name": "bash", "parameters": {"type": "object"}}])
    assert "<think>\nI should run ls.\n</think>" in _prompt(tok, engine)
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {oai.api_key}"}) as http:
        async with http.get(local.url + "/v1/responses/resp_123") as resp:
            body = await resp.json()
            assert resp.status == 404 and body["error"]["code"] == "response_not_found"
            assert "resp_123" in body["error"]["message"]
        async with http.get(local.url + "/v1/responses/input_tokens") as resp:
            assert resp.status == 405 and resp.headers["Allow"] == "POST"


async def test_codex_namespace_tools_are_shown_and_their_calls_name_the_namespace(local, tok):  # noqa: F811
    """Codex offers its sub-agent tools as a `namespace` tool; the policy sees each function
    under its flat name (`multi_agent_v1__spawn_agent`), a call to one is answered with
    `name` and `namespace` apart (Codex rejects it otherwise: "unsupported call"), and the
    item echoed back with its namespace extends the call."""
    spawn = '<tool_call>\n{"name": "multi_agent_v1__spawn_agent", "arguments": {"task": "count files"}}\n</tool_call>'
    engine = await local.engine([spawn, "done"])
    await local.proxy(engine=engine)
    tools = [{"type": "function", "name": "exec_command", "parameters": {"type": "object"}},
             {"type": "namespace", "name": "multi_agent_v1", "description": "sub-agents", "tools": [
                 {"type": "function", "name": "spawn_agent", "description": "Spawn a sub-agent.",
                  "parameters": {"type": "object", "properties": {"task": {"type": "string"}}}},
                 {"type": "function", "name": "wait_agent", "parameters": {"type": "object"}}]}]
    body = {"model": "m", "input": [{"role": "user", "content": "go"}], "tools": tools, "stream": False}
    oai = local.client("ex-ns")
    got = await oai.post("/responses", body=body, cast_to=object)
    (call,) = [item for item in got["output"] if item["type"] == "function_call"]
    assert (call["name"], call["namespace"], json.loads(call["arguments"])) == (
        "spawn_agent", "multi_agent_v1", {"task": "count files"})
    prompt = _prompt(tok, engine)
    assert '"name": "multi_agent_v1__spawn_agent"' in prompt and '"name": "multi_agent_v1__wait_agent"' in prompt
    assert "Spawn a sub-agent." in prompt
    echoed = {**body, "input": body["input"] + [
        {k: call[k] for k in ("type", "call_id", "name", "namespace", "arguments")},
        {"type": "function_call_output", "call_id": call["call_id"], "output": "spawned"}]}
    await oai.post("/responses", body=echoed, cast_to=object)
    store = local.store("ex-ns")
    assert store.calls[-1].parent is store.calls[0] and store.calls[-1].drift == 0
    # Two tools the policy would see under one name: refused, not answered to the wrong one
    clash = [{"type": "function", "name": "multi_agent_v1__wait_agent", "parameters": {}}, *tools]
    with pytest.raises(openai.BadRequestError) as err:
        await oai.post("/responses", body={**body, "tools": clash}, cast_to=object)
    assert err.value.body["param"] == "tools" and "multi_agent_v1__wait_agent" in err.value.message
