"""The scheduling policies of gyre.control, fed facts by hand: the switch rule at its
boundary, serial core-first switches, admission at C_e, the staleness gate, each baseline as
DESIGN.md defines it, and hand-worked timelines of a 2-cell, 4-execution case per mode."""
import numpy as np
import pytest

from gyre.control import facts as F
from gyre.control.modes import Async, Colocate, ColocateOverlapped, make_policy
from gyre.control.policy import PolicyConfig, execution_id
from gyre.sim.bench import config
from gyre.sim.cluster import Simulation, Workload


def boot(policy, t=0.0):
    """Every cell announces itself in rollout with version 0; the actions that follow."""
    out = []
    for c in policy.cfg.cells:
        out += policy.on(F.VersionLoaded(t=t, engine=c, version=0))
        out += policy.on(F.CellSwitched(t=t, cell=c, from_role="idle", to_role="rollout"))
    return out


def placed(actions):
    return [p for a in actions if isinstance(a, F.Dispatch) for p in a.executions]


def of(actions, kind):
    return [a for a in actions if isinstance(a, kind)]


def finish(policy, t, execution):
    step = int(execution.split("-")[0][1:])
    return policy.on(F.ExecutionFinished(t=t, execution=execution, step=step))


# --- the elastic switch rule ------------------------------------------------------------

def test_the_switch_rule_at_its_boundary():
    """w(t) = C_R(t) − C_e switches the core; one execution more does not."""
    p = make_policy("elastic", PolicyConfig(cells=("c0", "c1"), capacity=2, groups_per_step=4, group_size=1,
                                            steps=1))
    start = placed(boot(p))  # the core announces first and is served first
    assert {(x.execution, x.engine) for x in start} == {
        ("s0-g0-e0", "c0"), ("s0-g1-e0", "c0"), ("s0-g2-e0", "c1"), ("s0-g3-e0", "c1")}
    assert finish(p, 10.0, "s0-g2-e0") == []
    assert p.on(F.MicrostepReady(t=10.0, step=0, microstep=0)) == []  # work to claim, but w = 3 > 4 − 2
    assert (p.water_level, p.rollout_capacity - p.cfg.capacity) == (3, 2)
    actions = finish(p, 20.0, "s0-g3-e0")  # w = 2 = C_R − C_e
    assert of(actions, F.Switch) == [F.Switch(cell="c0", from_role="rollout", to_role="training",
                                              reason="water level", step=0)]
    (moved,) = of(actions, F.Reroute)  # the core's executions go to the cell that stays in rollout
    assert {(r.execution, r.engine) for r in moved.routes} == {("s0-g0-e0", "c1"), ("s0-g1-e0", "c1")}
    assert p.rollout_capacity == 2 and p.water_level == 2


def test_the_standalone_pool_counts_in_c_r_and_takes_moved_executions_first():
    p = make_policy("elastic", PolicyConfig(cells=("c0", "c1"), capacity=2, groups_per_step=6, group_size=1,
                                            steps=1, pool=2))
    start = placed(boot(p))
    assert sorted((x.engine, x.execution) for x in start)[:2] == [("c0", "s0-g2-e0"), ("c0", "s0-g3-e0")]
    assert [x.engine for x in start].count(F.POOL) == 2 and p.rollout_capacity == 6
    on = {x.engine: [] for x in start}
    for x in start:
        on[x.engine].append(x.execution)
    finish(p, 1.0, on[F.POOL][0])
    finish(p, 2.0, on["c1"][0])
    actions = p.on(F.MicrostepReady(t=2.0, step=0, microstep=0))  # w = 4 = C_R − C_e
    assert [(s.cell, s.to_role) for s in of(actions, F.Switch)] == [("c0", "training")]
    (moved,) = of(actions, F.Reroute)
    assert sorted(r.engine for r in moved.routes) == ["c1", F.POOL]
    assert p.rollout_capacity == 4  # the pool and c1


def test_no_switch_without_training_to_do():
    p = make_policy("elastic", PolicyConfig(cells=("c0", "c1"), capacity=2, groups_per_step=4, group_size=1,
                                            steps=1))
    boot(p)
    finish(p, 1.0, "s0-g0-e0")
    assert finish(p, 2.0, "s0-g1-e0") == []  # w = C_R − C_e, but nothing to claim


def test_switches_are_serial_and_core_first():
    p = make_policy("elastic", PolicyConfig(cells=("c0", "c1", "c2"), capacity=1, groups_per_step=3, group_size=1,
                                            steps=1), return_rule="idle")
    assert {(x.execution, x.engine) for x in placed(boot(p))} == {
        ("s0-g0-e0", "c0"), ("s0-g1-e0", "c1"), ("s0-g2-e0", "c2")}
    finish(p, 1.0, "s0-g2-e0")
    actions = p.on(F.MicrostepReady(t=1.0, step=0, microstep=0))
    p.on(F.MicrostepReady(t=1.0, step=0, microstep=1))
    assert [(s.cell, s.to_role) for s in of(actions, F.Switch)] == [("c0", "training")]
    assert [(r.execution, r.engine) for a in of(actions, F.Reroute) for r in a.routes] == [("s0-g0-e0", "c2")]
    # c1's execution finishes: w = 1 = C_R − C_e again, but c0's switch is still in flight
    assert of(finish(p, 2.0, "s0-g1-e0"), F.Switch) == []
    actions = p.on(F.CellSwitched(t=3.0, cell="c0", from_role="rollout", to_role="training",
                                  durations={"total_s": 2.0}))
    assert [(s.cell, s.to_role) for s in of(actions, F.Switch)] == [("c1", "training")]  # then c1, not c2
    assert p.switch_s[("rollout", "training")] == [2.0]


def _second_cell_case(timed_microstep_s):
    """2 cells of C_e 1, 2 executions: the core switches when the first finishes (w = 1 =
    C_R − C_e), its switch measured at 1 s; then, with a micro-step of `timed_microstep_s`
    committed (None: none yet), the second finishes and w = 0 lets c1 switch."""
    p = make_policy("elastic", PolicyConfig(cells=("c0", "c1"), capacity=1, groups_per_step=2, group_size=1,
                                            steps=1))
    boot(p)
    finish(p, 1.0, "s0-g1-e0")
    actions = []
    for m in range(4):
        actions += p.on(F.MicrostepReady(t=1.0, step=0, microstep=m))
    assert [(s.cell, s.to_role) for s in of(actions, F.Switch)] == [("c0", "training")]
    p.on(F.CellSwitched(t=2.0, cell="c0", from_role="rollout", to_role="training", durations={"total_s": 1.0}))
    if timed_microstep_s is not None:
        p.on(F.MicrostepGranted(t=2.0, step=0, microstep=0, replica="c0"))
        p.on(F.MicrostepCommitted(t=2.0 + timed_microstep_s, step=0, microstep=0, replica="c0"))
    return [(s.cell, s.to_role) for s in of(finish(p, 3.0, "s0-g0-e0"), F.Switch)]


def test_before_a_micro_step_is_timed_the_water_level_alone_decides():
    assert _second_cell_case(None) == [("c1", "training")]
    # once timed, the switch must pay: 3 micro-steps of 0.1 s over 2 cells save 0.15 s, less
    # than the 1 s switch measured; of 1 s they save 1.5 s
    assert _second_cell_case(0.1) == []
    assert _second_cell_case(0.9) == [("c1", "training")]


def _observed(cells, microstep_s):
    """An elastic policy at the boundary of step 1 (8 micro-steps, all ready), having seen 8
    executions of 40 s on C_e 1 (a burst: 320 cell-s), micro-steps of `microstep_s`, free
    switches and a finish every 10 s."""
    p = make_policy("elastic", PolicyConfig(cells=tuple(f"c{i}" for i in range(cells)), capacity=1,
                                            groups_per_step=4, group_size=2, steps=4))
    p.durations = [40.0] * 8
    p.microstep_s = [microstep_s]
    p.switch_s = {("rollout", "training"): [0.0], ("training", "rollout"): [0.0]}
    p.recent_finishes.extend([0.0, 10.0, 20.0, 30.0])
    p.t = 30.0
    p.sealed[1] = p.ready[1] = 8
    return p


def test_an_uneven_whole_cell_split_returns_every_training_cell_at_the_boundary():
    # ρ = 120 / 440: the best whole-cell split trains on one cell
    assert _observed(4, 15.0).keep_at_boundary(1, trainers=2) == 1  # 3 cells roll out a burst in 107 s
    # on 2 cells one cell would roll out for 320 s while the other trains for 120 s, 200 s
    # more than returning both costs (2 drains of C_e / 2λ = 5 s): both return
    assert _observed(2, 15.0).keep_at_boundary(1, trainers=2) == 0
    assert _observed(2, 40.0).keep_at_boundary(1, trainers=2) == 1  # 320 s of training: even


def test_once_every_burst_is_released_every_training_cell_returns_at_the_boundary():
    p = _observed(4, 15.0)
    p.released = 3
    assert p.keep_at_boundary(1, trainers=2) == 1
    p.released = 4  # the last burst too: the end of the run
    assert p.keep_at_boundary(1, trainers=2) == 0


# --- admission and the staleness gate ------------------------------------------------------

@pytest.mark.parametrize("mode,dispatched,waiting", [
    ("elastic", 4, 12), ("colocate", 4, 4), ("colocate_overlapped", 4, 12), ("async", 2, 14),
    ("async_nonstreaming", 2, 14)])
def test_no_engine_is_given_more_than_c_e(mode, dispatched, waiting):
    """2 cells of C_e = 2, bursts of 8: colocate releases one burst, the others the two S = 1
    allows; async (1+1) places nothing on its training cell."""
    options = {"rollout_cells": 1} if mode.startswith("async") else {}
    p = make_policy(mode, PolicyConfig(cells=("c0", "c1"), capacity=2, groups_per_step=2, group_size=4, steps=2),
                    **options)
    first = placed(boot(p))
    assert (len(first), len(p.backlog)) == (dispatched, waiting)
    assert all(sum(1 for x in first if x.engine == e) <= 2 for e in ("c0", "c1"))
    head = execution_id(*p.backlog[0])
    again = placed(finish(p, 5.0, first[0].execution))
    assert [(x.execution, x.engine) for x in again] == [(head, first[0].engine)]  # the freed slot, in order
    assert all(len(held) <= p.capacity[e] for e, held in p.held.items())


def test_a_burst_waits_until_every_serving_engine_has_loaded_v_k_minus_s():
    p = make_policy("elastic", PolicyConfig(cells=("c0", "c1"), capacity=1, groups_per_step=1, group_size=1,
                                            steps=3, staleness=1))
    assert sorted(x.execution for x in placed(boot(p))) == ["s0-g0-e0", "s1-g0-e0"]  # v0 serves bursts 0 and 1
    finish(p, 1.0, "s0-g0-e0")
    finish(p, 2.0, "s1-g0-e0")
    assert p.released == 2
    assert placed(p.on(F.StepCompleted(t=3.0, step=0))) == []  # v1 exists, no engine serves it yet
    assert placed(p.on(F.VersionLoaded(t=4.0, engine="c0", version=1))) == []  # c1 still serves v0
    (burst2,) = placed(p.on(F.VersionLoaded(t=5.0, engine="c1", version=1)))
    assert burst2.execution == "s2-g0-e0"


def test_a_cell_back_from_training_on_an_older_version_gets_no_execution_of_a_newer_burst():
    """S = 0: burst 1 is released once the serving c1 loaded v1; c0 comes back from training
    restored to v0 (the newest it had heard of) and is given nothing of burst 1 until it
    loads v1, so every call of burst 1 is sampled by v1 whichever cell serves it."""
    p = make_policy("elastic", PolicyConfig(cells=("c0", "c1"), capacity=1, groups_per_step=1, group_size=2,
                                            steps=2, staleness=0))
    assert sorted((x.execution, x.engine) for x in placed(boot(p))) == [("s0-g0-e0", "c0"), ("s0-g0-e1", "c1")]
    finish(p, 1.0, "s0-g0-e0")
    finish(p, 2.0, "s0-g0-e1")
    (leave,) = of(p.on(F.MicrostepReady(t=3.0, step=0, microstep=0)), F.Switch)
    assert (leave.cell, leave.to_role) == ("c0", "training")
    p.on(F.CellSwitched(t=4.0, cell="c0", from_role="rollout", to_role="training"))
    p.on(F.StepSealed(t=4.0, step=0, microsteps=1, executions=2))
    p.on(F.MicrostepGranted(t=4.0, step=0, microstep=0, replica="c0"))
    p.on(F.MicrostepCommitted(t=5.0, step=0, microstep=0, replica="c0"))
    assert placed(p.on(F.StepCompleted(t=6.0, step=0))) == []  # c1 serves v0: the gate is shut
    actions = p.on(F.VersionLoaded(t=7.0, engine="c1", version=1))
    assert [(x.execution, x.engine) for x in placed(actions)] == [("s1-g0-e0", "c1")]
    assert [(s.cell, s.to_role) for s in of(actions, F.Switch)] == [("c0", "rollout")]  # s1-g0-e1 waits
    p.on(F.VersionLoaded(t=8.0, engine="c0", version=0))  # restored to the version it knew
    assert placed(p.on(F.CellSwitched(t=8.0, cell="c0", from_role="training", to_role="rollout"))) == []
    assert [(x.execution, x.engine) for x in placed(p.on(F.VersionLoaded(t=9.0, engine="c0", version=1)))] == [
        ("s1-g0-e1", "c0")]


def test_with_s_0_the_next_burst_waits_for_the_previous_step():
    p = make_policy("async", PolicyConfig(cells=("c0", "c1"), capacity=4, groups_per_step=1, group_size=2,
                                          steps=2, staleness=0), rollout_cells=1)
    assert sorted(x.execution for x in placed(boot(p))) == ["s0-g0-e0", "s0-g0-e1"]
    assert p.released == 1


# --- the baselines as DESIGN.md defines them --------------------------------------------------

def test_colocate_rolls_out_one_burst_then_every_cell_trains_then_returns():
    p = Colocate(PolicyConfig(cells=("c0", "c1"), capacity=2, groups_per_step=1, group_size=2, steps=2))
    assert len(placed(boot(p))) == 2 and p.released == 1  # burst 1 waits though S = 1 would allow it
    finish(p, 1.0, "s0-g0-e0")
    actions = finish(p, 2.0, "s0-g0-e1")
    assert [(s.cell, s.to_role) for s in of(actions, F.Switch)] == [("c0", "training"), ("c1", "training")]
    assert of(actions, F.OpenStep) == [F.OpenStep(step=0)]
    for c in ("c0", "c1"):
        p.on(F.CellSwitched(t=3.0, cell=c, from_role="rollout", to_role="training"))
    back = p.on(F.StepCompleted(t=9.0, step=0))
    assert [(s.cell, s.to_role) for s in of(back, F.Switch)] == [("c0", "rollout"), ("c1", "rollout")]
    p.on(F.VersionLoaded(t=10.0, engine="c0", version=1))
    p.on(F.CellSwitched(t=10.0, cell="c0", from_role="training", to_role="rollout"))
    p.on(F.VersionLoaded(t=10.0, engine="c1", version=1))
    burst = placed(p.on(F.CellSwitched(t=10.0, cell="c1", from_role="training", to_role="rollout")))
    assert sorted(x.execution for x in burst) == ["s1-g0-e0", "s1-g0-e1"]


def test_colocate_overlapped_rolls_out_every_burst_s_allows_and_trains_them_in_one_phase():
    p = ColocateOverlapped(PolicyConfig(cells=("c0", "c1"), capacity=2, groups_per_step=1, group_size=1, steps=2))
    assert sorted(x.execution for x in placed(boot(p))) == ["s0-g0-e0", "s1-g0-e0"]
    assert of(finish(p, 1.0, "s0-g0-e0"), F.Switch) == []  # burst 1 still runs: the phase goes on
    actions = finish(p, 2.0, "s1-g0-e0")
    assert len(of(actions, F.Switch)) == 2 and of(actions, F.OpenStep) == [F.OpenStep(step=0)]
    for c in ("c0", "c1"):
        p.on(F.CellSwitched(t=3.0, cell=c, from_role="rollout", to_role="training"))
    assert p.on(F.StepCompleted(t=5.0, step=0)) == [F.OpenStep(step=1)]  # no return between the two steps


def test_colocate_overlapped_interrupting_pauses_the_newer_burst():
    p = ColocateOverlapped(PolicyConfig(cells=("c0", "c1"), capacity=1, groups_per_step=1, group_size=1,
                                        steps=2), interrupt=True)
    boot(p)
    actions = finish(p, 1.0, "s0-g0-e0")
    (pause,) = of(actions, F.Reroute)
    assert [(r.execution, r.engine) for r in pause.routes] == [("s1-g0-e0", None)]
    assert p.water_level == 1  # a paused execution is dispatched and unfinished


def test_async_keeps_its_split_and_streams():
    p = Async(PolicyConfig(cells=("c0", "c1", "c2"), capacity=2, groups_per_step=2, group_size=1, steps=2),
              rollout_cells=2)
    actions = boot(p)
    assert [(s.cell, s.to_role) for s in of(actions, F.Switch)] == [("c0", "training")]
    assert all(x.engine != "c0" for x in placed(actions))
    assert of(actions, F.OpenStep) == [F.OpenStep(step=0)]  # streaming: open before any group is in
    assert p.split == "2+1"


def test_async_nonstreaming_opens_a_step_only_once_it_is_sealed():
    p = make_policy("async_nonstreaming", PolicyConfig(cells=("c0", "c1"), capacity=2, groups_per_step=2,
                                                       group_size=1, steps=1), rollout_cells=1)
    assert of(boot(p), F.OpenStep) == []
    assert of(p.on(F.MicrostepReady(t=1.0, step=0, microstep=0)), F.OpenStep) == []
    assert of(p.on(F.StepSealed(t=2.0, step=0, microsteps=2, executions=2)), F.OpenStep) == [F.OpenStep(step=0)]


def test_policies_refuse_what_cannot_run():
    with pytest.raises(ValueError, match="rollout_cells"):
        Async(PolicyConfig(cells=("c0", "c1"), capacity=1, groups_per_step=1, group_size=1, steps=1),
              rollout_cells=2)
    with pytest.raises(ValueError, match="capacity"):
        PolicyConfig(cells=("c0",), capacity=0, groups_per_step=1, group_size=1, steps=1)
    with pytest.raises(ValueError, match="unknown mode"):
        make_policy("colocated", PolicyConfig(cells=("c0",), capacity=1, groups_per_step=1, group_size=1, steps=1))
    p = make_policy("elastic", PolicyConfig(cells=("c0",), capacity=1, groups_per_step=1, group_size=1, steps=1))
    p.on(F.Clock(t=5.0))
    with pytest.raises(ValueError, match="clock order"):
        p.on(F.Clock(t=4.0))


# --- hand-worked timelines: 2 cells, C_e = 2, 2 groups × 2 executions ------------------------
#
# Durations (s): step 0 g0 = 10, 20 and g1 = 30, 40; step 1 g0 = 15, 25 and g1 = 35, 5.
# One micro-step per group (10 s on one cell); switches 1 s each way; S = 1.
# New executions go to the cell that stays in rollout longest first (c1, then the core c0).

HAND = np.array([[10.0, 20.0, 30.0, 40.0], [15.0, 25.0, 35.0, 5.0]])

TIMELINES = {
    # both cells roll out burst 0 (c1: g0, c0: g1); it ends at 40; both switch (41) and train one
    # micro-step each: T0 = 51. Both return (52), burst 1 ends at 52 + 35 = 87; switch 88,
    # train: T1 = 98.
    "colocate": ({}, [51.0, 98.0]),
    # bursts 0 and 1 in one phase: burst 1 backfills slots as burst 0 frees them (s1-g0-e0 at
    # 10 → 25, s1-g0-e1 at 20 → 45, s1-g1-e0 at 25 → 60, s1-g1-e1 at 30 → 35); the phase ends at
    # 60, both cells switch (61), train step 0 (T0 = 71), then step 1 in the same phase (T1 = 81).
    "colocate_overlapped": ({}, [71.0, 81.0]),
    # 1+1: c0 trains from t = 1, c1 rolls out two at a time: s0-g0 ends 10, 20; s0-g1 starts
    # 10, 20 and ends 40, 60; s1-g0-e0 40 → 55, s1-g0-e1 55 → 80, s1-g1-e0 60 → 95,
    # s1-g1-e1 80 → 85. Streaming: step 0's micro-steps at 20 → 30 and 60 → 70 (T0 = 70);
    # step 1's at 80 → 90 and 95 → 105 (T1 = 105).
    "async": ({"rollout_cells": 1}, [70.0, 105.0]),
    # the same rollout; a step trains only once sealed: step 0 at 60 → 80, step 1 at 95 → 115.
    "async_nonstreaming": ({"rollout_cells": 1}, [80.0, 115.0]),
    # c0 announces first and takes s0-g0 (10, 20); c1 takes s0-g1 (30, 40). Burst 1 backfills:
    # s1-g0-e0 on c0 10 → 25, s1-g0-e1 on c0 20 → 45, s1-g1-e0 on c0 25 → 60, s1-g1-e1 on c1
    # 30 → 35. At 40 w = 2 = C_R − C_e and group 0's micro-step waits: the core leaves rollout,
    # its two executions move to c1; it trains 41 → 51 and 51 → 61 (T0 = 61). At 61 c1 is empty
    # (its last execution ended at 60) and step 1's two micro-steps wait: c1 switches (62); the
    # core trains 61 → 71, c1 62 → 72: T1 = 72.
    "elastic": ({}, [61.0, 72.0]),
}


@pytest.mark.parametrize("mode", list(TIMELINES))
def test_hand_worked_timeline(mode):
    options, ends = TIMELINES[mode]
    w = Workload(cells=2, capacity=2, groups=2, group_size=2, durations=HAND, microsteps_per_group=1,
                 microstep_s=10.0, to_training_s=1.0, to_rollout_s=1.0)
    log = []
    result = Simulation(w, make_policy(mode, config(w), **options), observe=log.append).run()
    assert result.step_ends == ends
    if mode == "elastic":
        (reroute,) = of(log, F.Reroute)
        assert {(r.execution, r.engine) for r in reroute.routes} == {("s1-g0-e1", "c1"), ("s1-g1-e0", "c1")}
        grants = [(g.t, g.step, g.replica) for g in log if isinstance(g, F.MicrostepGranted)]
        assert grants == [(41.0, 0, "c0"), (51.0, 0, "c0"), (61.0, 1, "c0"), (62.0, 1, "c1")]
