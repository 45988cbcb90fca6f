"""gyre sim: traces that replay exactly, what-if workloads from a trace, the bounds, a
property test of elastic against the bound and colocate, and the command itself."""
import dataclasses
import io
import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gyre.control import facts as F
from gyre.control import trace
from gyre.sim import whatif
from gyre.sim.bench import run
from gyre.sim.bounds import bound_step_s, critical_path_ends, ideal_step_s, step_time
from gyre.sim.cluster import Workload
from gyre.sim.profiles import PROFILES, random_profiles


def small(seed=0, steps=4, cells=3, capacity=2, groups=3, group_size=2, staleness=1) -> Workload:
    rng = np.random.default_rng(seed)
    d = rng.integers(5, 120, size=(steps, groups * group_size)).astype(float)
    return Workload(cells=cells, capacity=capacity, groups=groups, group_size=group_size, durations=d,
                    microsteps_per_group=2, microstep_s=7.0, to_training_s=2.0, to_rollout_s=1.0,
                    staleness=staleness)


# --- traces -----------------------------------------------------------------------------

def _trace(w, mode="elastic", **options) -> list[str]:
    buf = io.StringIO()
    from gyre.control.modes import make_policy
    from gyre.sim.bench import config
    from gyre.sim.cluster import Simulation

    policy = make_policy(mode, config(w), **options)
    Simulation(w, policy, observe=trace.Writer(buf, policy).write).run()
    return buf.getvalue().splitlines()


@pytest.mark.parametrize("mode,options", [("elastic", {}), ("colocate", {}), ("colocate_overlapped", {}),
                                          ("async", {"rollout_cells": 1}),
                                          ("async_nonstreaming", {"rollout_cells": 2})])
def test_a_fresh_policy_fed_a_traces_facts_takes_exactly_its_actions(mode, options):
    lines = _trace(small(), mode, **options)
    head = json.loads(lines[0])
    assert head["trace"] == 1 and head["mode"] == mode and head["config"]["cells"] == ["c0", "c1", "c2"]
    kinds = {json.loads(x).get("fact") or json.loads(x).get("action") for x in lines[1:]}
    assert {"execution.started", "execution.finished", "microstep.granted", "step.completed", "cell.switched",
            "dispatch", "switch", "open", "done"} <= kinds
    assert trace.replay(lines) == []


def test_every_mode_runs_with_a_standalone_pool():
    w = dataclasses.replace(small(seed=5), pool=3)
    for mode, options in (("elastic", {}), ("colocate", {}), ("colocate_overlapped", {}),
                          ("async", {"rollout_cells": 1}), ("async_nonstreaming", {"rollout_cells": 2})):
        ends = run(w, mode, **options).step_ends
        assert len(ends) == w.steps and ends == sorted(ends)


def test_a_later_finish_changes_the_actions():
    lines = _trace(small())
    _, items = trace.read(lines)
    items = list(items)
    # move the first finish of burst 1 after the next fact that comes later
    i = next(n for n, x in enumerate(items) if isinstance(x, F.ExecutionFinished) and x.step == 1)
    late = next(n for n in range(i + 1, len(items)) if isinstance(items[n], F.Fact) and items[n].t > items[i].t)
    moved = dataclasses.replace(items[i], t=items[late].t)
    changed = items[:i] + items[i + 1:late + 1] + [moved] + items[late + 1:]
    mismatches = trace.replay(lines, items=changed)
    assert mismatches  # the slot it frees is given out later, to other executions
    assert trace.replay(lines, items=items) == []


def test_trace_lines_round_trip():
    for item in (F.StepSealed(t=1.5, step=2, microsteps=8, executions=12),
                 F.CellSwitched(t=2.0, cell="c1", from_role="rollout", to_role="training", durations={"total_s": 8.5})):
        assert trace.decode(json.loads(json.dumps(trace.encode(item)))) == item
    d = F.Dispatch(step=1, executions=(F.Placed(execution="s1-g0-e0", group=0, engine="c2"),))
    r = F.Reroute(routes=(F.Route(execution="s1-g0-e0", engine=None),), reason="pause")
    for action in (d, r, F.Switch(cell="c0", from_role="training", to_role="rollout", reason="x", step=3)):
        obj = json.loads(json.dumps(trace.encode(action, 4.0)))
        assert obj["t"] == 4.0 and trace.decode(obj) == action
    with pytest.raises(ValueError, match="not a gyre trace"):
        trace.read(['{"hello": 1}'])


# --- what-if -------------------------------------------------------------------------------

def test_a_trace_replayed_at_its_own_size_predicts_its_own_run():
    w = small(seed=3)
    lines = _trace(w)
    m = whatif.measured(lines)
    assert (m.cells, m.capacity, m.groups, m.group_size, m.microsteps_per_group) == (3, 2, 3, 2, 2)
    assert m.microstep_s == pytest.approx(7.0) and m.to_training_s == pytest.approx(2.0)
    assert len(m.durations) == w.durations.size
    again = whatif.workload_at(m, 3)
    assert np.array_equal(again.durations, w.durations)
    assert run(again, "elastic").step_ends == pytest.approx(m.step_ends)


def test_what_if_scales_the_executions_with_the_cells(tmp_path):
    lines = _trace(small(seed=4))
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(lines) + "\n")
    m = whatif.measured(lines)
    six = whatif.workload_at(m, 6)
    assert (six.groups, six.capacity, six.durations.shape) == (6, 2, (4, 12))
    assert set(np.unique(six.durations)) <= set(m.durations.values())  # drawn from what was measured
    report = whatif.report(path, [2, 6], ("elastic", "colocate"))
    assert report["prediction_error"] == pytest.approx(0.0, abs=1e-9)
    assert set(report["by_cells"]) == {"2", "6"}
    assert report["by_cells"]["6"]["executions_per_step"] == 12
    assert set(report["by_cells"]["6"]["step_time_s"]) == {"elastic", "colocate"}


# --- bounds ----------------------------------------------------------------------------------

def test_the_bounds_by_hand():
    d = np.array([[10.0, 30.0], [50.0, 20.0], [40.0, 40.0]])
    w = Workload(cells=2, capacity=1, groups=1, group_size=2, durations=d, microsteps_per_group=2, microstep_s=5.0,
                 to_training_s=0.0, to_rollout_s=0.0)
    # W = 10 cell-s per step, K = 2, G = 1: T_k >= T_{k-1} + 5 and T_k >= T_{k-2} + L_k + 5
    assert critical_path_ends(w) == [35.0, 55.0, 80.0]
    assert step_time([35.0, 55.0, 80.0]) == 25.0  # (T_2 - T_1) / 1
    # counted step 2: (80 s of executions / 1 + 10) / 2 = 45
    assert ideal_step_s(w) == 45.0
    assert bound_step_s(w) == {"ideal_s": 45.0, "critical_path_s": 25.0, "bound_s": 45.0}


def test_a_late_satellite_finds_nothing_left_to_claim():
    p = dataclasses.replace(PROFILES["terminalbench_122b"], steps=3)
    from gyre.sim.bench import workload

    log = []
    from gyre.control.modes import make_policy
    from gyre.sim.bench import config
    from gyre.sim.cluster import Simulation

    w = workload(p)
    Simulation(w, make_policy("elastic", config(w)), observe=log.append).run()
    told = {x.replica for x in log if isinstance(x, F.NothingToClaim)}
    assert told - {"c0"}  # a satellite asked for a micro-step after the last one was granted
    committed = [x for x in log if isinstance(x, F.MicrostepCommitted)]
    assert len(committed) == 3 * 64 and len({(x.step, x.microstep) for x in committed}) == 3 * 64


# --- property: never below the bound; with free switches, never behind colocate --------------

workloads = st.builds(
    lambda cells, capacity, groups, group_size, steps, per_group, mu, staleness, seed: Workload(
        cells=cells, capacity=capacity, groups=groups, group_size=group_size,
        durations=np.random.default_rng(seed).integers(1, 100, size=(steps, groups * group_size)).astype(float),
        microsteps_per_group=per_group, microstep_s=float(mu), to_training_s=0.0, to_rollout_s=0.0,
        staleness=staleness),
    cells=st.integers(1, 4), capacity=st.integers(1, 4), groups=st.integers(1, 4), group_size=st.integers(1, 3),
    steps=st.integers(2, 6), per_group=st.integers(1, 2), mu=st.integers(1, 30), staleness=st.integers(0, 1),
    seed=st.integers(0, 2**32 - 1))


def tight(seed: int, staleness: int, cells: int = 2) -> Workload:
    """A small cluster (`cells` cells of C_e 1–2) with more executions per burst than slots
    and training as long as a burst's rollout: the next burst's executions contend for the
    slots the current step's training needs. Free switches."""
    rng = np.random.default_rng([seed, staleness])
    capacity, groups, group_size = int(rng.integers(1, 3)), int(rng.integers(3, 5)), int(rng.integers(2, 4))
    steps = int(rng.integers(4, 7))
    return Workload(cells=cells, capacity=capacity, groups=groups, group_size=group_size,
                    durations=rng.integers(1, 100, size=(steps, groups * group_size)).astype(float),
                    microsteps_per_group=2, microstep_s=float(rng.integers(10, 31)), to_training_s=0.0,
                    to_rollout_s=0.0, staleness=staleness)


def broad(seed: int, staleness: int) -> Workload:
    """A workload drawn as `workloads` draws them, from a seed."""
    rng = np.random.default_rng([seed, staleness])
    cells, capacity, groups = int(rng.integers(1, 5)), int(rng.integers(1, 5)), int(rng.integers(1, 5))
    group_size, steps, per_group = int(rng.integers(1, 4)), int(rng.integers(2, 7)), int(rng.integers(1, 3))
    return Workload(cells=cells, capacity=capacity, groups=groups, group_size=group_size,
                    durations=rng.integers(1, 100, size=(steps, groups * group_size)).astype(float),
                    microsteps_per_group=per_group, microstep_s=float(rng.integers(1, 31)), to_training_s=0.0,
                    to_rollout_s=0.0, staleness=staleness)


def violations(w: Workload) -> list[str]:
    """What the properties forbid on `w` (free switches): elastic ending a step before the
    critical path allows, or its step time or its last step more than one micro-step behind
    colocate's."""
    elastic, colocate = run(w, "elastic").step_ends, run(w, "colocate").step_ends
    found = [f"step {k} ends at {t} before its bound {b}"
             for k, (t, b) in enumerate(zip(elastic, critical_path_ends(w))) if t < b - 1e-9]
    if step_time(elastic) > step_time(colocate) + w.microstep_s + 1e-9:
        found.append(f"step time {step_time(elastic)} vs colocate's {step_time(colocate)}")
    if elastic[-1] > colocate[-1] + w.microstep_s + 1e-9:
        found.append(f"last step ends at {elastic[-1]} vs colocate's {colocate[-1]}")
    return found


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(w=workloads, to_training=st.sampled_from([0.0, 3.0]), to_rollout=st.sampled_from([0.0, 2.0]))
def test_elastic_never_beats_the_lower_bound(w, to_training, to_rollout):
    w = dataclasses.replace(w, to_training_s=to_training, to_rollout_s=to_rollout)
    ends = run(w, "elastic").step_ends
    assert all(t >= b - 1e-9 for t, b in zip(ends, critical_path_ends(w)))
    total = (w.durations.sum() / w.capacity + w.steps * w.train_s) / w.cells
    assert ends[-1] >= total - 1e-9


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(w=workloads)
def test_with_free_switches_elastic_is_never_behind_colocate_by_more_than_a_micro_step(w):
    assert violations(w) == []  # S is drawn from 0 and 1


@pytest.mark.parametrize("staleness", [0, 1])
def test_on_2000_tight_workloads_elastic_keeps_the_properties(staleness):
    # before the uneven-split return, 19 of these with S = 1 fell more than a micro-step
    # behind colocate
    assert {seed: v for seed in range(2000) if (v := violations(tight(seed, staleness)))} == {}


@pytest.mark.slow
@pytest.mark.parametrize("staleness", [0, 1])
@pytest.mark.parametrize("draw", [tight, lambda seed, staleness: tight(seed, staleness, cells=3), broad],
                         ids=["tight", "tight_3_cells", "broad"])
def test_on_20000_workloads_elastic_keeps_the_properties(draw, staleness):
    assert {seed: v for seed in range(2000, 22000) if (v := violations(draw(seed, staleness)))} == {}


# --- the command ------------------------------------------------------------------------------

def test_gyre_sim_writes_the_keys_and_a_picture_per_mode(tmp_path, capsys):
    from handlers.cli import main

    out = tmp_path / "sim.json"
    assert main(["sim", "--profile", "nl2repo_122b", "--steps", "4", "--json", str(out), "--jobs", "1"]) == 0
    printed = capsys.readouterr().out
    assert "reference" in printed and "1.36–1.47×" in printed
    figures = json.loads(out.read_text())
    f = figures["profiles"]["nl2repo_122b"]
    assert set(f["step_time_s"]) == {"elastic", "colocate", "colocate_overlapped", "async", "async_nonstreaming"}
    for key in ("speedup_vs_colocate", "speedup_vs_colocate_overlapped", "speedup_vs_async",
                "speedup_vs_async_nonstreaming", "ratio_to_ideal", "ratio_to_bound", "reference", "inputs"):
        assert key in f
    assert f["inputs"]["to_training_s"] == 8.52 and f["inputs"]["capacity"] == 128
    assert set(f["async_splits"]["async"]["step_time_s"]) == {"1+2", "2+1"}
    pictures = sorted(p.name for p in tmp_path.glob("*.png"))
    assert pictures == [f"sim-nl2repo_122b-{m}.png" for m in sorted(f["step_time_s"])]
    assert all((tmp_path / p).read_bytes()[:4] == b"\x89PNG" for p in pictures)


def test_gyre_sim_random_profiles_report_the_worst_against_the_best_baseline(tmp_path):
    from gyre.sim.command import main

    out = tmp_path / "r.json"
    assert main(["--random", "2", "--seed", "11", "--steps", "3", "--json", str(out), "--jobs", "1"]) == 0
    r = json.loads(out.read_text())["random"]
    assert r["seed"] == 11 and r["n"] == 2 and set(r["profiles"]) == {"random_11_0", "random_11_1"}
    assert r["worst_vs_best_baseline"] == max(f["elastic_vs_best_baseline"] for f in r["profiles"].values())
    assert not list(tmp_path.glob("*.png"))  # random profiles draw pictures only when asked


def test_gyre_sim_runs_a_subset_of_modes(capsys):
    from gyre.sim.command import main

    assert main(["--profile", "nl2repo_122b", "--steps", "3", "--modes", "elastic", "--jobs", "1"]) == 0
    assert "ratio_to_bound" in capsys.readouterr().out


def test_random_profiles_are_drawn_within_the_benchmark_ranges():
    for p in random_profiles(50, 7):
        assert 2 <= p.cells <= 8 and 16 <= p.capacity <= 128
        assert 5 * 60 <= p.median_s <= 60 * 60 and 1.5 <= p.p90_s / p.median_s <= 4
        assert 0 <= p.timeout_fraction <= 0.5 and 10 * 60 <= p.train_s <= 120 * 60
        assert 1 <= p.to_training_s <= 20 and 1 <= p.to_rollout_s <= 20
    assert random_profiles(3, 7) == random_profiles(50, 7)[:3]  # a profile does not depend on N
