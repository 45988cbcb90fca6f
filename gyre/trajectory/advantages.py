"""Group-relative advantages (DESIGN.md "Learning" and "Trajectory processing").

    A_e = (R_e − mean_g R) / std_g R        over the group's remaining executions, ddof = 1

- An execution whose reward is None was *excluded* (evaluator failed past its budget): it
  leaves the group and gets no advantage.
- A *placeholder* (nothing to evaluate) counts in the mean and std with reward 0 but has no
  tokens and is not trained, so it gets no advantage entry either.
- A = 0 for every execution of a group with fewer than two remaining executions, or whose
  std is below `MIN_STD`.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

MIN_STD = 1e-6


def group_advantages(rewards: Mapping[str, float | None], placeholders: Iterable[str] = ()) -> dict[str, float]:
    """Advantages of one group's trained executions.

    rewards: execution id → reward in [0, 1], or None when excluded. Placeholders may be
      listed here too (any value) or only in `placeholders`.
    placeholders: execution ids that count with reward 0 and are never trained.
    Returns execution id → A_e for every execution with a reward that is not a placeholder.
    Raises ValueError on a non-finite reward.
    """
    holders = set(placeholders)
    remaining: dict[str, float] = {}
    for execution, reward in rewards.items():
        if execution in holders or reward is None:
            continue
        if not math.isfinite(reward):
            raise ValueError(f"reward of execution {execution!r} is not finite: {reward!r}")
        remaining[execution] = float(reward)
    values = list(remaining.values()) + [0.0] * len(holders)
    n = len(values)
    if n < 2:
        return {e: 0.0 for e in remaining}
    mean = sum(values) / n
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    if std < MIN_STD:
        return {e: 0.0 for e in remaining}
    return {e: (r - mean) / std for e, r in remaining.items()}
