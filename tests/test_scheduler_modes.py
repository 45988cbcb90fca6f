"""Every scheduling mode on the real daemons: `gyre run toy --set run.mode=M` on two cells
(every daemon a process, a real nats-server), and what each mode's `trace.jsonl` shows.

- elastic: cells leave rollout by the water level (w ≤ C_R − C_e, recomputed here from the
  trace's own lines), and a fresh policy fed the trace's facts takes exactly the actions
  the daemon published on the bus (read back from the run's streams); with a backlog and
  long calls, a switch moves the executions the leaving cell serves;
- async: the training cells leave rollout once, at the start, and nothing switches after;
  nothing is dispatched to a training cell (nonstreaming: a step is opened once sealed);
- colocate (and overlapped): every switch moves every cell, the cells not between roles
  always hold the same role, and executions are dispatched only while every cell is in
  rollout.

Every mode's trace replays: a fresh policy of its mode fed the trace's facts takes exactly
the trace's actions.

Elastic and async run by default (about a minute each on 2 cores); the other three, and the
elastic run whose switch moves executions, are slow.
"""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import schemas
from bus import Bus
from gyre.control import trace

ROOT = Path(__file__).resolve().parents[1]
CELLS = ("cell0", "cell1")
C_E = 2
SETTINGS = ("cells.count=2", "tasks.group_size=2")


def gyre_run(tmp_path: Path, server, mode: str, steps: int = 2, groups: int = 2, capacity: int = C_E,
             extra: tuple[str, ...] = ()) -> tuple[Path, list[dict]]:
    runs = tmp_path / "runs"
    env = dict(os.environ, GYRE_RUNS_DIR=str(runs), GYRE_NATS_URL=server.url, GYRE_NATS_TOKEN=server.token,
               HF_HUB_OFFLINE="1")
    run_id = f"m-{mode.replace('_', '-')}"
    argv = [sys.executable, "-m", "handlers.cli", "run", "toy", "--run-id", run_id, "--timeout", "300",
            "--set", f"run.mode={mode}", "--set", f"run.steps={steps}"]
    for s in (*SETTINGS, f"cells.capacity={capacity}", f"tasks.groups_per_step={groups}", *extra):
        argv += ["--set", s]
    proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=420)
    run_dir = runs / run_id
    logs = "".join(f"\n--- {p.name}\n{p.read_text(errors='replace')[-1500:]}"
                   for p in sorted((run_dir / "logs").glob("*.log"))) if (run_dir / "logs").exists() else ""
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:] + logs
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == steps and summary["executions"] == 2 * groups * steps, summary
    lines = [json.loads(line) for line in (run_dir / "trace.jsonl").read_text().splitlines()]
    assert lines[0]["mode"] == mode and lines[0]["config"]["cells"] == list(CELLS)
    assert lines[0]["config"]["capacity"] == capacity
    # every execution of both bursts dispatched exactly once, each to a cell
    placed = [x for a in actions(lines, "dispatch") for x in a["executions"]]
    assert sorted(x[0] for x in placed) == sorted(f"s{k}-g{g}-e{i}" for k in range(steps) for g in range(groups)
                                                  for i in (0, 1))
    assert actions(lines, "done") == [{"t": actions(lines, "done")[0]["t"], "action": "done", "steps": steps}]
    # a fresh policy of the mode fed the trace's facts takes exactly the trace's actions
    with open(run_dir / "trace.jsonl") as f:
        assert trace.replay(f) == []
    return run_dir, lines


def actions(lines: list[dict], kind: str) -> list[dict]:
    return [x for x in lines if x.get("action") == kind]


def blocks(lines: list[dict]) -> list[tuple[dict, list[dict]]]:
    """(fact, the actions it led to) in order."""
    out: list[tuple[dict, list[dict]]] = []
    for x in lines[1:]:
        if "fact" in x:
            out.append((x, []))
        else:
            assert out, "an action before any fact"  # actions follow the fact that led to them
            out[-1][1].append(x)
    return out


async def published(server, run: str) -> tuple[list[schemas.CellSwitch], list[schemas.RouteUpdated]]:
    """What the scheduler published on the bus: every `cell.switch` and `route.updated`."""
    bus = await Bus.connect(server.url, token=server.token, run=run, name="check")
    got: list = []
    stop, caught = asyncio.Event(), asyncio.Event()

    async def on(event):
        got.append(event)

    task = asyncio.create_task(bus.replay([schemas.CellSwitch.NAME, schemas.RouteUpdated.NAME], on, stop=stop,
                                          caught_up=caught))
    await asyncio.wait_for(caught.wait(), 30)
    stop.set()
    await task
    await bus.close()
    return ([e for e in got if isinstance(e, schemas.CellSwitch)],
            [e for e in got if isinstance(e, schemas.RouteUpdated)])


def test_elastic_switches_by_the_water_level_and_its_trace_replays_to_the_published_actions(tmp_path, nats_server):
    """Two groups of two short executions per step on 2 × 2 slots: every execution has
    finished before the first micro-step can be claimed (scoring and building take longer
    than a toy execution), so a cell leaves rollout holding none and nothing is moved; the
    test below makes the executions outlast that."""
    run_dir, lines = gyre_run(tmp_path, nats_server, "elastic")
    check_elastic(nats_server, run_dir, lines)


@pytest.mark.slow
def test_elastic_moves_the_executions_of_a_cell_that_leaves_rollout(tmp_path, nats_server):
    """Three groups per step on 2 × 3 slots and calls of 256 tokens (the recipe's
    `sampling.max_tokens`; the toy's 16 otherwise): executions outlast the scoring and
    building of the first groups, so cell0 leaves rollout by the water level once at most
    C_e = 3 executions are left, and it serves some of them unless all three are cell1's;
    the switch moves them (a `route` action, the
    `route.updated` the switch names). Each moved execution was dispatched once and finished
    once (ok), and the trace still replays to the daemon's actions."""
    run_dir, lines = gyre_run(tmp_path, nats_server, "elastic", groups=3, capacity=3,
                              extra=("sampling.max_tokens=256",))
    moving = check_elastic(nats_server, run_dir, lines, c_e=3)
    assert moving, [a for a in lines if a.get("action") in ("switch", "route")]
    moved = [r.execution for e in moving for r in e.routes]
    finished = [(x["execution"], x.get("status", "ok")) for x in lines if x.get("fact") == "execution.finished"]
    for x in moved:  # finished once, ok: its harness went on at the new cell
        assert [f for f in finished if f[0] == x] == [(x, "ok")], (x, finished)
    placed = [x[0] for a in actions(lines, "dispatch") for x in a["executions"]]
    assert all(placed.count(x) == 1 for x in moved), placed
    # a moved execution goes to the cell that stays in rollout, never back to the one leaving
    for e in moving:
        leaving = e.routes[0].reason.split(" to ")[0]
        assert all(r.cell != leaving for r in e.routes), e


def check_elastic(nats_server, run_dir: Path, lines: list[dict], c_e: int = C_E) -> list[schemas.RouteUpdated]:
    """The elastic run's checks (module docstring); returns the `route.updated` events that
    moved executions off a switching cell."""
    # The trace replays to its own actions (gyre_run), and they are exactly what the daemon
    # published, in order.
    switches, routes = asyncio.run(published(nats_server, run_dir.name))
    traced_switches = actions(lines, "switch")
    assert [(e.cell, e.from_role, e.to_role, e.reason, e.step) for e in switches] == [
        (a["cell"], a["from_role"], a["to_role"], a["reason"], a["step"]) for a in traced_switches]
    traced_routes = [a for a in lines if a.get("action") in ("dispatch", "route")]
    assert [e.seq for e in routes] == list(range(len(traced_routes)))
    assert [[(r.execution, r.cell) for r in e.routes] for e in routes] == [
        [(x[0], x[2]) for x in a["executions"]] if a["action"] == "dispatch" else [tuple(r) for r in a["routes"]]
        for a in traced_routes]
    # A switch carries the reroute published just before it (the executions it moves, whose
    # KV blocks the cell hands to their new cells).
    for e in switches:
        if e.route_seq >= 0:
            assert e.moved == routes[e.route_seq].routes and e.moved[0].reason.startswith(f"{e.cell} to "), e
    moving = [e for e in routes if e.routes[0].reason.startswith("cell")]
    assert sorted(e.seq for e in moving) == sorted(e.route_seq for e in switches if e.route_seq >= 0)

    # Cells left rollout by the water level: at each such switch, recomputed from the trace's
    # own lines, w(t) = dispatched − finished ≤ C_R(t) − C_e over the cells serving then.
    role = {c: "idle" for c in CELLS}
    switching: set[str] = set()
    d = f = 0
    to_training = 0
    for fact, taken in blocks(lines):
        if fact["fact"] == "execution.finished":
            f += 1
        elif fact["fact"] == "cell.switched":
            role[fact["cell"]] = fact["to_role"]
            switching.discard(fact["cell"])
        for a in taken:
            if a["action"] == "dispatch":
                d += len(a["executions"])
            elif a["action"] == "switch":
                if a["to_role"] == "training":
                    assert a["reason"] == "water level"
                    serving = [c for c in CELLS if role[c] == "rollout" and c not in switching]
                    assert a["cell"] in serving
                    assert d - f <= c_e * len(serving) - c_e, (fact, a, d, f, serving)
                    to_training += 1
                switching.add(a["cell"])
    assert to_training >= 1
    assert traced_switches[0]["cell"] == "cell0"  # the core first
    return moving


def check_async(lines: list[dict], streaming: bool) -> None:
    """The split: cell0 trains, cell1 rolls out; the one switch is cell0's, when it announces
    itself, until the run is done and cell0 returns to serve the last version."""
    switches = actions(lines, "switch")
    assert [(a["cell"], a["to_role"], a["reason"]) for a in switches[1:]] == [("cell0", "rollout", "run done")]
    ending = next(taken for _, taken in blocks(lines) if any(a["action"] == "done" for a in taken))
    assert [a["action"] for a in ending] == ["switch", "done"] and ending[0] == switches[1]
    switches = switches[:1]
    assert [(a["cell"], a["from_role"], a["to_role"], a["reason"]) for a in switches] == [
        ("cell0", "rollout", "training", "async split")]
    # cell0 leaves rollout as soon as it announces itself, holding nothing
    announce = next(b for b in blocks(lines) if b[0].get("fact") == "cell.switched" and b[0]["cell"] == "cell0")
    assert switches[0] in announce[1]
    assert {x[2] for a in actions(lines, "dispatch") for x in a["executions"]} == {"cell1"}
    switched = [x for x in lines if x.get("fact") == "cell.switched" and x["from_role"] != "idle"]
    assert [(x["cell"], x["to_role"]) for x in switched][:1] == [("cell0", "training")]
    assert [(x["cell"], x["to_role"]) for x in switched[1:]] in ([], [("cell0", "rollout")])  # the run-done return
    if not streaming:  # a step is opened only once sealed
        for fact, taken in blocks(lines):
            for a in taken:
                if a["action"] == "open":
                    sealed = [x for x in lines[:lines.index(fact) + 1]
                              if x.get("fact") == "step.sealed" and x["step"] == a["step"]]
                    assert sealed, a


def test_async_keeps_its_split_and_never_switches_again(tmp_path, nats_server):
    """Three steps: burst 2 waits for the rollout cell to load v1 (S = 1), which it does while
    serving, without a switch; the scheduler learns it from `weights.loaded`."""
    _, lines = gyre_run(tmp_path, nats_server, "async", steps=3)
    loaded = [x for x in lines if x.get("fact") == "weights.loaded" and x["version"] >= 1]
    assert loaded and loaded[0]["engine"] == "cell1", loaded
    check_async(lines, streaming=True)


@pytest.mark.slow
def test_async_nonstreaming_keeps_its_split_and_opens_a_step_once_sealed(tmp_path, nats_server):
    _, lines = gyre_run(tmp_path, nats_server, "async_nonstreaming")
    check_async(lines, streaming=False)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["colocate", "colocate_overlapped"])
def test_colocate_keeps_every_cell_in_one_role(tmp_path, nats_server, mode):
    _, lines = gyre_run(tmp_path, nats_server, mode)
    role = {c: "idle" for c in CELLS}
    switching: set[str] = set()
    directions = []
    for fact, taken in blocks(lines):
        if fact["fact"] == "cell.switched":
            role[fact["cell"]] = fact["to_role"]
            switching.discard(fact["cell"])
        # all cells in one role at a time: the cells not between roles hold the same one
        settled = {role[c] for c in CELLS if c not in switching and role[c] != "idle"}
        assert len(settled) <= 1, (fact, role, switching)
        switches = [a for a in taken if a["action"] == "switch"]
        switching |= {a["cell"] for a in switches}
        if switches:  # every switch moves every cell, the same way
            assert sorted(a["cell"] for a in switches) == list(CELLS)
            assert len({a["to_role"] for a in switches}) == 1
            directions.append(switches[0]["to_role"])
        for a in taken:
            if a["action"] == "dispatch":
                assert set(role.values()) == {"rollout"}, (fact, role)
    # one training phase per step (colocate_overlapped: one for both steps S = 1 lets it roll out)
    phases = 2 if mode == "colocate" else 1
    assert directions == ["training", "rollout"] * phases  # the last return: the run is done
