"""Samples → packed micro-steps, and the micro-step's compact binary format.

Contract:
- A `Sample` is the kept trajectories of one execution with its advantage A_e; its
  N_e = Σ_τ |K_τ| over those trajectories (DESIGN.md "Learning").
- `pack(samples, token_budget)` fills micro-steps in order. A trajectory is never split;
  the budget is a soft cap on *distinct* positions — a trajectory costs its length minus
  the longest token prefix (of at least `shared_min_tokens`) it shares with a trajectory
  already in the micro-step, because the trainer runs a shared prefix once (`gyre.learning.trainer.prefix_forest`; DESIGN.md
  "Trajectory processing": shared tokens are computed once) — so an execution's kept
  trajectories, which arrive together and share their system prompt, tend to land in one
  micro-step. A trajectory that would overflow a non-empty micro-step opens the next one,
  and a trajectory longer than the budget gets a micro-step of its own. Every
  trajectory records its execution, A_e and N_e (the whole step's N_e, even when the
  execution's trajectories land in several micro-steps), so loss denominators are exact.
- `to_bytes` / `from_bytes`: a safetensors blob (tensors little-endian, header JSON) with
  the metadata under `__metadata__` (`format`, `step`, `index`, `executions`, `roles`,
  `leaves`). To stay small (≈ 4–9 bytes per token) the loss mask is bit-packed, behaviour
  log-probs are stored only at loss positions, and per-token versions and temperatures are
  run-length encoded; `from_bytes` restores the dense arrays. In memory,
  `MicrostepData.behaviour_logprobs` is 0 wherever `loss_mask` is False.

Tensors in the blob (int32 unless noted): `input_ids (T,)`, `cu_seqlens (n+1,)`,
`loss_mask_bits (ceil(T/8),) uint8`, `behaviour_logprobs (K,) float32` (at loss positions
in order), `versions_values / versions_starts`, `temperatures_values float32 /
temperatures_starts`, `traj_execution (n,)`, `advantages (n,) float32`, `n_e (n,) float32`.
"""
from __future__ import annotations

import dataclasses
import json
import struct

import numpy as np
from safetensors.numpy import save as _st_save

from gyre.trajectory.tree import Trajectory

FORMAT = "gyre.microstep.v1"
SHARED_PREFIX_MIN_TOKENS = 64  # the trainer's default: shorter common prefixes are recomputed


class MicrostepFormatError(ValueError):
    """A blob is not a valid micro-step (wrong format tag, bad header or inconsistent arrays)."""


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class Sample:
    """The kept trajectories of one execution (≤ J_max) with its advantage A_e."""

    execution: str
    advantage: float
    trajectories: tuple[Trajectory, ...]

    @property
    def n_e(self) -> int:
        """N_e: trained tokens of the execution over all its kept trajectories."""
        return sum(t.n_trained for t in self.trajectories)


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class MicrostepData:
    """One packed micro-step: n trajectories concatenated into T token positions.

    executions: distinct execution ids, indexed by `traj_execution`.
    input_ids: (T,) int32. cu_seqlens: (n+1,) int32 trajectory boundaries, cu_seqlens[0] = 0.
    loss_mask: (T,) bool. behaviour_logprobs: (T,) float32, 0 where loss_mask is False.
    temperatures: (T,) float32 sampling temperature (1.0 on context). versions: (T,) int32
      behaviour policy version (-1 on context).
    traj_execution: (n,) int32 index into `executions`. advantages: (n,) float32 A_e.
    n_e: (n,) float32 N_e of the trajectory's execution over the whole step.
    roles / leaves: per trajectory, the leaf's role and call id (diagnostics).
    """

    step: int
    index: int
    executions: tuple[str, ...]
    input_ids: np.ndarray
    cu_seqlens: np.ndarray
    loss_mask: np.ndarray
    behaviour_logprobs: np.ndarray
    temperatures: np.ndarray
    versions: np.ndarray
    traj_execution: np.ndarray
    advantages: np.ndarray
    n_e: np.ndarray
    roles: tuple[str, ...] = ()
    leaves: tuple[str, ...] = ()

    @property
    def n_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def n_trained(self) -> int:
        return int(np.count_nonzero(self.loss_mask))

    @property
    def n_trajectories(self) -> int:
        return int(self.cu_seqlens.shape[0] - 1)

    def seq_index(self) -> np.ndarray:
        """(T,) int64 trajectory index of each position."""
        return np.repeat(np.arange(self.n_trajectories, dtype=np.int64), np.diff(self.cu_seqlens))

    def execution_summary(self) -> list[tuple[str, int, float]]:
        """(execution, N_e, A_e) of each execution inside, in `executions` order."""
        out = []
        for i, execution in enumerate(self.executions):
            j = int(np.flatnonzero(self.traj_execution == i)[0])
            out.append((execution, int(self.n_e[j]), float(self.advantages[j])))
        return out


def pack(samples: list[Sample], token_budget: int, *, step: int = 0, first_index: int = 0,
         shared_min_tokens: int = SHARED_PREFIX_MIN_TOKENS) -> list[MicrostepData]:
    """Pack samples' trajectories into micro-steps of about `token_budget` distinct positions.

    shared_min_tokens: a common prefix counts once only when it is at least this long — the
    trainer's `TrainerConfig.shared_prefix_min_tokens`, below which it recomputes a prefix;
    0 counts every position (a trainer that does not share prefixes).

    Trajectories with |K_τ| = 0 are dropped (they would contribute nothing). Samples with
    no trajectory are skipped. Micro-steps are numbered from `first_index`.
    Raises ValueError when token_budget < 1.
    """
    if token_budget < 1:
        raise ValueError(f"token_budget must be >= 1, got {token_budget}")
    groups: list[list[tuple[Sample, Trajectory]]] = []
    current: list[tuple[Sample, Trajectory]] = []
    size = 0
    for sample in samples:
        for traj in sample.trajectories:
            if traj.n_trained == 0:
                continue
            cost = len(traj)
            if shared_min_tokens:
                shared = max((common_prefix(traj.input_ids, t.input_ids) for _, t in current), default=0)
                cost -= shared if shared >= shared_min_tokens else 0
            if current and size + cost > token_budget:
                groups.append(current)
                current, size, cost = [], 0, len(traj)
            current.append((sample, traj))
            size += cost
    if current:
        groups.append(current)
    return [_build(g, step, first_index + i) for i, g in enumerate(groups)]


def common_prefix(x: np.ndarray, y: np.ndarray) -> int:
    """Length of the longest common prefix of two 1-D id arrays."""
    n = min(x.shape[0], y.shape[0])
    diff = np.flatnonzero(x[:n] != y[:n])
    return int(diff[0]) if diff.size else n


def _build(items: list[tuple[Sample, Trajectory]], step: int, index: int) -> MicrostepData:
    executions: list[str] = []
    where: dict[str, int] = {}
    traj_execution, advantages, n_e = [], [], []
    for sample, _ in items:
        if sample.execution not in where:
            where[sample.execution] = len(executions)
            executions.append(sample.execution)
        traj_execution.append(where[sample.execution])
        advantages.append(sample.advantage)
        n_e.append(sample.n_e)
    trajs = [t for _, t in items]
    lengths = np.array([len(t) for t in trajs], dtype=np.int64)
    cu = np.zeros(len(trajs) + 1, dtype=np.int32)
    np.cumsum(lengths, out=cu[1:])
    mask = np.concatenate([t.loss_mask for t in trajs]).astype(bool)
    lp = np.concatenate([t.behaviour_logprobs for t in trajs]).astype(np.float32)
    lp[~mask] = 0.0
    return MicrostepData(
        step=step, index=index, executions=tuple(executions),
        input_ids=np.concatenate([t.input_ids for t in trajs]).astype(np.int32),
        cu_seqlens=cu, loss_mask=mask, behaviour_logprobs=lp,
        temperatures=np.concatenate([t.temperatures for t in trajs]).astype(np.float32),
        versions=np.concatenate([t.versions for t in trajs]).astype(np.int32),
        traj_execution=np.asarray(traj_execution, dtype=np.int32),
        advantages=np.asarray(advantages, dtype=np.float32),
        n_e=np.asarray(n_e, dtype=np.float32),
        roles=tuple(t.role for t in trajs), leaves=tuple(t.leaf for t in trajs),
    )


def to_bytes(ms: MicrostepData) -> bytes:
    """Serialise a micro-step (safetensors + JSON metadata; see the module docstring)."""
    v_values, v_starts = _rle(ms.versions)
    t_values, t_starts = _rle(ms.temperatures)
    tensors = {
        "input_ids": np.ascontiguousarray(ms.input_ids, dtype=np.int32),
        "cu_seqlens": np.ascontiguousarray(ms.cu_seqlens, dtype=np.int32),
        "loss_mask_bits": np.packbits(ms.loss_mask.astype(bool)),
        "behaviour_logprobs": np.ascontiguousarray(ms.behaviour_logprobs[ms.loss_mask], dtype=np.float32),
        "versions_values": v_values.astype(np.int32),
        "versions_starts": v_starts,
        "temperatures_values": t_values.astype(np.float32),
        "temperatures_starts": t_starts,
        "traj_execution": np.ascontiguousarray(ms.traj_execution, dtype=np.int32),
        "advantages": np.ascontiguousarray(ms.advantages, dtype=np.float32),
        "n_e": np.ascontiguousarray(ms.n_e, dtype=np.float32),
    }
    metadata = {
        "format": FORMAT,
        "step": str(ms.step),
        "index": str(ms.index),
        "executions": json.dumps(list(ms.executions)),
        "roles": json.dumps(list(ms.roles)),
        "leaves": json.dumps(list(ms.leaves)),
    }
    return _st_save(tensors, metadata=metadata)


def from_bytes(data: bytes) -> MicrostepData:
    """Inverse of `to_bytes`. Raises MicrostepFormatError on a malformed blob."""
    from safetensors.numpy import load

    meta = _metadata(data)
    if meta.get("format") != FORMAT:
        raise MicrostepFormatError(f"format tag is {meta.get('format')!r}, expected {FORMAT!r}")
    try:
        t = load(data)
        ids = t["input_ids"]
        n = ids.shape[0]
        mask = np.unpackbits(t["loss_mask_bits"], count=n).astype(bool)
        lp = np.zeros(n, dtype=np.float32)
        lp[mask] = t["behaviour_logprobs"]
        ms = MicrostepData(
            step=int(meta["step"]), index=int(meta["index"]),
            executions=tuple(json.loads(meta["executions"])),
            input_ids=ids, cu_seqlens=t["cu_seqlens"], loss_mask=mask, behaviour_logprobs=lp,
            temperatures=_unrle(t["temperatures_values"], t["temperatures_starts"], n),
            versions=_unrle(t["versions_values"], t["versions_starts"], n),
            traj_execution=t["traj_execution"], advantages=t["advantages"], n_e=t["n_e"],
            roles=tuple(json.loads(meta.get("roles", "[]"))), leaves=tuple(json.loads(meta.get("leaves", "[]"))),
        )
    except (KeyError, ValueError, TypeError) as exc:
        raise MicrostepFormatError(f"malformed micro-step: {exc}") from None
    if int(ms.cu_seqlens[-1]) != n or ms.traj_execution.shape[0] != ms.n_trajectories:
        raise MicrostepFormatError("cu_seqlens or traj_execution disagree with the token count")
    return ms


def _metadata(data: bytes) -> dict[str, str]:
    # safetensors layout: u64 little-endian header length, then the JSON header.
    if len(data) < 8:
        raise MicrostepFormatError("blob shorter than a safetensors header")
    (n,) = struct.unpack("<Q", data[:8])
    try:
        header = json.loads(data[8:8 + n])
    except ValueError as exc:
        raise MicrostepFormatError(f"bad safetensors header: {exc}") from None
    return header.get("__metadata__") or {}


def _rle(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Run-length encoding: (values, starts int32) with starts[0] = 0."""
    if a.shape[0] == 0:
        return a[:0], np.zeros(0, dtype=np.int32)
    starts = np.concatenate([[0], np.flatnonzero(a[1:] != a[:-1]) + 1]).astype(np.int32)
    return a[starts], starts


def _unrle(values: np.ndarray, starts: np.ndarray, n: int) -> np.ndarray:
    if n == 0:
        return values[:0].copy()
    counts = np.diff(np.append(starts.astype(np.int64), n))
    return np.repeat(values, counts)
