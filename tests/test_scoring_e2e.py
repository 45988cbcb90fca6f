"""Scoring end to end over the bus (DESIGN.md "Trajectory processing"), with real daemons.

One group of six executions runs through the real runner (toy harness, confined), the real
proxy in front of a scripted engine, the real evaluator and the real builder, all on a
private nats-server. Each case must end as specified:

    execution  what happens                           execution.scored            in the group
    e0         answers "I have 2 cats."               reward 1.0 (4/4 tests)      trained
    e1         answers "i have 2 cats"                reward 0.5 (2/4)            trained
    e2         its model call hangs: timeout at 3 s   reward 0.25 (1/4): the      no trained token
               (workspace kept, seeded "draft")       preserved workspace         (its call aborted)
    e3         evaluator crashes once, then grades    reward 1.0, attempt 1       trained
    e4         evaluator crashes every time           excluded, attempt 1         leaves the group
    e5         task unknown: no workspace             placeholder, reward 0       mean/std only

Advantages over the remaining rewards (1, .5, .25, 1, 0): mean .55, std (ddof 1) √.2, so
A = (R − .55)/√.2: e0, e3 → +1.0062, e1 → −0.1118. |E| = 3 (e0, e1, e3), 1 excluded.

The evaluator's crashes are injected by wrapping its `grade_workspace` (an infrastructure
failure cannot be provoked on purpose otherwise); everything else is the real component.

The second test runs ops/reward_service_example.py as a subprocess in the evaluator's place.
"""
from __future__ import annotations

import asyncio
import json
import math
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

import schemas
from bus import Bus
from gyre.env.tasks import GradeError
from gyre.serving.tokenizer import build_tokenizer
from handlers import builder as builder_mod
from handlers import evaluator as evaluator_mod
from handlers.proxy import daemon as proxy_mod
from handlers import runner as runner_mod
from handlers.engines.scripted import ScriptedEngine
from schemas import ids

SECRET = bytes(range(7, 39))
REPO = Path(__file__).resolve().parent.parent
TESTS = ("from pathlib import Path\n\nA = Path(__file__).with_name('answer.txt')\n\n\n"
         "def text():\n    return A.read_text()\n\n\n"
         "def test_exists():\n    assert A.is_file()\n\n\n"
         "def test_has_digit():\n    assert any(c.isdigit() for c in text())\n\n\n"
         "def test_starts_upper():\n    assert text()[:1].isupper()\n\n\n"
         "def test_ends_with_period():\n    assert text().rstrip().endswith('.')\n")
TASK = {"instance_id": "e2e-sentence", "problem_statement": "Answer with one sentence that has a number.",
        "files": {"answer.txt": "draft"}, "test_files": {"test_sentence_hidden.py": TESTS},
        "solution": {"answer.txt": "I have 2 cats."}, "timeout_s": 60, "test_timeout_s": 60}
GROUP = 6


@pytest.fixture
def base(sandbox_dir):
    return sandbox_dir


def info(execution: str, task: str = "e2e-sentence", group_size: int = GROUP) -> schemas.ExecutionInfo:
    return schemas.ExecutionInfo(execution=execution, task=task, group="s0-g0", step=0, harness="toy",
                                 group_size=group_size, step_groups=1)


class Collector:
    """Every replayed event by (name, execution or step)."""

    def __init__(self) -> None:
        self.events: dict[str, list] = {}

    async def __call__(self, event) -> None:
        self.events.setdefault(event.NAME, []).append(event)

    def by_execution(self, name: str) -> dict[str, list]:
        out: dict[str, list] = {}
        for e in self.events.get(name, []):
            out.setdefault(e.info.execution, []).append(e)
        return out

    async def wait(self, predicate, timeout_s: float, what: str) -> None:
        async def poll():
            while not predicate():
                await asyncio.sleep(0.05)
        try:
            await asyncio.wait_for(poll(), timeout_s)
        except asyncio.TimeoutError:
            raise AssertionError(f"timed out waiting for {what}; have {sorted(self.events)}") from None


async def test_timeout_crash_retry_exhausted_and_no_workspace_end_as_specified(nats_server, run_id, base, monkeypatch):
    tasks_path = base / "tasks.jsonl"
    tasks_path.write_text(json.dumps(TASK) + "\n")
    release = asyncio.Event()

    async def answer(body: dict) -> str:
        execution = body.get("gyre_execution", "")
        if execution.endswith("e2"):
            await release.wait()  # hangs until the test ends; the runner kills the harness at 3 s
        return "i have 2 cats" if execution.endswith("e1") else "I have 2 cats."

    attempts: Counter = Counter()
    real_grade = evaluator_mod.grade_workspace

    async def flaky_grade(task, workspace, scratch, **kw):
        execution = Path(workspace).name
        attempts[execution] += 1
        if execution.endswith("e4") or (execution.endswith("e3") and attempts[execution] == 1):
            raise GradeError("injected: the test runner crashed")
        return await real_grade(task, workspace, scratch, **kw)

    monkeypatch.setattr(evaluator_mod, "grade_workspace", flaky_grade)
    engine = ScriptedEngine(build_tokenizer(), callback=answer)
    await engine.start()
    bus = await Bus.connect(nats_server.url, token=nats_server.token, run=run_id, name="test")
    await bus.ensure_streams()
    stop = asyncio.Event()
    seen = Collector()
    proxy_url: asyncio.Future = asyncio.get_running_loop().create_future()
    common = dict(run=run_id, nats_url=nats_server.url, nats_token=nats_server.token)
    run_dir = base / "run"
    tasks = [
        asyncio.create_task(bus.replay(["execution.finished", "execution.scored", "step.sealed", "microstep.ready"],
                                       seen, stop=stop)),
        asyncio.create_task(proxy_mod.run(
            proxy_mod.Config(key_secret=SECRET, run=run_id, nats_url=nats_server.url, nats_token=nats_server.token,
                             engine_url=engine.url, shutdown_grace_s=2.0),
            stop, on_started=lambda _state, url: proxy_url.set_result(url))),
        asyncio.create_task(evaluator_mod.run(evaluator_mod.Config(**common, run_dir=run_dir, tasks=str(tasks_path),
                                                                   retries=1, retry_delay_s=0.2, concurrency=3), stop)),
        asyncio.create_task(builder_mod.run(builder_mod.Config(**common), stop)),
    ]
    try:
        url = await asyncio.wait_for(proxy_url, 60)
        tasks.append(asyncio.create_task(runner_mod.run(runner_mod.Config(
            **common, run_dir=run_dir, tasks=str(tasks_path), key_secret=SECRET.hex(), proxy_url=url,
            concurrency=GROUP), stop)))
        for i in range(GROUP):
            execution = f"s0-g0-e{i}"
            await bus.publish(schemas.ExecutionDispatched(
                event_id=ids.dispatched(run_id, execution),
                info=info(execution, task="no-such-task" if i == 5 else "e2e-sentence"),
                timeout_s=3.0 if i == 2 else 60.0))
        await seen.wait(lambda: "step.sealed" in seen.events, 150, "step.sealed")

        finished = {e: evs[0] for e, evs in seen.by_execution("execution.finished").items()}
        assert finished["s0-g0-e2"].status == "timeout" and finished["s0-g0-e2"].workspace
        assert (finished["s0-g0-e5"].status, finished["s0-g0-e5"].workspace) == ("no_workspace", "")
        assert all(finished[f"s0-g0-e{i}"].status == "ok" for i in (0, 1, 3, 4))

        scored = seen.by_execution("execution.scored")
        assert all(len(v) == 1 for v in scored.values()) and len(scored) == GROUP  # one fact each
        s = {e: v[0] for e, v in scored.items()}
        assert (s["s0-g0-e0"].outcome, s["s0-g0-e0"].reward, s["s0-g0-e0"].tests_passed) == ("reward", 1.0, 4)
        assert (s["s0-g0-e1"].outcome, s["s0-g0-e1"].reward) == ("reward", 0.5)
        # Timeout: scored on the preserved workspace (partial credit), not dropped.
        assert (s["s0-g0-e2"].outcome, s["s0-g0-e2"].reward, s["s0-g0-e2"].tests_passed) == ("reward", 0.25, 1)
        # Crash, then retry: the second attempt's reward, under the second attempt's id.
        assert (s["s0-g0-e3"].outcome, s["s0-g0-e3"].reward, s["s0-g0-e3"].attempt) == ("reward", 1.0, 1)
        assert s["s0-g0-e3"].event_id == ids.scored(run_id, "s0-g0-e3", 1) and attempts["s0-g0-e3"] == 2
        # Exhausted: excluded with the reason, never a reward of 0.
        e4 = s["s0-g0-e4"]
        assert (e4.outcome, e4.reward, e4.attempt) == ("excluded", None, 1) and attempts["s0-g0-e4"] == 2
        assert "failed 2 times" in e4.reason and "injected" in e4.reason
        # No workspace: a reward-0 placeholder.
        assert (s["s0-g0-e5"].outcome, s["s0-g0-e5"].reward) == ("placeholder", 0.0)

        (sealed,) = seen.events["step.sealed"]
        assert (sealed.step, sealed.groups, sealed.executions, sealed.excluded) == (0, 1, 3, 1)
        assert sealed.reward_mean == pytest.approx(0.55)
        await seen.wait(lambda: sum(1 for _ in seen.events.get("microstep.ready", ())) >= sealed.microsteps,
                        30, "microstep.ready")
        advantages = {x.execution: x.advantage for m in seen.events["microstep.ready"] for x in m.executions}
        std = math.sqrt(0.2)
        assert advantages == pytest.approx({"s0-g0-e0": 0.45 / std, "s0-g0-e1": -0.05 / std, "s0-g0-e3": 0.45 / std},
                                           abs=1e-5)
    finally:
        stop.set()
        release.set()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        await bus.close()
        await engine.stop()
    for r in results:
        assert not isinstance(r, Exception), repr(r)


async def test_example_reward_service_takes_the_evaluators_place(nats_server, run_id, base):
    done, undone = base / "ws-done", base / "ws-undone"
    done.mkdir()
    undone.mkdir()
    (done / "DONE").write_text("")
    bus = await Bus.connect(nats_server.url, token=nats_server.token, run=run_id, name="test")
    await bus.ensure_streams()
    stop = asyncio.Event()
    seen = Collector()
    common = dict(run=run_id, nats_url=nats_server.url, nats_token=nats_server.token)
    tasks = [asyncio.create_task(bus.replay(["execution.scored", "step.sealed"], seen, stop=stop)),
             asyncio.create_task(builder_mod.run(builder_mod.Config(**common), stop))]
    env = dict(os.environ, GYRE_NATS_URL=nats_server.url, GYRE_NATS_TOKEN=nats_server.token)
    service = subprocess.Popen([sys.executable, str(REPO / "ops" / "reward_service_example.py"), run_id,
                                "--command", "test -f DONE"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        cases = {"s0-g0-e0": ("ok", str(done)), "s0-g0-e1": ("timeout", str(undone)), "s0-g0-e2": ("no_workspace", "")}
        for execution, (status, ws) in cases.items():
            await bus.publish(schemas.ExecutionFinished(event_id=ids.finished(run_id, execution),
                                                        info=info(execution, group_size=3), status=status, workspace=ws))
        await seen.wait(lambda: "step.sealed" in seen.events, 60, "step.sealed from the example's scores")
        s = {e: v[0] for e, v in seen.by_execution("execution.scored").items()}
        assert {e: (x.outcome, x.reward, x.event_id) for e, x in s.items()} == {
            "s0-g0-e0": ("reward", 1.0, ids.scored(run_id, "s0-g0-e0", 0)),
            "s0-g0-e1": ("reward", 0.0, ids.scored(run_id, "s0-g0-e1", 0)),
            "s0-g0-e2": ("placeholder", 0.0, ids.scored(run_id, "s0-g0-e2", 0)),
        }
        (sealed,) = seen.events["step.sealed"]
        assert (sealed.groups, sealed.excluded, sealed.reward_mean) == (1, 0, pytest.approx(1 / 3))
        assert service.poll() is None  # still serving
    finally:
        service.terminate()
        out, _ = service.communicate(timeout=10)
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        await bus.close()


def test_gyre_run_without_its_evaluator_is_scored_by_the_example_service(tmp_path, nats_server):
    """`gyre run --no-evaluator` starts every daemon but the evaluator; the example reward
    service, started beside it as docs/reward-services.md says, scores every execution and
    the run ends `done` on its scores (reward 1.0 for all: `--command true`)."""
    runs, run = tmp_path / "runs", "noeval"
    env = dict(os.environ, GYRE_RUNS_DIR=str(runs), GYRE_NATS_URL=nats_server.url,
               GYRE_NATS_TOKEN=nats_server.token, HF_HUB_OFFLINE="1")
    (runs / "older").mkdir(parents=True)  # a previous run that `runs/latest` named
    (runs / "latest").symlink_to("older")
    gyre_run = subprocess.Popen([sys.executable, "-m", "handlers.cli", "run", "toy", "--no-evaluator", "--run-id", run,
                                 "--set", "run.steps=1", "--timeout", "300"],
                                cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    service = None
    try:
        for _ in range(300):  # as docs/reward-services.md says: once runs/latest/nats.json exists
            if (runs / "latest" / "nats.json").exists():
                break
            time.sleep(0.1)
        assert json.loads((runs / "latest" / "nats.json").read_text())["run"] == run  # written whole, never half
        # (the service waits for the run's streams, created a moment later)
        service = subprocess.Popen([sys.executable, str(REPO / "ops" / "reward_service_example.py"), run,
                                    "--command", "true"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                   text=True)
        out, _ = gyre_run.communicate(timeout=400)
    finally:
        if gyre_run.poll() is None:  # timed out or failed above: leave no run behind
            gyre_run.kill()
            gyre_run.communicate()
        said = ""
        if service is not None:
            service.terminate()
            said, _ = service.communicate(timeout=10)
    assert gyre_run.returncode == 0, out[-3000:]
    assert "no built-in evaluator" in out
    assert not (runs / run / "logs" / "evaluator.log").exists()
    summary = json.loads((runs / run / "summary.json").read_text())
    assert summary["steps"] == 1 and summary["rewards_per_step"] == [1.0], summary
    assert summary["evaluator"] == "external" and "rewards from your reward service" in out
    scored = [line for line in said.splitlines() if ": reward 1.0" in line]
    assert len(scored) == summary["executions"], said[-2000:]
    assert "Traceback" not in said, said[-2000:]
