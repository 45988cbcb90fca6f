"""Seeing a run (issue 53): `gyre status`, every daemon's /metrics, TensorBoard scalars, `gyre report`.

One real `gyre run toy` (every daemon a process, a private nats-server) is watched while it
runs — each daemon's /metrics scraped as soon as its URL is recorded, `gyre status --once`
once executions are scored and again while step 0 trains, the scheduler's water level while
executions run, the live `gyre status` in tmux — and its directory is checked after it ends
against the run's own records (summary.json, metrics.jsonl, trace.jsonl).
"""
from __future__ import annotations

import glob
import json
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


def _trace(run_dir: Path) -> list[dict]:
    """The scheduler's trace.jsonl (a line being written is left out)."""
    path = run_dir / "trace.jsonl"
    out = []
    for x in path.read_text().splitlines() if path.exists() else []:
        try:
            out.append(json.loads(x))
        except json.JSONDecodeError:
            break
    return out


def _water_levels(trace: list[dict]) -> list[int]:
    """w(t) after each trace line: executions dispatched minus finished."""
    out, w = [], 0
    for x in trace:
        if x.get("action") == "dispatch":
            w += len(x["executions"])
        elif x.get("fact") == "execution.finished":
            w -= 1
        out.append(w)
    return out


def _sd_files_found_by_documented_config(runs: Path, env: dict, where: Path) -> dict:
    """Run docs/metrics.md's line that writes a scrape config for GYRE_RUNS_DIR (into
    `where`), and resolve each `files` glob as Prometheus does: relative to the config
    file's directory. Returns {"found": paths, "shipped": the shipped config's globs}."""
    import yaml

    line = next(x for x in (ROOT / "docs" / "metrics.md").read_text().splitlines() if x.startswith("sed "))
    where.mkdir()
    config = where / "gyre-prometheus.yml"
    subprocess.run(["bash", "-c", line.replace("/tmp/gyre-prometheus.yml", str(config))], cwd=ROOT,
                   env=dict(env, GYRE_RUNS_DIR=str(runs)), check=True)

    def globs(path: Path) -> list[str]:
        cfg = yaml.safe_load(path.read_text())
        return [os.path.join(path.parent, f) for job in cfg["scrape_configs"] for sd in job["file_sd_configs"]
                for f in sd["files"]]
    found = sorted({p for g in globs(config) for p in glob.glob(g)})
    return {"found": found, "shipped": globs(ROOT / "ops" / "prometheus.yml")}


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
        seen["sd"] = _sd_files_found_by_documented_config(runs, env, runs / "prometheus")
        # the scheduler's water level while step 0's executions run, bracketed by its trace
        _wait("step 0's dispatch", lambda: any(x.get("action") == "dispatch" for x in _trace(run_dir)),
              180, proc, out)
        time.sleep(0.5)
        trace_before = _trace(run_dir)
        seen["water"] = _total(_samples(scrape(urls["scheduler"])), "gyre_water_level")
        seen["water_levels"] = _water_levels(_trace(run_dir))[len(trace_before) - 1:]
        _wait("a scored execution", lambda: any(x["kind"] == "execution.scored" for x in _lines(run_dir)),
              240, proc, out)
        once = subprocess.run(_gyre("status", "--once"), cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=60)
        seen["once"] = once
        seen["once_lines"] = _lines(run_dir)
        # a second snapshot while step 0 trains: its executions all scored, cell0 granted micro-steps
        _wait("step 0 training", lambda: len([x for x in _trace(run_dir) if x.get("fact") == "microstep.granted"])
              and sum(1 for x in _lines(run_dir) if x["kind"] == "execution.scored"
                      and x["execution"].startswith("s0-")) == 8, 240, proc, out)
        seen["training_before"] = (_lines(run_dir), _trace(run_dir))
        seen["training"] = subprocess.run(_gyre("status", "--once"), cwd=ROOT, env=env, capture_output=True,
                                          text=True, timeout=60)
        time.sleep(0.5)  # what the status read is in the run's records by now
        seen["training_after"] = (_lines(run_dir), _trace(run_dir))
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


def _cells_row(text: str, cell: str) -> list[str]:
    row = next(x for x in text.splitlines() if re.match(rf"│ {cell}\s+│", x))
    return [c.strip() for c in row.strip().strip("│").split("│")]


def test_status_once_while_training_counts_calls_rewards_and_microsteps(toy_run):
    """A snapshot while step 0 trains (cell0 its only cell, so no call completes meanwhile),
    against the run's records read just before and just after it."""
    once = toy_run["training"]
    assert once.returncode == 0, once.stderr
    text = once.stdout
    (lines0, trace0), (lines1, trace1) = toy_run["training_before"], toy_run["training_after"]
    calls = lambda lines: sum(1 for x in lines if x["kind"] == "call.completed")  # noqa: E731
    shown = int(re.search(r"calls (\d+), [0-9.]+ calls/s", text)[1])
    assert calls(lines0) <= shown <= calls(lines1) and shown > 0, (shown, calls(lines0), calls(lines1))
    # step 0: all 8 finished and scored, and the mean of their rewards (the summary's too)
    rewards = [x["reward"] for x in lines1 if x["kind"] == "execution.scored" and x["execution"].startswith("s0-")
               and x["outcome"] != "excluded"]
    mean = sum(rewards) / len(rewards)
    summary = json.loads((toy_run["run_dir"] / "summary.json").read_text())
    assert mean == pytest.approx(summary["rewards_per_step"][0])
    assert re.search(rf"│\s+0 │\s+8 │\s+0 │\s+0 │\s+8 │\s+8 │\s+{mean:.3f} │", text), (mean, text)
    # micro-steps: the core's own grants and commits count (the scheduler's trace holds them too)
    of = lambda trace, fact: sum(1 for x in trace if x.get("fact") == fact and x.get("replica") == "cell0")  # noqa
    _cell, _role, _version, _doing, claimed, committed = _cells_row(text, "cell0")
    assert 1 <= of(trace0, "microstep.granted") <= int(claimed) <= of(trace1, "microstep.granted"), (claimed, text)
    assert of(trace0, "microstep.committed") <= int(committed) <= of(trace1, "microstep.committed"), text


def test_status_names_a_run_the_deployment_nats_never_saw(nats_server, tmp_path):
    import asyncio

    from bus import Bus

    async def known() -> None:
        bus = await Bus.connect(nats_server.url, token=nats_server.token, run="known1", name="test-status")
        await bus.ensure_streams()
        await bus.close()
    asyncio.run(known())
    env = dict(os.environ, GYRE_NATS_URL=nats_server.url, GYRE_NATS_TOKEN=nats_server.token or "",
               GYRE_RUNS_DIR=str(tmp_path), PYTHONPATH=str(ROOT))
    t0 = time.monotonic()
    once = subprocess.run(_gyre("status", "--once", "--run", "nosuch"), cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=60)
    assert once.returncode == 2 and time.monotonic() - t0 < 12, (once.returncode, once.stderr)
    assert once.stdout == "" and len(once.stderr.strip().splitlines()) == 1, once.stderr
    assert "'nosuch'" in once.stderr and "runs there: known1" in once.stderr, once.stderr
    live = subprocess.Popen(_gyre("status", "--run", "nosuch", "--refresh", "0.2"), cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(5)
    live.terminate()
    out, err = live.communicate(timeout=30)
    assert "no event of run 'nosuch' seen yet" in out, out + err
    assert re.search(r"step - +water level 0", out), out  # no step started yet


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
    # while step 0's executions ran: the w(t) of the scheduler's trace at the scrape
    assert toy_run["water"] in toy_run["water_levels"] and min(toy_run["water_levels"]) > 0, \
        (toy_run["water"], toy_run["water_levels"])
    # the daemons are gone: no service discovery file is left for Prometheus to scrape
    assert sorted(p.name for p in (run_dir / "metrics").glob("*.json")) == []
    for d in DAEMONS:  # every daemon times its publishes
        assert _total(after[d], "gyre_bus_publish_seconds_count") > 0, d


def test_prometheus_config_finds_a_live_runs_daemons(toy_run):
    """Prometheus joins a relative file_sd path onto the config file's directory."""
    run_dir = toy_run["run_dir"]
    assert [os.path.normpath(g) for g in toy_run["sd"]["shipped"]] == [str(ROOT / "runs" / "*" / "metrics" / "*.json")]
    found = {Path(p).resolve() for p in toy_run["sd"]["found"]}
    assert {(run_dir / "metrics" / f"{d}.json").resolve() for d in DAEMONS} <= found, found


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


@pytest.mark.parametrize("content", ['{"run": "r", "steps"', '[1, 2]'])
def test_report_names_a_summary_it_cannot_read(tmp_path, capsys, content):
    from handlers.report import main

    (tmp_path / "summary.json").write_text(content)
    assert main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and str(tmp_path / "summary.json") in err, err


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
