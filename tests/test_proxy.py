"""The proxy end to end: the official OpenAI SDK as harness, a scripted engine, a real
nats-server and bus; `call.completed` read back through the builder's JetStream consumer."""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import re
import threading
import time
from pathlib import Path

import aiohttp
import anthropic
import openai
import orjson
import pytest
import structlog.testing

import gyre.serving.tito
import schemas
from bus import Bus, BusConfig
from gyre.serving.chat import render
from gyre.env.harness import execution_key
from gyre.serving.tito import CallStore
from gyre.serving.tokenizer import IM_END, build_tokenizer
from handlers.engines.client import make_session
from handlers.proxy import call as proxy_call, outbox as proxy_outbox, restart as proxy_restart
from handlers.proxy.app import start
from handlers.proxy.daemon import Config, run
from handlers.proxy.state import ProxyState
from handlers.engines.scripted import ScriptedEngine, load_script
from schemas import ids
from schemas.cell import CellSwitched, Route, RouteUpdated
from schemas.execution import ExecutionFinished, ExecutionInfo
from tests.test_bus import freeze, until

SECRET = b"proxy-test-secret-0123456789"
TOOLS = [{"type": "function", "function": {"name": "bash", "description": "run a command",
                                           "parameters": {"type": "object",
                                                          "properties": {"command": {"type": "string"}}}}}]
SYSTEM = {"role": "system", "content": "You are a careful coding agent."}
TASK = {"role": "user", "content": "List the files, then say done."}
CALL_LS = '<tool_call>\n{"name": "bash", "arguments": {"command": "ls -la", "note": "caf\u00e9 \u2713"}}\n</tool_call>'
CALL_CAT = '<tool_call>\n{"name": "bash", "arguments": {"command": "cat a.txt"}}\n</tool_call>'


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


@pytest.fixture
async def bus(nats_server, run_id):
    b = await Bus.connect(nats_server.url, token=nats_server.token, run=run_id, name="test",
                          config=BusConfig(connect_timeout_s=5.0, drain_timeout_s=5.0))
    await b.ensure_streams()
    yield b
    await b.close()


class Stack:
    """Scripted engine(s) + proxy on 127.0.0.1 + helpers to read call.completed."""

    def __init__(self, tok, bus, run_id):
        self.tok, self.bus, self.run_id = tok, bus, run_id
        self.engines: list[ScriptedEngine] = []
        self.clients: list[openai.AsyncOpenAI] = []
        self.runner = self.session = self.state = None
        self.url = ""

    async def engine(self, texts=None, callback=None, **kw) -> ScriptedEngine:
        engine = ScriptedEngine(self.tok, texts, callback, **kw)
        await engine.start()
        self.engines.append(engine)
        return engine

    async def proxy(self, *, engine: ScriptedEngine | None = None, **overrides) -> str:
        overrides.setdefault("shutdown_grace_s", 2.0)
        overrides.setdefault("retry_backoff_s", 0.02)
        overrides.setdefault("retry_backoff_max_s", max(0.1, overrides["retry_backoff_s"]))
        cfg = Config(run=self.run_id, key_secret=SECRET, engine_url=engine.url if engine else "", **overrides)
        self.session = make_session()
        self.state = ProxyState(cfg, self.tok, self.session, self.bus)
        self.runner, self.url = await start(self.state)
        return self.url

    def client(self, execution: str, **kw) -> openai.AsyncOpenAI:
        client = openai.AsyncOpenAI(base_url=self.url + "/v1", api_key=execution_key(SECRET, execution),
                                    max_retries=0, **kw)
        self.clients.append(client)
        return client

    def anthropic(self, execution: str, **kw) -> anthropic.AsyncAnthropic:
        client = anthropic.AsyncAnthropic(base_url=self.url, api_key=execution_key(SECRET, execution),
                                          max_retries=0, **kw)
        self.clients.append(client)
        return client

    def store(self, execution: str):
        """The execution's TITO call store in the running proxy."""
        return self.state.executions[execution].store

    async def calls(self, n: int, timeout_s: float = 15.0) -> list[schemas.CallCompleted]:
        """The next n call.completed events through the builder's durable consumer."""
        got: list[schemas.CallCompleted] = []
        stop = asyncio.Event()

        async def handler(event):
            got.append(event)
            if len(got) >= n:
                stop.set()

        task = asyncio.create_task(self.bus.consume("builder-calls-v1", handler, stop=stop, poll_s=0.2))
        try:
            await asyncio.wait_for(stop.wait(), timeout_s)
        finally:
            stop.set()
            await asyncio.wait_for(task, 10)
        return sorted(got, key=lambda e: (e.execution, e.seq))

    async def close(self):
        for c in self.clients:
            await c.close()
        if self.state is not None:
            await self.state.drain(5)
            self.state.close()
        if self.runner is not None:
            await self.runner.cleanup()
        if self.session is not None:
            await self.session.close()
        for e in self.engines:
            await e.stop()


@pytest.fixture
async def stack(tok, bus, run_id):
    s = Stack(tok, bus, run_id)
    yield s
    await s.close()


def encode(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def full(event):
    return list(event.tokens.prompt_ids) + list(event.tokens.completion_ids)


async def test_multi_turn_tool_calls_stream_and_not_extend_verbatim(stack, tok):
    engine = await stack.engine([CALL_LS, CALL_CAT, "All done."])
    await stack.proxy(engine=engine)
    client = stack.client("ex1")

    # Turn 1, not streamed: a tool call.
    r1 = await client.chat.completions.create(model="policy", messages=[SYSTEM, TASK], tools=TOOLS)
    choice = r1.choices[0]
    assert choice.finish_reason == "tool_calls"
    (tc1,) = choice.message.tool_calls
    assert tc1.function.name == "bash"
    assert json.loads(tc1.function.arguments) == {"command": "ls -la", "note": "café ✓"}
    assert r1.usage.completion_tokens == len(encode(tok, CALL_LS)) + 1

    # Turn 2, streamed: the harness re-serialises turn 1's arguments (no spaces, sorted
    # keys, \\u escapes) and sends the system prompt as text parts with a cache marker.
    args = json.dumps(json.loads(tc1.function.arguments), separators=(",", ":"), sort_keys=True, ensure_ascii=True)
    assert args != tc1.function.arguments and "\\u00e9" in args
    echoed = {"role": "assistant", "content": None,
              "tool_calls": [{"id": tc1.id, "type": "function", "function": {"name": "bash", "arguments": args}}]}
    system_parts = {"role": "system", "content": [{"type": "text", "text": SYSTEM["content"],
                                                   "cache_control": {"type": "ephemeral"}}]}
    turn2 = [system_parts, TASK, echoed, {"role": "tool", "tool_call_id": tc1.id, "content": "a.txt\nb.txt"}]
    stream = await client.chat.completions.create(model="policy", messages=turn2, tools=TOOLS, stream=True,
                                                  temperature=0.7, extra_body={"top_k": 20})
    chunks = [c async for c in stream]
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["tool_calls"]
    assert chunks[0].choices[0].delta.role == "assistant"
    deltas = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].id and deltas[0].function.name == "bash"
    assert json.loads("".join(d.function.arguments or "" for d in deltas)) == {"command": "cat a.txt"}
    tc2_id = deltas[0].id

    # Turn 3, streamed with usage: plain text.
    turn3 = [*turn2, {"role": "assistant", "tool_calls": [{"id": tc2_id, "type": "function", "function": {
        "name": "bash", "arguments": '{"command":"cat a.txt"}'}}]},
        {"role": "tool", "tool_call_id": tc2_id, "content": "hello"}]
    stream = await client.chat.completions.create(model="policy", messages=turn3, tools=TOOLS, stream=True,
                                                  stream_options={"include_usage": True})
    chunks = [c async for c in stream]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "All done."
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(encode(tok, "All done.")) + 1

    e0, e1, e2 = await stack.calls(3)
    sent = [r["input_ids"] for r in engine.requests]
    assert [r["gyre_execution"] for r in engine.requests] == ["ex1"] * 3
    assert (e0.call, e0.seq, e0.parent_call, e0.prefix_len) == ("ex1:0", 0, None, 0)
    assert e0.event_id == ids.call(stack.run_id, "ex1", 0)
    assert list(e0.tokens.prompt_ids) == sent[0]
    assert e0.tokens.completion_ids[-1] == IM_END and e0.finish_reason == "stop" and e0.status == "ok"
    assert list(e0.tokens.completion_ids) == encode(tok, CALL_LS) + [IM_END]
    assert len(e0.tokens.logprobs) == len(e0.tokens.completion_ids) and all(lp < 0 for lp in e0.tokens.logprobs)
    assert e0.versions == ((0, len(e0.tokens.completion_ids), 0),)
    # Turn 2 extends turn 1: its prompt is turn 1's ids verbatim plus the new suffix.
    assert (e1.parent_call, e1.prefix_len, e1.drift) == ("ex1:0", len(full(e0)), 0)
    assert sent[1] == full(e0) + list(e1.tokens.prompt_ids)
    assert e1.tokens.prompt_ids[:5] == tuple(encode(tok, "\n<|im_start|>user\n<tool_response>"))
    assert (e1.sampling.temperature, e1.sampling.top_p, e1.sampling.top_k) == (0.7, 1.0, 20)
    assert engine.requests[1]["sampling_params"]["temperature"] == 0.7
    assert (e2.parent_call, e2.prefix_len, e2.drift) == ("ex1:1", len(sent[1]) + len(e1.tokens.completion_ids), 0)
    assert sent[2] == sent[1] + list(e1.tokens.completion_ids) + list(e2.tokens.prompt_ids)
    assert e0.sampling.temperature == 1.0 and e0.cell == "static" and e0.api == "chat"
    assert {"queue_s", "engine_s", "total_s"} <= set(e1.timings)


async def test_branch_length_cap_and_engine_faults(stack, tok):
    engine = await stack.engine(["The answer is forty-two, as computed."])
    # keepalive_s tiny: while retrying, the non-streamed answer starts with newlines.
    await stack.proxy(engine=engine, max_completion_tokens=50, keepalive_s=0.005)
    client = stack.client("ex2")
    r0 = await client.chat.completions.create(model="m", messages=[SYSTEM, TASK], max_tokens=4)
    assert r0.choices[0].finish_reason == "length"
    assert engine.requests[0]["sampling_params"]["max_new_tokens"] == 4
    # Over the cap: clamped. The engine is briefly unavailable, then aborts once (a cell
    # switch): the harness sees neither.
    engine.fail_next(2, 503)
    engine.abort_next(1)
    edited = [SYSTEM, {"role": "user", "content": "List the files, then stop."}]
    r1 = await client.chat.completions.create(model="m", messages=edited, max_tokens=10_000)
    assert r1.choices[0].finish_reason == "stop"
    assert r1.choices[0].message.content == "The answer is forty-two, as computed."
    assert engine.requests[-1]["sampling_params"]["max_new_tokens"] == 50
    assert len(engine.requests) == 5 and len({r["rid"] for r in engine.requests}) == 5

    e0, e1 = await stack.calls(2)
    assert e0.finish_reason == "length" and len(e0.tokens.completion_ids) == 4
    assert IM_END not in e0.tokens.completion_ids
    # Not an extension: a branch at the longest common token prefix with call 0.
    fresh = engine.requests[-1]["input_ids"]
    lcp = next(i for i, (a, b) in enumerate(zip(fresh, full(e0))) if a != b)
    assert (e1.parent_call, e1.prefix_len) == ("ex2:0", lcp)
    assert list(e1.tokens.prompt_ids) == fresh[lcp:]
    assert e1.sampling.max_tokens == 50 and e1.tokens.completion_ids[-1] == IM_END
    engine.fail_next(3, 503)
    async with aiohttp.ClientSession() as http:
        async with http.post(stack.url + "/v1/chat/completions", json={"messages": [TASK]},
                             headers={"x-api-key": execution_key(SECRET, "ex2")}) as r:
            raw = await r.read()
    assert r.status == 200 and raw.startswith(b"\n") and json.loads(raw)["object"] == "chat.completion"


async def test_errors_auth_and_plain_endpoints(stack):
    engine = await stack.engine(["ok"])
    url = await stack.proxy(engine=engine, max_calls=1)
    with pytest.raises(openai.AuthenticationError):
        async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="gyre-ex3-" + "0" * 32, max_retries=0) as bad:
            await bad.chat.completions.create(model="m", messages=[TASK])
    async with aiohttp.ClientSession() as http:
        async with http.post(url + "/v1/chat/completions", json={"messages": [TASK]}) as r:
            assert r.status == 401
            err = (await r.json())["error"]
            assert err["type"] == "authentication_error" and err["param"] is None and "message" in err
        key = execution_key(SECRET, "ex3")
        async with http.post(url + "/v1/chat/completions", data=b"{not json",
                             headers={"x-api-key": key, "Content-Type": "application/json"}) as r:
            assert r.status == 400
            assert (await r.json())["error"]["type"] == "invalid_request_error"
        async with http.post(url + "/v1/chat/completions", json={"messages": "hi"}, headers={"x-api-key": key}) as r:
            assert r.status == 400 and (await r.json())["error"]["param"] == "messages"
        async with http.get(url + "/v1/models", headers={"Authorization": f"Bearer {key}"}) as r:
            assert r.status == 200 and (await r.json())["data"][0]["id"] == "gyre"
        async with http.head(url + "/") as r:
            assert r.status == 200
        async with http.get(url + "/health") as r:
            assert r.status == 200 and (await r.json())["run"] == stack.run_id
        async with http.get(url + "/v1/nope", headers={"x-api-key": key}) as r:
            assert r.status == 404 and "error" in await r.json()
    client = stack.client("ex3")
    await client.chat.completions.create(model="m", messages=[TASK])
    with pytest.raises(openai.BadRequestError) as info:
        await client.chat.completions.create(model="m", messages=[TASK])
    assert info.value.code == "max_calls_exceeded"
    (e0,) = await stack.calls(1)
    assert e0.execution == "ex3" and e0.status == "ok"


async def test_routes_from_cell_events_wait_and_stick(stack, bus, run_id):
    a = await stack.engine(["from a"])
    b = await stack.engine(["from b"])
    await stack.proxy(keepalive_s=0.05)  # no static engine: wait for cells
    stop = asyncio.Event()
    replay = asyncio.create_task(bus.replay(["cell.switched", "route.updated"], stack.state.handle_event,
                                            stop=stop, poll_s=0.2))
    try:
        client = stack.client("ex4")
        stream = await client.chat.completions.create(model="m", messages=[TASK], stream=True)

        async def read_all():
            return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

        waiting = asyncio.create_task(read_all())
        await asyncio.sleep(0.3)
        assert not waiting.done()  # no rollout cell yet: the harness waits (keep-alives)
        await bus.publish(CellSwitched(event_id=ids.switched(run_id, "c0", 0), cell="c0", seq=0,
                                       from_role="training", to_role="rollout", durations={}, engine_url=a.url))
        assert await asyncio.wait_for(waiting, 10) == "from a"
        await bus.publish(CellSwitched(event_id=ids.switched(run_id, "c1", 0), cell="c1", seq=0,
                                       from_role="training", to_role="rollout", durations={}, engine_url=b.url))
        for _ in range(50):
            if "c1" in stack.state.router.cells:
                break
            await asyncio.sleep(0.05)
        r = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "again"}])
        assert r.choices[0].message.content == "from a"  # sticky
        other = await stack.client("ex5").chat.completions.create(model="m", messages=[TASK])
        assert other.choices[0].message.content == "from b"  # least loaded
        await bus.publish(RouteUpdated(event_id=ids.route(run_id, 0), seq=0,
                                       routes=(Route(execution="ex4", cell="c1", reason="switch"),)))
        for _ in range(50):
            if stack.state.router.routes.get("ex4") == "c1":
                break
            await asyncio.sleep(0.05)
        r = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "moved"}])
        assert r.choices[0].message.content == "from b"
        events = await stack.calls(4)
        assert [(e.execution, e.cell) for e in events] == [("ex4", "c0"), ("ex4", "c0"), ("ex4", "c1"), ("ex5", "c1")]
    finally:
        stop.set()
        await asyncio.wait_for(replay, 10)


async def test_client_gone_aborts_upstream_and_records_aborted(stack, run_id):
    engine = await stack.engine(["slow answer"], delay_s=30.0)
    url = await stack.proxy(engine=engine)
    key = execution_key(SECRET, "ex6")
    async with aiohttp.ClientSession() as http:
        req = asyncio.create_task(http.post(url + "/v1/chat/completions", json={"messages": [TASK]},
                                            headers={"x-api-key": key}))
        for _ in range(200):
            if engine.requests:
                break
            await asyncio.sleep(0.02)
        req.cancel()
        await asyncio.gather(req, return_exceptions=True)
    (e0,) = await stack.calls(1)
    assert e0.status == "aborted" and e0.finish_reason == "abort" and e0.tokens.completion_ids == ()
    assert engine.requests[0]["rid"] in engine.aborted


async def test_large_call_tokens_go_to_the_object_store(stack, bus):
    engine = await stack.engine(["short"])
    await stack.proxy(engine=engine, object_threshold_bytes=2000)
    long_task = {"role": "user", "content": "word " * 2000}
    await stack.client("ex7").chat.completions.create(model="m", messages=[long_task])
    (e0,) = await stack.calls(1)
    assert e0.tokens_ref == "calls/ex7/0" and e0.tokens.prompt_ids == ()
    stored = orjson.loads(await bus.get_object(e0.tokens_ref))
    assert stored["prompt_ids"] == engine.requests[0]["input_ids"]
    assert stored["completion_ids"][-1] == IM_END and len(stored["logprobs"]) == len(stored["completion_ids"])


async def test_an_event_too_large_only_with_its_other_fields_moves_its_tokens_at_publish(stack, bus):
    """The tokens' JSON alone fits (about 250 bytes) but the whole event does not: moved
    when publishing, from the inline arrays."""
    engine = await stack.engine(["short"])
    await stack.proxy(engine=engine, object_threshold_bytes=400)
    await stack.client("ex8").chat.completions.create(model="m", messages=[TASK])
    (e0,) = await stack.calls(1)
    assert e0.tokens_ref == "calls/ex8/0" and e0.tokens.prompt_ids == ()
    raw = await bus.get_object(e0.tokens_ref)
    assert len(raw) < 400  # so call_event kept them inline
    stored = orjson.loads(raw)
    assert stored["prompt_ids"] == engine.requests[0]["input_ids"]
    assert stored["completion_ids"][-1] == IM_END and len(stored["logprobs"]) == len(stored["completion_ids"])


def test_a_large_call_event_writes_its_tokens_from_the_arrays(tok):
    """Tokens whose JSON exceeds the threshold are written once, from the arrays, and the
    event carries only the key (no tuples of Python ints are built)."""
    from handlers.proxy.routing import EngineResult
    from schemas.call import SamplingParams

    state = ProxyState(Config(run="r", key_secret=SECRET, object_threshold_bytes=4000), tok, session=None)
    match = CallStore(tok).match([{"role": "user", "content": "word " * 3000}])
    result = EngineResult(output_ids=[9707, IM_END], logprobs=[-0.25, -1.5e-05], finish="stop",
                          versions=((0, 2, 3),), cell="c", queue_s=0.0, engine_s=0.1)
    common = dict(execution="ex", seq=4, match=match, sampling=SamplingParams(), status="ok", total_s=0.2, cell="c")
    event, tokens_json = state.call_event(**common, result=result)
    assert event.tokens_ref == "calls/ex/4" and event.tokens == schemas.CallTokens()
    assert tokens_json == orjson.dumps({"prompt_ids": match.prompt_ids.tolist(), "completion_ids": [9707, IM_END],
                                        "logprobs": [-0.25, -1.5e-05]})
    assert schemas.decode_part(schemas.CallTokens, tokens_json).prompt_ids == tuple(match.prompt_ids.tolist())
    assert len(schemas.encode(event)) < 4000
    small = ProxyState(Config(run="r", key_secret=SECRET), tok, session=None)  # 256 KB: inline
    event, tokens_json = small.call_event(**common, result=result)
    assert tokens_json is None and event.tokens_ref is None
    assert event.tokens.prompt_ids == tuple(match.prompt_ids.tolist()) and event.tokens.logprobs == (-0.25, -1.5e-05)


async def _serving(cfg):
    """run(cfg) in a task once it serves: (stop, task, {"state", "url"})."""
    stop, up, started = asyncio.Event(), asyncio.Event(), {}
    task = asyncio.create_task(run(cfg, stop, on_started=lambda state, url: (started.update(state=state, url=url),
                                                                             up.set())))
    await asyncio.wait_for(up.wait(), 30)
    return stop, task, started


@contextlib.asynccontextmanager
async def _served(cfg):
    """run(cfg) while the block runs, from once it serves: yields {"state", "url"}; stopped
    (and awaited, ≤ 20 s) after the block."""
    stop, task, started = await _serving(cfg)
    try:
        yield started
    finally:
        stop.set()
        await asyncio.wait_for(task, 20)


async def test_run_serves_until_stopped(tmp_path, tok, nats_server, run_id, bus):
    engine = ScriptedEngine(tok, ["hi there"])
    await engine.start()
    url_file = tmp_path / "proxy.json"
    cfg = Config(run=run_id, key_secret=SECRET, nats_url=nats_server.url, nats_token=nats_server.token,
                 url_file=str(url_file), shutdown_grace_s=5.0)
    stop = asyncio.Event()
    started = {}
    task = asyncio.create_task(run(cfg, stop, on_started=lambda state, url: started.update(state=state)))
    try:
        for _ in range(300):
            if url_file.exists() or task.done():
                break
            await asyncio.sleep(0.02)
        base = orjson.loads(url_file.read_bytes())["url"]
        # The proxy learns the engine from the bus (replayed cell.switched).
        await bus.publish(CellSwitched(event_id=ids.switched(run_id, "c0", 0), cell="c0", seq=0,
                                       from_role="idle", to_role="rollout", durations={}, engine_url=engine.url))
        async with openai.AsyncOpenAI(base_url=base + "/v1", api_key=execution_key(SECRET, "ex8"),
                                      max_retries=0) as client:
            r = await client.chat.completions.create(model="m", messages=[TASK])
            assert r.choices[0].message.content == "hi there"
            # Once the execution finished, its call store is freed and its key takes no more
            # calls: a late call (a leftover process) would be trained after the score.
            info = ExecutionInfo(execution="ex8", task="t", group="s0-g0", step=0, harness="toy",
                                 group_size=1, step_groups=1)
            await bus.publish(ExecutionFinished(event_id=ids.finished(run_id, "ex8"), info=info, status="ok",
                                                workspace=""))
            for _ in range(500):
                if started["state"].executions["ex8"].store is None:
                    break
                await asyncio.sleep(0.02)
            follow_up = [TASK, {"role": "assistant", "content": "hi there"}, {"role": "user", "content": "more"}]
            with pytest.raises(openai.PermissionDeniedError) as late:
                await client.chat.completions.create(model="m", messages=follow_up)
            assert late.value.code == "execution_finished" and "has finished" in late.value.message
            assert started["state"].executions["ex8"].store is None
    finally:
        stop.set()
        await asyncio.wait_for(task, 20)
        await engine.stop()
    (e0,) = await Stack(tok, bus, run_id).calls(1)
    assert e0.cell == "c0" and e0.status == "ok"
    assert len(engine.requests) == 1


async def test_a_restarted_proxy_goes_on_after_its_predecessors_seqs(tmp_path, tok, nats_server, run_id, bus):
    """Event ids name one fact each: a proxy restarted in the same run must not publish
    `<run>:<execution>:call:0` again (JetStream drops it as a duplicate: the call is lost)."""
    engine = ScriptedEngine(tok, ["one", "two", "three", "four"])
    await engine.start()
    cfg = Config(run=run_id, key_secret=SECRET, nats_url=nats_server.url, nats_token=nats_server.token,
                 engine_url=engine.url, shutdown_grace_s=5.0)

    async def serve(calls: list[tuple[str, list[dict]]]) -> None:
        async with _served(cfg) as started:
            for execution, messages in calls:
                async with openai.AsyncOpenAI(base_url=started["url"] + "/v1",
                                              api_key=execution_key(SECRET, execution), max_retries=0) as client:
                    await client.chat.completions.create(model="m", messages=messages)

    try:
        await serve([("exA", [TASK]), ("exA", [TASK, {"role": "assistant", "content": "one"},
                                                 {"role": "user", "content": "again"}]), ("exB", [TASK])])
        await serve([("exA", [TASK]), ("exC", [TASK])])
    finally:
        await engine.stop()
    events = await Stack(tok, bus, run_id).calls(5)
    assert sorted((e.execution, e.seq) for e in events) == [("exA", 0), ("exA", 1), ("exA", 2), ("exB", 0),
                                                           ("exC", 0)]
    assert len({e.event_id for e in events}) == 5
    late = next(e for e in events if (e.execution, e.seq) == ("exA", 2))
    assert late.parent_call is None and late.call == "exA:2"


async def test_calls_the_bus_cannot_take_are_spilled_and_published_by_the_next_proxy(tmp_path, tok, run_id):
    """Nothing is lost while the bus is down: a call whose `call.completed` gets no PubAck
    within retry_timeout_s, and one still unacknowledged when the proxy shuts down, go to
    the spill file; the next proxy publishes them before it serves and numbers on after
    them."""
    from bus.server import NatsServer

    server = NatsServer.start(tmp_path / "nats")
    port = int(server.url.rsplit(":", 1)[1])
    bus = await Bus.connect(server.url, token=server.token, run=run_id, name="t",
                            config=BusConfig(reconnect_wait_s=0.1, timeout_s=0.3, publish_attempts=1))
    spill = tmp_path / "proxy-unpublished.jsonl"
    stack = Stack(tok, bus, run_id)
    try:
        await bus.ensure_streams()
        engine = await stack.engine(["one", "two", "three", "four"])
        await stack.proxy(engine=engine, spill_file=str(spill), retry_timeout_s=0.5)
        client = stack.client("exs")
        history = [SYSTEM, TASK]
        for _ in range(3):
            if len(history) == 4:  # the first call is stored; then the bus goes away
                await until(lambda: not stack.state._unsent)
                server.stop()
            r = await client.chat.completions.create(model="m", messages=history)
            history += [{"role": "assistant", "content": r.choices[0].message.content},
                        {"role": "user", "content": "go on"}]
            if len(history) == 6:  # the second call's publish gives up after retry_timeout_s
                for _ in range(200):
                    if spill.exists():
                        break
                    await asyncio.sleep(0.02)
                assert len([line for line in spill.read_bytes().splitlines() if line]) == 1
                # The third call's publish is to be still retrying at the shutdown below.
                stack.state.cfg = dataclasses.replace(stack.state.cfg, retry_timeout_s=60.0)
        # A resend that failed left its file as `.sending`; the third call, still waiting for
        # its PubAck at shutdown, starts a new spill file: the next proxy must take both.
        spill.rename(stack.state.sending_path())
        spill.write_bytes(b'{"event": {"call": "cut sh')  # a write cut short (a full disk)
        await stack.state.drain(0.2)
        assert len([line for line in spill.read_bytes().splitlines() if line]) == 2  # the new one stays apart
        server = await asyncio.to_thread(NatsServer.start, tmp_path / "nats", port=port, token=server.token)
        cfg = Config(run=run_id, key_secret=SECRET, nats_url=server.url, nats_token=server.token,
                     engine_url=engine.url, spill_file=str(spill), shutdown_grace_s=5.0)
        async with _served(cfg) as started:
            assert not spill.exists() and not stack.state.sending_path().exists()
            assert Path(f"{spill}.unreadable").read_bytes() == b'{"event": {"call": "cut sh\n'
            async with openai.AsyncOpenAI(base_url=started["url"] + "/v1", api_key=execution_key(SECRET, "exs"),
                                          max_retries=0) as again:
                await again.chat.completions.create(model="m", messages=[TASK])
        events = await stack.calls(4)
        assert [(e.seq, e.status) for e in events] == [(0, "ok"), (1, "ok"), (2, "ok"), (3, "ok")]
        assert [tok.decode(e.tokens.completion_ids[:-1]) for e in events] == ["one", "two", "three", "four"]
        assert events[2].parent_call == "exs:1" and events[3].parent_call is None
    finally:
        await stack.close()
        await bus.close()
        server.stop()


async def test_a_publish_gives_up_within_retry_timeout_s_not_after_the_bus_own_tries(tmp_path, tok, run_id):
    """The window bounds a publish already under way: with the bus down, one `Bus.publish`
    retries for `publish_bound_s` (≈ 33 s with the defaults; 6 s here), longer than the
    proxy's retry_timeout_s (1 s here), and the call is spilled when the window ends."""
    from bus.server import NatsServer

    server = NatsServer.start(tmp_path / "nats")
    config = BusConfig(reconnect_wait_s=0.1, timeout_s=0.5)
    assert config.publish_bound_s() > 5.0
    bus = await Bus.connect(server.url, token=server.token, run=run_id, name="t", config=config)
    spill = tmp_path / "proxy-unpublished.jsonl"
    stack = Stack(tok, bus, run_id)
    try:
        await bus.ensure_streams()
        engine = await stack.engine(["one"])
        await stack.proxy(engine=engine, spill_file=str(spill), retry_timeout_s=1.0)
        server.stop()
        await stack.client("exw").chat.completions.create(model="m", messages=[SYSTEM, TASK])
        t0 = time.monotonic()  # its publish starts once it is answered
        await until(lambda: spill.exists(), 15.0)
        took = time.monotonic() - t0
    finally:
        await stack.close()
        await bus.close()
        server.stop()
    assert took < 2.0, took
    assert [json.loads(line)["event"]["call"] for line in spill.read_bytes().splitlines() if line] == ["exw:0"]


class _Outage:
    """A proxy (spilling to `spill`, its spill resend running) on a bus whose nats-server
    the test stops (`server.stop()`) and brings back on the same port and store
    (`restart`); the resend tries on its own only every 120 s."""

    def __init__(self, tmp_path, tok, run_id, monkeypatch) -> None:
        monkeypatch.setattr(proxy_restart, "SPILL_RETRY_S", 120.0)  # not by the periodic retry
        self.tmp_path, self.tok, self.run_id = tmp_path, tok, run_id
        self.spill = tmp_path / "proxy-unpublished.jsonl"
        self.stop = asyncio.Event()

    async def __aenter__(self) -> "_Outage":
        from bus.server import NatsServer

        self.server = NatsServer.start(self.tmp_path / "nats")
        self.bus = await Bus.connect(self.server.url, token=self.server.token, run=self.run_id, name="t",
                                     config=BusConfig(reconnect_wait_s=0.1, timeout_s=0.3, publish_attempts=1))
        self.stack, self.resend = Stack(self.tok, self.bus, self.run_id), None
        await self.bus.ensure_streams()
        return self

    async def serve(self, script: list[str]) -> None:
        engine = await self.stack.engine(script)
        await self.stack.proxy(engine=engine, spill_file=str(self.spill), retry_timeout_s=0.5)
        self.resend = asyncio.create_task(proxy_restart.resend_spilled(self.stack.state, self.stop))

    async def restart(self) -> None:
        from bus.server import NatsServer

        port = int(self.server.url.rsplit(":", 1)[1])
        self.server = await asyncio.to_thread(NatsServer.start, self.tmp_path / "nats", port=port,
                                              token=self.server.token)

    async def sent(self) -> None:
        """Until the spill files are gone (published)."""
        await until(lambda: not self.spill.exists() and not self.stack.state.sending_path().exists(), 10)

    async def __aexit__(self, *exc) -> None:
        self.stop.set()
        if self.resend is not None:
            await asyncio.wait_for(self.resend, 5)
        await self.stack.close()
        await self.bus.close()
        self.server.stop()


async def test_spilled_calls_go_out_once_the_bus_is_back_without_a_restart(tmp_path, tok, run_id, monkeypatch):
    """A serving proxy publishes what it spilled as soon as JetStream takes events again (its
    next acknowledged publish): a bus outage longer than retry_timeout_s delays calls, and
    their children are not left waiting for a parent until the proxy restarts."""
    async with _Outage(tmp_path, tok, run_id, monkeypatch) as o:
        await o.serve(["one", "two"])
        o.server.stop()
        client = o.stack.client("exr")
        r = await client.chat.completions.create(model="m", messages=[SYSTEM, TASK])
        await until(o.spill.exists, 4)
        # Call 1's publish waits for the bus to be back (not spilled too: it is what sends call 0).
        o.stack.state.cfg = dataclasses.replace(o.stack.state.cfg, retry_timeout_s=60.0)
        await o.restart()
        await client.chat.completions.create(model="m", messages=[SYSTEM, TASK, {"role": "assistant", "content":
                                                                                  r.choices[0].message.content},
                                                                  {"role": "user", "content": "go on"}])
        events = await o.stack.calls(2, timeout_s=20)
        assert [(e.seq, e.parent_call) for e in events] == [(0, None), (1, "exr:0")]
        await o.sent()  # (the bus client may deliver its own buffered copy of call 0 first)


async def test_spilled_calls_go_out_when_the_bus_reconnects_with_no_call_after_the_outage(tmp_path, tok, run_id,
                                                                                           monkeypatch):
    """The outage ends and no harness calls again (they all wait on an answer already given):
    the reconnect itself sends the spilled call, not the next periodic try (here 120 s away,
    up to SPILL_RETRY_MAX_S once the tries failed), so it lands before its execution's score."""
    async with _Outage(tmp_path, tok, run_id, monkeypatch) as o:
        await o.serve(["one"])
        o.server.stop()
        await o.stack.client("exq").chat.completions.create(model="m", messages=[SYSTEM, TASK])
        await until(o.spill.exists, 4)
        await o.restart()
        events = await o.stack.calls(1, timeout_s=20)
        assert [(e.seq, e.status) for e in events] == [(0, "ok")]
        await o.sent()


async def test_a_spilled_call_stored_already_is_not_published_again(tmp_path, tok):
    """A spilled call whose PubAck alone was lost is stored: the next proxy, which reads the
    stored ids before it republishes, leaves it out (JetStream would store it twice after
    its duplicate window) and numbers on after every one."""
    def event(seq):
        return schemas.CallCompleted(event_id=f"r:exs:call:{seq}", call=f"exs:{seq}", execution="exs", seq=seq,
                                     parent_call=None, prefix_len=0, tokens=schemas.CallTokens(),
                                     sampling=schemas.SamplingParams(), finish_reason="stop", versions=(), cell="c",
                                     role="main", api="chat", status="ok", timings={}, drift=0, meta={})

    class StoredBus:
        async def stored_ids(self, name, stop=None):
            return {"r:exs:call:0": {"Nats-Msg-Id": "r:exs:call:0"}}

    spill = tmp_path / "proxy-unpublished.jsonl"
    state = ProxyState(Config(run="r", key_secret=SECRET, spill_file=str(spill)), tok, session=None, bus=StoredBus())
    state.spill([proxy_outbox.Outgoing(event(0)), proxy_outbox.Outgoing(event(1))], "test")
    sent = []

    async def publish(out, may_have_landed=False, stop=None):
        sent.append(out.event.event_id)
        return True

    state._publish = publish
    assert await proxy_restart.resume(state, state.bus, asyncio.Event())
    assert sent == ["r:exs:call:1"] and not spill.exists()
    assert state.executions["exs"].next_seq == 2


async def test_a_starting_proxy_stops_while_the_bus_will_not_take_its_spilled_calls(tmp_path, tok, nats_server,
                                                                                   run_id, monkeypatch):
    """Publishing what an earlier proxy spilled may wait minutes on a bus that is down: a
    stop meanwhile ends the start at once, and the spilled calls stay, whole, for the next
    one (in the file the resend moved them to)."""
    spill = tmp_path / "proxy-unpublished.jsonl"
    cfg = Config(run=run_id, key_secret=SECRET, nats_url=nats_server.url, nats_token=nats_server.token,
                 spill_file=str(spill))
    event = schemas.CallCompleted(event_id=ids.call(run_id, "exs", 0), call="exs:0", execution="exs", seq=0,
                                  parent_call=None, prefix_len=0, tokens=schemas.CallTokens(),
                                  sampling=schemas.SamplingParams(), finish_reason="stop", versions=(), cell="c",
                                  role="main", api="chat", status="ok", timings={}, drift=0, meta={})
    ProxyState(cfg, tok, session=None).spill([proxy_outbox.Outgoing(event)], "test")
    written = spill.read_bytes()
    hung = asyncio.Event()

    async def hanging(self, *args, **kwargs):  # a publish to a bus that does not answer
        hung.set()
        await asyncio.sleep(3600)

    monkeypatch.setattr(ProxyState, "_publish", hanging)
    stop = asyncio.Event()
    task = asyncio.create_task(run(cfg, stop))
    await asyncio.wait_for(hung.wait(), 30)
    stop.set()
    await asyncio.wait_for(task, 5)
    kept = [p for p in (spill, Path(f"{spill}.sending")) if p.exists()]
    assert [p.read_bytes() for p in kept] == [written]


async def test_a_second_proxy_is_refused_while_the_first_still_runs_after_it_stopped_listening(tmp_path, run_id):
    """The run lock beside proxy.json is held for the proxy's whole life, its drain and
    spill included (when `/health` no longer answers): a second proxy is refused with the
    holder's pid, and starts once the holder has let go."""
    from handlers.daemon import FatalError

    url_file = tmp_path / "proxy.json"
    held = proxy_restart.run_lock(url_file.with_suffix(".lock"), run_id)
    cfg = Config(run=run_id, key_secret=SECRET, url_file=str(url_file), shutdown_grace_s=1.0)
    with pytest.raises(FatalError, match=f"still runs \\(pid {os.getpid()}"):
        await asyncio.wait_for(run(cfg, asyncio.Event()), 30)
    held.close()
    stop, up = asyncio.Event(), asyncio.Event()
    task = asyncio.create_task(run(cfg, stop, on_started=lambda state, url: up.set()))
    await asyncio.wait_for(up.wait(), 30)
    stop.set()
    await asyncio.wait_for(task, 10)


async def test_a_restarted_proxy_refuses_a_finished_execution_from_its_first_call(tok, nats_server, run_id, bus):
    """The proxy serves only once its replay of the run's events has caught up: a restarted
    proxy must not record a call of an execution that finished before it started."""
    engine = ScriptedEngine(tok, ["one"])
    await engine.start()
    info = ExecutionInfo(execution="exF", task="t", group="s0-g0", step=0, harness="toy", group_size=1,
                         step_groups=1)
    for n in range(1000):  # a run's history before it: the replay takes a while
        other = dataclasses.replace(info, execution=f"other{n}")
        await bus.publish(ExecutionFinished(event_id=ids.finished(run_id, other.execution), info=other, status="ok",
                                            workspace=""))
    await bus.publish(ExecutionFinished(event_id=ids.finished(run_id, "exF"), info=info, status="ok", workspace=""))
    cfg = Config(run=run_id, key_secret=SECRET, nats_url=nats_server.url, nats_token=nats_server.token,
                 engine_url=engine.url, shutdown_grace_s=5.0)
    try:
        async with _served(cfg) as started:
            async with openai.AsyncOpenAI(base_url=started["url"] + "/v1", api_key=execution_key(SECRET, "exF"),
                                          max_retries=0) as client:
                with pytest.raises(openai.PermissionDeniedError):
                    await client.chat.completions.create(model="m", messages=[TASK])
    finally:
        await engine.stop()
    assert engine.requests == []


async def test_max_calls_holds_across_a_proxy_restart(tmp_path, tok, nats_server, run_id, bus):
    """A restarted proxy must not give a runaway execution a fresh `max_calls` allowance,
    nor count an execution's token counts (stored calls too) against it."""
    engine = ScriptedEngine(tok, ["one", "two", "three", "four", "five"])
    await engine.start()
    cfg = Config(run=run_id, key_secret=SECRET, nats_url=nats_server.url, nats_token=nats_server.token,
                 engine_url=engine.url, shutdown_grace_s=5.0, max_calls=2)

    async def serve(calls: list[str]) -> list[str]:
        out = []
        async with _served(cfg) as started:
            for execution in calls:
                key = execution_key(SECRET, execution.removesuffix("/count"))
                if execution.endswith("/count"):
                    async with anthropic.AsyncAnthropic(base_url=started["url"], api_key=key, max_retries=0) as ac:
                        await ac.messages.count_tokens(model="m", messages=[TASK])
                        out.append("counted")
                    continue
                async with openai.AsyncOpenAI(base_url=started["url"] + "/v1", api_key=key, max_retries=0) as client:
                    try:
                        await client.chat.completions.create(model="m", messages=[TASK])
                        out.append("ok")
                    except openai.BadRequestError as exc:
                        out.append(exc.body["code"] if isinstance(exc.body, dict) else str(exc.body))
        return out

    try:
        assert await serve(["exA", "exA", "exC/count", "exC", "exC/count"]) == ["ok", "ok", "counted", "ok", "counted"]
        assert await serve(["exA", "exB", "exC", "exC"]) == ["max_calls_exceeded", "ok", "ok", "max_calls_exceeded"]
    finally:
        await engine.stop()


async def _stored_calls(bus, run_id: str, n: int) -> None:
    sem = asyncio.Semaphore(256)

    async def one(k: int) -> None:
        async with sem:
            await bus.publish_raw(f"gyre.v1.{run_id}.call.completed", b"{}",
                                  {"Nats-Msg-Id": ids.call(run_id, f"ex{k % 50}", k // 50)})

    await asyncio.gather(*(one(k) for k in range(n)))


@pytest.mark.parametrize("how", ["stop", "cancel"])
async def test_a_proxy_stopped_while_reading_stored_ids_never_serves(tmp_path, tok, nats_server, run_id, bus,
                                                                      monkeypatch, how):
    """A stop (or the task's cancellation) while the stored ids are read ends the read at its
    next batch: the proxy never binds, writes no url file, and closes its bus."""
    from bus import Bus

    await _stored_calls(bus, run_id, 20000)
    real_ids, reading, returned = Bus.stored_ids, asyncio.Event(), []

    async def slow_ids(self, name, **kw):  # small batches: the read takes a while
        reading.set()
        out = await real_ids(self, name, **{**kw, "batch": 256})
        returned.append(out)
        return out

    monkeypatch.setattr(Bus, "stored_ids", slow_ids)
    closed = []
    real_close = Bus.close
    monkeypatch.setattr(Bus, "close", lambda self, **kw: (closed.append(1), real_close(self, **kw))[1])
    url_file = tmp_path / "proxy.json"
    cfg = Config(run=run_id, key_secret=SECRET, nats_url=nats_server.url, nats_token=nats_server.token,
                 url_file=str(url_file), shutdown_grace_s=5.0)
    stop = asyncio.Event()
    started = []
    task = asyncio.create_task(run(cfg, stop, on_started=lambda state, url: started.append(url)))
    await asyncio.wait_for(reading.wait(), 30)
    await asyncio.sleep(0.05)
    t0 = asyncio.get_running_loop().time()
    if how == "stop":
        stop.set()
        await asyncio.wait_for(task, 10)
        assert returned == [None]
    else:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, 10)
    assert asyncio.get_running_loop().time() - t0 < 0.5  # not the rest of the read (750 batches)
    assert started == [] and not url_file.exists() and closed == [1]


async def test_a_proxy_that_cannot_read_stored_ids_closes_its_bus_and_raises(tok, nats_server, run_id, monkeypatch):
    from bus import Bus

    async def failing_ids(self, name, **kw):
        raise RuntimeError("nats: timeout")

    monkeypatch.setattr(Bus, "stored_ids", failing_ids)
    closed = []
    real_close = Bus.close
    monkeypatch.setattr(Bus, "close", lambda self, **kw: (closed.append(1), real_close(self, **kw))[1])
    cfg = Config(run=run_id, key_secret=SECRET, nats_url=nats_server.url, nats_token=nats_server.token)
    with pytest.raises(RuntimeError, match="nats: timeout"):
        await asyncio.wait_for(run(cfg, asyncio.Event()), 30)
    assert closed == [1]


@pytest.mark.parametrize("put_fails", [False, True])
async def test_a_call_whose_id_another_proxy_used_is_logged_as_lost(stack, bus, run_id, monkeypatch, put_fails):
    """Two proxies in one run (a replacement started before the old one exited): JetStream
    drops the second `call:0` as a duplicate; the proxy says so at error level, also when
    its first try failed before publishing (storing the tokens)."""
    from bus import Bus

    if put_fails:
        real_put, puts = Bus.put_object, []

        async def flaky_put(self, key, data):
            puts.append(key)
            if len(puts) == 1:
                raise TimeoutError("nats: timeout")
            return await real_put(self, key, data)

        monkeypatch.setattr(Bus, "put_object", flaky_put)
    engine = await stack.engine(["first"])
    await stack.proxy(engine=engine, retry_backoff_s=0.01, **({"object_threshold_bytes": 400} if put_fails else {}))
    other = schemas.CallCompleted(event_id=ids.call(run_id, "exD", 0), call="exD:0", execution="exD", seq=0,
                                  parent_call=None, prefix_len=0, tokens=schemas.CallTokens(),
                                  sampling=schemas.SamplingParams(), finish_reason="stop", versions=(), cell="c",
                                  role="main", api="chat", status="ok", timings={}, drift=0, meta={})
    await bus.publish(other)
    with structlog.testing.capture_logs() as logs:
        await stack.client("exD").chat.completions.create(model="m", messages=[TASK])
        for _ in range(300):
            if any(e["event"] == "proxy.call.duplicate_id" for e in logs):
                break
            await asyncio.sleep(0.02)
    (lost,) = [e for e in logs if e["event"] == "proxy.call.duplicate_id"]
    assert lost["event_id"] == ids.call(run_id, "exD", 0) and lost["log_level"] == "error"
    assert [e["event"] for e in logs if e["event"] == "proxy.call.publish_retry"] == (
        ["proxy.call.publish_retry"] if put_fails else [])


async def test_a_proxy_that_cannot_bind_leaves_the_processes_gc_as_it_was(tok, run_id):
    """GC tuning is undone only where it was done (an embedding process keeps its own)."""
    import gc
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        gc.freeze()
        frozen, thresholds = gc.get_freeze_count(), gc.get_threshold()
        try:
            cfg = Config(run=run_id, key_secret=SECRET, port=taken.getsockname()[1])
            with pytest.raises(OSError):
                await run(cfg, asyncio.Event())
            assert gc.get_freeze_count() > frozen // 2 > 0 and gc.get_threshold() == thresholds  # not unfrozen
        finally:
            gc.unfreeze()


async def test_a_second_proxy_of_a_run_refuses_to_start_while_the_first_serves(tmp_path, tok, run_id):
    """One proxy per run: a second one given the run's url file while the first answers
    there exits with a clear error and leaves the file (the runner's harnesses read it)
    alone; once the first has exited (the file is stale) it starts."""
    from handlers.daemon import FatalError

    url_file = tmp_path / "proxy.json"
    cfg = Config(run=run_id, key_secret=SECRET, url_file=str(url_file), shutdown_grace_s=1.0)
    stop_first, first_up = asyncio.Event(), asyncio.Event()
    first = asyncio.create_task(run(cfg, stop_first, on_started=lambda state, url: first_up.set()))
    await asyncio.wait_for(first_up.wait(), 30)
    written = url_file.read_bytes()
    with pytest.raises(FatalError, match="already serves at .* one proxy per run"):
        await asyncio.wait_for(run(cfg, asyncio.Event()), 30)
    assert url_file.read_bytes() == written
    # Another run's proxy at that URL (its port reused): not this run's, so no refusal.
    other_file = tmp_path / "other.json"
    other_file.write_bytes(written)
    other_cfg = Config(run=run_id + "x", key_secret=SECRET, url_file=str(other_file), shutdown_grace_s=1.0)
    stop_other, other_up = asyncio.Event(), asyncio.Event()
    other = asyncio.create_task(run(other_cfg, stop_other, on_started=lambda state, url: other_up.set()))
    await asyncio.wait_for(other_up.wait(), 30)
    stop_other.set()
    await asyncio.wait_for(other, 10)
    stop_first.set()
    await asyncio.wait_for(first, 10)
    # Restarted, the run's proxy takes its predecessor's port again: harnesses started
    # before the restart reach it when they retry.
    stop_second, second_up = asyncio.Event(), asyncio.Event()
    second = asyncio.create_task(run(cfg, stop_second, on_started=lambda state, url: second_up.set()))
    await asyncio.wait_for(second_up.wait(), 30)
    assert url_file.read_bytes() == written
    url = orjson.loads(written)["url"]
    async with aiohttp.ClientSession() as session, session.get(url + "/health") as resp:
        assert (await resp.json())["run"] == run_id
    stop_second.set()
    await asyncio.wait_for(second, 10)
    # When something else listens on that port by then, a free one is taken and written.
    squatter = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", int(url.rsplit(":", 1)[1]))
    try:
        stop_third, third_up = asyncio.Event(), asyncio.Event()
        third = asyncio.create_task(run(cfg, stop_third, on_started=lambda state, url: third_up.set()))
        await asyncio.wait_for(third_up.wait(), 30)
        moved = orjson.loads(url_file.read_bytes())["url"]
        assert moved != url
        async with aiohttp.ClientSession() as session, session.get(moved + "/health") as resp:
            assert (await resp.json())["run"] == run_id
        stop_third.set()
        await asyncio.wait_for(third, 10)
    finally:
        squatter.close()


async def test_a_proxy_started_before_its_run_directory_exists_makes_it(tmp_path, tok, run_id):
    """A deployment may start the proxy before the runner has made the run's directory."""
    url_file = tmp_path / "runs" / run_id / "proxy.json"
    cfg = Config(run=run_id, key_secret=SECRET, url_file=str(url_file), shutdown_grace_s=1.0,
                 spill_file=str(url_file.with_name("proxy-unpublished.jsonl")))
    stop, up = asyncio.Event(), asyncio.Event()
    task = asyncio.create_task(run(cfg, stop, on_started=lambda state, url: up.set()))
    await asyncio.wait_for(up.wait(), 30)
    assert orjson.loads(url_file.read_bytes())["url"].startswith("http://127.0.0.1:")
    assert url_file.with_suffix(".lock").exists()
    stop.set()
    await asyncio.wait_for(task, 10)


def test_load_script(tmp_path):
    path = tmp_path / "script.jsonl"
    path.write_text('"plain"\n{"text": "<tool_call>\\n{}\\n</tool_call>"}\n\n')
    assert load_script(path) == ["plain", "<tool_call>\n{}\n</tool_call>"]


async def _exchange(url: str, requests: list[tuple[str, dict]], key: str, version: str) -> list[tuple[str, bytes]]:
    """Send `requests` one after another on one raw connection; each answer's status line
    and headers (lower-cased) and its body, framed by chunks, a length, or the close."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    out = []
    try:
        for path, body in requests:
            data = json.dumps(body).encode()
            writer.write(f"POST {path} {version}\r\nHost: x\r\nContent-Type: application/json\r\nx-api-key: {key}\r\n"
                         f"Connection: keep-alive\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data)
            head = (await reader.readuntil(b"\r\n\r\n")).decode().lower()
            payload = b""
            if "transfer-encoding: chunked" in head:
                while size := int(await reader.readuntil(b"\r\n"), 16):
                    payload += (await reader.readexactly(size + 2))[:-2]
                assert await reader.readexactly(2) == b"\r\n"
            elif "content-length:" in head:
                payload = await reader.readexactly(int(head.split("content-length:")[1].split("\r\n")[0]))
            else:
                payload = await reader.read()  # to the close: the only end a body without length has
            out.append((head, payload))
    finally:
        writer.close()
    return out


def _complete(path: str, stream: bool, payload: bytes) -> bool:
    text = payload.decode()
    if not stream:
        return isinstance(json.loads(text), dict)  # keep-alive newlines before it are JSON whitespace
    last = text.rstrip("\n").split("\n\n")[-1]
    return {"/v1/chat/completions": last == "data: [DONE]", "/v1/responses": "response.completed" in last,
            "/v1/messages": "message_stop" in last}[path]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("delay_s,keepalive_s", [(0.0, 30.0), (0.25, 0.05)], ids=["answered", "keep-alives first"])
async def test_answers_end_where_their_framing_says(stack, stream, delay_s, keepalive_s):
    """Every API's answer, streamed or not, with or without keep-alives sent first, ends
    exactly where its chunks or length say, so the next request on the same HTTP/1.1
    connection is served; over HTTP/1.0 (no chunking) the connection closes after it."""
    engine = await stack.engine([CALL_LS], delay_s=delay_s)
    url = await stack.proxy(engine=engine, keepalive_s=keepalive_s)
    key = execution_key(SECRET, "exframe")
    msgs = [{"role": "user", "content": "hi"}]
    requests = [("/v1/chat/completions", {"model": "m", "messages": msgs, "stream": stream}),
                ("/v1/responses", {"model": "m", "input": "hi", "stream": stream}),
                ("/v1/messages", {"model": "c", "max_tokens": 50, "messages": msgs, "stream": stream}),
                ("/v1/chat/completions", {"model": "m", "messages": msgs, "stream": stream})]
    answers = await asyncio.wait_for(_exchange(url, requests, key, "HTTP/1.1"), 30)
    assert len(answers) == len(requests)
    for (head, payload), (path, _) in zip(answers, requests):
        assert head.startswith("http/1.1 200") and _complete(path, stream, payload), (path, head, payload[-200:])
    (head, payload), = await asyncio.wait_for(_exchange(url, requests[2:3], key, "HTTP/1.0"), 10)
    assert " 200 " in head.split("\r\n")[0] and _complete("/v1/messages", stream, payload), (head, payload[-200:])


async def test_engine_gets_the_stores_prompt_ids_exactly(stack):
    """Extensions send the engine their parent's ids as JSON text kept from its call plus the
    new ids (`_Execution.prompt_json`): across two interleaved lines, a completion cut by
    length (the next prompt adds `<|im_end|>`) and a branch, every /generate carries exactly
    the prompt ids the store recorded (parent's full ids up to prefix_len + the new ones)."""
    engine = await stack.engine(["first answer", "second answer is longer than four", "third", "sub one",
                                 "sub two", "fourth", "branch"])
    await stack.proxy(engine=engine, object_threshold_bytes=1 << 30)
    client = stack.client("exw")
    main = [SYSTEM, TASK]
    sub = [{"role": "system", "content": "You are a sub-agent."}, {"role": "user", "content": "Find a.txt"}]

    async def ask(msgs, **kw):
        r = await client.chat.completions.create(model="m", messages=msgs, **kw)
        msgs.append({"role": "assistant", "content": r.choices[0].message.content})

    await ask(main)
    main.append({"role": "user", "content": "go on"})
    await ask(main, max_tokens=4)  # cut by length: no <|im_end|> sampled
    main.append({"role": "user", "content": "and then?"})
    await ask(main)
    await ask(sub)
    sub.append({"role": "user", "content": "more"})
    await ask(sub)
    main.append({"role": "user", "content": "last"})
    await ask(main)
    await ask([SYSTEM, {"role": "user", "content": "an edited task"}])  # a branch
    events = await stack.calls(7)
    full_ids, extends = {}, []
    for e, request in zip(events, engine.requests):
        parent = full_ids[e.parent_call][: e.prefix_len] if e.parent_call else []
        extends.append(bool(e.parent_call) and e.prefix_len == len(full_ids[e.parent_call]))
        prompt = parent + list(e.tokens.prompt_ids)
        assert request["input_ids"] == prompt, e.call
        full_ids[e.call] = prompt + list(e.tokens.completion_ids)
    assert [e.finish_reason for e in events][1] == "length" and events[2].tokens.prompt_ids[0] == IM_END
    # The sub-agent's first call and the edited task are branches (a shared token prefix).
    assert extends == [False, True, True, False, True, True, False]
    # The cache keeps each line's tip only: main's, the sub-agent's and the branch's.
    assert set(stack.state.executions["exw"].wire) == {"exw:4", "exw:5", "exw:6"}


async def test_a_call_in_flight_when_its_execution_finishes_is_refused_and_not_trained(stack, run_id):
    """A call still generating when `execution.finished` arrives (a leftover process) gets
    the finished execution's 403 and is recorded as an `error` call (its answer would land
    after the score); the execution's prompt JSON, freed, is not put back."""
    engine = await stack.engine(["one"])
    engine.gate = asyncio.Event()
    await stack.proxy(engine=engine)
    client = stack.client("exl")
    inflight = asyncio.ensure_future(client.chat.completions.create(model="m", messages=[SYSTEM, TASK]))
    await until(lambda: engine.requests)  # generating
    info = ExecutionInfo(execution="exl", task="t", group="s0-g0", step=0, harness="toy", group_size=1,
                         step_groups=1)
    await stack.state.handle_event(ExecutionFinished(event_id=ids.finished(run_id, "exl"), info=info, status="ok",
                                                     workspace=""))
    engine.gate.set()
    with pytest.raises(openai.PermissionDeniedError) as refused:
        await inflight
    assert refused.value.code == "execution_finished"
    ex = stack.state.executions["exl"]
    assert ex.store is None and ex.wire == {}
    (event,) = await stack.calls(1)
    assert (event.call, event.status) == ("exl:0", "error")


async def test_a_finished_executions_key_takes_no_more_calls_in_either_api(stack, run_id):
    """After `execution.finished` the execution has been (or is being) scored: a call with its
    key is a 403 in the caller's shape, for messages and count_tokens alike, and reaches no
    engine; another execution is served as before."""
    engine = await stack.engine(["one", "two"])
    await stack.proxy(engine=engine)
    info = ExecutionInfo(execution="exf", task="t", group="s0-g0", step=0, harness="toy", group_size=1,
                         step_groups=1)
    await stack.state.handle_event(ExecutionFinished(event_id=ids.finished(run_id, "exf"), info=info, status="ok",
                                                     workspace=""))
    late = stack.anthropic("exf")
    with pytest.raises(anthropic.PermissionDeniedError) as refused:
        await late.messages.create(model="m", max_tokens=50, messages=[TASK])
    assert refused.value.body["error"]["type"] == "permission_error"
    assert "has finished" in refused.value.body["error"]["message"]
    with pytest.raises(anthropic.PermissionDeniedError):
        await late.messages.count_tokens(model="m", messages=[TASK])
    assert engine.requests == [] and stack.state.executions["exf"].store is None
    r = await stack.anthropic("exg").messages.create(model="m", max_tokens=50, messages=[TASK])
    assert r.content[0].text == "one"
    (event,) = await stack.calls(1)
    assert event.execution == "exg"


async def test_a_heavy_branch_is_rendered_and_encoded_off_the_event_loop(stack, tok, monkeypatch):
    """A request that extends no call and holds more than `HEAVY_CHARS` characters (a long
    conversation re-sent with an earlier message changed) is rendered and encoded in a worker
    thread: another execution's call is answered while that runs, and the branch's prompt,
    parent and prefix are what the loop would have computed."""
    monkeypatch.setattr(gyre.serving.tito, "HEAVY_CHARS", 2_000)
    engine = await stack.engine(["first", "other", "branch", "extended"])
    await stack.proxy(engine=engine)
    client = stack.client("exh")
    loop_thread, work = threading.get_ident(), []  # (thread, characters) of every render and encode
    real_render, real_encode = CallStore._render, CallStore.encode

    def spy_render(self, *args):
        text = real_render(self, *args)
        work.append((threading.get_ident(), len(text)))
        return text

    def spy_encode(self, text):
        work.append((threading.get_ident(), len(text)))
        return real_encode(self, text)

    monkeypatch.setattr(CallStore, "_render", spy_render)
    monkeypatch.setattr(CallStore, "encode", spy_encode)
    long_task = {"role": "user", "content": "Read this log:\n" + "line of output\n" * 200}
    r0 = await client.chat.completions.create(model="m", messages=[SYSTEM, long_task])
    edited = [SYSTEM, {"role": "user", "content": long_task["content"] + "and say what failed."}]

    entered, other_answered = asyncio.Event(), threading.Event()
    calls = []
    real = CallStore.prepare
    loop = asyncio.get_running_loop()

    def prepare(self, pending):
        calls.append((threading.get_ident(), pending.heavy))
        loop.call_soon_threadsafe(entered.set)
        other_answered.wait(10)  # on the loop's thread this would hold the other call back
        return real(self, pending)

    monkeypatch.setattr(CallStore, "prepare", prepare)
    branch = asyncio.create_task(client.chat.completions.create(model="m", messages=edited))
    await asyncio.wait_for(entered.wait(), 10)
    other = await asyncio.wait_for(stack.client("exo").chat.completions.create(model="m", messages=[SYSTEM, TASK]), 5)
    other_answered.set()
    r1 = await branch
    assert r0.choices[0].message.content == "first" and other.choices[0].message.content == "other"
    assert r1.choices[0].message.content == "branch"
    assert len(calls) == 1 and calls[0][0] != loop_thread and calls[0][1] is True  # "exo"'s call is light

    e0, e1 = [e for e in await stack.calls(3) if e.execution == "exh"]
    expected = encode(tok, render(tok, edited, None, True))
    assert engine.requests[-1]["input_ids"] == expected
    lcp = next(i for i, (a, b) in enumerate(zip(expected, full(e0))) if a != b)
    assert (e1.parent_call, e1.prefix_len, list(e1.tokens.prompt_ids)) == ("exh:0", lcp, expected[lcp:])
    # count_tokens of a heavy request (an auxiliary call, a fresh root) takes the same thread.
    counted = await stack.anthropic("exh").messages.count_tokens(model="m", messages=[long_task])
    assert counted.input_tokens == len(encode(tok, render(tok, [long_task], None, True)))
    assert len(calls) == 2 and calls[1][0] == calls[0][0] and calls[1][1] is True
    # An extension by a long message (a huge tool output): only it is rendered, in the thread.
    longer = [*edited, {"role": "assistant", "content": "branch"}, {"role": "user", "content": "x y " * 1_000}]
    await client.chat.completions.create(model="m", messages=longer)
    (e2,) = [e for e in await stack.calls(2) if e.call == "exh:3"]  # exh:2 is the count_tokens call
    assert (e2.parent_call, e2.prefix_len, e2.drift) == ("exh:1", len(expected) + len(e1.tokens.completion_ids), 0)
    assert engine.requests[-1]["input_ids"] == encode(tok, render(tok, longer, None, True))
    assert len(calls) == 3 and calls[2][0] == calls[0][0]
    # Nothing long was rendered or encoded on the event loop's thread, first call included.
    assert [n for t, n in work if t == loop_thread and n > 2_000] == [] and len([n for _, n in work if n > 2_000]) >= 5


async def test_with_another_template_a_long_extension_is_made_off_the_event_loop(stack, tok, monkeypatch):
    """With a checkpoint's own template (not gyre's), an extension renders both
    conversations whole: a heavy one is prepared in the branch thread, and it still
    extends its parent verbatim with drift 0."""
    import copy

    monkeypatch.setattr(gyre.serving.tito, "HEAVY_CHARS", 2_000)
    other = copy.copy(tok)
    other.chat_template = tok.chat_template + "{#- a checkpoint's own copy #}"
    stack.tok = other
    engine = await stack.engine(["first", "second"])
    await stack.proxy(engine=engine)
    assert not stack.state.execution("ext").store.incremental
    threads = []
    real = CallStore.prepare

    def prepare(self, pending):
        threads.append((threading.get_ident(), pending.extends is not None))
        return real(self, pending)

    monkeypatch.setattr(CallStore, "prepare", prepare)
    client = stack.client("ext")
    msgs = [SYSTEM, {"role": "user", "content": "Read this log:\n" + "line of output\n" * 200}]
    r0 = await client.chat.completions.create(model="m", messages=msgs)
    msgs += [{"role": "assistant", "content": r0.choices[0].message.content}, {"role": "user", "content": "go on"}]
    await client.chat.completions.create(model="m", messages=msgs)
    e0, e1 = await stack.calls(2)
    assert [t != threading.get_ident() for t, _ in threads] == [True, True] and [x for _, x in threads] == [False, True]
    assert (e1.parent_call, e1.prefix_len, e1.drift) == ("ext:0", len(full(e0)), 0)
    assert engine.requests[1]["input_ids"] == full(e0) + list(e1.tokens.prompt_ids)
    assert engine.requests[1]["input_ids"] == encode(tok, render(tok, msgs, None, True))


async def test_a_call_that_fails_or_is_left_while_its_prompt_is_made_uses_no_call(stack, monkeypatch):
    """In the branch thread: a MemoryError is a 500 in the API's shape (chat and
    count_tokens), a client that leaves meanwhile is let go; neither uses a call or leaves
    one counted in flight."""
    monkeypatch.setattr(gyre.serving.tito, "HEAVY_CHARS", 50)
    engine = await stack.engine(["ok"])
    await stack.proxy(engine=engine)
    long_task = {"role": "user", "content": "x" * 200}
    real = CallStore.prepare
    release, entered = threading.Event(), threading.Event()

    def failing(self, pending):
        raise MemoryError()

    monkeypatch.setattr(CallStore, "prepare", failing)
    with pytest.raises(openai.InternalServerError) as err:
        await stack.client("exf").chat.completions.create(model="m", messages=[SYSTEM, long_task])
    assert err.value.body["code"] == "internal_error"
    with pytest.raises(anthropic.InternalServerError) as aerr:
        await stack.anthropic("exf").messages.count_tokens(model="m", messages=[long_task])
    assert aerr.value.body["error"] == {"type": "api_error", "message": "internal error in the proxy: MemoryError"}
    assert stack.state.executions["exf"].model_calls == 0

    def blocking(self, pending):
        entered.set()
        release.wait(10)
        return real(self, pending)

    monkeypatch.setattr(CallStore, "prepare", blocking)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=0.5)) as http:
        with pytest.raises(asyncio.TimeoutError):
            await http.post(stack.url + "/v1/chat/completions", json={"messages": [SYSTEM, long_task]},
                            headers={"x-api-key": execution_key(SECRET, "exf")})
    assert entered.is_set()
    ex = stack.state.executions["exf"]
    for _ in range(100):  # the proxy lets the call go while its prompt is still being made
        if stack.state.active == 0:
            break
        await asyncio.sleep(0.05)
    release.set()
    assert (ex.model_calls, ex.active, stack.state.active, engine.requests) == (0, 0, 0, [])


async def test_max_calls_holds_for_calls_waiting_on_the_branch_thread(stack, monkeypatch):
    """A call counts against `max_calls` from its admission, not after its prompt is made:
    two concurrent heavy first calls of an execution allowed one call get one answer and
    one 400. A heavy request the template cannot render is a 400 that uses no call."""
    monkeypatch.setattr(gyre.serving.tito, "HEAVY_CHARS", 50)
    engine = await stack.engine(["ok"])
    await stack.proxy(engine=engine, max_calls=1)
    client = stack.client("exm")
    # A heavy request the template cannot render fails in the thread: a 400, no call used.
    with pytest.raises(openai.BadRequestError) as bad:
        await client.chat.completions.create(model="m", messages=[SYSTEM, {"role": "function", "content": "x" * 200}])
    assert bad.value.body["param"] == "messages" and stack.state.executions["exm"].model_calls == 0
    asks = [client.chat.completions.create(model="m", messages=[SYSTEM, {"role": "user", "content": "x" * 200}])
            for _ in range(2)]
    results = await asyncio.gather(*asks, return_exceptions=True)
    assert sorted(type(r).__name__ for r in results) == ["BadRequestError", "ChatCompletion"]
    assert len(engine.requests) == 1 and stack.state.executions["exm"].model_calls == 1


async def test_a_call_abandoned_at_shutdown_is_spilled_while_its_upstream_abort_hangs(tmp_path, tok):
    """A harness that goes away leaves an `aborted` call: it is counted unsent at once, so a
    drain that gives up on a hung engine abort (and on a bus that takes nothing) still
    spills it; before, the event was built only after the abort returned."""
    from handlers.proxy.routing import Attempt
    from schemas.call import SamplingParams

    class SilentBus:  # takes no publish
        config = BusConfig()

        async def publish(self, event, data, headers=None):
            publishing.set()
            await asyncio.sleep(3600)

    publishing = asyncio.Event()

    spill = tmp_path / "proxy-unpublished.jsonl"
    state = ProxyState(Config(run="r", key_secret=SECRET, spill_file=str(spill)), tok, session=None, bus=SilentBus())

    async def hung_abort(client, rid):
        await asyncio.sleep(3600)

    state.engines.abort_upstream = hung_abort
    attempt = Attempt(client=object(), rid="rid-1", cell="c")
    match = CallStore(tok).match([{"role": "user", "content": "hi"}])
    common = dict(execution="ex", seq=0, match=match, sampling=SamplingParams(), api="chat", role="main", meta={})
    proxy_call._abandon(state, attempt, common, None, 0.0)
    await asyncio.wait_for(publishing.wait(), 5)  # the publish is under way (and never answered)
    await state.drain(0.2)
    (line,) = [orjson.loads(x) for x in spill.read_bytes().splitlines() if x.strip()]
    assert (line["event"]["call"], line["event"]["status"]) == ("ex:0", "aborted")
    await state.drain(0.2)  # a second drain spills nothing again
    assert len([x for x in spill.read_bytes().splitlines() if x.strip()]) == 1


async def test_a_slow_puback_within_one_wait_lands_even_with_a_short_window(tmp_path, tok):
    """The window bounds a publish's own retries, never its first PubAck wait: with
    retry_timeout_s (0.2 s) shorter than the bus's PubAck timeout, a PubAck taking 0.5 s on
    a healthy bus is stored, not cancelled and spilled."""
    from schemas.call import SamplingParams

    class SlowBus:
        config = BusConfig(timeout_s=2.0)
        stored: list = []

        async def publish(self, event, data, headers=None):
            await asyncio.sleep(0.5)
            self.stored.append(event.call)
            return True

    spill = tmp_path / "proxy-unpublished.jsonl"
    bus = SlowBus()
    state = ProxyState(Config(run="r", key_secret=SECRET, spill_file=str(spill), retry_timeout_s=0.2), tok,
                       session=None, bus=bus)
    match = CallStore(tok).match([{"role": "user", "content": "hi"}])
    await state.publish(state.call_event(execution="ex", seq=0, match=match, sampling=SamplingParams(), api="chat",
                                         role="main", meta={}, result=None, status="ok", total_s=0.0, cell="c"))
    assert bus.stored == ["ex:0"] and not spill.exists()


async def test_a_resend_that_fails_part_way_does_not_publish_the_sent_calls_again(tmp_path, tok):
    """A spill file is kept whole when one of its calls still fails after retry_timeout_s;
    the calls published before it must not go out again on the next try (long after
    JetStream's duplicate window they would be stored twice)."""
    def event(seq):
        return schemas.CallCompleted(event_id=f"r:exs:call:{seq}", call=f"exs:{seq}", execution="exs", seq=seq,
                                     parent_call=None, prefix_len=0, tokens=schemas.CallTokens(),
                                     sampling=schemas.SamplingParams(), finish_reason="stop", versions=(), cell="c",
                                     role="main", api="chat", status="ok", timings={}, drift=0, meta={})

    spill = tmp_path / "proxy-unpublished.jsonl"
    state = ProxyState(Config(run="r", key_secret=SECRET, spill_file=str(spill)), tok, session=None, bus=object())
    state.spill([proxy_outbox.Outgoing(event(0)), proxy_outbox.Outgoing(event(1))], "test")
    sent, fail = [], ["r:exs:call:1"]

    async def publish(out, may_have_landed=False, stop=None):
        if out.event.event_id in fail:
            fail.remove(out.event.event_id)
            return False
        sent.append(out.event.event_id)
        return True

    state._publish = publish
    with pytest.raises(RuntimeError, match="could not publish the calls spilled"):
        await state.republish()
    assert list(await state.republish()) == ["r:exs:call:1"]
    assert sent == ["r:exs:call:0", "r:exs:call:1"] and not spill.exists() and not state.sending_path().exists()


async def test_a_call_waiting_for_a_cell_when_the_proxy_stops_gets_a_503_at_once(tmp_path, tok, nats_server, run_id,
                                                                                   bus):
    """No rollout cell will come back for a stopping proxy (the run has ended, every cell
    trains): a call waiting for one fails at once with 503 `proxy_stopping`, recorded as an
    `error` call, instead of holding the shutdown for its whole grace (60 s here) and then
    having its connection cut."""
    url_file = tmp_path / "proxy.json"
    cfg = Config(run=run_id, key_secret=SECRET, nats_url=nats_server.url, nats_token=nats_server.token,
                 url_file=str(url_file), shutdown_grace_s=60.0)
    stop, task, started = await _serving(cfg)
    async with openai.AsyncOpenAI(base_url=started["url"] + "/v1", api_key=execution_key(SECRET, "exw"),
                                  max_retries=0) as client:
        waiting = asyncio.ensure_future(client.chat.completions.create(model="m", messages=[TASK]))
        await until(lambda: started["state"].active == 1)  # admitted, waiting for a cell
        stop.set()
        with pytest.raises(openai.InternalServerError) as refused:
            await asyncio.wait_for(waiting, 20)
    assert refused.value.status_code == 503 and refused.value.code == "proxy_stopping"
    await asyncio.wait_for(task, 20)  # not the 60 s grace
    (event,) = await Stack(tok, bus, run_id).calls(1)
    assert (event.execution, event.status, event.tokens.completion_ids) == ("exw", "error", ())


async def test_a_stop_cancels_a_call_still_generating_at_the_end_of_its_grace_and_records_it(tmp_path, tok,
                                                                                              nats_server, run_id,
                                                                                              bus):
    """The whole stop fits `shutdown_grace_s`: a generation that outlasts it is cancelled
    once the publishes' reserve is reached, aborted upstream and published as `aborted`,
    and the proxy is gone well before a supervisor's SIGKILL (aiohttp alone waited twice
    its shutdown timeout, then the drain a third: 60 s of a 30 s budget, and the call was
    lost to the kill). The harness hears why: a 503, or an error event in a stream already
    open (it read an end of stream and the log blamed the client)."""
    import anthropic

    engine = ScriptedEngine(tok, ["never"])
    engine.gate = asyncio.Event()  # generates until aborted
    await engine.start()
    cfg = Config(run=run_id, key_secret=SECRET, nats_url=nats_server.url, nats_token=nats_server.token,
                 engine_url=engine.url, shutdown_grace_s=4.0, spill_file=str(tmp_path / "spill.jsonl"))
    stop, up = asyncio.Event(), asyncio.Event()
    started = {}
    task = asyncio.create_task(run(cfg, stop, on_started=lambda state, url: (started.update(url=url), up.set())))
    try:
        await asyncio.wait_for(up.wait(), 30)
        async with openai.AsyncOpenAI(base_url=started["url"] + "/v1", api_key=execution_key(SECRET, "exg"),
                                      max_retries=0) as client:
            call = asyncio.ensure_future(client.chat.completions.create(model="m", messages=[TASK]))
            streamer = anthropic.AsyncAnthropic(base_url=started["url"], api_key=execution_key(SECRET, "exs"),
                                                max_retries=0)

            kinds: list[str] = []

            async def streamed() -> None:
                async with streamer.messages.stream(model="m", max_tokens=64, messages=[TASK]) as events:
                    async for e in events:
                        kinds.append(e.type)

            stream = asyncio.ensure_future(streamed())
            await until(lambda: len(engine.requests) == 2)
            await asyncio.sleep(0.5)  # the stream has opened (`STREAM_OPEN_S`)
            t0 = time.monotonic()
            stop.set()
            await asyncio.wait_for(task, 30)
            stopped_s = time.monotonic() - t0
            with pytest.raises(openai.InternalServerError, match="the proxy stopped"):
                await call
            with pytest.raises(anthropic.APIStatusError, match="the proxy stopped"):
                await stream
            assert kinds == ["message_start"]  # the error came in the opened stream
            await streamer.close()
    finally:
        stop.set()
        await engine.stop()
    assert stopped_s < cfg.shutdown_grace_s + 2.0, stopped_s
    events = await Stack(tok, bus, run_id).calls(2)
    assert sorted((event.execution, event.status) for event in events) == [("exg", "aborted"), ("exs", "aborted")]
    assert engine.aborted and not (tmp_path / "spill.jsonl").exists()


async def test_a_huge_session_id_in_the_body_is_cut_and_the_call_stored(stack):
    """An Anthropic `metadata.user_id` holding a 1 MB session id went onto the call's
    `call.completed` whole: no publish could carry it, and the spill it left stopped every
    later proxy of the run from starting (a hostile review)."""
    from gyre.serving.roles import META_CHARS

    engine = await stack.engine(["ok"])
    url = await stack.proxy(engine=engine)
    body = {"model": "m", "max_tokens": 10, "messages": [{"role": "user", "content": "hi"}],
            "metadata": {"user_id": json.dumps({"session_id": "A" * 1_000_000})}}
    async with aiohttp.ClientSession() as http:
        async with http.post(url + "/v1/messages", json=body,
                             headers={"x-api-key": execution_key(SECRET, "exP")}) as r:
            assert r.status == 200, await r.text()
    (event,) = await stack.calls(1)
    assert event.status == "ok" and event.meta["session_id"] == "A" * META_CHARS


async def test_a_spilled_call_too_large_for_the_bus_is_kept_aside_and_the_others_go_out(tmp_path, tok, bus,
                                                                                         run_id):
    """A spilled line that can never be published (over the payload limit with its tokens
    in the object store) is moved to `.unreadable`, not retried for `retry_timeout_s`, and
    the calls after it are published: it used to raise, so a starting proxy never served."""
    def event(seq, meta):
        return schemas.CallCompleted(event_id=ids.call(run_id, "exs", seq), call=f"exs:{seq}", execution="exs",
                                     seq=seq, parent_call=None, prefix_len=0, tokens=schemas.CallTokens(),
                                     sampling=schemas.SamplingParams(), finish_reason="stop", versions=(), cell="c",
                                     role="main", api="chat", status="ok", timings={}, drift=0, meta=meta)

    spill = tmp_path / "proxy-unpublished.jsonl"
    state = ProxyState(Config(run=run_id, key_secret=SECRET, spill_file=str(spill), retry_timeout_s=600.0), tok,
                       session=None, bus=bus)
    state.spill([proxy_outbox.Outgoing(event(0, {"session_id": "A" * 1_000_000})), proxy_outbox.Outgoing(event(1, {}))],
                "test")
    assert list(await asyncio.wait_for(state.republish(), 30)) == [ids.call(run_id, "exs", 1)]
    (kept,) = Path(f"{spill}.unreadable").read_bytes().splitlines()
    assert orjson.loads(kept)["event"]["call"] == "exs:0"
    assert not spill.exists() and not state.sending_path().exists()
    (stored,) = await Stack(tok, bus, run_id).calls(1)
    assert stored.call == "exs:1"


async def test_a_serving_proxy_resends_its_spill_without_the_calls_stored_meanwhile(tmp_path, tok, bus, run_id):
    """A spilled call whose PubAck alone was lost is stored already; the serving proxy's
    resend reads the run's stored ids first and leaves it out (after JetStream's duplicate
    window, here cut to 1 s, a second copy would be stored: a hostile review found calls
    stored three times)."""
    from bus import subjects as bus_subjects

    stream = bus_subjects.stream("CALLS").stream_name(run_id)
    config = (await bus.js.stream_info(stream)).config
    config.duplicate_window = 1.0
    await bus.js.update_stream(config)

    def event(seq):
        return schemas.CallCompleted(event_id=ids.call(run_id, "exd", seq), call=f"exd:{seq}", execution="exd",
                                     seq=seq, parent_call=None, prefix_len=0, tokens=schemas.CallTokens(),
                                     sampling=schemas.SamplingParams(), finish_reason="stop", versions=(), cell="c",
                                     role="main", api="chat", status="ok", timings={}, drift=0, meta={})

    assert await bus.publish(event(0))  # it landed; its PubAck was lost, so the proxy spilled it
    await asyncio.sleep(1.5)  # past the (shortened) duplicate window
    spill = tmp_path / "proxy-unpublished.jsonl"
    state = ProxyState(Config(run=run_id, key_secret=SECRET, spill_file=str(spill)), tok, session=None, bus=bus)
    state.spill([proxy_outbox.Outgoing(event(0)), proxy_outbox.Outgoing(event(1))], "test")
    stop = asyncio.Event()
    resend = asyncio.create_task(proxy_restart.resend_spilled(state, stop))
    state.bus_back.set()
    try:
        await until(lambda: not spill.exists() and not state.sending_path().exists())
    finally:
        stop.set()
        await asyncio.wait_for(resend, 10)
    assert sorted(await bus.stored_ids("call.completed")) == [ids.call(run_id, "exd", 0), ids.call(run_id, "exd", 1)]


def _kernel_holds(rcvbuf: int) -> int:
    """Bytes a loopback TCP connection takes from its writer while the reader (receive
    buffer `rcvbuf`) reads nothing: about what the kernel's two buffers hold."""
    import socket

    with socket.create_server(("127.0.0.1", 0)) as listener:
        reader = socket.socket()
        reader.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        reader.connect(listener.getsockname())
        writer, _ = listener.accept()
        writer.setblocking(False)
        held, chunk = 0, b"=" * 65536
        with reader, writer:
            for _ in range(3):  # until the window has closed
                with contextlib.suppress(BlockingIOError):
                    while True:
                        held += writer.send(chunk)
                time.sleep(0.2)
        return held


PROXY_PROCESS = """
import asyncio, json, sys
from handlers.daemon import run_async, install_signals
from handlers.proxy.daemon import Config, run
kw = json.loads(sys.argv[1])
cfg = Config(key_secret=bytes.fromhex(kw.pop("key_secret")), **kw)
async def main():
    stop = asyncio.Event()
    install_signals(stop)
    await run(cfg, stop, on_started=lambda state, url: open(sys.argv[2], "w").write(url))
run_async(main())
"""


def _request(execution: str) -> bytes:
    body = json.dumps({"model": "m", "messages": [TASK]}).encode()
    return (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Authorization: Bearer " + execution_key(SECRET, execution).encode() +
            b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


async def test_a_harness_has_its_whole_answer_exactly_when_the_call_is_recorded_ok_after_a_stop(
        tmp_path, tok, nats_server, run_id, bus):
    """A proxy process stopped (SIGTERM) while a harness that reads nothing holds an answer
    larger than the kernel's buffers: after the process exits the harness has part of it
    and the call is `aborted` (it was recorded `ok` and its tail lost at exit: a hostile
    review)."""
    import signal
    import socket
    import subprocess
    import sys

    size = _kernel_holds(4096) + 300_000
    engine = ScriptedEngine(tok, ["ok" + (" " + "=" * 64) * (size // 65)])  # (BPE is quick on short words)
    await engine.start()
    kw = dict(run=run_id, key_secret=SECRET.hex(), nats_url=nats_server.url, nats_token=nats_server.token,
              engine_url=engine.url, shutdown_grace_s=6.0, max_completion_tokens=1_000_000, check_drift=False)
    url_file = tmp_path / "url"
    log = open(tmp_path / "proxy.log", "wb")
    proc = subprocess.Popen([sys.executable, "-c", PROXY_PROCESS, json.dumps(kw), str(url_file)], stdout=log,
                            stderr=subprocess.STDOUT, cwd=Path(__file__).resolve().parents[1])
    reader = socket.socket()
    data = b""
    try:
        await until(lambda: url_file.exists() and url_file.read_text() or proc.poll() is not None, 60)
        reader.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        reader.connect(("127.0.0.1", int(url_file.read_text().rsplit(":", 1)[1])))
        reader.sendall(_request("exa"))
        await until(lambda: engine.requests, 30)
        await asyncio.sleep(2.0)  # the answer is out of the engine, in the sockets
        proc.send_signal(signal.SIGTERM)
        await asyncio.wait_for(asyncio.to_thread(proc.wait), 30)
        reader.settimeout(10)
        with contextlib.suppress(ConnectionResetError):
            while chunk := await asyncio.to_thread(reader.recv, 1 << 20):
                data += chunk
    finally:
        reader.close()
        log.close()
        if proc.poll() is None:
            proc.kill()
        await engine.stop()
    head, _, answer = data.partition(b"\r\n\r\n")
    assert b" 200 " in head.split(b"\r\n")[0]  # the answer had begun to go out
    assert len(answer) < int(re.search(rb"(?i)content-length: *(\d+)", head).group(1))  # and was cut
    (event,) = await Stack(tok, bus, run_id).calls(1)
    assert (event.call, event.status) == ("exa:0", "aborted")
    assert event.tokens_ref or event.tokens.completion_ids  # the sample is kept (never trained)


async def test_a_call_is_recorded_only_once_its_transport_holds_none_of_the_answer(tmp_path, tok, nats_server,
                                                                                  run_id, bus, monkeypatch):
    """aiohttp's write_eof returns while the transport still holds less than its high-water
    mark (64 KiB); a call recorded `ok` then lost that tail when a stop ended the process
    (a hostile review). Here the mark is raised to 64 MiB, so that any answer beyond the
    kernel's buffers leaves such a tail: the call is recorded only once the harness has
    taken it, and a stop before that cuts it (`aborted`)."""
    import socket

    from aiohttp import web_protocol

    made = web_protocol.RequestHandler.connection_made

    def high_water(self, transport):
        made(self, transport)
        transport.set_write_buffer_limits(high=64 << 20)

    monkeypatch.setattr(web_protocol.RequestHandler, "connection_made", high_water)
    size = _kernel_holds(4096) + 300_000
    engine = ScriptedEngine(tok, ["ok" + (" " + "=" * 64) * (size // 65)] * 2)
    await engine.start()
    cfg = Config(run=run_id, key_secret=SECRET, nats_url=nats_server.url, nats_token=nats_server.token,
                 engine_url=engine.url, shutdown_grace_s=4.0, max_completion_tokens=1_000_000, check_drift=False)
    stop, task, started = await _serving(cfg)
    port = int(started["url"].rsplit(":", 1)[1])
    taken, cut = socket.socket(), socket.socket()
    try:
        for reader in (taken, cut):
            reader.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            reader.connect(("127.0.0.1", port))
        taken.sendall(_request("exa"))
        await until(lambda: len(engine.requests) == 1, 30)
        await asyncio.sleep(1.5)  # the answer is out of the engine; its tail is in the transport
        assert not await bus.stored_ids("call.completed")  # not recorded while the harness lacks it
        taken.settimeout(10)
        data = b""
        while b'"finish_reason"' not in data[-400:]:
            data += await asyncio.to_thread(taken.recv, 1 << 20)
        await until(lambda: not started["state"]._unsent and started["state"].active == 0, 30)
        assert len(await bus.stored_ids("call.completed")) == 1  # recorded once taken
        cut.sendall(_request("exb"))
        await until(lambda: len(engine.requests) == 2, 30)
        await asyncio.sleep(1.5)
        stop.set()
        await asyncio.wait_for(task, 30)
    finally:
        taken.close()
        cut.close()
        stop.set()
        await engine.stop()
    events = {e.execution: e.status for e in await Stack(tok, bus, run_id).calls(2)}
    assert events == {"exa": "ok", "exb": "aborted"}


async def test_a_harness_that_stops_reading_its_answer_is_cut_after_deliver_timeout_s(tmp_path, tok, nats_server,
                                                                                       run_id, bus):
    """A harness that reads nothing of an answer larger than the sockets hold held its
    handler (and its execution's slot) until the proxy stopped. After `deliver_timeout_s`
    the connection is cut and the call recorded `aborted`, with the proxy still serving:
    the same execution's next call is answered."""
    import socket

    size = _kernel_holds(4096) + 300_000
    engine = ScriptedEngine(tok, ["ok" + (" " + "=" * 64) * (size // 65), "next"])
    await engine.start()
    cfg = Config(run=run_id, key_secret=SECRET, nats_url=nats_server.url, nats_token=nats_server.token,
                 engine_url=engine.url, max_completion_tokens=1_000_000, check_drift=False, deliver_timeout_s=2.0,
                 max_active_calls_per_execution=1)
    reader = socket.socket()
    async with _served(cfg) as started:
        state = started["state"]
        try:
            reader.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            reader.connect(("127.0.0.1", int(started["url"].rsplit(":", 1)[1])))
            reader.sendall(_request("exs"))
            await until(lambda: engine.requests, 30)
            await until(lambda: state.active == 0, 30)  # handler done: cut, not waiting for the stop
            (event,) = await Stack(tok, bus, run_id).calls(1)
            assert (event.call, event.status) == ("exs:0", "aborted")
            reader.settimeout(10)
            data = b""
            with contextlib.suppress(ConnectionResetError):
                while chunk := await asyncio.to_thread(reader.recv, 1 << 20):
                    data += chunk
            head, _, answer = data.partition(b"\r\n\r\n")
            assert len(answer) < int(re.search(rb"(?i)content-length: *(\d+)", head).group(1))  # cut short
            async with openai.AsyncOpenAI(base_url=started["url"] + "/v1", api_key=execution_key(SECRET, "exs"),
                                          max_retries=0) as client:
                again = await client.chat.completions.create(model="m", messages=[TASK])
            assert again.choices[0].message.content == "next"
        finally:
            reader.close()
            await engine.stop()


async def test_a_harness_that_reads_slowly_but_steadily_is_not_cut_by_deliver_timeout_s(tmp_path, tok, nats_server,
                                                                                         run_id, bus):
    """`deliver_timeout_s` bounds a reader's pause, not its whole read: a harness that takes
    what its socket holds every 50 ms, of an answer that needs seconds, gets all of it,
    recorded `ok`, with the timeout at 0.75 s (a hostile review found it cut after 1.5 s: the
    timeout was a deadline on the whole delivery, and the transport's unsent bytes do not
    shrink while the kernel's send queue drains)."""
    import socket

    size = _kernel_holds(65536) + 600_000
    engine = ScriptedEngine(tok, ["ok" + (" " + "=" * 64) * (size // 65)])
    await engine.start()
    cfg = Config(run=run_id, key_secret=SECRET, nats_url=nats_server.url, nats_token=nats_server.token,
                 engine_url=engine.url, max_completion_tokens=1_000_000, check_drift=False, deliver_timeout_s=0.75)
    reader = socket.socket()
    async with _served(cfg) as started:
        try:
            reader.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
            reader.connect(("127.0.0.1", int(started["url"].rsplit(":", 1)[1])))
            reader.sendall(_request("exr"))
            reader.settimeout(10)
            data, began, want = b"", time.monotonic(), None
            while want is None or len(data) < want:
                chunk = await asyncio.to_thread(reader.recv, 1 << 16)
                assert chunk, f"cut after {len(data)} bytes"
                data += chunk
                if want is None and b"\r\n\r\n" in data:
                    head, _, _ = data.partition(b"\r\n\r\n")
                    want = len(head) + 4 + int(re.search(rb"(?i)content-length: *(\d+)", head).group(1))
                await asyncio.sleep(0.05)
            took = time.monotonic() - began
            (event,) = await Stack(tok, bus, run_id).calls(1)
        finally:
            reader.close()
            await engine.stop()
    assert took > 2 * cfg.deliver_timeout_s  # the read outlasted the timeout, as a whole
    assert event.status == "ok"
    assert orjson.loads(data.partition(b"\r\n\r\n")[2])["choices"][0]["message"]["content"].startswith("ok =")


async def test_a_stop_with_the_bus_frozen_spills_and_ends_within_its_grace(tmp_path, tok, nats_server, run_id, bus):
    """A nats-server that answers nothing (SIGSTOP; a partition) held the stop for its
    drain and flush timeouts (40 s of a 20 s budget): the unacknowledged call is spilled at
    the end of the grace and the bus closed without draining."""
    import signal

    engine = ScriptedEngine(tok, ["one", "two"])
    await engine.start()
    spill = tmp_path / "spill.jsonl"
    cfg = Config(run=run_id, key_secret=SECRET, nats_url=nats_server.url, nats_token=nats_server.token,
                 engine_url=engine.url, shutdown_grace_s=4.0, spill_file=str(spill))
    stop, task, started = await _serving(cfg)
    try:
        async with openai.AsyncOpenAI(base_url=started["url"] + "/v1", api_key=execution_key(SECRET, "exf"),
                                      max_retries=0) as client:
            await client.chat.completions.create(model="m", messages=[TASK])
            await until(lambda: not started["state"]._unsent)
            await freeze(nats_server.process)
            try:
                await client.chat.completions.create(model="m", messages=[SYSTEM, TASK])
                t0 = time.monotonic()
                stop.set()
                await asyncio.wait_for(task, 60)
                stopped_s = time.monotonic() - t0
            finally:
                os.kill(nats_server.process.pid, signal.SIGCONT)
    finally:
        stop.set()
        await engine.stop()
    assert stopped_s < cfg.shutdown_grace_s + 3.0, stopped_s
    (line,) = [orjson.loads(x) for x in spill.read_bytes().splitlines() if x.strip()]
    assert line["event"]["call"] == "exf:1"


async def test_a_call_retrying_a_dead_engine_when_the_proxy_stops_gets_a_503_at_once(tmp_path, tok, nats_server,
                                                                                    run_id, bus):
    """When a run ends its cells go with it: a call between attempts fails with 503
    `proxy_stopping` instead of retrying until the stop's cancel (it was cut without an
    error body after most of the grace)."""
    from bus.server import free_port

    cfg = Config(run=run_id, key_secret=SECRET, nats_url=nats_server.url, nats_token=nats_server.token,
                 engine_url=f"http://127.0.0.1:{free_port()}", shutdown_grace_s=20.0)
    stop, task, started = await _serving(cfg)
    try:
        async with openai.AsyncOpenAI(base_url=started["url"] + "/v1", api_key=execution_key(SECRET, "exd"),
                                      max_retries=0) as client:
            call = asyncio.ensure_future(client.chat.completions.create(model="m", messages=[TASK]))
            await until(lambda: started["state"].active == 1)
            await asyncio.sleep(0.5)  # refused, backing off
            stop.set()
            with pytest.raises(openai.InternalServerError) as refused:
                await asyncio.wait_for(call, 5)
            await asyncio.wait_for(task, 10)
    finally:
        stop.set()
    assert refused.value.code == "proxy_stopping"
    (event,) = await Stack(tok, bus, run_id).calls(1)
    assert event.status == "error"


async def test_a_start_that_fails_after_the_replay_began_does_not_wait_out_the_grace(tmp_path, tok, nats_server,
                                                                                    run_id):
    """The replay of the run's events ends on the stop; a start that fails (its port taken)
    has no stop, and waited the whole grace for it."""
    import socket

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    try:
        cfg = Config(run=run_id, key_secret=SECRET, nats_url=nats_server.url, nats_token=nats_server.token,
                     port=taken.getsockname()[1], shutdown_grace_s=60.0)
        t0 = time.monotonic()
        with pytest.raises(OSError):
            await asyncio.wait_for(run(cfg, asyncio.Event()), 40)
        failed_s = time.monotonic() - t0
    finally:
        taken.close()
    assert failed_s < cfg.shutdown_grace_s / 4, failed_s  # not held for the grace


async def test_a_call_completed_goes_to_the_bus_at_once_and_a_cancelled_one_is_spilled(tmp_path, tok, bus, run_id,
                                                                                       monkeypatch):
    """`publish_later` starts the publish in the next loop pass, with no timer before it: a
    call held back in memory is lost in a crash and, reaching the bus after its execution's
    score, is never trained (a 20-ms batch window lost every call to a scorer 5 ms after the
    answer). Every call is stored, and a publish cancelled before it started is still
    spilled by the drain (it was counted unsent)."""
    def event(seq):
        return schemas.CallCompleted(event_id=ids.call(run_id, "exb", seq), call=f"exb:{seq}", execution="exb",
                                     seq=seq, parent_call=None, prefix_len=0, tokens=schemas.CallTokens(),
                                     sampling=schemas.SamplingParams(), finish_reason="stop", versions=(), cell="c",
                                     role="main", api="chat", status="ok", timings={}, drift=0, meta={})

    spill = tmp_path / "proxy-unpublished.jsonl"
    state = ProxyState(Config(run=run_id, key_secret=SECRET, spill_file=str(spill)), tok, session=None, bus=bus)
    started: list[int] = []
    publish = bus.publish

    async def recording(ev, *args, **kw):
        started.append(ev.seq)
        return await publish(ev, *args, **kw)

    monkeypatch.setattr(bus, "publish", recording)
    for seq in range(3):
        state.publish_later(proxy_outbox.Outgoing(event(seq)))
        await asyncio.sleep(0)  # one loop pass
        assert started == list(range(seq + 1))
    earlier = set(state._background)  # (the calls before may still await their PubAcks)
    state.publish_later(proxy_outbox.Outgoing(event(3)))
    (waiting,) = state._background - earlier
    waiting.cancel()
    await state.drain(5)
    assert started == [0, 1, 2]
    assert [orjson.loads(line)["event"]["seq"] for line in spill.read_bytes().splitlines() if line] == [3]
    stored = sorted(await bus.stored_ids("call.completed"))
    assert stored == sorted(ids.call(run_id, "exb", s) for s in range(3))


async def test_seeded_proxy_sends_each_call_its_own_seed(stack):
    """A run's proxy samples call `<e>:<seq>` with call_seed(run seed, e, seq): the same on a
    retried attempt, independent of what else runs, different across calls and executions."""
    from gyre.serving.seeds import call_seed

    engine = await stack.engine(["ok"] * 4)
    await stack.proxy(engine=engine, seed=7)
    engine.fail_next(1, 503)  # the first attempt is refused: its retry carries the same seed
    for execution in ("sa", "sb"):
        client = stack.client(execution)
        await client.chat.completions.create(model="m", messages=[SYSTEM, TASK])
        await client.chat.completions.create(model="m", messages=[SYSTEM, {"role": "user", "content": "again"}])
    seeds = [(r["gyre_execution"], r["sampling_params"]["seed"]) for r in engine.requests]
    expected = [("sa", call_seed(7, "sa", 0))] * 2 + [("sa", call_seed(7, "sa", 1)), ("sb", call_seed(7, "sb", 0)),
                                                      ("sb", call_seed(7, "sb", 1))]
    assert seeds == expected
    assert len({s for _, s in expected}) == 4 and all(0 <= s < 2**63 for _, s in expected)
