"""`gyre bench learning [--json PATH]`: does the policy get better, and not by chance? (BENCHMARKS.md)

The whole system on this machine: `gyre run learning` (the `majority` task family through
the toy harness, runner, proxy, embedded engine, evaluator, builder, trainer and weight
publishing; mode `colocate` on one cell; GSPO the only loss term) for `--steps` steps
(default 20), then the same run again with `train.lr = 0`, the control: the same recipe,
seed, model and sampling seeds, so a rise that came from the task, the evaluator or the
sampling would show there too. Both runs take `GROUPS_PER_STEP` groups a step (8, twice the
recipe's 4: why at the constant). Both runs start from one warm-started checkpoint written
first (`gyre init-model --warm-start majority`, deterministic), passed as `model.dir`.

Reproducible by construction: each call is sampled with its own seed
(`gyre.serving.seeds.call_seed`: run seed, execution id, call number), the engine runs one
request per forward, the trainer works in float64 (the order in which a step's micro-steps
are summed follows the order its groups were scored in; in float64 that order moves the
weights by ~1e-16 relative, far below the float32 the engine serves in), and the warm start
runs on one thread. So the same command gives the same reward curve.

Keys: `reward_per_step`, `reward_first5`, `reward_last5`, `rise` (last5 − first5),
`wall_s` (the run, warm start excluded), `control` with the same keys, `warm_start`
(seconds, estimated initial success rate), `mode`, `task`, `steps`, `seed`, `machine`.
Target: rise ≥ 0.3 with |control rise| < 0.05, the whole command within 30 minutes.
"""
from __future__ import annotations

import argparse
import os
import secrets
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import orjson

RECIPE = "learning"
TASK = "majority"
MODE = "colocate"
PINNED = (f"run.mode={MODE}", "cells.count=1", "train.max_staleness=1")
"""BENCHMARKS.md's setting, whatever the recipe schedules (`make demo` runs it elastic on two cells)."""
GROUPS_PER_STEP = 8
"""Groups of 8 executions per step in both runs (the recipe, and so `make demo`, has 4).
The control's flatness is a statement about sampling noise: at p ≈ 0.15 a step's mean of
32 binary rewards has a standard deviation of ~0.063, so the difference of two 5-step
means has ~0.04, close to the 0.05 bound (the first full run's control moved 0.069 at 4
groups). 64 executions a step bring it to ~0.028 (the bound at ~1.8 σ); the noise falls as
1/√n, so each halving costs four times the rollouts. The optimizer step per step is the
same, and the gradient it follows is the mean over twice the groups."""


def curve_figures(rewards: list[float | None], window: int = 5) -> dict:
    """`reward_first<w>`, `reward_last<w>` and `rise` of a reward curve (None = a step that
    was never scored counts as 0)."""
    r = [0.0 if x is None else float(x) for x in rewards]
    first, last = r[:window], r[-window:]
    f = sum(first) / len(first) if first else 0.0
    l_ = sum(last) / len(last) if last else 0.0
    return {"reward_per_step": [round(x, 4) for x in r], f"reward_first{window}": round(f, 4),
            f"reward_last{window}": round(l_, 4), "rise": round(l_ - f, 4)}


def write_model(out: Path, seed: int = 0, steps: int | None = None) -> dict:
    """The runs' starting checkpoint: the embedded default model, warm-started on the task
    family as the recipe says (its `[model]` table). Returns the warm start's stats."""
    from transformers.utils import logging as hf_logging

    from gyre.config import load_recipe
    from gyre.learning.warm_start import warm_start
    from gyre.serving.model import ModelSpec, init_model

    hf_logging.disable_progress_bar()
    m = load_recipe(RECIPE).model
    init_model(out, ModelSpec(layers=m.layers, hidden=m.hidden, heads=m.heads, kv_heads=m.kv_heads,
                              head_dim=m.hidden // m.heads, intermediate=3 * m.hidden, seed=m.seed))
    return warm_start(out, m.warm_start, m.warm_start_steps if steps is None else steps, seed=seed)


def run_once(model_dir: Path, runs_dir: Path, run_id: str, *, steps: int, seed: int, lr: float | None = None,
             extra: tuple[str, ...] = (), timeout_s: float = 1800.0, quiet: bool = True) -> dict:
    """One `gyre run learning` in its own process on `model_dir`; returns its summary plus
    `wall_s` measured around the process. Raises RuntimeError when the run fails."""
    argv = [sys.executable, "-m", "handlers.cli", "run", RECIPE, "--run-id", run_id, "--timeout", str(timeout_s),
            "--set", f"run.steps={steps}", "--set", f"run.seed={seed}", "--set", f"model.dir=\"{model_dir}\"",
            *(x for item in PINNED for x in ("--set", item))]
    if lr is not None:
        argv += ["--set", f"train.lr={lr!r}"]
    for item in extra:
        argv += ["--set", item]
    env = dict(os.environ, GYRE_RUNS_DIR=str(runs_dir))
    t0 = time.monotonic()
    proc = subprocess.run(argv, check=False, env=env, stdout=subprocess.PIPE if quiet else None, stderr=subprocess.STDOUT,
                          text=True)
    wall = time.monotonic() - t0
    summary_path = runs_dir / run_id / "summary.json"
    if proc.returncode != 0 or not summary_path.exists():
        tail = (proc.stdout or "")[-3000:]
        raise RuntimeError(f"run {run_id} failed (exit {proc.returncode}); its output ends with:\n{tail}")
    summary = orjson.loads(summary_path.read_bytes())
    summary["process_wall_s"] = round(wall, 1)
    return summary


def measure(*, steps: int = 20, seed: int = 0, window: int = 5, workdir: Path | None = None,
            quiet: bool = True, warm_start_steps: int | None = None, groups: int = GROUPS_PER_STEP) -> dict:
    """Write the model, run learning then control with `groups` groups a step; the figures
    (module docstring)."""
    from handlers.bench.proxy import machine

    root = Path(workdir or tempfile.mkdtemp(prefix="gyre-bench-learning-"))
    t0 = time.monotonic()
    ws = write_model(root / "model", seed=0, steps=warm_start_steps)
    tag = secrets.token_hex(2)
    out: dict = {"task": TASK, "mode": MODE, "steps": steps, "seed": seed, "window": window,
                 "groups_per_step": groups,
                 "warm_start": {"seconds": ws["seconds"], "success": ws["success"], "steps": ws["steps"]},
                 "run_dir": str(root)}
    for name, lr in (("learning", None), ("control", 0.0)):
        s = run_once(root / "model", root / "runs", f"bench-{name}-{tag}", steps=steps, seed=seed, lr=lr,
                     extra=(f"tasks.groups_per_step={groups}",), quiet=quiet)
        figures = curve_figures(s["rewards_per_step"], window)
        figures.update(wall_s=s["wall_s"], grad_norm_per_step=s["grad_norm_per_step"],
                       tokens_trained=s["tokens_trained"], run=s["run"])
        if name == "learning":
            out.update(figures)
        else:
            out["control"] = figures
    out["total_s"] = round(time.monotonic() - t0, 1)
    out["machine"] = machine()
    return out


def print_table(f: dict) -> None:
    w = f["window"]
    print(f"\ngyre bench learning — task {f['task']}, mode {f['mode']}, {f['steps']} steps of "
          f"{f['groups_per_step']} groups, seed {f['seed']}")
    print(f"warm start: {f['warm_start']['steps']} steps, {f['warm_start']['seconds']} s, "
          f"initial success ≈ {f['warm_start']['success']:.3f}")
    print(f"{'run':10} {'first' + str(w):>8} {'last' + str(w):>8} {'rise':>8} {'wall_s':>8}   reward per step")
    for name, g in (("learning", f), ("control", f["control"])):
        curve = " ".join(f"{x:.2f}" for x in g["reward_per_step"])
        print(f"{name:10} {g[f'reward_first{w}']:8.3f} {g[f'reward_last{w}']:8.3f} {g['rise']:8.3f} "
              f"{g['wall_s']:8.1f}   {curve}")
    met = f["rise"] >= 0.3 and abs(f["control"]["rise"]) < 0.05 and f["total_s"] <= 1800
    print(f"target: rise >= 0.3 with |control rise| < 0.05 within 30 min (total {f['total_s']} s): "
          f"{'met' if met else 'NOT met'}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="gyre bench learning", description=__doc__.splitlines()[0])
    p.add_argument("--json", help="write the figures here")
    p.add_argument("--steps", type=int, default=20, help="steps of each run (default 20)")
    p.add_argument("--seed", type=int, default=0, help="the runs' seed (default 0)")
    p.add_argument("--workdir", help="where the model and the runs go (default: a new temporary directory, kept)")
    p.add_argument("--verbose", action="store_true", help="show the runs' progress")
    a = p.parse_args(argv)
    if a.steps < 10:
        p.error("--steps must be >= 10 (the first and last 5 steps are compared)")
    f = measure(steps=a.steps, seed=a.seed, workdir=Path(a.workdir) if a.workdir else None, quiet=not a.verbose)
    print_table(f)
    if a.json:
        Path(a.json).write_bytes(orjson.dumps(f, option=orjson.OPT_INDENT_2))
        print(f"figures written to {a.json}")
    print(f"runs kept in {f['run_dir']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
