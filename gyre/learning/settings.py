"""The trainer's settings that a recipe sets: the optimizer, the GSPO clip range, the
parameters' dtype, and how the core's ledger grants micro-steps to replicas.

Torch-free, so the recipe (`gyre.config.TrainSection`, the `[train]` table) composes
them without importing torch; `gyre.learning.trainer.TrainerConfig` extends them with
the settings no recipe sets. `__post_init__` raises ValueError naming the broken rule
(`<class>.<field> ...`).
"""
from __future__ import annotations

import dataclasses
from typing import Literal


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class TrainerSettings:
    """How one optimizer step updates the policy, and how replicas share a step."""

    lr: float = 1e-3
    """AdamW learning rate, >= 0 (0 = a control run: the policy never changes)."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay, >= 0 (0 = none)."""
    adam_eps: float = 1e-8
    """AdamW denominator epsilon, > 0. A coordinate whose gradient is far below it moves by
    far less than the learning rate (on a large vocabulary, the output rows of tokens the
    policy never samples)."""
    grad_clip: float = 1.0
    """Largest global L2 norm of the |E|-scaled gradient; a larger one is scaled down to it. > 0."""
    eps_low: float = 3e-4
    """GSPO clip range below 1: a ratio under 1 − eps_low is clipped (Zheng et al. 2025,
    arXiv:2507.18071, eq. 10-11; `gyre.learning.gspo`). In (0, 1)."""
    eps_high: float = 4e-4
    """GSPO clip range above 1: a ratio over 1 + eps_high is clipped. > 0."""
    dtype: Literal["float32", "float64"] = "float32"
    """Dtype of the trainer's parameters, gradients and optimizer state (`float32`, or `float64`
    where replicas must agree to 1e-8)."""
    lease_s: float = 30.0
    """Seconds a micro-step's grant lasts without renewal (DESIGN.md "Training exactly once");
    a replica renews its grants while it holds them. > 0."""
    grant_budget: int = 3
    """Grants one micro-step may get in one core epoch; one more fails its step loudly
    (`step.failed`). >= 1."""
    device_time_s: float = 0.0
    """Emulated device time of one micro-step, seconds (`gyre bench modes`): a replica waits
    before each micro-step's forward-backward what the previous one's forward-backward left of
    it, so a micro-step lasts about max(device_time_s, its forward-backward); 0 = none. >= 0."""

    def __post_init__(self) -> None:
        name = type(self).__name__
        if not self.lr >= 0:  # NaN too: it compares false both ways
            raise ValueError(f"{name}.lr must be >= 0, got {self.lr}")
        if self.weight_decay < 0:
            raise ValueError(f"{name}.weight_decay must be >= 0, got {self.weight_decay}")
        if not self.adam_eps > 0:
            raise ValueError(f"{name}.adam_eps must be > 0, got {self.adam_eps}")
        if not self.grad_clip > 0:
            raise ValueError(f"{name}.grad_clip must be > 0, got {self.grad_clip}")
        if self.dtype not in ("float32", "float64"):
            raise ValueError(f"{name}.dtype must be 'float32' or 'float64', got {self.dtype!r}")
        if not self.lease_s > 0:
            raise ValueError(f"{name}.lease_s must be > 0, got {self.lease_s}")
        if self.grant_budget < 1:
            raise ValueError(f"{name}.grant_budget must be >= 1, got {self.grant_budget}")
        if not self.device_time_s >= 0:
            raise ValueError(f"{name}.device_time_s must be >= 0, got {self.device_time_s}")
        if not (0 < self.eps_low < 1 and self.eps_high > 0):
            raise ValueError(f"{name}.eps_low must be in (0, 1) and eps_high > 0, got {self.eps_low}, {self.eps_high}")
