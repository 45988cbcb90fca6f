"""Request bodies that resend a history, parsed only where they are new.

A harness resends its whole conversation on every call: after 50 calls of a bench
execution a 57-KB body, after an hour of an agent's rollout ~4 MB for ~1M tokens. Parsing
that whole body (`orjson.loads`: ≈ 70 µs for 57 KB here, 9–18 ms at 680k tokens) and then
comparing the parsed history with the previous request's (`gyre.serving.tito`, `MessageMemo`: a
walk over cold objects) costs O(history) on the event loop for every call.

Contract: `BodyMemo.loads(raw, field)` returns what `orjson.loads(raw)` returns (equal
values; raises `orjson.JSONDecodeError` the same way), where `field` names the top-level
array that holds the history (`messages`; Responses' `input`). When `raw` begins with the
bytes of an earlier body of the execution through the end of its array's element j, and
after its array ends with that body's bytes (the other fields unchanged), then:
- elements 0..j are that body's parsed objects (the same objects, so the comparisons
  downstream are identity checks in C), and only the new elements are parsed;
- the other top-level values are that body's (the same objects).
Equal bytes parse to equal values, so this is exact; anything else (a first call, a body
whose bytes differ before the array or after it, an array holding a number or a literal,
a field that is missing, not an array, or present twice, more than `MAX_ITEMS` elements)
is parsed whole. Each of the latest bodies sharing bytes is tried, most shared first, so
two lines that differ only after the array (one streams, one does not) keep their own.

The byte layout of a body (where the array starts, where each element ends, where the
array closes) comes from the parsed elements' compact JSON when that is what the bytes are
(orjson's, and JavaScript's `JSON.stringify`, as Claude Code sends: one `orjson.dumps`
and one memcmp), else from regular expressions that match one whole JSON value each (a
string with its escapes; an object or array with balanced brackets, strings matched whole,
at most `MAX_DEPTH` deep: in C, one Python step per top-level key and per element). A body
parsed whole gets its layout once, when a later body is first compared with it, from the
element it shared with an earlier body on; an extension finds only its new elements' ends.
Callers must not mutate what `loads` returns (the objects are shared with later bodies).

Cost (`handlers/bench/probes/resent_history_cost.py`, a Claude Code-shaped history): at 600k tokens (2.7 MB)
≈ 0.5 ms to read an extension's body, against ≈ 3 ms parsed whole. Memory: the latest
`size` bodies' bytes (a ~1M-token execution's main line: ≈ 4 MB; more while lines that
differ after the array coexist) beside the parsed objects the execution's memos keep
anyway; freed with the execution (`execution.finished`).
"""
from __future__ import annotations

import bisect
import dataclasses
import re
from typing import Any

import numpy as np
import orjson

_STRING = rb'"[^"\\]*+(?:\\.[^"\\]*+)*+"'
"""A JSON string, escapes included."""
MAX_DEPTH = 24
"""Deepest nesting of an array element that is matched (deeper: the body is parsed whole)."""
MAX_ITEMS = 65_536
"""Most elements, and top-level keys, a layout is found for: one Python step each, so a
hostile body of tiny elements cannot hold the event loop for long (such a body is parsed
whole instead)."""


def _container(depth: int) -> bytes:
    """An object or array nested at most `depth` deep, its brackets balanced. In valid JSON
    it ends exactly at the bracket that closes its first one (strings are matched whole,
    so brackets inside them are never seen)."""
    inner = _STRING + rb"|[^\"{}\[\]]++" + (b"|" + _container(depth - 1) if depth > 1 else b"")
    return rb"[{\[](?:" + inner + rb")*+[}\]]"


_WS = rb"[ \t\n\r]*+"
_ITEM = re.compile(_WS + b"(" + _STRING + b"|" + _container(MAX_DEPTH) + b")" + _WS + rb"([,\]])")
"""One array element that ends itself (a string, object or array), then `,` or `]`."""
_KEY = re.compile(_WS + b"(" + _STRING + b")" + _WS + b":" + _WS)
_VALUE = re.compile(b"(?:" + _STRING + b"|" + _container(MAX_DEPTH) + rb"|[-+.0-9a-zA-Z]++)" + _WS + rb"([,}])")
"""A top-level value (scalars included), then `,` or `}`."""
_AFTER_ARRAY = re.compile(rb"\]" + _WS + rb"([,}])")
_OPEN_OBJECT = re.compile(_WS + rb"\{" + _WS)
_SPACES = re.compile(_WS)
_COMMA, _BRACKET = ord(","), ord("]")


@dataclasses.dataclass(slots=True)
class _Layout:
    """Where a body's history array lies: `start` right after its `[`, `ends[i]` right
    after element i's closing `}` or `"` (strictly increasing), `close` at its `]`."""

    start: int
    ends: list[int]
    close: int


@dataclasses.dataclass(slots=True, eq=False)
class _Body:
    raw: bytes
    field: str
    body: dict
    layout: _Layout | None = None
    scanned: bool = False  # layout looked for (None then: this body cannot be reused)
    seed: tuple[_Layout, int] | None = None
    """(an earlier body's layout, j) when `raw` begins with that body's bytes through its
    element j: the layout is then found from element j on."""

    def layout_of(self) -> _Layout | None:
        if not self.scanned:
            self.layout = _layout(self.raw, self.field, self.body[self.field], self.seed)
            self.scanned, self.seed = True, None
        return self.layout


def _elements(raw: bytes, pos: int) -> tuple[list[int], int] | None:
    """Scan the elements of an array from `pos` (where its first element, or the one after
    a `,`, begins; whitespace allowed) to its closing `]`: (the end of each, the index of the
    `]`). None unless there are 1 to `MAX_ITEMS` elements, each an object, array or string
    (ends that are self-delimiting) nested at most `MAX_DEPTH` deep."""
    ends: list[int] = []
    while len(ends) < MAX_ITEMS and (m := _ITEM.match(raw, pos)):
        ends.append(m.end(1))
        if m.group(2) == b"]":
            return ends, m.start(2)
        pos = m.end()
    return None


def _rest(raw: bytes, pos: int, items: list, first: bool) -> tuple[list[int], int] | None:
    """(ends, close) of an array's elements `items` (parsed) from `pos` on: right after its
    `[` (`first`) or right after an element. Their compact JSON when that is what the bytes
    are (orjson's, JavaScript's `JSON.stringify`: one memcmp), else scanned (`_elements`).
    None when the bytes are not those elements (see `_elements` for which can be found)."""
    pos = _SPACES.match(raw, pos).end()
    if pos >= len(raw):
        return None
    if raw[pos] == _BRACKET:
        return ([], pos) if not items else None
    if not first:
        if raw[pos] != _COMMA:
            return None
        pos += 1
    if not items or len(items) > MAX_ITEMS or not all(type(e) in (dict, list, str) for e in items):
        return None
    try:
        parts = [orjson.dumps(e) for e in items]
    except orjson.JSONEncodeError:  # nested deeper than orjson writes
        return None
    text = b",".join(parts)
    close = pos + len(text)
    if raw[close:close + 1] == b"]" and raw.startswith(text, pos):
        ends, at = [], pos
        for part in parts:
            at += len(part)
            ends.append(at)
            at += 1
        return ends, close
    got = _elements(raw, pos)
    return got if got is not None and len(got[0]) == len(items) else None


def _layout(raw: bytes, field: str, items: list, seed: tuple[_Layout, int] | None = None) -> _Layout | None:
    """The layout of `field`'s array in the JSON object `raw` (already parsed: valid;
    `items` that array as parsed), or None unless it is the only top-level key that decodes
    to `field` and `_rest` finds its elements. seed: see `_Body.seed` (the bytes through
    element j are that body's, so its layout holds there: only the rest is scanned)."""
    found: _Layout | None = None
    if seed is not None:
        lay, j = seed
        got = _rest(raw, lay.ends[j], items[j + 1:], first=False)
        if got is None:
            return None
        found = _Layout(lay.start, lay.ends[:j + 1] + got[0], got[1])
        m = _AFTER_ARRAY.match(raw, got[1])
        if m is None:
            return None
        if m.group(1) == b"}":
            return found
        pos = m.end()
    else:
        m = _OPEN_OBJECT.match(raw)
        if m is None or raw[m.end():m.end() + 1] == b"}":
            return None
        pos = m.end()
    keys = 0
    while keys < MAX_ITEMS and (key := _KEY.match(raw, pos)):
        keys += 1
        pos = key.end()
        if orjson.loads(key.group(1)) == field:
            if found is not None or raw[pos:pos + 1] != b"[":
                return None
            got = _rest(raw, pos + 1, items, first=True)
            if got is None:
                return None
            found = _Layout(pos + 1, *got)
            m = _AFTER_ARRAY.match(raw, got[1])
        else:
            m = _VALUE.match(raw, pos)
        if m is None:
            return None
        if m.group(1) == b"}":
            return found
        pos = m.end()
    return None


class BodyMemo:
    """One execution's latest request bodies (module docstring). Not thread-safe: one
    event loop's."""

    def __init__(self, size: int = 4):
        self.size = size
        self._bodies: list[_Body] = []  # newest first
        self.reused = 0
        """Bodies parsed only in part (a counter for tests and diagnosis)."""

    def loads(self, raw: bytes, field: str, remember: bool = True) -> Any:
        """`orjson.loads(raw)`, reusing an earlier body's parsed history (module docstring).
        raw: the request body (bytes, decompressed); remember=False: the body is not kept
        as a latest one (a token count). Raises orjson.JSONDecodeError."""
        shared: list[tuple[int, int, _Body]] = []  # (-j, age, body): raw has its bytes through element j
        for age, old in enumerate(self._bodies):
            if old.field == field and (lay := old.layout_of()) is not None and lay.ends:
                j = _shared(raw, old.raw, lay.ends)
                if j >= 0:
                    shared.append((-j, age, old))
        shared.sort()
        for neg_j, _, old in shared:  # the most shared first; one whose other fields changed, the next
            entry = _extend(raw, old, -neg_j)
            if entry is not None:
                self.reused += 1
                if not remember:
                    return entry.body
                self._bodies.remove(old)  # this line's tip moves on
                break
        else:
            body = orjson.loads(raw)
            if not (isinstance(body, dict) and isinstance(body.get(field), list)):
                return body  # not a history (an error for the caller to name): nothing to keep
            if not remember:
                return body
            entry = _Body(raw, field, body, seed=(shared[0][2].layout, -shared[0][0]) if shared else None)
        self._bodies.insert(0, entry)
        del self._bodies[self.size:]
        return entry.body


def _extend(raw: bytes, old: _Body, j: int) -> _Body | None:
    """`raw` as `old`'s elements 0..j plus new elements, or None when it is not that: `raw`
    is old's bytes through element j, then `,` and values (parsed here) or nothing, then
    old's bytes from its array's `]` on (the JSON grammar reads that one way only)."""
    lay = old.layout
    close = len(raw) - (len(old.raw) - lay.close)  # where old's `]` and what follows would start
    if close < lay.ends[j] or not raw.startswith(memoryview(old.raw)[lay.close:], close):
        return None  # the fields after the array changed
    pos = _SPACES.match(raw, lay.ends[j]).end()
    if pos == close:
        new: list = []
        ends: list[int] = []
    else:
        if raw[pos] != _COMMA:
            return None
        try:  # inside an object and an array, as in the body: orjson's nesting limit counts the same
            new = orjson.loads(b'{"":[' + raw[pos + 1:close] + b"]}")[""]
        except orjson.JSONDecodeError:
            return None  # parsed whole: the error names its place in the body
        got = _rest(raw, pos, new, first=False)
        if got is None or got[1] != close:
            return None
        ends = got[0]
    body = dict(old.body)
    body[old.field] = old.body[old.field][:j + 1] + new
    return _Body(raw, old.field, body, _Layout(lay.start, lay.ends[:j + 1] + ends, close), scanned=True)


def _shared(raw: bytes, old: bytes, ends: list[int]) -> int:
    """The last element of `old` whose bytes (and all before it) `raw` begins with; -1: none.
    The last few are tried first (an extension; Claude Code's moved cache marker), then the
    first differing byte is found a 64-KB memcmp at a time."""
    view = memoryview(old)
    for j in range(len(ends) - 1, max(len(ends) - 4, -1), -1):
        if raw.startswith(view[:ends[j]]):
            return j
    n = min(len(raw), ends[-1])
    first = 0
    while first < n:
        hi = min(first + (1 << 16), n)
        if not raw.startswith(view[first:hi], first):
            first += int(np.argmax(np.frombuffer(raw, np.uint8, hi - first, first)
                                   != np.frombuffer(old, np.uint8, hi - first, first)))
            break
        first = hi
    return bisect.bisect_right(ends, first) - 1
