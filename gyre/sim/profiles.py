"""The workloads `gyre sim` runs: the four fixed profiles of BENCHMARKS.md, the held-out
random ones, and the execution durations every mode of one profile sees alike.

Assumptions (BENCHMARKS.md fixes the rest):
- durations are lognormal, σ = ln(p90 / median) / z_0.9 (z_0.9 = 1.2816), cut at the
  timeout; a `timeout_fraction` of the executions (drawn independently) runs into the
  timeout whatever the lognormal says;
- 32 groups × 16 executions per step unless the profile says otherwise, two micro-steps of
  equal device time per group;
- every cell is equally fast; training one step on one cell takes `train_s`, spread over
  the step's micro-steps;
- a switch costs the same every time (8.52 s rollout→training, 3.46 s training→rollout);
- an engine (and a satellite in training) loads a new policy version in `load_s` = 0 s:
  the reference's figures do not give it, and it is small beside minutes-long executions;
- launching, scoring and packing take no time (the builder announces a group's micro-steps
  when its last execution finishes).
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

Z90 = 1.2815515655446004
MIN = 60.0


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Profile:
    """One simulated workload. Durations in seconds."""

    name: str
    cells: int
    """Cells of the cluster (the core and its satellites)."""
    nodes_per_cell: int
    """Nodes per cell (printed; the model does not use it)."""
    capacity: int
    """C_e: executions one rollout cell serves at once."""
    median_s: float
    """Median of the lognormal execution duration."""
    p90_s: float
    """90th percentile of the lognormal execution duration."""
    timeout_s: float
    """Executions are cut at this duration."""
    timeout_fraction: float
    """Share of executions that run into the timeout regardless of the lognormal."""
    train_s: float
    """Device time to train one step on one cell."""
    steps: int
    groups: int = 32
    group_size: int = 16
    microsteps_per_group: int = 2
    to_training_s: float = 8.52
    """Switch cost rollout → training."""
    to_rollout_s: float = 3.46
    """Switch cost training → rollout."""
    load_s: float = 0.0
    """Time an engine or satellite takes to load a new policy version."""
    staleness: int = 1
    """S."""
    pool: int = 0
    """Standalone rollout pool capacity (executions); none in the fixed profiles."""
    seed: int = 0
    """Seed of the durations."""
    note: str = ""

    def __post_init__(self) -> None:
        if not (0 < self.median_s <= self.p90_s):
            raise ValueError(f"{self.name}: need 0 < median_s <= p90_s, got {self.median_s}, {self.p90_s}")
        if not 0 <= self.timeout_fraction <= 1:
            raise ValueError(f"{self.name}: timeout_fraction must be in [0, 1], got {self.timeout_fraction}")
        if self.cells < 1 or self.capacity < 1 or self.steps < 1:
            raise ValueError(f"{self.name}: cells, capacity and steps must be at least 1")

    @property
    def executions_per_step(self) -> int:
        return self.groups * self.group_size

    @property
    def microsteps(self) -> int:
        return self.groups * self.microsteps_per_group

    @property
    def microstep_s(self) -> float:
        """Device time of one micro-step on one cell."""
        return self.train_s / self.microsteps

    def durations(self) -> np.ndarray:
        """(steps, executions_per_step) float64 seconds; the same for every mode of one profile."""
        rng = np.random.default_rng([self.seed, 0x6779])
        sigma = math.log(self.p90_s / self.median_s) / Z90
        shape = (self.steps, self.executions_per_step)
        d = np.exp(rng.normal(math.log(self.median_s), sigma, size=shape))
        hit = rng.random(shape) < self.timeout_fraction
        return np.where(hit, self.timeout_s, np.minimum(d, self.timeout_s))

    def describe(self) -> dict:
        return dataclasses.asdict(self)


PROFILES: dict[str, Profile] = {p.name: p for p in (
    Profile(name="terminalbench_122b", cells=4, nodes_per_cell=8, capacity=128, median_s=10 * MIN, p90_s=45 * MIN,
            timeout_s=90 * MIN, timeout_fraction=0.0, train_s=40 * MIN, steps=24, seed=1,
            note="TerminalBench, Qwen 3.6 122B"),
    Profile(name="deepswe_122b", cells=4, nodes_per_cell=8, capacity=128, median_s=20 * MIN, p90_s=70 * MIN,
            timeout_s=120 * MIN, timeout_fraction=0.0, train_s=60 * MIN, steps=24, seed=2,
            note="DeepSWE, Qwen 3.6 122B"),
    Profile(name="nl2repo_122b", cells=3, nodes_per_cell=8, capacity=128, median_s=40 * MIN, p90_s=110 * MIN,
            timeout_s=180 * MIN, timeout_fraction=0.0, train_s=90 * MIN, steps=48, groups=24, seed=3,
            note="NL2Repo, Qwen 3.6 122B; 384 executions per step"),
    Profile(name="nl2repo_2p4t", cells=4, nodes_per_cell=48, capacity=128, median_s=45 * MIN, p90_s=80 * MIN,
            timeout_s=90 * MIN, timeout_fraction=0.4, train_s=96 * MIN, steps=48, seed=4,
            note="NL2Repo, Qwen 3.8 2.4T; colocate ≈ 90 min of tail + 96/4 min of training per step"),
)}

REFERENCE: dict[str, dict[str, list[float]]] = {
    "nl2repo_122b": {"speedup_vs_colocate": [1.36, 1.47], "speedup_vs_async": [1.42, 1.53]},
    "deepswe_122b": {"speedup_vs_colocate": [1.61, 1.82], "speedup_vs_async": [1.57, 1.57]},
    "terminalbench_122b": {"speedup_vs_colocate": [1.81, 1.85], "speedup_vs_async": [1.38, 1.43]},
    "nl2repo_2p4t": {"speedup_vs_colocate": [1.21, 1.21], "speedup_vs_async": [1.78, 1.78]},
}
"""The published ratios of the system gyre follows (BENCHMARKS.md "gyre sim")."""

RANDOM_STEPS = 24
"""Steps of a held-out random profile (BENCHMARKS.md does not fix it)."""


def random_profiles(n: int, seed: int) -> list[Profile]:
    """`n` held-out profiles drawn from `seed` (BENCHMARKS.md "gyre sim"): cells 2–8, C_e
    16–128, lognormal median 5–60 min with p90 1.5–4× the median, 0–50% of executions at the
    timeout, training per step 10–120 min on one cell, switch costs 1–20 s each way; 512
    executions per step. Not fixed there, assumed here: the timeout is 1.1–2× the p90 (the
    fixed profiles have 1.1–2×), and each profile runs 24 steps."""
    rng = np.random.default_rng([seed, 0x72616E64])
    out = []
    for i in range(n):
        median = float(rng.uniform(5, 60)) * MIN
        p90 = median * float(rng.uniform(1.5, 4.0))
        out.append(Profile(
            name=f"random_{seed}_{i}", cells=int(rng.integers(2, 9)), nodes_per_cell=0,
            capacity=int(rng.integers(16, 129)), median_s=median, p90_s=p90,
            timeout_s=p90 * float(rng.uniform(1.1, 2.0)), timeout_fraction=float(rng.uniform(0, 0.5)),
            train_s=float(rng.uniform(10, 120)) * MIN, steps=RANDOM_STEPS,
            to_training_s=float(rng.uniform(1, 20)), to_rollout_s=float(rng.uniform(1, 20)),
            seed=int(rng.integers(0, 2**31))))
    return out
