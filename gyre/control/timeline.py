"""A run's cells over time, replayed from its `trace.jsonl`: the trace's facts fed through a
fresh policy of its mode (gyre.control.trace), giving each cell's role as the scheduler saw
it (`rollout`, `training`, `switching`), the micro-step grants it held, the water level and
the idle cell-seconds (the simulator's definitions, gyre.sim.cluster.SimResult). Read by
`gyre run`'s picture of the cells and by `gyre bench modes`' audit."""
from __future__ import annotations

import dataclasses

from gyre.control import facts as F
from gyre.control import trace as tr

STATES = ("rollout", "training", "switching")


@dataclasses.dataclass
class Replayed:
    """A run's trace replayed through a fresh policy of its mode."""

    head: dict
    cells: list[str]
    capacity: int
    segments: dict[str, list[tuple[float, float, str]]]
    """cell -> (start, end, state) with state `rollout`, `training` or `switching`."""
    busy: dict[str, list[tuple[float, float]]]
    """cell -> intervals it held a micro-step grant."""
    t: list[float]
    water_level: list[int]
    spare: list[int]
    """C_R(t) − C_e after each fact."""
    idle_cell_s: dict[str, float]
    window: tuple[float, float]
    """(first dispatch, last step completed) on the trace's clock."""
    commits: dict[str, int]
    dispatch_delays: list[float]
    switched: list[F.CellSwitched]
    """Role changes between rollout and training within the window."""
    step_ends: list[float]


def _state(policy, cell: str) -> str:
    if cell in policy.target:
        return "switching"
    role = policy.role[cell]
    return role if role in ("rollout", "training") else "idle"


def replay(lines: list[str]) -> Replayed:
    """Replay a trace (its lines) through a fresh policy. Raises ValueError on a file that is
    no gyre trace."""
    head, items = tr.read(lines)
    policy = tr.policy_from(head)
    cells = list(head["config"]["cells"])
    cap = int(head["config"]["capacity"])
    facts = [x for x in items if isinstance(x, F.Fact)]
    ends = [f.t for f in facts if isinstance(f, F.StepCompleted)]
    end = ends[-1] if ends else (facts[-1].t if facts else 0.0)
    segments: dict[str, list] = {c: [] for c in cells}
    busy: dict[str, list] = {c: [] for c in cells}
    state = {c: ("idle", 0.0) for c in cells}
    holding: dict[str, float] = {}
    t_s, water, spare = [], [], []
    idle = {s: 0.0 for s in STATES}
    rates = (0.0, 0.0, 0.0)
    start: float | None = None
    last = 0.0
    commits: dict[str, int] = {}
    dispatched: dict[str, float] = {}
    delays: list[float] = []
    switched: list[F.CellSwitched] = []
    for fact in facts:
        if start is not None and last < end:
            dt = min(fact.t, end) - last
            idle = {s: idle[s] + dt * r for s, r in zip(STATES, rates)}
        last = fact.t
        if isinstance(fact, F.MicrostepCommitted):
            commits[fact.replica] = commits.get(fact.replica, 0) + 1
        elif isinstance(fact, F.ExecutionStarted) and fact.execution in dispatched:
            delays.append(fact.t - dispatched.pop(fact.execution))
        elif (isinstance(fact, F.CellSwitched) and fact.t <= end
              and {fact.from_role, fact.to_role} == {"rollout", "training"}):
            switched.append(fact)
        for action in policy.on(fact):
            if isinstance(action, F.Dispatch):
                start = fact.t if start is None else start
                for placed in action.executions:
                    dispatched[placed.execution] = fact.t
        for c in cells:
            now = _state(policy, c)
            if now != state[c][0]:
                if state[c][0] != "idle" and fact.t > state[c][1]:
                    segments[c].append((state[c][1], fact.t, state[c][0]))
                state[c] = (now, fact.t)
            held = c in policy.holding and now == "training"
            if held and c not in holding:
                holding[c] = fact.t
            elif not held and c in holding:
                busy[c].append((holding.pop(c), fact.t))
        serving = [c for c in cells if policy.serving(c)]
        rates = (len(serving) - sum(len(policy.held[c]) for c in serving) / cap,
                 float(sum(1 for c in cells if policy.trainer(c) and c not in policy.holding)),
                 float(len(policy.target)))
        t_s.append(fact.t)
        water.append(policy.water_level)
        spare.append(policy.rollout_capacity - cap)
    for c in cells:
        if state[c][0] != "idle" and end > state[c][1]:
            segments[c].append((state[c][1], end, state[c][0]))
        if c in holding:
            busy[c].append((holding.pop(c), end))
    return Replayed(head=head, cells=cells, capacity=cap, segments=segments, busy=busy, t=t_s, water_level=water,
                    spare=spare, idle_cell_s={k: round(v, 3) for k, v in idle.items()},
                    window=(start or 0.0, end), commits=dict(sorted(commits.items())), dispatch_delays=delays,
                    switched=switched, step_ends=ends)
