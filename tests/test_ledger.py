"""The step ledger (gyre.learning.ledger): hand-worked cases, then a property test over any
interleaving of announcements, seals, grants (and lost grant replies), lease expiries,
contributions, duplicate contributions, replica arrivals and deaths, and core restarts.

The model keeps what the ledger cannot see: each replica's accumulated micro-steps (with
the epoch they were granted under) and the core's accumulated gradient as a multiset of
micro-step ids. The invariant is DESIGN.md's: the gradient the core applies holds every
micro-step of the step exactly once, whatever happened.
"""
from __future__ import annotations

import collections

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from gyre.learning.ledger import (
    Accepted, Announced, Duplicate, Failed, Granted, Ledger, Lost, NothingLeft, Refused, Renewed, Wait,
)


def announced(ledger: Ledger, step: int, n: int) -> None:
    for i in range(n):
        ledger.announce(Announced(step, i, key=f"step-{step}/mstep-{i}"))


def test_grants_one_holder_at_a_time_and_applies_when_every_microstep_is_committed():
    ledger = Ledger(epoch=0, step=0, lease_s=10.0)
    assert ledger.claim("core", (), now=0.0) == Wait("step not sealed")
    announced(ledger, 0, 2)
    g0 = ledger.claim("core", (), now=0.0, expires=False)
    assert g0 == Granted(0, "step-0/mstep-0", None, 1)
    g1 = ledger.claim("cell1", (), now=0.0)
    assert (g1.microstep, g1.lease_s) == (1, 10.0)
    assert ledger.claim("cell2", (), now=1.0) == Wait("step not sealed")
    ledger.seal(0, microsteps=2, executions=4)
    assert ledger.claim("cell2", (), now=1.0) == NothingLeft()
    assert ledger.contribute("core", 0, 0, [0]) == Accepted((0,))
    assert not ledger.complete()
    assert ledger.contribute("cell1", 0, 0, [1]) == Accepted((1,))
    assert ledger.contribute("cell1", 0, 0, [1]) == Duplicate()  # a redelivered contribution
    assert ledger.complete() and ledger.committed_per_replica() == {"core": 1, "cell1": 1}
    ledger.advance()
    assert (ledger.step, ledger.holders, ledger.committed) == (1, {}, {})


def test_a_later_steps_microstep_is_never_granted_into_the_current_step():
    ledger = Ledger(epoch=0, step=3, lease_s=10.0)
    announced(ledger, 4, 2)
    ledger.announce(Announced(2, 0))  # already trained: ignored
    assert isinstance(ledger.claim("core", ()), Wait)
    ledger.seal(3, microsteps=0, executions=0)
    assert ledger.complete()  # a step without micro-steps applies at its seal
    ledger.advance()
    assert ledger.claim("core", ()).microstep == 0 and ledger.step == 4


def test_an_expired_lease_is_granted_again_and_the_late_contribution_is_refused_whole():
    """cell1 holds 0 and 1 under 5 s leases and stalls; at t = 6 cell2 is granted 0 (grant
    2 of micro-step 0); cell1's contribution of {0, 1} at t = 7 is refused whole and 1 is
    free again; cell2 takes it and its contribution of {0, 1} is accepted."""
    ledger = Ledger(epoch=2, step=0, lease_s=5.0)
    announced(ledger, 0, 2)
    ledger.seal(0, 2, 2)
    assert ledger.claim("cell1", (), now=0.0).microstep == 0
    assert ledger.claim("cell1", (0,), now=0.5).microstep == 1
    assert ledger.claim("cell2", (), now=4.0) == NothingLeft()  # both leases live
    again = ledger.claim("cell2", (), now=6.0)
    assert (again.microstep, again.n, again.expired_from) == (0, 2, "cell1")
    refused = ledger.contribute("cell1", 0, 2, [0, 1], now=7.0)
    assert isinstance(refused, Refused) and refused.released == (1,)
    assert ledger.claim("cell2", (0,), now=7.0).microstep == 1
    assert ledger.contribute("cell2", 0, 2, [0, 1], now=8.0) == Accepted((0, 1))
    assert ledger.complete() and ledger.committed == {0: "cell2", 1: "cell2"}


def test_an_expired_lease_nobody_took_still_counts():
    ledger = Ledger(epoch=0, step=0, lease_s=1.0)
    announced(ledger, 0, 1)
    ledger.seal(0, 1, 1)
    ledger.claim("cell1", (), now=0.0)
    assert ledger.contribute("cell1", 0, 0, [0], now=50.0) == Accepted((0,))


def test_renewal_keeps_a_lease_and_a_lost_id_makes_the_replica_drop_its_work():
    ledger = Ledger(epoch=0, step=0, lease_s=2.0)
    announced(ledger, 0, 3)
    ledger.claim("cell1", (), now=0.0)
    ledger.claim("cell1", (0,), now=1.0)
    assert ledger.claim("cell1", (0, 1), now=2.5, want=False) == Renewed()  # leases run to 4.5
    assert ledger.claim("cell2", (), now=4.0).microstep == 2  # 0 and 1 still live
    assert ledger.claim("cell2", (2,), now=5.0).microstep == 0  # 0 expired at 4.5
    lost = ledger.claim("cell1", (0, 1), now=5.5)
    assert lost == Lost((0,), (1,))  # its other grant, 1, is released with it
    assert ledger.holders.keys() == {0, 2}


def test_a_grant_whose_reply_was_lost_is_released_at_the_next_claim():
    ledger = Ledger(epoch=0, step=0, lease_s=30.0)
    announced(ledger, 0, 2)
    assert ledger.claim("cell1", (), now=0.0).microstep == 0  # the reply never arrives
    again = ledger.claim("cell1", (), now=1.0)  # it asks again, holding nothing
    assert (again.microstep, again.n) == (0, 2)


def test_ids_returned_but_not_yet_taken_stay_the_replicas():
    """A satellite returned {0, 1} and claims again before the core took the contribution:
    listing them keeps them its own (not a lost reply), and once they are committed, listing
    them again is no loss either."""
    ledger = Ledger(epoch=0, step=0, lease_s=30.0)
    announced(ledger, 0, 3)
    ledger.claim("cell1", (), now=0.0)
    ledger.claim("cell1", (0,), now=0.0)
    assert ledger.claim("cell1", (0, 1), now=1.0, want=False) == Renewed()
    assert ledger.contribute("cell1", 0, 0, [0, 1], now=1.5) == Accepted((0, 1))
    assert ledger.claim("cell1", (0, 1), now=2.0, want=False) == Renewed()
    assert ledger.claim("cell1", (), now=2.0) == Granted(2, "step-0/mstep-2", 30.0, 1)


def test_contributions_of_another_epoch_or_step_or_unheld_ids_are_refused():
    ledger = Ledger(epoch=1, step=5, lease_s=30.0)
    announced(ledger, 5, 2)
    ledger.claim("cell1", ())
    assert isinstance(ledger.contribute("cell1", 5, 0, [0]), Refused)  # the previous core's epoch
    assert isinstance(ledger.contribute("cell1", 4, 1, [0]), Refused)
    assert isinstance(ledger.contribute("cell1", 5, 1, []), Refused)
    refused = ledger.contribute("cell1", 5, 1, [0, 1])  # 1 was never granted to it
    assert isinstance(refused, Refused) and refused.released == (0,)


def test_a_microstep_past_its_grant_budget_fails_the_step():
    ledger = Ledger(epoch=0, step=7, lease_s=1.0, grant_budget=3)
    announced(ledger, 7, 1)
    for n, t in ((1, 0.0), (2, 2.0), (3, 4.0)):
        assert ledger.claim(f"cell{n}", (), now=t).n == n  # each holder lets its lease lapse
    failed = ledger.claim("cell9", (), now=6.0)
    assert isinstance(failed, Failed) and failed.microstep == 0 and "grant budget of 3" in failed.reason
    assert ledger.claim("core", (), now=6.0) == failed  # the step stays failed, loudly


def test_bad_arguments():
    for kw in (dict(epoch=-1, step=0), dict(epoch=0, step=0, lease_s=0.0), dict(epoch=0, step=0, grant_budget=0)):
        with pytest.raises(ValueError):
            Ledger(**kw)


# -- the property test ---------------------------------------------------------------------
REPLICAS = ("core", "cell1", "cell2", "cell3")
LEASE_S = 1.0
RARELY = st.sampled_from([False] * 7 + [True])
"""Deaths and core restarts wipe state: a run with one in every few rules would rarely
reach a lease that expires under a live replica."""


class LedgerMachine(RuleBasedStateMachine):
    """A core (its own replica commits each micro-step as it trains it), three satellites,
    three steps of up to 4 micro-steps, any interleaving."""

    budget = 10**6

    @initialize(first=st.integers(1, 4), later=st.lists(st.integers(0, 4), min_size=2, max_size=2))
    def start(self, first, later):
        self.sizes = [first, *later]  # micro-steps of steps 0, 1, 2
        self.now = 0.0
        self.epoch = 0
        self.ledger = Ledger(epoch=0, step=0, lease_s=LEASE_S, grant_budget=self.budget)
        self.history: list[tuple[str, object]] = []  # announcements and seals on the bus, for restarts
        self.alive = {r: True for r in REPLICAS}
        self.held = {r: [] for r in REPLICAS}  # accumulated, not returned
        self.pending = {r: [] for r in REPLICAS}  # returned, listed until the step moves on or they are lost
        self.held_at = {r: (0, 0) for r in REPLICAS}  # (epoch, step) of the held grants
        self.sent: list[tuple[str, int, int, tuple[int, ...]]] = []  # contributions on the bus
        self.accumulated: collections.Counter[int] = collections.Counter()  # the core's gradient
        self.applied: list[int] = []
        self.said: set[tuple[int, int]] = set()

    @property
    def step(self) -> int:
        return self.ledger.step

    def _file(self, kind, fact) -> None:
        self.history.append((kind, fact))
        self._deliver(kind, fact)

    def _deliver(self, kind, fact) -> None:
        if kind == "ready":
            self.ledger.announce(fact)
        else:
            self.ledger.seal(*fact)

    @rule(data=st.data())
    def announce(self, data):
        """The next few announcements the builder makes (the bus delivers them in any order
        relative to the seal), sometimes one again."""
        todo = [(s, i) for s in range(3) for i in range(self.sizes[s]) if (s, i) not in self.said]
        if todo:
            for s, i in data.draw(st.lists(st.sampled_from(todo), min_size=1, max_size=3, unique=True)):
                self.said.add((s, i))
                self._file("ready", Announced(s, i, key=f"{s}/{i}"))
        elif self.history:
            kind, fact = data.draw(st.sampled_from(self.history))
            self._deliver(kind, fact)

    @rule(step=st.integers(0, 2))
    def seal(self, step):
        self._file("sealed", (step, self.sizes[step], 4))

    @rule(replica=st.sampled_from(REPLICAS), reply_lost=st.booleans(), want=st.booleans())
    def claim(self, replica, reply_lost, want):
        if not self.alive[replica] or self.step >= 3:
            return
        if self.held_at[replica] != (self.ledger.epoch, self.step):  # a core restart, or the step
            self.held[replica], self.held_at[replica] = [], (self.ledger.epoch, self.step)  # was done without it
            self.pending[replica] = []
        core = replica == "core"
        listed = tuple(self.held[replica] + self.pending[replica])
        answer = self.ledger.claim(replica, listed, self.now, want=want, expires=not core)
        if reply_lost and not core:
            return
        if isinstance(answer, Lost):
            self.held[replica], self.pending[replica] = [], []
        elif isinstance(answer, Granted):
            if core:  # the core trains it into its own gradient and commits it at once
                outcome = self.ledger.contribute("core", self.step, self.ledger.epoch, [answer.microstep], self.now)
                assert isinstance(outcome, Accepted)
                self.accumulated[answer.microstep] += 1
            else:
                self.held[replica].append(answer.microstep)

    @rule(replica=st.sampled_from(REPLICAS), reply_lost=st.booleans())
    def claim_more(self, replica, reply_lost):
        """Claims are the common case: a second rule doubles their share of the steps."""
        self.claim(replica, reply_lost, want=True)

    def _contribute(self, replica, step, epoch, ids) -> None:
        outcome = self.ledger.contribute(replica, step, epoch, ids, self.now)
        if isinstance(outcome, Accepted):
            self.accumulated.update(outcome.microsteps)

    data_lost_in_transit = False

    @rule(replica=st.sampled_from(REPLICAS[1:]), late=st.booleans())
    def give_back_late(self, replica, late):
        """A contribution the core takes only later (a claim may come first), or never."""
        self.data_lost_in_transit = late
        try:
            self.give_back(replica)
        finally:
            self.data_lost_in_transit = False

    @rule(replica=st.sampled_from(REPLICAS[1:]))
    def give_back(self, replica):
        if self.alive[replica] and self.held[replica]:
            epoch, step = self.held_at[replica]
            message = (replica, step, epoch, tuple(self.held[replica]))
            self.sent.append(message)
            self.pending[replica] += self.held[replica]
            self.held[replica] = []
            if self.data_lost_in_transit:  # the core takes it later (redeliver), or never
                return
            self._contribute(*message)

    @rule(data=st.data())
    def redeliver(self, data):
        if self.sent:
            self._contribute(*data.draw(st.sampled_from(self.sent)))

    @rule(dt=st.sampled_from([0.4, LEASE_S + 0.1]))
    def tick(self, dt):
        self.now += dt

    @rule(replica=st.sampled_from(REPLICAS[1:]), now=RARELY)
    def die(self, replica, now):
        if not now:
            return
        self.alive[replica] = False
        self.held[replica], self.pending[replica] = [], []

    @rule(replica=st.sampled_from(REPLICAS[1:]))
    def arrive(self, replica):
        self.alive[replica] = True

    @rule(now=RARELY)
    def restart_core(self, now):
        """kill -9 of the core: its gradient and ledger are gone; it resumes from the last
        applied step under a new epoch and replays the bus's announcements and seals."""
        if not now:
            return
        self.epoch += 1
        step = self.step
        self.ledger = Ledger(epoch=self.epoch, step=step, lease_s=LEASE_S, grant_budget=self.budget)
        for kind, fact in self.history:
            self._deliver(kind, fact)
        self.accumulated.clear()

    @rule()
    def apply(self):
        if self.step < 3 and self.ledger.complete():
            self._check_complete()
            self.applied.append(self.step)
            self.accumulated.clear()
            self.ledger.advance()

    def _check_complete(self):
        n = self.sizes[self.step]
        assert self.accumulated == collections.Counter(range(n)), (self.step, self.accumulated)

    @invariant()
    def never_counted_twice(self):
        if hasattr(self, "ledger"):
            assert all(c == 1 for c in self.accumulated.values()), self.accumulated
            assert set(self.accumulated) == set(self.ledger.committed)

    def teardown(self):
        """Liveness: once every replica is alive and behaves, every step completes (or, with a
        budget, fails loudly)."""
        if not hasattr(self, "ledger"):
            return
        for kind, fact in [("ready", Announced(s, i, key=f"{s}/{i}")) for s in range(3) for i in range(self.sizes[s])] + \
                [("sealed", (s, self.sizes[s], 4)) for s in range(3)]:
            self._file(kind, fact)
        for r in REPLICAS:
            self.alive[r] = True
        for _ in range(200):
            if self.step >= 3 or self.ledger.failed is not None:
                break
            self.now += LEASE_S + 0.1
            for r in REPLICAS:
                for _ in range(8):
                    self.claim(r, reply_lost=False, want=True)
                if r != "core":
                    self.give_back(r)
            self.apply()
        assert self.step >= 3 or self.ledger.failed is not None, (self.step, self.ledger.holders, self.ledger.committed)
        if self.budget == 10**6:
            assert self.applied == [0, 1, 2]


class BudgetedLedgerMachine(LedgerMachine):
    """The same with the default grant budget of 3: a step may fail, but never miscounts."""

    budget = 3


SETTINGS = settings(max_examples=150, stateful_step_count=80, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])
TestLedgerProperties = LedgerMachine.TestCase
TestLedgerProperties.settings = SETTINGS
TestBudgetedLedgerProperties = BudgetedLedgerMachine.TestCase
TestBudgetedLedgerProperties.settings = SETTINGS
