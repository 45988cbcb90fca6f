"""`gyre report RUN_DIR`: one self-contained HTML page of a run, with its pictures.

Reads what the run recorded (`summary.json`, `metrics.jsonl`, `config.json`) and writes
`<run_dir>/report.html` plus the PNGs it embeds under `<run_dir>/report/` (made by
`gyre.plots`, the plotting code `gyre sim` uses too). Each plot is a `<figure
id="plot-NAME">` with its picture inline (a data: URL, so the page stands alone) and the
data drawn, as JSON, beside it in `<script type="application/json" id="data-NAME">`, so
a reader can check it. A plot whose data the run did not record is a paragraph that says
so (`class="missing"`), and appears once a run records it, with no change here.

Plots: reward per step (with the control run's, when `summary.json` names one under
`control`), loss, KL and clip fraction, the cells' Gantt above the water level, the
staleness histogram, call latency percentiles by API, tokens generated per second; then
the summary table. `gyre run` writes the report as a run ends.
"""
from __future__ import annotations

import argparse
import base64
import html
import sys
from pathlib import Path

import orjson

PERCENTILES = (50, 90, 99)


def read_records(run_dir: Path) -> tuple[dict, list[dict], dict]:
    """(summary.json, metrics.jsonl lines, config.json) of a run; {} / [] for what is absent.
    Raises FileNotFoundError when `run_dir` is no run directory (neither file there),
    UnreadableRecord naming the file when summary.json or config.json holds no JSON object."""
    run_dir = Path(run_dir)
    summary_path, metrics_path = run_dir / "summary.json", run_dir / "metrics.jsonl"
    if not summary_path.exists() and not metrics_path.exists():
        raise FileNotFoundError(f"{run_dir} holds no summary.json or metrics.jsonl: is it a run directory "
                                "(runs/<id>, written by `gyre run`)?")
    summary = _object(summary_path) if summary_path.exists() else {}
    lines = []
    if metrics_path.exists():
        for raw in metrics_path.read_bytes().splitlines():
            try:
                lines.append(orjson.loads(raw))
            except orjson.JSONDecodeError:
                continue  # a line cut by a crash
    config_path = run_dir / "config.json"
    config = _object(config_path) if config_path.exists() else {}
    return summary, lines, config


class UnreadableRecord(ValueError):
    """A run's JSON record that holds no JSON object (cut short, or not what `gyre run` writes)."""


def _object(path: Path) -> dict:
    """The JSON object in `path`. Raises UnreadableRecord naming the file when it holds none."""
    try:
        value = orjson.loads(path.read_bytes())
    except orjson.JSONDecodeError as exc:
        raise UnreadableRecord(f"{path} is not JSON (cut short?): {exc}") from None
    if not isinstance(value, dict):
        raise UnreadableRecord(f"{path} holds a JSON {type(value).__name__}, not the object `gyre run` writes")
    return value


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0–100) by linear interpolation between closest ranks (numpy's default)."""
    xs = sorted(values)
    if not xs:
        raise ValueError("no values")
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def plot_data(summary: dict, lines: list[dict], config: dict) -> dict[str, dict | None]:
    """name → the data of each plot (None: the run recorded none). Pure: the page and the
    tests read the same numbers."""
    of = lambda kind: [x for x in lines if x.get("kind") == kind]  # noqa: E731
    steps = sorted({x["step"]: x for x in of("step.completed")}.values(), key=lambda x: x["step"])
    out: dict[str, dict | None] = {}
    rewards = summary.get("rewards_per_step") or []
    out["reward"] = {"step": list(range(len(rewards))), "reward_mean": rewards,
                     "control": summary.get("control", {}).get("rewards_per_step") if summary.get("control")
                     else None} if rewards else None
    out["loss"] = {"step": [s["step"] for s in steps], "loss": [s.get("loss") for s in steps]} if steps else None
    has_kl = [s for s in steps if "kl" in s or "clip_fraction" in s]
    out["kl_clip"] = {"step": [s["step"] for s in has_kl], "kl": [s.get("kl") for s in has_kl],
                      "clip_fraction": [s.get("clip_fraction") for s in has_kl]} if has_kl else None
    hist: dict[int, int] = {}
    for s in steps:
        for k, v in (s.get("staleness_histogram") or {}).items():
            hist[int(k)] = hist.get(int(k), 0) + int(v)
    out["staleness"] = ({"staleness": sorted(hist), "tokens": [hist[k] for k in sorted(hist)]} if hist else None)
    calls = [c for c in of("call.completed") if c.get("total_s") is not None]
    apis = sorted({c["api"] for c in calls})
    out["latency"] = {"api": apis, **{f"p{q}": [round(percentile([c["total_s"] for c in calls if c["api"] == a], q), 6)
                                                for a in apis] for q in PERCENTILES},
                      "calls": [sum(1 for c in calls if c["api"] == a) for a in apis]} if calls else None
    gen = [c for c in of("call.completed") if c.get("completion_tokens")]
    if gen:
        end = max(c["t"] for c in lines)
        width = max(1.0, round(end / 20, 1))  # about 20 bins over the run
        bins = [0] * (int(end // width) + 1)
        for c in gen:
            bins[int(c["t"] // width)] += c["completion_tokens"]
        out["tokens_per_s"] = {"t": [round(i * width, 3) for i in range(len(bins))], "bin_s": width,
                               "tokens_per_s": [round(b / width, 6) for b in bins]}
    else:
        out["tokens_per_s"] = None
    out["timeline"] = _timeline(lines, config)
    return out


def _timeline(lines: list[dict], config: dict) -> dict | None:
    """The cells' roles over time (cell.switched) and the water level w(t) (dispatched −
    finished) against C_R(t) − C_e, with C_e = the recipe's harness.concurrency."""
    switched = [x for x in lines if x.get("kind") == "cell.switched"]
    if not switched:
        return None
    end = max(x["t"] for x in lines)
    cells = sorted({x["cell"] for x in switched}, key=lambda c: (len(c), c))
    segments: dict[str, list[list]] = {c: [] for c in cells}
    for cell in cells:
        mine = [x for x in switched if x["cell"] == cell]
        for i, x in enumerate(mine):
            until = mine[i + 1]["t"] - float((mine[i + 1].get("durations") or {}).get("total_s", 0.0)) \
                if i + 1 < len(mine) else end
            took = float((x.get("durations") or {}).get("total_s", 0.0))
            if took > 0:
                segments[cell].append([round(x["t"] - took, 3), x["t"], "switching"])
            if x["to_role"] in ("rollout", "training") and until > x["t"]:
                segments[cell].append([x["t"], round(until, 3), x["to_role"]])
    c_e = int(((config.get("harness") or {}).get("concurrency")) or 1)
    events = sorted([(x["t"], 1, None) for x in lines if x.get("kind") == "execution.dispatched"]
                    + [(x["t"], -1, None) for x in lines if x.get("kind") == "execution.finished"]
                    + [(x["t"], 0, (x["cell"], x["to_role"])) for x in switched], key=lambda e: e[0])
    roles: dict[str, str] = {}
    t, w, spare, level = [0.0], [0], [0], 0
    for when, delta, switch in events:
        level += delta
        if switch:
            roles[switch[0]] = switch[1]
        t.append(when)
        w.append(level)
        spare.append(c_e * sum(1 for r in roles.values() if r == "rollout") - c_e)
    t.append(end)  # the last level holds to the run's last record
    w.append(level)
    spare.append(spare[-1])
    step_ends = [x["t"] for x in lines if x.get("kind") == "step.completed"]
    return {"cells": cells, "segments": segments, "t": t, "water_level": w, "spare": spare, "step_ends": step_ends,
            "c_e": c_e}


def _png(path: Path, name: str, data: dict, run: str) -> Path:
    from gyre import plots

    if name == "reward":
        series = {"reward mean": data["reward_mean"]}
        if data.get("control"):
            series["control run"] = data["control"][: len(data["step"])]
        return plots.series_png(path, title=f"{run}: reward per step", x=data["step"], series=series,
                                xlabel="step", ylabel="reward")
    if name == "loss":
        return plots.series_png(path, title="GSPO loss", x=data["step"], series={"loss": data["loss"]},
                                xlabel="step", ylabel="loss")
    if name == "kl_clip":
        return plots.series_png(path, title="KL(π_old ‖ π_θ) and clip fraction", x=data["step"],
                                series={"kl": data["kl"], "clip fraction": data["clip_fraction"]},
                                xlabel="step", ylabel="per trained token")
    if name == "staleness":
        return plots.bars_png(path, title="trained tokens by staleness", labels=[str(s) for s in data["staleness"]],
                              values={"tokens": data["tokens"]}, xlabel="staleness (steps)", ylabel="tokens")
    if name == "latency":
        return plots.bars_png(path, title="call latency percentiles", labels=data["api"],
                              values={f"p{q}": data[f"p{q}"] for q in PERCENTILES}, xlabel="API", ylabel="seconds")
    if name == "tokens_per_s":
        return plots.series_png(path, title="tokens generated per second", x=data["t"],
                                series={"tokens/s": data["tokens_per_s"]}, xlabel="run time (s)",
                                ylabel="tokens/s", marker="")
    if name == "timeline":
        segs = {c: [tuple(s) for s in data["segments"][c]] for c in data["cells"]}
        return plots.timeline_png(path, title="cells and the water level", segments=segs, busy={}, t=data["t"],
                                  water_level=data["water_level"], spare=data["spare"], step_ends=data["step_ends"],
                                  unit_s=1.0, unit="s")
    raise ValueError(f"unknown plot {name!r}")


TITLES = {
    "reward": ("Reward per step", "no step was scored"),
    "loss": ("Loss", "no step completed"),
    "kl_clip": ("KL and clip fraction", "no step recorded KL or clip fraction"),
    "timeline": ("Cells and water level", "no cell switch was recorded"),
    "staleness": ("Staleness", "no step recorded a staleness histogram"),
    "latency": ("Call latency", "no call with a recorded latency"),
    "tokens_per_s": ("Tokens per second", "no generated tokens were recorded"),
}

_CSS = """body{font-family:system-ui,sans-serif;max-width:1120px;margin:1.5em auto;color:#222}
main{display:flex;flex-wrap:wrap;gap:0 16px}section{flex:0 0 550px}section.wide{flex:0 0 100%}
h2{font-size:1.1em;margin:0.6em 0 0.2em}figure{margin:0}figure img{max-width:100%;border:1px solid #ddd}
figcaption{font-size:0.8em;color:#666}table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:2px 8px;
text-align:left;font-size:0.9em}p.missing{color:#888;font-style:italic}"""


def _json_script(obj) -> str:
    return orjson.dumps(obj, option=orjson.OPT_SORT_KEYS).decode().replace("</", "<\\/")


def render(run_dir: Path) -> Path:
    """Write `<run_dir>/report.html` and `<run_dir>/report/*.png`; returns the page's path."""
    run_dir = Path(run_dir).resolve()
    summary, lines, config = read_records(run_dir)
    data = plot_data(summary, lines, config)
    run = summary.get("run") or run_dir.name
    parts = [f"<!doctype html><html lang=en><head><meta charset=utf-8><title>gyre report: {html.escape(run)}</title>"
             f"<style>{_CSS}</style></head><body><h1>gyre run {html.escape(run)}</h1>"]
    if summary.get("outcome"):
        parts.append(f"<p>outcome <b>{html.escape(str(summary['outcome']))}</b>, {summary.get('steps', 0)} steps, "
                     f"{summary.get('executions', 0)} executions, wall {summary.get('wall_s', '?')} s</p>")
    parts.append("<main>")
    for name, (title, missing) in TITLES.items():
        parts.append(f'<section{" class=wide" if name == "timeline" else ""}><h2>{title}</h2>')
        if data[name] is None:
            parts.append(f'<p class="missing" id="missing-{name}">This run recorded nothing to draw: {missing}.</p>')
        else:
            png = _png(run_dir / "report" / f"{name}.png", name, data[name], run)
            b64 = base64.b64encode(png.read_bytes()).decode()
            parts.append(f'<figure id="plot-{name}"><img alt="{title}" src="data:image/png;base64,{b64}">'
                         f'<figcaption>{title} — data in #data-{name}</figcaption>'
                         f'<script type="application/json" id="data-{name}">{_json_script(data[name])}</script>'
                         "</figure>")
        parts.append("</section>")
    parts.append("</main><section><h2>Summary</h2><table>")
    for key, value in summary.items():
        shown = value if isinstance(value, (str, int, float)) or value is None else orjson.dumps(value).decode()
        parts.append(f"<tr><th>{html.escape(key)}</th><td>{html.escape(str(shown))}</td></tr>")
    parts.append(f'</table><script type="application/json" id="data-summary">{_json_script(summary)}</script>'
                 "</section></body></html>")
    out = run_dir / "report.html"
    out.write_text("".join(parts))
    return out


write_report = render


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="gyre report", description="Write a run's HTML report with its pictures.")
    p.add_argument("run_dir", nargs="?", default=None, help="a run directory (default: runs/latest)")
    a = p.parse_args(argv)
    from handlers.run import runs_root

    run_dir = Path(a.run_dir) if a.run_dir else runs_root() / "latest"
    try:
        path = render(run_dir)
    except (FileNotFoundError, NotADirectoryError, UnreadableRecord) as exc:
        print(f"gyre report: {exc}", file=sys.stderr)
        return 2
    print(f"gyre: report written to {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
