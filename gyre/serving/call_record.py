"""A served call as the TITO store keeps it (`gyre.serving.tito.CallStore`), and the walks
over its chain of parents.

Memory: a call stores only the ids after its prefix (`own_ids`, int32) and a reference to
its parent, so an execution of N calls over L tokens keeps O(L) ids, not O(N·L).
`CallRecord.full_ids`, `segments`, `sampled_mask` and `sampled_range` rebuild a call's ids
and sampled positions from that chain; `_shared_len` (the common token prefix with a prompt,
memoised across the leaves of a tree) and `_last_im_end_before` walk it without building it.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from gyre.serving.tokenizer import IM_END


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class CallRecord:
    """One served call of an execution.

    call: call id. seq: order in the execution. parent/prefix_len: this call's full ids
    are `parent.full_ids()[:prefix_len] + own_ids` (parent None ⇒ prefix_len 0).
    own_ids: (N,) int32, the new prompt ids after the prefix followed by the completion.
    completion_len: C, the trailing ids of own_ids the model sampled (stop token included).
    messages: normalised request messages (shared with the parent's where reused).
    tools: normalised tools. answer: the assistant message returned to the harness
    (normalised; tool-call arguments are the raw payload the model emitted).
    drift: the drift of this call's prompt (`gyre.serving.drift`). conv_query / conv_shown:
    facts of `messages + [answer]` in gyre's template (a real user query is present; an
    assistant after the last one shows reasoning). turn_start: index in `full_ids()` of
    the last prompt turn (right after the prompt's last `<|im_end|>`). turn_drift: that
    turn's drift as every extension of this call reuses it, against
    `encode(render_assistant_turn(answer))` (`gyre.serving.tito.CallStore._turn_drift`; 0 when drift is not
    counted or the template is not gyre's).
    """

    call: str
    seq: int
    parent: CallRecord | None
    prefix_len: int
    own_ids: np.ndarray
    completion_len: int
    messages: tuple[dict, ...]
    tools: tuple[dict, ...]
    answer: dict
    conv_key: bytes
    drift: int = 0
    conv_query: bool = False
    conv_shown: bool = False
    turn_start: int = 0
    turn_drift: int = 0

    @property
    def full_len(self) -> int:
        return self.prefix_len + len(self.own_ids)

    @property
    def prompt_len(self) -> int:
        return self.full_len - self.completion_len

    @property
    def stopped(self) -> bool:
        """True when the completion ended with `<|im_end|>` (the template's turn end)."""
        return self.completion_len > 0 and int(self.own_ids[-1]) == IM_END

    def segments(self, limit: int | None = None) -> list[np.ndarray]:
        """Views whose concatenation is `full_ids()[:limit]`, root first."""
        limit = self.full_len if limit is None else min(limit, self.full_len)
        out: list[np.ndarray] = []
        rec: CallRecord | None = self
        while rec is not None and limit > 0:
            if limit > rec.prefix_len:
                out.append(rec.own_ids[: limit - rec.prefix_len])
                limit = rec.prefix_len
            rec = rec.parent
        out.reverse()
        return out

    def full_ids(self) -> np.ndarray:
        """(L,) int32: prompt ids + completion ids."""
        segs = self.segments()
        return np.concatenate(segs) if segs else np.zeros(0, np.int32)

    def sampled_range(self, start: int, end: int) -> np.ndarray:
        """(end - start,) bool: `sampled_mask(end)[start:]`, walking only the calls whose
        completions can reach past `start`."""
        mask = np.zeros(end - start, bool)
        limit = min(end, self.full_len)
        rec: CallRecord | None = self
        while rec is not None and limit > start:
            lo = max(rec.full_len - rec.completion_len, start)
            hi = min(limit, rec.full_len)
            if lo < hi:
                mask[lo - start:hi - start] = True
            limit = min(limit, rec.prefix_len)
            rec = rec.parent
        return mask

    def sampled_mask(self, length: int) -> np.ndarray:
        """(length,) bool: positions of `full_ids()[:length]` sampled by the model (in
        this call or an ancestor whose ids it reuses)."""
        mask = np.zeros(length, bool)
        limit = min(length, self.full_len)
        rec: CallRecord | None = self
        while rec is not None and limit > 0:
            start = rec.full_len - rec.completion_len
            if start < limit:
                mask[start:min(limit, rec.full_len)] = True
            limit = min(limit, rec.prefix_len)
            rec = rec.parent
        return mask


def _shared_len(rec: CallRecord, ids: np.ndarray, memo: dict[str, int]) -> int:
    """Length of the common prefix of `rec.full_ids()` and `ids` (P,), from its ancestors':
    rec's full ids are its parent's first `prefix_len` then `own_ids`, so only `own_ids` is
    compared, and only when the parent's share covers the prefix. memo: call → that length
    for the calls seen so far (filled here), so calls sharing ancestors compare them once:
    O(records + shared ids) for all the leaves of a tree, not O(leaves × prompt)."""
    chain: list[CallRecord] = []
    r: CallRecord | None = rec
    while r is not None and r.call not in memo:
        chain.append(r)
        r = r.parent
    n = memo[r.call] if r is not None else 0
    for c in reversed(chain):
        if n >= c.prefix_len:
            n = c.prefix_len
            m = min(len(c.own_ids), len(ids) - n)
            if m > 0:
                eq = c.own_ids[:m] == ids[n:n + m]
                n += m if eq.all() else int(np.argmin(eq))
        memo[c.call] = n
    return n


def _last_im_end_before(rec: CallRecord, limit: int) -> int:
    """Index of the last <|im_end|> in `rec.full_ids()[:limit]`, -1 when there is none."""
    r: CallRecord | None = rec
    limit = min(limit, rec.full_len)
    while r is not None and limit > 0:
        if limit > r.prefix_len:
            hits = np.flatnonzero(r.own_ids[: limit - r.prefix_len] == IM_END)
            if len(hits):
                return r.prefix_len + int(hits[-1])
            limit = r.prefix_len
        r = r.parent
    return -1
