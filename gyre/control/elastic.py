"""The elastic policy (DESIGN.md "Elastic scheduling").

Cells move between rollout and training during a step:
- bursts are released by the staleness gate and admitted greedily, at most C_e executions
  per engine;
- the next cell in switch order (core first, then the satellites in their fixed order)
  leaves rollout only when the water level allows it, w(t) ≤ C_R(t) − C_e, one switch at a
  time, and only when it has training to do that saves more time than a round trip of
  switches costs (before any micro-step has been timed there is no estimate of the saving,
  and the water level alone decides);
- training cells return to rollout by the return rule, only while executions wait for a slot.

Return rules (`return_rule`):
- `boundary`: when a step is completed, every training cell returns;
- `idle`: a training cell with nothing to claim returns;
- `adaptive`, the default and the one configuration for every workload:
  - at a step boundary once every burst has been released (the end of the run), every
    training cell returns: the last bursts roll out on every cell, and the water level
    brings the cells back to train them;
  - at any other step boundary, the policy judges from what it has observed whether the
    run is bound by latency or by throughput: latency when a burst's expected longest execution,
    spread over the S+1 bursts in flight, outlasts one step's work (rollout and training)
    spread over every cell. Bound by latency, every training cell returns, so the new
    burst's long executions all start at once (the boundary rule); bound by throughput,
    round(K·ρ) training cells stay (ρ the training share of a step's work, as the best
    fixed split would have it; never more than have micro-steps to claim), the others
    return — unless that whole-cell split is uneven: it leaves a single cell (and no pool)
    to roll out, which would take longer for a burst than the kept cells take to train a
    step, by more than returning every cell costs (K round trips of switches and K drains,
    one after another); the kept cells would wait for data while executions wait for the
    one cell's slots (2 cells with ρ near ½, say). Then every training cell returns (the
    uneven-split return);
  - between boundaries, an idle training cell returns when, staying until the open step's
    data is complete, it would idle longer than a return costs: a round trip of switches
    plus the drain that bringing it back takes (C_e slots emptied one finish at a time);
  - while executions wait and no engine serves, one training cell always returns.

The policy reads only what it observes: execution durations so far (finished ones, and the
elapsed time of those running), the switch durations measured in `cell.switched`, the
micro-step durations (grant to commit), the finish rate and the ledger's counts. It is
never told a profile's durations, timeout or training time.
"""
from __future__ import annotations

import bisect
from typing import Literal

from gyre.control.facts import Action
from gyre.control.policy import Policy, PolicyConfig

ReturnRule = Literal["boundary", "idle", "adaptive"]


class ElasticPolicy(Policy):
    mode = "elastic"

    def __init__(self, config: PolicyConfig, *, return_rule: ReturnRule = "adaptive") -> None:
        super().__init__(config)
        if return_rule not in ("boundary", "idle", "adaptive"):
            raise ValueError(f"return_rule must be boundary, idle or adaptive, got {return_rule!r}")
        self.return_rule = return_rule
        self._boundary = 0  # steps completed when the boundary rule last returned cells
        self._recheck_at = 0.0  # idle training cells stay at least until then

    def options(self) -> dict:
        return {"return_rule": self.return_rule}

    # --- observations ---------------------------------------------------------------------

    def switch_cost(self, from_role: str, to_role: str) -> float:
        """The mean measured duration of this kind of switch (0 before the first)."""
        seen = self.switch_s[(from_role, to_role)]
        return sum(seen) / len(seen) if seen else 0.0

    def microstep_cost(self) -> float:
        """The mean measured micro-step duration (grant to commit), 0 before the first."""
        seen = self.microstep_s
        return sum(seen) / len(seen) if seen else 0.0

    def microsteps_in(self, step: int) -> int:
        """The micro-steps of `step`: known once sealed, else those of the last sealed step,
        else those announced so far."""
        if step in self.sealed:
            return self.sealed[step]
        last = max(self.sealed, default=None)
        return max(self.ready[step], self.sealed[last] if last is not None else 0)

    def expected_end(self, elapsed: float, q: float) -> float:
        """The q-quantile of the observed durations longer than `elapsed`; `elapsed` when
        none was that long."""
        d = self.durations
        i = bisect.bisect_right(d, elapsed)
        if i >= len(d):
            return elapsed
        return d[i + min(len(d) - i - 1, int(q * (len(d) - i)))]

    def data_complete_at(self, step: int) -> float:
        """When the last execution of `step` is expected to finish (now if it is sealed):
        each unfinished one ends at the quantile 1 − 1/(n+1) of the observed durations
        longer than its own elapsed time, n the unfinished ones."""
        if step in self.sealed:
            return self.t
        running = self.unfinished.get(step, ())
        waiting = sum(1 for e in self.backlog if e[0] == step) if step >= self.released - 1 else 0
        n = len(running) + waiting
        if n == 0:
            return self.t
        q = 1.0 - 1.0 / (n + 1)
        end = self.t
        for x in running:
            started = self.started_at.get(x, self.t)
            end = max(end, started + self.expected_end(self.t - started, q))
        if waiting:
            end = max(end, self.t + self.expected_end(0.0, q))
        return end

    # --- decisions ------------------------------------------------------------------------

    def decide(self) -> list[Action]:
        actions: list[Action] = []
        k = self.completed
        actions += self.open_step(k)
        self.release(k + self.cfg.staleness)
        actions += self.returns()
        actions += self.admit()
        actions += self.to_training()
        return actions

    def waiting(self) -> int:
        """Executions released (or paused) that no engine holds."""
        return len(self.backlog) + len(self.paused)

    def idle_trainers(self) -> int:
        """Training cells that hold no micro-step."""
        return sum(1 for c in self.cfg.cells if self.trainer(c) and c not in self.holding)

    def to_training(self) -> list[Action]:
        """The next cell in order leaves rollout when the water level allows and the switch
        pays for itself: the claimable training, spread over one more cell, ends sooner by
        more than a round trip of switches costs. Until a micro-step has been timed the
        saving is unknown and the water level alone decides (a saving estimated as 0 would
        hold every cell but the first back until the first micro-step is committed)."""
        if any(t == "training" for t in self.target.values()):
            return []  # serial: one switch to training at a time
        cell = next((c for c in self.cfg.cells if self.serving(c)), None)
        if cell is None or self.water_level > self.rollout_capacity - self.capacity[cell]:
            return []
        k = self.opened
        claimable = self.claimable(k)
        if claimable <= self.idle_trainers():
            return []
        trainers = sum(1 for c in self.cfg.cells if self.trainer(c))
        if trainers and self.return_rule == "adaptive" and self.microstep_s:
            work = (claimable + len(self.holding)) * self.microstep_cost()
            saving = work / trainers - work / (trainers + 1)
            if saving <= self.switch_cost("rollout", "training") + self.switch_cost("training", "rollout"):
                return []
        return self.switch(cell, "training", "water level")

    def returns(self) -> list[Action]:
        """Training cells that return to rollout now (the last in switch order first)."""
        waiting = self.waiting()
        if not waiting:
            return []
        returning = sum(1 for t in self.target.values() if t == "rollout")
        need = -(-waiting // self.cfg.capacity) - returning
        trainers = [c for c in reversed(self.cfg.cells) if self.trainer(c)]
        if need <= 0 or not trainers:
            return []
        k = self.opened
        boundary = (self._boundary < self.completed
                    and self.released >= min(self.cfg.steps, self.completed + self.cfg.staleness + 1))
        if self.return_rule == "boundary":
            if not boundary:
                return []
            self._boundary = self.completed
            cells = trainers
        elif self.return_rule == "adaptive" and boundary:
            self._boundary = self.completed
            keep = self.keep_at_boundary(k, len(trainers))
            cells = trainers[:len(trainers) - keep]
        elif self.return_rule == "idle":
            cells = [c for c in trainers if c not in self.holding and self.claimable(k) == 0]
        else:
            cells = self.idle_returns(k, [c for c in trainers if c not in self.holding], waiting)
        if not cells and not returning and self.rollout_capacity == 0:
            cells = trainers[:1]  # executions wait and nothing serves: one cell must
        cells = cells[:need]
        return self.switch(cells, "rollout", "executions waiting") if cells else []

    def idle_returns(self, step: int, idle: list[str], waiting: int) -> list[str]:
        """Idle training cells that return: all of them when, staying until the open step's
        data is complete, they would idle longer than a return costs. A return costs a
        round trip of switches and, to come back while executions still wait, a drain: C_e
        slots emptied one finish at a time, about C_e / (2λ) cell-seconds at the finish
        rate λ observed lately."""
        if not idle or self.claimable(step) > 0 or self.t < self._recheck_at:
            return []
        trainers = sum(1 for c in self.cfg.cells if self.trainer(c))
        work = (self.microsteps_in(step) - self.committed[step]) * self.microstep_cost()
        if self.nothing_left(step):
            idle_s = self.next_work_in(step)
        else:
            idle_s = self.data_complete_at(step) - self.t - work / trainers
        costs = self.switch_cost("training", "rollout") + self.switch_cost("rollout", "training")
        rate = self.finish_rate()
        drain = self.cfg.capacity / (2 * rate) if rate > 0 else float("inf")
        if idle_s > costs + drain:
            return idle
        self._recheck_at = self.t + max(self.microstep_cost(), 0.1 * max(idle_s, 0.0))
        return []

    def finish_rate(self) -> float:
        """Executions finished per second lately (over the last 2·C_e finishes)."""
        f = self.recent_finishes
        if len(f) < 2 or f[-1] <= f[0]:
            return 0.0
        return (len(f) - 1) / (max(self.t, f[-1]) - f[0])

    def next_work_in(self, step: int) -> float:
        """Seconds until a training cell is expected to have something to claim: now when a
        micro-step is claimable; when the open step has nothing left to claim, once it is
        completed (about a micro-step) and the next step has micro-steps; otherwise when the
        next group of the open step is expected to be in."""
        if self.claimable(step) > 0:
            return 0.0
        if self.nothing_left(step):
            if step + 1 >= self.cfg.steps:
                return float("inf")
            mu = self.microstep_cost()
            return mu if self.ready[step + 1] > 0 else mu + self.next_group_in(step + 1)
        return self.next_group_in(step)

    def next_group_in(self, step: int) -> float:
        """Seconds until the first unfinished group of `step` is expected to be complete
        (each execution at the quantile 1 − 1/(n+1) of the observed durations longer than
        its elapsed time, n the group's unfinished executions); inf when none is dispatched
        in full."""
        best = float("inf")
        for (k, g), left in self.group_left.items():
            if k != step:
                continue
            running = self.in_group.get((k, g), ())
            if len(running) < left:
                continue
            q = 1.0 - 1.0 / (len(running) + 1)
            end = 0.0
            for x in running:
                started = self.started_at.get(x, self.t)
                end = max(end, started + self.expected_end(self.t - started, q) - self.t)
            best = min(best, end)
        return max(0.0, best)

    def keep_at_boundary(self, step: int, trainers: int) -> int:
        """How many training cells stay when a step boundary brings executions to wait: none
        once every burst has been released, or when the run is bound by latency, or when the
        throughput split is uneven; round(K·ρ) when it is bound by throughput (see the module
        docstring), from the durations and micro-steps observed so far."""
        d = self.durations
        mu = self.microstep_cost()
        if not d or mu <= 0 or self.released >= self.cfg.steps:
            return 0
        cells = len(self.cfg.cells)
        n = self.cfg.executions_per_step
        training = self.microsteps_in(step) * mu  # cell-seconds of one step's training
        rollout = n * (sum(d) / len(d)) / self.cfg.capacity  # cell-seconds of one burst
        longest = d[min(len(d) - 1, int(len(d) * (1 - 1 / (n + 1))))]  # expected longest of n
        latency = longest / (self.cfg.staleness + 1) + training / (self.cfg.groups_per_step * cells)
        if latency > (rollout + training) / cells:
            return 0
        split = round(cells * training / (rollout + training))
        if split == 0 or self.uneven(split, training, rollout):
            return 0
        return min(trainers, self.claimable(step), split)

    def uneven(self, keep: int, training: float, rollout: float) -> bool:
        """Whether a whole-cell split of `keep` training cells is uneven: it leaves one cell
        (and no pool) to roll out, and that cell takes longer for a burst (`rollout`
        cell-seconds) than the kept cells take for a step (`training` cell-seconds) by more
        than returning every cell at the boundary costs. The kept cells would wait for data
        while executions wait for the one cell's slots, and that cell never leaves rollout
        while it holds an execution (w ≤ C_R − C_e = 0). Returning every cell costs each of
        the K cells a round trip of switches and a drain (C_e slots emptied at the observed
        finish rate, as in `idle_returns`), paid one after another since switches to
        training are serial. (Only for a single rollout cell: with a wider rollout side,
        returning every cell measured slower on most held-out random profiles it changed.)"""
        if self.cfg.pool or len(self.cfg.cells) - keep != 1:
            return False
        idle = rollout - training / keep
        rate = self.finish_rate()
        drain = self.cfg.capacity / (2 * rate) if rate > 0 else float("inf")
        costs = self.switch_cost("training", "rollout") + self.switch_cost("rollout", "training")
        return idle > len(self.cfg.cells) * (costs + drain)
