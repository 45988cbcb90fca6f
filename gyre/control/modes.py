"""The baselines, each in its classic and its strongest form (DESIGN.md "Staleness",
BENCHMARKS.md "gyre bench modes"), as policies over the shared view of
`gyre.control.policy`:

- `colocate`: every cell rolls out burst k; when all of it has finished, every cell
  switches to training and trains step k; when step k is completed, every cell returns and
  burst k+1 is dispatched. One burst per phase.
- `colocate_overlapped`: the same phases, but a rollout phase dispatches every burst the
  staleness gate allows. The phase ends when its oldest burst has finished; executions of
  newer bursts still running are paused for the training phase (no cell serves then) and
  resume first when the cells return.
- `async`: a fixed whole-cell split: the first `len(cells) − rollout_cells` cells (the core
  first) train, the others roll out; bursts are dispatched as soon as the gate and capacity
  allow; training is streamed group by group (a step is open for claims as soon as the
  previous one is completed).
- `async_nonstreaming`: the same, but a step is open for claims only once it is sealed
  (every group in).

`make_policy(mode, config, **options)` builds any mode, elastic included.
"""
from __future__ import annotations

from gyre.control.facts import Action
from gyre.control.policy import Policy, PolicyConfig


class Colocate(Policy):
    """Classic colocate: one burst per phase; all cells switch together."""

    mode = "colocate"

    def all_serving(self) -> bool:
        return all(self.serving(c) for c in self.cfg.cells)

    def decide(self) -> list[Action]:
        actions: list[Action] = []
        k = self.completed
        training = [c for c in self.cfg.cells if self.target.get(c, self.role[c]) == "training"]
        if training and self.opened < k:
            # step k-1 is completed: every cell returns (also one whose switch is in flight)
            return self.switch(training, "rollout", "step completed")
        if training:
            return actions  # training phase
        if self.all_serving():
            self.release(self.phase_bursts())
        actions += self.admit()
        if self.burst_finished(k) and self.opened < k and self.all_serving():
            actions += self.to_training(k)
        return actions

    def phase_bursts(self) -> int:
        """The last burst this phase may release."""
        return self.completed

    def to_training(self, k: int) -> list[Action]:
        return self.switch(list(self.cfg.cells), "training", f"burst {k} finished") + self.open_step(k)


class ColocateOverlapped(Colocate):
    """Colocate whose rollout phase dispatches every burst the staleness gate allows.

    Phase j rolls out bursts k … k+S (k the oldest step not trained), all of them to the
    end, then every cell trains steps k … k+S in turn, then every cell returns. With
    `interrupt`, the rollout phase ends as soon as burst k has finished; newer executions
    still running are paused through the training phase (which then trains step k only)
    and resume first when the cells return.
    """

    mode = "colocate_overlapped"

    def __init__(self, config: PolicyConfig, *, interrupt: bool = False) -> None:
        super().__init__(config)
        self.interrupt = interrupt
        self.phase_end = -1  # the last step of the current training phase

    def options(self) -> dict:
        return {"interrupt": self.interrupt} if self.interrupt else {}

    def decide(self) -> list[Action]:
        if self.interrupt:
            return super().decide()
        actions: list[Action] = []
        k = self.completed
        training = [c for c in self.cfg.cells if self.target.get(c, self.role[c]) == "training"]
        if training:
            if k <= self.phase_end:
                return self.open_step(k)  # the next step of this training phase
            return self.switch(training, "rollout", "phase trained")
        if self.all_serving():
            if self.released == k:
                self.release(k + self.cfg.staleness)
            actions += self.admit()
            if self.released > k and all(self.burst_finished(j) for j in range(k, self.released)):
                self.phase_end = self.released - 1
                actions += self.to_training(k)
        return actions

    def phase_bursts(self) -> int:
        return self.completed + self.cfg.staleness


class Async(Policy):
    """A fixed split: `rollout_cells` cells roll out, the others (core first) train."""

    mode = "async"

    def __init__(self, config: PolicyConfig, *, rollout_cells: int, streaming: bool = True) -> None:
        super().__init__(config)
        n = len(config.cells)
        if not 1 <= rollout_cells < n:
            raise ValueError(f"async needs 1 <= rollout_cells < {n} cells, got {rollout_cells}")
        self.rollout_cells = rollout_cells
        self.streaming = streaming
        self.trainers = config.cells[:n - rollout_cells]
        if not streaming:
            self.mode = "async_nonstreaming"

    def options(self) -> dict:
        return {"rollout_cells": self.rollout_cells}

    @property
    def split(self) -> str:
        """`<rollout>+<training>` cells, e.g. `3+1`."""
        return f"{self.rollout_cells}+{len(self.trainers)}"

    def placeable(self, engine: str) -> bool:
        return engine not in self.trainers

    def decide(self) -> list[Action]:
        actions: list[Action] = []
        # the training cells leave rollout once, serially, core first
        if not any(self.target.get(c) == "training" for c in self.trainers):
            for c in self.trainers:
                if self.role[c] == "rollout" and c not in self.target:
                    actions += self.switch(c, "training", "async split")
                    break
        self.release(self.completed + self.cfg.staleness)
        actions += self.admit()
        k = self.completed
        if self.streaming or k in self.sealed:
            actions += self.open_step(k)
        return actions


def make_policy(mode: str, config: PolicyConfig, **options) -> Policy:
    """A policy of `mode`: `elastic` (options: see `ElasticPolicy`), `colocate`,
    `colocate_overlapped`, `async` and `async_nonstreaming` (option `rollout_cells`)."""
    from gyre.control.elastic import ElasticPolicy

    if mode == "elastic":
        return ElasticPolicy(config, **options)
    if mode == "colocate":
        return Colocate(config, **options)
    if mode == "colocate_overlapped":
        return ColocateOverlapped(config, **options)
    if mode in ("async", "async_nonstreaming"):
        return Async(config, streaming=mode == "async", **options)
    raise ValueError(f"unknown mode {mode!r}; modes: {', '.join(MODES)}")


MODES = ("elastic", "colocate", "colocate_overlapped", "async", "async_nonstreaming")
