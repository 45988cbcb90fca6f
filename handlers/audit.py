"""The crash audit: did a run lose or double-count anything? (issue 52; `gyre bench chaos`).

`audit(bus, run_dir, answered=None)` reads the run's retained streams and its run directory
once the run is over (or at any moment: it counts what is there) and returns `Audit`:

- `calls_answered`: calls the harnesses got an answer to, counted on the client side:
  `answered` (execution → calls) when given, else `answered_calls(run_dir)`, the toy
  harness's own lines in `logs/executions/<execution>.log`; `calls_recorded`: distinct
  `call.completed` call ids stored; `calls_lost`: per execution, answered minus recorded
  (never below 0), summed.
- `samples_duplicated`: a micro-step (step, index) announced more than once (`microstep.ready`
  stored twice, whatever its id), an execution packed
  into micro-steps of two steps, and a trajectory (execution, leaf call) packed twice into
  the micro-steps of one step (read from the object store where the payload is still there).
- `microsteps_double_counted`: a micro-step (epoch, step, index) committed more than once, and per
  completed step the micro-steps its `step.completed` says it trained beyond what its
  `step.sealed` announced; a step whose `step.completed` events disagree (it was applied
  twice with different results) counts all its micro-steps.
- `executions_dispatched_twice`: executions the scheduler routed for dispatch more than once
  (`route.updated`, reason `dispatch`) or whose harness the runner launched more than once
  (`runner.harness.started` in the runner's log, `logs/runner*.log`).
- `steps_completed`: distinct steps with a `step.completed`; `steps_sealed` likewise.
A run that lost nothing and counted nothing twice has every loss or duplication count 0.
"""
from __future__ import annotations

import collections
import dataclasses
import re
from pathlib import Path

import orjson

import schemas
from bus import Bus
from gyre.trajectory.microstep import from_bytes

NAMES = (schemas.CallCompleted.NAME, schemas.MicrostepReady.NAME, schemas.MicrostepCommitted.NAME,
         schemas.StepSealed.NAME, schemas.StepCompleted.NAME, schemas.RouteUpdated.NAME)
_TOY_CALL = re.compile(r"^toy_harness: call (\d+): ", re.MULTILINE)


@dataclasses.dataclass(frozen=True, slots=True)
class Audit:
    calls_answered: int
    calls_recorded: int
    calls_lost: int
    samples_duplicated: int
    microsteps_double_counted: int
    executions_dispatched_twice: int
    steps_sealed: int
    steps_completed: int
    details: dict = dataclasses.field(default_factory=dict)
    """Which ids each count came from (for a failure message)."""

    def clean(self) -> bool:
        return not (self.calls_lost or self.samples_duplicated or self.microsteps_double_counted
                    or self.executions_dispatched_twice)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def answered_calls(run_dir: Path) -> dict[str, int]:
    """execution → calls answered to its toy harness (its `toy_harness: call N:` lines)."""
    out = {}
    for path in sorted((Path(run_dir) / "logs" / "executions").glob("*.log")):
        out[path.stem] = len(set(_TOY_CALL.findall(path.read_text(errors="replace"))))
    return out


def harness_launches(run_dir: Path) -> collections.Counter:
    """execution → times a runner of the run launched its harness (the runners' logs)."""
    launches: collections.Counter = collections.Counter()
    for path in sorted((Path(run_dir) / "logs").glob("runner*.log")):
        for line in path.read_bytes().splitlines():
            if b"runner.harness.started" not in line:
                continue
            try:
                launches[orjson.loads(line)["execution"]] += 1
            except (orjson.JSONDecodeError, KeyError, TypeError):
                continue
    return launches


async def audit(bus: Bus, run_dir: Path, answered: dict[str, int] | None = None) -> Audit:
    events = await bus.stored_events(NAMES)
    by_kind: dict[type, list] = collections.defaultdict(list)
    for e in events:
        by_kind[type(e)].append(e)
    details: dict = {}

    # calls
    recorded: dict[str, set[str]] = collections.defaultdict(set)
    for c in by_kind[schemas.CallCompleted]:
        recorded[c.execution].add(c.call)
    answered = answered_calls(run_dir) if answered is None else answered
    lost = {e: n - len(recorded.get(e, ())) for e, n in answered.items() if n > len(recorded.get(e, ()))}
    details["calls_lost"] = lost

    # samples
    ready = by_kind[schemas.MicrostepReady]
    ids = collections.Counter(f"{e.step}:{e.microstep}" for e in ready)
    dup_ids = {i: n - 1 for i, n in ids.items() if n > 1}
    steps_of: dict[str, set[int]] = collections.defaultdict(set)
    latest: dict[tuple[int, int], schemas.MicrostepReady] = {}
    for e in ready:
        latest[(e.step, e.microstep)] = e
        for x in e.executions:
            steps_of[x.execution].add(e.step)
    two_steps = {e: sorted(s) for e, s in steps_of.items() if len(s) > 1}
    seen: collections.Counter = collections.Counter()
    unread = 0
    for (step, _i), e in sorted(latest.items()):
        try:
            ms = from_bytes(await bus.get_object(e.key))
        except KeyError:
            unread += 1
            continue
        for t in range(ms.n_trajectories):
            seen[(step, ms.executions[ms.traj_execution[t]], ms.leaves[t])] += 1
    twice = {f"{s}:{e}:{leaf}": n - 1 for (s, e, leaf), n in seen.items() if n > 1}
    details.update(microsteps_ready_repeated=dup_ids, executions_in_two_steps=two_steps,
                   trajectories_packed_twice=twice, microstep_payloads_unread=unread)
    samples_duplicated = sum(dup_ids.values()) + len(two_steps) + sum(twice.values())

    # micro-steps
    committed = collections.Counter(f"{e.epoch}:{e.step}:{e.microstep}" for e in by_kind[schemas.MicrostepCommitted])
    dup_commits = {i: n - 1 for i, n in committed.items() if n > 1}
    sealed = {e.step: e for e in by_kind[schemas.StepSealed]}
    completed: dict[int, list[schemas.StepCompleted]] = collections.defaultdict(list)
    for e in by_kind[schemas.StepCompleted]:
        completed[e.step].append(e)
    over: dict[int, int] = {}
    for step, es in completed.items():
        announced = sealed[step].microsteps if step in sealed else 0
        if len({(e.loss, e.grad_norm, e.tokens) for e in es}) > 1:
            over[step] = max(announced, max(e.microsteps for e in es))
            continue
        trained = max(sum(e.microsteps_per_replica.values()) if e.microsteps_per_replica else e.microsteps
                      for e in es)
        if trained > announced:
            over[step] = trained - announced
    details.update(microsteps_committed_repeated=dup_commits, microsteps_over_sealed=over)

    # dispatches
    routed: collections.Counter = collections.Counter()
    for e in by_kind[schemas.RouteUpdated]:
        for r in e.routes:
            if r.reason == "dispatch":
                routed[r.execution] += 1
    launches = harness_launches(run_dir)
    twice_dispatched = sorted({e for e, n in routed.items() if n > 1} | {e for e, n in launches.items() if n > 1})
    details["executions_dispatched_twice"] = twice_dispatched
    details["executions_dispatched"] = len(routed)
    details["harnesses_launched"] = sum(launches.values())

    return Audit(calls_answered=sum(answered.values()), calls_recorded=sum(len(v) for v in recorded.values()),
                 calls_lost=sum(lost.values()), samples_duplicated=samples_duplicated,
                 microsteps_double_counted=sum(dup_commits.values()) + sum(over.values()),
                 executions_dispatched_twice=len(twice_dispatched), steps_sealed=len(sealed),
                 steps_completed=len(completed), details=details)
