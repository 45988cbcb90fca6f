"""Faults around the proxy: malformed engine replies (SGLang's own `weight_version`
string included), a model's tool call that is not JSON, an error after a non-streamed
keep-alive, a hung engine beside a healthy one, and request bodies that only classification
or deep nesting would trip over. Each must end in the caller's error shape or a normal
answer, with the call on the bus."""
from __future__ import annotations

import asyncio
import dataclasses
import json

import aiohttp
import openai
import orjson
import pytest
from aiohttp import web

from gyre.serving.chat import parse_completion
from gyre.env.harness import execution_key
from handlers.proxy.call import CHAT
from handlers.proxy.outbox import Outgoing
from handlers.proxy.api import ApiError, StreamStart
from handlers.proxy.routing import engine_reply
from handlers.proxy.http import STREAM_OPEN_S, Reply
from schemas import ids
from schemas.cell import Route, RouteUpdated
from tests.test_proxy import SECRET, Stack, bus, stack, tok  # noqa: F401 - fixtures
from tests.test_proxy_apis import switched, wait_for

GOOD = {"output_ids": [9707, 151645], "meta_info": {
    "finish_reason": {"type": "stop", "matched": 151645}, "output_token_logprobs": [[-0.5, 9707], [-0.1, 151645]],
    "weight_version": "default"}}


def with_meta(**meta) -> dict:
    return {**GOOD, "meta_info": {**GOOD["meta_info"], **meta}}


def test_engine_reply_reads_sglang_versions_and_refuses_what_is_not_a_sample():
    r = engine_reply(GOOD)  # SGLang before any weight update: "default" is the starting policy
    assert r.output_ids == [9707, 151645] and r.logprobs == [-0.5, -0.1] and r.finish == "stop"
    assert r.versions == ((0, 2, 0),) and r.stop_string is None
    assert engine_reply(with_meta(weight_version="7")).versions == ((0, 2, 7),)
    assert engine_reply(with_meta(weight_version=3)).versions == ((0, 2, 3),)
    assert engine_reply(with_meta(gyre_versions=[[0, 1, 4], [1, 2, 5]])).versions == ((0, 1, 4), (1, 2, 5))
    assert engine_reply(with_meta(finish_reason=None)).finish == "stop"
    aborted = engine_reply({"text": "", "meta_info": {"finish_reason": {"type": "abort", "message": "evicted"}}})
    assert aborted.finish == "abort" and aborted.output_ids == [] and aborted.versions == ()
    no_ids = {"meta_info": GOOD["meta_info"], "text": "Hello"}  # SGLang without --return-token-ids
    assert engine_reply(no_ids).output_ids == [9707, 151645]
    assert engine_reply(with_meta(finish_reason={"type": "length", "length": 2})).finish == "length"
    bad = [
        "<html>bad gateway</html>", [1, 2], None,
        {"output_ids": None, "meta_info": None},
        {**GOOD, "meta_info": None},
        {"meta_info": with_meta(output_token_logprobs=[[-0.5], [-0.1]])["meta_info"]},
        {**GOOD, "output_ids": [1.5, 2]},
        {**GOOD, "output_ids": [True, 2]},
        {**GOOD, "output_ids": [-1, 2]},
        with_meta(output_token_logprobs=[[None, 9707], [-0.1, 151645]]),  # SGLang writes -inf / NaN as null
        with_meta(output_token_logprobs=[[-0.5, 9707]]),
        with_meta(output_token_logprobs=None),
        with_meta(output_token_logprobs=[-0.5, -0.1]),
        with_meta(weight_version="v2-final"),
        with_meta(weight_version=-1),
        with_meta(finish_reason="stop"),
        with_meta(finish_reason={"type": "weird"}),
        with_meta(gyre_versions=[[0, 2]]),
        with_meta(gyre_versions=[[0, 1, 3]]),  # does not cover both ids
        with_meta(gyre_versions=[[0, 1, 3], [5, 2, 4]]),
        with_meta(gyre_versions=[[0, 2, 2**31]]),  # versions and ids are int32 downstream
        {**GOOD, "output_ids": [2**31, 151645]},
        with_meta(output_token_logprobs=[[50.0, 9707], [-0.1, 151645]]),  # a log-prob above 0
        with_meta(weight_version="9" * 30),  # beyond a 64-bit version
    ]
    for body in bad:
        with pytest.raises(ApiError) as err:
            engine_reply(body)
        assert err.value.status == 502 and err.value.code == "engine_bad_reply", body


class RawEngine:
    """A `/generate` that answers fixed bytes (after `delay_s`), as a misbehaving engine
    or a stock SGLang would."""

    def __init__(self, body: bytes, status: int = 200, delay_s: float = 0.0):
        self.body, self.status, self.delay_s = body, status, delay_s
        self.requests: list[dict] = []
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> "RawEngine":
        async def generate(request: web.Request) -> web.Response:
            self.requests.append(await request.json())
            await asyncio.sleep(self.delay_s)
            return web.Response(body=self.body, status=self.status, content_type="application/json")

        async def abort(request: web.Request) -> web.Response:
            return web.json_response({})

        app = web.Application()
        app.router.add_post("/generate", generate)
        app.router.add_post("/abort_request", abort)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"
        return self

    async def stop(self) -> None:
        await self.runner.cleanup()


async def test_sglang_string_version_is_answered_and_a_garbage_reply_is_a_502_on_the_bus(stack):  # noqa: F811
    sglang = await RawEngine(orjson.dumps(GOOD)).start()
    try:
        await stack.proxy(engine=None)
        await stack.state.handle_event(switched("c0", "rollout", sglang.url))
        answer = await stack.client("ex-sg").chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}])
        assert answer.choices[0].message.content == "Hello" and answer.choices[0].finish_reason == "stop"
        (ok,) = await stack.calls(1)
        assert ok.status == "ok" and ok.versions == ((0, 2, 0),) and ok.tokens.completion_ids == (9707, 151645)
        streamed = {"model": "m", "max_tokens": 5, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
        for body in (b"<html>502 Bad Gateway</html>", b'{"output_ids": null, "meta_info": null}'):
            sglang.body = body
            with pytest.raises(openai.InternalServerError) as err:  # 502, OpenAI's error shape
                await stack.client("ex-sg").chat.completions.create(
                    model="m", messages=[{"role": "user", "content": "hi"}])
            assert err.value.status_code == 502 and err.value.body["code"] == "engine_bad_reply"
            async with aiohttp.ClientSession() as http:
                async with http.post(stack.url + "/v1/messages", json={
                        "model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]},
                        headers={"x-api-key": execution_key(SECRET, "ex-sg2")}) as r:
                    assert r.status == 502 and (await r.json())["error"]["type"] == "api_error"
                # Streamed, failing before the stream opened (STREAM_OPEN_S): an HTTP error too.
                async with http.post(stack.url + "/v1/messages", json=streamed,
                                     headers={"x-api-key": execution_key(SECRET, "ex-sg2")}) as r:
                    assert r.status == 502 and (await r.json())["error"]["type"] == "api_error"
            errors = await stack.calls(3)
            assert [e.status for e in errors] == ["error"] * 3 and all(not e.tokens.completion_ids for e in errors)
        sglang.delay_s = STREAM_OPEN_S + 0.3  # the stream opens first: the error is an SSE event
        async with aiohttp.ClientSession() as http:
            async with http.post(stack.url + "/v1/messages", json=streamed,
                                 headers={"x-api-key": execution_key(SECRET, "ex-sg2")}) as r:
                frames = (await r.read()).decode()
        assert r.status == 200 and frames.startswith("event: message_start")
        assert "event: error" in frames and frames.rstrip().endswith("}")
        assert [e.status for e in await stack.calls(1)] == ["error"]
    finally:
        await sglang.stop()


def test_a_tool_call_with_nan_or_infinity_is_text():
    for value in ("NaN", "Infinity", "-Infinity", "1e999", "-1e400"):
        text = '<tool_call>\n{"name": "bash", "arguments": {"command": %s}}\n</tool_call>' % value
        parsed = parse_completion(text, id_prefix="call_x")
        assert parsed.tool_calls == () and value in parsed.content
        nested = '<tool_call>\n{"name": "bash", "arguments": "{\\"n\\": %s}"}\n</tool_call>' % value
        assert parse_completion(nested, id_prefix="call_x").tool_calls == ()
    deep = '<tool_call>\n{"name": "bash", "arguments": {"a": %s}}\n</tool_call>' % ("[" * 100 + "]" * 100)
    assert parse_completion(deep, id_prefix="call_x").tool_calls == ()
    fine = '<tool_call>\n{"name": "bash", "arguments": {"a": %s, "x": 1e300}}\n</tool_call>' % ("[" * 20 + "]" * 20)
    assert len(parse_completion(fine, id_prefix="call_x").tool_calls) == 1


async def test_nan_tool_call_reaches_anthropic_as_text(stack):  # noqa: F811
    engine = await stack.engine(['<tool_call>\n{"name": "bash", "arguments": {"command": NaN}}\n</tool_call>'])
    await stack.proxy(engine=engine)
    client = stack.anthropic("ex-nan")
    message = await client.messages.create(model="m", max_tokens=50, messages=[{"role": "user", "content": "go"}])
    assert message.stop_reason == "end_turn" and "NaN" in message.content[0].text
    async with client.messages.stream(model="m", max_tokens=50, messages=[{"role": "user", "content": "go"}]) as s:
        final = await s.get_final_message()
    assert final.content[0].type == "text" and "NaN" in final.content[0].text
    assert [c.status for c in await stack.calls(2)] == ["ok", "ok"]


async def test_a_failure_after_non_streamed_keepalives_cuts_the_body(stack):  # noqa: F811
    engine = await RawEngine(b'{"error": "boom"}', status=500, delay_s=0.5).start()
    try:
        await stack.proxy(engine=None, keepalive_s=0.1)
        await stack.state.handle_event(switched("c0", "rollout", engine.url))
        # The SDK must not take a 200 with an error object for an answer: it sees a broken
        # connection (which it would retry).
        with pytest.raises(openai.APIConnectionError):
            await stack.client("ex-ka").chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
        async with aiohttp.ClientSession() as http:
            async with http.post(stack.url + "/v1/chat/completions", json={
                    "model": "m", "messages": [{"role": "user", "content": "hi"}]},
                    headers={"Authorization": f"Bearer {execution_key(SECRET, 'ex-ka')}"}) as r:
                assert r.status == 200
                with pytest.raises(aiohttp.ClientPayloadError):
                    await r.read()
        assert [c.status for c in await stack.calls(2)] == ["error", "error"]
    finally:
        await engine.stop()


async def test_a_hung_engine_does_not_hold_up_calls_to_another(stack):  # noqa: F811
    hung = await stack.engine(["late"], delay_s=30.0)
    healthy = await stack.engine(["prompt"])
    await stack.proxy(engine=None, concurrency=1)
    state = stack.state
    await state.handle_event(switched("c0", "rollout", hung.url))
    await state.handle_event(switched("c1", "rollout", healthy.url))
    await state.handle_event(RouteUpdated(event_id=ids.route(stack.run_id, 0), seq=0, routes=(
        Route(execution="ex-h1", cell="c0", reason="test"), Route(execution="ex-h2", cell="c0", reason="test"),
        Route(execution="ex-ok", cell="c1", reason="test"))))
    msgs = [{"role": "user", "content": "hi"}]
    stuck = [asyncio.ensure_future(stack.client(e).chat.completions.create(model="m", messages=msgs))
             for e in ("ex-h1", "ex-h2")]
    await wait_for(lambda: hung.requests)
    answer = await asyncio.wait_for(stack.client("ex-ok").chat.completions.create(model="m", messages=msgs), 10)
    assert answer.choices[0].message.content == "prompt" and len(hung.requests) == 1  # its one slot is taken
    for task in stuck:
        task.cancel()
    await asyncio.gather(*stuck, return_exceptions=True)


@pytest.mark.parametrize("case", ["claude-code-header", "codex-header", "deep-header", "deep-tool-input",
                                  "deep-custom-tool", "stream-string", "include-usage-string", "message-number",
                                  "text-number",
                                  "assistant-text-number"])
async def test_bodies_that_trip_classification_or_nesting_get_a_400(stack, case):  # noqa: F811
    engine = await stack.engine(["ok"])
    await stack.proxy(engine=engine)
    deep = "[" * 1000 + "]" * 1000
    user = '{"role":"user","content":"hi"}'
    chat, messages, responses = "/v1/chat/completions", "/v1/messages", "/v1/responses"
    path, raw, headers = {
        "claude-code-header": (chat, '{"messages":[1]}', {"x-claude-code-session-id": "s"}),
        "codex-header": (chat, '{"messages":["x"]}', {"x-codex-turn-metadata": "{}"}),
        "deep-header": (chat, '{"messages":[%s]}' % user, {"x-codex-turn-metadata": "[" * 3000 + "]" * 3000}),
        "deep-tool-input": (messages, '{"max_tokens":5,"messages":[%s,{"role":"assistant","content":[{"type":'
                            '"tool_use","id":"a","name":"f","input":{"x":%s}}]}]}' % (user, deep), {}),
        "deep-custom-tool": (responses, '{"input":[{"type":"message","role":"user","content":"hi"},{"type":'
                             '"custom_tool_call","call_id":"a","name":"f","input":%s}]}' % deep, {}),
        "stream-string": (chat, '{"messages":[%s],"stream":"false"}' % user, {}),
        "include-usage-string": (chat, '{"messages":[%s],"stream":true,"stream_options":{"include_usage":"false"}}'
                                 % user, {}),
        "message-number": (messages, '{"max_tokens":5,"messages":[7]}', {}),
        "text-number": (messages, '{"max_tokens":5,"messages":[{"role":"user","content":[{"type":"text","text":5}]}]}',
                        {}),
        "assistant-text-number": (messages, '{"max_tokens":5,"messages":[%s,{"role":"assistant","content":[{"type":'
                                  '"text","text":null}]},%s]}' % (user, user), {}),
    }[case]
    async with aiohttp.ClientSession() as http:
        async with http.post(stack.url + path, data=raw.encode(), headers={
                **headers, "Authorization": f"Bearer {execution_key(SECRET, 'ex-' + case)}",
                "Content-Type": "application/json"}) as r:
            body = await r.json()
            if case == "deep-header":  # an unreadable harness header is metadata lost, not an error
                assert r.status == 200, body
            else:
                assert r.status == 400, body
                assert body["error"]["type"] == "invalid_request_error"


async def test_unknown_paths_and_models_answer_in_the_callers_shape(stack):  # noqa: F811
    engine = await stack.engine(["ok"])
    await stack.proxy(engine=engine)
    async with aiohttp.ClientSession() as http:
        for path, anthropic_shape, headers in (
                ("/messages/foo", True, {}), ("/v1/messages/x/y", True, {}), ("/chat/nope", False, {}),
                ("/nope", False, {}), ("/v1/complete", True, {"anthropic-version": "2023-06-01"})):
            async with http.post(stack.url + path, json={}, headers=headers) as r:
                body = await r.json()
                assert r.status == 404, path
                assert (body.get("type") == "error") == anthropic_shape and body["error"]["type"] == "not_found_error"
        anthropic_sdk = {"x-api-key": "nope", "anthropic-version": "2023-06-01"}
        async with http.get(stack.url + "/v1/models", headers=anthropic_sdk) as r:
            assert r.status == 401 and (await r.json())["type"] == "error"
        async with http.get(stack.url + "/v1/models", headers={"Authorization": "Bearer nope"}) as r:
            assert r.status == 401 and set((await r.json())["error"]) == {"message", "type", "param", "code"}
        for method in ("GET", "HEAD"):
            async with http.request(method, stack.url + "/") as r:
                assert r.status == 200
        for path, anthropic_shape in (("/v1/chat/completions", False), ("/responses", False), ("/v1/messages", True),
                                      ("/v1/messages/count_tokens", True)):
            async with http.get(stack.url + path) as r:  # a model path with the wrong method
                body = await r.json()
                assert r.status == 405 and r.headers["Allow"] == "POST", path
                assert (body.get("type") == "error") == anthropic_shape, body
                assert body["error"]["type"] == "invalid_request_error", body


async def test_a_defect_of_ours_is_a_500_in_the_api_shape_and_the_call_is_on_the_bus(stack, monkeypatch):  # noqa: F811
    engine = await stack.engine(["ok"])
    await stack.proxy(engine=engine)

    def broken(*args, **kwargs):
        raise KeyError("a bug")

    monkeypatch.setattr("handlers.proxy.call.parse_completion", broken)
    with pytest.raises(openai.InternalServerError) as err:
        await stack.client("ex-bug").chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    assert err.value.status_code == 500 and err.value.body["code"] == "internal_error"
    client = stack.anthropic("ex-bug2")
    with pytest.raises(Exception) as err2:
        async with client.messages.stream(model="m", max_tokens=5, messages=[{"role": "user", "content": "hi"}]) as s:
            await s.get_final_message()
    assert "internal error" in str(err2.value)
    assert [c.status for c in await stack.calls(2)] == ["error", "error"]
    assert stack.state.active == 0


async def test_a_generation_past_its_bound_is_aborted_and_retried_elsewhere(stack, monkeypatch):  # noqa: F811
    monkeypatch.setattr("handlers.proxy.routing.GENERATE_GRACE_S", 0.3)
    monkeypatch.setattr("handlers.proxy.routing.MIN_DECODE_TOKENS_PER_S", 1e9)
    hung = await stack.engine(["late"], delay_s=30.0)
    healthy = await stack.engine(["prompt"])
    await stack.proxy(engine=None)
    state = stack.state
    await state.handle_event(switched("c0", "rollout", hung.url))
    await state.handle_event(switched("c1", "rollout", healthy.url))
    await state.handle_event(RouteUpdated(event_id=ids.route(stack.run_id, 0), seq=0, routes=(
        Route(execution="ex-slow", cell="c0", reason="test"),)))
    answer = await asyncio.wait_for(stack.client("ex-slow").chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hi"}]), 10)
    assert answer.choices[0].message.content == "prompt"
    await wait_for(lambda: hung.requests and hung.requests[0]["rid"] in hung.aborted)
    (call,) = await stack.calls(1)
    assert call.status == "ok" and call.cell == "c1"


async def test_a_timed_out_attempt_gets_a_fresh_wait_and_calls_queued_behind_it_move_on(stack, monkeypatch):  # noqa: F811
    # The attempt's bound exceeds retry_timeout_s, as by default (10 min vs 10 min): the
    # calls must still move to the healthy cell once their attempts on the hung one time out,
    # the second after queueing for the hung engine's one slot.
    monkeypatch.setattr("handlers.proxy.routing.GENERATE_GRACE_S", 1.0)
    monkeypatch.setattr("handlers.proxy.routing.MIN_DECODE_TOKENS_PER_S", 1e9)
    hung = await stack.engine(["late"], delay_s=30.0)
    healthy = await stack.engine(["prompt"])
    await stack.proxy(engine=None, retry_timeout_s=0.5, concurrency=1)
    state = stack.state
    await state.handle_event(switched("c0", "rollout", hung.url))
    await state.handle_event(switched("c1", "rollout", healthy.url))
    await state.handle_event(RouteUpdated(event_id=ids.route(stack.run_id, 0), seq=0, routes=(
        Route(execution="ex-t1", cell="c0", reason="test"), Route(execution="ex-t2", cell="c0", reason="test"))))
    msgs = [{"role": "user", "content": "hi"}]
    first = asyncio.ensure_future(stack.client("ex-t1").chat.completions.create(model="m", messages=msgs))
    await wait_for(lambda: hung.requests)
    second = await asyncio.wait_for(stack.client("ex-t2").chat.completions.create(model="m", messages=msgs), 10)
    answer = await asyncio.wait_for(first, 10)
    assert answer.choices[0].message.content == second.choices[0].message.content == "prompt"
    assert len(hung.requests) == 2 and len(healthy.requests) == 2
    await wait_for(lambda: {r["rid"] for r in hung.requests} <= hung.aborted)
    assert sorted(c.status for c in await stack.calls(2)) == ["ok", "ok"]


async def test_a_connect_timeout_is_retried_until_the_deadline_not_counted_as_a_hung_engine(stack, monkeypatch):  # noqa: F811
    from handlers.engines import client as engine_client, connections as engine_http
    calls = []

    async def slow_connect(self):
        calls.append("/generate")
        raise TimeoutError("slow connect")

    async def other(self, method, path, body=None, timeout=None):
        calls.append(path)
        raise engine_client.EngineUnavailable("connect timeout") from TimeoutError("slow connect")

    monkeypatch.setattr(engine_http.EngineConnections, "_connect", slow_connect)
    monkeypatch.setattr(engine_client.EngineClient, "_request", other)
    await stack.proxy(engine=None, retry_timeout_s=1.0, retry_backoff_s=0.05)
    await stack.state.handle_event(switched("c0", "rollout", "http://127.0.0.1:9"))
    t0 = asyncio.get_running_loop().time()
    with pytest.raises(openai.InternalServerError) as err:
        await stack.client("ex-ct").chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    assert err.value.status_code == 503 and "within" in str(err.value)  # the deadline, not "timed out repeatedly"
    assert asyncio.get_running_loop().time() - t0 >= 0.9 and "/abort_request" not in calls and len(calls) > 3


def test_key_cache_keeps_valid_keys_only():
    """Verified keys are cached (no HMAC per call); rejected ones never are, so requests
    with made-up keys cannot fill the cache or push the real keys out."""
    from handlers.proxy.daemon import Config
    from handlers.proxy.state import ProxyState

    state = ProxyState(Config(run="r", key_secret=SECRET), None, None)
    key = execution_key(SECRET, "exA")
    forged = key[:-1] + ("0" if key[-1] != "0" else "1")
    for bad in [forged, "gyre-exA-" + "0" * 32, "x" * 8000, *(f"junk-{i}" for i in range(100))]:
        assert state.execution_of(bad) is None
    assert state._valid_key.cache_info().currsize == 0
    assert state.execution_of(key) == "exA" and state.execution_of(key) == "exA"
    info = state._valid_key.cache_info()
    assert (info.currsize, info.hits) == (1, 1)
    assert state.execution_of(forged) is None


async def _serve_one(handler) -> tuple[int | None, bytes]:
    """POST once to a bare aiohttp server running `handler`: (status, body), or (None,
    the error's repr) when the connection broke."""
    app = web.Application()
    app.router.add_post("/x", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        async with aiohttp.ClientSession() as http:
            try:
                async with http.post(f"http://127.0.0.1:{runner.addresses[0][1]}/x") as r:
                    return r.status, await r.read()
            except aiohttp.ClientError as exc:
                return None, repr(exc).encode()
    finally:
        await runner.cleanup()


@pytest.mark.parametrize("stream", [False, True])
async def test_a_failure_as_the_response_was_to_open_is_an_http_error(stream):
    """The keep-alive timer fired (the opening is scheduled, not begun) in the loop pass the
    handler resumes with a failure: nothing went out yet, so the caller gets an HTTP error
    in its API's shape, not a cut body or an SSE error."""
    async def handler(request):
        reply = Reply(request, CHAT, stream, keepalive_s=0.05, deliver_timeout_s=30.0)
        await reply.start(StreamStart(rid="r", created=0, model="m", prompt_tokens=1), [])
        await asyncio.sleep(0.01)
        reply._timer.cancel()  # what the loop does when the timer fires just before this resumes
        reply._start_keepalive()
        return await reply.fail(ApiError(503, "no engine", "server_error", code="engine_unavailable"))

    status, body = await _serve_one(handler)
    assert status == 503 and orjson.loads(body)["error"]["code"] == "engine_unavailable", (status, body)


async def test_a_cancellation_while_keepalives_stop_is_not_lost():
    """The handler cancelled (the harness went away) while `stop_keepalive` awaits the
    keep-alive task: the cancellation reaches the handler instead of being absorbed."""
    seen = {}

    async def handler(request):
        reply = Reply(request, CHAT, True, keepalive_s=0.05, deliver_timeout_s=30.0)
        await reply.start(StreamStart(rid="r", created=0, model="m", prompt_tokens=1), [])
        await asyncio.sleep(0.2)  # opened, keep-alives running
        asyncio.get_running_loop().call_soon(asyncio.current_task().cancel)
        try:
            await reply.send([b"data: answer\n\n"])
            seen["outcome"] = "answered"
        except asyncio.CancelledError:
            seen["outcome"] = "cancelled"
            raise
        return reply.resp

    await _serve_one(handler)
    assert seen == {"outcome": "cancelled"}


async def test_a_cell_whose_url_the_proxy_cannot_use_is_avoided_and_the_call_served_elsewhere(stack):  # noqa: F811
    good = await stack.engine(["from good"])
    await stack.proxy(engine=None, retry_timeout_s=3.0)
    await stack.state.handle_event(switched("bad", "rollout", good.url.removeprefix("http://")))  # no scheme
    await stack.state.handle_event(switched("good", "rollout", good.url, seq=1))
    client = stack.client("ex-b")
    for i in range(4):
        answer = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": f"q{i}"}])
        assert answer.choices[0].message.content == "from good"


# --------------------------------------------------------------------------- hostile clients on loopback

RAW_BODY = b'{"model":"m","max_tokens":16,"messages":[{"role":"user","content":"hi"}]}'


async def raw_exchange(url: str, head: bytes, body: bytes = RAW_BODY, timeout_s: float = 5.0) -> bytes:
    """One request as raw bytes (any header byte allowed); the whole response."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(head + b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body) + body)
    await writer.drain()
    try:
        return await asyncio.wait_for(reader.read(), timeout_s)
    finally:
        writer.close()


async def test_a_key_that_is_not_utf8_is_a_401_in_the_apis_shape(stack):  # noqa: F811
    url = await stack.proxy(engine=await stack.engine(["hi"]))
    bad = b"gyre-\xe9-0123456789abcdef0123456789abcdef"
    for head in (b"POST /v1/messages HTTP/1.1\r\nHost: x\r\nx-api-key: " + bad + b"\r\n",
                 b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + bad + b"\r\n"):
        resp = await raw_exchange(url, head)
        head_out, _, body = resp.partition(b"\r\n\r\n")
        assert head_out.startswith(b"HTTP/1.1 401") and b"application/json" in head_out, resp[:300]
        assert b"invalid API key" in body


async def test_metadata_that_is_not_utf8_is_stored_escaped_and_holds_up_no_other_call(stack):  # noqa: F811
    """A session header whose bytes are not UTF-8, or Codex turn metadata holding a `\\ud800`
    escape, goes into `call.completed` meta escaped: the call is stored (orjson refuses
    surrogates, so it was retried for the whole window and then lost, holding a publish
    slot all that time)."""
    engine = await stack.engine(["hi"])
    url = await stack.proxy(engine=engine, retry_timeout_s=30.0, max_publishes_in_flight=2)
    key = execution_key(SECRET, "ex-hdr").encode()
    resp = await raw_exchange(url, b"POST /v1/messages HTTP/1.1\r\nHost: x\r\nx-api-key: " + key + b"\r\n"
                                   b"anthropic-version: 2023-06-01\r\nx-claude-code-session-id: sess-\xff\r\n")
    assert resp.startswith(b"HTTP/1.1 200"), resp[:300]
    codex = stack.client("ex-codex-meta", default_headers={"x-codex-turn-metadata": '{"turn_id": "t\\ud800"}',
                                                            "session-id": "thread-1"})
    assert (await codex.responses.create(model="m", input="hi")).output_text == "hi"
    good = await stack.client("ex-good").chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    assert good.choices[0].message.content == "hi"
    calls = {c.execution: c for c in await stack.calls(3, timeout_s=10)}
    assert calls["ex-hdr"].meta["session_id"] == "sess-\\udcff" and calls["ex-hdr"].status == "ok"
    assert calls["ex-codex-meta"].meta["turn_id"] == "t\\ud800"


async def test_metadata_that_will_not_encode_is_spilled_escaped_beside_the_other_calls(stack, tmp_path):  # noqa: F811
    """Should a string that is not UTF-8 reach an event's meta by another way than
    `gyre.serving.roles.classify`, the publish stores the event with it escaped, and a stop's spill
    writes every call of its batch."""
    engine = await stack.engine(["hi"])
    spill = tmp_path / "spill.jsonl"
    await stack.proxy(engine=engine, retry_timeout_s=60.0, spill_file=str(spill))
    state = stack.state
    real = state.call_event

    def poisoned(**kw):
        out = real(**kw)
        if out.event.execution == "ex-bad":
            out = type(out)(dataclasses.replace(out.event, meta={**out.event.meta, "x": "a\ud800"}), out.tokens_json)
        return out

    state.call_event = poisoned
    for execution in ("ex-bad", "ex-fine"):
        await stack.client(execution).chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    calls = {c.execution: c for c in await stack.calls(2, timeout_s=10)}
    assert calls["ex-bad"].meta["x"] == "a\\ud800" and calls["ex-fine"].status == "ok"

    bad = dataclasses.replace(calls["ex-bad"], meta={"x": "b\ud800"})
    state.spill([Outgoing(bad, None), Outgoing(calls["ex-fine"], None)], "test")
    lines = [orjson.loads(line) for line in spill.read_bytes().splitlines() if line]
    assert [ln["event"]["execution"] for ln in lines] == ["ex-bad", "ex-fine"]
    assert lines[0]["event"]["meta"]["x"] == "b\\ud800"


async def test_a_client_that_never_finishes_its_request_is_closed(stack, monkeypatch):  # noqa: F811
    """A connection that sends nothing, or part of its headers, is closed once idle for
    `IDLE_CLOSE_S`; one whose body stalls gets a 408 in the API's shape after
    `BODY_READ_S`, and is closed: a local process cannot hold connections until the proxy runs out of
    file descriptors. A harness's call meanwhile is served."""
    import handlers.proxy.app as proxy_mod
    import handlers.proxy.http as proxy_http

    monkeypatch.setattr(proxy_mod, "IDLE_CLOSE_S", 1.0)
    monkeypatch.setattr(proxy_http, "BODY_READ_S", 1.0)
    engine = await stack.engine(["hi"])
    url = await stack.proxy(engine=engine)
    host, port = url.removeprefix("http://").rsplit(":", 1)
    key = execution_key(SECRET, "ex-slow").encode()
    stalled = []
    for data in (b"", b"POST /v1/messages HTTP/1.1\r\nHost: x\r\n",
                 b"POST /v1/messages HTTP/1.1\r\nHost: x\r\nx-api-key: " + key + b"\r\nContent-Length: 100\r\n\r\n{"):
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(data)
        await writer.drain()
        stalled.append((reader, writer))
    answer = await stack.client("ex-fine").chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
    assert answer.choices[0].message.content == "hi"
    try:  # (the stalled body's connection closes once aiohttp's lingering read, 10 s, gives up)
        got = await asyncio.wait_for(asyncio.gather(*(reader.read() for reader, _ in stalled)), 15.0)
    finally:
        for _, writer in stalled:
            writer.close()
    assert got[:2] == [b"", b""]
    assert got[2].startswith(b"HTTP/1.1 408") and b"did not arrive within 1 s" in got[2], got[2][:300]
    assert b'"type":"error"' in got[2]


async def test_content_encoding_over_two_header_lines_is_one_list(stack):  # noqa: F811
    """RFC 9110 5.3: `Content-Encoding: gzip` twice is `gzip, gzip` (decoded twice)."""
    import gzip

    url = await stack.proxy(engine=await stack.engine(["hi"]))
    key = execution_key(SECRET, "ex-enc").encode()
    body = gzip.compress(gzip.compress(RAW_BODY))
    resp = await raw_exchange(url, b"POST /v1/messages HTTP/1.1\r\nHost: x\r\nx-api-key: " + key + b"\r\n"
                                   b"anthropic-version: 2023-06-01\r\nContent-Encoding: gzip\r\n"
                                   b"Content-Encoding: gzip\r\n", body)
    assert resp.startswith(b"HTTP/1.1 200"), resp[:300]


async def test_what_aiohttp_logs_of_a_refused_request_head_is_a_json_line(stack):  # noqa: F811
    """A header line beyond aiohttp's 8,190 bytes is refused by aiohttp's parser before any
    handler runs; it logs that through the stdlib with a traceback, which reached a daemon's
    log as bare text lines among its JSON ones (`configure_logging` routes the stdlib too)."""
    import io

    import structlog

    from handlers.daemon import configure_logging, release_stdlib_logging

    url = await stack.proxy(engine=await stack.engine(["hi"]))
    out = io.StringIO()
    configure_logging("proxy", json_lines=True, file=out)
    try:
        resp = await raw_exchange(url, b"POST /v1/messages HTTP/1.1\r\nHost: x\r\nx-junk: " + b"x" * 20_000 + b"\r\n")
        assert resp.split(b"\r\n", 1)[0].split(b" ")[1] == b"400", resp[:300]
        await asyncio.sleep(0.1)
    finally:
        structlog.reset_defaults()
        release_stdlib_logging()
    lines = [json.loads(line) for line in out.getvalue().splitlines()]  # every line JSON
    (refused,) = [x for x in lines if x.get("logger") == "aiohttp.server"]
    assert refused["level"] == "error" and "8190" in refused["exception"], refused
