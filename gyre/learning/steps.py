"""The core's apply-and-save sequence of a step; pure, the cell runs it in a worker thread.

`apply_step(trainer, executions, weights_dir, extra)` applies the gradient accumulated for
the step (dividing by |E| = max(executions, 1): a step whose executions were all excluded
still advances the version; DESIGN.md "Learning"), then writes the checkpoint of the new
version (`weights_dir/v<version>/`, gyre.learning.checkpoint) before anything announces it.
Which step may be applied, and when, is the ledger's (gyre.learning.ledger).
"""
from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:  # the trainer imports torch; this module does not need to
    from gyre.learning.trainer import StepStats, Trainer


@dataclasses.dataclass(frozen=True, slots=True)
class AppliedStep:
    """One applied step: the trainer's stats, the policy version it made, where its checkpoint
    is, and the seconds the optimizer step and the checkpoint took."""

    stats: StepStats
    policy_version: int
    path: Path
    optimizer_s: float
    checkpoint_s: float


def weights_path(weights_dir: Path, policy_version: int) -> Path:
    """Where the weights of `policy_version` are written: `weights_dir/v<version>`."""
    return Path(weights_dir) / f"v{policy_version}"


def apply_step(trainer: Trainer, executions: int, weights_dir: Path,
               extra: dict | Callable[[StepStats, float], dict] | None = None) -> AppliedStep:
    """Apply the step accumulated in `trainer` and checkpoint the new version (module
    docstring). extra: kept in the checkpoint's state; a callable gets the step's stats and
    the optimizer's seconds and returns it. Blocking. Raises what `Trainer.apply` and
    `checkpoint.save` raise (ValueError, OSError)."""
    from gyre.learning import checkpoint

    t0 = time.perf_counter()
    stats = trainer.apply(max(executions, 1))
    t1 = time.perf_counter()
    path = checkpoint.save(trainer, weights_dir, extra(stats, t1 - t0) if callable(extra) else extra)
    return AppliedStep(stats=stats, policy_version=trainer.policy_version, path=path, optimizer_s=t1 - t0,
                       checkpoint_s=time.perf_counter() - t1)
