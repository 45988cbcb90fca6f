"""The step ledger: which micro-steps of the step being trained are granted, to whom, and
which are committed (DESIGN.md "Training exactly once").

Pure bookkeeping kept by the core (no torch, no asyncio, no bus); the caller passes the
clock (`now`: seconds on one monotonic clock) and publishes the facts it returns.

- The ledger trains one step at a time, `step` (= the core's policy version: step k
  turns v_k into v_{k+1}), under the core's `epoch` (raised at every core start). Facts
  of another epoch count for nothing.
- `announce` files a `microstep.ready` (any step; a step below `step` is ignored), `seal`
  a `step.sealed` (the number of micro-steps N and |E|). Both are idempotent.
- `claim(replica, held, now)` is a replica's request: it first renews the leases of the
  micro-steps the replica says it `held` (ids of this step and epoch it was granted and has
  not seen counted: accumulated, or returned in a contribution the core may not have
  handled yet; an id already committed to it is simply acknowledged); a grant the replica
  does not list is one it never learnt of (a lost reply) and is released. If any listed id is no longer the replica's (its lease expired
  and the id was granted to another, or it was released), the answer is `Lost`: the
  replica's contribution could only be refused, so its other grants are released at once
  and it must drop what it accumulated. Otherwise, with `want`, the lowest-numbered
  micro-step of `step` that is announced, not committed and not held under a live lease
  by another replica is granted (`Granted`, one holder at a time); else the answer is
  `Wait` (not sealed yet, or an announced id is still missing) or `NothingLeft` (sealed,
  and every micro-step is granted under a live lease or committed).
- A lease lasts `lease_s` seconds from its grant or last renewal (`None` = never expires,
  the core's own replica). An expired grant stays its holder's until another replica is
  granted the id, so a slow replica whose id nobody needed keeps it.
- A micro-step granted more than `grant_budget` times in one epoch fails the step: the
  claim that would grant it answers `Failed`, and so does every later claim of the step.
- `contribute(replica, step, epoch, ids, now)` is a returned contribution: accepted (the
  ids are committed to the replica, the caller adds the gradient) only when it is of this
  epoch and step and every id is held by the replica (lease live or expired but not
  granted again). A contribution that repeats an accepted one is a `Duplicate` (count it
  once). Any other is `Refused` whole, and the replica's grants of the step are released
  (granted again to whoever asks).
- `complete()`: the step is sealed and every micro-step 0..N−1 is committed; `advance()`
  then moves to the next step.

Invariant (tests/test_ledger.py, over any interleaving): each micro-step of a completed
step was accepted exactly once in the epoch that completes it.
"""
from __future__ import annotations

import collections
import dataclasses
import math


@dataclasses.dataclass(frozen=True, slots=True)
class Announced:
    """A micro-step the builder announced: its object-store key and token counts."""

    step: int
    microstep: int
    key: str = ""
    tokens: int = 0
    trained: int = 0


@dataclasses.dataclass(slots=True)
class Grant:
    """The current holder of a micro-step. lease_until: seconds on the caller's clock
    (math.inf: never expires). n: this is the id's n-th grant in the epoch (1-based)."""

    replica: str
    lease_until: float
    n: int


# -- claim answers ----------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, slots=True)
class Granted:
    """The replica now holds `microstep` (its `n`-th grant) until `lease_s` seconds from now
    (None = no expiry) unless it renews. `expired_from`: the replica whose expired lease the
    id was taken from, if any."""

    microstep: int
    key: str
    lease_s: float | None
    n: int
    expired_from: str | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class Renewed:
    """The held leases were renewed; nothing was asked for."""


@dataclasses.dataclass(frozen=True, slots=True)
class Wait:
    """Nothing to grant now, but the step is not over: ask again later."""

    reason: str


@dataclasses.dataclass(frozen=True, slots=True)
class NothingLeft:
    """Sealed, and every micro-step is granted under a live lease or committed."""


@dataclasses.dataclass(frozen=True, slots=True)
class Lost:
    """Held ids that are no longer the replica's; its other grants were released. The
    replica drops its accumulated gradient and claims afresh."""

    microsteps: tuple[int, ...]
    released: tuple[int, ...]


@dataclasses.dataclass(frozen=True, slots=True)
class Failed:
    """The step failed (a micro-step past its grant budget)."""

    reason: str
    microstep: int


ClaimAnswer = Granted | Renewed | Wait | NothingLeft | Lost | Failed


# -- contribution outcomes --------------------------------------------------------------
@dataclasses.dataclass(frozen=True, slots=True)
class Accepted:
    """The ids are committed to the replica: add its gradient once."""

    microsteps: tuple[int, ...]


@dataclasses.dataclass(frozen=True, slots=True)
class Duplicate:
    """The same contribution was accepted before: count nothing."""


@dataclasses.dataclass(frozen=True, slots=True)
class Refused:
    """Not counted. released: the replica's grants of the step, free to be granted again."""

    reason: str
    released: tuple[int, ...]


Outcome = Accepted | Duplicate | Refused


@dataclasses.dataclass(frozen=True, slots=True)
class Seal:
    """A step's seal: N micro-steps (ids 0..N−1) and |E|."""

    microsteps: int
    executions: int


class Ledger:
    """The core's ledger of the step being trained (module docstring).

    epoch: the core's epoch (>= 0). step: the step to train first (the core's policy
    version). lease_s: seconds a grant lasts without renewal, > 0. grant_budget: grants per
    micro-step and epoch, >= 1. Raises ValueError for bad arguments.
    """

    def __init__(self, *, epoch: int, step: int, lease_s: float = 30.0, grant_budget: int = 3) -> None:
        if epoch < 0 or step < 0:
            raise ValueError(f"Ledger epoch and step must be >= 0, got {epoch}, {step}")
        if not lease_s > 0:
            raise ValueError(f"Ledger.lease_s must be > 0, got {lease_s}")
        if grant_budget < 1:
            raise ValueError(f"Ledger.grant_budget must be >= 1, got {grant_budget}")
        self.epoch = epoch
        self.step = step
        self.lease_s = lease_s
        self.grant_budget = grant_budget
        self.announced: dict[int, dict[int, Announced]] = {}
        """step → micro-step id → its announcement (steps >= `step`)."""
        self.seals: dict[int, Seal] = {}
        self.holders: dict[int, Grant] = {}
        """micro-step id → its current grant (this step, uncommitted)."""
        self.committed: dict[int, str] = {}
        """micro-step id → the replica whose contribution was accepted (this step)."""
        self.grants: collections.Counter[int] = collections.Counter()
        """micro-step id → grants in this epoch and step."""
        self.failed: Failed | None = None

    # -- facts from the builder -----------------------------------------------------------
    def announce(self, a: Announced) -> None:
        """File a `microstep.ready` (idempotent; steps already trained are ignored)."""
        if a.step >= self.step:
            self.announced.setdefault(a.step, {}).setdefault(a.microstep, a)

    def seal(self, step: int, microsteps: int, executions: int) -> None:
        """File a `step.sealed` (idempotent; steps already trained are ignored)."""
        if step >= self.step:
            self.seals[step] = Seal(microsteps, executions)

    # -- replicas ---------------------------------------------------------------------------
    def held_by(self, replica: str) -> list[int]:
        """Ids of this step granted to `replica` and not committed, ascending."""
        return sorted(i for i, g in self.holders.items() if g.replica == replica)

    def claim(self, replica: str, held: tuple[int, ...] | list[int] = (), now: float = 0.0, *, want: bool = True,
              expires: bool = True) -> ClaimAnswer:
        """A replica's claim (module docstring). held: the ids of this epoch and step it holds
        and has not returned. expires: False for a replica whose leases never expire (the
        core's own, which dies only with the ledger)."""
        lease = self.lease_s if expires else None
        held_set = set(held)
        mine = set(self.held_by(replica))
        returned = {i for i in held_set if self.committed.get(i) == replica}  # accepted already: nothing to renew
        lost = tuple(sorted(held_set - mine - returned))
        if lost:
            released = self._release(replica)
            return Lost(lost, released)
        for i in mine - held_set:  # granted, but the replica never learnt it: a lost reply
            del self.holders[i]
        until = math.inf if lease is None else now + lease
        for i in held_set & mine:
            self.holders[i].lease_until = until
        if self.failed is not None:
            return self.failed
        if not want:
            return Renewed()
        candidate = self._candidate(replica, now)
        if candidate is None:
            return NothingLeft() if self.nothing_left(now) else Wait(self._wait_reason())
        previous = self.holders.get(candidate)
        if self.grants[candidate] >= self.grant_budget:
            self.failed = Failed(f"micro-step {candidate} of step {self.step} would be granted more than its "
                                 f"grant budget of {self.grant_budget} (epoch {self.epoch})", candidate)
            return self.failed
        self.grants[candidate] += 1
        self.holders[candidate] = Grant(replica, until, self.grants[candidate])
        return Granted(candidate, self.announced[self.step][candidate].key, lease, self.grants[candidate],
                       previous.replica if previous is not None else None)

    def _candidate(self, replica: str, now: float) -> int | None:
        free = expired = None
        for i in sorted(self.announced.get(self.step, {})):
            if i in self.committed:
                continue
            g = self.holders.get(i)
            if g is None:
                free = i
                break
            if expired is None and g.replica != replica and g.lease_until <= now:
                expired = i
        return free if free is not None else expired

    def _wait_reason(self) -> str:
        seal = self.seals.get(self.step)
        if seal is None:
            return "step not sealed"
        return "micro-steps not announced yet" if not self._all_announced(seal) else "leases held by others"

    def _all_announced(self, seal: Seal) -> bool:
        have = self.announced.get(self.step, {})
        return all(i in have for i in range(seal.microsteps))

    def nothing_left(self, now: float) -> bool:
        """Sealed, every id announced, and each committed or held under a live lease."""
        seal = self.seals.get(self.step)
        if seal is None or not self._all_announced(seal):
            return False
        for i in range(seal.microsteps):
            if i in self.committed:
                continue
            g = self.holders.get(i)
            if g is None or g.lease_until <= now:
                return False
        return True

    def _release(self, replica: str) -> tuple[int, ...]:
        ids = tuple(self.held_by(replica))
        for i in ids:
            del self.holders[i]
        return ids

    def release(self, replica: str) -> tuple[int, ...]:
        """Release every grant of `replica` (it left training); returns the ids."""
        return self._release(replica)

    # -- contributions ----------------------------------------------------------------------
    def acceptable(self, replica: str, step: int, epoch: int, ids: tuple[int, ...] | list[int]) -> bool:
        """Whether `contribute` would accept these ids now (it changes nothing): the caller
        pulls a gradient only for a contribution that can count."""
        return (epoch == self.epoch and step == self.step and bool(ids)
                and all((g := self.holders.get(i)) is not None and g.replica == replica for i in ids))

    def contribute(self, replica: str, step: int, epoch: int, ids: tuple[int, ...] | list[int],
                   now: float = 0.0) -> Outcome:
        """A replica returned the gradient sum of `ids` (module docstring)."""
        del now  # an expired lease still counts while no other replica was granted the id
        ids = tuple(sorted(set(ids)))
        if epoch != self.epoch:
            return Refused(f"epoch {epoch} is not the core's epoch {self.epoch}", ())
        if step != self.step:
            return Refused(f"step {step} is not the step being trained ({self.step})", ())
        if not ids:
            return Refused("no micro-steps", ())
        if all(self.committed.get(i) == replica for i in ids):
            return Duplicate()
        mine = set(self.held_by(replica))
        bad = [i for i in ids if i not in mine]
        if bad:
            taken = [i for i in bad if i in self.committed or i in self.holders]
            why = (f"micro-steps {taken} were granted again or committed" if taken
                   else f"micro-steps {bad} are not held by {replica}")
            return Refused(why, self._release(replica))
        for i in ids:
            del self.holders[i]
            self.committed[i] = replica
        return Accepted(ids)

    # -- the step ------------------------------------------------------------------------------
    def complete(self) -> bool:
        """Sealed, and every micro-step 0..N−1 committed."""
        seal = self.seals.get(self.step)
        return seal is not None and all(i in self.committed for i in range(seal.microsteps))

    def seal_of(self, step: int | None = None) -> Seal | None:
        return self.seals.get(self.step if step is None else step)

    def committed_per_replica(self) -> dict[str, int]:
        """replica → micro-steps of this step committed to it."""
        return dict(collections.Counter(self.committed.values()))

    def advance(self) -> None:
        """The step was applied: train the next one (grants and counts start afresh)."""
        self.announced.pop(self.step, None)
        self.seals.pop(self.step, None)
        self.step += 1
        self.holders.clear()
        self.committed.clear()
        self.grants.clear()
        self.failed = None
