"""Seeing a run (issue 53): `gyre status`, every daemon's /metrics, TensorBoard scalars, `gyre report`.

One real `gyre run toy` (every daemon a process, a private nats-server) is watched while it
runs — each daemon's /metrics scraped as soon as its URL is recorded, `gyre status --once`
once executions are scored, the live `gyre status` in tmux — and its directory is checked
after it ends against the run's own records (summary.json, metrics.jsonl).
"""
from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[1]
DAEMONS = ("proxy", "runner", "evaluator", "builder", "scheduler", "cell0")


def _env(runs: Path) -> dict:
    env = dict(os.environ, GYRE_RUNS_DIR=str(runs), PYTHONPATH=str(ROOT))
    env.pop("GYRE_NATS_URL", None)
    return env


def _gyre(*args: str) -> list[str]:
    return [sys.executable, "-m", "handlers.cli", *args]


def _lines(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def _wait(what: str, cond, timeout_s: float, proc: subprocess.Popen, out: Path):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        if proc.poll() is not None:
            raise AssertionError(f"gyre run exited ({proc.returncode}) before {what}:\n{out.read_text()[-3000:]}")
        time.sleep(0.3)
    raise AssertionError(f"timed out waiting for {what}:\n{out.read_text()[-3000:]}")


def _samples(text: str) -> dict[tuple[str, tuple], float]:
    """(sample name, sorted labels) → value, parsed with Prometheus' own text parser."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _total(samples: dict, name: str, **labels) -> float:
    return sum(v for (n, ls), v in samples.items()
               if n == name and all(dict(ls).get(k) == val for k, val in labels.items()))


@pytest.fixture(scope="module")
def toy_run(tmp_path_factory):
    runs = tmp_path_factory.mktemp("runs")
    env = _env(runs)
    out = runs / "gyre-run.out"
    run_dir = runs / "vis"
    seen: dict = {}
    with open(out, "wb") as f:
        proc = subprocess.Popen(_gyre("run", "toy", "--run-id", "vis", "--timeout", "400"), cwd=ROOT, env=env,
                                stdout=f, stderr=subprocess.STDOUT)
    try:
        from handlers.metrics import recorded_urls, scrape

        urls = _wait("every daemon's metrics URL", lambda: (u := recorded_urls(run_dir)) and
                     set(DAEMONS) <= set(u) and u, 180, proc, out)
        seen["urls"] = urls
        seen["before"] = {d: scrape(u) for d, u in urls.items()}  # before the first step ends
        seen["before_lines"] = _lines(run_dir)
        _wait("a scored execution", lambda: any(x["kind"] == "execution.scored" for x in _lines(run_dir)),
              240, proc, out)
        once = subprocess.run(_gyre("status", "--once"), cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=60)
        seen["once"] = once
        seen["once_lines"] = _lines(run_dir)
        if shutil.which("tmux") and proc.poll() is None:
            session = f"gyre-status-{os.getpid()}"
            cmd = " ".join(_gyre("status", "--run-dir", str(run_dir), "--refresh", "0.5"))
            subprocess.run(["tmux", "new-session", "-d", "-s", session, "-x", "150", "-y", "50",
                            f"cd {ROOT} && GYRE_RUNS_DIR={runs} PYTHONPATH={ROOT} {cmd}"], check=True)
            try:
                screen = ""
                deadline = time.monotonic() + 30
                while time.monotonic() < deadline and "executions per step" not in screen:
                    time.sleep(1)
                    screen = subprocess.run(["tmux", "capture-pane", "-p", "-t", session], capture_output=True,
                                            text=True).stdout
                seen["screen"] = screen
            finally:
                subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True)
        proc.wait(timeout=420)
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(60)
    seen.update(rc=proc.returncode, out=out.read_text(), run_dir=run_dir, runs=runs, env=env)
    assert proc.returncode == 0, seen["out"][-3000:]
    return seen


def test_status_once_shows_step_cells_executions_rewards(toy_run):
    once = toy_run["once"]
    assert once.returncode == 0, once.stderr
    text = once.stdout
    assert re.search(r"gyre status — run vis\s+step [01] \((rollout|scoring|training|completed)\)", text), text
    assert re.search(r"water level \d+ vs C_R − C_e -?\d+", text), text
    assert re.search(r"│ cell0 │ (rollout|training)\s*│ [0-9]", text), text  # role and policy version
    # step 0's burst: the toy recipe dispatches 2 groups × 4 executions
    row = re.search(r"│\s+0 │\s+8 │\s+(\d+) │\s+(\d+) │\s+(\d+) │\s+(\d+) │\s+([0-9.]+|-) │", text)
    assert row, text
    queued, running, finished, scored = map(int, row.groups()[:4])
    assert queued + running + finished == 8 and 1 <= scored <= finished
    # the reward shown is a mean of step 0's rewards, which the run records too
    rewards = [x["reward"] for x in _lines(toy_run["run_dir"]) if x["kind"] == "execution.scored"
               and x["execution"].startswith("s0-")]
    assert row.group(5) != "-" and min(rewards) - 1e-3 <= float(row.group(5)) <= max(rewards) + 1e-3
    assert re.search(r"^\s+proxy\s+http://127\.0\.0\.1:\d+/metrics$", text, re.M), text


def test_status_live_view_in_tmux(toy_run):
    if "screen" not in toy_run:
        pytest.skip("tmux not installed (ops/install.sh installs it when run as root)")
    screen = toy_run["screen"]
    assert "gyre status — run vis" in screen, screen
    assert "executions per step" in screen and "cell0" in screen, screen


def test_every_daemon_metrics_parse_and_counters_match_the_run_records(toy_run):
    run_dir = toy_run["run_dir"]
    summary = json.loads((run_dir / "summary.json").read_text())
    lines = _lines(run_dir)
    assert all(u.startswith("http://127.0.0.1:") for u in toy_run["urls"].values()), toy_run["urls"]
    before = {d: _samples(t) for d, t in toy_run["before"].items()}
    # the "after" scrape: `gyre run` scrapes every daemon as the run ends, before stopping them
    after = {d: _samples((run_dir / "metrics" / f"{d}.prom").read_text()) for d in DAEMONS}
    delta = lambda d, name, **labels: _total(after[d], name, **labels) - _total(before[d], name, **labels)  # noqa

    calls = [x for x in lines if x["kind"] == "call.completed"]
    assert delta("proxy", "gyre_calls_total") == summary["calls"] == len(calls) > 0
    assert delta("proxy", "gyre_calls_total", status="ok") == summary["calls_by_status"].get("ok", 0)
    assert delta("proxy", "gyre_tokens_generated_total") == summary["tokens_generated"] == \
        sum(c["completion_tokens"] for c in calls) > 0
    assert delta("proxy", "gyre_call_latency_seconds_count") == len(calls)
    assert delta("proxy", "gyre_call_latency_seconds_sum") == pytest.approx(sum(c["total_s"] for c in calls))
    for status, n in summary["executions_by_status"].items():
        assert delta("runner", "gyre_executions_finished_total", outcome=status) == n
    assert delta("runner", "gyre_executions_finished_total") == summary["executions"] == 16
    assert delta("evaluator", "gyre_executions_scored_total") == \
        sum(1 for x in lines if x["kind"] == "execution.scored")
    steps = [x for x in lines if x["kind"] == "step.completed"]
    assert delta("cell0", "gyre_steps_completed_total") == summary["steps"] == len(steps) == 2
    assert delta("cell0", "gyre_step_seconds_sum") == pytest.approx(sum(s["duration_s"] for s in steps), rel=1e-9)
    assert delta("cell0", "gyre_step_seconds_count") == len(steps)
    assert delta("cell0", "gyre_tokens_trained_total") == summary["tokens_trained"] > 0
    assert delta("cell0", "gyre_microsteps_committed_total", replica="cell0") == \
        sum(s["microsteps_per_replica"].get("cell0", 0) for s in steps)
    # counters live only where their events are published
    assert _total(after["runner"], "gyre_calls_total") == 0 and _total(after["proxy"], "gyre_steps_completed_total") == 0
    assert _total(after["cell0"], "gyre_cell_role", cell="cell0") == 1  # one role at a time
    assert ("gyre_water_level", ()) in after["scheduler"]
    for d in DAEMONS:  # every daemon times its publishes
        assert _total(after[d], "gyre_bus_publish_seconds_count") > 0, d


def test_tensorboard_scalars_equal_metrics_jsonl(toy_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = toy_run["run_dir"]
    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    steps = sorted((x for x in _lines(run_dir) if x["kind"] == "step.completed"), key=lambda x: x["step"])
    assert len(steps) == 2
    recorded = {"loss": "loss", "grad_norm": "grad_norm", "kl": "kl", "clip_fraction": "clip_fraction",
                "reward_mean": "reward_mean", "reward_std": "reward_std", "tokens": "tokens", "step_s": "duration_s"}
    assert {f"train/{k}" for k in recorded} <= set(acc.Tags()["scalars"])
    for tag, key in recorded.items():
        events = acc.Scalars(f"train/{tag}")
        assert [e.step for e in events] == [s["step"] for s in steps], tag
        for e, s in zip(events, steps):
            assert e.value == pytest.approx(s[key], rel=1e-6, abs=1e-12), (tag, e.value, s[key])
    # staleness: the trained tokens' mean staleness of each step's histogram
    for e, s in zip(acc.Scalars("train/staleness_mean"), steps):
        h = {int(k): v for k, v in s["staleness_histogram"].items()}
        assert e.value == pytest.approx(sum(k * v for k, v in h.items()) / sum(h.values()), rel=1e-6)


def _embedded(html: str) -> dict[str, object]:
    return {m[1]: json.loads(m[2].replace("<\\/", "</")) for m in
            re.finditer(r'<script type="application/json" id="data-([a-z_]+)">(.*?)</script>', html, re.S)}


def test_report_data_equals_the_run_records(toy_run):
    import numpy as np

    run_dir = toy_run["run_dir"]
    assert f"gyre: report written to {run_dir.resolve() / 'report.html'}" in toy_run["out"]
    html = (run_dir / "report.html").read_text()
    data = _embedded(html)
    summary = json.loads((run_dir / "summary.json").read_text())
    lines = _lines(run_dir)
    steps = sorted((x for x in lines if x["kind"] == "step.completed"), key=lambda x: x["step"])
    calls = [x for x in lines if x["kind"] == "call.completed"]
    assert data["summary"] == summary
    assert data["reward"]["reward_mean"] == summary["rewards_per_step"]
    assert data["loss"] == {"step": [0, 1], "loss": [s["loss"] for s in steps]}
    assert data["kl_clip"]["kl"] == [s["kl"] for s in steps]
    assert data["kl_clip"]["clip_fraction"] == [s["clip_fraction"] for s in steps]
    hist: dict[int, int] = {}
    for s in steps:
        for k, v in s["staleness_histogram"].items():
            hist[int(k)] = hist.get(int(k), 0) + v
    assert dict(zip(data["staleness"]["staleness"], data["staleness"]["tokens"])) == hist
    assert sum(hist.values()) == summary["tokens_trained"]
    assert data["latency"]["api"] == ["chat"] and data["latency"]["calls"] == [len(calls)]
    for q in (50, 90, 99):
        assert data["latency"][f"p{q}"][0] == pytest.approx(np.percentile([c["total_s"] for c in calls], q), abs=1e-6)
    tps = data["tokens_per_s"]
    assert sum(v * tps["bin_s"] for v in tps["tokens_per_s"]) == pytest.approx(summary["tokens_generated"])
    tl = data["timeline"]
    assert tl["cells"] == ["cell0"] and max(tl["water_level"]) == 8 and tl["water_level"][-1] == 0
    assert {seg[2] for seg in tl["segments"]["cell0"]} >= {"rollout", "training"}
    for name in ("reward", "loss", "kl_clip", "timeline", "staleness", "latency", "tokens_per_s"):
        assert f'<figure id="plot-{name}"' in html and (run_dir / "report" / f"{name}.png").stat().st_size > 1000


def test_report_says_what_a_run_did_not_record(tmp_path):
    from handlers.report import main

    (tmp_path / "summary.json").write_text(json.dumps({"run": "r", "steps": 0, "rewards_per_step": []}))
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"t": 1.0, "kind": "execution.finished",
                                                        "execution": "s0-g0-e0", "status": "ok"}) + "\n")
    assert main([str(tmp_path)]) == 0
    html = (tmp_path / "report.html").read_text()
    for name in ("reward", "loss", "kl_clip", "timeline", "staleness", "latency", "tokens_per_s"):
        assert f'id="missing-{name}"' in html and f'id="plot-{name}"' not in html
    assert main([str(tmp_path / "nope")]) == 2


def _chromium() -> tuple[str, str] | None:
    browser = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    driver = shutil.which("chromedriver")
    return (browser, driver) if browser and driver else None


def test_report_renders_in_headless_chromium(toy_run):
    found = _chromium()
    if found is None or not _has_selenium():
        if os.environ.get("CI") == "true":
            pytest.fail("chromium, chromedriver or selenium missing under CI: ops/install.sh installs them")
        pytest.skip("chromium + chromium-driver (Debian) and selenium are needed: ops/install.sh installs them as root")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    browser, driver_path = found
    opts = webdriver.ChromeOptions()
    opts.binary_location = browser
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1200,2400"):
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    run_dir = toy_run["run_dir"]
    driver = webdriver.Chrome(service=Service(driver_path), options=opts)
    try:
        driver.get((run_dir / "report.html").resolve().as_uri())
        logs = driver.get_log("browser")
        assert not [x for x in logs if x["level"] in ("SEVERE", "ERROR")], logs
        figures = driver.execute_script(
            "return [...document.querySelectorAll('figure')].map(f => ({id: f.id, "
            "w: f.querySelector('img').naturalWidth, complete: f.querySelector('img').complete, "
            "data: JSON.parse(f.querySelector('script[type=\"application/json\"]').textContent)}))")
        expected = _embedded((run_dir / "report.html").read_text())
        assert {f["id"] for f in figures} == {f"plot-{k}" for k in expected if k != "summary"}
        for f in figures:
            assert f["complete"] and f["w"] > 300, f["id"]
            assert f["data"] == expected[f["id"][5:]], f["id"]  # what the browser parsed is what was written
        shot = run_dir / "report-screenshot.png"
        driver.save_screenshot(str(shot))
        assert shot.stat().st_size > 10_000
    finally:
        driver.quit()


def _has_selenium() -> bool:
    try:
        import selenium  # noqa: F401
    except ImportError:
        return False
    return True


def test_dashboard_and_scrape_config_name_documented_metrics():
    from handlers import metrics

    documented = set(re.findall(r"`(gyre_[a-z_]+)`", (ROOT / "docs" / "metrics.md").read_text()))
    served = {m._name + ("_total" if m._type == "counter" else "") for m in vars(metrics).values()
              if hasattr(m, "_type") and str(getattr(m, "_name", "")).startswith("gyre_")}
    assert served == documented, (served ^ documented)
    dashboard = json.loads((ROOT / "ops" / "grafana" / "dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    assert exprs
    for expr in exprs:
        names = re.findall(r"\bgyre_[a-z_]+", expr)
        assert names, expr
        for n in names:
            assert re.sub(r"_(bucket|sum|count)$", "", n) in documented, (n, expr)
    scrape = (ROOT / "ops" / "prometheus.yml").read_text()
    assert "scrape_configs" in scrape and "file_sd_configs" in scrape
