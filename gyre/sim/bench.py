"""Running modes on workloads and the figures of BENCHMARKS.md "gyre sim".

`run(workload, mode, **options)` simulates one policy; `compare(workload)` runs every mode
(async and async_nonstreaming at every whole-cell split, the fastest reported as the mode)
and returns the keys: `step_time_s` per mode, the four speedups of elastic, `ratio_to_ideal`,
`ratio_to_bound`, the bounds, and an audit per mode.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

from gyre.control.modes import make_policy
from gyre.control.policy import PolicyConfig
from gyre.sim.bounds import WARMUP, bound_step_s, step_time
from gyre.sim.cluster import SimResult, Simulation, Workload
from gyre.sim.profiles import Profile

BASELINES = ("colocate", "colocate_overlapped", "async", "async_nonstreaming")
ELASTIC: dict = {}
"""The one elastic configuration every profile runs (the policy's defaults)."""


def workload(p: Profile) -> Workload:
    """The workload of a profile, with its seeded durations."""
    return Workload(cells=p.cells, capacity=p.capacity, groups=p.groups, group_size=p.group_size,
                    durations=p.durations(), microsteps_per_group=p.microsteps_per_group, microstep_s=p.microstep_s,
                    to_training_s=p.to_training_s, to_rollout_s=p.to_rollout_s, load_s=p.load_s,
                    staleness=p.staleness, pool=p.pool, timeout_s=p.timeout_s)


def config(w: Workload) -> PolicyConfig:
    return PolicyConfig(cells=w.cell_names, capacity=w.capacity, groups_per_step=w.groups, group_size=w.group_size,
                        steps=w.steps, staleness=w.staleness, pool=w.pool)


def run(w: Workload, mode: str, *, timeline: bool = False, trace: Path | None = None, **options) -> SimResult:
    """Simulate one policy of `mode` on `w`; with `trace`, write its trace there."""
    policy = make_policy(mode, config(w), **options)
    if trace is None:
        return Simulation(w, policy, timeline=timeline).run()
    from gyre.control.trace import Writer

    trace.parent.mkdir(parents=True, exist_ok=True)
    with trace.open("w") as f:
        return Simulation(w, policy, timeline=timeline, observe=Writer(f, policy).write).run()


@dataclasses.dataclass
class Compared:
    figures: dict
    results: dict[str, SimResult]
    """mode (async ones by split too: `async 3+1`) -> its run."""


def compare(w: Workload, *, modes: tuple[str, ...] = ("elastic", *BASELINES), timeline: bool = False,
            elastic: dict | None = None, warmup: int = WARMUP, split: int | None = None,
            splits: list[int] | None = None, traces: Path | None = None, prefix: str = "") -> Compared:
    """Every mode on `w`; the figures of BENCHMARKS.md "gyre sim" for one profile. split: the
    rollout cells of both async modes; splits: the ones to try (default: every whole-cell
    split), the fastest kept; traces: a directory for each run's trace
    (`<prefix>-<mode>.trace.jsonl`)."""
    results: dict[str, SimResult] = {}
    steps: dict[str, float] = {}
    by_mode: dict[str, dict[str, float]] = {}

    def trace(name: str) -> Path | None:
        return traces / f"{prefix}-{name.replace(' ', '-')}.trace.jsonl" if traces is not None else None

    for mode in modes:
        if mode in ("async", "async_nonstreaming"):
            if w.cells < 2:
                continue
            by_split = {}
            for r in ([split] if split else splits or range(1, w.cells)):
                res = run(w, mode, timeline=timeline, trace=trace(f"{mode} {r}+{w.cells - r}"), rollout_cells=r)
                key = f"{r}+{w.cells - r}"
                results[f"{mode} {key}"] = res
                by_split[key] = step_time(res.step_ends, warmup)
            best = min(by_split, key=by_split.get)
            by_mode[mode] = by_split
            steps[mode] = by_split[best]
            results[mode] = results[f"{mode} {best}"]
        else:
            res = run(w, mode, timeline=timeline, trace=trace(mode),
                      **((elastic if elastic is not None else ELASTIC) if mode == "elastic" else {}))
            results[mode] = res
            steps[mode] = step_time(res.step_ends, warmup)
    figures: dict = {"step_time_s": steps}
    if by_mode:
        figures["async_splits"] = {m: {"step_time_s": v, "best": min(v, key=v.get)} for m, v in by_mode.items()}
    if "elastic" in steps:
        e = steps["elastic"]
        for m in BASELINES:
            if m in steps:
                figures[f"speedup_vs_{m}"] = steps[m] / e
        bounds = bound_step_s(w, warmup)
        figures["ratio_to_ideal"] = e / bounds["ideal_s"]
        figures["ratio_to_bound"] = e / bounds["bound_s"]
        figures["bound"] = bounds
        base = [steps[m] for m in BASELINES if m in steps]
        if base:
            figures["elastic_vs_best_baseline"] = e / min(base)
    figures["audit"] = {m: audit(res, w) for m, res in results.items()}
    return Compared(figures, results)


def audit(res: SimResult, w: Workload) -> dict:
    """What shows a mode ran at its best: idle cell-seconds by kind, switches, micro-steps per cell."""
    return {"idle_cell_s": res.idle_cell_s, "switches": res.switches,
            "microsteps_per_cell": dict(sorted(res.microsteps_per_cell.items())),
            "run_s": res.step_ends[-1] if res.step_ends else 0.0}


def pictures(compared: Compared, w: Workload, directory: Path, prefix: str) -> list[Path]:
    """One PNG per mode (the async modes at their best split): roles over time above the water level."""
    from gyre.plots import timeline_png

    out = []
    for mode, res in compared.results.items():
        if " " in mode or res.timeline is None:
            continue
        tl = res.timeline
        label = mode
        split = compared.figures.get("async_splits", {}).get(mode)
        if split:
            label += f" (best split {split['best']})"
        title = (f"{prefix} — {label}: step time {compared.figures['step_time_s'][mode] / 60:.1f} min "
                 f"({w.cells} cells, C_e {w.capacity}, S {w.staleness})")
        out.append(timeline_png(directory / f"{prefix}-{mode}.png", title=title, segments=tl.segments, busy=tl.busy,
                                t=tl.t, water_level=tl.water_level, spare=tl.spare, step_ends=res.step_ends))
    return out
