"""Running tests that start Mooncake inside a private network namespace.

Mooncake's transfer engine binds every interface, so the tests that use it run, NATS and
processes included, inside a fresh network namespace whose only interface is loopback
(`unshare -n`, lo up: handlers.transfer.mooncake.namespace_command). The default run has
one test per such module (tests/test_mooncake.py) that runs the module's tests with pytest
inside the namespace and reports each one; where root, `unshare`, `ip` or `libibverbs1`
are missing it skips with the reason, and fails under CI=true.
"""
from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def missing() -> str | None:
    """Why Mooncake tests cannot run here, or None."""
    from handlers.transfer.mooncake import MooncakeUnavailable, available, namespace_command

    why = available()
    if why is not None:
        return why
    try:
        argv = namespace_command(["true"])
    except MooncakeUnavailable as exc:
        return str(exc)
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        return f"cannot make a private network namespace (root or user namespaces needed): {done.stderr.strip()}"
    return None


def skip_or_fail(reason: str) -> None:
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI=true and the Mooncake tests cannot run: {reason}")
    pytest.skip(reason)


def run_module(module: Path, tmp: Path, timeout_s: float, *selectors: str) -> dict[str, str]:
    """Run `module`'s tests with pytest inside a private network namespace; returns test name
    → outcome (`passed`, `failed: …`, `skipped: …`). Inside, CI=true: nothing may skip."""
    from handlers.transfer.mooncake import namespace_command

    report = tmp / "report.xml"
    argv = namespace_command([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x",
                              f"--junitxml={report}", "-o", "addopts=", str(module), *selectors])
    env = dict(os.environ, CI="true", PYTHONPATH=str(ROOT), GYRE_IN_NAMESPACE="1", MC_LOG_LEVEL="ERROR",
               GLOG_minloglevel="2", HF_HUB_OFFLINE="1")
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
    if not report.exists():
        raise AssertionError(f"pytest in the namespace wrote no report (rc {done.returncode}):\n"
                             f"{done.stdout[-4000:]}\n{done.stderr[-4000:]}")
    outcomes = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        failure = case.find("failure")
        if failure is None:
            failure = case.find("error")
        skipped = case.find("skipped")
        if failure is not None:
            outcomes[case.get("name")] = f"failed: {failure.get('message', '')}\n{failure.text or ''}"
        elif skipped is not None:
            outcomes[case.get("name")] = f"skipped: {skipped.get('message', '')}"
        else:
            outcomes[case.get("name")] = "passed"
    if done.returncode != 0 and all(v == "passed" for v in outcomes.values()):
        raise AssertionError(f"pytest in the namespace exited {done.returncode}:\n{done.stdout[-4000:]}")
    return outcomes
