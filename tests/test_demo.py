"""`make demo` (`gyre run learning`) schedules elastic on two cells, and its summary shows the
cells: the switches with their durations and the path of the picture of cells over time.

The short run is the learning recipe's scheduling (mode, cells, S) on the toy task set with
the random embedded model, one step: every daemon a process, a private nats-server, the
scheduler's trace drawn as `gyre run` draws it (about a minute on 2 cores). The full demo's
figures (10 steps, the warm start, three runs) are in docs/results.md.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from gyre.config import load_recipe
from handlers.bench import learning as bench_learning
from handlers.run import _parse_overrides

ROOT = Path(__file__).resolve().parents[1]


def test_the_demo_recipe_is_elastic_on_two_cells_and_the_learning_bench_stays_colocate_on_one():
    r = load_recipe("learning")
    assert r.run.mode == "elastic" and r.cells.count >= 2
    # S = 0: burst k is sampled by v_k alone, whichever cell serves a call and whenever one switched
    assert r.train.max_staleness == 0
    # BENCHMARKS.md's gyre bench learning: colocate on one cell, whatever the recipe schedules
    pinned = load_recipe("learning", _parse_overrides(list(bench_learning.PINNED)))
    assert (pinned.run.mode, pinned.cells.count) == ("colocate", 1)


def test_a_short_demo_run_prints_its_switches_and_the_path_of_its_picture(tmp_path):
    runs = tmp_path / "runs"
    env = dict(os.environ, GYRE_RUNS_DIR=str(runs), HF_HUB_OFFLINE="1")
    env.pop("GYRE_NATS_URL", None)  # its own nats-server, as `make demo` starts one
    argv = [sys.executable, "-m", "handlers.cli", "run", "learning", "--run-id", "demo", "--timeout", "300"]
    for item in ("run.steps=1", "tasks.set=toy", "model.warm_start=''", "harness.max_calls=2",
                 "sampling.max_tokens=16", "tasks.groups_per_step=2", "tasks.group_size=4"):
        argv += ["--set", item]
    proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=420, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run_dir = runs / "demo"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["mode"], summary["cells"]) == ("elastic", 2)
    # the cells left rollout by the water level and came back: each switch measured, and printed
    switches = summary["switches"]
    assert any(s["to"] == "training" for s in switches), (switches, proc.stdout[-3000:])
    assert all(s["total_s"] > 0 and {s["from"], s["to"]} == {"rollout", "training"} for s in switches)
    out = proc.stdout
    total = sum(s["total_s"] for s in switches)
    assert f"switches         {len(switches)}, {total:.1f} s in all" in out
    printed = re.findall(r"(cell\d) → (\w+) ([\d.]+) s", out.split("switches         ")[1].split("cells picture")[0])
    assert printed == [(s["cell"], s["to"], f"{s['total_s']:.2f}") for s in switches]
    # one step: every switch to training while step 0 was under way; after it, the returns to rollout
    assert all(s["step"] == 0 for s in switches if s["to"] == "training")
    assert all(s["step"] in (0, 1) for s in switches if s["to"] == "rollout")
    if any(s["step"] == 1 for s in switches):  # printed as the run's end, not as a step 1
        assert re.search(r"^ +after +cell\d → rollout", out, re.M), out
    # the picture: the Gantt of the cells above the water level, drawn from trace.jsonl
    picture = run_dir / "cells.png"
    assert summary["cells_picture"] == str(picture)
    assert f"cells picture    {picture} " in out
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and picture.stat().st_size > 10_000
    # the summary ends by saying where the outputs are
    last = out.rstrip().splitlines()[-1]
    assert last.startswith(f"gyre: the run's outputs are in {run_dir}") and "cells.png" in last, last
