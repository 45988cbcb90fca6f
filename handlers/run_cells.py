"""The cells of a finished `gyre run`, for its summary: the switches and the picture.

- `switches(progress_switches)`: the role changes between rollout and training that the
  cells reported on `cell.switched` (the start's announcements, from `idle`, left out), each
  with the cell, the direction, the run time it ended at (`t`), the step under way then
  (`step`: the steps completed so far) and its measured durations (`total_s`, `release_s`,
  `load_s`), in the order they were reported.
- `picture(run_dir)`: the run's cells over time, a Gantt of their roles above the water
  level w(t) and the switch rule's threshold C_R(t) − C_e, drawn by gyre.plots from the
  scheduler's `trace.jsonl` replayed through a fresh policy of its mode (the picture
  `gyre sim` and `gyre bench modes` draw, handlers.bench.modes_audit), written to
  `<run_dir>/cells.png`. None when the run left no trace or no fact in it.
- `print_cells(summary)`: the summary's lines for both.
"""
from __future__ import annotations

from pathlib import Path

from gyre.control.timeline import Replayed, replay

PICTURE = "cells.png"


def switches(reported: list[dict]) -> list[dict]:
    """The switches between rollout and training among `reported` (Progress.switches)."""
    out = []
    for s in reported:
        if {s.get("from"), s.get("to")} != {"rollout", "training"}:
            continue
        out.append({"cell": s["cell"], "from": s["from"], "to": s["to"], "t": s.get("t"), "step": s.get("step"),
                    **{k: round(float(s[k]), 3) for k in ("total_s", "release_s", "load_s") if k in s}})
    return out


def picture(run_dir: Path) -> Path | None:
    """Draw `<run_dir>/cells.png` from `<run_dir>/trace.jsonl` (module docstring); its path,
    or None when there is nothing to draw."""
    path = Path(run_dir) / "trace.jsonl"
    if not path.exists():
        return None
    lines = path.read_text().splitlines()
    if len(lines) < 2:
        return None
    r = replay(lines)
    if not r.t:
        return None
    mode = r.head.get("mode", "?")
    title = (f"{Path(run_dir).name}: {mode} on {len(r.cells)} cell{'s' if len(r.cells) != 1 else ''}, "
             f"C_e {r.capacity} (run time from the first dispatch)")
    return draw(Path(run_dir) / PICTURE, r, title)


def print_cells(s: dict) -> None:
    """The summary's switch lines and the picture's path (from `s["switches"]`, `s["cells_picture"]`)."""
    done = s.get("switches") or []
    if done:
        total = sum(x.get("total_s", 0.0) for x in done)
        print(f"switches         {len(done)}, {total:.1f} s in all (each: release, load, resume; by step under way;"
              " summary.json has each one's phases)")
        steps: dict = {}
        for x in done:
            steps.setdefault(x.get("step"), []).append(f"{x['cell']} → {x['to']} {x.get('total_s', 0.0):.2f} s")
        for step, items in steps.items():  # switches once every step completed: the return to rollout
            ended = step is not None and step >= s.get("steps_planned", step + 1)
            label = "after" if ended else f"step {'?' if step is None else step:>2}"
            print(f"                 {label:<7}  " + ", ".join(items))
    elif s.get("cells", 1) > 1:
        print("switches         none between rollout and training")
    if s.get("cells_picture"):
        print(f"cells picture    {s['cells_picture']} (roles over time above the water level)")


def draw(path: Path, r: Replayed, title: str, ends: list[float] | None = None) -> Path:
    """The run's Gantt above its water level (gyre.plots, as `gyre sim` draws one), seconds
    on the trace's clock from the first dispatch."""
    from gyre.plots import timeline_png

    t0 = r.window[0]
    segs = {c: [(max(a, t0) - t0, b - t0, s) for a, b, s in r.segments[c] if b > t0] for c in r.cells}
    busy = {c: [(max(a, t0) - t0, b - t0) for a, b in r.busy[c] if b > t0] for c in r.cells}
    kept = [i for i, x in enumerate(r.t) if x >= t0]
    return timeline_png(path, title=title, segments=segs, busy=busy, t=[r.t[i] - t0 for i in kept],
                        water_level=[r.water_level[i] for i in kept], spare=[r.spare[i] for i in kept],
                        step_ends=[x - t0 for x in (r.step_ends if ends is None else ends)], unit_s=1.0, unit="s")
