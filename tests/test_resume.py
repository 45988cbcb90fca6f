"""`gyre run --resume RUN_DIR` after every process of a run was killed (a reboot).

Real processes: `gyre run toy` in its own process group, every process it started (daemons,
its nats-server, harnesses) found through /proc, frozen with SIGSTOP and killed with SIGKILL
at a chosen moment; then `gyre run --resume` on the run directory, and an audit of the
run's JetStream store (a nats-server started again on it).

The toy recipe with one group per step and one trajectory per micro-step
(`train.microstep_tokens = 1`) is deterministic: the proxy seeds every call by
(execution, call), the builder packs a group's executions in sorted order, the core trains
micro-steps in index order, so two runs give the same weights bit for bit. (With two groups
per step the micro-steps' order follows the order the groups were scored in, and AdamW's
first steps amplify the float32 summation differences to ~1e-5.)
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import schemas
from bus import Bus
from bus.server import NatsServer

ROOT = Path(__file__).resolve().parents[1]
OVERRIDES = ["--set", "tasks.groups_per_step=1", "--set", "train.microstep_tokens=1"]
STEPS = 2


def _env(runs: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GYRE_NATS_", "GYRE_RESUMED"))}
    return dict(env, GYRE_RUNS_DIR=str(runs), HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT))


def _gyre(*args: str) -> list[str]:
    return [sys.executable, "-m", "handlers.cli", *args]


def _logs(run_dir: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-2000:]}"
                     for p in sorted((run_dir / "logs").glob("*.log")))


def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            tree.setdefault(ppid, []).append(int(entry))
    return tree


def _tree(root: int) -> list[int]:
    """`root` and every process below it (the daemons start their own sessions, so a
    process group does not hold them)."""
    tree, out, todo = _children(), [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(tree.get(pid, ()))
    return out


def kill_everything(proc: subprocess.Popen) -> int:
    """What a reboot does to a run: freeze every process of it (SIGSTOP, so none reacts to
    another's death: no SIGTERM to the nats-server from its parent, no daemon noticing the
    end of the run), then SIGKILL them all. Returns how many processes were killed."""
    frozen: set[int] = set()
    while True:  # a process may fork while we walk: walk until nothing new is found
        found = set(_tree(proc.pid)) - frozen
        if not found:
            break
        for pid in found:
            try:
                os.kill(pid, signal.SIGSTOP)
            except ProcessLookupError:
                pass
        frozen |= found
    os.killpg(proc.pid, signal.SIGKILL)
    for pid in frozen:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(30)
    deadline = time.monotonic() + 30
    while any(Path(f"/proc/{pid}").exists() and "Z" not in _state(pid) for pid in frozen):
        assert time.monotonic() < deadline, "processes of the run survived SIGKILL"
        time.sleep(0.1)
    return len(frozen)


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "Z"


async def _follow_until(run_dir: Path, proc: subprocess.Popen, names: list[str], hit, timeout_s: float = 300):
    """Follow the run's events `names` until `hit(events)` is true (events: every event seen
    so far, in order); returns them."""
    deadline = time.monotonic() + timeout_s
    while not (run_dir / "logs" / "scheduler.log").exists():  # started once the run's streams exist
        assert proc.poll() is None and time.monotonic() < deadline, "the run never started its daemons"
        await asyncio.sleep(0.2)
    info = json.loads((run_dir / "nats.json").read_text())
    bus = await Bus.connect(info["url"], token=info.get("token"), run=info["run"], name="test-watch")
    events: list = []
    found = asyncio.Event()

    async def on(event) -> None:
        events.append(event)
        if hit(events):
            found.set()

    stop = asyncio.Event()
    task = asyncio.create_task(bus.replay(names, on, stop=stop, poll_s=0.05))
    try:
        while not found.is_set():
            assert proc.poll() is None, "the run ended before the kill"
            assert time.monotonic() < deadline, "the moment to kill never came"
            if task.done():
                task.result()
            try:
                await asyncio.wait_for(found.wait(), 0.05)
            except TimeoutError:
                pass
        return list(events)
    finally:
        stop.set()
        await task
        await bus.close()


def _crash(tmp_path: Path, run: str, names: list[str], hit) -> tuple[Path, list, str]:
    """Start `gyre run toy` (deterministic overrides), kill every process of it once
    `hit(events)` holds; returns (run directory, events seen, its console)."""
    runs = tmp_path / "runs"
    console = tmp_path / f"{run}.console"
    with open(console, "wb") as sink:
        proc = subprocess.Popen(_gyre("run", "toy", "--run-id", run, "--timeout", "600", *OVERRIDES), cwd=ROOT,
                                env=_env(runs), stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        seen = asyncio.run(_follow_until(runs / run, proc, names, hit))
        killed = kill_everything(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
    out = console.read_text(errors="replace")
    assert killed >= 8, out  # gyre run, nats-server, proxy, runner, evaluator, builder, cell0, scheduler
    assert not (runs / run / "summary.json").exists()
    return runs / run, seen, out


def _resume(run_dir: Path) -> subprocess.CompletedProcess:
    resumed = subprocess.run(_gyre("run", "--resume", str(run_dir), "--timeout", "600"), check=False, cwd=ROOT,
                             env=_env(run_dir.parent), capture_output=True, text=True, timeout=900)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:] + _logs(run_dir)
    assert "(resumed)" in resumed.stdout
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["outcome"] == "done" and summary["steps"] == STEPS and summary["policy_version"] == STEPS
    return resumed


async def _audit(run_dir: Path, run: str) -> dict:
    """Every stored event of the run that the audit reads, from its JetStream store."""
    server = NatsServer.start(run_dir / "nats")
    try:
        bus = await Bus.connect(server.url, token=server.token, run=run, name="test-audit")
        names = [schemas.MicrostepReady.NAME, schemas.MicrostepCommitted.NAME, schemas.StepSealed.NAME,
                 schemas.StepCompleted.NAME, schemas.ExecutionStarted.NAME, schemas.ExecutionFinished.NAME,
                 schemas.ExecutionScored.NAME, schemas.RouteUpdated.NAME]
        out: dict[str, list] = {n: [] for n in names}

        async def on(event) -> None:
            out[event.NAME].append(event)

        stop, caught = asyncio.Event(), asyncio.Event()
        task = asyncio.create_task(bus.replay(names, on, stop=stop, caught_up=caught))
        await asyncio.wait_for(caught.wait(), 60)
        stop.set()
        await task
        await bus.close()
        return out
    finally:
        server.stop()


def _weights(run_dir: Path, version: int) -> dict[str, torch.Tensor]:
    return {k: v.double() for k, v in load_file(str(run_dir / "weights" / f"v{version}" / "model.safetensors")).items()}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    """An uninterrupted run of the deterministic toy recipe (module docstring)."""
    runs = tmp_path_factory.mktemp("runs")
    proc = subprocess.run(_gyre("run", "toy", "--run-id", "plain", "--timeout", "600", *OVERRIDES), check=False, cwd=ROOT,
                          env=_env(runs), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:] + _logs(runs / "plain")
    return runs / "plain"


def _audit_once(run_dir: Path) -> dict:
    """The run's stored events, checked: every step completed once; the micro-steps counted
    (committed under the epoch that completed their step) are each step's sealed ones, and
    hold every execution at most once; every execution dispatched, started and finished
    once; metrics.jsonl holds each step and execution once across the run's processes."""
    events = asyncio.run(_audit(run_dir, run_dir.name))
    completed = {e.step: e for e in events[schemas.StepCompleted.NAME]}
    assert sorted(completed) == list(range(STEPS))
    ready = {(e.step, e.microstep): e for e in events[schemas.MicrostepReady.NAME]}
    sealed = {e.step: e for e in events[schemas.StepSealed.NAME]}
    trained: list[str] = []
    for k, done in completed.items():
        counted = sorted(e.microstep for e in events[schemas.MicrostepCommitted.NAME]
                         if e.step == k and e.epoch == done.epoch)
        assert counted == list(range(sealed[k].microsteps)), (k, counted)
        assert sum(done.microsteps_per_replica.values()) == sealed[k].microsteps
        trained += [x.execution for i in counted for x in ready[(k, i)].executions]
    assert len(trained) == len(set(trained)), "an execution was trained twice"
    planned = STEPS * 4
    routes = {e.seq: e for e in events[schemas.RouteUpdated.NAME]}  # a republished fact keeps its seq
    dispatched = [r.execution for e in routes.values() for r in e.routes if r.reason == "dispatch"]
    assert len(dispatched) == len(set(dispatched)) == planned, "an execution was dispatched twice"
    # the scheduler's trace (rebuilt by the resumed scheduler) dispatched each execution once,
    # and burst k only once its gate opened, resumed as it was: after step k − 1 completed in
    # colocate, after step k − 1 − S completed otherwise (every engine then serves v_{k−S})
    recipe = json.loads((run_dir / "config.json").read_text())
    lag = 0 if recipe["run"]["mode"] == "colocate" else recipe["train"]["max_staleness"]
    trace = [json.loads(line) for line in (run_dir / "trace.jsonl").read_text().splitlines()[1:]]
    dispatches = [(i, x[0]) for i, obj in enumerate(trace) if obj.get("action") == "dispatch" for x in obj["executions"]]
    assert sorted(e for _i, e in dispatches) == sorted(set(dispatched))
    completed_at = {obj["step"]: i for i, obj in enumerate(trace) if obj.get("fact") == "step.completed"}
    for i, execution in dispatches:
        gate = int(execution[1:].split("-")[0]) - 1 - lag
        assert gate < 0 or i > completed_at[gate], (execution, "dispatched before its gate opened")
    started = [e.info.execution for e in events[schemas.ExecutionStarted.NAME]]
    assert len(started) == len(set(started)) == planned
    assert sorted(e.info.execution for e in events[schemas.ExecutionFinished.NAME]) == sorted(started)
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines if x["kind"] == "step.completed"] == list(range(STEPS))
    assert sorted(x["execution"] for x in lines if x["kind"] == "execution.finished") == sorted(started)
    return events


def _launches(run_dir: Path) -> list[list[str]]:
    """The executions whose harness each runner process launched (logs/runner.log: a runner
    logs `runner.sandbox` as it starts, then `runner.harness.started` per launch)."""
    out: list[list[str]] = []
    for line in (run_dir / "logs" / "runner.log").read_text().splitlines():
        if '"runner.sandbox"' in line:
            out.append([])
        elif '"runner.harness.started"' in line:
            out[-1].append(json.loads(line)["execution"])
    return out


def test_resume_after_a_reboot_mid_step(tmp_path, uninterrupted):
    """SIGKILL of every process of the run after a micro-step of step 1 was committed and
    before step 1 completed; `gyre run --resume` restores v1 with its optimizer state, trains
    step 1 again under a new epoch, every execution once, and its weights equal the
    uninterrupted run's after every step."""
    def mid_step(events) -> bool:
        committed = any(isinstance(e, schemas.MicrostepCommitted) and e.step == 1 for e in events)
        return committed and not any(isinstance(e, schemas.StepCompleted) and e.step == 1 for e in events)

    run_dir, _seen, out = _crash(tmp_path, "crash", [schemas.MicrostepCommitted.NAME, schemas.StepCompleted.NAME],
                                 mid_step)
    # The kill landed mid-step: step 1 had a committed micro-step, and its checkpoint (v2,
    # written before step.completed) does not exist; step 0's does.
    assert (run_dir / "weights" / "v1").is_dir() and not (run_dir / "weights" / "v2").exists(), out
    _resume(run_dir)
    events = _audit_once(run_dir)
    completed = {e.step: e for e in events[schemas.StepCompleted.NAME]}
    assert completed[0].epoch == 0 and completed[1].epoch == 1  # step 1 trained again by the restarted core
    assert any(e.step == 1 and e.epoch == 0 for e in events[schemas.MicrostepCommitted.NAME])
    launches = [e for runner in _launches(run_dir) for e in runner]
    assert sorted(launches) == sorted(e.info.execution for e in events[schemas.ExecutionStarted.NAME])
    for version in range(1, STEPS + 1):
        ours, theirs = _weights(run_dir, version), _weights(uninterrupted, version)
        assert ours.keys() == theirs.keys()
        for name in ours:
            assert torch.allclose(ours[name], theirs[name], rtol=0, atol=1e-8), (version, name)


@pytest.mark.slow
def test_resume_after_a_reboot_mid_rollout(tmp_path):
    """SIGKILL of every process while harnesses run: `gyre run --resume` finishes those
    executions `timeout` on their preserved workspace, scores them (partial credit), never
    launches them again, and completes the run (> 60 s: the runner's dispatches come back
    after their ack_wait)."""
    def mid_rollout(events) -> bool:  # a harness that made a call and has not finished
        called = {e.execution for e in events if isinstance(e, schemas.CallCompleted)}
        finished = {e.info.execution for e in events if isinstance(e, schemas.ExecutionFinished)}
        return bool(called - finished)

    run_dir, _seen, out = _crash(tmp_path, "rollout", [schemas.CallCompleted.NAME, schemas.ExecutionFinished.NAME],
                                 mid_rollout)
    records = {p.stem for p in (run_dir / "runner").glob("*.json")}
    cut = {p.name for p in (run_dir / "workspaces").iterdir()} - records
    assert cut, out  # harnesses died with the machine: workspaces without a runner record
    _resume(run_dir)
    events = _audit_once(run_dir)
    finished = {e.info.execution: e for e in events[schemas.ExecutionFinished.NAME]}
    scored = {e.info.execution: e for e in events[schemas.ExecutionScored.NAME]}
    for execution in cut:
        assert finished[execution].status == "timeout", finished[execution]
        assert scored[execution].outcome == "reward", scored[execution]
    before, after = _launches(run_dir)
    assert len(before + after) == len(set(before + after)) and not cut & set(after)


@pytest.mark.slow
def test_resume_elastic_with_a_satellite(tmp_path, monkeypatch):
    """Elastic on two cells (the core and a satellite), killed after a micro-step of step 0
    was committed: the resumed run completes its three steps, each execution dispatched,
    started and trained once, no burst before its gate."""
    monkeypatch.setattr(sys.modules[__name__], "OVERRIDES", [*OVERRIDES, "--set", "run.mode=elastic",
                                                            "--set", "cells.count=2", "--set", "run.steps=3"])
    monkeypatch.setattr(sys.modules[__name__], "STEPS", 3)

    def mid_step(events) -> bool:
        committed = any(isinstance(e, schemas.MicrostepCommitted) and e.step == 0 for e in events)
        return committed and not any(isinstance(e, schemas.StepCompleted) and e.step == 0 for e in events)

    run_dir, _seen, out = _crash(tmp_path, "elastic", [schemas.MicrostepCommitted.NAME, schemas.StepCompleted.NAME],
                                 mid_step)
    assert not (run_dir / "weights" / "v1").exists(), out
    _resume(run_dir)
    events = _audit_once(run_dir)
    assert {e.step: e.epoch for e in events[schemas.StepCompleted.NAME]} == {0: 1, 1: 1, 2: 1}


def test_resume_refuses_what_it_cannot_resume(tmp_path, uninterrupted):
    """A finished run, a directory that is not a run: exit 2 with the reason, nothing started."""
    runs = tmp_path / "runs"
    done = subprocess.run(_gyre("run", "--resume", str(uninterrupted)), check=False, cwd=ROOT, env=_env(runs),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "done already" in done.stderr, done.stderr
    (tmp_path / "empty").mkdir()
    empty = subprocess.run(_gyre("run", "--resume", str(tmp_path / "empty")), check=False, cwd=ROOT, env=_env(runs),
                           capture_output=True, text=True, timeout=120)
    assert empty.returncode == 2 and "not a run directory" in empty.stderr, empty.stderr
    both = subprocess.run(_gyre("run", "toy", "--resume", str(uninterrupted)), check=False, cwd=ROOT, env=_env(runs),
                          capture_output=True, text=True, timeout=120)
    assert both.returncode == 2 and "--resume" in both.stderr


def test_the_policy_counts_a_restarted_cores_ledger_afresh():
    """A resumed (or restarted) core grants the interrupted step's micro-steps again under a
    new epoch: the scheduler's view of that step starts afresh, so it does not see the step
    as having nothing left to claim after the old epoch's grants, and a late fact of the old
    epoch counts for nothing."""
    from gyre.control import facts as F
    from gyre.control.modes import make_policy
    from gyre.control.policy import PolicyConfig

    p = make_policy("elastic", PolicyConfig(cells=("c0", "c1"), capacity=2, groups_per_step=1, group_size=2, steps=2))
    p.on(F.MicrostepReady(t=1.0, step=0, microstep=0))
    p.on(F.MicrostepReady(t=1.0, step=0, microstep=1))
    p.on(F.StepSealed(t=1.0, step=0, microsteps=2, executions=2))
    p.on(F.MicrostepGranted(t=2.0, step=0, microstep=0, replica="c0"))
    p.on(F.MicrostepCommitted(t=3.0, step=0, microstep=0, replica="c0"))
    p.on(F.MicrostepGranted(t=3.0, step=0, microstep=1, replica="c1"))
    assert p.nothing_left(0) and p.claimable(0) == 0 and "c1" in p.holding
    # the core restarts (epoch 1) and grants micro-step 0 again
    p.on(F.MicrostepGranted(t=10.0, step=0, microstep=0, replica="c0", epoch=1))
    assert p.granted[0] == 1 and p.committed[0] == 0 and p.claimable(0) == 1 and not p.nothing_left(0)
    assert "c1" not in p.holding  # its grant died with the old epoch
    p.on(F.MicrostepCommitted(t=11.0, step=0, microstep=1, replica="c1", epoch=0))  # late, old epoch
    assert p.committed[0] == 0


def test_metrics_lines_written_before_the_kill_are_counted_and_a_torn_one_cut(tmp_path):
    """`handlers.resume.written`: each fact's line once by its identity (a step.completed a
    restarted core published again with other timings is the same line), `t` of the last
    line, and a line the kill tore off is cut so the resumed process appends clean lines."""
    from handlers.resume import line_key, written

    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b'{"t":1.5,"kind":"execution.finished","execution":"s0-g0-e0","status":"ok"}\n'
                     b'{"t":2.5,"kind":"step.completed","step":0,"loss":0.1,"phase_s":{"checkpoint":0.2}}\n'
                     b'{"t":3.0,"kind":"cell.switched","cell":"cell0"}\n{"t":3.5,"kind":"call.comp')
    counts, last_t = written(path)
    assert last_t == 3.0
    assert path.read_bytes().endswith(b'"cell0"}\n')
    assert counts[line_key({"kind": "step.completed", "step": 0, "loss": 0.1, "phase_s": {"checkpoint": 0.0}})] == 1
    assert counts[line_key({"kind": "execution.finished", "execution": "s0-g0-e0", "status": "ok"})] == 1
    assert line_key({"kind": "cell.switched", "cell": "cell0"}) in counts
    assert line_key({"kind": "cell.switched", "cell": "cell1"}) not in counts
    assert written(tmp_path / "absent.jsonl") == ({}, 0.0)
