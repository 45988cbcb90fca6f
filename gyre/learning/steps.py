"""A trainer replica's steps: which step is ready to apply, and the apply-and-save sequence.

Pure bookkeeping, no asyncio and no bus: the cell (handlers/cell.py) tells `StepAccounts`
what it received, asks it whether a step is ready, runs `apply_step` (in a worker
thread) and publishes the outcome.

- A step is *sealed* once the builder's `step.sealed` for it arrived; the seal names the
  step's micro-steps (`microsteps`) and |E| (`executions`).
- A micro-step is *counted* for its step each time one delivered `microstep.ready` has been
  accumulated into the trainer; a redelivered micro-step counts again.
- Step k is *applied* once the trainer's policy version is above k (applying step k makes
  version k + 1); it is *ready* when it is sealed, at least its sealed number of
  micro-steps were counted, and it is not applied.
- A step's duration runs from the arrival of its first micro-step to now (0 for a step
  without micro-steps), seconds on the caller's monotonic clock.

`apply_step(trainer, executions, weights_dir)` applies the accumulated step (dividing by
|E|, at least 1) and saves the new weights as `weights_dir/v<version>`.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING

from schemas import StepSealed

if TYPE_CHECKING:  # the trainer imports torch; this module does not need to
    from gyre.learning.trainer import StepStats, Trainer


@dataclasses.dataclass
class StepAccounts:
    """Sealed steps, counted micro-steps and step start times of one trainer replica."""

    sealed: dict[int, StepSealed] = dataclasses.field(default_factory=dict)
    """step → its seal."""
    counted: dict[int, int] = dataclasses.field(default_factory=dict)
    """step → micro-steps counted (deliveries accumulated)."""
    started: dict[int, float] = dataclasses.field(default_factory=dict)
    """step → arrival time of its first micro-step, seconds (the caller's monotonic clock)."""

    def microstep_arrived(self, step: int, now: float) -> None:
        """A micro-step of `step` arrived at `now`; the first one starts the step's clock."""
        self.started.setdefault(step, now)

    def microstep_counted(self, step: int) -> None:
        """One micro-step of `step` was accumulated into the trainer."""
        self.counted[step] = self.counted.get(step, 0) + 1

    def seal(self, sealed: StepSealed) -> None:
        """File the builder's seal of `sealed.step` (a later seal of the same step replaces it)."""
        self.sealed[sealed.step] = sealed

    def sealed_steps(self) -> list[int]:
        """The sealed steps, ascending (the order to try them in)."""
        return sorted(self.sealed)

    def ready(self, step: int, policy_version: int) -> StepSealed | None:
        """The seal of `step` when the step is ready to apply on a trainer at
        `policy_version`, else None (not sealed, micro-steps missing, or already applied)."""
        sealed = self.sealed.get(step)
        if sealed is None or self.counted.get(step, 0) < sealed.microsteps:
            return None
        if applied(step, policy_version):
            return None
        return sealed

    def duration_s(self, step: int, now: float) -> float:
        """Seconds from the first micro-step of `step` to `now`; 0 when none arrived."""
        return now - self.started.get(step, now)


def applied(step: int, policy_version: int) -> bool:
    """Whether a trainer at `policy_version` has applied `step` (step k makes version k + 1)."""
    return policy_version > step


@dataclasses.dataclass(frozen=True, slots=True)
class AppliedStep:
    """One applied step: the trainer's stats, the policy version it made, where its weights are."""

    stats: StepStats
    policy_version: int
    path: Path


def weights_path(weights_dir: Path, policy_version: int) -> Path:
    """Where the weights of `policy_version` are written: `weights_dir/v<version>`."""
    return Path(weights_dir) / f"v{policy_version}"


def apply_step(trainer: Trainer, executions: int, weights_dir: Path) -> AppliedStep:
    """Apply the step accumulated in `trainer` with |E| = max(executions, 1) (a step whose
    executions were all excluded still advances the version) and save the new weights.
    Blocking (an optimizer step and a checkpoint write): run it in a worker thread.
    Raises what `Trainer.apply` and `Trainer.save` raise (ValueError, OSError)."""
    stats = trainer.apply(max(executions, 1))
    version = trainer.policy_version
    path = weights_path(weights_dir, version)
    trainer.save(path)
    return AppliedStep(stats=stats, policy_version=version, path=path)
