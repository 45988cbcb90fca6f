"""Colocate policy: dispatch → all finished → switch to training → step done → back."""
from gyre.control.colocate import ColocatePolicy, Dispatch, Done, Switch


def test_colocate_cycle_two_steps():
    p = ColocatePolicy(tasks=["a", "b", "c"], cells=["c0", "c1"], steps=2, groups_per_step=2, group_size=3)
    assert p.on_cell_switched("c0", "rollout") == []  # waits for every cell
    (burst,) = p.on_cell_switched("c1", "rollout")
    assert isinstance(burst, Dispatch) and burst.step == 0
    assert len(burst.executions) == 6
    assert {e.group for e in burst.executions} == {"s0-g0", "s0-g1"}
    assert {e.cell for e in burst.executions} == {"c0", "c1"}
    assert p.water_level == 6
    ids = [e.execution for e in burst.executions]
    for e in ids[:-1]:
        assert p.on_execution_finished(0, e) == []
    assert p.on_execution_finished(0, ids[-1])[0] == Switch("c0", "rollout", "training", "burst finished", 0)
    assert p.water_level == 0
    assert p.on_execution_finished(0, ids[-1]) == []  # redelivered fact: no second switch
    p.on_cell_switched("c0", "training")
    p.on_cell_switched("c1", "training")
    back = p.on_step_completed(0)
    assert [a.to_role for a in back] == ["rollout", "rollout"]
    assert p.on_step_completed(0) == []
    p.on_cell_switched("c0", "rollout")
    (burst1,) = p.on_cell_switched("c1", "rollout")
    assert burst1.step == 1 and burst1.executions[0].execution == "s1-g0-e0"
    for e in burst1.executions:
        p.on_execution_finished(1, e.execution)
    p.on_cell_switched("c0", "training"); p.on_cell_switched("c1", "training")
    p.on_step_completed(1)
    p.on_cell_switched("c0", "rollout")
    assert p.on_cell_switched("c1", "rollout") == [Done(steps=2)]


def test_task_order_is_seeded():
    a = ColocatePolicy(tasks=list("abcdef"), cells=["c0"], steps=1, groups_per_step=3, group_size=1, seed=7)
    b = ColocatePolicy(tasks=list("abcdef"), cells=["c0"], steps=1, groups_per_step=3, group_size=1, seed=7)
    assert [e.task for e in a.plan(0).executions] == [e.task for e in b.plan(0).executions]


def test_step_completed_before_training_switch_arrives_still_returns_the_cell():
    """All executions failed at once: the step can complete before the cell's
    `cell.switched` (to training) reaches the scheduler. The cell must still be sent back."""
    p = ColocatePolicy(tasks=["a"], cells=["c0"], steps=2, groups_per_step=1, group_size=1)
    (burst,) = p.on_cell_switched("c0", "rollout")
    (to_training,) = p.on_execution_finished(0, burst.executions[0].execution)
    assert to_training.to_role == "training"
    (back,) = p.on_step_completed(0)  # the cell's switched event is still in flight
    assert back == Switch("c0", "training", "rollout", "step completed", 0)
    assert p.on_cell_switched("c0", "training") == []
    (burst1,) = p.on_cell_switched("c0", "rollout")
    assert burst1.step == 1
