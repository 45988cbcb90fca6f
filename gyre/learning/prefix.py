"""Shared prefixes of a micro-step's trajectories, run once (DESIGN.md "Trajectory processing").

- `prefix_forest(seqs, min_shared)` groups token sequences into tries whose long common
  prefixes become nodes of their own (the trainer runs each node once on a copy of its
  parent's KV cache).
- `branch_cache(past)` is that copy; `enable_prefix_attention(model)` switches a model's
  attention to one that lets a branch attend to its cached prefix without a (q, kv) mask.
Used by gyre.learning.trainer.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import torch

from gyre.trajectory.microstep import common_prefix


@dataclasses.dataclass(slots=True, eq=False)
class PrefixNode:
    """One segment of the trie over a micro-step's cut sequences.

    start, end: token positions [start, end) this node runs (its context [0, start) comes
    from its parent's KV cache). rows: the trajectories (indices into the list given to
    `prefix_forest`) whose sequence passes through the segment, in lexicographic order of
    their sequences. children: nodes continuing after `end`; none for a leaf, whose single
    row ends at `end`.
    """

    start: int
    end: int
    rows: list[int]
    children: list[PrefixNode] = dataclasses.field(default_factory=list)

    def positions(self) -> int:
        """Decoder positions run for the whole subtree."""
        return self.end - self.start + sum(c.positions() for c in self.children)


def prefix_forest(seqs: list[np.ndarray], min_shared: int) -> list[PrefixNode]:
    """Group token sequences into tries that run each long shared prefix once.

    seqs: (L_r,) non-negative int arrays. A prefix common to ≥ 2 sequences becomes a node of
    its own only when it adds ≥ min_shared (≥ 1) positions beyond its parent node; shorter
    common runs stay inside each branch (recomputed). Returns the roots, ordered by their
    smallest row: a root without children is a lone sequence run from position 0.
    Σ root.positions() ≤ Σ L_r, with equality when nothing is shared.
    """
    if min_shared < 1:
        raise ValueError(f"min_shared must be >= 1, got {min_shared}")
    n = len(seqs)
    order = sorted(range(n), key=lambda r: np.asarray(seqs[r], dtype=">i8").tobytes())
    lcp = [0] + [common_prefix(seqs[order[j - 1]], seqs[order[j]]) for j in range(1, n)]

    def build(lo: int, hi: int, ctx: int) -> list[PrefixNode]:
        if hi - lo == 1:
            return [PrefixNode(ctx, len(seqs[order[lo]]), [order[lo]])]
        p = min(lcp[lo + 1:hi])  # common prefix of order[lo:hi]
        cuts = [lo] + [j for j in range(lo + 1, hi) if lcp[j] == p] + [hi]
        start = p if p - ctx >= min_shared else ctx
        kids = [node for s, e in zip(cuts, cuts[1:]) for node in build(s, e, start)]
        if start == ctx:
            return kids
        return [PrefixNode(ctx, p, list(order[lo:hi]), kids)]

    return sorted(build(0, n, 0), key=lambda node: min(node.rows)) if n else []


def branch_cache(past):
    """A fresh DynamicCache holding copies of `past` [(k, v) per layer] (None → None), so a
    branch appending to it leaves its parent's tensors as they are."""
    if past is None:
        return None
    from transformers import DynamicCache

    return DynamicCache(ddp_cache_data=past)


class _CachedPrefixAttention(torch.autograd.Function):
    """softmax(q·[k_p; k_s]ᵀ·scale + causal mask on the k_s block)·[v_p; v_s] on CPU.

    q, k_s, v_s: (B, H, S, D) — the branch; k_p, v_p: (B, H, P, D) — its cached prefix,
    which every query sees. Two flash-attention calls (prefix block full, branch block
    causal) merged by log-sum-exp: o = Σ_b exp(lse_b − lse)·o_b, lse = logaddexp(lse_p, lse_s).
    The backward of each block is the flash backward given the merged o and lse (then
    exp(s − lse) are the true probabilities and rowsum(dO∘o) the true correction), dq summed.
    """

    @staticmethod
    def forward(ctx, q, k_p, v_p, k_s, v_s, scale):
        flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        o_p, lse_p = flash(q, k_p, v_p, 0.0, False, scale=scale)
        o_s, lse_s = flash(q, k_s, v_s, 0.0, True, scale=scale)
        lse = torch.logaddexp(lse_p, lse_s)  # (B, H, S)
        out = o_p * torch.exp(lse_p - lse).unsqueeze(-1) + o_s * torch.exp(lse_s - lse).unsqueeze(-1)
        ctx.save_for_backward(q, k_p, v_p, k_s, v_s, out, lse)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k_p, v_p, k_s, v_s, out, lse = ctx.saved_tensors
        flash_bwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
        g = grad_out.contiguous()
        dq_p, dk_p, dv_p = flash_bwd(g, q, k_p, v_p, out, lse, 0.0, False, scale=ctx.scale)
        dq_s, dk_s, dv_s = flash_bwd(g, q, k_s, v_s, out, lse, 0.0, True, scale=ctx.scale)
        return dq_p + dq_s, dk_p, dv_p, dk_s, dv_s, None


def _prefix_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """transformers attention function (`AttentionInterface`): SDPA, except for a query block
    continuing a cached prefix (kv longer than q, no mask), which attends to the whole prefix
    and causally to itself. query (B, H, S, D), key/value (B, H_kv, P + S, D); returns
    ((B, S, H, D), None) like `sdpa_attention_forward`."""
    from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward

    q_len, kv_len = query.shape[2], key.shape[2]
    if kv_len == q_len or attention_mask is not None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    if dropout or kwargs.get("sliding_window") is not None:
        raise ValueError("cached-prefix attention supports neither attention dropout nor sliding windows")
    n_rep = getattr(module, "num_key_value_groups", 1)
    key, value = repeat_kv(key, n_rep), repeat_kv(value, n_rep)
    p = kv_len - q_len
    if query.device.type == "cpu":
        out = _CachedPrefixAttention.apply(query, key[:, :, :p], value[:, :, :p], key[:, :, p:], value[:, :, p:], scaling)
    else:
        from torch.nn.attention.bias import causal_lower_right
        out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=causal_lower_right(q_len, kv_len),
                                                               scale=scaling)
    return out.transpose(1, 2).contiguous(), None


_ATTENTION = "gyre_cached_prefix_sdpa"


def enable_prefix_attention(model) -> bool:
    """Switch `model` to `_prefix_attention` when its attention allows it (SDPA, full attention
    on every layer, no attention dropout); returns whether it did."""
    from transformers import AttentionInterface

    cfg = model.config
    layer_types = getattr(cfg, "layer_types", None) or ["full_attention"]
    if (cfg._attn_implementation != "sdpa" or any(t != "full_attention" for t in layer_types)
            or getattr(cfg, "use_sliding_window", False) or getattr(cfg, "attention_dropout", 0.0)):
        return False
    AttentionInterface.register(_ATTENTION, _prefix_attention)
    model.set_attn_implementation(_ATTENTION)
    return model.config._attn_implementation == _ATTENTION
