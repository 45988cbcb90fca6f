"""Builder policy: calls and scores → samples → micro-steps, streamed group by group.

Pure state machine fed by the builder daemon (handlers/builder.py):
- `add_call(call)` files a `call.completed` (inline tokens) into its execution's tree.
- `add_score(scored)` records an execution's score; once every execution of a group is
  scored, the group is *finalised*: advantages (gyre.trajectory.advantages), trajectories per
  execution (gyre.trajectory.tree, ≤ J_max), micro-steps packed to a token budget
  (gyre.trajectory.microstep). When the step's last group is finalised the step is sealed.
Both are idempotent: a redelivered fact changes nothing. A call arriving after its
group was finalised is counted in `late_calls` (it can no longer be trained).
Micro-step indices: a group's micro-steps are numbered contiguously from the step's next
free index, unless `reserve(step, group, first)` placed the group earlier (a restarted
builder re-finalising a group whose micro-steps its predecessor already published: the
same content gets the same ids); fresh ranges start at or after `floor(step, index)`.
|E| (DESIGN.md "Learning") = trained executions of the step: scored, not excluded,
not a placeholder, with at least one trainable token.
"""
from __future__ import annotations

import dataclasses
import random

import structlog

from gyre.trajectory.advantages import group_advantages
from gyre.trajectory.microstep import MicrostepData, Sample, pack
from gyre.trajectory.tree import CallTree, trajectories
from schemas import CallCompleted, ExecutionScored

log = structlog.get_logger()

ADV_EPS = 0.0


@dataclasses.dataclass(frozen=True, slots=True)
class Sealed:
    """The step's micro-steps are all out. executions = |E|."""

    step: int
    microsteps: int
    executions: int
    groups: int
    zero_variance_groups: int
    excluded: int
    reward_mean: float


@dataclasses.dataclass
class _Step:
    groups_done: set[str] = dataclasses.field(default_factory=set)
    microsteps: int = 0
    next_index: int = 0
    executions: int = 0
    zero_variance: int = 0
    excluded: int = 0
    rewards: list[float] = dataclasses.field(default_factory=list)
    sealed: bool = False


@dataclasses.dataclass
class BuilderPolicy:
    """j_max: trajectories kept per execution. max_staleness: S. token_budget: soft
    positions per micro-step. seed: trajectory selection seed (per execution)."""

    j_max: int = 5
    max_staleness: int | None = 1
    token_budget: int = 16384
    seed: int = 0
    trees: dict[str, CallTree] = dataclasses.field(default_factory=dict)
    scores: dict[str, dict[str, ExecutionScored]] = dataclasses.field(default_factory=dict)  # group → execution →
    finalised: set[str] = dataclasses.field(default_factory=set)
    steps: dict[int, _Step] = dataclasses.field(default_factory=dict)
    late_calls: int = 0
    execution_group: dict[str, str] = dataclasses.field(default_factory=dict)
    reserved: dict[str, int] = dataclasses.field(default_factory=dict)  # group → first micro-step index

    def reserve(self, step: int, group: str, first: int) -> None:
        """Number `group`'s micro-steps from `first` when it is finalised (a predecessor
        published them there)."""
        self.reserved[group] = min(first, self.reserved.get(group, first))
        self.floor(step, first)  # the daemon floors every published index; this one at least

    def floor(self, step: int, index: int) -> None:
        """Fresh micro-step ranges of `step` start after `index` (published already)."""
        st = self.steps.setdefault(step, _Step())
        st.next_index = max(st.next_index, index + 1)

    def mark_sealed(self, step: int, groups: dict[str, list[str]]) -> None:
        """`step` was sealed by a predecessor: its groups (group → executions) are final,
        a call of theirs arriving now is late, a score changes nothing."""
        st = self.steps.setdefault(step, _Step())
        st.sealed = True
        for group, executions in groups.items():
            self.finalised.add(group)
            st.groups_done.add(group)
            for e in executions:
                self.execution_group[e] = group

    def add_call(self, call: CallCompleted) -> bool:
        """File a call (tokens inline). Returns False when it came too late or was known."""
        group = self.execution_group.get(call.execution)
        if group is not None and group in self.finalised:
            self.late_calls += 1
            log.warning("builder.call.late", execution=call.execution, call=call.call)
            return False
        tree = self.trees.setdefault(call.execution, CallTree(call.execution))
        return tree.add(call)

    def add_score(self, scored: ExecutionScored) -> tuple[list[MicrostepData], Sealed | None]:
        """Record a score; returns the micro-steps of a group it completes and the seal
        of a step it completes (else [] and None)."""
        info = scored.info
        self.execution_group[info.execution] = info.group
        if info.group in self.finalised:
            return [], None
        group = self.scores.setdefault(info.group, {})
        previous = group.get(info.execution)
        if previous is not None and previous.attempt >= scored.attempt:
            return [], None
        group[info.execution] = scored
        if len(group) < info.group_size:
            return [], None
        microsteps = self._finalise(info.group, info.step)
        st = self.steps[info.step]
        st.groups_done.add(info.group)
        if len(st.groups_done) < info.step_groups or st.sealed:
            return microsteps, None
        st.sealed = True
        mean = sum(st.rewards) / len(st.rewards) if st.rewards else 0.0
        return microsteps, Sealed(step=info.step, microsteps=st.microsteps, executions=st.executions,
                                  groups=len(st.groups_done), zero_variance_groups=st.zero_variance,
                                  excluded=st.excluded, reward_mean=mean)

    def _finalise(self, group: str, step: int) -> list[MicrostepData]:
        self.finalised.add(group)
        st = self.steps.setdefault(step, _Step())
        scored = self.scores[group]
        rewards: dict[str, float | None] = {}
        placeholders = []
        for execution, s in scored.items():
            if s.outcome == "excluded":
                rewards[execution] = None
                st.excluded += 1
            elif s.outcome == "placeholder":
                placeholders.append(execution)
                rewards[execution] = 0.0
                st.rewards.append(0.0)
            else:
                rewards[execution] = float(s.reward)
                st.rewards.append(float(s.reward))
        advantages = group_advantages(rewards, placeholders)
        if all(abs(a) <= ADV_EPS for a in advantages.values()):
            st.zero_variance += 1
        samples = []
        for execution in sorted(advantages):
            tree = self.trees.get(execution)
            if tree is None:
                continue
            if tree.pending:  # their parent never arrived (a call lost on its way): not trained
                log.warning("builder.calls.orphaned", execution=execution, group=group, calls=tree.pending)
            kept = trajectories(tree, j_max=self.j_max, rng=random.Random(f"{self.seed}:{execution}"),
                                max_staleness=self.max_staleness, trained_step=step)
            sample = Sample(execution=execution, advantage=advantages[execution], trajectories=tuple(kept))
            if sample.n_e == 0:
                continue
            st.executions += 1
            samples.append(sample)
        # Executions with A_e = 0 count in |E| but add nothing to the gradient: not packed.
        trained = [s for s in samples if s.advantage != 0.0]
        first = self.reserved.pop(group, st.next_index)
        microsteps = pack(trained, self.token_budget, step=step, first_index=first)
        st.microsteps += len(microsteps)
        st.next_index = max(st.next_index, first + len(microsteps))
        for execution in scored:
            self.trees.pop(execution, None)
        log.info("builder.group.finalised", group=group, step=step, executions=len(scored),
                 trained=len(trained), microsteps=len(microsteps))
        return microsteps
