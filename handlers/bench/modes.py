"""`gyre bench modes [--json PATH]`: at equal cells, how much faster does elastic finish the
same training than colocate and async, on this machine, with the real daemons? (BENCHMARKS.md)

Every mode is one `gyre run` (every daemon a process, a private nats-server, the real proxy,
runner, evaluator, builder, cells and scheduler) on 4 cells (cell0 the core), C_e = 4, S = 1:
`elastic`, `colocate`, `colocate_overlapped`, `async` at every whole-cell split (1+3, 2+2,
3+1 rollout+training; the fastest is `async`, all are reported) and `async_nonstreaming` at
async's fastest split.

Executions: the `synthetic` harness (a real client through the real proxy, gyre/env/synthetic.py)
with 2 chat calls of 4 tokens each and think times, its duration drawn from the workload
(`tail_heavy`: lognormal, median 4 s, p90 15 s; `timeout_bound`: 40% run into the timeout,
the rest lognormal, median 10 s, p90 22.5 s; 30 s timeout), the seed and (step, group,
index) only, so every mode meets the same durations; 4 groups × 8 executions per step.

Training: the toy model, each micro-step run for real within an emulated device time
(`train.device_time_s` = 10 s / 8: the replica waits what the real forward-backward leaves of
it), so that one step on one cell takes 10 s and divides by the training cells; the audit's
`microstep_s` says what a micro-step really took (more where the machine's cores are too
busy for the real part). The token budget packs 4 executions (one trajectory each) per
micro-step: 2 per group, 8 per step. The runs' processes use one torch thread each. The
emulation is printed with the figures and kept under `emulation`.

Figures per workload and mode: `step_time_s` = (T_{N−1} − T_w)/(N − 1 − w) with T_k the end
of step k's optimizer update (`metrics.jsonl` `step.completed`), N = 1 warm-up + 4 measured
steps, w = 1; the audit keys (handlers/bench/modes_audit.py); `sim_prediction_error` =
(predicted − measured)/measured, the simulator replaying the mode's own trace
(`gyre sim --trace`, in process); the speedups of elastic; a picture per mode (the cells'
Gantt above the water level, gyre/plots.py) beside the JSON. Top-level keys are
`tail_heavy`'s. `--smoke`: tail_heavy only, elastic, colocate and async at 3+1, 2 steps
(w = 0), durations and training scaled by 0.25: a few minutes.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gyre.env.synthetic import TIMEOUT_S, WORKLOADS, records
from gyre.sim.bounds import step_time
from handlers.bench import modes_audit as A

CELLS, CAPACITY, STALENESS = 4, 4, 1
GROUPS, GROUP_SIZE = 4, 8
TRAIN_S = 10.0
"""Seconds one step takes on one cell (emulated device time plus the real micro-steps)."""
MICROSTEPS_PER_GROUP = 2
CALLS, MAX_TOKENS = 2, 4
MODES = ("elastic", "colocate", "colocate_overlapped", "async", "async_nonstreaming")
BASELINES = MODES[1:]
RUN_ENV = {"OMP_NUM_THREADS": 1}
"""The runs' processes use one torch thread each: four cells, their engines and trainers
share the machine's cores (two here), and more threads per process only fight over them."""
SPLITS = (1, 2, 3)
"""Rollout cells of the async splits (1+3, 2+2, 3+1)."""


@dataclasses.dataclass(frozen=True)
class Plan:
    """What the bench runs. steps: per run, warm-up included; scale multiplies every
    execution duration, the timeout and the training time."""

    workloads: tuple[str, ...] = WORKLOADS
    modes: tuple[str, ...] = MODES
    splits: tuple[int, ...] = SPLITS
    steps: int = 5
    warmup: int = 1
    scale: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.steps - 1 - self.warmup < 1:
            raise ValueError(f"the step time needs steps - 1 - warmup >= 1 (steps {self.steps}, warmup {self.warmup})")
        bad = [m for m in self.modes if m not in MODES] + [w for w in self.workloads if w not in WORKLOADS]
        if bad:
            raise ValueError(f"unknown mode or workload {bad[0]!r} (modes: {', '.join(MODES)}; "
                             f"workloads: {', '.join(WORKLOADS)})")
        if not self.splits or any(not 1 <= r < CELLS for r in self.splits):
            raise ValueError(f"async splits are rollout cells in 1..{CELLS - 1}, got {self.splits}")


SMOKE = Plan(workloads=("tail_heavy",), modes=("elastic", "colocate", "async"), splits=(3,), steps=2, warmup=0,
             scale=0.25)


def split_name(rollout: int) -> str:
    return f"{rollout}+{CELLS - rollout}"


# --- the emulation ---------------------------------------------------------------------------

def trajectory_tokens(model_dir: Path) -> int:
    """Token positions of one synthetic execution's trajectory: its calls' chat rendered as
    the proxy renders it, every answer `MAX_TOKENS` long (the ids are reused verbatim)."""
    from gyre.serving.chat import render
    from gyre.serving.model import load_tokenizer

    tok = load_tokenizer(model_dir)
    messages = [{"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": "Execution s0-g0-e0: say something."}]
    answer = " a" * MAX_TOKENS
    for _ in range(CALLS - 1):
        messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "Go on."}]
    return len(tok(render(tok, messages), add_special_tokens=False)["input_ids"]) + MAX_TOKENS


def emulation(plan: Plan, model_dir: Path) -> dict:
    """The micro-step shape and the emulated device time (module docstring)."""
    length = trajectory_tokens(model_dir)
    per = GROUP_SIZE // MICROSTEPS_PER_GROUP
    microsteps = GROUPS * MICROSTEPS_PER_GROUP
    return {"train_s_per_step_on_one_cell": TRAIN_S * plan.scale, "microsteps_per_step": microsteps,
            "trajectory_tokens": length, "microstep_tokens": int((per + 0.5) * length),
            "device_time_s": round(TRAIN_S * plan.scale / microsteps, 4),
            "torch_threads_per_process": RUN_ENV["OMP_NUM_THREADS"],
            "note": "each micro-step runs for real on the toy model; its real forward-backward counts towards "
                    "device_time_s (the replica waits the rest), so a micro-step lasts about max(device_time_s, "
                    "its forward-backward): where the machine is too busy for that, the audit's microstep_s shows it"}


# --- one run ---------------------------------------------------------------------------------

def task_file(workdir: Path, workload: str, plan: Plan) -> Path:
    path = workdir / "tasks" / f"synthetic-{workload}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = records(workload, seed=plan.seed, scale=plan.scale, calls=CALLS, max_tokens=MAX_TOKENS)
    path.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in lines))
    return path


def overrides(plan: Plan, emu: dict, mode: str, rollout: int | None, tasks: Path, model_dir: Path) -> list[str]:
    """The `--set` items of one run (on the bundled `toy` recipe)."""
    items = [f"run.mode={mode}", f"run.steps={plan.steps}", f"run.seed={plan.seed}",
             f'tasks.set="{tasks}"', f"tasks.groups_per_step={GROUPS}", f"tasks.group_size={GROUP_SIZE}",
             "harness.name=synthetic", f"harness.timeout_s={TIMEOUT_S * plan.scale!r}", f"harness.max_calls={CALLS}",
             f"harness.concurrency={2 * CELLS * CAPACITY}", f"sampling.max_tokens={MAX_TOKENS}",
             f'model.dir="{model_dir}"', f"train.microstep_tokens={emu['microstep_tokens']}",
             f"train.device_time_s={emu['device_time_s']!r}", f"train.max_staleness={STALENESS}",
             f"cells.count={CELLS}", f"cells.capacity={CAPACITY}"]
    if rollout is not None:
        items.append(f"run.rollout_cells={rollout}")
    return items


def run_one(plan: Plan, emu: dict, workdir: Path, workload: str, mode: str, rollout: int | None,
            tasks: Path, model_dir: Path, pictures: Path, quiet: bool) -> dict:
    """One `gyre run` of `mode`, then its figures; {"error": ...} when the run failed."""
    label = mode if rollout is None else f"{mode} {split_name(rollout)}"
    run_id = f"{workload}-{label.replace(' ', '-').replace('+', 'p')}-{secrets.token_hex(2)}".replace("_", "-")
    argv = [sys.executable, "-m", "handlers.cli", "run", "toy", "--run-id", run_id,
            "--timeout", str(plan.steps * (120 * plan.scale + 60) + 300)]
    for item in overrides(plan, emu, mode, rollout, tasks, model_dir):
        argv += ["--set", item]
    env = dict(os.environ, GYRE_RUNS_DIR=str(workdir / "runs"), HF_HUB_OFFLINE="1",
               **{k: str(v) for k, v in RUN_ENV.items()})
    log_path = workdir / "logs" / f"{run_id}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(argv, env=env, stdout=None if not quiet else log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL)
        try:
            proc.wait()
        except BaseException:  # interrupted: gyre run stops its daemons and its nats-server on SIGTERM
            proc.terminate()
            proc.wait(60)
            raise
    wall = round(time.monotonic() - t0, 1)
    run_dir = workdir / "runs" / run_id
    out: dict = {"run_dir": str(run_dir), "wall_s": wall, "label": label}
    if proc.returncode != 0 or not (run_dir / "trace.jsonl").exists():
        tail = log_path.read_text(errors="replace")[-1500:] if log_path.exists() else ""
        out["error"] = f"gyre run exited with {proc.returncode}; its output ({log_path}) ends with: {tail}"
        return out
    lines = (run_dir / "trace.jsonl").read_text().splitlines()
    metrics = A.read_metrics(run_dir)
    ends = A.step_ends(metrics)
    if len(ends) < plan.steps:
        out["error"] = f"{len(ends)} of {plan.steps} steps completed"
        return out
    r = A.replay(lines)
    measured = step_time(ends, plan.warmup)
    audit, notes = A.audit(run_dir, r, metrics, lines)
    predicted = A.predicted_step_s(lines, plan.warmup)
    name = f"{pictures.name}-{workload}-{label.replace(' ', '-')}.png"
    title = (f"{workload} — {label}: step time {measured:.1f} s ({CELLS} cells, C_e {CAPACITY}, S {STALENESS}; "
             f"this machine, emulated device time)")
    png = A.picture(pictures.parent / name, r, title)
    out.update(step_time_s=round(measured, 3), step_ends=[round(e, 3) for e in ends], audit=audit, notes=notes,
               sim_predicted_step_time_s=round(predicted, 3),
               sim_prediction_error=round((predicted - measured) / measured, 4), picture=str(png))
    return out


# --- the bench -------------------------------------------------------------------------------

def bench_workload(plan: Plan, emu: dict, workdir: Path, workload: str, model_dir: Path, pictures: Path,
                   quiet: bool, say) -> dict:
    """Every mode of `plan` on one workload: the figures under BENCHMARKS.md's keys."""
    tasks = task_file(workdir, workload, plan)
    runs: dict[str, dict] = {}

    def go(mode: str, rollout: int | None = None) -> dict:
        label = mode if rollout is None else f"{mode} {split_name(rollout)}"
        say(f"{workload}: {label} ...")
        res = run_one(plan, emu, workdir, workload, mode, rollout, tasks, model_dir, pictures, quiet)
        say(f"{workload}: {label}: " + (f"step time {res['step_time_s']:.2f} s (sim {res['sim_predicted_step_time_s']:.2f} s), "
                                        f"{res['wall_s']} s wall" if "error" not in res else f"FAILED: {res['error'][:300]}"))
        runs[label] = res
        return res

    out: dict = {"step_time_s": {}, "async_splits": {}, "audit": {}, "sim_prediction_error": {},
                 "sim_predicted_step_time_s": {}, "pictures": {}, "notes": {}}

    def keep(mode: str, res: dict) -> None:
        if "error" in res:
            out["step_time_s"][mode] = None
            out["notes"][mode] = [res["error"]]
            return
        out["step_time_s"][mode] = res["step_time_s"]
        out["audit"][mode] = res["audit"]
        out["sim_prediction_error"][mode] = res["sim_prediction_error"]
        out["sim_predicted_step_time_s"][mode] = res["sim_predicted_step_time_s"]
        out["pictures"][mode] = res["picture"]
        if res["notes"]:
            out["notes"][mode] = res["notes"]

    best: int | None = None
    for mode in [m for m in plan.modes if m != "async_nonstreaming"]:
        if mode != "async":
            keep(mode, go(mode))
            continue
        by_split = {r: go("async", r) for r in plan.splits}
        times = {split_name(r): res.get("step_time_s") for r, res in by_split.items()}
        ok = {r: res["step_time_s"] for r, res in by_split.items() if "error" not in res}
        best = min(ok, key=ok.get) if ok else None
        out["async_splits"]["async"] = {"step_time_s": times, "best": split_name(best) if best else None}
        keep("async", by_split[best] if best else next(iter(by_split.values())))
    if "async_nonstreaming" in plan.modes:
        rollout = best or plan.splits[-1]
        keep("async_nonstreaming", go("async_nonstreaming", rollout))
        out["async_splits"]["async_nonstreaming"] = {"step_time_s": {split_name(rollout): out["step_time_s"][
            "async_nonstreaming"]}, "best": split_name(rollout)}
    out.update(headline(out))
    out["runs"] = runs
    return out


def headline(w: dict) -> dict:
    """speedup_vs_<baseline>, switch_s and prefill_tokens_saved_by_kv_migration of one workload."""
    steps = w["step_time_s"]
    out: dict = {}
    e = steps.get("elastic")
    for m in BASELINES:
        out[f"speedup_vs_{m}"] = round(steps[m] / e, 4) if e and steps.get(m) else None
    audit = w["audit"].get("elastic", {})
    p50 = (audit.get("switches") or {}).get("p50_s", {})
    out["switch_s"] = {"rollout_to_training_p50": p50.get("rollout_to_training"),
                       "training_to_rollout_p50": p50.get("training_to_rollout")}
    out["prefill_tokens_saved_by_kv_migration"] = audit.get("kv_tokens_migrated")
    return out


def targets(f: dict) -> dict:
    """BENCHMARKS.md's targets: value, bound, met (None: not measured)."""
    def row(value, bound, at_least=True) -> dict:
        met = None if value is None else (value >= bound if at_least else value <= bound)
        return {"value": value, "target": (">= " if at_least else "<= ") + str(bound), "met": met}

    out = {}
    th, tb = f["workloads"].get("tail_heavy"), f["workloads"].get("timeout_bound")
    if th:
        out["tail_heavy speedup_vs_colocate"] = row(th["speedup_vs_colocate"], 1.5)
        out["tail_heavy speedup_vs_async"] = row(th["speedup_vs_async"], 1.05)
    if tb:
        out["timeout_bound speedup_vs_colocate"] = row(tb["speedup_vs_colocate"], 1.3)
    for name, w in f["workloads"].items():
        for m in ("colocate_overlapped", "async_nonstreaming"):
            if f"speedup_vs_{m}" in w and m in w["step_time_s"]:
                out[f"{name} speedup_vs_{m}"] = row(w[f"speedup_vs_{m}"], 1.0)
        for mode, err in w["sim_prediction_error"].items():
            out[f"{name} {mode} |sim_prediction_error|"] = row(None if err is None else abs(err), 0.15, False)
    if th:
        out["switch rollout_to_training_p50 s"] = row(th["switch_s"]["rollout_to_training_p50"], 0.5, False)
        out["switch training_to_rollout_p50 s"] = row(th["switch_s"]["training_to_rollout_p50"], 0.3, False)
        saved = th["prefill_tokens_saved_by_kv_migration"]
        out["prefill_tokens_saved_by_kv_migration"] = {"value": saved, "target": "> 0",
                                                       "met": None if saved is None else saved > 0}
    return out


def measure(plan: Plan, *, workdir: Path | None = None, json_path: Path | None = None, quiet: bool = True,
            say=print) -> dict:
    """Write the model, calibrate the emulation, run every workload and mode; the figures."""
    from handlers.bench.proxy import machine
    from gyre.config import load_recipe
    from gyre.serving.model import ModelSpec, init_model

    import logging

    import structlog
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the model is written and calibrated in this process
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    started = time.monotonic()
    root = Path(workdir or tempfile.mkdtemp(prefix="gyre-bench-modes-")).resolve()
    root.mkdir(parents=True, exist_ok=True)
    model_dir = root / "model"
    if not (model_dir / "config.json").exists():
        shutil.rmtree(model_dir, ignore_errors=True)
        m = load_recipe("toy").model
        init_model(model_dir, ModelSpec(layers=m.layers, hidden=m.hidden, heads=m.heads, kv_heads=m.kv_heads,
                                        head_dim=m.hidden // m.heads, intermediate=3 * m.hidden, seed=m.seed))
    emu = emulation(plan, model_dir)
    say(f"emulated device time: {emu['device_time_s']} s per micro-step, its real forward-backward included; "
        f"{emu['microsteps_per_step']} micro-steps of ≤ {emu['microstep_tokens']} tokens per step "
        f"({emu['trajectory_tokens']} per execution): {emu['train_s_per_step_on_one_cell']} s per step on one cell")
    pictures = (json_path.resolve().with_suffix("") if json_path else root / "modes")
    out: dict = {"settings": {"cells": CELLS, "capacity": CAPACITY, "staleness": STALENESS, "groups": GROUPS,
                              "group_size": GROUP_SIZE, "calls": CALLS, "max_tokens": MAX_TOKENS,
                              "timeout_s": TIMEOUT_S * plan.scale, **dataclasses.asdict(plan)},
                 "emulation": emu, "workdir": str(root)}
    out["workloads"] = {w: bench_workload(plan, emu, root, w, model_dir, pictures, quiet, say) for w in plan.workloads}
    top = out["workloads"].get("tail_heavy") or next(iter(out["workloads"].values()))
    out.update({k: top[k] for k in headline(top)})
    out["targets"] = targets(out)
    out["machine"] = machine()
    out["wall_s"] = round(time.monotonic() - started, 1)
    return out


def _num(x, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def print_table(f: dict) -> None:
    e, s = f["emulation"], f["settings"]
    print(f"\ngyre bench modes — {s['cells']} cells, C_e {s['capacity']}, S {s['staleness']}, {s['groups']} × "
          f"{s['group_size']} executions per step, {s['steps']} steps (w = {s['warmup']}), scale {s['scale']}, "
          f"seed {s['seed']}; one repetition on this machine (shared and slow: the figures move from run to run)")
    print(f"emulated device time {e['device_time_s']} s per micro-step (its real forward-backward included), "
          f"{e['microsteps_per_step']} micro-steps per step: {e['train_s_per_step_on_one_cell']} s per step on one "
          f"cell; measured per micro-step (p50) in each run below")
    for name, w in f["workloads"].items():
        print(f"\n{name}")
        print(f"  {'mode':22s} {'step (s)':>9s} {'elastic is':>10s} {'sim (s)':>8s} {'sim err':>8s} {'switches':>8s} "
              f"{'idle r/t/s (cell-s)':>22s} {'µstep (s)':>9s}  micro-steps per cell")
        for mode, st in w["step_time_s"].items():
            a = w["audit"].get(mode, {})
            idle = a.get("idle_cell_s") or {}
            label = mode + (f" {w['async_splits'][mode]['best']}" if mode in w["async_splits"] else "")
            print(f"  {label:22s} {_num(st, '9.2f')} {_num(w.get(f'speedup_vs_{mode}'), '9.2f') + ('×' if w.get(f'speedup_vs_{mode}') else ' '):>10s} "
                  f"{_num(w['sim_predicted_step_time_s'].get(mode), '8.2f')} {_num(w['sim_prediction_error'].get(mode), '+8.1%')} "
                  f"{_num((a.get('switches') or {}).get('count'), '8d')} "
                  f"{'/'.join(_num(idle.get(k), '.0f') for k in ('rollout', 'training', 'switching')):>22s} "
                  f"{_num(a.get('microstep_s'), '9.2f')}  {a.get('microsteps_per_cell', '')}")
        for mode, sp in w["async_splits"].items():
            print(f"  {mode} splits (step s): " + ", ".join(f"{k} {_num(v, '.2f')}" for k, v in sp["step_time_s"].items()))
        print(f"  switch p50 (elastic): {w['switch_s']}; prefill tokens saved by KV migration: "
              f"{w['prefill_tokens_saved_by_kv_migration']}")
        notes: dict[str, list[str]] = {}
        for mode, ns in w["notes"].items():
            for n in ns:
                notes.setdefault(n, []).append(mode)
        for n, modes in notes.items():
            print(f"  note ({', '.join(modes)}): {n}")
    print("\ntargets:")
    for name, t in f["targets"].items():
        met = {True: "met", False: "NOT met", None: "not measured"}[t["met"]]
        print(f"  {name:50s} {_num(t['value'], '.3f') if isinstance(t['value'], float) else t['value']!s:>10s}  "
              f"{t['target']:>8s}  {met}")
    print(f"({f['wall_s']} s)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="gyre bench modes", description=__doc__.splitlines()[0])
    p.add_argument("--json", type=Path, help="write the figures here, the pictures beside it")
    p.add_argument("--workloads", help=f"comma-separated (default: {','.join(WORKLOADS)})")
    p.add_argument("--modes", help=f"comma-separated (default: {','.join(MODES)})")
    p.add_argument("--async-splits", help="rollout+training splits of async, e.g. 3+1,2+2 (default: 1+3,2+2,3+1)")
    p.add_argument("--steps", type=int, help="measured steps per run, after the warm-up (default 4)")
    p.add_argument("--warmup", type=int, help="warm-up steps (default 1)")
    p.add_argument("--scale", type=float, help="multiply durations, timeout and training time (default 1)")
    p.add_argument("--seed", type=int, help="the workloads' and runs' seed (default 0)")
    p.add_argument("--workdir", type=Path, help="where the model, task sets, runs and logs go (default: a new "
                   "temporary directory, kept)")
    p.add_argument("--smoke", action="store_true", help="tail_heavy; elastic, colocate, async 3+1; 2 steps (w = 0); "
                   "scale 0.25: a few minutes")
    p.add_argument("--verbose", action="store_true", help="show the runs' progress")
    a = p.parse_args(argv)
    base = SMOKE if a.smoke else Plan()
    change: dict = {}
    if a.workloads:
        change["workloads"] = tuple(x.strip() for x in a.workloads.split(",") if x.strip())
    if a.modes:
        change["modes"] = tuple(x.strip() for x in a.modes.split(",") if x.strip())
    if a.async_splits:
        try:
            pairs = [tuple(int(n) for n in x.split("+")) for x in a.async_splits.split(",")]
        except ValueError:
            p.error(f"--async-splits {a.async_splits!r}: expected R+T items like 3+1")
        if any(len(x) != 2 or sum(x) != CELLS for x in pairs):
            p.error(f"--async-splits: each split must add up to {CELLS} cells")
        change["splits"] = tuple(x[0] for x in pairs)
    if a.warmup is not None:
        change["warmup"] = a.warmup
    if a.steps is not None:
        change["steps"] = a.steps + change.get("warmup", base.warmup)
    elif a.warmup is not None:
        change["steps"] = base.steps - base.warmup + a.warmup
    for name in ("scale", "seed"):
        if getattr(a, name) is not None:
            change[name] = getattr(a, name)
    try:
        plan = dataclasses.replace(base, **change)
    except ValueError as exc:
        p.error(str(exc))
    def interrupted(signum, _frame):
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, interrupted)  # a run in flight is stopped cleanly (run_one)
    f = measure(plan, workdir=a.workdir, json_path=a.json, quiet=not a.verbose)
    f["command"] = "gyre bench modes " + " ".join(sys.argv[1:] if argv is None else argv)
    print_table(f)
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(f, indent=1) + "\n")
        print(f"figures written to {a.json}, pictures beside it")
    print(f"runs kept in {f['workdir']}/runs")
    failed = [f"{w}/{m}" for w, x in f["workloads"].items() for m, s in x["step_time_s"].items() if s is None]
    if failed:
        print(f"gyre bench modes: runs failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
