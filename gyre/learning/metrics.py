"""A step's training metrics, summed over micro-steps and replicas.

Every field is a sum (or min/max, or a histogram) so that the metrics of micro-steps
trained by different replicas merge exactly, whatever the split: a satellite returns its
`StepMetrics` with its contribution (`to_dict`), the core `merge`s them, and `summary`
turns the total into what `step.completed` and `metrics.jsonl` carry.

Definitions (DESIGN.md "Learning"; trained tokens are the positions of K_τ):
- loss = Σ micro-step loss sums / |E| (the GSPO loss of the step).
- clip_fraction = trained tokens whose gradient the clip removed / trained tokens.
- ratio_{mean,std,min,max}: of the sequence ratios s_τ over trajectories with |K_τ| > 0.
- kl = mean over trained tokens of (r − 1) − log r, r = π_θ(y_t) / π_old(y_t): the k3
  estimator (Schulman 2020, "Approximating KL divergence") of KL(π_old ‖ π_θ) between the
  behaviour policy and the policy being trained, unbiased for tokens sampled from π_old.
- staleness: trained tokens by staleness = trained step − behaviour policy version.
- microsteps_per_replica: micro-steps each replica trained and had committed.
- phase_s: seconds per phase — `waiting_for_grants` and `forward_backward` summed over
  replicas, `reduction` (pulling and adding contributions), `optimizer`, `checkpoint`.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

PHASES = ("waiting_for_grants", "forward_backward", "reduction", "optimizer", "checkpoint")


@dataclasses.dataclass
class StepMetrics:
    """Mergeable sums of one step (module docstring). Counts are per trained token or trajectory."""

    loss_sum: float = 0.0
    tokens: int = 0
    trajectories: int = 0
    microsteps: int = 0
    clipped: float = 0.0
    ratio_sum: float = 0.0
    ratio_sq_sum: float = 0.0
    ratio_min: float = math.inf
    ratio_max: float = -math.inf
    kl_sum: float = 0.0
    staleness: dict[str, int] = dataclasses.field(default_factory=dict)
    """staleness (as a string, JSON keys) → trained tokens."""
    per_replica: dict[str, int] = dataclasses.field(default_factory=dict)
    phase_s: dict[str, float] = dataclasses.field(default_factory=dict)

    def add_microstep(self, stats: dict[str, float], staleness: dict[int, int], replica: str) -> None:
        """Fold in one micro-step's trainer stats (`Trainer.accumulate`'s dict) trained by `replica`."""
        self.loss_sum += stats["loss_sum"]
        self.tokens += int(stats["tokens"])
        self.trajectories += int(stats["trajectories"])
        self.microsteps += 1
        self.clipped += stats["clipped"]
        self.ratio_sum += stats["ratio_sum"]
        self.ratio_sq_sum += stats["ratio_sq_sum"]
        if stats["trajectories"]:
            self.ratio_min = min(self.ratio_min, stats["ratio_min"])
            self.ratio_max = max(self.ratio_max, stats["ratio_max"])
        self.kl_sum += stats["kl_sum"]
        for s, n in staleness.items():
            self.staleness[str(s)] = self.staleness.get(str(s), 0) + int(n)
        self.per_replica[replica] = self.per_replica.get(replica, 0) + 1

    def add_time(self, phase: str, seconds: float) -> None:
        """Add `seconds` to `phase` (one of PHASES). Raises ValueError for another name."""
        if phase not in PHASES:
            raise ValueError(f"unknown phase {phase!r}; phases are {PHASES}")
        self.phase_s[phase] = self.phase_s.get(phase, 0.0) + seconds

    def merge(self, other: StepMetrics) -> None:
        """Add `other` (another replica's micro-steps of the same step) into self."""
        self.loss_sum += other.loss_sum
        self.tokens += other.tokens
        self.trajectories += other.trajectories
        self.microsteps += other.microsteps
        self.clipped += other.clipped
        self.ratio_sum += other.ratio_sum
        self.ratio_sq_sum += other.ratio_sq_sum
        self.ratio_min = min(self.ratio_min, other.ratio_min)
        self.ratio_max = max(self.ratio_max, other.ratio_max)
        self.kl_sum += other.kl_sum
        for table, theirs in ((self.staleness, other.staleness), (self.per_replica, other.per_replica)):
            for k, v in theirs.items():
                table[k] = table.get(k, 0) + v
        for k, v in other.phase_s.items():
            self.phase_s[k] = self.phase_s.get(k, 0.0) + v

    def to_dict(self) -> dict:
        """JSON-safe (infinite extremes become None)."""
        out = dataclasses.asdict(self)
        for k in ("ratio_min", "ratio_max"):
            out[k] = None if math.isinf(out[k]) else out[k]
        return out

    @classmethod
    def from_dict(cls, d: dict) -> StepMetrics:
        """Inverse of `to_dict`. Raises ValueError naming a missing or mistyped field."""
        try:
            return cls(loss_sum=float(d["loss_sum"]), tokens=int(d["tokens"]), trajectories=int(d["trajectories"]),
                       microsteps=int(d["microsteps"]), clipped=float(d["clipped"]), ratio_sum=float(d["ratio_sum"]),
                       ratio_sq_sum=float(d["ratio_sq_sum"]),
                       ratio_min=math.inf if d["ratio_min"] is None else float(d["ratio_min"]),
                       ratio_max=-math.inf if d["ratio_max"] is None else float(d["ratio_max"]),
                       kl_sum=float(d["kl_sum"]), staleness={str(k): int(v) for k, v in d["staleness"].items()},
                       per_replica={str(k): int(v) for k, v in d["per_replica"].items()},
                       phase_s={str(k): float(v) for k, v in d.get("phase_s", {}).items()})
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ValueError(f"bad step metrics: {exc!r}") from None

    def summary(self, executions: int) -> dict:
        """What a practitioner reads (module docstring); executions = |E| (at least 1)."""
        n = self.trajectories
        mean = self.ratio_sum / n if n else 1.0
        var = max(self.ratio_sq_sum / n - mean * mean, 0.0) if n else 0.0
        return {
            "loss": self.loss_sum / max(executions, 1),
            "clip_fraction": self.clipped / self.tokens if self.tokens else 0.0,
            "ratio_mean": mean, "ratio_std": math.sqrt(var),
            "ratio_min": self.ratio_min if n else 1.0, "ratio_max": self.ratio_max if n else 1.0,
            "kl": self.kl_sum / self.tokens if self.tokens else 0.0,
            "tokens": self.tokens, "trajectories": self.trajectories, "microsteps": self.microsteps,
            "microsteps_per_replica": dict(sorted(self.per_replica.items())),
            "staleness_histogram": dict(sorted(self.staleness.items(), key=lambda kv: int(kv[0]))),
            "phase_s": {p: round(self.phase_s.get(p, 0.0), 6) for p in PHASES},
        }


def staleness_of(step: int, versions: np.ndarray, loss_mask: np.ndarray) -> dict[int, int]:
    """Trained tokens by staleness (step − behaviour version) of one micro-step.

    versions: (T,) int32 behaviour version per position (-1 on context); loss_mask: (T,) bool.
    """
    trained = versions[loss_mask]
    if trained.size == 0:
        return {}
    values, counts = np.unique(step - trained.astype(np.int64), return_counts=True)
    return {int(v): int(c) for v, c in zip(values, counts)}
