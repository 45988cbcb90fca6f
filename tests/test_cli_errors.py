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
])
def test_run_rejects_bad_input_before_starting(tmp_path, args, needle):
    env = dict(os.environ, GYRE_RUNS_DIR=str(tmp_path / "runs"))
    proc = subprocess.run([sys.executable, "-m", "handlers.cli", "run", "toy", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert needle in proc.stderr
    assert not (tmp_path / "escape").exists() and not (tmp_path / "runs").exists()
