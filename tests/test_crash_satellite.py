"""A satellite killed mid-micro-step restarts without loss (issue 52): in a colocate toy run
on two cells (both train every step: `cell0` the core, `cell1` a satellite), the satellite
is SIGKILLed while the ledger has granted it micro-steps of a step that is not completed and
not committed (asserted when the kill lands), then restarted after 1 s as a supervisor
would. Its grants are granted again (the restarted replica's first claim lists none of
them, which releases them; else their lease lapses, `train.lease_s`, here 4 s), the run
completes every step, and the audit (handlers.audit) finds no call lost, no sample or
micro-step counted twice and no execution dispatched twice.
"""
from __future__ import annotations

import asyncio
import collections
import json
import time

import pytest

import schemas
from bus import Bus
from gyre.config import load_recipe
from handlers.audit import audit
from handlers.bench.chaos import MODULES
from tests.crash import Daemons, make_run_dir, until

STEPS = 2
LEASE_S = 4.0


@pytest.mark.slow
async def test_a_satellite_killed_holding_grants_has_them_granted_again_and_the_run_completes_without_loss(
        nats_server, run_id, tmp_path):
    from gyre.serving.model import ModelSpec, init_model

    recipe = load_recipe("toy", {"run.mode": "colocate", "run.steps": STEPS, "cells.count": 2, "cells.capacity": 4,
                                 "train.lease_s": LEASE_S, "train.microstep_tokens": 96})
    run_dir = make_run_dir(tmp_path / run_id, run_id, nats_server, recipe)
    m = recipe.model
    init_model(run_dir / "model", ModelSpec(layers=m.layers, hidden=m.hidden, heads=m.heads, kv_heads=m.kv_heads,
                                            head_dim=m.hidden // m.heads, intermediate=3 * m.hidden, seed=m.seed))
    bus = await Bus.connect(nats_server.url, token=nats_server.token, run=run_id, name="test")
    await bus.ensure_streams()
    daemons = Daemons(run_dir)
    for name in MODULES:
        daemons.start(name)

    facts: dict[str, list] = collections.defaultdict(list)
    roles: dict[str, str] = {}
    stopped = asyncio.Event()

    async def on(event):
        facts[type(event).__name__].append(event)
        if isinstance(event, schemas.CellSwitched):
            roles[event.cell] = event.to_role

    follower = asyncio.create_task(bus.replay(
        [schemas.StepCompleted.NAME, schemas.MicrostepGranted.NAME, schemas.MicrostepCommitted.NAME,
         schemas.CellSwitched.NAME], on, stop=stopped))

    def completed() -> set[int]:
        return {e.step for e in facts["StepCompleted"]}

    def satellite_holds() -> list[tuple[int, int, int]]:
        done = completed()
        committed = {(e.epoch, e.step, e.microstep) for e in facts["MicrostepCommitted"]}
        held = {(e.epoch, e.step, e.microstep) for e in facts["MicrostepGranted"] if e.replica == "cell1"}
        later = collections.Counter((e.epoch, e.step, e.microstep) for e in facts["MicrostepGranted"])
        return sorted(k for k in held if k[1] not in done and k not in committed and later[k] == 1)

    kill: dict = {}

    async def kill_when_held() -> None:
        while len(completed()) < STEPS:
            held = satellite_holds() if roles.get("cell1") == "training" else []
            if held:
                t0 = time.monotonic()
                assert daemons.kill9("cell1") == -9
                kill.update(held=held, grants_before=len(facts["MicrostepGranted"]), at_step=len(completed()))
                await asyncio.sleep(1.0)
                daemons.start("cell1")
                kill["restart_s"] = round(time.monotonic() - t0, 2)
                return
            await asyncio.sleep(0.02)

    watcher = asyncio.create_task(kill_when_held())
    try:
        await until(lambda: len(completed()) == STEPS, f"{STEPS} steps completed", 900, every_s=0.5,
                    check=lambda: watcher.done() and watcher.exception() is None and daemons.alive())
        await asyncio.sleep(2.0)  # anything republished late is stored by now
        result = await audit(bus, run_dir)
        print("kill:", json.dumps(kill, default=str))
        print("audit:", json.dumps(result.to_dict(), default=str))
        assert kill.get("held"), ("the satellite never held a grant while in training", daemons.logs())
        regranted = collections.Counter((e.epoch, e.step, e.microstep)
                                        for e in facts["MicrostepGranted"][kill["grants_before"]:])
        assert all(regranted[k] >= 1 for k in map(tuple, kill["held"])), (kill, regranted)
        committed = collections.Counter((e.epoch, e.step, e.microstep) for e in facts["MicrostepCommitted"])
        assert all(committed[k] == 1 for k in map(tuple, kill["held"])), committed
        assert result.steps_completed == STEPS and result.steps_sealed == STEPS, result
        assert result.calls_answered > 0 and result.clean(), result
    finally:
        watcher.cancel()
        stopped.set()
        await asyncio.gather(follower, watcher, return_exceptions=True)
        daemons.stop()
        await bus.close()
