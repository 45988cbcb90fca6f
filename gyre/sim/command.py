"""`gyre sim`: the policies of `gyre.control` on simulated clusters (BENCHMARKS.md "gyre sim").

    gyre sim [--profile NAME|all] [--random N --seed S] [--json PATH] [--pictures]
    gyre sim --trace PATH [--cells 2,4,...,64] [--json PATH]

Prints a table per profile (step time per mode, elastic's speedups beside the reference's,
the bounds, the inputs) and, with --json, writes the figures under BENCHMARKS.md's keys with
one PNG per profile and mode beside the JSON (roles over time above the water level).
"""
from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import os
import platform
import statistics
import sys
import time
from importlib import metadata
from pathlib import Path

from gyre.sim import bench
from gyre.sim.bench import BASELINES
from gyre.sim.profiles import MIN, PROFILES, REFERENCE, Profile, random_profiles

RANDOM_TARGET = 1.02
"""Elastic may be at most 2% slower than the best baseline on a held-out random profile."""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gyre sim", description=(
        "Simulate the scheduling modes (the policies of gyre.control, unchanged) on the profiles of "
        "BENCHMARKS.md, on held-out random profiles, or on a run's trace."))
    p.add_argument("--profile", default=None, help=f"a fixed profile or `all` (default: all unless --random or "
                   f"--trace): {', '.join(PROFILES)}")
    p.add_argument("--random", type=int, default=0, metavar="N", help="also draw N held-out random profiles")
    p.add_argument("--seed", type=int, default=1, help="seed of the random profiles (default 1)")
    p.add_argument("--trace", type=Path, default=None, help="replay a trace.jsonl: step time per mode by cell count")
    p.add_argument("--cells", default="2,4,8,16,32,64", help="with --trace: the cell counts (default 2,4,8,16,32,64)")
    p.add_argument("--json", type=Path, default=None, help="write the figures here, the pictures beside it")
    p.add_argument("--pictures", action="store_true", help="pictures for random profiles too (fixed ones always "
                   "get them with --json)")
    p.add_argument("--no-pictures", action="store_true", help="no pictures at all")
    p.add_argument("--write-traces", type=Path, default=None, metavar="DIR",
                   help="write each simulated run's trace.jsonl into DIR")
    p.add_argument("--modes", default=",".join(("elastic", *BASELINES)), help="modes to run (default: all five)")
    p.add_argument("--async-split", default=None, metavar="R+T",
                   help="run both async modes at this split of rollout+training cells (default: every split, "
                        "the fastest reported)")
    p.add_argument("--to-training-s", type=float, default=None, help="switch cost rollout→training (default 8.52)")
    p.add_argument("--to-rollout-s", type=float, default=None, help="switch cost training→rollout (default 3.46)")
    p.add_argument("--capacity", type=int, default=None, help="C_e: executions per rollout cell (default: the "
                   "profile's)")
    p.add_argument("--staleness", type=int, default=None, help="S (default 1)")
    p.add_argument("--steps", type=int, default=None, help="steps per profile (default: the profile's)")
    p.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="worker processes (default 2)")
    return p


def _overrides(a: argparse.Namespace) -> dict:
    names = {"to_training_s": a.to_training_s, "to_rollout_s": a.to_rollout_s, "capacity": a.capacity,
             "staleness": a.staleness, "steps": a.steps}
    return {k: v for k, v in names.items() if v is not None}


def _split(text: str | None, cells: int) -> int | None:
    if text is None:
        return None
    r, t = (int(x) for x in text.split("+"))
    if r + t != cells or r < 1 or t < 1:
        raise SystemExit(f"gyre sim: --async-split {text} does not split {cells} cells")
    return r


def _run_profile(p: Profile, modes: tuple[str, ...], split: str | None, pictures: Path | None,
                 traces: Path | None) -> dict:
    """Every mode on one profile (a worker process's job): the figures, with pictures."""
    started = time.perf_counter()
    w = bench.workload(p)
    compared = bench.compare(w, modes=modes, timeline=pictures is not None, split=_split(split, p.cells),
                             traces=traces, prefix=p.name)
    figures = compared.figures
    figures["inputs"] = {k: v for k, v in p.describe().items() if k != "note"} | {"note": p.note}
    if p.name in REFERENCE:
        figures["reference"] = REFERENCE[p.name]
    if pictures is not None:
        figures["pictures"] = [str(x) for x in bench.pictures(compared, w, pictures.parent, f"{pictures.name}-{p.name}")]
    figures["wall_s"] = time.perf_counter() - started
    return figures


def _all(profiles: list[Profile], modes, split, pictures: Path | None, traces, jobs: int) -> dict[str, dict]:
    from gyre.progress import bar

    if jobs <= 1 or len(profiles) == 1:
        return {p.name: _run_profile(p, modes, split, pictures, traces)
                for p in bar(profiles, total=len(profiles), desc="profiles")}
    with concurrent.futures.ProcessPoolExecutor(max_workers=jobs) as pool:
        futures = {p.name: pool.submit(_run_profile, p, modes, split, pictures, traces) for p in profiles}
        for _ in bar(concurrent.futures.as_completed(futures.values()), total=len(futures), desc="profiles"):
            pass
        return {name: f.result() for name, f in futures.items()}


def _minutes(s: float) -> str:
    return f"{s / MIN:.1f}"


def _table(name: str, f: dict) -> str:
    i = f["inputs"]
    steps = f["step_time_s"]
    lines = [f"{name}: {i['cells']} cells" + (f" × {i['nodes_per_cell']} nodes" if i["nodes_per_cell"] else "")
             + f", C_e {i['capacity']}, S {i['staleness']}, switches {i['to_training_s']:.2f} s → training / "
             f"{i['to_rollout_s']:.2f} s → rollout, {i['groups'] * i['group_size']} executions and "
             f"{i['groups'] * i['microsteps_per_group']} micro-steps per step, {i['steps']} steps"]
    lines.append(f"  {'mode':26s} {'step (min)':>10s} {'elastic is':>11s}  {'reference':10s}  async splits (min)")
    ref = f.get("reference", {})
    for mode, s in steps.items():
        label = mode
        split = f.get("async_splits", {}).get(mode)
        if split:
            label += f" {split['best']}"
        speed = f.get(f"speedup_vs_{mode}")
        r = ref.get(f"speedup_vs_{mode}")
        rtext = "" if not r else (f"{r[0]:.2f}×" if r[0] == r[1] else f"{r[0]:.2f}–{r[1]:.2f}×")
        splits = ", ".join(f"{k} {_minutes(v)}" for k, v in split["step_time_s"].items()) if split else ""
        lines.append(f"  {label:26s} {_minutes(s):>10s} {'' if speed is None else f'{speed:.2f}×':>11s}  "
                     f"{rtext:10s}  {splits}".rstrip())
    if "ratio_to_bound" in f:
        b = f["bound"]
        line = (f"  ratio_to_bound {f['ratio_to_bound']:.3f} (bound {_minutes(b['bound_s'])} min: critical path "
                f"{_minutes(b['critical_path_s'])}, ideal {_minutes(b['ideal_s'])}); ratio_to_ideal "
                f"{f['ratio_to_ideal']:.3f}")
        if "elastic_vs_best_baseline" in f:
            line += f"; elastic ÷ best baseline {f['elastic_vs_best_baseline']:.3f}"
        lines.append(line)
    return "\n".join(lines)


def _random_summary(seed: int, figures: dict[str, dict]) -> dict:
    ratios = {n: f["elastic_vs_best_baseline"] for n, f in figures.items() if "elastic_vs_best_baseline" in f}
    if not ratios:
        return {"seed": seed, "n": len(figures), "profiles": figures}
    worst = max(ratios, key=ratios.get)
    return {"seed": seed, "n": len(figures), "worst_vs_best_baseline": ratios[worst], "worst_profile": worst,
            "median_vs_best_baseline": statistics.median(ratios.values()), "target": RANDOM_TARGET,
            "target_met": ratios[worst] <= RANDOM_TARGET, "profiles": figures}


def _machine() -> dict:
    def version(name: str) -> str | None:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return None
    return {"cores": os.cpu_count(), "python": platform.python_version(), "torch": version("torch"),
            "simpy": version("simpy"), "numpy": version("numpy"), "platform": platform.platform()}


def main(argv: list[str] | None = None) -> int:
    a = _parser().parse_args(argv)
    started = time.perf_counter()
    modes = tuple(m.strip() for m in a.modes.split(",") if m.strip())
    unknown = [m for m in modes if m not in ("elastic", *BASELINES)]
    if unknown:
        raise SystemExit(f"gyre sim: unknown mode(s) {', '.join(unknown)}")
    out: dict = {"command": "gyre sim " + " ".join(sys.argv[1:] if argv is None else argv), "machine": _machine(),
                 "warmup_steps": bench.WARMUP, "modes": list(modes)}
    overrides = _overrides(a)
    if overrides or a.async_split:
        out["inputs"] = overrides | ({"async_split": a.async_split} if a.async_split else {})
    pictures = None
    if a.json is not None and not a.no_pictures:
        pictures = a.json.with_suffix("")
    if a.trace is not None:
        from gyre.sim import whatif

        out["whatif"] = whatif.report(a.trace, [int(x) for x in a.cells.split(",")], modes, overrides)
        print(whatif.table(out["whatif"]))
    profile = a.profile or ("all" if not a.random and a.trace is None else None)
    if profile is not None:
        names = list(PROFILES) if profile == "all" else [profile]
        missing = [n for n in names if n not in PROFILES]
        if missing:
            raise SystemExit(f"gyre sim: unknown profile {missing[0]!r}; profiles: {', '.join(PROFILES)}, all")
        chosen = [dataclasses.replace(PROFILES[n], **overrides) for n in names]
        out["profiles"] = _all(chosen, modes, a.async_split, pictures, a.write_traces, a.jobs)
        for name, f in out["profiles"].items():
            print(_table(name, f), end="\n\n")
    if a.random:
        drawn = [dataclasses.replace(p, **overrides) for p in random_profiles(a.random, a.seed)]
        figures = _all(drawn, modes, a.async_split, pictures if a.pictures else None, a.write_traces, a.jobs)
        out["random"] = _random_summary(a.seed, figures)
        r = out["random"]
        for name, f in figures.items():
            print(f"  {name}: {f['inputs']['cells']} cells, C_e {f['inputs']['capacity']}: elastic "
                  f"{_minutes(f['step_time_s'].get('elastic', float('nan')))} min, ÷ best baseline "
                  f"{f.get('elastic_vs_best_baseline', float('nan')):.3f}, ratio_to_bound "
                  f"{f.get('ratio_to_bound', float('nan')):.3f}")
        if "worst_vs_best_baseline" in r:
            print(f"random profiles (seed {a.seed}, {r['n']}): elastic ÷ best baseline worst "
                  f"{r['worst_vs_best_baseline']:.3f} ({r['worst_profile']}), median {r['median_vs_best_baseline']:.3f}; "
                  f"target ≤ {RANDOM_TARGET}: {'met' if r['target_met'] else 'MISSED'}")
    out["wall_s"] = time.perf_counter() - started
    print(f"({out['wall_s']:.0f} s)")
    if a.json is not None:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(out, indent=1, default=float) + "\n")
        print(f"wrote {a.json}")
    return 0
