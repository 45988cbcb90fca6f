"""KV migration on embedded-engine cells (DESIGN.md "Elastic scheduling"): two cell processes
(`python -m handlers.cell`) on a real nats-server, the proxy (`handlers.proxy.daemon.run`) in
this process, the OpenAI SDK as harness, the test playing the scheduler (`route.updated`,
then `cell.switch` with the moved executions, as handlers/scheduler.py publishes them).

cell1 serves two executions; one has a call in flight when cell1 leaves rollout. The proxy
cuts that call at cell1 and retries it at cell0; cell1 hands both executions' prefix KV
blocks to cell0 through the transfer layer (`kv.offered`, `kv.pulled`), which imports them
before it serves their next request. Held to an unmigrated twin (one in-process engine that
serves the same calls without a switch): each moved execution's next call prefills only its
new tokens (the engines' counters), and its completion and log-probs are the twin's.
"""
from __future__ import annotations

import asyncio

import aiohttp
import numpy as np
import openai
import pytest

import schemas
from gyre.env.harness import execution_key
from gyre.serving.engine import Engine, EngineConfig, GenerateRequest, SamplingParams
from handlers.metrics import recorded_urls, scrape
from handlers.proxy.daemon import Config as ProxyConfig
from schemas import ids
from tests.replicas import Cells
from tests.test_engine import build_tiny_model
from tests.test_proxy import SECRET, Stack, _serving, tok  # noqa: F401 - fixtures
from tests.test_visibility import _samples, _total

TOKEN = "replicas-test-engine-token"  # tests.replicas.Cells' engine token
LONG = 400  # max_tokens of the call in flight at the switch: long enough to still run when cut


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("kv-move") / "m", seed=3)


async def counters(http: aiohttp.ClientSession, url: str) -> dict:
    async with http.get(url + "/get_model_info", headers={"Authorization": f"Bearer {TOKEN}"}) as r:
        info = await r.json()
    return {**info["counters"], "in_flight": info["in_flight"]}


async def until(predicate, what: str, timeout_s: float = 60.0) -> None:
    for _ in range(int(timeout_s / 0.02)):
        if await predicate():
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


async def facts(server, run: str, names: list[str]) -> list:
    from bus import Bus

    bus = await Bus.connect(server.url, token=server.token, run=run, name="check")
    got, stop, caught = [], asyncio.Event(), asyncio.Event()

    async def on(event):
        got.append(event)

    task = asyncio.create_task(bus.replay(names, on, stop=stop, caught_up=caught))
    await asyncio.wait_for(caught.wait(), 30)
    stop.set()
    await task
    await bus.close()
    return got


def prompts(calls: list[schemas.CallCompleted]) -> dict[str, tuple[int, ...]]:
    """call id → its whole prompt: the parent's prompt + completion cut at `prefix_len`, then
    the call's own prompt ids."""
    out: dict[str, tuple[int, ...]] = {}
    by_call = {c.call: c for c in calls}
    for c in sorted(calls, key=lambda c: (c.execution, c.seq)):
        parent = by_call.get(c.parent_call) if c.parent_call else None
        head = () if parent is None else (out[parent.call] + parent.tokens.completion_ids)[:c.prefix_len]
        out[c.call] = head + c.tokens.prompt_ids
    return out


async def test_moved_executions_next_calls_prefill_only_new_tokens_with_the_twins_logprobs(
        nats_server, run_id, tmp_path, model_dir):
    async with Cells(nats_server, run_id, tmp_path, model_dir) as cells, aiohttp.ClientSession() as http:
        cells.recipe.write_text(cells.recipe.read_text() + f"\n[sampling]\nmax_tokens = {LONG}\n")
        for cell in ("cell0", "cell1"):
            cells.start(cell)
        await cells.until(lambda: {"cell0", "cell1"} <= set(cells.roles), "both cells to announce", 120)
        url = {e.cell: e.engine_url for e in cells.facts["cell.switched"]}
        stop, task, started = await _serving(ProxyConfig(
            run=run_id, key_secret=SECRET, nats_url=nats_server.url, nats_token=nats_server.token,
            engine_token=TOKEN, retry_backoff_s=0.05, retry_backoff_max_s=0.2, shutdown_grace_s=5.0))
        state = started["state"]
        clients = {e: openai.AsyncOpenAI(base_url=started["url"] + "/v1", api_key=execution_key(SECRET, e),
                                         max_retries=0) for e in ("e1", "e2")}
        try:
            await cells.bus.publish(schemas.RouteUpdated(event_id=ids.route(run_id, 0), seq=0, routes=(
                schemas.Route(execution="e1", cell="cell1"), schemas.Route(execution="e2", cell="cell1"))))

            async def proxy_knows() -> bool:
                return len(state.router.cells) == 2 and len(state.router.routes) == 2
            await until(proxy_knows, "the proxy to learn the cells and routes")

            first = {e: [{"role": "user", "content": f"Write a short poem about {topic}."}]
                     for e, topic in (("e1", "rivers"), ("e2", "mountains"))}
            answers = {}
            for e in ("e1", "e2"):
                r = await clients[e].chat.completions.create(model="m", messages=first[e], temperature=0, max_tokens=8)
                answers[e] = r.choices[0].message.content or ""
            second = {e: first[e] + [{"role": "assistant", "content": answers[e]},
                                     {"role": "user", "content": "Now one more line, please."}] for e in first}

            # e2's next call is in flight (its prefill done, decoding) when cell1 leaves rollout
            before1 = await counters(http, url["cell1"])
            in_flight = asyncio.ensure_future(clients["e2"].chat.completions.create(
                model="m", messages=second["e2"], temperature=0, max_tokens=LONG))

            async def decoding() -> bool:
                now = await counters(http, url["cell1"])
                return now["in_flight"] == 1 and now["prefill_tokens"] > before1["prefill_tokens"]
            await until(decoding, "e2's call to decode at cell1")
            at0, at1 = await counters(http, url["cell0"]), await counters(http, url["cell1"])
            moved = (schemas.Route(execution="e1", cell="cell0", reason="cell1 to training"),
                     schemas.Route(execution="e2", cell="cell0", reason="cell1 to training"))
            await cells.bus.publish(schemas.RouteUpdated(event_id=ids.route(run_id, 1), seq=1, routes=moved))
            await cells.bus.publish(schemas.CellSwitch(
                event_id=ids.switch(run_id, "cell1", 0), cell="cell1", seq=0, from_role="rollout",
                to_role="training", reason="water level", moved=moved, route_seq=1))
            cells.switch_seq["cell1"] += 1
            r2 = await asyncio.wait_for(in_flight, 120)  # the harness sees a normal answer
            assert r2.choices[0].finish_reason in ("length", "stop")
            after_e2 = await counters(http, url["cell0"])
            await cells.until(lambda: cells.roles.get("cell1") == "training", "cell1 to train")
            async with http.post(url["cell1"] + "/generate", json={"input_ids": [1, 2, 3]},
                                 headers={"Authorization": f"Bearer {TOKEN}"}) as r:
                cell1_after = r.status

            r1 = await clients["e1"].chat.completions.create(model="m", messages=second["e1"], temperature=0,
                                                             max_tokens=8)
            assert r1.choices[0].message.content is not None
            after_e1 = await counters(http, url["cell0"])
            metrics0 = _samples(scrape(recorded_urls(cells.run_dir)["cell0"]))
            calls = await Stack(None, cells.bus, run_id).calls(4, timeout_s=30)
        finally:
            for c in clients.values():
                await c.close()
            stop.set()
            await asyncio.wait_for(task, 30)
        retries = dict(state.engines.retries)

        switched = [e for e in cells.facts["cell.switched"] if e.cell == "cell1" and e.seq == 0
                    and e.to_role == "training"]
        kv = await facts(nats_server, run_id, ["kv.offered", "kv.pulled"])

    # one recorded call per call, every one ok with drift 0; the moved ones served at cell0
    by = {(c.execution, c.seq): c for c in calls}
    assert sorted(by) == [("e1", 0), ("e1", 1), ("e2", 0), ("e2", 1)], sorted(by)
    assert [(c.status, c.drift) for c in calls] == [("ok", 0)] * 4
    assert [by[k].cell for k in sorted(by)] == ["cell1", "cell0", "cell1", "cell0"]
    assert retries == {"rerouted": 1}  # e2's call, cut at cell1 by the route

    # cell1 offered both prefixes to cell0, which pulled and kept them; its switch reports the bytes
    (offer,) = [e for e in kv if isinstance(e, schemas.KvOffered)]
    pulled = [e for e in kv if isinstance(e, schemas.KvPulled)]
    assert (offer.cell, offer.seq, offer.route_seq) == ("cell1", 0, 1)
    assert sorted((b.execution, b.to_cell) for b in offer.blocks) == [("e1", "cell0"), ("e2", "cell0")]
    assert sorted((p.execution, p.cell, p.error) for p in pulled) == [("e1", "cell0", ""), ("e2", "cell0", "")]
    assert {p.execution: p.bytes for p in pulled} == {b.execution: b.bytes for b in offer.blocks}
    assert {p.execution: p.tokens for p in pulled} == {b.execution: b.tokens for b in offer.blocks}
    (done,) = switched  # one bytes dict: the engine freed, the KV its executions' new cell pulled
    assert set(done.bytes) == {"live_before", "freed", "live_after", "pulled_weights", "pulled_kv"}, done.bytes
    assert done.bytes["pulled_kv"] == sum(p.bytes for p in pulled) > 0
    assert done.bytes["freed"] > done.bytes["pulled_kv"], done.bytes  # the weights and those KV caches
    assert cell1_after == 503  # released: moved KV went out before the engine's state was freed
    imported = after_e1["kv_imported_tokens"] - at0["kv_imported_tokens"]
    assert imported == sum(p.tokens for p in pulled) > 0
    assert _total(metrics0, "gyre_engine_kv_imported_tokens_total") == after_e1["kv_imported_tokens"]
    assert _total(metrics0, "gyre_engine_prefill_tokens_total") == after_e1["prefill_tokens"]

    # the unmigrated twin: the same calls on one engine, no switch
    parent_prompt = prompts(calls)
    twin = Engine(EngineConfig(model_dir=model_dir, max_completion_tokens=LONG))
    prefill = {}
    for c in sorted(calls, key=lambda c: (c.execution, c.seq)):
        sp = SamplingParams(temperature=0.0, max_new_tokens=c.sampling.max_tokens)
        res = twin.generate(GenerateRequest(rid=c.call, input_ids=parent_prompt[c.call], sampling=sp,
                                            execution=c.execution))
        assert res.output_ids == c.tokens.completion_ids, c.call
        np.testing.assert_allclose(res.logprobs, c.tokens.logprobs, rtol=0, atol=1e-5, err_msg=c.call)
        prefill[(c.execution, c.seq)] = res.prefilled_tokens
    e1_blocks = next(b for b in offer.blocks if b.execution == "e1")
    e1_first = by[("e1", 0)]
    assert e1_blocks.tokens == len(parent_prompt[e1_first.call]) + len(e1_first.tokens.completion_ids) - 1

    # e1's next call, at cell0 after the import: only its new tokens, as in the twin
    e1_next = after_e1["prefill_tokens"] - after_e2["prefill_tokens"]
    assert e1_next == prefill[("e1", 1)] < len(parent_prompt[by[("e1", 1)].call]), (e1_next, prefill)
    # e2's call cut mid-decode: its prompt was prefilled at cell1 (as in the twin), and cell0,
    # holding the retry until the import landed, ran only the last prompt id (for its logits)
    assert at1["prefill_tokens"] - before1["prefill_tokens"] == prefill[("e2", 1)] > 1
    assert after_e2["prefill_tokens"] - at0["prefill_tokens"] == 1
