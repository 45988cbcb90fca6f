"""Step time and the lower bounds of BENCHMARKS.md "gyre sim".

- step time of a run: (T_{N−1} − T_w) / (N − 1 − w), T_k the end of step k's optimizer
  update, w warm-up steps;
- ideal: all rollout and training work of the counted steps spread over all cells with no
  idle time (a cell serves C_e executions at once; the pool, when declared, adds its
  capacity to rollout but never trains);
- critical path: with W the training cell-seconds of a step, K the cells, G the groups per
  step and L_k the longest execution of burst k, T_k ≥ T_{k−1} + W/K and
  T_k ≥ T_{k−S−1} + L_k + W/(G·K), T_j = 0 for j < 0; the bound's step time is taken over
  the same steps as a run's;
- the bound is the larger of the two.
"""
from __future__ import annotations

import numpy as np

from gyre.sim.cluster import Workload

WARMUP = 1
"""Warm-up steps left out of a step time (BENCHMARKS.md "gyre bench modes": w = 1)."""


def step_time(step_ends: list[float], warmup: int = WARMUP) -> float:
    """(T_{N−1} − T_w) / (N − 1 − w); with fewer steps than that, the mean step time."""
    n = len(step_ends)
    if n - 1 - warmup < 1:
        return step_ends[-1] / n
    return (step_ends[-1] - step_ends[warmup]) / (n - 1 - warmup)


def counted(n: int, warmup: int = WARMUP) -> slice:
    """The steps a step time covers."""
    return slice(warmup + 1, n) if n - 1 - warmup >= 1 else slice(0, n)


def ideal_step_s(w: Workload, warmup: int = WARMUP) -> float:
    """Mean over the counted steps of the step's work spread over every cell and the pool
    with no idle time: max(W/K, (Σ durations + W·C_e) / (K·C_e + pool))."""
    work = w.durations[counted(w.steps, warmup)].sum(axis=1).mean()
    k, c = w.cells, w.capacity
    return max(w.train_s / k, (work + w.train_s * c) / (k * c + w.pool))


def critical_path_ends(w: Workload) -> list[float]:
    """T_k of the critical-path recurrence."""
    k_cells, s = w.cells, w.staleness
    train = w.train_s
    longest = np.max(w.durations, axis=1)
    ends: list[float] = []
    for k in range(w.steps):
        prev = ends[k - 1] if k >= 1 else 0.0
        gate = ends[k - s - 1] if k - s - 1 >= 0 else 0.0
        ends.append(max(prev + train / k_cells, gate + float(longest[k]) + train / (w.groups * k_cells)))
    return ends


def bound_step_s(w: Workload, warmup: int = WARMUP) -> dict[str, float]:
    """`ideal_s`, `critical_path_s` and `bound_s` (the larger)."""
    ideal = ideal_step_s(w, warmup)
    path = step_time(critical_path_ends(w), warmup)
    return {"ideal_s": ideal, "critical_path_s": path, "bound_s": max(ideal, path)}
