"""Training exactly once with real cell processes on a real nats-server (DESIGN.md "Training
exactly once"; tests/replicas.py has the machinery).

The test plays the builder (micro-steps in the object store, `microstep.ready`,
`step.sealed`) and the scheduler (`cell.switch`). The cells are `python -m handlers.cell`
processes: the core (cell0) hosts the ledger; satellites claim over the bus, pull the core's
weights and return their gradient sums through the loopback transfer layer. Every case holds
the core's float64 checkpoint to one in-process trainer that ran every micro-step (atol
1e-8), and the ledger's facts to "every micro-step committed exactly once".
"""
from __future__ import annotations

import datetime as dt
import signal

import pytest

from tests.replicas import Cells, check_moments, check_weights, microsteps, reference, write_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("replicas-model"))


def at(event) -> dt.datetime:
    return dt.datetime.fromisoformat(event.emitted_at.replace("Z", "+00:00"))


async def test_a_core_and_two_satellites_train_what_one_replica_trains(nats_server, run_id, tmp_path, model_dir):
    """Step 0: core and cell1. Step 1: cell2 joins once 3 micro-steps are granted (and the core
    committed one: a satellite commits its micro-steps when it returns them), so it
    trains on the core's snapshot of v1 (pulled through the transfer layer). The weights of
    v2 equal one replica's; each satellite committed micro-steps while the core held grants."""
    steps = [microsteps(0, 4, seed=1), microsteps(1, 10, seed=2)]
    # micro-steps of ≥ 0.6 s (the forward-backward counts towards it): long enough for the
    # core to be granted one while each satellite holds one
    async with Cells(nats_server, run_id, tmp_path, model_dir, device_time_s=0.6) as cells:
        for cell in ("cell0", "cell1", "cell2"):
            cells.start(cell)
        await cells.switch("cell0", "training")
        await cells.switch("cell1", "training")
        await cells.publish(steps[0])
        await cells.seal(0, len(steps[0]))
        await cells.until(lambda: cells.completed(0), "step 0")

        await cells.publish(steps[1][:3])
        await cells.until(lambda: len({g.microstep for g in cells.of("microstep.granted", 1)}) == 3
                          and cells.of("microstep.committed", 1), "3 micro-steps of step 1 granted, one committed")
        await cells.switch("cell2", "training")
        await cells.publish(steps[1][3:])
        await cells.seal(1, len(steps[1]))
        await cells.until(lambda: cells.completed(1), "step 1")

        for step, mss in enumerate(steps):
            assert await cells.settled_commits(step, 0, len(mss)) == {i: 1 for i in range(len(mss))}
        done = cells.completed(1)
        by_cell = {c: sum(1 for e in cells.of("microstep.committed", 1) if e.replica == c) for c in ("cell0", "cell1", "cell2")}
        assert done.microsteps_per_replica == {c: n for c, n in by_cell.items() if n} and sum(by_cell.values()) == 10
        assert by_cell["cell1"] >= 1 and by_cell["cell2"] >= 1, by_cell
        # cell2 trained on v1, pulled from the core: the transfer key its claims named.
        assert cells.of("weights.published", policy_version=1)[0].key.endswith("/weights-v1-e0")
        # Overlap: the core was granted a micro-step while each satellite held an uncommitted one.
        for sat in ("cell1", "cell2"):
            held = [(at(g), min(at(c) for c in cells.of("microstep.committed", 1, microstep=g.microstep)))
                    for g in cells.of("microstep.granted", 1, replica=sat)
                    if cells.of("microstep.committed", 1, microstep=g.microstep, replica=sat)]
            core_grants = [at(g) for g in cells.of("microstep.granted", 1, replica="cell0")]
            assert any(start < t < end for start, end in held for t in core_grants), (sat, held, core_grants)
        assert done.phase_s["reduction"] > 0 and done.phase_s["forward_backward"] > 0
        assert set(done.staleness_histogram) == {"0"} and done.kl > 0

    expected = reference(model_dir, cells.recipe, steps)
    check_weights(cells.checkpoint(2), expected)
    check_moments(cells.checkpoint(2), expected)


async def test_a_stalled_and_a_killed_satellite_lose_only_what_they_had_not_returned(nats_server, run_id, tmp_path,
                                                                                  model_dir):
    """Leases of 1 s. While both hold uncommitted grants, cell1 is stopped (SIGSTOP) and cell2
    killed (SIGKILL). Their leases lapse, the core is granted their micro-steps again and
    trains them; cell1, resumed, learns its grants were taken, returns its contribution all
    the same, and it is refused whole. Every micro-step is committed once and the weights
    equal one replica's."""
    (step0,) = steps = [microsteps(0, 12, seed=3)]
    async with Cells(nats_server, run_id, tmp_path, model_dir, lease_s=1.0, grant_budget=10,
                     device_time_s=0.3) as cells:
        for cell in ("cell0", "cell1", "cell2"):
            cells.start(cell)
        for cell in ("cell0", "cell1", "cell2"):
            await cells.switch(cell, "training")
        await cells.publish(step0)
        await cells.until(lambda: cells.uncommitted("cell1", 0) and cells.uncommitted("cell2", 0),
                          "both satellites to hold uncommitted grants")
        cells.signal("cell1", signal.SIGSTOP)
        cells.signal("cell2", signal.SIGKILL)
        stalled, killed = cells.uncommitted("cell1", 0), cells.uncommitted("cell2", 0)
        assert stalled and killed  # the stop and the kill landed while they held uncommitted work
        taken = stalled | killed

        def by_core() -> bool:
            return all(cells.of("microstep.committed", 0, microstep=i, replica="cell0") for i in taken)
        await cells.until(by_core, f"the core to train {sorted(taken)} again", timeout_s=120)
        cells.signal("cell1", signal.SIGCONT)
        await cells.until(lambda: cells.of("contribution.returned", 0, replica="cell1"), "cell1's late contribution")
        await cells.seal(0, len(step0))
        await cells.until(lambda: cells.completed(0), "step 0")

        assert await cells.settled_commits(0, 0, len(step0)) == {i: 1 for i in range(len(step0))}
        (late,) = cells.of("contribution.returned", 0, replica="cell1")
        assert set(late.microsteps) & stalled, "cell1 returned what it held when it stalled"
        assert not cells.of("microstep.committed", 0, replica="cell1", microstep=min(set(late.microsteps) & stalled))
        assert not cells.of("microstep.committed", 0, replica="cell2")  # it died before returning anything
        again = {g.microstep for g in cells.of("microstep.granted", 0, replica="cell0") if g.grant >= 2}
        assert taken <= again
        assert cells.completed(0).microsteps_per_replica.get("cell0", 0) >= len(taken)

    check_weights(cells.checkpoint(1), reference(model_dir, cells.recipe, steps))


async def test_a_core_killed_mid_step_resumes_from_its_checkpoint_under_a_new_epoch(nats_server, run_id, tmp_path,
                                                                                  model_dir):
    """Step 0 completes. During step 1, once micro-steps are committed and before the step is
    applied, the core is killed (SIGKILL) and started again: it restores v1 with its AdamW
    moments, raises its epoch to 1, goes back to training by itself (the role it was last
    asked for), and step 1 is trained again under epoch 1 (the satellite drops what it had
    accumulated under epoch 0). Two steps after the crash, v3's weights and
    moments equal an uninterrupted replica's."""
    steps = [microsteps(0, 4, seed=4), microsteps(1, 8, seed=5), microsteps(2, 5, seed=6)]
    async with Cells(nats_server, run_id, tmp_path, model_dir, lease_s=3.0, device_time_s=0.3) as cells:
        cells.start("cell0")
        cells.start("cell1")
        await cells.switch("cell0", "training")
        await cells.switch("cell1", "training")
        await cells.publish(steps[0])
        await cells.seal(0, len(steps[0]))
        await cells.until(lambda: cells.completed(0), "step 0")
        await cells.publish(steps[1])
        await cells.seal(1, len(steps[1]))
        await cells.until(lambda: len(cells.of("microstep.committed", 1)) >= 2, "two micro-steps of step 1 committed")
        cells.signal("cell0", signal.SIGKILL)
        assert not cells.completed(1) and cells.of("microstep.committed", 1, epoch=0)  # it held uncommitted work
        assert cells.checkpoint(1).is_dir() and not cells.checkpoint(2).exists()

        cells.start("cell0")
        await cells.until(lambda: cells.roles.get("cell0") == "training", "the restarted core to announce training")
        await cells.until(lambda: cells.completed(1), "step 1 after the restart", timeout_s=120)
        assert cells.completed(1).epoch == 1
        assert await cells.settled_commits(1, 1, len(steps[1])) == {i: 1 for i in range(len(steps[1]))}
        assert [w.epoch for w in cells.of("weights.published", policy_version=1)] == [0, 1]  # published again
        await cells.publish(steps[2])
        await cells.seal(2, len(steps[2]))
        await cells.until(lambda: cells.completed(2), "step 2")

    expected = reference(model_dir, cells.recipe, steps)
    check_weights(cells.checkpoint(3), expected)
    check_moments(cells.checkpoint(3), expected)


async def test_the_core_leaving_training_mid_step_keeps_the_steps_gradient(nats_server, run_id, tmp_path, model_dir):
    """Elastic lets the core return to rollout in the middle of a step and come back: the
    micro-steps it committed before, and a satellite's contribution added while it served,
    stay in the step's gradient (the core's new replica follows the ledger without dropping
    the core's accumulation). v1's weights and moments equal one replica's."""
    (step0,) = steps = [microsteps(0, 8, seed=8)]
    async with Cells(nats_server, run_id, tmp_path, model_dir, device_time_s=0.3) as cells:
        cells.start("cell0")
        cells.start("cell1")
        await cells.switch("cell0", "training")
        await cells.publish(step0[:3])
        await cells.until(lambda: len(cells.of("microstep.committed", 0, replica="cell0")) >= 2,
                          "the core to commit two micro-steps")
        await cells.switch("cell0", "rollout")
        await cells.switch("cell1", "training")
        await cells.publish(step0[3:6])
        await cells.until(lambda: cells.of("microstep.granted", 0, replica="cell1"), "the satellite to train")
        await cells.switch("cell1", "rollout")  # it returns what it trained
        await cells.until(lambda: cells.of("microstep.committed", 0, replica="cell1"), "the satellite's commits")
        await cells.switch("cell0", "training")
        await cells.publish(step0[6:])
        await cells.seal(0, len(step0))
        await cells.until(lambda: cells.completed(0), "step 0")
        assert await cells.settled_commits(0, 0, len(step0)) == {i: 1 for i in range(len(step0))}
        assert cells.completed(0).tokens == sum(ms.n_trained for ms in step0)

    expected = reference(model_dir, cells.recipe, steps)
    check_weights(cells.checkpoint(1), expected)
    check_moments(cells.checkpoint(1), expected)
