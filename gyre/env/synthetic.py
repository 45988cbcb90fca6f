"""The `synthetic` task family: executions whose durations follow a seeded workload
(BENCHMARKS.md "gyre bench modes"), run by the `synthetic` harness profile.

Each task's starting file `workload.json` tells the harness
(gyre/env/data/harness/synthetic_harness.py) which workload to draw from, with which seed
and scale; the harness draws its execution's duration from that and from its execution id
alone (step, group, index), so every scheduling mode meets the same durations. `answer.txt`
is graded by `expected`: the harness writes `pass` for an even index and `fail` for an odd
one, so every group's rewards differ and every execution is trained.

Pure: `records(...)` builds a task set (the bundled `synthetic.jsonl` is `records()`, which
`python -m gyre.env.synthetic` prints), `harness_module()` loads the harness file itself, so
the bench and the tests compute the very durations the harness runs (`durations`).
"""
from __future__ import annotations

import functools
import importlib.util
import json
import sys
from types import ModuleType

import numpy as np

from gyre.env.tasks import DATA_DIR

HARNESS_FILE = DATA_DIR / "harness" / "synthetic_harness.py"
WORKLOADS = ("tail_heavy", "timeout_bound")
TIMEOUT_S = 30.0
"""The workloads' execution timeout before scaling (BENCHMARKS.md)."""
N_TASKS = 4


@functools.cache
def harness_module() -> ModuleType:
    """The synthetic harness's own module (its `duration_s`, `WORKLOADS`, ...)."""
    spec = importlib.util.spec_from_file_location("gyre_synthetic_harness", HARNESS_FILE)
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(module)
    return module


def workload_spec(workload: str = "tail_heavy", *, seed: int = 0, scale: float = 1.0, calls: int = 2,
                  max_tokens: int = 4) -> dict:
    """What `workload.json` holds. Raises ValueError on an unknown workload or a bad number."""
    if workload not in WORKLOADS:
        raise ValueError(f"unknown workload {workload!r}; workloads: {', '.join(WORKLOADS)}")
    if not scale > 0 or calls < 1 or max_tokens < 1:
        raise ValueError(f"scale must be > 0, calls and max_tokens >= 1 (got {scale}, {calls}, {max_tokens})")
    return {"workload": workload, "seed": seed, "scale": scale, "timeout_s": TIMEOUT_S, "calls": calls,
            "max_tokens": max_tokens}


def records(workload: str = "tail_heavy", *, n: int = N_TASKS, **spec) -> list[dict]:
    """`n` task records of one workload (`workload_spec`'s keyword arguments)."""
    body = json.dumps(workload_spec(workload, **spec), sort_keys=True)
    return [{"instance_id": f"synthetic-{workload}-{i}", "problem_statement": f"Synthetic {workload} task {i}.",
             "files": {"workload.json": body}, "expected": {"answer.txt": "pass"},
             "timeout_s": TIMEOUT_S * spec.get("scale", 1.0), "tags": ["synthetic", workload]}
            for i in range(n)]


def durations(workload: str, *, seed: int, steps: int, groups: int, group_size: int,
              scale: float = 1.0) -> np.ndarray:
    """(steps, groups × group_size) seconds the harness runs each execution, capped at the
    timeout (`TIMEOUT_S` × scale): entry [k, g × group_size + i] is execution s<k>-g<g>-e<i>."""
    h = harness_module()
    cap = TIMEOUT_S * scale
    return np.array([[min(cap, h.duration_s(workload, seed, k, g, i, scale)) for g in range(groups)
                      for i in range(group_size)] for k in range(steps)])


if __name__ == "__main__":
    for record in records():
        sys.stdout.write(json.dumps(record, sort_keys=True) + "\n")
