"""What a trace tells the simulator: a run's shape, its execution durations, its measured
switch costs and micro-step durations; and the workloads that answer what-if questions.

`measured(lines)` reads a trace (`gyre.control.trace`); `workload_at(m, cells)` is the
run at another cluster size: the executions per step scale with the cells (C_e fixed), the
durations are drawn (seeded, with replacement) from the measured ones, and each micro-step
takes the measured mean. At the trace's own size the measured durations are replayed as
they were, execution by execution.
"""
from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Iterable

import numpy as np

from gyre.control import facts as F
from gyre.control.trace import read
from gyre.sim.cluster import Workload


@dataclasses.dataclass(frozen=True)
class Measured:
    """A run as its trace records it. Seconds throughout."""

    mode: str
    options: dict
    cells: int
    capacity: int
    groups: int
    group_size: int
    steps: int
    staleness: int
    pool: int
    durations: dict[tuple[int, int], float]
    """(step, index in step) -> started-to-finished seconds, for every execution that finished."""
    microstep_s: float
    """Median seconds a replica held a micro-step: from its grant to the replica's next grant or
    the micro-step's commit, whichever came first (a satellite returns the micro-steps of a
    step in one contribution, so its commits come together at the end). The median, not the
    mean: a replica's first micro-step also pays its warm-up, once per run."""
    microsteps_per_group: int
    to_training_s: float
    to_rollout_s: float
    step_ends: list[float]
    """When each step was completed, on the trace's clock."""


def measured(lines: Iterable[str]) -> Measured:
    """Read a trace; raises ValueError when it has no finished execution or no micro-step."""
    head, items = read(lines)
    cfg = head["config"]
    started: dict[str, float] = {}
    durations: dict[tuple[int, int], float] = {}
    granted: dict[tuple[int, int], float] = {}  # micro-step -> granted at, until counted
    holding: dict[str, tuple[int, int]] = {}  # replica -> the micro-step it was granted last
    micro: list[float] = []
    switches: dict[tuple[str, str], list[float]] = {("rollout", "training"): [], ("training", "rollout"): []}
    sealed: list[int] = []
    ends: list[float] = []
    t0 = None
    for item in items:
        if not isinstance(item, F.Fact):
            continue
        t0 = item.t if t0 is None else t0
        if isinstance(item, F.ExecutionStarted):
            started[item.execution] = item.t
        elif isinstance(item, F.ExecutionFinished) and item.execution in started:
            _, g, i = (int(p[1:]) for p in item.execution.split("-"))
            durations[(item.step, g * cfg["group_size"] + i)] = item.t - started.pop(item.execution)
        elif isinstance(item, F.MicrostepGranted):
            previous = holding.pop(item.replica, None)
            if previous is not None and previous in granted:
                micro.append(item.t - granted.pop(previous))
            granted[(item.step, item.microstep)] = item.t
            holding[item.replica] = (item.step, item.microstep)
        elif isinstance(item, F.MicrostepCommitted) and (item.step, item.microstep) in granted:
            micro.append(item.t - granted.pop((item.step, item.microstep)))
            if holding.get(item.replica) == (item.step, item.microstep):
                del holding[item.replica]
        elif isinstance(item, F.CellSwitched) and (item.from_role, item.to_role) in switches:
            if "total_s" in item.durations:
                switches[(item.from_role, item.to_role)].append(float(item.durations["total_s"]))
        elif isinstance(item, F.StepSealed):
            sealed.append(item.microsteps)
        elif isinstance(item, F.StepCompleted):
            ends.append(item.t - (t0 or 0.0))
    if not durations or not micro:
        raise ValueError("the trace has no finished execution or no committed micro-step to replay")
    per_group = max(1, round(statistics.median(sealed) / cfg["groups_per_step"])) if sealed else 1
    return Measured(
        mode=head["mode"], options=head.get("options", {}), cells=len(cfg["cells"]), capacity=cfg["capacity"],
        groups=cfg["groups_per_step"], group_size=cfg["group_size"], steps=cfg["steps"],
        staleness=cfg.get("staleness", 1), pool=cfg.get("pool", 0), durations=durations,
        microstep_s=statistics.median(micro), microsteps_per_group=per_group,
        to_training_s=statistics.median(switches[("rollout", "training")] or [0.0]),
        to_rollout_s=statistics.median(switches[("training", "rollout")] or [0.0]), step_ends=ends)


def workload_at(m: Measured, cells: int, *, steps: int | None = None, seed: int = 0) -> Workload:
    """The measured run on `cells` cells: groups per step scale with the cells (at least
    one), C_e, S, micro-steps per group and switch costs stay."""
    steps = steps or m.steps
    groups = max(1, round(m.groups * cells / m.cells))
    n = groups * m.group_size
    observed = np.array(sorted(m.durations.values()))
    rng = np.random.default_rng([seed, cells])
    durations = rng.choice(observed, size=(steps, n), replace=True)
    if cells == m.cells and groups == m.groups:  # the run itself: replay what was measured
        for (k, i), d in m.durations.items():
            if k < steps and i < n:
                durations[k, i] = d
    return Workload(cells=cells, capacity=m.capacity, groups=groups, group_size=m.group_size, durations=durations,
                    microsteps_per_group=m.microsteps_per_group, microstep_s=m.microstep_s,
                    to_training_s=m.to_training_s, to_rollout_s=m.to_rollout_s, staleness=m.staleness,
                    pool=m.pool if cells == m.cells else round(m.pool * cells / m.cells))


def async_splits(cells: int) -> list[int]:
    """The rollout cells of the async splits tried at `cells`: every split up to 8 cells, then
    the splits at eighths of the cluster."""
    if cells <= 8:
        return list(range(1, cells))
    return sorted({min(cells - 1, max(1, round(cells * f / 8))) for f in range(1, 8)})


def report(path, cells: list[int], modes: tuple[str, ...], overrides: dict | None = None) -> dict:
    """What-if figures of a trace: the step time it measured and the one the simulator
    predicts for its own mode and size, then every mode at each cell count."""
    from gyre.sim import bench
    from gyre.sim.bounds import step_time

    overrides = overrides or {}
    m = measured(open(path, encoding="utf-8"))
    switch = {k: overrides[k] for k in ("to_training_s", "to_rollout_s") if k in overrides}
    own = dataclasses.replace(workload_at(m, m.cells, steps=overrides.get("steps")), **switch)
    predicted = step_time(bench.run(own, m.mode, **m.options).step_ends)
    out: dict = {"trace": str(path), "mode": m.mode, "options": m.options, "cells": m.cells,
                 "capacity": m.capacity, "groups": m.groups, "group_size": m.group_size,
                 "microstep_s": m.microstep_s, "microsteps_per_group": m.microsteps_per_group,
                 "to_training_s": own.to_training_s, "to_rollout_s": own.to_rollout_s,
                 "executions_measured": len(m.durations), "predicted_step_time_s": predicted}
    if len(m.step_ends) >= 2:
        out["measured_step_time_s"] = step_time(m.step_ends)
        out["prediction_error"] = (predicted - out["measured_step_time_s"]) / out["measured_step_time_s"]
    by_cells = {}
    for k in cells:
        w = dataclasses.replace(workload_at(m, k, steps=overrides.get("steps")), **switch)
        figures = bench.compare(w, modes=modes, splits=async_splits(k)).figures
        figures.pop("audit", None)
        by_cells[str(k)] = figures | {"executions_per_step": w.groups * w.group_size}
    out["by_cells"] = by_cells
    return out


def table(r: dict) -> str:
    lines = [f"trace {r['trace']}: {r['mode']} on {r['cells']} cells, C_e {r['capacity']}, "
             f"{r['groups']} × {r['group_size']} executions per step, micro-step {r['microstep_s']:.1f} s, "
             f"switches {r['to_training_s']:.2f} s / {r['to_rollout_s']:.2f} s"]
    pred = f"  predicted step time of its own mode: {r['predicted_step_time_s']:.1f} s"
    if "measured_step_time_s" in r:
        pred += f" (measured {r['measured_step_time_s']:.1f} s, error {r['prediction_error']:+.1%})"
    lines.append(pred)
    modes = list(next(iter(r["by_cells"].values()))["step_time_s"]) if r["by_cells"] else []
    lines.append(f"  {'cells':>5s} {'executions':>10s} " + " ".join(f"{m:>20s}" for m in modes) + "   (step time, s)")
    for k, f in r["by_cells"].items():
        lines.append(f"  {k:>5s} {f['executions_per_step']:>10d} "
                     + " ".join(f"{f['step_time_s'].get(m, float('nan')):>20.1f}" for m in modes))
    return "\n".join(lines)
