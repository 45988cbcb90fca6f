"""Every daemon of a run restarts without loss after kill -9 (issue 52), in one shared run.

A seeded elastic toy run on two cells, every daemon a real process on a real nats-server. A
watcher per daemon SIGKILLs it once, at a moment it holds unfinished work (asserted when the
kill lands, and recorded), then restarts it after 1 s as a supervisor would:
- scheduler: executions it dispatched are in flight (not finished);
- runner: a harness it launched is running, one call answered (no record yet);
- evaluator: it is grading a workspace (its graded copy exists, no result recorded);
- builder: it took every stored call of a step that is not sealed (acked: in its memory only);
- a cell in rollout: executions routed to it are running, mid-conversation;
- the core cell: the ledger granted a micro-step of a step that is not completed;
- proxy: a harness it answered is mid-conversation (its next call fails on the dropped
  connection: the toy harness does not retry); the calls it answered whose records the bus
  had not acknowledged are in its journal, published by its successor.
The run must then complete every step, and the audit (handlers.audit) must find no call lost,
no sample or micro-step counted twice and no execution dispatched twice.
The builder's own test (tests/test_crash_builder.py) checks its micro-steps' content too;
tests/test_crash_proxy.py and tests/test_crash_satellite.py kill a proxy holding an
unacknowledged answered call and a satellite holding a grant.
"""
from __future__ import annotations

import asyncio
import collections
import json
import time
from pathlib import Path

import orjson
import pytest

import schemas
from bus import Bus
from gyre.config import load_recipe
from handlers.audit import audit
from handlers.bench.chaos import MODULES, current_process
from tests.crash import Daemons, make_run_dir, until

STEPS = 3


def _trace(run_dir: Path) -> list[dict]:
    out = []
    try:
        text = (run_dir / "trace.jsonl").read_text()
    except OSError:
        return out
    for line in text.splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return out


def _in_flight(run_dir: Path) -> dict[str, str]:
    """execution → cell, of the executions the scheduler's trace dispatched and not finished."""
    placed, done = {}, set()
    for x in _trace(run_dir):
        if x.get("action") == "dispatch":
            placed.update({e[0]: e[-1] for e in x["executions"]})  # [execution, slot, cell]
        elif x.get("fact") == "execution.finished":
            done.add(x.get("execution"))
    return {e: c for e, c in placed.items() if e not in done}


def _text(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def _log_executions(text: str, event: str) -> set[str]:
    out = set()
    for line in text.splitlines():
        if event in line:
            try:
                out.add(orjson.loads(line)["execution"])
            except (orjson.JSONDecodeError, KeyError):
                pass
    return out


@pytest.mark.slow
async def test_every_daemon_killed_mid_work_restarts_and_the_run_completes_without_loss(nats_server, run_id,
                                                                                       tmp_path):
    from gyre.serving.model import ModelSpec, init_model

    recipe = load_recipe("toy", {"run.mode": "elastic", "run.steps": STEPS, "cells.count": 2, "cells.capacity": 4,
                                 "tasks.group_size": 4, "tasks.groups_per_step": 2})
    run_dir = make_run_dir(tmp_path / run_id, run_id, nats_server, recipe)
    m = recipe.model
    init_model(run_dir / "model", ModelSpec(layers=m.layers, hidden=m.hidden, heads=m.heads, kv_heads=m.kv_heads,
                                            head_dim=m.hidden // m.heads, intermediate=3 * m.hidden, seed=m.seed))
    bus = await Bus.connect(nats_server.url, token=nats_server.token, run=run_id, name="test")
    await bus.ensure_streams()
    daemons = Daemons(run_dir)
    for name in MODULES:  # proxy, runner, evaluator, builder, cell0, cell1, scheduler, as `gyre run` orders them
        daemons.start(name)

    facts: dict[str, list] = collections.defaultdict(list)
    stopped = asyncio.Event()

    async def on(event):
        facts[type(event).__name__].append(event)

    follower = asyncio.create_task(bus.replay(
        [schemas.StepCompleted.NAME, schemas.StepSealed.NAME, schemas.MicrostepGranted.NAME,
         schemas.MicrostepCommitted.NAME, schemas.CallCompleted.NAME, schemas.CellSwitched.NAME], on, stop=stopped))
    kills: dict[str, dict] = {}
    lock = asyncio.Lock()

    def completed() -> set[int]:
        return {e.step for e in facts["StepCompleted"]}

    async def kill_when(name: str, holding, target: str | None = None) -> None:
        """SIGKILL `target` (default `name`) once `holding()` names the work it holds; restart it 1 s later."""
        target = target or name
        while len(completed()) < STEPS:
            async with lock:
                work = holding()
                if asyncio.iscoroutine(work):
                    work = await work
                if work:
                    t0 = time.monotonic()
                    assert daemons.kill9(target) == -9
                    kills[name] = {"daemon": target, "holding": work, "at_step": len(completed())}
                    await asyncio.sleep(1.0)
                    daemons.start(target)
                    kills[name]["restart_s"] = round(time.monotonic() - t0, 2)
                    return
            await asyncio.sleep(0.05)

    def scheduler_holds():
        return sorted(_in_flight(run_dir)) if len(_in_flight(run_dir)) >= 2 else None

    def running() -> list[str]:
        """Executions whose harness runs and has had an answer (mid-conversation)."""
        started = _log_executions(current_process(daemons.log("runner")), "runner.harness.started")
        return sorted(e for e in started if not (run_dir / "runner" / f"{e}.json").exists()
                      and "toy_harness: call 0:" in _text(run_dir / "logs" / "executions" / f"{e}.log"))

    def runner_holds():
        return running() or None

    def evaluator_holds():
        grading = sorted(p.name for p in (run_dir / "eval").glob("*") if (p / "a0").exists()
                         and not (run_dir / "evaluator" / f"{p.name}.json").exists()) if (run_dir / "eval").exists() else []
        return grading or None

    async def builder_holds():
        sealed = {e.step for e in facts["StepSealed"]}
        open_steps = {int(c.execution.split("-")[0][1:]) for c in facts["CallCompleted"]} - sealed
        if not open_steps or await bus.consumer_backlog("builder-calls-v1") != 0:
            return None
        return {"unsealed_steps_with_calls": sorted(open_steps), "calls": len(facts["CallCompleted"])}

    def rollout_cell_holds(cell: str):
        on_cell = {e for e, c in _in_flight(run_dir).items() if c == cell}
        return [e for e in running() if e in on_cell] or None

    def core_holds():
        done = completed()
        committed = {(e.epoch, e.step, e.microstep) for e in facts["MicrostepCommitted"]}
        held = sorted({(e.step, e.microstep) for e in facts["MicrostepGranted"]
                       if e.step not in done and (e.epoch, e.step, e.microstep) not in committed})
        return held or None

    watchers = [asyncio.create_task(kill_when(*w)) for w in (
        ("scheduler", scheduler_holds), ("runner", runner_holds), ("evaluator", evaluator_holds),
        ("builder", builder_holds), ("cell-in-rollout", lambda: rollout_cell_holds("cell1"), "cell1"),
        ("core-in-training", core_holds, "cell0"), ("proxy", runner_holds))]
    try:
        await until(lambda: len(completed()) == STEPS, f"{STEPS} steps completed", 900, every_s=0.5,
                    check=lambda: lock.locked() or daemons.alive())
        for w in watchers:
            w.cancel()
        await asyncio.sleep(2.0)  # anything republished late is stored by now
        result = await audit(bus, run_dir)
        print("kills:", json.dumps(kills, default=str))
        print("audit:", json.dumps(result.to_dict(), default=str))
        assert set(kills) == {"scheduler", "runner", "evaluator", "builder", "cell-in-rollout",
                              "core-in-training", "proxy"}, (kills, daemons.logs())
        assert result.steps_completed == STEPS and result.steps_sealed == STEPS, result
        assert result.calls_answered > 0 and result.clean(), result
    finally:
        for w in watchers:
            w.cancel()
        stopped.set()
        await asyncio.gather(follower, *watchers, return_exceptions=True)
        daemons.stop()
        await bus.close()
