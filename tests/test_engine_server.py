"""The embedded engine over real aiohttp on 127.0.0.1, driven by EngineClient:
SGLang's /generate shapes, prefix reuse, 503 while not serving, 400s, abort (explicit
and on client disconnect), weight updates from disk."""
from __future__ import annotations

import asyncio
import socket
import time

import numpy as np
import pytest

from gyre.serving.engine import Engine, EngineConfig, GenerateRequest, SamplingParams
from handlers.engines import embedded as engine_server
from handlers.engines.client import EngineClient, EngineRequestError, EngineUnavailable, make_session
from tests.test_engine import build_tiny_model, prompt

TOKEN = "engine-token-of-the-test-run"


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    base = tmp_path_factory.mktemp("models")
    return build_tiny_model(base / "v0", seed=0), build_tiny_model(base / "v1", seed=1)


@pytest.fixture
async def served(model_dirs):
    """(engine, app, client) with a fresh engine behind a real server."""
    engine = Engine(EngineConfig(model_dir=model_dirs[0]))
    app, runner, url = await engine_server.serve(engine, api_key=TOKEN)
    assert url.startswith("http://127.0.0.1:")
    session = make_session()
    yield engine, app, EngineClient(url, session, api_key=TOKEN)
    await session.close()
    await runner.cleanup()


async def until(cond, what: str, bound_s: float = 60.0) -> None:
    deadline = time.monotonic() + bound_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting for {what}")
        await asyncio.sleep(0.01)


LONG = {"temperature": 1.0, "max_new_tokens": 4000, "ignore_eos": True, "seed": 1}


async def test_generate_shapes_match_engine(served):
    engine, _app, client = served
    ids = prompt(12)
    sampling = {"temperature": 0.7, "top_p": 0.9, "top_k": 20, "max_new_tokens": 6, "stop_token_ids": [], "seed": 3}
    res = await client.generate(list(ids), sampling, rid="r1")
    direct = engine.generate(GenerateRequest(rid="r2", input_ids=ids, sampling=SamplingParams(
        temperature=0.7, top_p=0.9, top_k=20, max_new_tokens=6, seed=3)))
    meta = res["meta_info"]
    assert res["text"] == "" and res["output_ids"] == list(direct.output_ids)
    assert meta["id"] == "r1" and meta["finish_reason"] == {"type": "length", "length": 6}
    assert meta["prompt_tokens"] == 12 and meta["completion_tokens"] == 6 and meta["cached_tokens"] == 0
    assert meta["output_token_logprobs"] == [[lp, t, None] for lp, t in zip(direct.logprobs, direct.output_ids)]
    assert meta["weight_version"] == "0" and meta["gyre_versions"] == [[0, 6, 0]]
    assert meta["e2e_latency"] >= 0.0
    # a stop id ends the call and is included
    stop_id = res["output_ids"][2]
    res = await client.generate(list(ids), dict(sampling, stop_token_ids=[stop_id]), rid="r3")
    first = res["output_ids"].index(stop_id)
    assert res["output_ids"] == list(direct.output_ids[: first + 1])
    assert res["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_id}
    no_lp = await client.generate(list(ids), sampling, rid="r4", return_logprob=False)
    assert "output_token_logprobs" not in no_lp["meta_info"]
    # the proxy sends int32 prompt arrays as they are; the engine sees the same ids
    strided = np.repeat(np.asarray(ids, np.int32), 2)[::2]  # a non-contiguous view
    as_array = await client.generate(strided, sampling, rid="r5")
    assert as_array["output_ids"] == list(direct.output_ids) and as_array["meta_info"]["prompt_tokens"] == 12
    big_endian = await client.generate(np.asarray(ids, ">i8"), sampling, rid="r6")
    assert big_endian["output_ids"] == list(direct.output_ids)
    for wrong in (np.asarray(ids, np.float32), np.asarray([ids], np.int32)):
        with pytest.raises(TypeError, match="1-D integer array"):
            await client.generate(wrong, sampling, rid="r7")


async def test_execution_prefix_reuse_over_http(served):
    _engine, _app, client = served
    greedy = {"temperature": 0, "max_new_tokens": 5}
    p1 = list(prompt(20, seed=2))
    first = await client.generate(p1, greedy, rid="a", execution="exec-1")
    p2 = p1 + first["output_ids"] + list(prompt(4, seed=3))
    cached = await client.generate(p2, greedy, rid="b", execution="exec-1")
    plain = await client.generate(p2, greedy, rid="c")
    assert cached["meta_info"]["cached_tokens"] == len(p1) + 5 - 1
    assert cached["output_ids"] == plain["output_ids"]
    assert (await client.flush_cache())["success"] is True
    again = await client.generate(p2, greedy, rid="d", execution="exec-1")
    assert again["meta_info"]["cached_tokens"] == 0


async def test_not_serving_answers_503(served):
    _engine, app, client = served
    assert await client.health() is True
    engine_server.set_serving(app, False)
    assert await client.health() is False
    with pytest.raises(EngineUnavailable, match="503"):
        await client.generate([1, 2, 3], {"max_new_tokens": 2}, rid="x")
    assert (await client.model_info())["serving"] is False
    engine_server.set_serving(app, True)
    res = await client.generate([1, 2, 3], {"max_new_tokens": 2}, rid="y")
    assert len(res["output_ids"]) == 2


async def test_a_released_engine_answers_503_until_a_load(served, model_dirs):
    engine, _app, client = served
    await asyncio.to_thread(engine.release)
    with pytest.raises(EngineUnavailable, match="503"):
        await client.generate([1, 2, 3], {"max_new_tokens": 2}, rid="x")
    await asyncio.to_thread(engine.load_weights, model_dirs[1], 3)
    res = await client.generate([1, 2, 3], {"max_new_tokens": 2}, rid="y")
    assert len(res["output_ids"]) == 2 and res["meta_info"]["weight_version"] == "3"


async def test_bad_requests_answer_400(served):
    engine, _app, client = served
    with pytest.raises(EngineRequestError) as err:
        await client.generate(list(prompt(40000)), {"max_new_tokens": 1}, rid="long")
    assert err.value.status == 400 and "max_context_tokens" in err.value.body["error"]["message"]
    with pytest.raises(EngineRequestError) as err:
        await client.generate([1, engine.vocab_size], {}, rid="oov")
    assert err.value.status == 400 and err.value.body["error"]["type"] == "InvalidRequest"
    with pytest.raises(EngineRequestError, match="top_p"):
        await client.generate([1, 2], {"top_p": 0}, rid="tp")
    with pytest.raises(EngineRequestError, match="sampling_params.stop"):
        await client.generate([1, 2], {"stop": ["ok", 3]}, rid="st")
    session = client.session
    auth = {"Authorization": f"Bearer {TOKEN}"}
    for raw in (b"{not json", b"[1, 2]", b'{"text": "hello"}', b'{"input_ids": ["a"]}', b'{"input_ids": [1], "stream": true}'):
        async with session.post(client.base_url + "/generate", data=raw, headers=auth) as resp:
            body = await resp.json()
            assert resp.status == 400 and set(body["error"]) == {"message", "type"}, raw
    async with session.post(client.base_url + "/abort_request", data=b"{}", headers=auth) as resp:
        assert resp.status == 400
    async with session.get(client.base_url + "/nope", headers=auth) as resp:
        assert resp.status == 404 and (await resp.json())["error"]["type"] == "http_error"


async def test_abort_request(served):
    engine, _app, client = served
    task = asyncio.create_task(client.generate([5, 6, 7], LONG, rid="victim"))
    await until(lambda: engine.in_flight().get("victim", 0) >= 1, "victim to decode")
    assert await client.abort("victim") is True
    res = await task
    meta = res["meta_info"]
    assert meta["finish_reason"]["type"] == "abort"
    assert 1 <= meta["completion_tokens"] < 4000 and len(meta["output_token_logprobs"]) == meta["completion_tokens"]
    assert await client.abort("victim") is False


async def test_client_disconnect_aborts(served):
    engine, _app, client = served
    task = asyncio.create_task(client.generate([5, 6, 7], LONG, rid="gone"))
    await until(lambda: engine.in_flight().get("gone", 0) >= 1, "request to decode")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await until(lambda: "gone" not in engine.in_flight(), "engine to abort after disconnect")


async def test_concurrent_calls_interleave(served):
    engine, _app, client = served
    long = asyncio.create_task(client.generate([5, 6, 7], LONG, rid="long"))
    await until(lambda: engine.in_flight().get("long", 0) >= 1, "long call to decode")
    shorts = await asyncio.gather(*(client.generate([i, 9], {"max_new_tokens": 3}, rid=f"s{i}") for i in range(4)))
    assert all(len(s["output_ids"]) == 3 for s in shorts) and "long" in engine.in_flight()
    await client.abort("long")
    assert (await long)["meta_info"]["finish_reason"]["type"] == "abort"


async def test_update_weights_from_disk(served, model_dirs, tmp_path):
    engine, _app, client = served
    res = await client.update_weights_from_disk(model_dirs[1], 4)
    assert res["success"] is True
    assert await client.weight_version() == 4 and (await client.model_info())["weight_version"] == "4"
    out = await client.generate([1, 2, 3], {"max_new_tokens": 2}, rid="v4")
    assert out["meta_info"]["gyre_versions"] == [[0, 2, 4]] and out["meta_info"]["weight_version"] == "4"
    with pytest.raises(EngineRequestError) as err:
        await client.update_weights_from_disk(str(tmp_path / "missing"), 5)
    assert err.value.status == 400 and err.value.body["success"] is False
    assert await client.weight_version() == 4


async def test_connection_refused_is_unavailable():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    session = make_session(connect_s=2.0)
    try:
        client = EngineClient(f"http://127.0.0.1:{port}", session)
        with pytest.raises(EngineUnavailable):
            await client.generate([1], {}, rid="z")
        assert await client.health() is False
    finally:
        await session.close()


async def test_disconnect_noticed_without_handler_cancellation(model_dirs):
    """make_app under a plain AppRunner (aiohttp's default: handlers are not cancelled on
    disconnect): the handler's socket watch still aborts the call."""
    from aiohttp import web

    engine = Engine(EngineConfig(model_dir=model_dirs[0]))
    runner = web.AppRunner(engine_server.make_app(engine, api_key=TOKEN))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    session = make_session()
    try:
        client = EngineClient(f"http://{host}:{port}", session, api_key=TOKEN)
        task = asyncio.create_task(client.generate([5, 6, 7], LONG, rid="gone"))
        await until(lambda: engine.in_flight().get("gone", 0) >= 1, "request to decode")
        task.cancel()
        await until(lambda: "gone" not in engine.in_flight(), "engine to abort after disconnect")
    finally:
        await session.close()
        await runner.cleanup()


ROUTES = [("POST", "/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}}),
          ("POST", "/abort_request", {"abort_all": True}), ("POST", "/flush_cache", None),
          ("POST", "/update_weights_from_disk", {"model_path": "/tmp/policy-chosen", "weight_version": "9"}),
          ("GET", "/get_model_info", None), ("GET", "/get_weight_version", None)]


async def test_every_route_but_health_demands_the_bearer_token(served):
    """SGLang's --api-key convention: without the run's token (none, another, a Basic
    header, the token without "Bearer") every route answers 401 and does nothing; /health
    answers (a liveness probe); with it the same requests are served."""
    import aiohttp

    engine, app, client = served
    url = client.base_url
    before = engine.weight_version
    async with aiohttp.ClientSession() as http:
        for headers in ({}, {"Authorization": "Bearer not-the-token"}, {"Authorization": TOKEN},
                        {"Authorization": "Basic " + TOKEN}, {"Authorization": f"Bearer {TOKEN}x"},
                        {"Authorization": "Bearer \u00e9"}):
            for method, path, body in ROUTES:
                async with http.request(method, url + path, json=body, headers=headers) as resp:
                    assert resp.status == 401, (path, headers, resp.status)
                    assert resp.headers["WWW-Authenticate"] == "Bearer"
                    assert (await resp.json())["error"]["type"] == "unauthorized"
            async with http.get(url + "/health", headers=headers) as resp:
                assert resp.status == 200
        assert engine.weight_version == before and not engine.in_flight()
        for method, path, body in ROUTES[:2] + ROUTES[4:]:
            async with http.request(method, url + path, json=body,
                                    headers={"Authorization": f"Bearer {TOKEN}"}) as resp:
                assert resp.status == 200, (path, await resp.text())
    # The client without the token gets the refusal as an error with its status.
    session = make_session()
    try:
        with pytest.raises(EngineRequestError) as err:
            await EngineClient(url, session).generate([1, 2], {"max_new_tokens": 1}, rid="no-token")
        assert err.value.status == 401
        with pytest.raises(EngineRequestError):
            await EngineClient(url, session, api_key="wrong").model_info()
    finally:
        await session.close()
    with pytest.raises(ValueError, match="bearer token"):
        engine_server.make_app(engine, api_key="")
