"""The trainer's settings that a recipe sets: the optimizer and the GSPO clip range.

Torch-free, so the recipe (`gyre.config.TrainSection`, the `[train]` table) composes
them without importing torch; `gyre.learning.trainer.TrainerConfig` extends them with
the settings no recipe sets. `__post_init__` raises ValueError naming the broken rule
(`<class>.<field> ...`).
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class TrainerSettings:
    """How one optimizer step updates the policy."""

    lr: float = 1e-3
    """AdamW learning rate, > 0."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay, >= 0 (0 = none)."""
    grad_clip: float = 1.0
    """Largest global L2 norm of the |E|-scaled gradient; a larger one is scaled down to it. > 0."""
    eps_low: float = 3e-4
    """GSPO clip range below 1: a ratio under 1 − eps_low is clipped (Zheng et al. 2025,
    arXiv:2507.18071, eq. 10-11; `gyre.learning.gspo`). In (0, 1)."""
    eps_high: float = 4e-4
    """GSPO clip range above 1: a ratio over 1 + eps_high is clipped. > 0."""

    def __post_init__(self) -> None:
        name = type(self).__name__
        if not self.lr > 0:  # NaN too: it compares false both ways
            raise ValueError(f"{name}.lr must be > 0, got {self.lr}")
        if self.weight_decay < 0:
            raise ValueError(f"{name}.weight_decay must be >= 0, got {self.weight_decay}")
        if not self.grad_clip > 0:
            raise ValueError(f"{name}.grad_clip must be > 0, got {self.grad_clip}")
        if not (0 < self.eps_low < 1 and self.eps_high > 0):
            raise ValueError(f"{name}.eps_low must be in (0, 1) and eps_high > 0, got {self.eps_low}, {self.eps_high}")
