"""Training events: micro-steps, the core's ledger facts, step seal, weights, step completion.

Ids (schemas.ids): `<run>:step:<k>:mstep:<i>`, `<run>:step:<k>:sealed`,
`<run>:step:<k>:completed`, `<run>:weights:<version>:<epoch>`; the ledger's facts carry the
core's epoch: `<run>:core:<epoch>:step:<k>:mstep:<i>:granted:<n>`, `…:mstep:<i>:committed`,
`<run>:core:<epoch>:step:<k>:contribution:<replica>`, `<run>:core:<epoch>:step:<k>:failed`.
`microstep.claim` is a request (core NATS request/reply, never stored) answered by a
`ClaimReply`.
"""
from __future__ import annotations

import dataclasses
from typing import ClassVar, Literal

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
    """Builder → the core's ledger: a packed micro-batch is in the object store. Kept (event
    and payload) until its step completes; the ledger grants it to one replica at a time.

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
class MicrostepClaim(Event):
    """Replica → the core's ledger (request/reply, not stored): renew my grants, and (`want`)
    grant me a micro-step of the step being trained.

    replica: the cell asking. epoch, step: of the grants in `held` (-1: it holds none).
    held: micro-step ids granted to it under that epoch and step, accumulated and not yet
    returned (their leases are renewed; an id it does not list is released).
    """

    NAME: ClassVar[str] = "microstep.claim"
    replica: str
    epoch: int = -1
    step: int = -1
    held: tuple[int, ...] = ()
    want: bool = True


ClaimOutcome = Literal["granted", "renewed", "wait", "nothing_left", "lost", "failed", "refused"]


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ClaimReply:
    """The ledger's answer to a `microstep.claim` (encoded with `schemas.encode_part`).

    outcome: `granted` (microstep, key, lease_s, grant), `renewed`, `wait` (ask again later),
    `nothing_left` (sealed, and every micro-step is granted or committed), `lost` (ids in
    `lost` are no longer the replica's: its contribution can only be refused), `failed` (the
    step failed: reason), `refused` (the request was malformed: reason). epoch, step: the
    core's epoch and the step it trains. weights_key, weights_digest, weights_version: the
    transfer reference of the weights a replica trains the step on, and their policy version
    (= step). lease_s: seconds, None = no expiry. grant: the id's n-th grant.
    """

    outcome: ClaimOutcome
    epoch: int
    step: int
    microstep: int = -1
    key: str = ""
    lease_s: float | None = None
    grant: int = 0
    lost: tuple[int, ...] = ()
    reason: str = ""
    weights_key: str = ""
    weights_digest: str = ""
    weights_version: int = -1


@register
@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class MicrostepGranted(Event):
    """Core: the ledger granted micro-step `microstep` of `step` to `replica` (its `grant`-th
    grant in `epoch`), under a lease of `lease_s` seconds (None: the core's own, no expiry)."""

    NAME: ClassVar[str] = "microstep.granted"
    step: int
    microstep: int
    replica: str
    epoch: int
    grant: int
    lease_s: float | None = None


@register
@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class MicrostepCommitted(Event):
    """Core: micro-step `microstep` of `step` is counted, trained by `replica` (one fact per id
    and epoch; the ledger refuses a second commit)."""

    NAME: ClassVar[str] = "microstep.committed"
    step: int
    microstep: int
    replica: str
    epoch: int


@register
@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ContributionReturned(Event):
    """Replica → core: the gradient sum of `microsteps` (ids of `step`, granted under `epoch`)
    is exposed at transfer key `key` (manifest digest `digest`), before 1/|E|.

    metrics: the replica's `gyre.learning.metrics.StepMetrics.to_dict()` for those micro-steps.
    """

    NAME: ClassVar[str] = "contribution.returned"
    step: int
    epoch: int
    replica: str
    microsteps: tuple[int, ...]
    key: str
    digest: str
    metrics: dict = dataclasses.field(default_factory=dict)

    def check(self) -> None:
        if not self.microsteps:
            fail(self, "microsteps", "a contribution covers at least one micro-step")


@register
@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class StepFailed(Event):
    """Core: `step` cannot be trained under `epoch` (reason: e.g. micro-step `microstep` past
    its grant budget). Every daemon should treat the run as failed."""

    NAME: ClassVar[str] = "step.failed"
    step: int
    epoch: int
    reason: str
    microstep: int = -1


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
    """Core trainer: new weights for `policy_version` can be pulled from `path`, or through
    the transfer layer at `key` (manifest digest `digest`).

    path: directory of an HF checkpoint (model.safetensors + config) readable by cells.
    epoch: the core's epoch that published it (a restarted core publishes its version again).
    """

    NAME: ClassVar[str] = "weights.published"
    policy_version: int
    step: int
    path: str
    epoch: int = 0
    key: str = ""
    digest: str = ""


@register
@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class WeightsLoaded(Event):
    """Cell (an engine or a satellite): it pulled the snapshot of `policy_version` (manifest
    `digest`), verified every tensor against the manifest, and now serves (an engine) or
    trains on (a satellite) those weights. Never published for a transfer that failed,
    was short, timed out, was cancelled or did not verify.

    role: `rollout` (an engine) or `training` (a satellite). epoch: the core's epoch that
    published the version. verified: always true (the fact exists only after verification).
    """

    NAME: ClassVar[str] = "weights.loaded"
    cell: str
    policy_version: int
    epoch: int = 0
    digest: str = ""
    role: str = "rollout"
    verified: bool = True


@register
@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class StepCompleted(Event):
    """Core trainer: the optimizer step of `step` was applied (gyre.learning.metrics).

    loss: the GSPO loss (DESIGN.md "Learning"). grad_norm: global L2 norm before clipping.
    tokens: trained tokens. policy_version: version after the update (= step + 1).
    duration_s: seconds from the first claimed micro-step to the published weights.
    clip_fraction: trained tokens whose gradient the clip removed, fraction. ratio: the
    sequence ratios s_τ (`mean`, `std`, `min`, `max`). kl: k3 estimate of KL(π_old ‖ π_θ)
    per trained token. microsteps_per_replica: cell → micro-steps committed to it.
    staleness_histogram: staleness (string) → trained tokens. phase_s: seconds per phase
    (`waiting_for_grants`, `forward_backward`, `reduction`, `optimizer`, `checkpoint`).
    epoch: the core's epoch that trained it.
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
    microsteps: int = 0
    trajectories: int = 0
    clip_fraction: float = 0.0
    ratio: dict = dataclasses.field(default_factory=dict)
    kl: float = 0.0
    microsteps_per_replica: dict = dataclasses.field(default_factory=dict)
    staleness_histogram: dict = dataclasses.field(default_factory=dict)
    phase_s: dict = dataclasses.field(default_factory=dict)
    epoch: int = 0
