"""Harness continuity across a switch (DESIGN.md "Elastic scheduling"; issue 49's acceptance):
real, unmodified harnesses run by the real runner (confined, as `gyre run` launches them)
through the proxy daemon to two cell processes (`python -m handlers.cell`) on a real
nats-server; the test plays the scheduler. While a harness's call is in flight at cell1,
the scheduler's `route.updated` moves the execution to cell0 (the cell that stays in
rollout) and `cell.switch` sends cell1 to training, as handlers/scheduler.py publishes them.

What must hold: the harness sees no error and exits 0 (`execution.finished` ok, exit code
0; no proxy response to it is a 4xx/5xx), the proxy counts the cut call's retry (`rerouted`), every call is recorded once (call
ids and seqs unique in `call.completed`), every call recorded `ok` has drift 0, and the cut
call itself is recorded at cell0 only.

The switch lands mid-call for sure:
- Claude Code against the scripted engine behind each cell: cell1's playbook holds every
  answer (`hold_s`, far longer than the test), so its first call can only end by being cut;
  the test publishes the switch once the proxy has that call running at cell1 and cell1's
  engine reports it in flight. cell0's playbook drives Claude Code to write add.py.
- mini-swe-agent on embedded-engine cells (a tiny random model): the switch is published
  once cell1's engine has prefilled the call and is decoding it (its counters), with a
  completion budget of many tokens still to decode; the test then asserts that this call
  was the one cut and retried (recorded once, at cell0). Slow (2-4 minutes here).
"""
from __future__ import annotations

import asyncio
import json
from pathlib import Path

import aiohttp
import pytest
from prometheus_client import REGISTRY

import schemas
from handlers import runner as runner_mod
from handlers.engines.scripted import tool_call
from handlers.proxy.daemon import Config as ProxyConfig
from handlers.runner import Config as RunnerConfig
from handlers.runner import Paths
from schemas import ids
from tests.replicas import Cells
from tests.test_engine import build_tiny_model
from tests.test_harnesses import ADD_PY, SECRET, TASK, wanted
from tests.test_proxy import Stack as ProxyStack
from tests.test_proxy import _serving

pytestmark = pytest.mark.harness

TOKEN = "replicas-test-engine-token"  # tests.replicas.Cells' engine token
HELD = "held at cell1"  # cell1's scripted answer, never sent: the switch cuts it first


@pytest.fixture
def statuses(monkeypatch) -> list[tuple[str, str, int]]:
    """(method, path, status) of every response the proxy daemon sends a harness: its app
    as `handlers.proxy.app.start` makes it, with a recorder added."""
    from handlers.proxy import app as proxy_app

    seen: list[tuple[str, str, int]] = []
    make = proxy_app.make_app

    def recording(state):
        app = make(state)

        async def record(request, response) -> None:
            seen.append((request.method, request.path, response.status))
        app.on_response_prepare.append(record)
        return app
    monkeypatch.setattr(proxy_app, "make_app", recording)
    return seen


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("continuity") / "m", seed=5)


def retries(reason: str) -> float:
    return REGISTRY.get_sample_value("gyre_proxy_retries_total", {"reason": reason}) or 0.0


async def engine_info(http: aiohttp.ClientSession, url: str) -> dict:
    async with http.get(url + "/get_model_info", headers={"Authorization": f"Bearer {TOKEN}"}) as r:
        return await r.json()


class Run:
    """Two cells, the proxy daemon, the runner and the test's bus follower of one run."""

    def __init__(self, cells: Cells, nats_server, run_id: str, run_dir: Path, proxy: ProxyConfig):
        self.cells, self.nats, self.run_id, self.run_dir, self.proxy_cfg = cells, nats_server, run_id, run_dir, proxy
        self.finished: dict[str, schemas.ExecutionFinished] = {}
        self.stop = asyncio.Event()
        self._bg: list[asyncio.Task] = []

    async def start(self) -> None:
        await self.cells.until(lambda: {"cell0", "cell1"} <= set(self.cells.roles), "both cells to announce", 180)
        self.url = {e.cell: e.engine_url for e in self.cells.facts["cell.switched"]}
        self.proxy_stop, self.proxy_task, started = await _serving(self.proxy_cfg)
        self.state, proxy_url = started["state"], started["url"]
        tasks = self.run_dir.parent / "tasks.jsonl"
        tasks.write_text(json.dumps(TASK) + "\n")
        rcfg = RunnerConfig(run=self.run_id, nats_url=self.nats.url, nats_token=self.nats.token, run_dir=self.run_dir,
                            tasks=str(tasks), key_secret=SECRET.hex(), proxy_url=proxy_url, concurrency=4)
        self._bg.append(asyncio.create_task(runner_mod.run(rcfg, self.stop)))
        self._bg.append(asyncio.create_task(self.cells.bus.replay(["execution.finished"], self._seen, stop=self.stop,
                                                                  poll_s=0.2)))

    async def _seen(self, event) -> None:
        if isinstance(event, schemas.ExecutionFinished):
            self.finished[event.info.execution] = event

    async def dispatch(self, execution: str, profile: str, *, timeout_s: float, max_calls: int) -> None:
        """The scheduler's dispatch: the execution's route to cell1, then `execution.dispatched`."""
        await self.cells.bus.publish(schemas.RouteUpdated(event_id=ids.route(self.run_id, 0), seq=0, routes=(
            schemas.Route(execution=execution, cell="cell1"),)))
        info = schemas.ExecutionInfo(execution=execution, task="add", group="s0-g0", step=0, harness=profile,
                                     group_size=1, step_groups=1)
        await self.cells.bus.publish(schemas.ExecutionDispatched(
            event_id=ids.dispatched(self.run_id, execution), info=info, timeout_s=timeout_s, max_calls=max_calls))

    def running_at(self, execution: str, cell: str) -> bool:
        return any(a.cell == cell for a in self.state.router.running.get(execution, ()))

    async def wait_until(self, execution: str, ready, what: str) -> None:
        """Poll `ready()` every 20 ms (up to 120 s) while the execution runs; fail with its log
        if it finishes first or `ready` never holds."""
        for _ in range(6000):
            if await ready():
                return
            assert execution not in self.finished, self.log(execution)
            await asyncio.sleep(0.02)
        raise AssertionError(f"{what}\n{self.log(execution)}")

    async def switch_cell1(self, execution: str) -> None:
        """The scheduler's switch of cell1: the reroute of its execution to cell0, then the switch."""
        moved = (schemas.Route(execution=execution, cell="cell0", reason="cell1 to training"),)
        await self.cells.bus.publish(schemas.RouteUpdated(event_id=ids.route(self.run_id, 1), seq=1, routes=moved))
        await self.cells.bus.publish(schemas.CellSwitch(
            event_id=ids.switch(self.run_id, "cell1", 0), cell="cell1", seq=0, from_role="rollout",
            to_role="training", reason="water level", moved=moved, route_seq=1))
        self.cells.switch_seq["cell1"] += 1

    async def wait_finished(self, execution: str, bound_s: float) -> schemas.ExecutionFinished:
        async def poll():
            while execution not in self.finished:
                await asyncio.sleep(0.2)
        await asyncio.wait_for(poll(), bound_s)
        return self.finished[execution]

    async def recorded(self, execution: str) -> list[schemas.CallCompleted]:
        """Every `call.completed` of the run, once the bus holds as many as the proxy served;
        nothing more arrives after them."""
        served = self.state.executions[execution].next_seq
        reader = ProxyStack(None, self.cells.bus, self.run_id)
        calls = await reader.calls(served, timeout_s=30)
        with pytest.raises(asyncio.TimeoutError):
            await reader.calls(1, timeout_s=1.0)
        return calls

    def log(self, execution: str) -> str:
        path = Paths.of(self.run_dir, execution).log
        return (path.read_text(errors="replace")[-4000:] if path.exists() else "(no log)") + self.cells.logs()

    async def close(self) -> None:
        self.stop.set()
        await asyncio.gather(*self._bg, return_exceptions=True)
        self.proxy_stop.set()
        await asyncio.wait_for(self.proxy_task, 30)


def assert_continuity(run: Run, execution: str, done: schemas.ExecutionFinished, calls: list[schemas.CallCompleted],
                      rerouted_before: float, statuses: list[tuple[str, str, int]]) -> None:
    assert (done.status, done.exit_code) == ("ok", 0), f"{done.status} {done.exit_code}\n{run.log(execution)}"
    assert statuses and not [s for s in statuses if s[2] >= 400], statuses  # the harness was never answered an error
    assert calls and all(c.execution == execution for c in calls)
    assert len({c.call for c in calls}) == len(calls), [c.call for c in calls]  # no call recorded twice
    assert sorted(c.seq for c in calls) == list(range(len(calls)))
    bad = [(c.seq, c.status, c.drift) for c in calls if c.status != "ok" or c.drift]
    assert not bad, bad  # every call answered ok, drift 0
    assert run.state.engines.retries.get("rerouted", 0) >= 1, run.state.engines.retries
    assert retries("rerouted") - rerouted_before >= 1


def playbooks(tmp: Path, ws: Path) -> tuple[Path, Path]:
    """cell0's playbook (Claude Code writes add.py, then says it is done; any side call is
    answered OK) and cell1's (every answer held far beyond the test)."""
    cell0, cell1 = tmp / "cell0.jsonl", tmp / "cell1.jsonl"
    rules0 = [{"name": "main", "execution": "cc", "first": "add.py", "turns": [
                  tool_call("Write", {"file_path": str(ws / "add.py"), "content": ADD_PY}),
                  "The task is complete: add.py defines add(a, b)."]},
              {"name": "side", "turns": ["OK"]}]
    cell0.write_text("".join(json.dumps(r) + "\n" for r in rules0))
    cell1.write_text(json.dumps({"name": "held", "turns": [HELD], "hold_s": 600}) + "\n")
    return cell0, cell1


async def test_claude_code_on_scripted_cells_goes_on_through_a_switch_mid_call(
        nats_server, run_id, tmp_path, sandbox_dir, model_dir, statuses):
    wanted(["claude-code"])
    run_dir = sandbox_dir / "run"
    ex = "cc"
    script0, script1 = playbooks(tmp_path, Paths.of(run_dir, ex).workspace)
    async with Cells(nats_server, run_id, tmp_path, model_dir) as cells, aiohttp.ClientSession() as http:
        base = cells.recipe.read_text()
        for cell, script in (("cell0", script0), ("cell1", script1)):  # each cell its own playbook
            cells.recipe = tmp_path / f"recipe-{cell}.toml"
            cells.recipe.write_text(base + f'\n[engine]\nkind = "scripted"\nscript = "{script}"\n')
            cells.start(cell)
        run = Run(cells, nats_server, run_id, run_dir, ProxyConfig(
            run=run_id, key_secret=SECRET, nats_url=nats_server.url, nats_token=nats_server.token,
            engine_token=TOKEN, retry_backoff_s=0.05, retry_backoff_max_s=0.2, shutdown_grace_s=5.0))
        await run.start()
        try:
            before = retries("rerouted")
            await run.dispatch(ex, "claude-code", timeout_s=150.0, max_calls=8)

            async def held() -> bool:
                return run.running_at(ex, "cell1") and (await engine_info(http, run.url["cell1"]))["in_flight"] >= 1
            await run.wait_until(ex, held, "Claude Code's call never reached cell1")
            await run.switch_cell1(ex)
            done = await run.wait_finished(ex, 150.0)
            calls = await run.recorded(ex)
            await cells.until(lambda: cells.roles.get("cell1") == "training", "cell1 to train")
        finally:
            await run.close()

    assert_continuity(run, ex, done, calls, before, statuses)
    assert (Paths.of(run_dir, ex).workspace / "add.py").read_text() == ADD_PY, run.log(ex)
    # The held call was cut at cell1 and answered at cell0: every call recorded is cell0's,
    # never at cell1 (whose held answer never went out).
    assert [c.cell for c in calls] == ["cell0"] * len(calls), [(c.seq, c.cell) for c in calls]


LONG = 160  # the completion budget of every call: the cut call has most of it left to decode


@pytest.mark.slow  # 2-4 min on 2 busy cores: two embedded-engine cells, two 160-token calls
async def test_mini_swe_agent_on_embedded_cells_goes_on_through_a_switch_mid_call(
        nats_server, run_id, tmp_path, sandbox_dir, model_dir, statuses):
    wanted(["mini-swe-agent"])
    run_dir = sandbox_dir / "run"
    ex = "mini"
    async with Cells(nats_server, run_id, tmp_path, model_dir) as cells, aiohttp.ClientSession() as http:
        cells.recipe.write_text(cells.recipe.read_text() + f"\n[sampling]\nmax_tokens = {LONG}\n")
        for cell in ("cell0", "cell1"):
            cells.start(cell)
        run = Run(cells, nats_server, run_id, run_dir, ProxyConfig(
            run=run_id, key_secret=SECRET, nats_url=nats_server.url, nats_token=nats_server.token,
            engine_token=TOKEN, max_completion_tokens=LONG, retry_backoff_s=0.05, retry_backoff_max_s=0.2,
            shutdown_grace_s=5.0))
        await run.start()
        try:
            before = retries("rerouted")
            # each call decodes LONG tokens: 2-60 s on a tiny CPU model, by the machine's load
            await run.dispatch(ex, "mini-swe-agent", timeout_s=300.0, max_calls=2)

            async def decoding() -> bool:  # cell1 has prefilled mini-swe-agent's first call and decodes it
                if not run.running_at(ex, "cell1"):
                    return False
                info = await engine_info(http, run.url["cell1"])
                return info["in_flight"] == 1 and info["counters"]["prefill_tokens"] > 0
            await run.wait_until(ex, decoding, "mini-swe-agent's call never reached cell1")
            await run.switch_cell1(ex)
            done = await run.wait_finished(ex, 320.0)
            calls = await run.recorded(ex)
            await cells.until(lambda: cells.roles.get("cell1") == "training", "cell1 to train")
        finally:
            await run.close()

    assert_continuity(run, ex, done, calls, before, statuses)
    # The call cut mid-decode at cell1 was answered at cell0, and so was every later one: had
    # the switch come after it ended, it would be recorded at cell1.
    assert [c.cell for c in calls] == ["cell0"] * len(calls), [(c.seq, c.cell) for c in calls]
    assert len(calls) >= 2, [(c.seq, c.finish_reason) for c in calls]


async def test_a_held_playbook_answer_stays_in_flight_until_aborted():
    """`hold_s`: the scripted engine keeps the answer in flight (reported on
    /get_model_info) until its hold ends or the request is aborted (finish `abort`, no ids)."""
    from gyre.serving.tokenizer import build_tokenizer
    from handlers.engines.scripted import Playbook, Rule, ScriptedEngine

    tok = build_tokenizer()
    with pytest.raises(ValueError):
        Rule(turns=("x",), hold_s=-1)
    engine = ScriptedEngine(tok, callback=Playbook([Rule(execution="held", turns=("never",), hold_s=600),
                                                    Rule(turns=("at once",))]).callback(tok))
    await engine.start()
    try:
        async with aiohttp.ClientSession() as http:
            async def generate(execution: str) -> dict:
                body = {"input_ids": [1, 2, 3], "rid": execution, "gyre_execution": execution}
                async with http.post(engine.url + "/generate", json=body) as r:
                    return await r.json()
            held = asyncio.ensure_future(generate("held"))
            for _ in range(500):
                if (await (await http.get(engine.url + "/get_model_info")).json())["in_flight"] == 1:
                    break
                await asyncio.sleep(0.01)
            assert (await generate("other"))["text"] == "at once"  # other rules are not held
            assert not held.done()
            async with http.post(engine.url + "/abort_request", json={"rid": "held"}) as r:
                assert (await r.json())["aborted"] == 1
            answer = await asyncio.wait_for(held, 5)
            assert answer["meta_info"]["finish_reason"]["type"] == "abort" and answer["output_ids"] == []
    finally:
        await engine.stop()
