"""Evaluator: confined hidden-test runs on real workspaces, the scoring rules, and the
daemon over a real nats-server (reward, placeholder, exclusion after retries)."""
from __future__ import annotations

import asyncio
import dataclasses
import os
from pathlib import Path

import pytest

import schemas
from bus import Bus
from gyre.env.sandbox import SandboxConfig
from gyre.env.tasks import GradeError, Task, load_tasks, task_index, write_files
from handlers import evaluator as evaluator_mod
from handlers.evaluator import Config, Evaluator, grade_workspace, scored_event, triage
from schemas import ids

SANDBOX = SandboxConfig()


@pytest.fixture
def base(sandbox_dir):
    return sandbox_dir


def workspace(base: Path, name: str, files: dict[str, str]) -> Path:
    ws = base / "workspaces" / name
    ws.mkdir(parents=True)
    write_files(ws, files)
    return ws


def quick(instance_id: str) -> Task:
    return task_index(load_tasks("quickstart"))[instance_id]


async def test_correct_solution_scores_one(base):
    task = quick("rpn-calculator")
    ws = workspace(base, "good", task.solution)
    g = await grade_workspace(task, ws, base / "scratch", sandbox=SANDBOX)
    assert (g.reward, g.passed, g.total) == (1.0, 7, 7)


async def test_partial_solution_scores_fraction(base):
    task = quick("fix-stats-bugs")  # the shipped buggy file passes 2 of 7 hidden tests
    ws = workspace(base, "start", task.files)
    g = await grade_workspace(task, ws, base / "scratch", sandbox=SANDBOX)
    assert (g.passed, g.total) == (2, 7) and g.reward == pytest.approx(2 / 7)


async def test_missing_module_is_zero_not_a_crash(base):
    task = quick("slugify")
    ws = workspace(base, "empty", {"notes.txt": "nothing done"})
    g = await grade_workspace(task, ws, base / "scratch", sandbox=SANDBOX)
    assert (g.reward, g.passed, g.total) == (0.0, 0, 7) and "collection error" in g.note


async def test_agent_cannot_swap_tests_or_pytest(base):
    task = quick("run-length-encoding")
    files = {"rle.py": task.solution["rle.py"].replace("def decode", "def decode_old").replace(
        "def encode", "def decode(data):\n    return ''\n\n\ndef encode"),
        "conftest.py": "import pytest\n@pytest.hookimpl(tryfirst=True)\ndef pytest_runtest_call(item):\n    return True\n",
        "pytest.py": "raise SystemExit(0)\n",
        "test_rle_hidden.py": "def test_fake():\n    pass\n"}
    ws = workspace(base, "cheat", files)
    g = await grade_workspace(task, ws, base / "scratch", sandbox=SANDBOX)
    assert g.total == 7 and g.passed < 7


async def test_hanging_test_times_out_alone(base):
    task = dataclasses.replace(quick("fizzbuzz-rules"), test_timeout_s=60.0)
    code = task.solution["fizzbuzz.py"].replace("    if n < 0:", "    if n == 0:\n        while True:\n            pass\n    if n < 0:")
    ws = workspace(base, "hang1", {"fizzbuzz.py": code})
    g = await grade_workspace(task, ws, base / "scratch", sandbox=SANDBOX, per_test_timeout_s=1.0)
    assert (g.passed, g.total) == (6, 7) and g.note == "junit"


async def test_whole_run_timeout_keeps_partial_credit(base):
    task = dataclasses.replace(quick("fizzbuzz-rules"), test_timeout_s=4.0)
    # Blocks SIGALRM's effect by sleeping in a loop that swallows the per-test timeout.
    code = task.solution["fizzbuzz.py"].replace(
        "    if n < 0:",
        "    if n == 0:\n        import time\n        while True:\n            try:\n                time.sleep(0.05)\n"
        "            except BaseException:\n                pass\n    if n < 0:")
    ws = workspace(base, "hang2", {"fizzbuzz.py": code})
    g = await grade_workspace(task, ws, base / "scratch", sandbox=SANDBOX, per_test_timeout_s=0.5)
    # Tests run in file order; the 5th (zero) never returns, so 4 passed of 7 collected.
    assert (g.passed, g.total) == (4, 7) and g.note.startswith("partial: timeout")


async def test_broken_infrastructure_raises(base):
    task = quick("rpn-calculator")
    ws = workspace(base, "good", task.solution)
    broken = dataclasses.replace(task, test_command="python-does-not-exist -m pytest")
    with pytest.raises(GradeError, match="did not start"):
        await grade_workspace(broken, ws, base / "scratch", sandbox=SANDBOX)


def finished(run: str, execution: str, status: str, ws: str, task: str = "rpn-calculator") -> schemas.ExecutionFinished:
    info = schemas.ExecutionInfo(execution=execution, task=task, group="s0-g0", step=0, harness="toy",
                                 group_size=4, step_groups=1)
    return schemas.ExecutionFinished(event_id=ids.finished(run, execution), info=info, status=status, workspace=ws,
                                     exit_code=0 if status == "ok" else None, duration_s=1.0)


def test_triage_rules(base):
    ws = str(workspace(base, "w", {}))
    task = quick("rpn-calculator")
    assert triage(finished("r", "e", "no_workspace", ""), task)[0] == "placeholder"
    assert triage(finished("r", "e", "harness_error", ws), task)[0] == "excluded"
    assert triage(finished("r", "e", "ok", ws), None) == ("excluded", "task 'rpn-calculator' is not in the evaluator's task set")
    assert triage(finished("r", "e", "ok", str(base / "gone")), task)[0] == "excluded"
    assert triage(finished("r", "e", "timeout", ws), task) == ("grade", "")
    ev = scored_event("r", finished("r", "e", "no_workspace", "").info, outcome="placeholder", attempt=0, reason="x")
    assert (ev.reward, ev.event_id) == (0.0, "r:e:scored:0")
    ev = scored_event("r", finished("r", "e", "ok", ws).info, outcome="excluded", attempt=2, reason="boom")
    assert (ev.reward, ev.event_id, ev.reason) == (None, "r:e:scored:2", "boom")


async def test_evaluator_over_the_bus(nats_server, run_id, base):
    task = quick("rpn-calculator")
    good = workspace(base, "s0-g0-e0", task.solution)
    half = workspace(base, "s0-g0-e1", {"rpn.py": task.solution["rpn.py"].replace("/", "//")})
    cfg = Config(run=run_id, nats_url=nats_server.url, nats_token=nats_server.token, run_dir=base / "run",
                 tasks="quickstart", retries=1, retry_delay_s=0.1, concurrency=2)
    bus = await Bus.connect(nats_server.url, token=nats_server.token, run=run_id, name="test")
    await bus.ensure_streams()
    stop = asyncio.Event()
    scored: dict[str, list[schemas.ExecutionScored]] = {}

    async def collect(event):
        scored.setdefault(event.info.execution, []).append(event)

    replay = asyncio.create_task(bus.replay(["execution.scored"], collect, stop=stop))
    daemon = asyncio.create_task(evaluator_mod.run(cfg, stop))
    # An evaluator whose test runs cannot start (infrastructure): excluded after 1 + retries.
    broken_cfg = dataclasses.replace(cfg, run_dir=base / "run-broken")
    broken_tasks = {"rpn-calculator": dataclasses.replace(task, test_command="no-such-python -m pytest")}
    try:
        await bus.publish(finished(run_id, "s0-g0-e0", "ok", str(good)))
        await bus.publish(finished(run_id, "s0-g0-e1", "timeout", str(half)))
        await bus.publish(finished(run_id, "s0-g0-e2", "no_workspace", ""))
        await bus.publish(finished(run_id, "s0-g0-e3", "harness_error", str(good)))

        async def until(executions):
            while not set(executions) <= set(scored):
                await asyncio.sleep(0.05)
        await asyncio.wait_for(until(["s0-g0-e0", "s0-g0-e1", "s0-g0-e2", "s0-g0-e3"]), 60)
        e0, e1, e2, e3 = (scored[f"s0-g0-e{i}"][0] for i in range(4))
        assert (e0.outcome, e0.reward, e0.tests_passed, e0.tests_total, e0.attempt) == ("reward", 1.0, 7, 7, 0)
        assert e0.event_id == ids.scored(run_id, "s0-g0-e0", 0)
        assert e1.outcome == "reward" and 0.0 < e1.reward < 1.0  # floor division breaks the "/" tests
        assert (e2.outcome, e2.reward) == ("placeholder", 0.0)
        assert (e3.outcome, e3.reward) == ("excluded", None)
        assert not (base / "run" / "eval" / "s0-g0-e0").exists()  # graded: its scratch folder is gone

        evaluator = Evaluator(broken_cfg, bus, broken_tasks)
        event = finished(run_id, "s0-g0-e4", "ok", str(good))
        from bus import Retry
        with pytest.raises(Retry):
            await evaluator.handle(event)
        await evaluator.handle(event)  # second failure: the retry budget (1) is spent
        await asyncio.wait_for(until(["s0-g0-e4"]), 30)
        e4 = scored["s0-g0-e4"][0]
        assert (e4.outcome, e4.reward, e4.attempt) == ("excluded", None, 1)
        assert "failed 2 times" in e4.reason and "did not start" in e4.reason
        # Redelivery after the result is recorded re-publishes the same fact (deduplicated).
        await evaluator.handle(event)
        await asyncio.sleep(0.3)
        assert len(scored["s0-g0-e4"]) == 1
    finally:
        stop.set()
        await asyncio.gather(replay, daemon)
        await bus.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="the setuid fallback needs root")
def test_the_setuid_fallback_grades_on_the_daemons_event_loop(base):
    """The daemons run on uvloop, which cannot start a process as another user (Popen's
    `user=`): graders of the setuid fallback drop privileges in their argv instead."""
    import sys

    import uvloop

    from gyre.env.harness import python_installation
    from gyre.env.sandbox import unreadable

    cfg = SandboxConfig(mode="setuid")
    why = unreadable(python_installation(sys.executable), cfg.uid, cfg.gid)
    if why:  # a checkout under a private directory (mktemp -d, a 0700 home): the grader refuses, rightly
        pytest.skip(f"this checkout's interpreter is out of the sandbox uid's reach: {why}")
    task = quick("rpn-calculator")
    ws = workspace(base, "good-setuid", task.solution)
    g = uvloop.run(grade_workspace(task, ws, base / "scratch-setuid", sandbox=cfg))
    assert (g.reward, g.passed, g.total) == (1.0, 7, 7)
