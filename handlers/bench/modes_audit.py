"""What one `gyre run` of `gyre bench modes` recorded, read back: its step time, the audit
keys of BENCHMARKS.md, the simulator's prediction of its step time, and its picture.

Sources, all in the run directory: `trace.jsonl` (the scheduler's facts and actions, replayed
through a fresh policy of its mode: the cells' roles, the executions each engine held, the
water level, exactly as the scheduler saw them), `metrics.jsonl` (`step.completed`: when
each optimizer update ended, its staleness histogram; `cell.switched`), and the daemons' last
Prometheus scrapes `metrics/<daemon>.prom` (proxy retries, KV tokens imported, bytes a switch
freed). A key whose source the run does not record is None, with a line in `notes` saying
what is missing; nothing is estimated in its place.

Definitions (the simulator's, `gyre.sim.cluster.SimResult`, so both can be compared):
- `idle_cell_s`: cell-seconds from the first dispatch to the end of the last step's update:
  `rollout` (a serving cell's empty slots ÷ C_e), `training` (a training cell holding no
  micro-step grant), `switching` (a cell between roles);
- `microsteps_per_cell`: micro-steps committed per replica (`microstep.committed`);
- `microstep_s`: the median time a replica held a micro-step (gyre.sim.whatif), the device
  time the simulator replays;
- `dispatch_delay_s`: seconds from the scheduler's dispatch of an execution to the runner's
  `execution.started` (p50, max);
- `switches`: the cells' role changes between rollout and training up to the last step's
  end (the start's announcements and the run-done returns left out): count, p50 duration
  per direction (`cell.switched` total_s), bytes freed per direction.
"""
from __future__ import annotations

import json
import statistics
from pathlib import Path

from gyre.control import facts as F
from gyre.control.timeline import STATES, Replayed, replay  # noqa: F401 - the audit reads runs through them
from gyre.sim.bounds import step_time
from handlers.run_cells import draw as picture  # noqa: F401 - `gyre bench modes` draws each run


def step_ends(metrics_lines: list[dict]) -> list[float]:
    """T_k from `metrics.jsonl`: when `gyre run` learned that step k's update ended (its
    `step.completed`), one per step in step order."""
    by_step = {}
    for x in metrics_lines:
        if x.get("kind") == "step.completed" and x["step"] not in by_step:
            by_step[x["step"]] = x["t"]
    return [by_step[k] for k in sorted(by_step)]


def _p50(values: list[float]) -> float | None:
    return round(statistics.median(values), 4) if values else None


def prom_samples(run_dir: Path, daemons: list[str] | None = None) -> dict[str, list[tuple[dict, float]]]:
    """sample name -> [(labels, value)] over the `.prom` scrapes of `daemons` (default all);
    a label `daemon` is added. A counter a daemon declares without samples yet (labelled, never
    incremented) is there with no samples: it counted none, which is not the same as a
    build that has no such counter (absent)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, list[tuple[dict, float]]] = {}
    for path in sorted((Path(run_dir) / "metrics").glob("*.prom")):
        if daemons is not None and path.stem not in daemons:
            continue
        for family in text_string_to_metric_families(path.read_text()):
            if family.type == "counter":
                out.setdefault(f"{family.name}_total", [])
            for s in family.samples:
                out.setdefault(s.name, []).append(({**s.labels, "daemon": path.stem}, float(s.value)))
    return out


def audit(run_dir: Path, r: Replayed, metrics_lines: list[dict], lines: list[str] | None = None) -> tuple[dict, list[str]]:
    """The audit keys of one run (module docstring) and the notes on keys it could not read;
    with the trace's `lines`, also `microstep_s` (gyre.sim.whatif's: what the simulator replays)."""
    notes: list[str] = []
    prom = prom_samples(run_dir)
    retries = prom.get("gyre_proxy_retries_total")
    if retries is None:
        notes.append("proxy_retries: the proxy does not count retries in this build (gyre_proxy_retries_total)")
    imported = prom.get("gyre_engine_kv_imported_tokens_total")
    if imported is None:
        notes.append("kv_tokens_migrated: no cell counts imported KV tokens in this build "
                     "(gyre_engine_kv_imported_tokens_total)")
    hist: dict[str, int] = {}
    steps = [x for x in metrics_lines if x.get("kind") == "step.completed"]
    for x in steps:
        for k, v in (x.get("staleness_histogram") or {}).items():
            hist[str(k)] = hist.get(str(k), 0) + int(v)
    by_dir: dict[str, list[F.CellSwitched]] = {}
    for s in r.switched:
        by_dir.setdefault(f"{s.from_role}_to_{s.to_role}", []).append(s)
    freed = _freed_bytes(run_dir, metrics_lines, prom, r)
    if freed is None:
        notes.append("switches.released_bytes: cells do not measure the bytes a switch frees in this build "
                     "(cell.switched bytes.freed)")
    switches = {
        "count": len(r.switched),
        "p50_s": {d: _p50([float(s.durations["total_s"]) for s in v if "total_s" in s.durations])
                  for d, v in sorted(by_dir.items())},
        "released_bytes": freed,
    }
    delays = r.dispatch_delays
    out = {
        "microsteps_per_cell": r.commits,
        "idle_cell_s": r.idle_cell_s,
        "dispatch_delay_s": {"p50": _p50(delays), "max": round(max(delays), 4) if delays else None},
        "proxy_retries": ({lab["reason"]: int(v) for lab, v in retries if lab.get("reason")} if retries is not None
                          else None),
        "kv_tokens_migrated": int(sum(v for _, v in imported)) if imported is not None else None,
        "staleness_histogram": dict(sorted(hist.items(), key=lambda kv: int(kv[0]))),
        "switches": switches,
        "window_s": round(r.window[1] - r.window[0], 3),
    }
    if lines is not None:
        from gyre.sim import whatif

        out["microstep_s"] = round(whatif.measured(lines).microstep_s, 4)
    return out, notes


def _freed_bytes(run_dir: Path, metrics_lines: list[dict], prom: dict, r: Replayed) -> dict | None:
    """Bytes freed per switch direction: from the cells' `cell.switched` (metrics.jsonl
    `bytes.freed`) within the window, else their `gyre_switch_bytes_total{kind="freed"}`;
    None when neither is recorded."""
    lines = [x for x in metrics_lines if x.get("kind") == "cell.switched" and isinstance(x.get("bytes"), dict)]
    if lines:
        out: dict[str, list[int]] = {}
        for x in lines:
            if "freed" in x["bytes"] and x.get("from_role") in ("rollout", "training"):
                out.setdefault(f"{x['from_role']}_to_{x['to_role']}", []).append(int(x["bytes"]["freed"]))
        if out:
            return {d: {"p50": int(statistics.median(v)), "total": int(sum(v))} for d, v in sorted(out.items())}
    samples = prom.get("gyre_switch_bytes_total")
    if samples is None:
        return None
    total: dict[str, float] = {}
    for labels, value in samples:
        if labels.get("kind") == "freed":
            total[labels["direction"]] = total.get(labels["direction"], 0.0) + value
    return {d: {"p50": None, "total": int(v)} for d, v in sorted(total.items())}


def predicted_step_s(lines: list[str], warmup: int) -> float:
    """`gyre sim --trace`'s prediction of the run's step time: the simulator runs the trace's
    own mode at its own size on the durations, micro-step time and switch costs it measured
    (gyre.sim.whatif), step time over the same steps as the run's."""
    from gyre.sim import bench as simbench
    from gyre.sim import whatif

    m = whatif.measured(lines)
    res = simbench.run(whatif.workload_at(m, m.cells), m.mode, **m.options)
    return step_time(res.step_ends, warmup)


def read_metrics(run_dir: Path) -> list[dict]:
    out = []
    path = Path(run_dir) / "metrics.jsonl"
    if path.exists():
        for raw in path.read_text().splitlines():
            try:
                out.append(json.loads(raw))
            except json.JSONDecodeError:
                continue
    return out
