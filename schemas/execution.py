"""Execution lifecycle events: dispatched → started → finished → scored.

Ids (DESIGN.md "Event ids"): `<run>:<execution>:dispatched`, `:started`, `:finished`,
`:scored:<attempt>`. `execution` ids are unique within a run, e.g. `s0-g1-e3`
(step 0, group 1, execution 3).
"""
from __future__ import annotations

import dataclasses
from typing import ClassVar, Literal

from schemas.base import Event, fail, register

FinishStatus = Literal["ok", "timeout", "harness_error", "no_workspace"]
ScoreOutcome = Literal["reward", "excluded", "placeholder"]


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ExecutionInfo:
    """Identity of one execution, repeated on each lifecycle event.

    execution: execution id, unique in the run.
    task: task id from the task set.
    group: group id, unique in the run (`s<step>-g<index>`); advantages normalise inside it.
    step: the burst (= training step) this execution belongs to.
    harness: harness profile name (`mini-swe-agent`, `claude-code`, `codex`, `generic`, `toy`).
    group_size: G, executions in this group.
    step_groups: groups in this step's burst.
    """

    execution: str
    task: str
    group: str
    step: int
    harness: str
    group_size: int
    step_groups: int


def _check_info(event, info: ExecutionInfo) -> None:
    if not info.execution:
        fail(event, "info", "execution id must be non-empty")
    if info.step < 0:
        fail(event, "info", "step must be >= 0")
    if info.group_size < 1 or info.step_groups < 1:
        fail(event, "info", "group_size and step_groups must be >= 1")


@register
@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ExecutionDispatched(Event):
    """Scheduler → runner (work queue): launch this execution.

    timeout_s: wall-clock limit of the harness process, seconds.
    max_calls: cap on model calls the proxy serves this execution (0 = no cap).
    cell: the rollout cell the scheduler placed it on ('' = not said); `route.updated`
      tells the proxy the same.
    """

    NAME: ClassVar[str] = "execution.dispatched"
    info: ExecutionInfo
    timeout_s: float
    max_calls: int = 0
    cell: str = ""

    def check(self) -> None:
        _check_info(self, self.info)
        if self.timeout_s <= 0:
            fail(self, "timeout_s", "must be > 0")


@register
@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ExecutionStarted(Event):
    """Runner: the harness process of an execution started.

    workspace: absolute path of the execution's workspace ('' if it never came up).
    """

    NAME: ClassVar[str] = "execution.started"
    info: ExecutionInfo
    workspace: str

    def check(self) -> None:
        _check_info(self, self.info)


@register
@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ExecutionFinished(Event):
    """Runner: the harness process ended.

    status: `ok` (exited by itself), `timeout` (killed at timeout_s), `harness_error`
      (could not start or crashed before running), `no_workspace` (workspace never came up).
    workspace: path of the preserved workspace ('' if none).
    exit_code: process exit code (negative = signal), None if it never started.
    duration_s: wall-clock seconds from start to end.
    """

    NAME: ClassVar[str] = "execution.finished"
    info: ExecutionInfo
    status: FinishStatus
    workspace: str
    exit_code: int | None = None
    duration_s: float = 0.0

    def check(self) -> None:
        _check_info(self, self.info)
        if self.duration_s < 0:
            fail(self, "duration_s", "must be >= 0")


@register
@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ExecutionScored(Event):
    """Evaluator (or an external reward service): the execution's reward.

    outcome: `reward` (reward in [0, 1] is set), `excluded` (evaluator failed past its
      retry budget; reason says why; the execution leaves its group), `placeholder`
      (nothing to evaluate; reward 0, counts in the group's mean/std, never trained).
    attempt: evaluation attempt number, from 0; part of the event id.
    tests_passed / tests_total: what the reward was computed from, when tests were run.
    """

    NAME: ClassVar[str] = "execution.scored"
    info: ExecutionInfo
    outcome: ScoreOutcome
    reward: float | None = None
    reason: str = ""
    attempt: int = 0
    tests_passed: int = 0
    tests_total: int = 0

    def check(self) -> None:
        _check_info(self, self.info)
        if self.outcome == "reward":
            if self.reward is None or not (0.0 <= self.reward <= 1.0):
                fail(self, "reward", "must be in [0, 1] when outcome is 'reward'")
        elif self.outcome == "placeholder":
            if self.reward not in (None, 0.0):
                fail(self, "reward", "a placeholder has reward 0")
        elif self.reward is not None:
            fail(self, "reward", "an excluded execution carries no reward")
