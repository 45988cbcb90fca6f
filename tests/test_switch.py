"""What a cell's switch means (gyre.control.switch): the plan of each switch and its durations."""
from __future__ import annotations

import typing

import pytest

from gyre.control.switch import SwitchAction, SwitchPlan, durations, plan_switch


def test_rollout_to_training_on_the_core_cell_frees_the_engine_and_restores_the_trainer():
    assert plan_switch("rollout", "training", core=True) == SwitchPlan(
        "rollout", "training", release=("stop_serving", "move_kv", "release_engine"), load=("restore_trainer",),
        resume=("start_training",))


def test_rollout_to_training_on_a_satellite_frees_the_engine_builds_a_trainer_and_claims():
    assert plan_switch("rollout", "training", core=False) == SwitchPlan(
        "rollout", "training", release=("stop_serving", "move_kv", "release_engine"), load=("load_trainer",),
        resume=("start_training",))


@pytest.mark.parametrize("core,release", [(True, ("stop_training", "offload_trainer")),
                                          (False, ("stop_training", "release_trainer"))])
def test_training_to_rollout_frees_the_trainer_restores_the_engine_then_serves(core, release):
    assert plan_switch("training", "rollout", core=core) == SwitchPlan(
        "training", "rollout", release=release, load=("restore_engine",), resume=("start_serving",))


@pytest.mark.parametrize("role", ["idle", "rollout", "training"])
def test_a_switch_to_the_role_held_is_empty(role):
    assert plan_switch(role, role, core=True) == SwitchPlan(role, role, (), (), ())


def test_every_planned_action_is_a_known_action():
    known = set(typing.get_args(SwitchAction))
    roles = ("idle", "rollout", "training")
    for a in roles:
        for b in roles:
            for core in (True, False):
                plan = plan_switch(a, b, core=core)
                assert set(plan.release + plan.load + plan.resume) <= known, (a, b, core)


def test_durations_of_a_switch():
    # started 10.0, released 10.5, loaded 12.0, resumed by 12.25 (seconds)
    got = durations(10.0, 10.5, 12.0, 12.25)
    assert got == {"release_s": 0.5, "load_s": 1.5, "total_s": 2.25}
    assert list(got) == ["release_s", "load_s", "total_s"]  # the order cell.switched carries
