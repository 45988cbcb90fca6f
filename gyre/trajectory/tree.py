"""Calls → trajectory tree → kept trajectories with loss masks (DESIGN.md "Trajectory processing").

Contract:
- `CallTree(execution)` collects the `call.completed` events of one execution. `add` is
  idempotent (a redelivered call id changes nothing) and order-free (a child that arrives
  before its parent is held until the parent arrives). The full sequence of a call is
  ``full(parent)[:prefix_len] + prompt_ids + completion_ids``.
- Auxiliary-role calls and calls whose status is not ``ok`` never become leaves and are
  never trained; their ids are kept as *context* only, so that a call extending one of them
  can still be reconstructed. A call whose `prefix_len` exceeds its parent's full length,
  or whose version spans do not cover its completion, is *invalid*: it and its
  descendants are dropped and counted (`CallTree.invalid`).
- `trajectories(tree, ...)` keeps at most `j_max` root-to-leaf paths: from the
  highest-priority role (`ROLE_PRIORITY`) that still has unmasked trainable tokens, pick a
  leaf with probability proportional to its unmasked trainable tokens, keep its path, mask
  the path's tokens everywhere, repeat. A policy token is therefore trained by exactly one
  kept trajectory; tokens beyond the staleness bound (trained_step − version >
  max_staleness) are never trained and are counted.

Storage is array-based: every call's new ids (prompt + completion) occupy one contiguous
range of a per-execution token store; a path is a short list of store ranges (one per
ancestor), so masks and counts are numpy operations over the store, never per-token Python.
"""
from __future__ import annotations

import dataclasses
import random

import numpy as np
import structlog

from schemas.call import CallCompleted, CallTokens

log = structlog.get_logger()

ROLE_PRIORITY: tuple[str, ...] = ("main", "main-summary", "sub-agent", "sub-agent-summary")
"""Leaf roles in sampling priority order; any other role (`auxiliary`) is never trained."""

J_MAX = 5
"""Default cap on kept trajectories per execution (DESIGN.md)."""


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class Trajectory:
    """One kept root-to-leaf token sequence of an execution.

    execution: execution id. leaf: call id of the leaf. role: the leaf's role.
    input_ids: (T,) int32 token ids of the full sequence.
    loss_mask: (T,) bool, True on the policy tokens this trajectory trains (K_τ).
    behaviour_logprobs: (T,) float32, natural-log behaviour log-prob of policy tokens, 0 on context.
    versions: (T,) int32 policy version that produced each token, -1 on context.
    temperatures: (T,) float32 sampling temperature of the call that produced each policy
      token; 1.0 on context (never used there).
    n_stale: policy tokens of this path masked because they are beyond the staleness bound
      (each counted once per execution, by the first kept trajectory that contains it).
    """

    execution: str
    leaf: str
    role: str
    input_ids: np.ndarray
    loss_mask: np.ndarray
    behaviour_logprobs: np.ndarray
    versions: np.ndarray
    temperatures: np.ndarray
    n_stale: int = 0

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def n_trained(self) -> int:
        """|K_τ|: number of positions carrying loss."""
        return int(np.count_nonzero(self.loss_mask))


@dataclasses.dataclass(slots=True)
class _Node:
    call: str
    seq: int
    role: str
    trained: bool  # status ok and a trainable role; False = context only
    parent: str | None
    prefix_len: int
    start: int  # offset of this call's new ids in the token store
    n_new: int  # prompt + completion ids of this call
    full_len: int  # prefix_len + n_new
    covered: bool = False  # a trained child of the same role extends the whole full sequence


class CallTree:
    """The trajectory tree of one execution, built from `call.completed` events.

    Raises ValueError from `add` when the call belongs to another execution, or when its
    arrays live in the object store (`tokens_ref`) and no `tokens` were passed.
    """

    def __init__(self, execution: str) -> None:
        self.execution = execution
        self._nodes: dict[str, _Node] = {}
        self._pending: dict[str, list[tuple[CallCompleted, CallTokens]]] = {}
        self._pending_ids: set[str] = set()
        self.invalid: set[str] = set()
        self._chunks: list[tuple[np.ndarray, ...]] = []
        self._size = 0
        self._arrays: tuple[np.ndarray, ...] | None = None

    # -- building -------------------------------------------------------------------
    def add(self, call: CallCompleted, tokens: CallTokens | None = None) -> bool:
        """Add one call; returns False when its id was seen before (redelivery), else True.

        tokens: the call's arrays when the event carries `tokens_ref` (fetched by the caller).
        """
        if call.execution != self.execution:
            raise ValueError(f"call {call.call} belongs to execution {call.execution!r}, not {self.execution!r}")
        if call.call in self._nodes or call.call in self._pending_ids or call.call in self.invalid:
            return False
        if tokens is None:
            if call.tokens_ref is not None:
                raise ValueError(f"call {call.call} has tokens_ref {call.tokens_ref!r}; pass its tokens")
            tokens = call.tokens
        parent = call.parent_call
        if parent is not None and parent not in self._nodes and parent not in self.invalid:
            self._pending.setdefault(parent, []).append((call, tokens))
            self._pending_ids.add(call.call)
            return True
        stack = [(call, tokens)]
        while stack:
            c, t = stack.pop()
            self._pending_ids.discard(c.call)
            self._insert(c, t)
            stack.extend(self._pending.pop(c.call, ()))
        return True

    def _insert(self, call: CallCompleted, tokens: CallTokens) -> None:
        bind = log.bind(execution=self.execution, call=call.call)
        parent = self._nodes.get(call.parent_call) if call.parent_call is not None else None
        if call.parent_call is not None and parent is None:
            self.invalid.add(call.call)
            bind.warning("trajectory.call.invalid", reason="parent invalid")
            return
        if parent is not None and call.prefix_len > parent.full_len:
            self.invalid.add(call.call)
            bind.warning("trajectory.call.invalid", reason="prefix_len beyond parent", prefix_len=call.prefix_len, parent_len=parent.full_len)
            return
        prompt = _array(tokens.prompt_ids, np.int32)
        completion = _array(tokens.completion_ids, np.int32)
        lp = _array(tokens.logprobs, np.float32)
        n_p, n_c = prompt.shape[0], completion.shape[0]
        spans = np.asarray(call.versions, dtype=np.int64).reshape(-1, 3)
        if lp.shape[0] != n_c or not _spans_cover(spans, n_c):
            self.invalid.add(call.call)
            bind.warning("trajectory.call.invalid", reason="log-probs or version spans do not match the completion")
            return
        trained = call.status == "ok" and call.role in ROLE_PRIORITY
        n_new = n_p + n_c
        ids = np.concatenate([prompt, completion])
        policy = np.zeros(n_new, dtype=bool)
        logp = np.zeros(n_new, dtype=np.float32)
        version = np.full(n_new, -1, dtype=np.int32)
        temp = np.ones(n_new, dtype=np.float32)
        if trained and n_c:
            policy[n_p:] = True
            logp[n_p:] = lp
            version[n_p:] = np.repeat(spans[:, 2], spans[:, 1] - spans[:, 0]).astype(np.int32)
            temp[n_p:] = call.sampling.logprob_temperature  # 1.0 for greedy calls
            if parent is None and n_p == 0:
                policy[0] = False  # the very first token of a sequence has no context to predict it from
        self._chunks.append((ids, policy, logp, version, temp))
        self._arrays = None
        full_len = call.prefix_len + n_new
        self._nodes[call.call] = _Node(
            call=call.call, seq=call.seq, role=call.role, trained=trained, parent=call.parent_call,
            prefix_len=call.prefix_len, start=self._size, n_new=n_new, full_len=full_len,
        )
        self._size += n_new
        if trained and parent is not None and call.prefix_len == parent.full_len and call.role == parent.role:
            # A child of another role (Claude Code's compaction request extends the main line's
            # last call) leaves its parent a leaf of its own role: role priority keeps the main
            # line first, and masking trains the shared tokens once.
            parent.covered = True

    # -- inspection -----------------------------------------------------------------
    def __len__(self) -> int:
        """Calls placed in the tree (context-only calls included, pending ones not)."""
        return len(self._nodes)

    def __contains__(self, call: str) -> bool:
        return call in self._nodes

    @property
    def pending(self) -> int:
        """Calls held because their parent has not arrived yet."""
        return len(self._pending_ids)

    @property
    def n_tokens(self) -> int:
        """Distinct ids recorded for the execution (sum of every placed call's new ids)."""
        return self._size

    def leaves(self) -> list[str]:
        """Call ids of the leaves: trained calls whose full sequence no trained call of the
        same role extends."""
        return [n.call for n in sorted(self._nodes.values(), key=lambda n: n.seq) if n.trained and not n.covered]

    def role(self, call: str) -> str:
        """Role of a placed call."""
        return self._nodes[call].role

    def path_ranges(self, call: str) -> np.ndarray:
        """(k, 2) int64 store ranges [start, end) whose concatenation is full(call)."""
        node = self._nodes[call]
        limit = node.full_len
        ranges = []
        while True:
            if limit > node.prefix_len:
                ranges.append((node.start, node.start + (limit - node.prefix_len)))
                limit = node.prefix_len
            if node.parent is None:
                break
            node = self._nodes[node.parent]
        return np.asarray(ranges[::-1], dtype=np.int64).reshape(-1, 2)

    def path_index(self, call: str) -> np.ndarray:
        """(T,) int64 store indices of full(call), in order (index the `arrays()` columns with it)."""
        return _gather_index(self.path_ranges(call))

    def full_ids(self, call: str) -> np.ndarray:
        """(T,) int32 full sequence of any placed call."""
        ids = self.arrays()[0]
        return ids[self.path_index(call)]

    def arrays(self) -> tuple[np.ndarray, ...]:
        """The token store: (ids int32, policy bool, logp float32, version int32, temperature float32)."""
        if self._arrays is None:
            if self._chunks:
                self._arrays = tuple(np.concatenate(col) for col in zip(*self._chunks))
            else:
                self._arrays = (
                    np.zeros(0, np.int32), np.zeros(0, bool), np.zeros(0, np.float32),
                    np.zeros(0, np.int32), np.zeros(0, np.float32),
                )
            self._chunks = [self._arrays]
        return self._arrays

    def stale_mask(self, trained_step: int | None, max_staleness: int | None) -> np.ndarray:
        """(store,) bool: policy tokens with trained_step − version > max_staleness."""
        _, policy, _, version, _ = self.arrays()
        if max_staleness is None:
            return np.zeros_like(policy)
        if trained_step is None:
            raise ValueError("max_staleness needs trained_step (the step being packed for)")
        return policy & ((trained_step - version.astype(np.int64)) > max_staleness)

    def stale_tokens(self, trained_step: int, max_staleness: int) -> int:
        """Policy tokens of the whole execution beyond the staleness bound (a bug signal)."""
        return int(np.count_nonzero(self.stale_mask(trained_step, max_staleness)))


def build_tree(execution: str, calls) -> CallTree:
    """A `CallTree` from an iterable of `CallCompleted` (inline tokens), in any order."""
    tree = CallTree(execution)
    for call in calls:
        tree.add(call)
    return tree


def trajectories(
    tree: CallTree,
    *,
    j_max: int | None = J_MAX,
    rng: random.Random | None = None,
    max_staleness: int | None = None,
    trained_step: int | None = None,
) -> list[Trajectory]:
    """Keep ≤ j_max trajectories of `tree` by role-priority sampling (DESIGN.md).

    j_max: cap on kept trajectories; None = keep until nothing trainable is left (at most
      one trajectory per leaf). rng: source of the leaf choice; default
      `random.Random(execution)` so a rebuild keeps the same trajectories.
    max_staleness / trained_step: mask policy tokens with trained_step − version >
      max_staleness (DESIGN.md "Staleness"); both or neither.
    Returns the kept trajectories in the order they were kept; each has |K_τ| ≥ 1.
    Raises ValueError when j_max < 1 or max_staleness is given without trained_step.
    """
    if j_max is not None and j_max < 1:
        raise ValueError(f"j_max must be >= 1 or None, got {j_max}")
    rng = rng if rng is not None else random.Random(tree.execution)
    ids, policy, logp, version, temp = tree.arrays()
    stale = tree.stale_mask(trained_step, max_staleness)
    trainable = policy & ~stale
    leaves = tree.leaves()
    if not leaves:
        return []
    paths = [tree.path_ranges(leaf) for leaf in leaves]
    seg_leaf = np.repeat(np.arange(len(leaves)), [p.shape[0] for p in paths])
    segs = np.concatenate(paths)
    roles = np.array([ROLE_PRIORITY.index(tree.role(leaf)) for leaf in leaves])
    taken = np.zeros(ids.shape[0], dtype=bool)  # trained by a kept trajectory
    counted = np.zeros(ids.shape[0], dtype=bool)  # stale tokens already reported
    kept: list[Trajectory] = []
    cs = np.zeros(ids.shape[0] + 1, dtype=np.int64)  # cs[i] = available tokens before store index i
    while j_max is None or len(kept) < j_max:
        avail = trainable & ~taken
        np.cumsum(avail, out=cs[1:])
        counts = np.bincount(seg_leaf, weights=cs[segs[:, 1]] - cs[segs[:, 0]], minlength=len(leaves))
        live = counts > 0
        if not live.any():
            break
        top = roles[live].min()
        cand = np.flatnonzero(live & (roles == top))
        weights = np.cumsum(counts[cand])
        pick = int(cand[min(int(np.searchsorted(weights, rng.random() * weights[-1], side="right")), len(cand) - 1)])
        idx = _gather_index(paths[pick])
        mask = avail[idx]
        taken[idx[mask]] = True
        stale_here = stale[idx] & ~counted[idx]
        counted[idx[stale_here]] = True
        leaf = leaves[pick]
        kept.append(Trajectory(
            execution=tree.execution, leaf=leaf, role=tree.role(leaf), input_ids=ids[idx], loss_mask=mask,
            behaviour_logprobs=logp[idx], versions=version[idx], temperatures=temp[idx],
            n_stale=int(np.count_nonzero(stale_here)),
        ))
    n_stale = sum(t.n_stale for t in kept)
    if n_stale:
        log.warning("trajectory.stale_masked", execution=tree.execution, tokens=n_stale,
                    trained_step=trained_step, max_staleness=max_staleness)
    return kept


def _array(values, dtype) -> np.ndarray:
    """(n,) array of a token or log-prob sequence; decoded events hold tuples of Python
    numbers, which np.fromiter converts faster than np.asarray."""
    if isinstance(values, (tuple, list)):
        return np.fromiter(values, dtype, len(values))
    return np.asarray(values, dtype=dtype).reshape(-1)


def _gather_index(ranges: np.ndarray) -> np.ndarray:
    """(T,) int64 store indices of the concatenated ranges [start, end)."""
    lengths = ranges[:, 1] - ranges[:, 0]
    total = int(lengths.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    offsets = np.cumsum(lengths) - lengths
    return np.repeat(ranges[:, 0] - offsets, lengths) + np.arange(total, dtype=np.int64)


def _spans_cover(spans: np.ndarray, n: int) -> bool:
    """Version spans are contiguous half-open ranges covering [0, n)."""
    if spans.shape[0] == 0:
        return n == 0
    starts, ends = spans[:, 0], spans[:, 1]
    return bool(starts[0] == 0 and ends[-1] == n and np.all(ends >= starts) and np.all(starts[1:] == ends[:-1]))
