"""Deterministic event ids (DESIGN.md "Event ids"): one id per fact."""
from __future__ import annotations


def dispatched(run: str, execution: str) -> str:
    return f"{run}:{execution}:dispatched"


def started(run: str, execution: str) -> str:
    return f"{run}:{execution}:started"


def finished(run: str, execution: str) -> str:
    return f"{run}:{execution}:finished"


def scored(run: str, execution: str, attempt: int) -> str:
    return f"{run}:{execution}:scored:{attempt}"


def call(run: str, execution: str, seq: int) -> str:
    return f"{run}:{execution}:call:{seq}"


def microstep(run: str, step: int, index: int) -> str:
    return f"{run}:step:{step}:mstep:{index}"


def sealed(run: str, step: int) -> str:
    return f"{run}:step:{step}:sealed"


def step_completed(run: str, step: int) -> str:
    return f"{run}:step:{step}:completed"


def route(run: str, seq: int) -> str:
    return f"{run}:route:{seq}"


def switch(run: str, cell: str, seq: int) -> str:
    return f"{run}:cell:{cell}:switch:{seq}"


def switched(run: str, cell: str, seq: int) -> str:
    return f"{run}:cell:{cell}:switched:{seq}"


def weights(run: str, version: int) -> str:
    return f"{run}:weights:{version}"
