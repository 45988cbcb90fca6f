"""The proxy restarts without loss after kill -9 (issue 52): a real proxy process (`gyre
proxy --run-dir`) is SIGKILLed while it holds a call it answered whose `call.completed`
JetStream has not acknowledged (the nats-server is down: nothing reaches the bus, and
`retry_timeout_s` is far off, so nothing is spilled) and while a call is in flight at the
engine. Its successor publishes the answered call from the journal before it serves and
numbers the execution's next call after it; the audit (calls counted on the client side:
the toy harness's own lines) finds nothing lost. Before the journal this record was lost:
the spill file is written only when a publish fails for good or at a stop.
"""
from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys

import orjson
import pytest

from bus import Bus
from bus.server import NatsServer
from gyre.config import load_recipe
from gyre.env.harness import HARNESS_DIR, execution_key
from gyre.serving.tokenizer import build_tokenizer
from handlers.audit import audit
from handlers.engines.scripted import ScriptedEngine
from handlers.proxy import journal
from tests.crash import ROOT, Daemons, make_run_dir, until

_ANSWERED = re.compile(r"^toy_harness: call \d+: ", re.MULTILINE)


def _harness(run_dir, url: str, execution: str, calls: int) -> subprocess.Popen:
    """The toy harness (a real OpenAI-style client) for `execution`, its output in the run's
    `logs/executions/<execution>.log` as the runner keeps it (the audit counts its lines)."""
    work = run_dir / "workspaces" / execution
    work.mkdir(parents=True, exist_ok=True)
    (work / "task.md").write_text("What is 2 + 2?")
    key = execution_key(bytes.fromhex((run_dir / "key_secret").read_text()), execution)
    env = {"PATH": os.environ.get("PATH", ""), "OPENAI_BASE_URL": url, "OPENAI_API_KEY": key}
    with open(run_dir / "logs" / "executions" / f"{execution}.log", "ab") as log:
        return subprocess.Popen([sys.executable, str(HARNESS_DIR / "toy_harness.py"), "--task-file", "task.md",
                                 "--model", "policy", "--calls", str(calls), "--timeout", "60"], cwd=work, env=env,
                                stdout=log, stderr=subprocess.STDOUT)


def _proxy(daemons: Daemons, engine_url: str) -> subprocess.Popen:
    with open(daemons.run_dir / "logs" / "proxy.log", "ab") as log:
        proc = subprocess.Popen([sys.executable, "-m", "handlers.proxy", "--run-dir", str(daemons.run_dir),
                                 "--log-json", "--engine-url", engine_url], stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=daemons.env, cwd=ROOT, start_new_session=True)
    daemons.procs["proxy"] = proc
    return proc


def _url(run_dir) -> str:
    try:
        return orjson.loads((run_dir / "proxy.json").read_bytes())["v1"]
    except (OSError, orjson.JSONDecodeError, KeyError):
        return ""


@pytest.mark.slow  # 60-130 s here: two proxy starts (10-25 s each) and a nats-server restart
async def test_a_proxy_killed_holding_an_answered_unacknowledged_call_and_one_in_flight_loses_no_record(
        run_id, tmp_path):
    from gyre.serving.model import ModelSpec, init_model

    recipe = load_recipe("toy")
    server = NatsServer.start(tmp_path / "nats")
    port = int(server.url.rsplit(":", 1)[1])
    run_dir = make_run_dir(tmp_path / run_id, run_id, server, recipe)
    (run_dir / "logs" / "executions").mkdir(parents=True)
    m = recipe.model
    init_model(run_dir / "model", ModelSpec(layers=m.layers, hidden=m.hidden, heads=m.heads, kv_heads=m.kv_heads,
                                            head_dim=m.hidden // m.heads, intermediate=3 * m.hidden, seed=m.seed))
    engine = ScriptedEngine(build_tokenizer(), ["The answer is 4."])
    await engine.start()
    daemons = Daemons(run_dir)
    harnesses: list[subprocess.Popen] = []
    bus = None
    try:
        proxy = _proxy(daemons, engine.url)
        await until(lambda: _url(run_dir), "the proxy to serve", 90, check=daemons.alive)
        url = _url(run_dir)
        await until(lambda: _stored_once(server, run_id), "the bus to answer", 10)

        server.stop()  # the bus is down: no record of what follows reaches it
        done = _harness(run_dir, url, "s0-g0-e0", calls=1)
        harnesses.append(done)
        assert await asyncio.to_thread(done.wait, 60) == 0
        engine.gate = asyncio.Event()  # the next generation stays in flight
        cut = _harness(run_dir, url, "s0-g0-e1", calls=1)
        harnesses.append(cut)
        await until(lambda: len(engine.requests) == 2, "the second call to reach the engine", 30)

        # Unfinished work: an answered call whose record only the proxy holds (its journal has
        # it, the spill file not), and a call in flight.
        items, _ = journal.read(run_dir / "proxy-journal")
        assert [i["event"]["call"] for i in items] == ["s0-g0-e0:0"]
        assert not (run_dir / "proxy-unpublished.jsonl").exists()
        assert cut.poll() is None
        assert daemons.kill9("proxy") == -9
        # The toy harness does not retry a dropped connection: that execution fails.
        assert await asyncio.to_thread(cut.wait, 30) == 1
        assert "call 0 failed" in (run_dir / "logs" / "executions" / "s0-g0-e1.log").read_text()

        server = NatsServer.start(tmp_path / "nats", port=port, token=server.token)
        proxy = _proxy(daemons, engine.url)
        await until(lambda: daemons.log("proxy").count('"event":"proxy.started"') == 2,
                    "the restarted proxy to serve", 120, check=daemons.alive)
        log = daemons.log("proxy")
        assert "proxy.journal.republished" in log, log[-3000:]
        url = _url(run_dir)
        engine.gate = None
        again = _harness(run_dir, url, "s0-g0-e0", calls=1)  # the execution's next call: seq 1, not 0 again
        fresh = _harness(run_dir, url, "s0-g1-e0", calls=2)
        harnesses += [again, fresh]
        assert await asyncio.to_thread(again.wait, 60) == 0
        assert await asyncio.to_thread(fresh.wait, 60) == 0

        bus = await Bus.connect(server.url, token=server.token, run=run_id, name="test")
        await until(lambda: _calls(bus, 4), "every answered call stored", 30)
        proxy.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(proxy.wait, 30) == 0
        assert journal.segments(run_dir / "proxy-journal") == []  # a clean stop leaves no journal

        stored = {e.call: e for e in await bus.stored_events(["call.completed"])}
        assert sorted(stored) == ["s0-g0-e0:0", "s0-g0-e0:1", "s0-g1-e0:0", "s0-g1-e0:1"]
        assert stored["s0-g0-e0:0"].status == "ok" and stored["s0-g0-e0:0"].tokens.completion_ids
        answered = {e: len(_ANSWERED.findall((run_dir / "logs" / "executions" / f"{e}.log").read_text()))
                    for e in ("s0-g0-e0", "s0-g0-e1", "s0-g1-e0")}  # (the harness ran twice for s0-g0-e0)
        assert answered == {"s0-g0-e0": 2, "s0-g0-e1": 0, "s0-g1-e0": 2}
        result = await audit(bus, run_dir, answered=answered)
        assert result.calls_answered == 4 and result.calls_lost == 0, result
    finally:
        for h in harnesses:
            if h.poll() is None:
                h.kill()
        daemons.stop()
        if bus is not None:
            await bus.close()
        await engine.stop()
        server.stop()


async def _stored_once(server, run: str) -> bool:
    bus = await Bus.connect(server.url, token=server.token, run=run, name="probe")
    try:
        await bus.ensure_streams()
        return True
    finally:
        await bus.close()


async def _calls(bus: Bus, n: int) -> bool:
    return len(await bus.stored_ids("call.completed")) >= n
