"""`gyre bench modes`: the synthetic harness's seeded durations, the step time and the audit
read back from a run's records, and the smoke variant end to end on the real daemons.

- The harness (its own file, loaded as a module) draws each execution's duration from the
  workload, the seed and (step, group, index) only: the same on every call, the workloads'
  medians, 90th percentiles and timeout fractions, and the id it parses from a real execution
  key.
- The audit's replay of a trace, fed a simulated run's trace, gives the simulator's own
  idle cell-seconds, micro-steps per cell and switch count (so the real runs' audit keys mean
  what `gyre sim`'s do); step ends and the step time come from `metrics.jsonl` by hand-worked
  numbers.
- `gyre bench modes --smoke --modes elastic,colocate` (about 3 minutes on 2 cores) writes the
  JSON with BENCHMARKS.md's keys and a PNG per mode, and each mode's trace shows its defining
  behaviour (colocate: every cell in one role at a time; elastic: cells switch by the water
  level); the executions ran at least their drawn durations and timed out exactly when drawn
  past the timeout; every step had 8 micro-steps. The async run (no switch after its split)
  is `slow`.
"""
from __future__ import annotations

import io
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from gyre.control import trace
from gyre.env.harness import execution_key
from gyre.env.synthetic import TIMEOUT_S, durations, harness_module, records
from gyre.env.tasks import load_tasks
from gyre.sim.bounds import step_time
from gyre.sim.cluster import Workload
from handlers.bench import modes as M
from handlers.bench import modes_audit as A

ROOT = Path(__file__).resolve().parents[1]


# --- the synthetic harness's durations -------------------------------------------------------

def test_durations_are_seeded_by_step_group_and_index_and_follow_the_workloads():
    d = durations("tail_heavy", seed=0, steps=400, groups=4, group_size=8)
    assert np.array_equal(d, durations("tail_heavy", seed=0, steps=400, groups=4, group_size=8))
    assert not np.array_equal(d, durations("tail_heavy", seed=1, steps=400, groups=4, group_size=8))
    assert np.median(d) == pytest.approx(4.0, rel=0.08)
    assert np.percentile(d, 90) == pytest.approx(15.0, rel=0.1)
    assert 0.015 < np.mean(d >= TIMEOUT_S) < 0.035  # ≈ 2.5% reach the timeout
    assert d.max() == TIMEOUT_S
    # the same execution in a bigger step shape draws the same duration
    wide = durations("tail_heavy", seed=0, steps=2, groups=6, group_size=8)
    assert np.array_equal(wide[:, :32], d[:2])

    t = durations("timeout_bound", seed=0, steps=400, groups=4, group_size=8)
    h = harness_module()
    drawn = np.array([[h.duration_s("timeout_bound", 0, k, g, i) for g in range(4) for i in range(8)]
                      for k in range(400)])
    assert 0.37 < np.mean(np.isinf(drawn)) < 0.43  # 40% run into the timeout by construction
    rest = drawn[np.isfinite(drawn)]
    assert np.median(rest) == pytest.approx(10.0, rel=0.08)
    assert np.percentile(rest, 90) == pytest.approx(22.5, rel=0.1)
    assert np.array_equal(t, np.minimum(drawn, TIMEOUT_S))
    # scale multiplies every duration
    assert np.allclose(durations("tail_heavy", seed=0, steps=3, groups=4, group_size=8, scale=0.25),
                       np.minimum(0.25 * d[:3], 0.25 * TIMEOUT_S))


def test_the_harness_finds_its_execution_in_its_key():
    h = harness_module()
    key = execution_key(b"secret-of-the-run", "s12-g3-e7")
    assert h.execution_of_key(key) == "s12-g3-e7"
    assert h.parse_execution("s12-g3-e7") == (12, 3, 7)
    for bad in ("e7", "s1-g2", "x1-g2-e3"):
        with pytest.raises(ValueError):
            h.parse_execution(bad)
    with pytest.raises(ValueError):
        h.execution_of_key("sk-not-ours")


def test_task_sets_carry_the_workload_for_the_harness(tmp_path):
    tasks = load_tasks("synthetic")
    assert [t.instance_id for t in tasks] == [f"synthetic-tail_heavy-{i}" for i in range(4)]
    spec = json.loads(tasks[0].files["workload.json"])
    assert spec == {"workload": "tail_heavy", "seed": 0, "scale": 1.0, "timeout_s": 30.0, "calls": 2,
                    "max_tokens": 4}
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records("timeout_bound", seed=3, scale=0.5, calls=2)))
    (task,) = load_tasks(path)[:1]
    assert json.loads(task.files["workload.json"])["scale"] == 0.5 and task.timeout_s == 15.0
    assert task.expected == {"answer.txt": "pass"}
    with pytest.raises(ValueError, match="unknown workload"):
        records("nope")


# --- the audit and the step time -------------------------------------------------------------

def _sim_trace(mode: str, **options) -> tuple[list[str], object]:
    from gyre.control.modes import make_policy
    from gyre.sim.bench import config
    from gyre.sim.cluster import Simulation

    rng = np.random.default_rng(7)
    w = Workload(cells=4, capacity=2, groups=2, group_size=4, durations=rng.integers(5, 90, (4, 8)).astype(float),
                 microsteps_per_group=2, microstep_s=4.0, to_training_s=1.5, to_rollout_s=0.5)
    buf = io.StringIO()
    policy = make_policy(mode, config(w), **options)
    res = Simulation(w, policy, observe=trace.Writer(buf, policy).write).run()
    return buf.getvalue().splitlines(), res


@pytest.mark.parametrize("mode,options", [("elastic", {}), ("colocate", {}), ("async", {"rollout_cells": 2})])
def test_the_audits_replay_of_a_trace_gives_the_simulators_own_audit(mode, options):
    lines, res = _sim_trace(mode, **options)
    r = A.replay(lines)
    assert r.step_ends == res.step_ends
    assert r.commits == dict(sorted(res.microsteps_per_cell.items()))
    for kind in ("rollout", "training", "switching"):
        assert r.idle_cell_s[kind] == pytest.approx(res.idle_cell_s[kind], abs=1e-2), kind
    # every switch the policy asked for before the run was done, and only those
    asked = [x for x in map(json.loads, lines[1:]) if x.get("action") == "switch" and x["reason"] != "run done"]
    assert len(r.switched) == len(asked) > 0
    # the picture's segments cover every cell from the first dispatch to the end
    for cell, segs in r.segments.items():
        assert segs and segs[-1][1] == pytest.approx(res.step_ends[-1])
        assert all(a < b for a, b, _ in segs)
    # the simulator predicts its own trace exactly
    assert A.predicted_step_s(lines, 1) == pytest.approx(step_time(res.step_ends, 1))


def test_step_ends_and_step_time_by_hand():
    lines = [{"t": 3.0, "kind": "execution.finished"},
             {"t": 10.0, "kind": "step.completed", "step": 0}, {"t": 16.0, "kind": "step.completed", "step": 1},
             {"t": 16.5, "kind": "step.completed", "step": 1},  # a second line of the same fact
             {"t": 30.0, "kind": "step.completed", "step": 3}, {"t": 21.0, "kind": "step.completed", "step": 2},
             {"t": 35.0, "kind": "step.completed", "step": 4}]
    ends = A.step_ends(lines)
    assert ends == [10.0, 16.0, 21.0, 30.0, 35.0]
    assert step_time(ends, 1) == pytest.approx((35.0 - 16.0) / 3)
    assert step_time(ends[:2], 0) == pytest.approx(6.0)
    with pytest.raises(ValueError, match="steps - 1 - warmup"):
        M.Plan(steps=2, warmup=1)


def test_audit_reads_what_the_run_recorded_and_names_what_it_did_not(tmp_path):
    lines, _ = _sim_trace("elastic")
    (tmp_path / "metrics").mkdir()
    metrics = [{"t": 1.0, "kind": "step.completed", "step": 0, "staleness_histogram": {"0": 10, "1": 2}},
               {"t": 2.0, "kind": "step.completed", "step": 1, "staleness_histogram": {"1": 5}}]
    r = A.replay(lines)
    audit, notes = A.audit(tmp_path, r, metrics)
    assert audit["staleness_histogram"] == {"0": 10, "1": 7}
    assert audit["proxy_retries"] is None and audit["kv_tokens_migrated"] is None
    assert audit["switches"]["released_bytes"] is None and len(notes) == 3
    assert audit["switches"]["count"] == len(r.switched) > 0
    (tmp_path / "metrics" / "proxy.prom").write_text(
        "# TYPE gyre_proxy_retries_total counter\ngyre_proxy_retries_total{reason=\"rerouted\"} 3.0\n")
    (tmp_path / "metrics" / "cell1.prom").write_text(
        "# TYPE gyre_engine_kv_imported_tokens_total counter\ngyre_engine_kv_imported_tokens_total 120.0\n")
    audit, notes = A.audit(tmp_path, r, metrics + [{"t": 1.5, "kind": "cell.switched", "from_role": "rollout",
                                                   "to_role": "training", "bytes": {"freed": 4096}}])
    assert audit["proxy_retries"] == {"rerouted": 3} and audit["kv_tokens_migrated"] == 120
    # a counter declared but never incremented counted none
    (tmp_path / "metrics" / "proxy.prom").write_text(
        "# HELP gyre_proxy_retries_total retries\n# TYPE gyre_proxy_retries_total counter\n")
    assert A.audit(tmp_path, r, metrics)[0]["proxy_retries"] == {}
    assert audit["switches"]["released_bytes"] == {"rollout_to_training": {"p50": 4096, "total": 4096}}
    assert notes == []


# --- the smoke variant, end to end -----------------------------------------------------------

def _bench(tmp_path: Path, modes: str) -> dict:
    out = tmp_path / "out" / "modes.json"
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, "-m", "handlers.cli", "bench", "modes", "--smoke", "--modes", modes,
                           "--workdir", str(tmp_path / "work"), "--json", str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    logs = "".join(f"\n--- {p.name}\n{p.read_text(errors='replace')[-2000:]}"
                   for p in sorted((tmp_path / "work" / "logs").glob("*.log")))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:] + logs
    assert "emulated device time" in proc.stdout
    return json.loads(out.read_text())


def _blocks(lines: list[dict]) -> list[tuple[dict, list[dict]]]:
    out: list[tuple[dict, list[dict]]] = []
    for x in lines[1:]:
        if "fact" in x:
            out.append((x, []))
        else:
            out[-1][1].append(x)
    return out


def _check_run(f: dict, mode: str) -> list[dict]:
    """The checks every mode's run passes; returns its trace's lines."""
    run = f["workloads"]["tail_heavy"]["runs"][mode if mode != "async" else "async 3+1"]
    run_dir = Path(run["run_dir"])
    lines = [json.loads(x) for x in (run_dir / "trace.jsonl").read_text().splitlines()]
    assert lines[0]["mode"] == mode and lines[0]["config"]["cells"] == ["cell0", "cell1", "cell2", "cell3"]
    assert lines[0]["config"]["capacity"] == 4 and lines[0]["config"]["staleness"] == 1
    sealed = [x for x in lines if x.get("fact") == "step.sealed"]
    assert [x["microsteps"] for x in sealed] == [8, 8]  # the token budget packs 2 micro-steps per group
    # the executions ran their drawn durations, and timed out exactly when drawn past the timeout
    scale, timeout = f["settings"]["scale"], f["settings"]["timeout_s"]
    drawn = durations("tail_heavy", seed=0, steps=2, groups=4, group_size=8, scale=scale)
    started = {x["execution"]: x["t"] for x in lines if x.get("fact") == "execution.started"}
    finished = [x for x in lines if x.get("fact") == "execution.finished"]
    assert len(finished) == 64
    for x in finished:
        k, g, i = harness_module().parse_execution(x["execution"])
        d = drawn[k, g * 8 + i]
        assert x["t"] - started[x["execution"]] >= d - 0.5, (x, d)  # the scheduler's clock: delivery varies
        if d < timeout - 3.0:
            assert x["status"] == "ok", (x, d)
        elif d >= timeout:
            assert x["status"] == "timeout", (x, d)
    png = Path(f["workloads"]["tail_heavy"]["pictures"][mode])
    assert png.parent == Path(run["picture"]).parent and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    return lines


def test_smoke_writes_the_keys_and_each_modes_trace_shows_its_behaviour(tmp_path):
    f = _bench(tmp_path, "elastic,colocate")
    for key in ("speedup_vs_colocate", "speedup_vs_async", "speedup_vs_colocate_overlapped",
                "speedup_vs_async_nonstreaming", "switch_s", "prefill_tokens_saved_by_kv_migration", "workloads",
                "emulation", "targets", "machine", "settings"):
        assert key in f, key
    assert f["speedup_vs_colocate"] > 0 and f["speedup_vs_async"] is None  # async was not run
    e = f["emulation"]
    assert e["microsteps_per_step"] == 8 and e["device_time_s"] == pytest.approx(2.5 / 8, abs=1e-4)
    w = f["workloads"]["tail_heavy"]
    assert set(w["step_time_s"]) == {"elastic", "colocate"} and all(s > 0 for s in w["step_time_s"].values())
    assert w["speedup_vs_colocate"] == pytest.approx(w["step_time_s"]["colocate"] / w["step_time_s"]["elastic"],
                                                     rel=1e-3)
    for mode in ("elastic", "colocate"):
        audit = w["audit"][mode]
        assert set(audit) >= {"microsteps_per_cell", "idle_cell_s", "dispatch_delay_s", "proxy_retries",
                              "kv_tokens_migrated", "staleness_histogram", "switches"}
        assert sum(audit["microsteps_per_cell"].values()) == 16
        assert audit["microstep_s"] > 0
        assert set(audit["staleness_histogram"]) <= {"0", "1"}
        assert audit["dispatch_delay_s"]["p50"] >= 0
        assert math.isfinite(w["sim_prediction_error"][mode])
        # a key this build does not record is None, with a note saying so
        for key in ("proxy_retries", "kv_tokens_migrated"):
            if audit[key] is None:
                assert any(n.startswith(key) for n in w["notes"][mode])

    # colocate: every cell in one role at a time; dispatches only while every cell rolls out
    lines = _check_run(f, "colocate")
    cells = lines[0]["config"]["cells"]
    role = {c: "idle" for c in cells}
    directions = []
    for fact, taken in _blocks(lines):
        if fact["fact"] == "cell.switched":
            role[fact["cell"]] = fact["to_role"]
        switches = [a for a in taken if a["action"] == "switch"]
        if switches:
            assert sorted(a["cell"] for a in switches) == cells and len({a["to_role"] for a in switches}) == 1
            directions.append(switches[0]["to_role"])
        if any(a["action"] == "dispatch" for a in taken):
            assert set(role.values()) == {"rollout"}, (fact, role)
    assert directions == ["training", "rollout"] * 2
    assert w["audit"]["colocate"]["switches"]["count"] == 4 * 3  # out, back, out (the last return: run done)

    # elastic: cells leave rollout one at a time, core first, when the water level allows
    lines = _check_run(f, "elastic")
    to_training = [a for _, taken in _blocks(lines) for a in taken
                   if a["action"] == "switch" and a["to_role"] == "training"]
    assert to_training and to_training[0]["cell"] == "cell0"
    assert {a["reason"] for a in to_training} == {"water level"}
    assert w["audit"]["elastic"]["switches"]["count"] >= 1


@pytest.mark.slow
def test_smoke_async_keeps_its_split(tmp_path):
    f = _bench(tmp_path, "async")
    lines = _check_run(f, "async")
    switches = [a for _, taken in _blocks(lines) for a in taken if a["action"] == "switch"]
    assert [(a["cell"], a["to_role"], a["reason"]) for a in switches] == [
        ("cell0", "training", "async split"), ("cell0", "rollout", "run done")]
    placed = {p[2] for a in lines if a.get("action") == "dispatch" for p in a["executions"]}
    assert placed == {"cell1", "cell2", "cell3"}
    w = f["workloads"]["tail_heavy"]
    assert w["async_splits"]["async"]["best"] == "3+1"
    assert w["audit"]["async"]["microsteps_per_cell"] == {"cell0": 16}
