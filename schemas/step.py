"""Training events: micro-steps, step seal, weights, step completion.

Ids: `<run>:step:<k>:mstep:<i>`, `<run>:step:<k>:sealed`, `<run>:step:<k>:completed`,
`<run>:weights:<version>`.
"""
from __future__ import annotations

import dataclasses
from typing import ClassVar

from schemas.base import Event, fail, register


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class MicrostepExecution:
    """One execution inside a micro-step.

    execution: execution id. n_tokens: N_e, the execution's trainable tokens over all its
      kept trajectories (the whole step, not only this micro-step). advantage: A_e.
    """

    execution: str
    n_tokens: int
    advantage: float


@register
@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class MicrostepReady(Event):
    """Builder → trainers (work queue): a packed micro-batch is in the object store.

    key: object-store key of the packed micro-step (gyre.trajectory.microstep format).
    tokens: total token positions in the micro-step; trained: positions carrying loss.
    """

    NAME: ClassVar[str] = "microstep.ready"
    step: int
    microstep: int
    key: str
    executions: tuple[MicrostepExecution, ...]
    tokens: int
    trained: int
    trajectories: int

    def check(self) -> None:
        if self.step < 0 or self.microstep < 0:
            fail(self, "microstep", "step and micro-step index must be >= 0")


@register
@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class StepSealed(Event):
    """Builder: every micro-step of `step` has been announced.

    microsteps: number of micro-steps of the step. executions: |E| after exclusions
    (trained executions, placeholders not included). groups: groups in the step.
    zero_variance_groups: groups whose advantages are all 0.
    rewards: mean reward over scored executions of the step (placeholders count as 0).
    """

    NAME: ClassVar[str] = "step.sealed"
    step: int
    microsteps: int
    executions: int
    groups: int
    zero_variance_groups: int = 0
    excluded: int = 0
    reward_mean: float = 0.0


@register
@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class WeightsPublished(Event):
    """Core trainer: new weights for `policy_version` can be pulled from `path`.

    path: directory of an HF checkpoint (model.safetensors + config) readable by cells.
    """

    NAME: ClassVar[str] = "weights.published"
    policy_version: int
    step: int
    path: str


@register
@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class StepCompleted(Event):
    """Core trainer: the optimizer step of `step` was applied.

    loss: the GSPO loss (DESIGN.md "Learning"). grad_norm: global L2 norm before clipping.
    tokens: trained tokens. policy_version: version after the update (= step + 1).
    duration_s: seconds from the first claimed micro-step to the published weights.
    """

    NAME: ClassVar[str] = "step.completed"
    step: int
    loss: float
    grad_norm: float
    tokens: int
    executions: int
    policy_version: int
    duration_s: float = 0.0
    reward_mean: float = 0.0
