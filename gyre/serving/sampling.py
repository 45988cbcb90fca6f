"""Drawing the next token: the embedded engine's sampler (`gyre.serving.engine`).

Behaviour log-probs are of the temperature-scaled distribution *before* top-p/top-k
truncation (DESIGN.md "Learning"); greedy below `schemas.call.GREEDY_BELOW`, as SGLang.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from schemas.call import GREEDY_BELOW

if TYPE_CHECKING:
    from gyre.serving.request import SamplingParams


def sample_token(logits: torch.Tensor, sp: SamplingParams, generator: torch.Generator) -> tuple[int, float]:
    """Draws the next id from `logits: (V,) float32`.

    Returns (id, behaviour log-prob) where the log-prob is log_softmax(logits / T)[id],
    i.e. before top-k/top-p truncation; for T below `schemas.call.GREEDY_BELOW` (0 among
    them) the id is argmax and the log-prob is under T = 1, as SGLang does. Truncation:
    keep the k most likely ids, renormalise, then keep the smallest prefix (by descending
    probability) whose mass reaches top_p (always >= 1 id).
    """
    if sp.temperature < GREEDY_BELOW:  # greedy, as SGLang samples T below it
        token = int(torch.argmax(logits))
        return token, float(torch.log_softmax(logits, dim=-1)[token])
    logp = torch.log_softmax(logits / sp.temperature, dim=-1)  # (V,)
    probs = logp.exp()
    vocab = probs.shape[-1]
    k = sp.top_k if 0 < sp.top_k < vocab else vocab
    if k == vocab and sp.top_p >= 1.0:
        token = int(torch.multinomial(probs, 1, generator=generator))
    else:
        if k < vocab:
            top, idx = torch.topk(probs, k)  # sorted descending
        else:
            top, idx = torch.sort(probs, descending=True)
        kept = top * nucleus_mask(top, sp.top_p)
        token = int(idx[int(torch.multinomial(kept, 1, generator=generator))])
    return token, float(logp[token])


def nucleus_mask(sorted_probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """(N,) bool: which of `sorted_probs` (descending, any positive scale) top-p keeps.

    An id is kept when the renormalised mass strictly before it is < top_p (Holtzman et
    al. 2020, nucleus sampling); the most likely id is always kept.
    """
    p = sorted_probs / sorted_probs.sum()
    before = torch.cumsum(p, dim=-1) - p
    keep = before < top_p
    keep[0] = True
    return keep
