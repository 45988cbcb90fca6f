"""`gyre run` refuses bad input before it starts anything (exit 2, a message naming it)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("args,needle", [
    (["--run-id", "../../escape"], "--run-id"),
    (["--set", "harness.name=bogus"], "harness.name"),
    (["--set", "harness.max_calls=true"], "harness.max_calls"),
    (["--set", "run.steps=1.5"], "run.steps"),
    (["--set", "tasks.set=nope"], "tasks.set"),
    (["--set", "nosuch.key=1"], "nosuch"),
    (["--set", "cells.transfer=mooncake"], "cells.transfer = mooncake"),  # outside a private network namespace
])
def test_run_rejects_bad_input_before_starting(tmp_path, args, needle):
    env = dict(os.environ, GYRE_RUNS_DIR=str(tmp_path / "runs"))
    proc = subprocess.run([sys.executable, "-m", "handlers.cli", "run", "toy", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert needle in proc.stderr
    assert not (tmp_path / "escape").exists() and not (tmp_path / "runs").exists()


@pytest.mark.parametrize("when", ["started", "following"])
def test_run_stopped_by_sigterm_exits_143_with_its_summary(tmp_path, when):
    """SIGTERM stops the daemons and the NATS server and exits 128 + 15 (the shell's
    convention; Ctrl-C: 130), with the summary printed and written, its outcome
    `interrupted`: while the model is made (`started`: its first line) or once the run
    follows its events (the first progress line)."""
    import json
    import signal
    import threading

    env = dict(os.environ, GYRE_RUNS_DIR=str(tmp_path / "runs"), PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "handlers.cli", "run", "toy", "--run-id", "term"], cwd=ROOT,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    watchdog = threading.Timer(180, proc.kill)  # a hang fails the test instead of stalling the suite
    watchdog.start()
    try:
        wanted = "gyre: run term" if when == "started" else "["
        for line in proc.stdout:
            if line.startswith(wanted):
                break
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
    finally:
        watchdog.cancel()
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, out
    assert "outcome interrupted" in out, out
    summary = json.loads((tmp_path / "runs" / "term" / "summary.json").read_text())
    assert summary["outcome"] == "interrupted"
    left = subprocess.run(["pgrep", "-f", str(tmp_path)], capture_output=True, text=True).stdout.split()
    assert not left, f"processes of the run left behind: {left}"


def test_a_bad_run_name_is_named_as_such(tmp_path):
    """The default run id starts with `run.name`: a name it cannot carry is blamed, not
    the --run-id the user never gave."""
    env = dict(os.environ, GYRE_RUNS_DIR=str(tmp_path / "runs"))
    proc = subprocess.run([sys.executable, "-m", "handlers.cli", "run", "toy", "--set", "run.name=my run"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "gyre run: run.name" in proc.stderr and "--run-id" not in proc.stderr


@pytest.mark.parametrize("args,needle", [
    (["--layers", "0"], "--layers must be a positive int"),
    (["--hidden", "63"], "--hidden must be --heads times an even head size"),
    (["--kv-heads", "3"], "--heads (4) must be a multiple of --kv-heads (3)"),
    ([], "exists and is not an empty directory"),
])
def test_init_model_refuses_bad_sizes_and_a_used_directory_in_one_line(tmp_path, args, needle):
    target = tmp_path / "model"
    if not args:
        target.mkdir()
        (target / "mine.txt").write_text("keep me")
    proc = subprocess.run([sys.executable, "-m", "handlers.cli", "init-model", str(target), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and needle in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    left = sorted(p.name for p in target.iterdir()) if target.exists() else []
    assert left == ([] if args else ["mine.txt"])  # nothing written, nothing overwritten


def test_tap_refuses_a_pattern_nats_cannot_subscribe_in_one_line(nats_server):
    env = dict(os.environ, GYRE_NATS_URL=nats_server.url, GYRE_NATS_TOKEN=nats_server.token)
    proc = subprocess.run([sys.executable, "-m", "handlers.cli", "tap", "foo bar", "--run", "r"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "is not a NATS subject pattern" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("name", ["nope", "proxy_load", "proxy_servers", "probes", "probes.nfd_encode_cost", "."])
def test_bench_names_only_benchmarks(name):
    """`gyre bench NAME` runs only the benchmarks BENCHMARKS.md defines; a helper module of
    handlers/bench/ or a typo is a usage error naming the choices, not a traceback."""
    from handlers import cli

    proc = subprocess.run([sys.executable, "-m", "handlers.cli", "bench", name], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "unknown benchmark" in proc.stderr and "Traceback" not in proc.stderr
    assert all(b in proc.stderr for b in cli.BENCHMARKS)
