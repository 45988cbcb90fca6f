"""Pictures shared by `gyre sim`, `gyre bench modes` and `gyre report` (matplotlib, Agg).

`timeline_png(path, ...)`: the cell roles over time (a Gantt chart, one row per cell,
core on top) above the water level w(t) and the switch rule's threshold C_R(t) − C_e.
`series_png(path, ...)`: per-step curves (reward, loss, KL, clip fraction, tokens/s).
`bars_png(path, ...)`: grouped bars (staleness histogram, call latency percentiles).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend is chosen first)
from matplotlib.patches import Patch  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

COLOURS = {"rollout": "#4c78a8", "training": "#f2c48d", "busy": "#e45756", "switching": "#9d9d9d"}


def timeline_png(path: str | Path, *, title: str, segments: Mapping[str, Sequence[tuple[float, float, str]]],
                 busy: Mapping[str, Sequence[tuple[float, float]]], t: Sequence[float], water_level: Sequence[float],
                 spare: Sequence[float], step_ends: Sequence[float] = (), unit_s: float = 3600.0,
                 unit: str = "h") -> Path:
    """Write the picture to `path` (PNG). segments: cell -> (start, end, state) with state
    `rollout`, `training` or `switching`; busy: cell -> intervals running a micro-step (drawn
    over training); t, water_level, spare: the series w(t) and C_R(t) − C_e; step_ends: T_k
    (dotted lines). Times in seconds, drawn in `unit` (`unit_s` seconds each)."""
    path = Path(path)
    cells = list(segments)
    fig, (gantt, water) = plt.subplots(2, 1, figsize=(12, 2.0 + 0.45 * len(cells) + 2.6), sharex=True,
                                       gridspec_kw={"height_ratios": [0.45 * len(cells) + 0.6, 2.6]})
    for row, cell in enumerate(cells):
        y = len(cells) - 1 - row
        for state in ("rollout", "training", "switching"):
            bars = [(a / unit_s, (b - a) / unit_s) for a, b, s in segments[cell] if s == state]
            if bars:
                gantt.broken_barh(bars, (y - 0.4, 0.8), facecolors=COLOURS[state], linewidth=0)
        bars = [(a / unit_s, (b - a) / unit_s) for a, b in busy.get(cell, ())]
        if bars:
            gantt.broken_barh(bars, (y - 0.4, 0.8), facecolors=COLOURS["busy"], linewidth=0)
    gantt.set_yticks(range(len(cells)), [f"{c} (core)" if i == 0 else c for i, c in enumerate(cells)][::-1])
    gantt.legend(handles=[Patch(color=COLOURS[k], label=label) for k, label in (
        ("rollout", "rollout"), ("training", "training, waiting"), ("busy", "training, micro-step"),
        ("switching", "switching"))], loc="upper center", bbox_to_anchor=(0.5, -0.02), ncol=4, fontsize=8,
        frameon=False)
    gantt.set_title(title, fontsize=10)
    xs = [x / unit_s for x in t]
    water.step(xs, water_level, where="post", color="#4c78a8", linewidth=0.8, label="water level w(t)")
    water.step(xs, spare, where="post", color="#e45756", linewidth=0.8, label="C_R(t) − C_e")
    for end in step_ends:
        for ax in (gantt, water):
            ax.axvline(end / unit_s, color="#bbbbbb", linewidth=0.4, linestyle=":")
    water.set_xlabel(f"time ({unit})")
    water.set_ylabel("executions")
    water.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def series_png(path: str | Path, *, title: str, x: Sequence[float], series: Mapping[str, Sequence[float | None]],
               xlabel: str, ylabel: str, marker: str = "o") -> Path:
    """Write one line chart to `path` (PNG): each `series` label → its y values over `x`
    (None = not recorded at that x, left as a gap)."""
    path = Path(path)
    fig, ax = plt.subplots(figsize=(6.4, 3.2))
    for label, ys in series.items():
        ax.plot(x, [float("nan") if y is None else y for y in ys], marker=marker, markersize=4, linewidth=1.2,
                label=label)
    ax.set_title(title, fontsize=10)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if all(float(v).is_integer() for v in x):  # steps: no tick between two
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if len(series) > 1:
        ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def bars_png(path: str | Path, *, title: str, labels: Sequence[str], values: Mapping[str, Sequence[float]],
             xlabel: str, ylabel: str) -> Path:
    """Write a grouped bar chart to `path` (PNG): one bar per label and `values` entry."""
    path = Path(path)
    fig, ax = plt.subplots(figsize=(6.4, 3.2))
    n = max(len(values), 1)
    width = 0.8 / n
    for i, (name, ys) in enumerate(values.items()):
        ax.bar([j + (i - (n - 1) / 2) * width for j in range(len(labels))], ys, width=width, label=name)
    ax.set_xticks(range(len(labels)), labels)
    ax.set_title(title, fontsize=10)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3, axis="y")
    if n > 1:
        ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
