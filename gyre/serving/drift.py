"""Drift: where a reused prompt's ids disagree with a fresh tokenisation; and the facts
about a tokenizer's added tokens that TITO relies on.

Drift (the `drift` of `call.completed`): for an extension, the number of prompt positions
*outside the model-sampled completion spans* where the reused ids disagree with a fresh
`encode(render(request))`. Both sequences are aligned message by message (split after
every `<|im_end|>`), so a sampled span that re-tokenises to a different length shifts
nothing after it. Within a message chunk that holds sampled positions only the positions
before the first sampled one are compared (the template part `<|im_start|>assistant\\n`);
a chunk without sampled positions is compared in full, a length difference counting as
disagreement; an unpaired chunk counts all its unsampled positions. The template id just
before a sampled span does not count where the fresh tokenisation joined it with the span's
start (the header's "\n" and a completion opening with "\n" encode as one "\n\n" id): that
id holds sampled text. It is 0 for a BPE-stable template (every template boundary is a
special token, or a join of that kind). A branch is a fresh tokenisation, so its drift is 0.
`count_drift` counts it on a whole prompt.

Counted incrementally by `gyre.serving.tito.CallStore` with gyre's template, for a request
extending a call c: every rendered message starts right after a `<|im_end|>`, a special
token, and the tokenizer splits special tokens out before BPE, so
`encode(a + b) == encode(a) + encode(b)` whenever `a` ends with `<|im_end|>`. The request's
rendering is c's conversation cut after its last `<|im_end|>` followed by the suffix, and
its encoding splits the same way: the suffix region agrees by construction, and the
prefix chunks are c's prompt chunks (counted when c was matched: `c.drift`) plus c's last
turn — the generation prompt and c's completion (+ the closing `<|im_end|>`) against
`encode(render_assistant_turn(c.answer))`, counted once when c is recorded (after its
answer was delivered: `CallRecord.turn_drift`; when that turn is one chunk and its body
opens with an added token such as `<tool_call>` or `<think>`, only the ids before the
first sampled one count, and only the header up to that token is encoded). So
`drift = c.drift + that turn's count`, O(one turn). It equals the full-request count
(`CallStore.full_drift`, kept as the reference) except where a sampled span
re-tokenises to a different number of `<|im_end|>` chunks (the model wrote "<|im_end|>"
as plain text, or sampled `<|im_end|>` mid-completion): the full count then compares
every later message against the wrong one, the incremental one stays inside that message.

Tokenizer facts (HF tokenizers; none raises): `_special_tokens_split` (`<|im_end|>` is an
added token stripping no whitespace, so encoding splits at it), `_splitting_tokens` (the
added tokens encoding splits at exactly as written), `_im_end_stands_alone` (every written
`<|im_end|>` encodes as that token), `_opening_pattern` (a regex for the one such token
opening a text, where one can tell).
"""
from __future__ import annotations

import functools
import re
from collections.abc import Callable
from typing import Any

import numpy as np

from gyre.serving.tokenizer import IM_END, IM_END_TEXT


def _chunks(ids: np.ndarray) -> list[tuple[int, int]]:
    """[start, end) ranges split right after every <|im_end|>."""
    ends = (np.flatnonzero(ids == IM_END) + 1).tolist()
    if not ends or ends[-1] != len(ids):
        ends.append(len(ids))
    starts = [0, *ends[:-1]]
    return [(s, e) for s, e in zip(starts, ends) if e > s]


def count_drift(recorded: np.ndarray, sampled: np.ndarray, rendered: np.ndarray,
                joins: Callable[[int, int], bool] | None = None) -> int:
    """Prompt positions outside sampled spans where recorded and re-rendered ids disagree.

    recorded: (P,) int ids sent to the engine; sampled: (P,) bool, True where the model
    sampled the id; rendered: (R,) int, a fresh tokenisation of the rendered request.
    joins(r, f): True when id f's text is id r's text followed by more; with it, the
    template id just before a sampled span is not counted where the fresh tokenisation
    joined it with the span's first characters (a completion opening with "\n" after the
    header's "\n": one "\n\n" id), since that id then spans sampled text.
    Alignment and counting rules: module docstring ("Drift").
    """
    if len(recorded) == len(rendered) and np.array_equal(recorded, rendered):
        return 0  # the usual case: nothing disagrees, whatever was sampled
    rec_chunks, ren_chunks = _chunks(recorded), _chunks(rendered)
    drift = 0
    for i in range(max(len(rec_chunks), len(ren_chunks))):
        if i >= len(rec_chunks):
            s, e = ren_chunks[i]
            drift += e - s
            continue
        s, e = rec_chunks[i]
        mask = sampled[s:e]
        if i >= len(ren_chunks):
            drift += int((~mask).sum())
            continue
        a, b = recorded[s:e], rendered[ren_chunks[i][0]:ren_chunks[i][1]]
        hits = np.flatnonzero(mask)
        if len(hits):
            n = int(hits[0])
            m = min(n, len(b))
            drift += int((a[:m] != b[:m]).sum()) + (n - m)
            if joins is not None and 0 < n == m and a[n - 1] != b[n - 1] and joins(int(a[n - 1]), int(b[n - 1])):
                drift -= 1
        else:
            m = min(len(a), len(b))
            drift += int((a[:m] != b[:m]).sum()) + abs(len(a) - len(b))
    return drift


def _splitting_tokens(tokenizer: Any) -> tuple[str, ...]:
    """Texts of the tokenizer's added tokens that its encoding splits at exactly as written:
    matched on the raw text (not normalised, not only as a whole word) and stripping no
    neighbouring whitespace (`_special_tokens_split`). () when it lists none."""
    decoder = getattr(tokenizer, "added_tokens_decoder", None)
    if not isinstance(decoder, dict) or getattr(tokenizer, "split_special_tokens", False):
        return ()
    return tuple(str(t) for t in decoder.values()
                 if str(t) and not any(getattr(t, flag, True) for flag in ("lstrip", "rstrip", "single_word",
                                                                          "normalized")))


@functools.lru_cache(maxsize=8)
def _opening_pattern(tokens: tuple[str, ...]) -> re.Pattern | None:
    """A regex matching any of `tokens` where none is a prefix of another (then at most one
    matches at a position), else None."""
    if any(a != b and b.startswith(a) for a in tokens for b in tokens):
        return None
    return re.compile("|".join(map(re.escape, tokens)))


def _im_end_stands_alone(tokenizer: Any, splitting: tuple[str, ...]) -> bool:
    """True when every written `<|im_end|>` encodes as that token: it splits as written
    (it is in `splitting`, the tokenizer's `_splitting_tokens`) and no other added token can
    match over it (added tokens match leftmost, then longest): none holds it, and none ends
    with a proper prefix of it."""
    if IM_END_TEXT not in splitting:
        return False
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    heads = tuple(IM_END_TEXT[:k] for k in range(1, len(IM_END_TEXT)))
    return not any(t != IM_END_TEXT and (IM_END_TEXT in t or t.endswith(heads)) for t in map(str, decoder.values()))


def _special_tokens_split(tokenizer: Any) -> bool:
    """True when `<|im_end|>` is an added token that strips no neighbouring whitespace, so
    encoding splits at it (incremental drift relies on `encode(a + b) == encode(a) + encode(b)`
    for `a` ending with it)."""
    decoder = getattr(tokenizer, "added_tokens_decoder", None)
    token = decoder.get(IM_END) if isinstance(decoder, dict) else None
    return token is not None and str(token) == IM_END_TEXT and not getattr(token, "lstrip", True) \
        and not getattr(token, "rstrip", True)
