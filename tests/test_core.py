"""The core's ledger host (handlers.training.core) on a real nats-server, the test playing the
builder and the satellites over the bus: the grant budget fails a step loudly, a malformed
claim gets a clear answer, an unreadable contribution is refused and its ids granted again."""
from __future__ import annotations

import asyncio

import pytest

import schemas
from bus import Bus
from bus.subjects import dlq_subject, stream_for
from gyre.learning.metrics import StepMetrics
from gyre.learning.trainer import TrainerConfig
from handlers.daemon import run_loops
from handlers.training.core import Core
from handlers.transfer.loopback import LoopbackTransfer
from schemas import ids
from tests.replicas import microsteps, write_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("core-model"))


class Harness:
    def __init__(self, bus: Bus, run: str) -> None:
        self.bus, self.run, self.seq = bus, run, 0
        self.facts: dict[str, list] = {}

    async def on_fact(self, event) -> None:
        self.facts.setdefault(event.NAME, []).append(event)

    async def claim(self, replica: str, held=(), epoch=-1, step=-1, want=True) -> schemas.ClaimReply:
        self.seq += 1
        req = schemas.MicrostepClaim(event_id=ids.claim(self.run, replica, self.seq), replica=replica, epoch=epoch,
                                     step=step, held=tuple(held), want=want)
        data = await self.bus.request(schemas.MicrostepClaim.NAME, schemas.encode(req), 10.0)
        return schemas.decode_part(schemas.ClaimReply, data)

    async def until(self, predicate, what: str) -> None:
        for _ in range(200):
            if predicate():
                return
            await asyncio.sleep(0.05)
        raise AssertionError(f"timed out waiting for {what}: {self.facts}")


@pytest.fixture
async def core(nats_server, run_id, tmp_path, model_dir):
    bus = await Bus.connect(nats_server.url, token=nats_server.token, run=run_id, name="test")
    await bus.ensure_streams()
    transfer = LoopbackTransfer()
    cfg = TrainerConfig(dtype="float64", lease_s=0.3, grant_budget=2, replica="cell0")
    the_core = Core(run=run_id, cell="cell0", bus=bus, cfg=cfg, model_dir=model_dir, weights_dir=tmp_path / "weights",
                    transfer=transfer)
    await the_core.start()
    stop = asyncio.Event()
    harness = Harness(bus, run_id)
    tasks = [asyncio.create_task(run_loops(*the_core.loops(stop))),
             asyncio.create_task(bus.replay(["step.failed", "microstep.granted", "microstep.committed"],
                                            harness.on_fact, stop=stop))]
    (ms,) = microsteps(0, 1, seed=9)
    from gyre.trajectory.microstep import to_bytes

    await bus.put_object("step-0/mstep-0", to_bytes(ms))
    await bus.publish(schemas.MicrostepReady(event_id=ids.microstep(run_id, 0, 0), step=0, microstep=0,
                                             key="step-0/mstep-0", executions=(), tokens=ms.n_tokens,
                                             trained=ms.n_trained, trajectories=ms.n_trajectories))
    await harness.until(lambda: the_core.ledger.announced.get(0), "the announcement")
    yield the_core, harness
    stop.set()
    await asyncio.gather(*tasks, return_exceptions=True)
    transfer.close()
    await bus.close()


async def test_a_microstep_past_its_grant_budget_fails_its_step_loudly(core, run_id):
    the_core, h = core
    first = await h.claim("cell1")
    assert (first.outcome, first.microstep, first.grant, first.lease_s) == ("granted", 0, 1, 0.3)
    assert first.weights_key.endswith("/weights-v0-e0") and len(first.weights_digest) == 64
    await asyncio.sleep(0.4)  # cell1 never renews: its lease lapses
    second = await h.claim("cell2")
    assert (second.outcome, second.grant) == ("granted", 2)
    await asyncio.sleep(0.4)
    third = await h.claim("cell1")  # a third grant would pass the budget of 2
    assert third.outcome == "failed" and "grant budget of 2" in third.reason
    assert (await h.claim("cell3")).outcome == "failed"  # and the step stays failed
    await h.until(lambda: h.facts.get("step.failed"), "step.failed")
    (failed,) = h.facts["step.failed"]
    assert (failed.step, failed.epoch, failed.microstep, failed.event_id) == (0, 0, 0, ids.step_failed(run_id, 0, 0))
    dead = await h.bus.js.get_last_msg(stream_for("dlq.x").stream_name(run_id), dlq_subject(run_id, "microstep.ready"))
    assert schemas.decode("microstep.ready", dead.data).event_id == ids.microstep(run_id, 0, 0)
    assert "grant budget" in dead.headers["Gyre-Dlq-Reason"]
    assert [g.replica for g in h.facts["microstep.granted"]] == ["cell1", "cell2"]


async def test_a_malformed_claim_gets_a_clear_answer(core):
    _, h = core
    data = await h.bus.request(schemas.MicrostepClaim.NAME, b'{"event_id": "x", "held": "all"}', 10.0)
    reply = schemas.decode_part(schemas.ClaimReply, data)
    assert reply.outcome == "refused" and "replica" in reply.reason


async def test_an_unreadable_contribution_is_refused_and_its_ids_granted_again(core, run_id):
    the_core, h = core
    granted = await h.claim("cell1")
    assert granted.outcome == "granted"
    await h.bus.publish(schemas.ContributionReturned(
        event_id=ids.contribution(run_id, 0, 0, "cell1", (0,)), step=0, epoch=0, replica="cell1", microsteps=(0,),
        key="loopback://127.0.0.1:9/contribution-cell1-s0-e0", digest="0" * 64))  # nobody serves it
    await h.until(lambda: not the_core.ledger.holders, "the core to refuse it and release micro-step 0")
    again = await h.claim("cell2")  # at once, not after cell1's lease
    assert (again.outcome, again.microstep) == ("granted", 0)
    assert not h.facts.get("microstep.committed")


async def test_no_answer_names_a_step_with_another_steps_weights(core, run_id, monkeypatch):
    """While the core exposes v1 after applying step 0, a claim is answered for step 0 with
    v0, never for step 1 with v0 (a satellite would train step 1 on the wrong weights)."""
    the_core, h = core
    gate, snapshotting = asyncio.Event(), asyncio.Event()
    real = the_core._snapshot

    async def slow_snapshot():
        snapshotting.set()
        await gate.wait()
        return await real()

    monkeypatch.setattr(the_core, "_snapshot", slow_snapshot)
    granted = await h.claim("cell0")  # the core's own replica, as the cell runs it, trains micro-step 0
    assert granted.outcome == "granted" and (granted.step, granted.weights_version) == (0, 0)
    async with the_core.grad_lock:
        await the_core.commit_local(0)
    await h.bus.publish(schemas.StepSealed(event_id=ids.sealed(run_id, 0), step=0, microsteps=1, executions=1,
                                           groups=1))
    await asyncio.wait_for(snapshotting.wait(), 30)  # step 0 applied; v1 not offered yet
    try:
        during = await h.claim("cell1")
    finally:
        gate.set()
    assert (during.step, during.weights_version, during.outcome) == (0, 0, "nothing_left")
    await h.until(lambda: the_core.ledger.step == 1, "step 0 to be applied")
    after = await h.claim("cell1")
    assert (after.step, after.weights_version) == (1, 1) and after.weights_key.endswith("/weights-v1-e0")


async def test_a_redelivered_contribution_is_added_once(core, run_id):
    """The same `contribution.returned` handled twice (a lost ack redelivers it): the gradient
    is added once and each id committed once."""
    import numpy as np

    the_core, h = core
    assert (await h.claim("cell1")).outcome == "granted"
    grads = {name: np.full(p.shape, 0.5, dtype=np.float64) for name, p in the_core.trainer.model.named_parameters()}
    satellite = LoopbackTransfer()
    try:
        ref = satellite.expose("contribution-cell1-s0-e0", grads)
        event = schemas.ContributionReturned(
            event_id=ids.contribution(run_id, 0, 0, "cell1", (0,)), step=0, epoch=0, replica="cell1", microsteps=(0,),
            key=ref.key, digest=ref.digest, metrics=StepMetrics().to_dict())
        await the_core.on_contribution(event)
        await the_core.on_contribution(event)
    finally:
        satellite.close()
    got = the_core.trainer.gradients()
    assert all(np.array_equal(got[name], grads[name]) for name in grads)  # 0.5, not 1.0
    await h.until(lambda: h.facts.get("microstep.committed"), "the commit")
    await asyncio.sleep(0.2)
    assert [(c.microstep, c.replica) for c in h.facts["microstep.committed"]] == [(0, "cell1")]
    assert the_core.ledger.committed == {0: "cell1"}


async def test_a_core_killed_between_its_checkpoint_and_step_completed_publishes_it_on_restart(core, run_id, tmp_path,
                                                                                                model_dir):
    """The checkpoint of step 0 is on disk but `step.completed` never left (the core died in
    between): the restarted core publishes it, so the scheduler does not wait forever."""
    the_core, h = core
    hung = asyncio.Event()

    async def dies_here(path):
        hung.set()
        raise RuntimeError("killed")  # the process is gone before step.completed

    the_core._publish_weights = dies_here
    assert (await h.claim("cell0")).outcome == "granted"
    async with the_core.grad_lock:
        await the_core.commit_local(0)
    await h.bus.publish(schemas.StepSealed(event_id=ids.sealed(run_id, 0), step=0, microsteps=1, executions=1,
                                           groups=1))
    await asyncio.wait_for(hung.wait(), 60)
    completed: list = []
    stop = asyncio.Event()
    watcher = asyncio.create_task(h.bus.replay([schemas.StepCompleted.NAME], completed.append, stop=stop))
    await asyncio.sleep(0.3)
    assert not completed  # the kill landed after the checkpoint, before the event
    transfer = LoopbackTransfer()
    again = Core(run=run_id, cell="cell0", bus=h.bus, cfg=the_core.cfg, model_dir=model_dir,
                 weights_dir=tmp_path / "weights", transfer=transfer)
    try:
        await again.start()
        await h.until(lambda: completed, "the restarted core to publish step 0's step.completed")
        assert [(e.step, e.epoch) for e in completed] == [(0, 0)] and again.epoch == 1
        assert again.trainer.policy_version == 1
    finally:
        stop.set()
        await watcher
        transfer.close()


async def test_a_second_contribution_of_a_replica_to_the_same_step_is_counted(core, run_id):
    """A satellite that left training and came back (or restarted) in the same step returns a
    second contribution covering other ids: it is another fact, not a duplicate for the bus to
    drop (it was, and the step waited forever for those ids)."""
    import numpy as np

    from gyre.trajectory.microstep import to_bytes

    the_core, h = core
    (ms,) = microsteps(0, 1, seed=10)
    await h.bus.put_object("step-0/mstep-1", to_bytes(ms))
    await h.bus.publish(schemas.MicrostepReady(event_id=ids.microstep(run_id, 0, 1), step=0, microstep=1,
                                               key="step-0/mstep-1", executions=(), tokens=ms.n_tokens,
                                               trained=ms.n_trained, trajectories=ms.n_trajectories))
    await h.until(lambda: 1 in the_core.ledger.announced.get(0, {}), "the second announcement")
    grads = {name: np.full(p.shape, 0.25, dtype=np.float64) for name, p in the_core.trainer.model.named_parameters()}
    satellite = LoopbackTransfer()
    try:
        for n, covered in enumerate(((0,), (1,)), start=1):
            assert (await h.claim("cell1")).microstep == covered[0]
            ref = satellite.expose(f"contribution-{n}", grads)
            await h.bus.publish(schemas.ContributionReturned(
                event_id=ids.contribution(run_id, 0, 0, "cell1", covered), step=0, epoch=0, replica="cell1",
                microsteps=covered, key=ref.key, digest=ref.digest, metrics=StepMetrics().to_dict()))
            await h.until(lambda: len(h.facts.get("microstep.committed", ())) == n, f"contribution {n}'s commit")
    finally:
        satellite.close()
    assert the_core.ledger.committed == {0: "cell1", 1: "cell1"}
    got = the_core.trainer.gradients()
    assert all(np.array_equal(got[name], 2 * grads[name]) for name in grads)
